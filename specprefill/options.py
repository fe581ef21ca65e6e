"""The options of scoring, selection, sampling and generation: their defaults and ranges, once.

Defaults are the paper's and omlx's (lookahead 8 tokens at temperature 0.6 / top-p 0.95,
pooling kernel 13, draft prefill step 2048; chunks of 32, keep 0.2, a 512-token tail, an
admission threshold of 8192 tokens). Each object checks and normalises its fields when it
is built (an :class:`OptionError` names the field and its range), so the functions that
take one never check again; ``jobs`` builds them from job specs and settings and names the
field as the user spelled it. Pure Python: importing this never loads mlx.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

PREFILL_STEP = 2048  # tokens per forward pass while prefilling (draft and target)
# A stored hybrid prompt keeps its recurrent state at the end of its system prefix, at its
# last full block, and after every this many blocks (0: only those two). 16 blocks (4K tokens
# at 256) keeps a Qwen3.5-0.8B-shaped draft's bytes at 8K tokens within 1.4x its K/V alone
# (one checkpoint is 6.2 blocks of its K/V) and bounds what a restore may have to recompute
# (bench/block_store.py measures both).
STATE_CHECKPOINT_BLOCKS = 16
MAX_SEED = 2**32 - 1
MAX_TOKENS = 2**31 - 1  # token counts, like token ids, are int32 in the block store
MAX_LOOKAHEAD = 256
MAX_CHUNK_SIZE = 8192
MAX_POOL_KERNEL = 1023
MAX_FOLLOW_CHUNKS = 64  # chunks kept after each peak (selection.follow_chunks)
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# What a worker's models compute in (specprefill.compute_dtype): "auto" is float32 on MLX's CPU
# backend and the model's own dtype on Metal, "model" always the model's own.
COMPUTE_DTYPES = ("auto", "model", "float32", "bfloat16", "float16")


class OptionError(ValueError):
    """An option outside its type or range: ``field`` is its name in the options object,
    ``problem`` what is wrong (the message is ``"field: problem"``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _span(lo: float, hi: float, lo_open: bool = False) -> str:
    return f"{'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}]"


def check_integer(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as an int if it is an integer (not a bool) in ``[lo, hi]``, else :class:`OptionError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionError(name, f"expected an integer in {_span(lo, hi)}, got {type(value).__name__}")
    if not lo <= value <= hi:
        shown = str(int(value))
        shown = shown if len(shown) <= 24 else f"{shown[:20]}... ({len(shown)} digits)"
        raise OptionError(name, f"{shown} is outside the allowed range {_span(lo, hi)}")
    return int(value)


def check_number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` if ``lo_open``), else :class:`OptionError`."""
    span = _span(lo, hi, lo_open)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(name, f"expected a number in {span}, got {type(value).__name__}")
    try:
        value = float(value)
    except (OverflowError, ValueError):
        raise OptionError(name, f"not representable as a float (allowed: {span})") from None
    if not math.isfinite(value) or not (lo < value if lo_open else lo <= value) or value > hi:
        raise OptionError(name, f"{value!r} is outside the allowed range {span}")
    return value


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else :class:`OptionError`."""
    if not isinstance(value, bool):
        raise OptionError(name, f"expected true or false, got {type(value).__name__}")
    return value


def _set(obj: Any, **clean: Any) -> None:
    """Store normalised field values on a frozen options object (in ``__post_init__``)."""
    for name, value in clean.items():
        object.__setattr__(obj, name, value)


def _check_sampling(obj: Any) -> None:
    _set(obj, temperature=check_number("temperature", obj.temperature, 0.0, MAX_TEMPERATURE),
         top_p=check_number("top_p", obj.top_p, 0.0, 1.0, lo_open=True),
         seed=check_integer("seed", obj.seed, 0, MAX_SEED), greedy=check_flag("greedy", obj.greedy))


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
        _check_sampling(self)


@dataclass(frozen=True)
class ScoringOptions:
    """How the draft scores a prompt (:func:`specprefill.scoring.score_tokens`).

    ``n_lookahead`` tokens are sampled with ``temperature`` / ``top_p`` / ``seed`` (or
    ``greedy``); their queries, and the last prompt token's if ``include_last_query``,
    score the prompt; attention is pooled over ``pool_kernel`` positions (0 or 1: none).
    ``allow_beyond_context`` lets the job run past the context window the draft's and the
    target's configs declare (refused otherwise, when the worker tokenizes the prompt).
    How many tokens one forward pass prefills is the caller's (``prefill_step``), not an
    option: it does not change what is selected.
    """

    n_lookahead: int = 8
    temperature: float = 0.6
    top_p: float = 0.95
    greedy: bool = False
    seed: int = 0
    pool_kernel: int = 13
    include_last_query: bool = True
    allow_beyond_context: bool = False

    def __post_init__(self) -> None:
        _set(self, n_lookahead=check_integer("n_lookahead", self.n_lookahead, 0, MAX_LOOKAHEAD),
             include_last_query=check_flag("include_last_query", self.include_last_query),
             allow_beyond_context=check_flag("allow_beyond_context", self.allow_beyond_context),
             pool_kernel=check_integer("pool_kernel", self.pool_kernel, 0, MAX_POOL_KERNEL))
        if not self.include_last_query and self.n_lookahead == 0:
            raise OptionError("n_lookahead", "0 needs include_last_query=true (no query would "
                                             "score the prompt)")
        _check_sampling(self)

    @property
    def sampling(self) -> Sampling:
        """How the lookahead tokens are drawn."""
        return Sampling(self.temperature, self.top_p, self.seed, self.greedy)


@dataclass(frozen=True)
class SelectionOptions:
    """Which chunks the target prefills (:func:`specprefill.selection.plan_selection`).

    ``keep`` of the ranked chunks of ``chunk_size`` tokens are kept, the chunks holding the
    last ``tail_tokens`` tokens first; prompts of at most ``threshold`` tokens are kept whole.
    ``follow_chunks`` > 0 keeps, with each ranked chunk, the chunks that follow it (the lines
    after a peak, which a verbatim quote needs); they count against ``keep``.
    """

    keep: float = 0.2
    chunk_size: int = 32
    tail_tokens: int = 512
    threshold: int = 8192
    follow_chunks: int = 0

    def __post_init__(self) -> None:
        _set(self, keep=check_number("keep", self.keep, 0.0, 1.0, lo_open=True),
             chunk_size=check_integer("chunk_size", self.chunk_size, 1, MAX_CHUNK_SIZE),
             tail_tokens=check_integer("tail_tokens", self.tail_tokens, 0, MAX_TOKENS),
             threshold=check_integer("threshold", self.threshold, 0, MAX_TOKENS),
             follow_chunks=check_integer("follow_chunks", self.follow_chunks, 0, MAX_FOLLOW_CHUNKS))


def _stop_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, (bytes, dict)) or not isinstance(value, (list, tuple)):
        raise OptionError("stop", "expected a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise OptionError("stop", f"{len(value)} strings, allowed 0..{MAX_STOP_STRINGS}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise OptionError(f"stop[{i}]", f"expected a string of 1..{MAX_STOP_CHARS} characters")
    return tuple(value)


@dataclass(frozen=True)
class GenerateOptions:
    """What a generate job does after selection.

    Sampling: ``greedy`` or ``temperature`` 0 takes the argmax; otherwise top-p sampling
    seeded by ``seed`` (reproducible). Generation ends at EOS, after ``max_tokens`` tokens,
    or before the first occurrence of any ``stop`` string (one string or a list).
    ``full_prefill`` prefills the target with every prompt token (no draft scoring), for
    comparison. ``heal``: after a sparse prefill, queue a heal job (a full prefill of the
    conversation the next turn renders, off the critical path; ``worker.job.heal``).
    ``fit_context``: ``max_tokens`` is a ceiling the worker lowers to the room the prompt leaves
    in the target's context window, instead of refusing a prompt plus ``max_tokens`` past it
    (the answer then ends with the length reason); a prompt that leaves no room is refused.
    """

    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    greedy: bool = False
    stop: tuple[str, ...] = ()
    full_prefill: bool = False
    heal: bool = True
    fit_context: bool = False

    def __post_init__(self) -> None:
        _set(self, max_tokens=check_integer("max_tokens", self.max_tokens, 1, MAX_TOKENS),
             stop=_stop_strings(self.stop), full_prefill=check_flag("full_prefill", self.full_prefill),
             heal=check_flag("heal", self.heal), fit_context=check_flag("fit_context", self.fit_context))
        _check_sampling(self)

    @property
    def sampling(self) -> Sampling:
        """How the target's tokens are drawn."""
        return Sampling(self.temperature, self.top_p, self.seed, self.greedy)
