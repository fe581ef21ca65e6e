"""Position-dependent inputs at arbitrary (non-contiguous) token positions: rotary embeddings and
learned absolute position embeddings (installed per request by
:func:`specprefill.attention.target.target_session`).

mlx-lm attention modules rotate queries and keys with ``self.rope(x, offset=cache.offset)``,
so the position of a token is its index in the KV cache. After a sparse prefill the cache
holds only the kept tokens, so cache index and prompt position differ. :class:`PositionedRoPE`
wraps an attention module's genuine rope and translates the cache offset it is called with
into original positions through a shared :class:`PositionMap`:

* cache index ``i < K`` (a kept prompt token) -> ``kept_positions[i]``;
* cache index ``i >= K`` (a generated token) -> ``i - K + prompt_length``, so decoding
  continues at the true prompt length.

Per-token positions use ``mx.fast.rope``'s per-batch-element offsets: every token becomes its
own batch element, so the genuine module's own ``__call__`` (its frequencies, input scaling,
partial rotary dims) does the rotation and the result is bit-identical to its contiguous path.

Learned absolute position embeddings (gpt2's and gpt_bigcode's ``wpe``) are an embedding table
indexed by ``cache.offset + arange(L)``: :func:`embedding_inputs` finds every embedding of a
model by running it and reading what each is fed (the tokens, the cache indices plus a
constant, or something else), and :class:`PositionedEmbedding` turns the cache indices it is
fed into original positions through the same map. Past the table's last row an embedding
reads no defined memory, so those positions are refused (:func:`learned_positions`).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import rope_utils
from mlx_lm.models.cache import make_prompt_cache

from specprefill.wrapping import Wrapper, unwrap_rope

# Variants whose __call__ passes ``offset`` straight to mx.fast.rope (vector offsets allowed).
SUPPORTED_ROPES: tuple[type, ...] = (
    nn.RoPE,
    rope_utils.Llama3RoPE,
    rope_utils.YarnRoPE,
    rope_utils.SuScaledRoPE,
    rope_utils.ProportionalRoPE,
)


class PositionMap:
    """Maps KV-cache indices to original prompt positions (identity until :meth:`set`)."""

    def __init__(self) -> None:
        self.kept_positions = np.zeros(0, dtype=np.int64)
        self.prompt_length = 0

    def set(self, kept_positions: np.ndarray, prompt_length: int) -> None:
        """Cache index i holds prompt token ``kept_positions[i]``; later tokens follow the prompt."""
        self.kept_positions = np.asarray(kept_positions, dtype=np.int64)
        self.prompt_length = int(prompt_length)

    def positions(self, offset: int, length: int) -> np.ndarray:
        """Original positions of cache indices ``offset .. offset+length-1``."""
        return self.at(np.arange(offset, offset + length, dtype=np.int64))

    def at(self, index: np.ndarray) -> np.ndarray:
        """Original positions of the cache indices ``index`` (any shape)."""
        kept = self.kept_positions
        generated = index - len(kept) + self.prompt_length
        if len(kept) == 0:
            return generated
        return np.where(index < len(kept), kept[np.clip(index, 0, len(kept) - 1)], generated)


_SESSION_MAP: ContextVar[PositionMap | None] = ContextVar("specprefill_session_map", default=None)


class SessionPositions:
    """Stands for the position map of the target session open in the calling context (a thread,
    an asyncio task, a greenlet: each has its own), None outside one. Wrappers given it instead of
    a :class:`PositionMap` act as the genuine module in any other context, so one model serves a
    session's sparse prefill and, between its chunks, other requests' plain passes (a worker
    engine's batched decode) with their own positions."""

    def current(self) -> PositionMap | None:
        return _SESSION_MAP.get()


SESSION = SessionPositions()


@contextmanager
def session_positions(position_map: PositionMap) -> Iterator[None]:
    """Make ``position_map`` the calling context's session map (:data:`SESSION`) for the block."""
    token = _SESSION_MAP.set(position_map)
    try:
        yield
    finally:
        try:
            _SESSION_MAP.reset(token)
        except ValueError:  # closed from another context (a collected greenlet): clear it there
            _SESSION_MAP.set(None)


def resolve(position_map: PositionMap | SessionPositions) -> PositionMap | None:
    """The map to use now: ``position_map``, or the session's for :data:`SESSION` (None: none open)."""
    return position_map.current() if isinstance(position_map, SessionPositions) else position_map


def rope_at_positions(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """Apply ``rope`` to ``x`` (B, heads, L, D) with token ``l`` at ``positions[l]``."""
    B, H, L, D = x.shape
    per_token = x.transpose(2, 0, 1, 3).reshape(L, B * H, 1, D)
    rotated = rope(per_token, offset=positions)
    return rotated.reshape(L, B, H, D).transpose(1, 2, 0, 3)


def int_offset(offset: Any) -> int:
    if isinstance(offset, mx.array) and offset.ndim == 0:
        return int(offset.item())  # gemma4 wraps cache.offset in an array
    if isinstance(offset, int):
        return offset
    raise ValueError("offset: sparse positions support one sequence (a scalar cache offset) only")


class PositionedRoPE(Wrapper):
    """Wraps a genuine rope module; rotates at the positions a :class:`PositionMap` gives.

    Attribute access falls through to the genuine module (``dims``, ``_freqs``, ...).
    """

    def __init__(self, genuine: nn.Module, position_map: PositionMap | SessionPositions):
        super().__init__(genuine)
        self.position_map = position_map

    def __call__(self, x: mx.array, offset: Any = 0, **kwargs) -> mx.array:
        position_map = resolve(self.position_map)
        if position_map is None:  # no session in this context: the genuine rope, offsets as given
            return self.genuine(x, offset=offset, **kwargs)
        positions = position_map.positions(int_offset(offset), x.shape[-2])
        if positions[-1] - positions[0] == len(positions) - 1:
            # Contiguous run (always true while decoding): the genuine fast path.
            return self.genuine(x, offset=int(positions[0]), **kwargs)
        if kwargs:
            raise ValueError(f"rope keyword arguments {sorted(kwargs)} are not supported at sparse positions")
        return rope_at_positions(self.genuine, x, mx.array(positions, dtype=mx.int32))


def rope_owners(model: nn.Module) -> list[nn.Module]:
    """Every module holding a ``rope`` child (the attention modules)."""
    return [m for _, m in model.named_modules() if isinstance(m.get("rope"), nn.Module)]


EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)


@dataclass(frozen=True)
class EmbeddingInput:
    """One embedding table of a model and what its forward feeds it."""

    path: str        # where it sits in the module tree, e.g. "model.wpe"
    fed: str         # "tokens" (ids from the tokens alone), "positions" (cache index + ``shift``) or "other"
    size: int        # rows of the table
    shift: int = 0   # positions: the id fed for cache index i is i + shift


class PositionedEmbedding(Wrapper):
    """Wraps a learned position embedding fed cache indices (+ ``shift``); looks up original positions."""

    def __init__(self, genuine: nn.Module, position_map: PositionMap | SessionPositions, shift: int, size: int):
        super().__init__(genuine)
        self.position_map, self.shift, self.size = position_map, shift, size

    def __call__(self, ids: mx.array) -> mx.array:
        position_map = resolve(self.position_map)
        if position_map is None:
            return self.genuine(ids)
        positions = position_map.at(np.array(ids).astype(np.int64) - self.shift)
        if positions.size and positions.max() >= self.size - self.shift:
            raise ValueError(f"position {int(positions.max())}: past the model's {self.size - self.shift} "
                             "learned positions")
        return self.genuine(mx.array(positions + self.shift, dtype=ids.dtype))


def _embedding_slots(model: nn.Module) -> Iterator[tuple[Any, Any, str, nn.Module]]:
    """``(holder, key, path, module)`` of every embedding table, unwrapped (``holder[key]`` holds it)."""
    def walk(holder: Any, key: Any, path: str, value: Any) -> Iterator[tuple[Any, Any, str, nn.Module]]:
        genuine = unwrap_rope(value)
        if isinstance(genuine, EMBEDDINGS):
            yield holder, key, path, genuine
        elif isinstance(genuine, nn.Module):
            for name, child in genuine.items():
                yield from walk(genuine, name, f"{path}.{name}" if path else name, child)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield from walk(value, i, f"{path}.{i}", item)
        elif isinstance(value, dict):
            for name, item in value.items():
                yield from walk(value, name, f"{path}.{name}", item)
    for name, child in model.items():
        yield from walk(model, name, name, child)


class _Recording(Wrapper):
    def __init__(self, genuine: nn.Module, seen: list):
        super().__init__(genuine)
        object.__setattr__(self, "_seen", seen)

    def __call__(self, ids: mx.array) -> mx.array:
        self._seen.append(np.array(ids).astype(np.int64).reshape(-1))
        return self.genuine(ids)


# Forward passes as (cache offset, tokens): the same tokens at two offsets, then others; ids that are
# neither the tokens nor offset + arange.
_FEEDS = ((0, (11, 13)), (2, (11, 13)), (4, (17, 19, 23)))


def _classify(seen: list[np.ndarray]) -> tuple[str, int]:
    """What a table was fed in the :data:`_FEEDS` passes: ``("tokens", 0)`` when its ids follow the
    tokens alone (the same tokens at another offset, the same ids), ``("positions", shift)`` when
    they are ``offset + arange(L) + shift`` every time, else ``("other", 0)``."""
    if len(seen) != len(_FEEDS):
        return "other", 0
    if np.array_equal(seen[0], seen[1]):
        return "tokens", 0
    shifts = {int(ids[0]) - offset if len(ids) == len(tokens) and np.all(np.diff(ids) == 1) else -1
              for ids, (offset, tokens) in zip(seen, _FEEDS)}
    if len(shifts) == 1 and min(shifts) >= 0:
        return "positions", shifts.pop()
    return "other", 0


def embedding_inputs(model: nn.Module) -> list[EmbeddingInput]:
    """Every embedding table the model's forward looks up, and what it feeds each (see the module
    docstring), found by three short forward passes on a fresh cache; tables it never calls are
    left out."""
    slots = list(_embedding_slots(model))
    seen: list[list[np.ndarray]] = [[] for _ in slots]
    for (holder, key, _, module), record in zip(slots, seen):
        holder[key] = _Recording(module, record)
    try:
        cache = make_prompt_cache(model)
        for _, tokens in _FEEDS:
            mx.eval(model(mx.array([list(tokens)], dtype=mx.int32), cache=cache))
    finally:
        for holder, key, _, module in slots:
            holder[key] = module
    found = []
    for (_, _, path, module), record in zip(slots, seen):
        if record:
            fed, shift = _classify(record)
            found.append(EmbeddingInput(path, fed, int(module.weight.shape[0]), shift))
    return found


def learned_positions(inputs: Sequence[EmbeddingInput]) -> int | None:
    """How many positions the model's learned position embeddings cover (None: none, no limit)."""
    sizes = [e.size - e.shift for e in inputs if e.fed == "positions"]
    return min(sizes) if sizes else None


@contextmanager
def embeddings_at_positions(model: nn.Module, inputs: Sequence[EmbeddingInput],
                            position_map: PositionMap | SessionPositions) -> Iterator[None]:
    """Install a :class:`PositionedEmbedding` on each learned position embedding of ``inputs`` for the
    block; always puts the genuine tables back (a wrapper left by an aborted request is replaced)."""
    wanted = {e.path: e for e in inputs if e.fed == "positions"}
    slots = [slot for slot in _embedding_slots(model) if slot[2] in wanted]
    try:
        for holder, key, path, module in slots:
            holder[key] = PositionedEmbedding(module, position_map, wanted[path].shift, wanted[path].size)
        yield
    finally:
        for holder, key, _, module in slots:
            holder[key] = module
