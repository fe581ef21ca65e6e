"""Sparse prefill of a target model at original positions, and decoding at the true positions.

Usage (one request)::

    with sparse_session(target) as session:
        logits, kv_cache, state = session.prefill(tokens, keep_indices, progress=report)
        # or, for comparison, the plain path:  full_prefill(target, tokens, progress=report)
        for token in generate_tokens(target, logits, kv_cache, state, max_tokens=256,
                                     sampling=Sampling(temperature=0.6, top_p=0.95, seed=7),
                                     stop_tokens=tokenizer.eos_token_ids):
            ...  # detokenize, check stop strings, ``break`` to end early

The KV cache holds only the kept tokens (that is the saving); each kept token is rotated at its
original prompt position, and generated tokens continue at ``len(tokens) + i``. Everything
installed on the model lives exactly as long as the ``with`` block, which restores the genuine
rope modules on normal exit, on error and on a stop raised from a progress callback.

Attention masks: kept tokens are fed in ascending original order, so mlx-lm's ordinary causal
mask over cache order is the causal mask by original position. Sliding-window layers (gemma3)
window over the last ``window`` kept tokens (what their rotating cache holds), not over
``window`` original positions; with every token kept the two coincide.

Progress callbacks are ``progress(processed, total, phase)``: phase ``"target_prefill"``
(tokens run through the target / tokens to run, after each chunk) and ``"decode"`` (tokens
generated / ``max_tokens``, before each token is yielded). A callback may raise any exception
to stop the request; it propagates to the caller and the model is left unchanged.

Why decoding is a loop of its own and not ``mlx_lm.generate.generate_step`` (which takes a
prompt cache and a sampler, and would carry the sparse positions: the position map only reads
the cache offset): generate_step turns the logits into log-probabilities in the model's dtype
before its sampler sees them, and in bfloat16 that rounding changes the drawn tokens. Measured
with the shared seeded sampler on tiny llama, qwen3 and phi3 models (40 tokens; greedy, and
temperature 0.7 / 1.5 with top-p 0.9 / 1.0 over five seeds): in float32 all 63 sequences were
identical, in bfloat16 60 of 63 diverged, greedy ones included. It also runs the next forward
pass before it yields a token, so every stop (EOS, a stop string, a stop request) would pay for
one target step nobody reads.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from specprefill.options import PREFILL_STEP, Sampling
from specprefill.positions import PositionMap, install_positions
from specprefill.sampling import sample

__all__ = ["PrefillState", "Sampling", "SparseSession", "full_prefill", "generate_tokens", "sparse_session"]

Progress = Callable[[int, int, str], None]


@dataclass
class PrefillState:
    """What a prefill did; pass it to :func:`generate_tokens`."""

    prompt_tokens: int          # T, the full prompt length
    kept_tokens: int            # tokens in the cache after prefill (T for a full prefill)
    cached_tokens: int          # of those, already in the cache passed in
    seconds: float              # wall time of the prefill (the target's part of TTFT)
    session: Optional["SparseSession"] = None   # set for a sparse prefill

    @property
    def sparse(self) -> bool:
        return self.session is not None

    @property
    def kept_ratio(self) -> float:
        return self.kept_tokens / self.prompt_tokens

    @property
    def next_position(self) -> int:
        """Position of the first generated token: always the true prompt length."""
        return self.prompt_tokens


class SparseSession:
    """One request's view of a model with position-mapped ropes; made by :func:`sparse_session`."""

    def __init__(self, model: nn.Module, position_map: PositionMap):
        self.model = model
        self.position_map = position_map
        self.active = True
        self._prefilled = False

    def prefill(
        self,
        tokens: Sequence[int] | np.ndarray | mx.array,
        keep_indices: Sequence[int] | np.ndarray,
        *,
        protected_prefix: int = 0,
        kv_cache: Optional[list] = None,
        prefill_step: int = PREFILL_STEP,
        progress: Optional[Progress] = None,
    ) -> tuple[mx.array, list, PrefillState]:
        """Prefill only ``tokens[keep_indices]``, each at its original position.

        Args:
            tokens: the full prompt, T token ids.
            keep_indices: strictly increasing prompt indices to keep, within [0, T); must hold
                T-1 (the first generated token is predicted from the last prompt token).
            protected_prefix: the first this many tokens (system prompt) are kept in full and
                prefilled as their own first step.
            kv_cache: an mlx-lm target cache that already holds the prompt's first ``c`` tokens
                (contiguous, e.g. a cached system prompt; those indices must be kept), or None
                for a fresh cache.
            prefill_step: tokens per forward pass.
            progress: ``progress(processed, total, "target_prefill")`` after each step.

        Returns:
            ``(logits, kv_cache, state)``: logits (1, vocab) after the last prompt token, the cache
            holding the kept tokens only, and a :class:`PrefillState`.
        """
        if not self.active:
            raise RuntimeError("sparse session: already closed")
        if self._prefilled:
            raise RuntimeError("sparse session: one prefill per session (one request)")
        self._prefilled = True
        prompt = _as_tokens(tokens)
        T = len(prompt)
        keep = _check_keep(keep_indices, T, protected_prefix)
        kv_cache = make_prompt_cache(self.model) if kv_cache is None else kv_cache
        cached = _check_cached_prefix(kv_cache, keep)
        self.position_map.set(keep, T)
        start = time.perf_counter()
        logits = _run_prefill(self.model, prompt[mx.array(keep[cached:])], kv_cache,
                              first_stop=max(0, protected_prefix - cached), step=prefill_step,
                              progress=progress)
        state = PrefillState(T, len(keep), cached, time.perf_counter() - start, session=self)
        return logits, kv_cache, state


@contextmanager
def sparse_session(model: nn.Module) -> Iterator[SparseSession]:
    """Install position-mapped ropes on ``model`` for one request; always restore them.

    Leftover wrappers from an earlier aborted request are unwrapped first, never wrapped again.
    Until :meth:`SparseSession.prefill` runs the mapping is the identity, so a
    :func:`full_prefill` inside the session behaves exactly like one outside it. Raises
    :class:`specprefill.positions.UnsupportedRoPEError` for a model whose rope cannot be remapped.
    """
    position_map = PositionMap()
    restore = install_positions(model, position_map)
    session = SparseSession(model, position_map)
    try:
        yield session
    finally:
        session.active = False
        restore()


def full_prefill(
    model: nn.Module,
    tokens: Sequence[int] | np.ndarray | mx.array,
    *,
    kv_cache: Optional[list] = None,
    prefill_step: int = PREFILL_STEP,
    progress: Optional[Progress] = None,
) -> tuple[mx.array, list, PrefillState]:
    """Plain mlx-lm prefill of every token; same interface and results as ``session.prefill``.

    ``kv_cache`` may already hold the prompt's first ``c`` tokens; those are not run again.
    """
    prompt = _as_tokens(tokens)
    T = len(prompt)
    kv_cache = make_prompt_cache(model) if kv_cache is None else kv_cache
    cached = _check_cached_prefix(kv_cache, np.arange(T))
    start = time.perf_counter()
    logits = _run_prefill(model, prompt[cached:], kv_cache, first_stop=0, step=prefill_step,
                          progress=progress)
    return logits, kv_cache, PrefillState(T, T, cached, time.perf_counter() - start)


def generate_tokens(
    model: nn.Module,
    logits: mx.array,
    kv_cache: list,
    state: PrefillState,
    *,
    max_tokens: int,
    sampling: Sampling = Sampling(),
    stop_tokens: Iterable[int] = (),
    progress: Optional[Progress] = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` generated token ids, starting from the prefill's ``logits``.

    A token in ``stop_tokens`` (e.g. EOS) ends generation and is not yielded; stop strings are
    the caller's (stop iterating). Sampling is reproducible for a given ``sampling.seed`` and
    uses no global random state. After a sparse prefill this must run inside that prefill's
    ``sparse_session`` block (positions continue at ``state.next_position``).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    stops = {int(t) for t in stop_tokens}
    key = mx.random.key(sampling.seed)
    for n in range(1, max_tokens + 1):
        if state.session is not None and not state.session.active:
            raise RuntimeError("generate_tokens: a sparse prefill decodes only inside its sparse_session")
        key, step_key = mx.random.split(key)
        token = int(sample(logits, step_key, sampling).item())
        if token in stops:
            return
        if progress is not None:
            progress(n, max_tokens, "decode")
        yield token
        if n < max_tokens:
            logits = model(mx.array([[token]]), cache=kv_cache)[:, -1, :]


def _run_prefill(model, inputs: mx.array, kv_cache: list, *, first_stop: int, step: int,
                 progress: Optional[Progress]) -> mx.array:
    """Feed ``inputs`` in steps (the first ends at ``first_stop`` if > 0); last-token logits."""
    if step < 1:
        raise ValueError(f"prefill_step: must be >= 1, got {step}")
    total = len(inputs)
    if total == 0:
        raise ValueError("tokens: nothing left to prefill (the cache already holds the whole prompt)")
    done = 0
    while done < total:
        end = min(done + step, total)
        if done < first_stop < end:
            end = first_stop
        logits = model(inputs[None, done:end], cache=kv_cache)
        if end < total:
            # Only the cache is needed here: the lazy logits of the chunk are never computed.
            mx.eval([c.state for c in kv_cache])
        else:
            logits = logits[:, -1, :]
            mx.eval(logits, [c.state for c in kv_cache])
        done = end
        if progress is not None:
            progress(done, total, "target_prefill")
    return logits


def _as_tokens(tokens) -> mx.array:
    if isinstance(tokens, mx.array):
        prompt = tokens.reshape(-1).astype(mx.int32)
    else:
        prompt = mx.array(np.asarray(tokens, dtype=np.int32).reshape(-1))
    if len(prompt) == 0:
        raise ValueError("tokens: the prompt must hold at least 1 token")
    return prompt


def _check_keep(keep_indices, T: int, protected_prefix: int) -> np.ndarray:
    if not 0 <= protected_prefix <= T:
        raise ValueError(f"protected_prefix: must be in [0, {T}], got {protected_prefix}")
    keep = np.asarray(keep_indices, dtype=np.int64).reshape(-1)
    if len(keep) == 0:
        raise ValueError("keep_indices: must not be empty")
    if np.any(np.diff(keep) <= 0):
        raise ValueError("keep_indices: must be strictly increasing")
    if keep[0] < 0 or keep[-1] >= T:
        raise ValueError(f"keep_indices: must lie in [0, {T}), got [{keep[0]}, {keep[-1]}]")
    if keep[-1] != T - 1:
        raise ValueError(f"keep_indices: must include the last prompt index {T - 1}")
    return np.union1d(np.arange(protected_prefix), keep)


def _check_cached_prefix(kv_cache: list, keep: np.ndarray) -> int:
    cached = int(kv_cache[0].offset) if kv_cache else 0
    if cached and (cached > len(keep) or keep[cached - 1] != cached - 1):
        raise ValueError(f"kv_cache: holds {cached} tokens; they must be the prompt's first {cached} "
                         "tokens and all kept")
    return cached
