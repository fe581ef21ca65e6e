"""Score every prompt token with a draft model (the SpecPrefill speculator).

Phases: chunked prefill of the prompt (only the part not in a restored cache), a few
seeded lookahead decode steps with the post-RoPE queries captured, then importance
(see :mod:`specprefill.importance`). The returned cache describes exactly the prompt,
so it can be stored and reused; the model is left exactly as it was found.

The model comes as a :class:`~specprefill.profile.ModelProfile` (``profile_model(model)``,
once per model): its attention sites were verified when it was profiled, so scoring runs
no probe of its own.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from specprefill.capture import QueryCapture, UnsupportedModelError, capture_queries
from specprefill.importance import token_importance
from specprefill.options import ScoringOptions
from specprefill.profile import ModelProfile
from specprefill.sampling import sample

__all__ = ["ScoreResult", "ScoringOptions", "UnsupportedModelError", "score_tokens"]

Progress = Callable[[int, int, str], None]


@dataclass
class ScoreResult:
    """What scoring produced for one prompt of ``prompt_tokens`` tokens."""

    importance: mx.array  # float32, shape (T,), one per prompt token
    kv_cache: list  # mlx-lm cache objects holding exactly the T prompt tokens
    lookahead_tokens: list[int]  # sampled ids whose queries were captured, in order
    timings: dict[str, float] = field(default_factory=dict)  # "prefill", "lookahead", "importance"
    cached_tokens: int = 0  # prompt tokens restored from the cache passed in (0 cold)
    prompt_tokens: int = 0  # T


def _ignore_progress(processed: int, total: int, phase: str) -> None:
    pass


def _prompt(tokens: Any, vocab_size: int | None) -> list[int]:
    if isinstance(tokens, mx.array):
        tokens = np.array(tokens)
    values = np.asarray(tokens)
    if values.ndim != 1 or values.size == 0 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D sequence of token ids, got shape {values.shape}")
    if values.min() < 0:
        raise ValueError("tokens must be non-negative token ids")
    if vocab_size is not None and values.max() >= vocab_size:
        raise ValueError(f"tokens must be ids below the model's vocab_size {vocab_size}, got {values.max()}")
    return [int(t) for t in values]


def _restored_length(kv_cache: list, n_layers: int, n_prompt: int) -> int:
    if not isinstance(kv_cache, (list, tuple)) or len(kv_cache) != n_layers:
        size = len(kv_cache) if isinstance(kv_cache, (list, tuple)) else type(kv_cache).__name__
        raise ValueError(f"kv_cache must be a list of {n_layers} per-layer caches, got {size}")
    offsets = {getattr(c, "offset", None) for c in kv_cache}
    if len(offsets) != 1 or not isinstance(next(iter(offsets)), int):
        raise ValueError("kv_cache layers must all hold the same number of tokens, got offsets "
                         f"{sorted(map(str, offsets))}")
    n = offsets.pop()
    if not 0 <= n < n_prompt:
        raise ValueError(
            f"kv_cache holds {n} tokens; it must hold fewer than the prompt's {n_prompt} "
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


def _eval_cache(kv_cache: list) -> None:
    mx.eval([c.state for c in kv_cache])


def _prompt_cache(profile: ModelProfile, kv_cache: list | None, n_prompt: int,
                  n_lookahead: int) -> tuple[list, int]:
    """The cache to score in (a fresh one, or the restored prefix) and how many tokens it holds."""
    if kv_cache is None:
        kv_cache, cached = make_prompt_cache(profile.model), 0
    else:
        cached = _restored_length(kv_cache, len(profile.sites), n_prompt)
    n_total = n_prompt + n_lookahead
    if not any(_spans(c, n_total) for c in kv_cache):
        windows = sorted({getattr(c, "max_size", None) for c in kv_cache})
        raise ValueError(
            f"tokens: a prompt of {n_prompt} tokens plus {n_lookahead} lookahead tokens is longer than "
            f"every layer's attention window {windows}; no layer can score it"
        )
    return kv_cache, cached


def _prefill(model: nn.Module, prompt: list[int], kv_cache: list, cached: int, step: int,
             report: Progress) -> None:
    """Prefill all but the last prompt token in chunks; its query and logits come next."""
    n_prompt = len(prompt)
    report(cached, n_prompt, "prefill")
    position = cached
    while position < n_prompt - 1:
        end = min(position + step, n_prompt - 1)
        model(mx.array(prompt[position:end], dtype=mx.int32)[None], cache=kv_cache)
        _eval_cache(kv_cache)
        position = end
        report(position, n_prompt, "prefill")


def _lookahead(model: nn.Module, logits: mx.array, kv_cache: list, options: ScoringOptions,
               capture: QueryCapture, report: Progress) -> list[int]:
    """Sample ``n_lookahead`` tokens one at a time, recording their queries."""
    key = mx.random.key(options.seed)
    sampling = options.sampling
    lookahead: list[int] = []
    report(0, options.n_lookahead, "lookahead")
    for step in range(options.n_lookahead):
        key, subkey = mx.random.split(key)
        token = int(sample(logits[0, -1], subkey, sampling).item())
        lookahead.append(token)
        with capture.recording():
            logits = model(mx.array([[token]], dtype=mx.int32), cache=kv_cache)
            mx.eval(logits)
        report(step + 1, options.n_lookahead, "lookahead")
    return lookahead


def _importance(profile: ModelProfile, capture: QueryCapture, kv_cache: list, n_prompt: int,
                options: ScoringOptions, report: Progress) -> mx.array:
    """Importance from the captured queries over the prompt keys of every layer spanning them."""
    n_total = n_prompt + options.n_lookahead
    spanning = [i for i, c in enumerate(kv_cache) if _spans(c, n_total)]
    report(0, len(spanning), "importance")
    layers = ((capture.queries(i), kv_cache[i].keys[..., :n_prompt, :], float(profile.sites[i].module.scale))
              for i in spanning)
    return token_importance(layers, options.pool_kernel,
                            on_layer=lambda done: report(done, len(spanning), "importance"))


def score_tokens(
    profile: ModelProfile,
    tokens: Sequence[int],
    options: ScoringOptions = ScoringOptions(),
    *,
    kv_cache: list | None = None,
    progress: Progress | None = None,
) -> ScoreResult:
    """Importance of every token of ``tokens`` under the draft model of ``profile``.

    ``kv_cache`` (optional) is a restored prefix of this prompt, fewer tokens than the
    prompt; it is extended in place and returned in the result (on an exception it may
    be left partly extended). ``progress(processed, total, phase)`` is called at each
    phase start and after each prefill chunk, lookahead step and importance layer; it
    may raise to abort, and the exception propagates with the model untouched.
    Sampling uses an explicit key derived from ``options.seed`` (greedy or temperature
    0: argmax), so equal inputs give equal results on every run and machine.
    """
    model = profile.model
    prompt = _prompt(tokens, profile.vocab_size)
    n_prompt = len(prompt)
    report = progress or _ignore_progress
    timings: dict[str, float] = {}
    started = time.perf_counter()
    kv_cache, cached = _prompt_cache(profile, kv_cache, n_prompt, options.n_lookahead)
    _prefill(model, prompt, kv_cache, cached, options.prefill_step, report)
    with capture_queries(profile.sites) as capture:
        with capture.recording() if options.include_last_query else nullcontext():
            logits = model(mx.array([[prompt[-1]]], dtype=mx.int32), cache=kv_cache)
            mx.eval(logits)
        rewinds = [_rewind_point(c) for c in kv_cache]
        report(n_prompt, n_prompt, "prefill")
        timings["prefill"], started = time.perf_counter() - started, time.perf_counter()
        lookahead = _lookahead(model, logits, kv_cache, options, capture, report)
    timings["lookahead"], started = time.perf_counter() - started, time.perf_counter()
    importance = _importance(profile, capture, kv_cache, n_prompt, options, report)
    for c, rewind in zip(kv_cache, rewinds):
        _drop_lookahead(c, options.n_lookahead, rewind, n_prompt)
    # Evaluate here, on the thread that built the graph, before anyone serialises it.
    mx.eval(importance, [c.state for c in kv_cache])
    timings["importance"] = time.perf_counter() - started
    return ScoreResult(importance=importance, kv_cache=kv_cache, lookahead_tokens=lookahead,
                       timings=timings, cached_tokens=cached, prompt_tokens=n_prompt)
