"""The result of a prefill or generate job, as returned by the worker and stored by RQ (JSON).

Both kinds share :class:`JobResult`: the draft's selection (kept ranges, counts, the
protected prefix, block-store use), the timings, and what the job page shows (the
importance downsampled, the kept text). Kept token indices travel as
half-open ``[start, end)`` ranges: a 128K-token prompt with 20% kept in 32-token chunks is
a few hundred pairs instead of 26K integers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

RESULT_VERSION = 1


@dataclass
class KeptSpan:
    """One kept range with its text (only when the spec asked for spans)."""

    start: int
    end: int
    text: str


@dataclass
class ImportanceCurve:
    """The draft's importance downsampled to a bounded size: ``max[i]`` is the largest
    importance of token positions ``[i * tokens_per_bin, (i + 1) * tokens_per_bin)`` (the
    last bin may be shorter), so a token that mattered is never averaged away."""

    tokens_per_bin: int
    max: list[float]

    @classmethod
    def of(cls, importance: Any, max_points: int) -> "ImportanceCurve":
        """The curve of per-token ``importance`` (a sequence or array) in at most ``max_points`` bins."""
        import numpy as np

        values = np.asarray(importance, dtype=np.float64).reshape(-1)
        per_bin = max(1, -(-values.size // max(1, max_points)))
        padded = np.full(-(-values.size // per_bin) * per_bin, -np.inf)
        padded[:values.size] = values
        return cls(per_bin, [float(v) for v in padded.reshape(-1, per_bin).max(axis=1)])


@dataclass(kw_only=True)
class JobResult:
    """What every job returns about the prompt: the selection and how long each phase took.

    ``reason`` is set when nothing was dropped (and why); ``protected_prefix`` is the
    length of the chat system block that was always kept.
    """

    job_id: str
    kept: int
    total: int
    reason: str | None = None
    # Why more was kept than ``keep`` asked for (threshold, tail, protected prefix), else None.
    keep_effect: str | None = None
    kept_ranges: list[tuple[int, int]] = field(default_factory=list)
    protected_prefix: int = 0
    # First token of the mandatory tail the selection kept (None: nothing was dropped, or a
    # result from before this field).
    tail_start: int | None = None
    cached_tokens: int = 0          # draft prompt tokens restored from the block store
    blocks_written: int = 0
    memo_hit: bool = False
    boundary_reason: str | None = None  # why protected_prefix is 0 (no system block, a failed render)
    fallback: str | None = None     # why the draft's part was skipped after a failure
    timings: dict[str, float] = field(default_factory=dict)        # seconds per phase
    tokens_per_s: dict[str, float] = field(default_factory=dict)   # per phase
    draft_name: str = ""            # the draft model as the job named it ("draft": the default)
    # Said about the prompt without failing the job (e.g. many unknown tokens).
    warnings: list[str] = field(default_factory=list)
    # What the job page shows, kept when the job runs (the page never runs a model). The
    # layout of the prompt is these fields with kept_ranges, protected_prefix, tail_start and
    # the target's restored tokens, read by one function (jobs.contract.layout.regions).
    # The draft's importance, downsampled (None: the draft did not score this prompt).
    importance_curve: ImportanceCurve | None = None
    # Text of each kept range: when the spec asked (return_spans), else when the kept tokens
    # are at most Settings.page_text_tokens (None: neither).
    spans: list[KeptSpan] | None = None
    # Ranges of the restored prefix whose blocks a heal job prefilled (empty: none healed).
    healed_ranges: list[tuple[int, int]] = field(default_factory=list)

    @property
    def restored(self) -> int:
        """Leading prompt tokens the target restored from the block store (whole, not selected over)."""
        return 0

    @property
    def ratio(self) -> float:
        """Kept share of the prompt tokens not restored: what the selection was made over
        (1.0 when nothing was dropped). A restored prefix is counted by ``restored_ratio``."""
        over = self.total - self.restored
        return (self.kept - self.restored) / over if over > 0 else 1.0

    @property
    def restored_ratio(self) -> float:
        """Share of the prompt the target restored from the block store."""
        return self.restored / self.total if self.total else 0.0

    def kept_indices(self) -> list[int]:
        return [i for s, e in self.kept_ranges for i in range(s, e)]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept_ranges"] = [[int(s), int(e)] for s, e in self.kept_ranges]
        d["healed_ranges"] = [[int(s), int(e)] for s, e in self.healed_ranges]
        d["ratio"] = self.ratio
        d["restored_ratio"] = self.restored_ratio
        d["v"] = RESULT_VERSION
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "JobResult":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        values["kept_ranges"] = [(int(s), int(e)) for s, e in d.get("kept_ranges", [])]
        values["healed_ranges"] = [(int(s), int(e)) for s, e in d.get("healed_ranges", [])]
        if values.get("spans") is not None:
            values["spans"] = [KeptSpan(**s) for s in values["spans"]]
        if values.get("importance_curve") is not None:
            values["importance_curve"] = ImportanceCurve(**values["importance_curve"])
        return cls(**values)


@dataclass(kw_only=True)
class PrefillResult(JobResult):
    """What a prefill job returns: the selection, optionally its scores and kept text."""

    model: str = ""                 # the draft model's identity
    importance: list[float] | None = None  # every token's (only when the spec asked)
    kind: str = "prefill"


@dataclass(kw_only=True)
class GenerateResult(JobResult):
    """What a generate job returns: the text, and the selection the target prefilled.

    ``kept`` counts the prompt tokens prefilled into the target. ``ttft_s`` runs from the
    job's start on the worker (model loading included) to the first generated token.
    ``fallback`` says why the draft's part was skipped after a failure (the target then
    prefilled every token). ``finish_reason`` is ``"eos"``, ``"stop"`` (a stop string, which is not part of
    ``text``), ``"length"`` (``max_tokens`` reached) or ``"tool_calls"`` (the turn ended with
    tool calls). For a chat job ``text`` is the answer's content; ``reasoning`` the reasoning
    text and ``tool_calls`` the calls (``{"id", "name", "arguments"}``, arguments an object),
    separated and parsed with the model's own mlx-lm markers and tool parser
    (``jobs.client.answer_stream`` is how they stream).
    """

    text: str
    finish_reason: str
    token_ids: list[int]            # generated ids (up to the stop string, if any)
    ttft_s: float
    full_prefill: bool = False
    draft_model: str = ""           # identities (what the block-store keys are rooted in)
    target_model: str = ""
    target_name: str = ""           # the target as the job named it ("target": the default)
    draft_timings: dict[str, float] = field(default_factory=dict)  # scoring's own phases
    # The target's prompt tokens: restored from the block store (of them, healed: blocks a
    # heal job prefilled), prefilled in full (the contiguous prefix), prefilled sparse; and
    # its prefix blocks written.
    target_tokens: dict[str, int] = field(default_factory=dict)
    ttft_phases: dict[str, float] = field(default_factory=dict)  # seconds before the first token
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # This turn's heal (worker.job.heal): queued (its job_id, tokens), or the reason it was not.
    heal: dict[str, Any] = field(default_factory=dict)
    # Whether this turn waited for its conversation's running heal (setting heal_wait_ms):
    # waited, the heal job, its ETA, and why not when it did not; empty: no heal was running.
    heal_wait: dict[str, Any] = field(default_factory=dict)
    # Whether its decode ran in the worker's batch (every generating job one token per step in one
    # forward pass), and why not when it did not (a family or cache that cannot batch: it then
    # decoded one job at a time inside the same loop).
    batched: bool = False
    unbatched_reason: str | None = None
    kind: str = "generate"

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def restored(self) -> int:
        return int(self.target_tokens.get("restored", 0))

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "generated_tokens": self.generated_tokens}


def rates(timings: Mapping[str, float], tokens: Mapping[str, int]) -> dict[str, float]:
    """Tokens per second for each phase that has both a time and a token count."""
    return {phase: round(tokens[phase] / t, 1) for phase, t in timings.items()
            if phase in tokens and t > 0}


def result_from_json(d: Mapping[str, Any]) -> PrefillResult | GenerateResult:
    """The typed result for a job's JSON return value (by its ``kind``)."""
    return GenerateResult.from_json(d) if d.get("kind") == "generate" else PrefillResult.from_json(d)
