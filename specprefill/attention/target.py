"""What sparse prefill at original positions needs, per family, and the session doing it.

A target needs none of the draft's probe: only that every position-dependent part of the model
can be driven by original positions instead of the cache index. In mlx-lm 0.32 that is:

* **rotary embeddings**: every ``rope`` module must accept per-token offsets. Besides the ones
  :mod:`specprefill.positions` supports, hunyuan's and hunyuan_v1_dense's ``DynamicNTKAlphaRoPE``
  (fixed frequencies) do, and smollm3's ``NoPE`` is the identity. ``DynamicNTKScalingRoPE``
  (and internlm3's own) changes its base with ``offset + length``: refused. Layers without rope (llama4's NoPE layers,
  nemotron-h, Granite-4.0-H) need nothing; cohere2/exaone4 keep a rope they never call.
* **position-dependent factors outside the rope**: ministral3 (and mistral3 wrapping it) scale
  queries by ``1 + β·log(1 + ⌊pos/original_max_position_embeddings⌋)`` computed from
  ``cache[0].offset``; its function is replaced, for the session, by one reading the
  position map (:data:`POSITION_FACTORS`).
* **learned absolute position embeddings** (gpt2's and gpt_bigcode's ``wpe``): found by what the
  forward feeds each embedding table (:func:`specprefill.positions.embedding_inputs`); a table fed
  the cache indices is looked up at original positions for the session, one fed anything else is
  refused by name, and the table's rows bound the prompt (:attr:`TargetProfile.max_positions`).
* **offsets as arrays**: gemma4 passes ``mx.array(cache.offset)`` to its ropes; the session's
  rope wrapper accepts 0-d arrays.
* **sliding windows**: a windowed layer must see what a full prefill would. Its mask is made
  from original positions during the sparse prefill (:class:`PositionedRotatingKVCache`), and
  the last ``window`` prompt tokens must be kept (omlx does the same), so decoding continues
  with the exact window. :func:`required_tail` says how many; a keep set without them is refused.
* **recurrent layers** consume the kept tokens in order; they have no positions. Their state
  after a sparse prefill is the state of the kept sequence, not of the prompt (an
  approximation of the prompt's state that keep-all makes exact).
* **caches**: only :data:`TARGET_CACHES` (and ``CacheList`` of them); anything else is refused
  by name at load, and a quantized target (``kv_bits``) with sliding windows is refused too.
"""
from __future__ import annotations

import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from specprefill.attention.kernel import family_modules
from specprefill.attention.probe import holds_keys, make_cache, require_layers
from specprefill.errors import UnsupportedModelError
from specprefill.options import PREFILL_STEP
from specprefill.positions import (SESSION, SUPPORTED_ROPES, EmbeddingInput, PositionedRoPE, PositionMap,
                                   SessionPositions, embeddings_at_positions, embedding_inputs, int_offset,
                                   learned_positions, resolve, rope_owners, session_positions)
from specprefill.prefill import PrefillState, Progress, as_tokens, held_tokens, run_prefill
from specprefill.wrapping import unwrap_rope

# Module-level functions that compute a position-dependent factor from the cache offset,
# by module: replaced for the session by the same formula at original positions.
POSITION_FACTORS = {"mlx_lm.models.ministral3": "_get_llama_4_attn_scale"}


def _extra_ropes() -> tuple[type, ...]:
    """Family-defined ropes that take per-token offsets: hunyuan's and hunyuan_v1_dense's
    ``DynamicNTKAlphaRoPE`` (one class each, the same code: the base is scaled by ``alpha`` once,
    at construction, and ``mx.fast.rope`` runs with those fixed frequencies) and smollm3's ``NoPE``."""
    found = []
    for module, name in (("mlx_lm.models.hunyuan", "DynamicNTKAlphaRoPE"),
                         ("mlx_lm.models.hunyuan_v1_dense", "DynamicNTKAlphaRoPE"), ("mlx_lm.models.smollm3", "NoPE")):
        __import__(module)
        found.append(getattr(sys.modules[module], name))
    return tuple(found)


POSITIONABLE_ROPES = SUPPORTED_ROPES + _extra_ropes()


@dataclass(frozen=True)
class TargetProfile:
    """What a sparse prefill of this model installs and requires."""

    family: str
    ropes: tuple[str, ...]         # rope classes wrapped
    factors: tuple[str, ...]       # position-dependent functions replaced
    window: int                    # largest sliding window (0: none): the tail that must be kept
    caches: tuple[str, ...]        # cache classes
    kv_bits: int | None = None     # the target's KV quantization (None: plain caches)
    kv_group_size: int = 64
    embeddings: tuple[EmbeddingInput, ...] = ()  # learned position embeddings, looked up by position

    @property
    def max_positions(self) -> int | None:
        """Positions the learned position embeddings cover (None: no such limit)."""
        return learned_positions(self.embeddings)


# Cache classes a sparse prefill drives (by original positions, or in order for recurrent state).
TARGET_CACHES = (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache)
# Why a cache class outside TARGET_CACHES cannot be driven, where the cause is known.
UNDRIVEN_CACHES = {
    "ChunkedKVCache": "chunked attention: the model builds its chunk mask in its own forward from cache "
                      "indices (llama4), so kept tokens cannot be placed in their original chunks",
}


def target_profile(model: nn.Module, *, kv_bits: int | None = None, kv_group_size: int = 64) -> TargetProfile:
    """Check what sparse prefill needs (module docstring); the profile or :class:`UnsupportedModelError`.

    ``kv_bits`` quantizes the target's cache; a model with sliding-window layers cannot be
    (mlx-lm has no quantized rotating cache) and is refused here, at load.
    """
    require_layers(model)
    family = type(model).__module__
    ropes = _rope_names(model, family)
    embeddings = _position_embeddings(model, family)
    factors = tuple(f"{m.__name__}.{POSITION_FACTORS[m.__name__]}" for m in family_modules(model)
                    if m.__name__ in POSITION_FACTORS)
    cache = make_cache(model, kv_bits, kv_group_size)
    _check_caches(family, cache)
    window = max([c.max_size for c in _leaves(cache) if isinstance(c, RotatingKVCache)] + _mask_windows(model),
                 default=0)
    if kv_bits is not None:
        _check_runs_quantized(model, cache)
    if kv_bits is not None and _mask_windows(model):
        raise UnsupportedModelError(f"{family}: kv_bits: windowed layers on plain caches cannot be masked by "
                                    "original position once quantized; serve this target with kv_bits unset")
    return TargetProfile(family, ropes, factors, window, tuple(sorted({type(c).__name__ for c in _leaves(cache)})),
                         kv_bits, kv_group_size, embeddings)


def _rope_names(model: nn.Module, family: str) -> tuple[str, ...]:
    """The rope classes to wrap, or the refusal naming one that per-token offsets cannot drive."""
    ropes = set()
    for owner in rope_owners(model):
        rope = unwrap_rope(owner["rope"])
        if type(rope) not in POSITIONABLE_ROPES:
            raise UnsupportedModelError(
                f"{family}: rope {type(rope).__name__} cannot be driven by original positions (its "
                f"frequencies depend on the cache offset or it takes no per-token offsets)")
        ropes.add(type(rope).__name__)
    return tuple(sorted(ropes))


def _position_embeddings(model: nn.Module, family: str) -> tuple[EmbeddingInput, ...]:
    """The learned position embeddings (fed cache indices), or the refusal naming an embedding fed
    anything else than the tokens or those indices: its ids cannot be mapped to original positions."""
    found = embedding_inputs(model)
    for table in found:
        if table.fed == "other":
            raise UnsupportedModelError(
                f"{family}: embedding {table.path} is fed ids that are neither the tokens nor the cache "
                "positions (a position embedding of an unknown kind), so sparse prefill cannot look it up "
                "at original positions")
    return tuple(t for t in found if t.fed == "positions")


def _check_caches(family: str, cache: list) -> None:
    for leaf in _leaves(cache):
        if leaf is not None and type(leaf) not in TARGET_CACHES:
            name = type(leaf).__name__
            why = UNDRIVEN_CACHES.get(name, f"supported: {', '.join(c.__name__ for c in TARGET_CACHES)}")
            raise UnsupportedModelError(f"{family}: cache {name} is not supported by sparse prefill ({why})")
        if isinstance(leaf, RotatingKVCache) and leaf.keep:
            raise UnsupportedModelError(f"{family}: RotatingKVCache with keep > 0 is not supported")


def _check_runs_quantized(model: nn.Module, cache: list) -> None:
    """A prefill step and a decode step on the quantized cache, or the refusal naming what failed."""
    try:
        for ids in ([1, 2], [3]):
            mx.eval(model(mx.array([ids], dtype=mx.int32), cache=cache))
    except Exception as exc:  # hand-written attention (gemma2), MLA's latents: no quantized path
        raise UnsupportedModelError(f"{type(model).__module__}: kv_bits: does not run with a quantized KV cache "
                                    f"({type(exc).__name__}: {str(exc)[:120]}); serve it with kv_bits unset") from None


def _mask_windows(model: nn.Module) -> list[int]:
    """Window sizes the model asks its caches for masks with (mistral3 windows plain KV caches)."""
    seen: list[int] = []
    cache = make_cache(model)
    for leaf in _leaves(cache):
        if hasattr(leaf, "make_mask") and holds_keys(leaf):
            genuine = leaf.make_mask

            def recording(*args, _genuine=genuine, **kwargs):
                if kwargs.get("window_size"):
                    seen.append(int(kwargs["window_size"]))
                return _genuine(*args, **kwargs)
            leaf.make_mask = recording
    mx.eval(model(mx.array([[1, 2]], dtype=mx.int32), cache=cache))
    return seen


def required_tail(profile: TargetProfile) -> int:
    """Prompt tokens at the end that a sparse prefill must keep (the largest sliding window)."""
    return profile.window


def _leaves(cache: list) -> list:
    return [m for c in cache for m in (c.caches if isinstance(c, CacheList) else (c,))]


def _positioned_factor(genuine: Callable, position_map: PositionMap | SessionPositions) -> Callable:
    """ministral3's query scale, at the original positions of ``offset .. offset+size-1`` (the
    genuine function where no session is open)."""
    def factor(size, offset, beta, max_position_embeddings):
        current = resolve(position_map)
        if current is None:
            return genuine(size, offset, beta, max_position_embeddings)
        positions = mx.array(current.positions(int_offset(offset), int(size)), dtype=mx.float32)
        return (1 + beta * mx.log(1 + mx.floor(positions / max_position_embeddings)))[:, None]
    factor.genuine = genuine
    return factor


class _PositionedMask:
    """Masks by original position while the cache is filled with kept tokens (see below)."""

    position_map: PositionMap

    def _prefilling(self, n: int) -> bool:
        return self.offset + n <= len(self.position_map.kept_positions)

    def _position_mask(self, N: int, held: int, window: int | None) -> mx.array:
        keys = self.position_map.positions(self.offset - held, held + N)
        queries = keys[held:]
        allowed = keys[None, :] <= queries[:, None]
        if window is not None:
            allowed &= keys[None, :] > queries[:, None] - window
        return mx.array(allowed)


class PositionedKVCache(_PositionedMask, KVCache):
    """A ``KVCache`` whose *windowed* masks (mistral3 runs ministral3's sliding layers on plain
    caches) count original positions during a sparse prefill; causal masks need nothing."""

    def __init__(self, position_map: PositionMap):
        super().__init__()
        self.position_map = position_map

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if window_size is None or not self._prefilling(N):
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        return self._position_mask(N, self.offset, window_size)


class PositionedRotatingKVCache(_PositionedMask, RotatingKVCache):
    """A sliding-window cache whose window is measured in original positions during a sparse prefill.

    While it is filled with kept tokens (cache indices below the number kept) it appends in
    temporal order (never rotating in place) and masks by position: query at p sees keys in
    ``(p - window, p]``. The keys it holds (the last ``max_size - 1`` plus the new ones) always
    include those. Decoding afterwards is mlx-lm's own: with the last ``window`` prompt tokens
    kept, the window it holds is the true one.
    """

    def __init__(self, max_size: int, position_map: PositionMap):
        super().__init__(max_size=max_size, keep=0)
        self.position_map = position_map

    def update_and_fetch(self, keys, values):
        if self._prefilling(keys.shape[2]):
            return self._update_concat(keys, values)
        return super().update_and_fetch(keys, values)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if not self._prefilling(N):
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        return self._position_mask(N, min(self.max_size - 1, self.offset), window_size or self.max_size)


def target_cache(model: nn.Module, position_map: PositionMap, kv_bits: int | None = None,
                 kv_group_size: int = 64) -> list:
    """The model's cache with each sliding-window layer made position-aware."""
    def convert(c):
        if isinstance(c, CacheList):
            return CacheList(*(convert(m) for m in c.caches))
        if type(c) is RotatingKVCache:
            return PositionedRotatingKVCache(c.max_size, position_map)
        if type(c) is KVCache:
            return PositionedKVCache(position_map)
        return c
    return [convert(c) for c in make_cache(model, kv_bits, kv_group_size)]


def positioned(cache: list, position_map: PositionMap) -> list:
    """``cache`` (a prefix from a full prefill or an earlier session) with its plain KV and
    sliding-window layers as position-aware ones masking by ``position_map``, same state."""
    def convert(c):
        if isinstance(c, CacheList):
            return CacheList(*(convert(m) for m in c.caches))
        if isinstance(c, _PositionedMask):
            c.position_map = position_map
            return c
        if type(c) is RotatingKVCache:
            out = PositionedRotatingKVCache(c.max_size, position_map)
            out.state = c.state
            return out
        if type(c) is KVCache:
            out = PositionedKVCache(position_map)
            out.keys, out.values, out.offset = c.keys, c.values, c.offset
            return out
        return c
    return [convert(c) for c in cache]


class TargetSession:
    """One request's sparse prefill on a model with position-mapped ropes and factors."""

    def __init__(self, model: nn.Module, profile: TargetProfile, position_map: PositionMap):
        self.model, self.profile, self.position_map = model, profile, position_map
        self.active = True
        self._prefilled = False

    def prefill(self, tokens: Sequence[int] | np.ndarray | mx.array, keep_indices: Sequence[int] | np.ndarray, *,
                protected_prefix: int = 0, kv_cache: list | None = None, cached_tokens: int | None = None,
                prefill_step: int = PREFILL_STEP,
                progress: Progress | None = None) -> tuple[mx.array, list, PrefillState]:
        """Prefill only ``tokens[keep_indices]``, each at its original position.

        ``keep_indices``: strictly increasing prompt indices ending at the last one; the first
        ``protected_prefix`` tokens are kept and prefilled as their own first step, and the last
        :func:`required_tail` tokens must be kept (sliding windows). ``kv_cache``: a cache of
        this model already holding the prompt's first ``c`` tokens (all kept), else a fresh
        one (quantized as the profile says); ``cached_tokens``: ``c`` as the caller prefilled it
        (a cache of recurrent layers only has no length to read; KV layers must agree). Returns the last token's logits (1, vocab), the
        cache (kept tokens only) and a :class:`~specprefill.sparse.PrefillState`; decode with
        :func:`specprefill.sparse.generate_tokens` inside the session.
        """
        if not self.active or self._prefilled:
            raise RuntimeError("target session: one prefill per open session (one request)")
        self._prefilled = True
        prompt = as_tokens(tokens)
        limit = self.profile.max_positions
        if limit is not None and len(prompt) > limit:
            raise ValueError(f"tokens: the prompt has {len(prompt)} tokens; {self.profile.family} embeds at most "
                             f"{limit} positions (learned position embeddings)")
        keep = _check_keep(keep_indices, len(prompt), protected_prefix, required_tail(self.profile))
        self.position_map.set(keep, len(prompt))
        if kv_cache is None:
            kv_cache = target_cache(self.model, self.position_map, self.profile.kv_bits, self.profile.kv_group_size)
        else:
            kv_cache = positioned(kv_cache, self.position_map)
        cached = _cached_prefix(kv_cache, keep, cached_tokens)
        started = time.perf_counter()
        logits = run_prefill(self.model, prompt[mx.array(keep[cached:])], kv_cache,
                             first_stop=max(0, protected_prefix - cached), step=prefill_step, progress=progress)
        state = PrefillState(len(prompt), len(keep), cached, time.perf_counter() - started, session=self)
        return logits, kv_cache, state


def _check_keep(keep_indices: Sequence[int], n: int, protected_prefix: int, tail: int) -> np.ndarray:
    if not 0 <= protected_prefix <= n:
        raise ValueError(f"protected_prefix: must be in [0, {n}], got {protected_prefix}")
    keep = np.asarray(keep_indices, dtype=np.int64).reshape(-1)
    if len(keep) == 0:
        raise ValueError("keep_indices: must not be empty")
    if np.any(np.diff(keep) <= 0):
        raise ValueError("keep_indices: must be strictly increasing")
    if keep[0] < 0 or keep[-1] >= n:
        raise ValueError(f"keep_indices: must lie in [0, {n}), got [{keep[0]}, {keep[-1]}]")
    if keep[-1] != n - 1:
        raise ValueError(f"keep_indices: must include the last prompt index {n - 1}")
    missing = np.setdiff1d(np.arange(max(0, n - tail), n), keep)
    if len(missing):
        raise ValueError(f"keep_indices: the last {tail} prompt tokens must be kept (sliding-window layers "
                         f"of that size), {len(missing)} are not")
    return np.union1d(np.arange(protected_prefix), keep)


def _cached_prefix(kv_cache: list, keep: np.ndarray, cached_tokens: int | None) -> int:
    """Tokens a passed-in cache holds (:func:`held_tokens`); they must be kept, from index 0."""
    cached = held_tokens(kv_cache, cached_tokens)
    if cached and (cached > len(keep) or keep[cached - 1] != cached - 1):
        raise ValueError(f"kv_cache: holds {cached} tokens; they must be the prompt's first {cached} "
                         "tokens and all kept")
    return cached


@contextmanager
def target_session(model: nn.Module, profile: TargetProfile | None = None) -> Iterator[TargetSession]:
    """Open one request's session: its position map drives the model's ropes, learned position
    embeddings and position factors in the calling context (:data:`specprefill.positions.SESSION`:
    a thread's, a greenlet's), while the genuine modules serve every other context. The wrappers
    stay installed while any session on the model is open and the genuine modules come back when
    the last one closes (on any exit)."""
    profile = profile or target_profile(model)
    position_map = PositionMap()
    session = TargetSession(model, profile, position_map)
    with ExitStack() as stack:
        stack.enter_context(_shared(("model", id(model)), lambda s: _install_positions(s, model, profile)))
        for module in family_modules(model):
            name = POSITION_FACTORS.get(module.__name__)
            if name:
                stack.enter_context(_shared(("factor", module.__name__),
                                            lambda s, m=module, n=name: _install_factor(s, m, n)))
        stack.enter_context(session_positions(position_map))
        try:
            yield session
        finally:
            session.active = False


# What is installed for open sessions: key -> [sessions using it, the ExitStack that removes it].
_SHARED: dict[tuple, list] = {}


@contextmanager
def _shared(key: tuple, install: Callable[[ExitStack], None]) -> Iterator[None]:
    """``install`` once for every session open at a time under ``key``; removed with the last."""
    entry = _SHARED.get(key)
    if entry is None:
        stack = ExitStack()
        try:
            install(stack)
        except BaseException:
            stack.close()
            raise
        entry = _SHARED[key] = [0, stack]
    entry[0] += 1
    try:
        yield
    finally:
        entry[0] -= 1
        if entry[0] == 0:
            _SHARED.pop(key, None)
            entry[1].close()


def _install_positions(stack: ExitStack, model: nn.Module, profile: TargetProfile) -> None:
    owners = rope_owners(model)
    genuine = [unwrap_rope(o["rope"]) for o in owners]
    for owner, rope in zip(owners, genuine):
        owner.rope = PositionedRoPE(rope, SESSION)
    stack.callback(_restore_ropes, owners, genuine)
    stack.enter_context(embeddings_at_positions(model, profile.embeddings, SESSION))


def _install_factor(stack: ExitStack, module, name: str) -> None:
    original = module.__dict__[name]
    plain = getattr(original, "genuine", original)
    setattr(module, name, _positioned_factor(plain, SESSION))
    stack.callback(setattr, module, name, plain)


def _restore_ropes(owners: list[nn.Module], genuine: list[nn.Module]) -> None:
    for owner, rope in zip(owners, genuine):
        owner.rope = rope

