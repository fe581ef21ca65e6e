"""The scorer on the kernel capture: any verified family, hybrid caches, quantized KV.

Phases: chunked prefill of the prompt (only the part not in a restored cache), the last
prompt token, a few seeded lookahead decode steps, importance, the cache rewound to exactly
the prompt (:func:`specprefill.scoring.score_tokens` is the validated front door), with:

* the model's :class:`~specprefill.attention.probe.AttentionProfile` deciding which layers
  vote (recurrent layers never do), and every scored step checked against it;
* queries, keys, scale, masks and sinks taken from the kernel (:mod:`.kernel`), so variants
  need no modelling; quantized caches are dequantised for the importance only;
* every cache type rewound after the lookahead (:mod:`.caches`);
* optional block boundaries: prefill steps also end at each multiple of ``block_size``, and
  ``on_step(start, end, cache)`` runs after every step over tokens ``[start, end)`` (the last
  prompt token's included), so a recorder (:class:`~specprefill.attention.caches.BlockRecorder`)
  can keep what exists only then: recurrent state after a block's last token (a recurrent
  layer cannot be rewound to an earlier token) and a sliding window's newest tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from specprefill.attention.caches import rewind, rewind_point
from specprefill.attention.importance import fold, layer_probabilities, votes
from specprefill.attention.kernel import KernelCall, KernelCapture, kernel_capture
from specprefill.attention.probe import AttentionProfile, holds_keys, make_cache, require_draft
from specprefill.errors import UnsupportedModelError
from specprefill.options import Sampling
from specprefill.prefill import Progress
from specprefill.sampling import sample

StepHook = Callable[[int, int, list], None]


@dataclass
class ScoreResult:
    """What scoring produced for one prompt of ``prompt_tokens`` tokens."""

    importance: mx.array  # float32, shape (T,), one per prompt token
    kv_cache: list  # mlx-lm cache objects holding exactly the T prompt tokens
    lookahead_tokens: list[int]  # sampled ids whose queries were captured, in order
    timings: dict[str, float] = field(default_factory=dict)  # "prefill", "lookahead", "importance"
    cached_tokens: int = 0  # prompt tokens restored from the cache passed in (0 cold)
    prompt_tokens: int = 0  # T


def prefill_ends(start: int, stop: int, step: int, block_size: int | None) -> list[int]:
    """Ends of the prefill steps over tokens ``[start, stop)``: every ``step`` tokens and every block boundary."""
    ends, position = [], start
    while position < stop:
        end = min(position + step, stop)
        if block_size:
            end = min(end, (position // block_size + 1) * block_size)
        ends.append(end)
        position = end
    return ends


def cached_length(cache: list, n_prompt: int) -> int:
    """Tokens a restored cache holds, read from its KV layers (recurrent state has no length)."""
    offsets = set()
    for entry in cache:
        for member in getattr(entry, "caches", None) or (entry,):
            if holds_keys(member):
                offsets.add(member.offset)
    if len(offsets) != 1:
        raise ValueError(f"cache: its KV layers hold different numbers of tokens {sorted(offsets)}")
    n = offsets.pop()
    if not 0 <= n < n_prompt:
        raise ValueError(f"cache holds {n} tokens; it must hold fewer than the prompt's {n_prompt}")
    return n


def _check_windows(cache: list, n_prompt: int, n_lookahead: int) -> None:
    """Refuse before any work when every KV layer is a window narrower than prompt plus lookahead."""
    windows = {getattr(m, "max_size", None) for entry in cache
               for m in (getattr(entry, "caches", None) or (entry,)) if holds_keys(m)}
    if windows and None not in windows and n_prompt + n_lookahead > max(windows):
        raise ValueError(f"tokens: a prompt of {n_prompt} tokens plus {n_lookahead} lookahead tokens is longer "
                         f"than every layer's attention window {sorted(windows)}; no layer can score it")


def _check_selection(profile: AttentionProfile, n_prompt: int, n_lookahead: int) -> None:
    """Refuse before any work when every attention layer attends to a selection of fewer keys than the
    last lookahead step has (the probe saw it select them: deepseek_v32's top-k indexer)."""
    limits = [r.selects for r in profile.layers if r.role == "attention"]
    if limits and None not in limits and n_prompt + n_lookahead > max(limits):
        raise ValueError(
            f"tokens: a prompt of {n_prompt} tokens plus {n_lookahead} lookahead tokens is more than the "
            f"{max(limits)} keys each attention layer of {profile.family} attends to (it selects them per "
            f"query, e.g. a top-k sparse indexer), so no layer attends over the whole prompt; prompts of up "
            f"to {max(limits) - n_lookahead} tokens can be scored")


def _check_step(profile: AttentionProfile, calls: Sequence[KernelCall], step: str) -> None:
    counts = {}
    for call in calls:
        counts[call.layer] = counts.get(call.layer, 0) + 1
    for role in profile.layers:
        expected = 1 if role.role == "attention" else 0
        if counts.get(role.index, 0) != expected:
            raise UnsupportedModelError(
                f"layer {role.index}: {counts.get(role.index, 0)} attention computations in {step}; the "
                f"model's profile ({profile.describe()}) expects {expected}")


def _forward(model: nn.Module, token: int, cache: list, capture: KernelCapture, *, scored: bool,
             last: bool, profile: AttentionProfile, step: str) -> tuple[mx.array, list[KernelCall]]:
    capture.recording, capture.keep_keys = scored, scored and last
    start = len(capture.calls)
    logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)
    mx.eval(logits, capture.pending_arrays(start))
    capture.recording = capture.keep_keys = False
    calls = capture.calls[start:]
    if scored:
        _check_step(profile, calls, step)
    return logits, calls


def _importance(profile: AttentionProfile, steps: list[list[KernelCall]], key_counts: list[int],
                n_prompt: int, pool_kernel: int, report: Progress) -> mx.array:
    def layers():
        for index in profile.attention_layers:
            calls = [next(c for c in step if c.layer == index) for step in steps]
            if votes(calls, key_counts):
                probs = layer_probabilities(calls, n_prompt)
                if probs is not None:
                    yield probs
    report(0, len(profile.attention_layers), "importance")
    try:
        return fold(layers(), pool_kernel, on_layer=lambda done: report(done, len(profile.attention_layers),
                                                                       "importance"))
    except ValueError:
        raise ValueError(f"tokens: a prompt of {n_prompt} tokens plus the lookahead is longer than every "
                         "attention layer's window; no layer can score it") from None


def _prefill(model: nn.Module, prompt: list[int], cache: list, start: int, step: int,
             block_size: int | None, on_step: StepHook | None, report: Progress) -> None:
    for end in prefill_ends(start, len(prompt) - 1, step, block_size):
        model(mx.array([prompt[start:end]], dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])
        if on_step is not None:
            on_step(start, end, cache)
        start = end
        report(end, len(prompt), "prefill")


def score_prompt(model: nn.Module, tokens: Sequence[int], profile: AttentionProfile, *,
                 n_lookahead: int = 8, temperature: float = 0.6, top_p: float = 0.95,
                 greedy: bool = False, seed: int = 0, pool_kernel: int = 13, prefill_step: int = 2048,
                 include_last_query: bool = True, cache: list | None = None,
                 block_size: int | None = None, on_step: StepHook | None = None,
                 progress: Progress | None = None) -> ScoreResult:
    """Importance of every prompt token under the verified draft ``model`` (see the module docstring).

    ``cache`` is a restored prefix (fewer tokens than the prompt), extended in place. Argument
    checks beyond these are :func:`specprefill.scoring.score_tokens`'s and stay there.
    """
    require_draft(profile)
    prompt = [int(t) for t in tokens]
    n_prompt = len(prompt)
    if n_prompt == 0 or (n_lookahead == 0 and not include_last_query):
        raise ValueError("tokens: need at least one token and one scored query")
    report = progress or (lambda *_: None)
    timings, started = {}, time.perf_counter()
    if cache is None:
        cache, cached = make_cache(model, profile.kv_bits, profile.kv_group_size), 0
    else:
        cached = cached_length(cache, n_prompt)
    _check_windows(cache, n_prompt, n_lookahead)
    _check_selection(profile, n_prompt, n_lookahead)
    report(cached, n_prompt, "prefill")
    _prefill(model, prompt, cache, cached, prefill_step, block_size, on_step, report)
    with kernel_capture(model) as capture:
        steps, lookahead, points = _score_steps(model, prompt, cache, capture, profile, n_lookahead,
                                                include_last_query, dict(temperature=temperature, top_p=top_p,
                                                                         greedy=greedy), seed,
                                                on_step, report, timings, started)
    started = time.perf_counter()
    key_counts = ([n_prompt] if include_last_query else []) + [n_prompt + 1 + i for i in range(n_lookahead)]
    importance = _importance(profile, steps, key_counts, n_prompt, pool_kernel, report)
    for entry, point in zip(cache, points):
        rewind(entry, point)
    mx.eval(importance, [c.state for c in cache])
    timings["importance"] = time.perf_counter() - started
    return ScoreResult(importance, cache, lookahead, timings, cached, n_prompt)


def _score_steps(model, prompt, cache, capture, profile, n_lookahead, include_last, sampling, seed,
                 on_step, report, timings, started):
    """The last prompt token, then the seeded lookahead; returns the scored steps' calls."""
    n_prompt, steps, lookahead = len(prompt), [], []
    logits, calls = _forward(model, prompt[-1], cache, capture, scored=include_last,
                             last=n_lookahead == 0, profile=profile, step="the last prompt token")
    if include_last:
        steps.append(calls)
    if on_step is not None:
        on_step(n_prompt - 1, n_prompt, cache)
    points = [rewind_point(c) for c in cache]
    report(n_prompt, n_prompt, "prefill")
    timings["prefill"], started = time.perf_counter() - started, time.perf_counter()
    key = mx.random.key(seed)
    report(0, n_lookahead, "lookahead")
    for i in range(n_lookahead):
        key, subkey = mx.random.split(key)
        token = int(sample(logits[0, -1], subkey, Sampling(**sampling, seed=seed)).item())
        lookahead.append(token)
        logits, calls = _forward(model, token, cache, capture, scored=True, last=i == n_lookahead - 1,
                                 profile=profile, step=f"lookahead step {i + 1}")
        steps.append(calls)
        report(i + 1, n_lookahead, "lookahead")
    timings["lookahead"] = time.perf_counter() - started
    return steps, lookahead, points
