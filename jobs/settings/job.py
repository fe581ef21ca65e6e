"""The settings of a job itself: what it is when it says nothing (the SpecPrefill defaults), at
most (its limits), and how long it and its result live. Read where a job is built (a client, the
HTTP server) and again where it runs (a worker checks every payload against its own)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from jobs.settings.check import Bounds, SettingsError
from specprefill.options import ScoringOptions, SelectionOptions

# The settings named by option fields: setting (and SPECPREFILL_<NAME>) -> (group, field).
OPTION_GROUPS = {"scoring": ScoringOptions, "selection": SelectionOptions}
OPTION_SETTINGS = {f.name: (group, f.name) for group, cls in OPTION_GROUPS.items() for f in fields(cls)}


@dataclass(frozen=True)
class JobSettings:
    """A job's defaults, limits and lifetimes, the same on both sides of the queue."""

    scoring: ScoringOptions = field(default_factory=ScoringOptions)
    """How the draft scores a prompt, for every job that does not say (specprefill/options.py);
    each field is a setting of its own name (``SPECPREFILL_N_LOOKAHEAD``, and
    ``SPECPREFILL_TEMPERATURE`` / ``_TOP_P`` / ``_SEED`` / ``_GREEDY`` for the lookahead)."""
    selection: SelectionOptions = field(default_factory=SelectionOptions)
    """Which chunks the target prefills, for every job that does not say; each field is a
    setting of its own name (``SPECPREFILL_KEEP``, ``SPECPREFILL_THRESHOLD``, ...)."""
    max_prompt_tokens: int = 131072
    """The longest prompt a job may have, in tokens."""
    max_batch_documents: int = 10000
    """The most documents one batch may hold."""
    max_generate_tokens: int = 4096
    """The most tokens a generate job may ask for (``max_tokens``)."""
    job_timeout_s: int = 1800
    """How long a job may run before RQ stops it."""
    result_ttl_s: int = 24 * 3600
    """How long a finished job's result is kept (and the HTTP Batch API's files)."""
    failure_ttl_s: int = 7 * 24 * 3600
    """How long a failed job and its error are kept."""
    retry_max: int = 3
    """How often a job whose attempt failed or whose worker died is tried again."""


RANGES: dict[str, Bounds] = {
    "max_prompt_tokens": (1, None), "max_batch_documents": (1, None), "max_generate_tokens": (1, None),
    "job_timeout_s": (1, None), "result_ttl_s": (1, None), "failure_ttl_s": (1, None), "retry_max": (0, 100),
}


def check(settings: JobSettings) -> None:
    for group, cls in OPTION_GROUPS.items():
        if not isinstance(getattr(settings, group), cls):
            raise SettingsError(f"setting {group}: expected {cls.__name__}, got "
                                f"{type(getattr(settings, group)).__name__}", group)
