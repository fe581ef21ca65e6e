"""Every mlx-lm cache type as snapshots and as per-layer named arrays (hybrid models included).

mlx-lm 0.32 gives a layer one of: ``KVCache`` (keys/values grown in 256-token steps),
``QuantizedKVCache`` (keys and values as (packed, scales, biases) triples), ``RotatingKVCache``
(a sliding window of ``max_size`` tokens), ``ArraysCache`` (recurrent state: Mamba-2's conv
and SSM state, Gated DeltaNet's, LFM2's short-conv window; mlx-lm 0.32 has no ``MambaCache``
class any more) or ``CacheList`` (falcon-h1: Mamba state and KV in one layer), or none at all
(nemotron-h's MLP blocks get no cache entry; gemma4's KV-shared layers none either).

* :func:`rewind_point` / :func:`rewind`: the lookahead leaves no trace. Unbounded KV caches
  are trimmed (no copy of the prompt's keys); everything else (windows, llama4's attention
  chunks, recurrent state) is snapshotted before the lookahead and put back after, on the same
  objects.
* :func:`layer_arrays` / :func:`layer_from_arrays`: one layer's cache as ``meta`` (class and
  integers) plus named arrays, and back. Token-indexed arrays are named ``keys*``/``values*``
  (tokens on axis 2); fixed-size recurrent state ``state.<i>``; CacheList members are
  prefixed ``<member>.``. This is the "per layer, named arrays" shape the store will hold.
* :func:`block_arrays` / :func:`assemble`: what one block of ``[start, end)`` holds per layer
  (its tokens' K/V, and for recurrent layers the state after token ``end - 1``) and how a
  prefix is rebuilt from consecutive blocks (K/V of all of them, state of the last).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from specprefill.errors import UnsupportedModelError

QUANT_PARTS = ("packed", "scales", "biases")


def _copy(a: Any) -> Any:
    # A distinct array object: caches update by rebinding the arrays they hold in place.
    return mx.array(a) if isinstance(a, mx.array) else a


def rewind_point(entry: Any) -> Any:
    """What :func:`rewind` needs to put ``entry`` back as it is now."""
    if type(entry) in (KVCache, QuantizedKVCache):
        return ("trim", entry.offset)
    if isinstance(entry, RotatingKVCache):
        return ("state", tuple(_copy(v) for v in entry.state))
    if isinstance(entry, ChunkedKVCache):
        # The model trims its front when the next step starts (maybe_trim_front), so a lookahead
        # can drop keys a trim cannot bring back: the held keys are snapshotted, not trimmed.
        held = entry.offset - entry.start_position
        keys, values = (None, None) if entry.keys is None else (
            _copy(entry.keys[..., :held, :]), _copy(entry.values[..., :held, :]))
        return ("state", (keys, values, entry.offset, entry.chunk_size, entry.start_position))
    if isinstance(entry, ArraysCache):
        return ("arrays", [_copy(a) for a in entry.cache], _copy(entry.left_padding), _copy(entry.lengths))
    if isinstance(entry, CacheList):
        return ("list", [rewind_point(c) for c in entry.caches])
    raise UnsupportedModelError(f"cache {type(entry).__name__}: no rule to undo the lookahead on it")


def _slice_tokens(x: Any, n: int) -> Any:
    if isinstance(x, tuple):
        return tuple(a[..., :n, :] for a in x)
    return x[..., :n, :]


def rewind(entry: Any, point: Any) -> None:
    """Put ``entry`` back to ``point``; buffers of trimmed caches end exactly at the kept tokens."""
    kind = point[0]
    if kind == "trim":
        n = point[1]
        entry.trim(entry.offset - n)
        if entry.keys is not None:
            entry.keys, entry.values = _slice_tokens(entry.keys, n), _slice_tokens(entry.values, n)
    elif kind == "state":
        entry.state = point[1]
    elif kind == "arrays":
        entry.cache, entry.left_padding, entry.lengths = list(point[1]), point[2], point[3]
    else:
        for member, member_point in zip(entry.caches, point[1]):
            rewind(member, member_point)


def _temporal(entry: RotatingKVCache) -> tuple[mx.array, mx.array]:
    if entry.keep:
        raise UnsupportedModelError("RotatingKVCache with keep > 0 is not supported here")
    return entry._temporal_order(entry.keys), entry._temporal_order(entry.values)


def layer_arrays(entry: Any) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """``(meta, arrays)`` describing one layer's cache exactly (see the module docstring)."""
    if entry is None:
        return {"class": "none"}, {}
    if isinstance(entry, CacheList):
        meta, arrays = {"class": "CacheList", "members": []}, {}
        for i, member in enumerate(entry.caches):
            m, a = layer_arrays(member)
            meta["members"].append(m)
            arrays.update({f"{i}.{k}": v for k, v in a.items()})
        return meta, arrays
    if isinstance(entry, ArraysCache):
        if entry.left_padding is not None or entry.lengths is not None:
            raise UnsupportedModelError("ArraysCache: batched (padded) state is not storable")
        return ({"class": "ArraysCache", "size": len(entry.cache)},
                {f"state.{i}": a for i, a in enumerate(entry.cache) if a is not None})
    if isinstance(entry, RotatingKVCache):
        keys, values = _temporal(entry) if entry.keys is not None else (None, None)
        meta = {"class": "RotatingKVCache", "offset": entry.offset, "max_size": entry.max_size}
        return meta, ({} if keys is None else {"keys": keys, "values": values})
    if type(entry) is QuantizedKVCache:
        meta = {"class": "QuantizedKVCache", "offset": entry.offset, "group_size": entry.group_size,
                "bits": entry.bits}
        if entry.keys is None:
            return meta, {}
        keys, values = _slice_tokens(entry.keys, entry.offset), _slice_tokens(entry.values, entry.offset)
        return meta, {**{f"keys.{p}": a for p, a in zip(QUANT_PARTS, keys)},
                      **{f"values.{p}": a for p, a in zip(QUANT_PARTS, values)}}
    if type(entry) is KVCache:
        meta = {"class": "KVCache", "offset": entry.offset}
        if entry.keys is None:
            return meta, {}
        return meta, {"keys": entry.keys[..., :entry.offset, :], "values": entry.values[..., :entry.offset, :]}
    raise UnsupportedModelError(f"cache {type(entry).__name__}: no storage layout")


def _members(arrays: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def layer_from_arrays(meta: dict[str, Any], arrays: dict[str, mx.array], *, own: bool = False) -> Any:
    """The cache object :func:`layer_arrays` described (its own array objects: copies, or with
    ``own`` the arrays themselves, when they were made for this cache alone, as a fetch's are)."""
    take = (lambda a: a) if own else _copy
    kind = meta["class"]
    if kind == "none":
        return None
    if kind == "CacheList":
        return CacheList(*(layer_from_arrays(m, _members(arrays, f"{i}."), own=own)
                           for i, m in enumerate(meta["members"])))
    if kind == "ArraysCache":
        entry = ArraysCache(meta["size"])
        entry.cache = [take(arrays.get(f"state.{i}")) for i in range(meta["size"])]
        return entry
    if kind == "RotatingKVCache":
        entry = RotatingKVCache(max_size=meta["max_size"], keep=0)
        if arrays:
            keys, values = take(arrays["keys"]), take(arrays["values"])
            entry.state = (keys, values, meta["offset"], 0, meta["max_size"], keys.shape[2])
        return entry
    if kind == "QuantizedKVCache":
        entry = QuantizedKVCache(group_size=meta["group_size"], bits=meta["bits"])
        if arrays:
            entry.keys = tuple(take(arrays[f"keys.{p}"]) for p in QUANT_PARTS)
            entry.values = tuple(take(arrays[f"values.{p}"]) for p in QUANT_PARTS)
            entry.offset = meta["offset"]
        return entry
    entry = KVCache()
    if arrays:
        entry.keys, entry.values, entry.offset = take(arrays["keys"]), take(arrays["values"]), meta["offset"]
    return entry


def is_token_array(name: str) -> bool:
    """Token-indexed (tokens on axis 2: ``keys``, ``values.packed``, ``1.keys``...) rather than state."""
    return bool({"keys", "values"} & set(name.split(".")))


def _token_origin(meta: dict[str, Any], name: str, length: int) -> int:
    """Index of the first token an array of ``length`` tokens holds (a window ends at ``offset``)."""
    if meta["class"] == "CacheList":
        head, rest = name.split(".", 1)
        return _token_origin(meta["members"][int(head)], rest, length)
    return meta["offset"] - length if meta["class"] == "RotatingKVCache" else 0


def block_arrays(meta: dict[str, Any], arrays: dict[str, mx.array], start: int, end: int) -> dict[str, mx.array]:
    """One layer's share of block ``[start, end)``: its tokens' K/V and the state after ``end - 1``.

    ``(meta, arrays)`` come from :func:`layer_arrays`; their state must be the layer's right
    after token ``end - 1`` and their K/V must still hold tokens ``start..end-1`` (a rotating
    window does right after the prefill step that ends at ``end``).
    """
    out = {}
    for name, a in arrays.items():
        if not is_token_array(name):
            out[name] = a
            continue
        lo = start - _token_origin(meta, name, a.shape[2])
        if lo < 0 or lo + end - start > a.shape[2]:
            raise ValueError(f"{name}: tokens [{start}, {end}) are not in the cache any more")
        out[name] = a[..., lo:lo + end - start, :]
    return out


def assemble(meta: dict[str, Any], blocks: Sequence[dict[str, mx.array]], n_tokens: int, *,
             own: bool = False) -> Any:
    """One layer's cache holding the first ``n_tokens`` tokens, from its consecutive blocks.

    K/V are the blocks' concatenated (a window keeps its last ``max_size``); recurrent state is
    the last block's. ``own``: see :func:`layer_from_arrays`.
    """
    if meta["class"] == "CacheList":
        return CacheList(*(assemble(m, [_members(b, f"{i}.") for b in blocks], n_tokens, own=own)
                           for i, m in enumerate(meta["members"])))
    arrays = {}
    for name in blocks[0]:
        if not is_token_array(name):
            arrays[name] = blocks[-1][name]
            continue
        joined = mx.concatenate([b[name] for b in blocks], axis=2)
        if meta["class"] == "RotatingKVCache" and joined.shape[2] > meta["max_size"]:
            # the window alone, in its own memory (a view would keep the whole prefix alive)
            joined = mx.array(joined[..., -meta["max_size"]:, :])
        arrays[name] = joined
    restored = {**meta, "offset": n_tokens} if "offset" in meta else meta
    return layer_from_arrays(restored, arrays, own=own)


def _window_arrays(meta: dict[str, Any], arrays: dict[str, mx.array], prefix: str = "") -> list[str]:
    """Names of the token arrays that live in a sliding window (they must be kept as they arrive)."""
    if meta["class"] == "CacheList":
        return [n for i, m in enumerate(meta["members"])
                for n in _window_arrays(m, _members(arrays, f"{i}."), f"{prefix}{i}.")]
    if meta["class"] == "RotatingKVCache":
        return [prefix + n for n in arrays if is_token_array(n)]
    return []


class BlockRecorder:
    """A scorer ``on_step`` hook that keeps, per block, what exists only during the prefill.

    At each block end it keeps every layer's state arrays (recurrent state after the block's
    last token; only at the checkpoints ``keep_state`` names), and while the prefill runs it keeps each sliding window's newest tokens
    (the window lets them go later). The K/V of unbounded layers are sliced from the final
    cache instead (:meth:`blocks`), so holding nothing here pins a KV buffer being written.

    With ``sink``, each block is handed over complete as soon as it ends instead
    (``sink(end, per-layer arrays)``, K/V sliced from the cache at that step) and nothing is
    kept: memory stays one block's worth however long the prompt (a Qwen3.5-0.8B block holds
    18 MiB of recurrent state). The sink must copy what it keeps before returning; it returns
    how many blocks it stored, summed in ``written``.

    ``keep_state(end)`` says at which block ends the recurrent state is kept (the checkpoints;
    default every end): the other blocks are their K/V alone.
    """

    def __init__(self, block_size: int, sink: Callable[[int, list[dict[str, mx.array]]], int] | None = None,
                 keep_state: Callable[[int], bool] | None = None):
        self.block_size = block_size
        self.sink = sink
        self.keep_state = keep_state
        self.written = 0
        self.states: dict[int, list[dict[str, mx.array]]] = {}  # block end -> per layer
        self._pieces: dict[tuple[int, str], list[mx.array]] = {}

    def __call__(self, start: int, end: int, cache: list) -> None:
        layers = [layer_arrays(entry) for entry in cache]
        for i, (meta, arrays) in enumerate(layers):
            for name in _window_arrays(meta, arrays):
                a = arrays[name]
                lo = start - _token_origin(meta, name, a.shape[2])
                self._pieces.setdefault((i, name), []).append(mx.array(a[..., lo:lo + end - start, :]))
        if end % self.block_size:
            return
        kept = []
        keep = self.keep_state is None or self.keep_state(end)
        for i, (meta, arrays) in enumerate(layers):
            layer = {n: a for n, a in arrays.items() if keep and not is_token_array(n)}
            for name in _window_arrays(meta, arrays):
                layer[name] = mx.concatenate(self._pieces.pop((i, name)), axis=2)
            kept.append(layer)
        if self.sink is not None:
            per_layer = [{**block_arrays(meta, {n: a for n, a in arrays.items() if is_token_array(n) and n not in
                                                recorded}, end - self.block_size, end), **recorded}
                         for (meta, arrays), recorded in zip(layers, kept)]
            self.written += self.sink(end, per_layer) or 0
            return
        mx.eval(kept)
        self.states[end] = kept

    def blocks(self, cache: list, n_tokens: int) -> list[tuple[int, list[dict[str, mx.array]]]]:
        """``(end, per-layer arrays)`` of every full block recorded, K/V taken from ``cache``."""
        layers = [layer_arrays(entry) for entry in cache]
        out = []
        for end in sorted(e for e in self.states if e <= n_tokens):
            per_layer = []
            for (meta, arrays), recorded in zip(layers, self.states[end]):
                kv = {n: a for n, a in arrays.items() if is_token_array(n) and n not in recorded}
                per_layer.append({**block_arrays(meta, kv, end - self.block_size, end), **recorded})
            out.append((end, per_layer))
        return out


def layer_metas(cache: list) -> list[dict[str, Any]]:
    """Every layer's ``meta`` (what :func:`assemble` needs besides the blocks)."""
    return [layer_arrays(entry)[0] for entry in cache]


def storable_reason(cache: list) -> str | None:
    """Why blocks of this cache (fresh or filled) cannot be stored and restored exactly, or None."""
    for i, entry in enumerate(cache):
        for member in getattr(entry, "caches", None) or (entry,):
            if isinstance(member, RotatingKVCache) and member.keep:
                return f"cache layer {i}: RotatingKVCache with keep={member.keep} (tokens pinned at the start)"
            if isinstance(member, ArraysCache) and (member.left_padding is not None or member.lengths is not None):
                return f"cache layer {i}: batched (padded) ArraysCache"
            if member is not None and not isinstance(member, (KVCache, QuantizedKVCache, RotatingKVCache,
                                                              ArraysCache)):
                return f"cache layer {i}: {type(member).__name__} has no storage layout"
    return None


def needs_recorder(metas: Sequence[dict[str, Any]]) -> bool:
    """Whether blocks need a :class:`BlockRecorder` (recurrent state or sliding windows), i.e. cannot
    be sliced from the final cache alone."""
    def member_needs(meta: dict[str, Any]) -> bool:
        if meta["class"] == "CacheList":
            return any(member_needs(m) for m in meta["members"])
        return meta["class"] in ("ArraysCache", "RotatingKVCache")
    return any(member_needs(m) for m in metas)


def sliced_blocks(cache: list, n_tokens: int, block_size: int) -> list[tuple[int, list[dict[str, mx.array]]]]:
    """``(end, per-layer arrays)`` of every full block, sliced from a cache of K/V layers only
    (``KVCache``/``QuantizedKVCache``; see :func:`needs_recorder`)."""
    layers = [layer_arrays(entry) for entry in cache]
    return [(end, [block_arrays(meta, arrays, end - block_size, end) for meta, arrays in layers])
            for end in range(block_size, n_tokens + 1, block_size)]


def sliced_tail(cache: list, n_tokens: int, block_size: int) -> list[dict[str, mx.array]]:
    """Per layer the arrays of the partial last block of the first ``n_tokens`` (its tokens after
    the last full block), sliced from a cache of K/V layers only, as :func:`sliced_blocks` slices blocks."""
    start = n_tokens // block_size * block_size
    return [block_arrays(meta, arrays, start, n_tokens) for meta, arrays in (layer_arrays(e) for e in cache)]


def restore(metas: Sequence[dict[str, Any]], layers: Sequence[dict[str, mx.array]], n_tokens: int) -> list:
    """The cache of a prefix of ``n_tokens`` from its stored arrays: per layer the blocks' K/V joined
    and the last block's state (as a block store's fetch returns them: new arrays, each for one
    layer, which the cache takes as they are: no copy of a restored prefix)."""
    if len(metas) != len(layers):
        raise ValueError(f"restore: {len(layers)} stored layers, the model's cache has {len(metas)}")
    return [assemble(meta, [arrays], n_tokens, own=True) for meta, arrays in zip(metas, layers)]


def array_layout(cache: list) -> list[dict[str, list]]:
    """Per layer ``{name: [dtype, shape]}`` of the arrays :func:`layer_arrays` gives for ``cache``; a
    cache :func:`storable_reason` refuses has none (nothing of it is ever stored: llama4's chunks)."""
    if storable_reason(cache) is not None:
        return [{} for _ in cache]
    return [{name: [str(a.dtype).split(".")[-1], list(a.shape)] for name, a in layer_arrays(entry)[1].items()}
            for entry in cache]
