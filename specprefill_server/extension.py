"""The SpecPrefill extension every API shares: the request's extra body fields (the draft
model and every generate option the API has no name for, ``extra_body={"keep": 0.2}`` in
the SDKs) and the reply's ``specprefill`` object (what SpecPrefill did for the answer)."""
from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, create_model

from jobs.results import GenerateResult
from jobs.spec import option_names

# Phases before the first token, in the order they run (GenerateResult.timings keys), for
# results of workers that do not report ``ttft_phases`` themselves.
TTFT_PHASES = ("load_models", "tokenize", "draft_scoring", "selection", "target_prefill")

# Fields of OpenAI's own that carry a generate job's options (each API's convert.py maps its own names).
OPENAI_OPTIONS = frozenset({"max_tokens", "temperature", "top_p", "seed", "stop"})
# The SpecPrefill knobs a request may set as extra body fields (unset: the deployment's
# settings): the draft model and every option of a generate job (jobs.spec.option_names)
# OpenAI has no name for. Typed Any: the job spec checks each (its error names the field).
SPECPREFILL_FIELDS = ("draft_model", *(n for n in option_names("generate") if n not in OPENAI_OPTIONS))
SpecPrefillOptions = create_model(
    "SpecPrefillOptions", __config__=ConfigDict(extra="forbid"),
    **{name: (Any, None) for name in SPECPREFILL_FIELDS})


def job_fields(req: Any, **named: Any) -> dict[str, Any]:
    """A request's SpecPrefill extra fields and the job fields its API names (``target_model``,
    ``max_tokens``, ...), the unset ones left to the service's defaults."""
    fields: dict[str, Any] = {name: getattr(req, name) for name in SPECPREFILL_FIELDS}
    fields.update(named)
    return {k: v for k, v in fields.items() if v is not None}


def specprefill_info(result: GenerateResult) -> dict[str, Any]:
    """What SpecPrefill did for this answer: kept share, block-store tokens, TTFT by phase."""
    return {
        "job_id": result.job_id,
        "kept_ratio": round(result.ratio, 6),  # of the tokens not restored (what was selected over)
        "restored_ratio": round(result.restored_ratio, 6),
        "kept_tokens": result.kept,
        "prompt_tokens": result.total,
        "cached_tokens": result.cached_tokens,
        "memo_hit": result.memo_hit,
        "protected_prefix": result.protected_prefix,
        "full_prefill": result.full_prefill,
        "reason": result.reason,
        "keep_effect": result.keep_effect,  # why more was kept than keep asked for, if it was
        "fallback": result.fallback,
        "target_tokens": dict(result.target_tokens),
        "heal": dict(result.heal or {}),  # this turn's heal job (queued, its id) or why none
        "ttft_s": result.ttft_s,
        "ttft_phases_s": dict(result.ttft_phases) or {p: result.timings[p] for p in TTFT_PHASES
                                                      if p in result.timings},
        "draft_phases_s": dict(result.draft_timings),
    }
