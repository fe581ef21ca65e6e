"""The options of scoring, selection and sampling: their defaults and their validation, once.

Defaults are the paper's and omlx's (lookahead 8 tokens at temperature 0.6 / top-p 0.95,
pooling kernel 13, draft prefill step 2048; chunks of 32, keep 0.2, a 512-token tail, an
admission threshold of 8192 tokens). Each object checks itself when it is built, so the
functions that take one never check again. ``jobs.settings.Settings`` takes its defaults
from here. Pure Python: importing this never loads mlx (``specprefill.blas`` must run first).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from specprefill.checks import check_int

PREFILL_STEP = 2048  # tokens per forward pass while prefilling (draft and target)
MAX_SEED = 2**63 - 1


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a float if it is a number in (0, 1], else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"{name}: must be a number in (0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn from logits: temperature, then top-p, with a seeded key.

    ``greedy`` (or temperature 0) takes the argmax. Used for the draft's lookahead and
    for the target's decoding; the defaults are greedy decoding.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    greedy: bool = False

    def __post_init__(self) -> None:
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
                or not 0 <= temperature < math.inf:
            raise ValueError(f"temperature: must be a finite number >= 0, got {temperature!r}")
        check_fraction("top_p", self.top_p)
        check_int("seed", self.seed, 0, MAX_SEED)


@dataclass(frozen=True)
class ScoringOptions:
    """How the draft scores a prompt (:func:`specprefill.scoring.score_tokens`).

    ``n_lookahead`` tokens are sampled with ``temperature`` / ``top_p`` / ``seed`` (or
    ``greedy``); their queries, and the last prompt token's if ``include_last_query``,
    score the prompt; attention is pooled over ``pool_kernel`` positions; the prompt is
    prefilled ``prefill_step`` tokens at a time.
    """

    n_lookahead: int = 8
    temperature: float = 0.6
    top_p: float = 0.95
    greedy: bool = False
    seed: int = 0
    pool_kernel: int = 13
    prefill_step: int = PREFILL_STEP
    include_last_query: bool = True

    def __post_init__(self) -> None:
        check_int("n_lookahead", self.n_lookahead, 0)
        if not self.include_last_query and self.n_lookahead == 0:
            raise ValueError("n_lookahead: must be >= 1 when include_last_query is False "
                             "(no query to score with)")
        self.sampling  # noqa: B018 - validates temperature, top_p and seed
        check_int("pool_kernel", self.pool_kernel, 0)
        check_int("prefill_step", self.prefill_step, 1)

    @property
    def sampling(self) -> Sampling:
        """How the lookahead tokens are drawn."""
        return Sampling(self.temperature, self.top_p, self.seed, self.greedy)


@dataclass(frozen=True)
class SelectionOptions:
    """Which chunks the target prefills (:func:`specprefill.selection.plan_selection`).

    ``keep`` of the ranked chunks of ``chunk_size`` tokens are kept, the chunks holding the
    last ``tail_tokens`` tokens first; prompts of at most ``threshold`` tokens are kept whole.
    """

    keep: float = 0.2
    chunk_size: int = 32
    tail_tokens: int = 512
    threshold: int = 8192

    def __post_init__(self) -> None:
        check_fraction("keep", self.keep)
        check_int("chunk_size", self.chunk_size, 1)
        check_int("tail_tokens", self.tail_tokens, 0)
        check_int("threshold", self.threshold, 0)
