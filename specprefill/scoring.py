"""Score every prompt token with a draft model (the SpecPrefill speculator).

Phases: chunked prefill of the prompt (only the part not in a restored cache), a few
seeded lookahead decode steps with the post-RoPE queries captured, then importance
(see :mod:`specprefill.importance`). The returned cache describes exactly the prompt,
so it can be stored and reused; the model is left exactly as it was found.
"""
from __future__ import annotations

import math
import numbers
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from specprefill.capture import (
    AttentionSite,
    UnsupportedModelError,
    capture_queries,
    check_attention,
)
from specprefill.checks import check_int
from specprefill.importance import token_importance
from specprefill.sampling import sample

__all__ = ["ScoreResult", "UnsupportedModelError", "check_scorable", "score_tokens"]

Progress = Callable[[int, int, str], None]


@dataclass
class ScoreResult:
    """What scoring produced for one prompt of ``prompt_tokens`` tokens."""

    importance: mx.array  # float32, shape (T,), one per prompt token
    cache: list  # mlx-lm cache objects holding exactly the T prompt tokens
    lookahead_tokens: list[int]  # sampled ids whose queries were captured, in order
    timings: dict[str, float] = field(default_factory=dict)  # "prefill", "lookahead", "importance"
    cached_tokens: int = 0  # prompt tokens restored from the cache passed in (0 cold)
    prompt_tokens: int = 0  # T


def check_scorable(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` saying why ``model`` cannot be scored.

    Runs a five-token probe that proves the query capture reproduces the model's own
    attention output, so an unrecognised attention never yields wrong scores.
    """
    check_attention(model)


def _prompt(tokens: Any) -> list[int]:
    if isinstance(tokens, mx.array):
        tokens = np.array(tokens)
    values = np.asarray(tokens)
    if values.ndim != 1 or values.size == 0 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D sequence of token ids, got shape {values.shape}")
    if values.min() < 0:
        raise ValueError("tokens must be non-negative token ids")
    return [int(t) for t in values]


def _restored_length(cache: list, n_layers: int, n_prompt: int) -> int:
    if not isinstance(cache, (list, tuple)) or len(cache) != n_layers:
        size = len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__
        raise ValueError(f"cache must be a list of {n_layers} per-layer caches, got {size}")
    offsets = {getattr(c, "offset", None) for c in cache}
    if len(offsets) != 1 or not isinstance(next(iter(offsets)), int):
        raise ValueError(f"cache layers must all hold the same number of tokens, got offsets {sorted(map(str, offsets))}")
    n = offsets.pop()
    if not 0 <= n < n_prompt:
        raise ValueError(
            f"cache holds {n} tokens; it must hold fewer than the prompt's {n_prompt} "
            "(the last prompt token is always recomputed for the lookahead logits)"
        )
    return n


def _rewind_point(layer_cache: Any) -> tuple | None:
    """A copy of a bounded or untrimmable cache's state, to restore after the lookahead.

    Unbounded trimmable caches (``KVCache``) are trimmed instead: copying them would
    double the prompt's KV memory.
    """
    bounded = getattr(layer_cache, "max_size", None) is not None
    trimmable = getattr(layer_cache, "is_trimmable", lambda: False)()
    if not bounded and trimmable:
        return None
    copy = lambda v: mx.array(v) if isinstance(v, mx.array) else v  # noqa: E731 - new objects:
    # cache updates assign into slices of the arrays they hold, which would alter a plain reference.
    state = layer_cache.state
    state = tuple(copy(v) for v in state) if isinstance(state, tuple) else [copy(v) for v in state]
    meta = getattr(layer_cache, "meta_state", None)
    return state, meta


def _drop_lookahead(layer_cache: Any, n: int, rewind: tuple | None, n_prompt: int) -> None:
    if rewind is not None:
        state, meta = rewind
        layer_cache.state = state
        if meta is not None:
            layer_cache.meta_state = meta
    else:
        if layer_cache.trim(n) != n:
            raise RuntimeError(f"{type(layer_cache).__name__} could not trim the {n} lookahead tokens")
        keys = getattr(layer_cache, "keys", None)
        if isinstance(keys, mx.array) and keys.shape[2] > n_prompt:
            # Slice the buffers too, so `state` shows exactly the prompt (no stale lookahead keys).
            layer_cache.keys = keys[..., :n_prompt, :]
            layer_cache.values = layer_cache.values[..., :n_prompt, :]
    if getattr(layer_cache, "offset", n_prompt) != n_prompt:
        raise RuntimeError(f"{type(layer_cache).__name__} holds {layer_cache.offset} tokens after the lookahead, not {n_prompt}")


def _spans(layer_cache: Any, n_tokens: int) -> bool:
    """Whether the cache still holds keys for all of the first ``n_tokens`` positions in order."""
    max_size = getattr(layer_cache, "max_size", None)
    return max_size is None or n_tokens <= max_size


def _eval_cache(cache: list) -> None:
    mx.eval([c.state for c in cache])


def score_tokens(
    model: nn.Module,
    tokens: Sequence[int],
    *,
    n_lookahead: int = 8,
    temperature: float = 0.6,
    top_p: float = 0.95,
    greedy: bool = False,
    seed: int = 0,
    pool_kernel: int = 13,
    prefill_step: int = 2048,
    include_last_query: bool = True,
    cache: list | None = None,
    progress: Progress | None = None,
) -> ScoreResult:
    """Importance of every token of ``tokens`` under the draft ``model``.

    ``cache`` (optional) is a restored prefix of this prompt, fewer tokens than the
    prompt; it is extended in place and returned in the result (on an exception it may
    be left partly extended). ``progress(processed, total, phase)`` is called at each
    phase start and after each prefill chunk, lookahead step and importance layer; it
    may raise to abort, and the exception propagates with the model untouched.
    Sampling uses an explicit key derived from ``seed`` (``greedy`` or temperature 0:
    argmax), so equal inputs give equal results on every run and machine.
    """
    prompt = _prompt(tokens)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(vocab, int) and max(prompt) >= vocab:
        raise ValueError(f"tokens must be ids below the model's vocab_size {vocab}, got {max(prompt)}")
    n_lookahead = check_int("n_lookahead", n_lookahead, 0)
    if not include_last_query and n_lookahead == 0:
        raise ValueError("n_lookahead must be >= 1 when include_last_query is False (no query to score with)")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    seed = check_int("seed", seed, 0, 2**63 - 1)
    pool_kernel = check_int("pool_kernel", pool_kernel, 0)
    prefill_step = check_int("prefill_step", prefill_step, 1)
    report = progress or (lambda processed, total, phase: None)

    timings = {"prefill": 0.0, "lookahead": 0.0, "importance": 0.0}
    started = time.perf_counter()
    sites = check_attention(model)
    n_prompt = len(prompt)
    if cache is None:
        cache = make_prompt_cache(model)
        cached = 0
    else:
        cached = _restored_length(cache, len(sites), n_prompt)
    n_total = n_prompt + n_lookahead
    if not any(_spans(c, n_total) for c in cache):
        windows = sorted({getattr(c, "max_size", None) for c in cache})
        raise ValueError(
            f"tokens: a prompt of {n_prompt} tokens plus {n_lookahead} lookahead tokens is longer than "
            f"every layer's attention window {windows}; no layer can score it"
        )

    # Prefill everything but the last prompt token, whose query and logits come next.
    report(cached, n_prompt, "prefill")
    position = cached
    while position < n_prompt - 1:
        end = min(position + prefill_step, n_prompt - 1)
        model(mx.array(prompt[position:end], dtype=mx.int32)[None], cache=cache)
        _eval_cache(cache)
        position = end
        report(position, n_prompt, "prefill")

    key = mx.random.key(seed)
    lookahead: list[int] = []
    with capture_queries(sites) as capture:
        with capture.recording() if include_last_query else nullcontext():
            logits = model(mx.array([[prompt[-1]]], dtype=mx.int32), cache=cache)
            mx.eval(logits)
        rewinds = [_rewind_point(c) for c in cache]
        report(n_prompt, n_prompt, "prefill")
        timings["prefill"] = time.perf_counter() - started

        started = time.perf_counter()
        report(0, n_lookahead, "lookahead")
        for step in range(n_lookahead):
            key, subkey = mx.random.split(key)
            token = int(sample(logits[0, -1], subkey, temperature=temperature, top_p=top_p,
                               greedy=greedy).item())
            lookahead.append(token)
            with capture.recording():
                logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)
                mx.eval(logits)
            report(step + 1, n_lookahead, "lookahead")
    timings["lookahead"] = time.perf_counter() - started

    started = time.perf_counter()
    spanning = [i for i, c in enumerate(cache) if _spans(c, n_total)]
    report(0, len(spanning), "importance")

    def layers():
        for i in spanning:
            keys = cache[i].keys[..., :n_prompt, :]
            yield capture.queries(i), keys, float(sites[i].module.scale)

    importance = token_importance(
        layers(), pool_kernel, on_layer=lambda done: report(done, len(spanning), "importance")
    )
    for c, rewind in zip(cache, rewinds):
        _drop_lookahead(c, n_lookahead, rewind, n_prompt)
    # Evaluate here, on the thread that built the graph, before anyone serialises it.
    mx.eval(importance, [c.state for c in cache])
    timings["importance"] = time.perf_counter() - started

    return ScoreResult(
        importance=importance,
        cache=cache,
        lookahead_tokens=lookahead,
        timings=timings,
        cached_tokens=cached,
        prompt_tokens=n_prompt,
    )
