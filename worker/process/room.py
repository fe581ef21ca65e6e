"""How many jobs a worker holds at once: ``max_jobs_in_flight``, and a KV memory budget.

A job enters when a slot is free and, with ``kv_budget_bytes`` set, when its KV fits beside
what the jobs in flight reserve: its model's KV bytes per token (measured once per model and
role, :func:`kv_bytes_of`) times its prompt's tokens plus its ``max_tokens``, plus the
per-sequence state a recurrent layer keeps whatever the length. A generate or heal job's
KV is its target's, a prefill job's the draft's. The prompt is counted whole even when the
target will prefill only the kept part: the estimate never falls short.

A job whose size cannot be known yet (its model is not loaded: it loads it) enters only
alone, and nothing joins it until its model is loaded and its size known. A job larger than
the whole budget runs alone too: the budget bounds what runs together, ``max_prompt_tokens``
what runs at all. A job that does not fit goes back to the front of its queue, where another
worker may take it; this worker takes nothing more until one of its jobs ends.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from jobs.contract.heal import heal_spec_from_payload, is_heal_payload
from jobs.contract.spec import spec_from_payload
from jobs.settings import Settings

log = logging.getLogger(__name__)

PROBE_TOKENS = 4  # tokens run through a fresh cache to see what each layer keeps


@dataclass(frozen=True)
class KVSize:
    """A model's KV memory: ``per_token`` bytes for each token held, ``fixed`` per sequence."""

    per_token: float
    fixed: int

    def of(self, tokens: int) -> int:
        return int(self.fixed + self.per_token * tokens + 0.5)


def kv_bytes_of(model: Any, kv_bits: int | None = None, kv_group_size: int = 64) -> KVSize | None:
    """``model``'s KV size, read off its cache (quantized as jobs run it) after a few tokens: a
    layer holding keys and values (plain, quantized or windowed; a window is counted as if it
    kept every token, so the estimate never falls short) adds their bytes per position, a
    layer holding a recurrent state adds that state's bytes once. None for something that is
    no MLX model (a test's fake)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from specprefill.attention.probe import make_cache

    if not isinstance(model, nn.Module):
        return None
    cache = make_cache(model, kv_bits, kv_group_size)
    model(mx.ones((1, PROBE_TOKENS), dtype=mx.int32), cache=cache)
    per_token, fixed = 0.0, 0
    for layer in _leaves(cache):
        held = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        arrays = [a for x in held if x is not None for a in (x if isinstance(x, (tuple, list)) else (x,))]
        if arrays:  # (batch, heads, positions, width): bytes per position, whatever is preallocated
            per_token += sum(a.nbytes / a.shape[2] for a in arrays)
        else:
            fixed += sum(a.nbytes for _, a in tree_flatten(layer.state) if isinstance(a, mx.array))
    return KVSize(per_token, fixed)


def _leaves(cache: Any) -> Iterable[Any]:
    for c in cache:
        sub = getattr(c, "caches", None)  # a CacheList (hybrid layers) holds several
        yield from (_leaves(sub) if isinstance(sub, (list, tuple)) else (c,))


@dataclass(frozen=True)
class JobSize:
    """What a queued job will hold: ``tokens`` (prompt plus what it may generate) through
    model ``model`` in ``role``; ``bytes`` None while that model is not loaded here."""

    model: str
    role: str  # "target" or "draft"
    tokens: int
    bytes: int | None = None


class Room:
    """The slots and the KV budget of one worker (see the module docstring)."""

    def __init__(self, settings: Settings, pool: Any) -> None:
        self.settings, self.pool = settings, pool
        self.max_jobs = settings.max_jobs_in_flight
        self.budget = settings.kv_budget_bytes
        self._sizes: dict[tuple[str, str], KVSize | None] = {}  # (model identity, role)

    def size_of(self, payload: Any) -> JobSize | None:
        """What the job of ``payload`` will hold; None for a payload that fails anyway (it is
        let in and fails at once, saying why) or when there is no budget to check."""
        if not self.budget:
            return None
        try:
            return self._size(payload)
        except Exception as exc:  # a bad payload, an unknown model, a template that raises
            log.debug("room: cannot size a job (%s: %s); it is let in and fails on its own",
                      type(exc).__name__, exc)
            return None

    def _size(self, payload: Any) -> JobSize:
        from worker.job.prompt import tokenize_prompt

        s = self.settings
        if is_heal_payload(payload):
            heal = heal_spec_from_payload(payload, s)
            return self.priced(JobSize(heal.target_model, "target", len(heal.tokens)))
        spec = spec_from_payload(payload, s)
        generate = spec.kind == "generate"
        name, field = (spec.target_model, "target_model") if generate else (spec.draft_model, "draft_model")
        if spec.tokens is not None:
            prompt = len(spec.tokens)
        else:
            prompt = len(tokenize_prompt(spec, self.pool.prompt_tools(name, field)[0]).tokens)
        extra = spec.generate.max_tokens if generate and spec.generate is not None else 0
        return self.priced(JobSize(name, "target" if generate else "draft", prompt + extra))

    def priced(self, size: JobSize) -> JobSize:
        """``size`` with its bytes, if its model is loaded here (measured once per model and role)."""
        loaded = self.pool.loaded_model(size.model)
        if loaded is None:
            return size
        key = (loaded.identity, size.role)
        if key not in self._sizes:
            kv = self.settings.kv_quantization(size.role)
            self._sizes[key] = kv_bytes_of(loaded.model, *kv)
            if self._sizes[key] is not None:
                log.info("room: %s as %s holds %.0f KV bytes per token (+%d per sequence)", size.model,
                         size.role, self._sizes[key].per_token, self._sizes[key].fixed)
        kv_size = self._sizes[key]
        return size if kv_size is None else JobSize(size.model, size.role, size.tokens, kv_size.of(size.tokens))

    def admits(self, size: JobSize | None, held: list[JobSize | None]) -> bool:
        """Whether a job of ``size`` may join the jobs holding ``held`` (their sizes, priced
        again by the caller once their models are loaded) under the slots and the budget."""
        if len(held) >= self.max_jobs:
            return False
        if not self.budget or not held:
            return True  # no budget, or alone: a job always runs alone
        if size is None:
            return True  # sized at none: it fails at once
        if size.bytes is None or any(h is not None and h.bytes is None for h in held):
            return False  # an unknown size: alone only, and nothing joins it
        return size.bytes + self.reserved(held) <= self.budget

    @staticmethod
    def reserved(held: Iterable[JobSize | None]) -> int:
        """The KV bytes ``held`` reserve (unknown sizes count 0: they run alone)."""
        return sum(h.bytes for h in held if h is not None and h.bytes is not None)
