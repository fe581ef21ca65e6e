"""The result of a prefill or generate job, as returned by the worker and stored by RQ (JSON).

Kept token indices travel as half-open ``[start, end)`` ranges: a 128K-token prompt
with 20% kept in 32-token chunks is a few hundred pairs instead of 26K integers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

RESULT_VERSION = 1


@dataclass
class KeptSpan:
    """One kept range with its text (only when the spec asked for spans)."""

    start: int
    end: int
    text: str


@dataclass
class PrefillResult:
    """What a prefill job returns. ``reason`` is set when nothing was dropped."""

    job_id: str
    kept_ranges: list[tuple[int, int]]
    kept: int
    total: int
    reason: str | None
    protected_prefix: int = 0
    cached_tokens: int = 0          # prompt tokens restored from the block store
    blocks_written: int = 0
    memo_hit: bool = False
    model: str = ""
    timings: dict[str, float] = field(default_factory=dict)        # seconds per phase
    tokens_per_s: dict[str, float] = field(default_factory=dict)   # per phase
    importance: list[float] | None = None
    spans: list[KeptSpan] | None = None
    kind: str = "prefill"

    @property
    def ratio(self) -> float:
        """Kept fraction of the prompt (1.0 when nothing was dropped)."""
        return self.kept / self.total if self.total else 1.0

    def kept_indices(self) -> list[int]:
        return [i for s, e in self.kept_ranges for i in range(s, e)]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept_ranges"] = [[int(s), int(e)] for s, e in self.kept_ranges]
        d["ratio"] = self.ratio
        d["v"] = RESULT_VERSION
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PrefillResult":
        d = dict(d)
        d.pop("v", None)
        d.pop("ratio", None)
        d["kept_ranges"] = [(int(s), int(e)) for s, e in d["kept_ranges"]]
        if d.get("spans") is not None:
            d["spans"] = [KeptSpan(**s) for s in d["spans"]]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def rates(timings: Mapping[str, float], tokens: Mapping[str, int]) -> dict[str, float]:
    """Tokens per second for each phase that has both a time and a token count."""
    return {phase: round(tokens[phase] / t, 1) for phase, t in timings.items()
            if phase in tokens and t > 0}


@dataclass
class GenerateResult:
    """What a generate job returns: the text and how long each phase took.

    ``ttft_s`` runs from the job's start on the worker (model loading included) to the
    first generated token. ``finish_reason`` is ``"eos"``, ``"stop"`` (a stop string,
    which is not part of ``text``) or ``"length"`` (``max_tokens`` reached).
    """

    job_id: str
    text: str
    finish_reason: str
    token_ids: list[int]            # generated ids (up to the stop string, if any)
    ttft_s: float
    kept: int                       # prompt tokens prefilled into the target
    total: int                      # prompt tokens
    full_prefill: bool = False
    reason: str | None = None       # why nothing was dropped (admission), if so
    kept_ranges: list[tuple[int, int]] = field(default_factory=list)
    protected_prefix: int = 0
    cached_tokens: int = 0          # draft prompt tokens restored from the block store
    blocks_written: int = 0
    memo_hit: bool = False
    draft_model: str = ""
    target_model: str = ""
    timings: dict[str, float] = field(default_factory=dict)        # seconds per phase
    tokens_per_s: dict[str, float] = field(default_factory=dict)   # per phase
    draft_timings: dict[str, float] = field(default_factory=dict)  # scoring's own phases
    kind: str = "generate"

    @property
    def ratio(self) -> float:
        """Kept fraction of the prompt (1.0 for a full prefill)."""
        return self.kept / self.total if self.total else 1.0

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept_ranges"] = [[int(s), int(e)] for s, e in self.kept_ranges]
        d["ratio"] = self.ratio
        d["generated_tokens"] = self.generated_tokens
        d["v"] = RESULT_VERSION
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "GenerateResult":
        d = dict(d)
        d["kept_ranges"] = [(int(s), int(e)) for s, e in d.get("kept_ranges", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def result_from_json(d: Mapping[str, Any]) -> "PrefillResult | GenerateResult":
    """The typed result for a job's JSON return value (by its ``kind``)."""
    return GenerateResult.from_json(d) if d.get("kind") == "generate" else PrefillResult.from_json(d)
