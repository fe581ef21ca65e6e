"""One KV block as one msgpack value: per layer, named raw arrays in, the same out.

A block holds, for every layer, the arrays named :data:`LAYER_ARRAYS` (``keys`` then
``values``), each as raw little-endian bits with a dtype name and a 4-D shape whose axis 2
is the block's tokens. A value is the msgpack array ``[header, payload, checksum]``:

- ``header``: a map with ``version``, ``fingerprint``, ``tokens`` (tokens in the
  block) and ``layers``, one ``[keys_dtype, keys_shape, values_dtype,
  values_shape]`` entry per layer; ``pad`` only aligns the payload.
- ``payload``: one ``bin`` holding every layer's keys then values, in layer order,
  as the arrays' raw little-endian bits (C order). It starts 16-byte aligned in
  the value so readers can view it in place.
- ``checksum``: the payload's 64-bit XXH3 (see :func:`payload_checksum`).

Any msgpack reader can read a value; :func:`decode_block` reads it without copying the
payload. Arrays are carried as bits (``bfloat16`` as ``uint16``), so float32, float16 and
bfloat16 round-trip bit-exactly. Other per-layer array kinds (recurrent state snapshots,
quantized K/V parts) would be new names in a new format version; the store handles layers
as named arrays already.
"""
from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import msgpack
import numpy as np
import xxhash

FORMAT_VERSION = 1

# The named arrays of every layer of a version-1 block, in payload order.
LAYER_ARRAYS = ("keys", "values")
_LAYER_NAMES = frozenset(LAYER_ARRAYS)

# dtype name -> numpy dtype of the same width that carries the bits
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<u4"),
    "float16": np.dtype("<u2"),
    "bfloat16": np.dtype("<u2"),
}

_ALIGN = 16
_BIN32 = 0xC6
_UINT64 = 0xCF


class CorruptBlockError(ValueError):
    """A stored value that is not a valid block for this store (bad, stale or foreign)."""


class RawArray(NamedTuple):
    """An array as raw bits: ``bits`` is a numpy unsigned-int view with the logical shape.

    A plain ``(dtype name, bits)`` pair is one too: storage takes any such pair.
    """

    dtype: str
    bits: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape


Layer = Mapping[str, RawArray]  # one layer's named arrays
# Per layer, per named array (in LAYER_ARRAYS order): (name, dtype, shape). Comparable.
BlockLayout = tuple[tuple[tuple[str, str, tuple[int, ...]], ...], ...]


def layer_arrays(layer: Mapping[str, Sequence]) -> list[RawArray]:
    """The arrays of one layer in payload order, as :class:`RawArray`; ``ValueError`` if the
    layer does not hold exactly the :data:`LAYER_ARRAYS`."""
    keys = getattr(layer, "keys", None)
    if keys is None or keys() != _LAYER_NAMES:
        names = sorted(keys()) if keys is not None else type(layer).__name__
        raise ValueError(f"layers: each layer holds exactly {', '.join(LAYER_ARRAYS)}, got {names}")
    arrays = [layer[name] for name in LAYER_ARRAYS]
    return [a if type(a) is RawArray else RawArray(*a) for a in arrays]


def payload_checksum(payload: memoryview) -> int:
    """64-bit XXH3 of the payload: catches flips, truncation, reordering and foreign data.

    XXH3 runs at memory speed (faster than a copy here), where CRC32 or BLAKE2b would cap
    the codec far below a plain copy. An integrity check against faults, not a MAC:
    Redis is trusted not to forge values.
    """
    return xxhash.xxh3_64_intdigest(payload)


@functools.lru_cache(maxsize=64)
def _aligned_prefix(fingerprint: str, n_tokens: int, specs: tuple, payload_size: int) -> bytes:
    """``fixarray(3)``, the header and the payload's bin32 marker, padded so the payload is aligned.

    ``specs``: ``(dtype, shape)`` of every array in payload order. Cached: every block of one
    store has the same header.
    """
    n = len(LAYER_ARRAYS)
    header = {
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "tokens": n_tokens,
        "layers": [[x for dtype, shape in specs[i:i + n] for x in (dtype, list(shape))]
                   for i in range(0, len(specs), n)],
    }

    def prefix(pad: int) -> bytes:
        return (b"\x93" + msgpack.packb({**header, "pad": b"\0" * pad})
                + bytes([_BIN32]) + payload_size.to_bytes(4, "big"))

    pad = -len(prefix(0)) % _ALIGN
    out = prefix(pad)
    if len(out) % _ALIGN:  # the pad's own bin8 marker can never change size for pad < 16
        raise AssertionError("payload alignment")
    return out


def encode_block(fingerprint: str, n_tokens: int, layers: Sequence[Layer]) -> memoryview:
    """Serialise one block (per layer: its named arrays as raw bits) into one value.

    Copies each array once, straight into the value buffer (so a slice of a big
    cache does not pin it). Returns a read-only memoryview redis-py sends as is.
    """
    arrays = [a for layer in layers for a in layer_arrays(layer)]
    if not arrays:
        raise ValueError("layers: a block needs at least one layer")
    payload_size = sum(a.bits.nbytes for a in arrays)
    if payload_size >= 1 << 32:
        raise ValueError(f"block payload: {payload_size} bytes; allowed < 4 GiB")
    specs = tuple((a.dtype, a.bits.shape) for a in arrays)
    prefix = _aligned_prefix(fingerprint, n_tokens, specs, payload_size)
    start = len(prefix)
    end = start + payload_size
    # np.empty, not bytearray: no zero-fill pass over memory that is overwritten next.
    out = np.empty(end + 9, dtype=np.uint8)
    out[:start] = np.frombuffer(prefix, dtype=np.uint8)
    first = arrays[0].bits
    if all(a.bits.dtype == first.dtype and a.bits.shape == first.shape for a in arrays):
        stacked = out[start:end].view(first.dtype).reshape((len(arrays),) + first.shape)
        for i, a in enumerate(arrays):
            np.copyto(stacked[i], a.bits)
    else:
        pos = start
        for a in arrays:
            np.copyto(out[pos:pos + a.bits.nbytes].view(a.bits.dtype).reshape(a.bits.shape), a.bits)
            pos += a.bits.nbytes
    view = memoryview(out)
    checksum = payload_checksum(view[start:end])
    out[end:] = np.frombuffer(bytes([_UINT64]) + checksum.to_bytes(8, "big"), dtype=np.uint8)
    return view.toreadonly()


@dataclass(frozen=True)
class DecodedBlock:
    """A validated block; arrays are views into the stored value (no copy yet)."""

    n_tokens: int
    layers: list[dict[str, RawArray]]  # per layer, its LAYER_ARRAYS by name
    layout: BlockLayout


def _payload_span(value: memoryview, at: int) -> tuple[int, int]:
    """(start, length) of the bin whose marker is at ``at``."""
    marker = value[at]
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(marker)
    if width is None:
        raise CorruptBlockError(f"payload: expected a msgpack bin, found byte 0x{marker:02x}")
    start = at + 1 + width
    length = int.from_bytes(value[at + 1:start], "big")
    return start, length


def _is_dim(d: object) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d >= 1


def _array_spec(dtype: object, shape: object, n_tokens: int) -> tuple[str, np.dtype, tuple[int, ...], int]:
    """(dtype name, bits dtype, shape, bytes) of one header array entry, validated."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CorruptBlockError(f"layer dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) != 4 or not all(_is_dim(d) for d in shape):
        raise CorruptBlockError(f"layer shape: {shape!r} is not 4 positive ints")
    if shape[2] != n_tokens:
        raise CorruptBlockError(f"layer shape: {shape!r} does not hold {n_tokens} tokens")
    bits_dtype = DTYPES[dtype]
    return dtype, bits_dtype, tuple(shape), bits_dtype.itemsize * math.prod(shape)


def _layer_specs(entries: list, n_tokens: int) -> list[tuple[str, np.dtype, tuple[int, ...], int]]:
    """Keys then values spec of every layer; identical layers are validated once.

    Every field is type-checked before it is hashed or multiplied: a crafted header
    (a list where a dtype belongs) is a :class:`CorruptBlockError`, never a ``TypeError``.
    """
    seen: dict[tuple, list] = {}
    specs = []
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 4:
            raise CorruptBlockError("layers: entry is not [k_dtype, k_shape, v_dtype, v_shape]")
        k_dtype, k_shape, v_dtype, v_shape = entry
        if not (isinstance(k_shape, list) and isinstance(v_shape, list)):
            raise CorruptBlockError(f"layer shapes: {k_shape!r}, {v_shape!r} are not lists")
        key = (k_dtype, tuple(k_shape), v_dtype, tuple(v_shape))
        try:
            pair = seen.get(key)
        except TypeError:  # an unhashable dtype or dim: not a layer entry
            raise CorruptBlockError(f"layers: malformed entry {entry!r}") from None
        if pair is None:
            pair = [_array_spec(k_dtype, k_shape, n_tokens), _array_spec(v_dtype, v_shape, n_tokens)]
            if k_shape[:3] != v_shape[:3]:
                raise CorruptBlockError(f"layer shapes: keys {k_shape} and values {v_shape} differ in "
                                        "batch, heads or tokens")
            seen[key] = pair
        specs.extend(pair)
    return specs


class _ViewReader:
    """A file-like reader over a memoryview, so msgpack reads only the header, never copying the payload."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def read(self, n: int) -> bytes:
        chunk = self._view[self._pos:self._pos + n]
        self._pos += len(chunk)
        return bytes(chunk)


@dataclass(frozen=True)
class _Format:
    """A parsed and validated value prefix (header and payload marker)."""

    prefix: bytes
    header: dict
    specs: list  # (dtype name, bits dtype, shape, bytes) of every array, in payload order
    layout: BlockLayout
    payload_start: int
    payload_length: int


# Parsed prefixes seen recently, most recent last: every block of a store has the same
# one, so a fetch of many blocks parses the header once (a pure memo, like ``re``'s
# pattern cache). Bounded LRU; the lock makes lookups safe from several threads.
_FORMATS: OrderedDict[bytes, _Format] = OrderedDict()
_FORMATS_LOCK = threading.Lock()
_MAX_FORMATS = 16


def _known_format(view: memoryview) -> _Format | None:
    with _FORMATS_LOCK:
        for prefix, fmt in _FORMATS.items():
            if view[:len(prefix)] == prefix:
                _FORMATS.move_to_end(prefix)  # iteration ends here, so moving is safe
                return fmt
    return None


def _remember_format(fmt: _Format) -> None:
    with _FORMATS_LOCK:
        _FORMATS[fmt.prefix] = fmt
        _FORMATS.move_to_end(fmt.prefix)
        while len(_FORMATS) > _MAX_FORMATS:
            _FORMATS.popitem(last=False)


def _read_format(view: memoryview, n_tokens: int) -> _Format:
    try:
        unpacker = msgpack.Unpacker(_ViewReader(view), read_size=4096)
        if unpacker.read_array_header() != 3:
            raise CorruptBlockError("value: not a 3-element msgpack array")
        header = unpacker.unpack()
        payload_at = unpacker.tell()
    except CorruptBlockError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise CorruptBlockError(f"value: not a block ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise CorruptBlockError("header: not a map")
    if not _is_dim(header.get("tokens")) or header["tokens"] != n_tokens:
        raise CorruptBlockError(f"tokens: {header.get('tokens')!r}, expected {n_tokens}")
    layer_specs = header.get("layers")
    if not isinstance(layer_specs, list) or not layer_specs:
        raise CorruptBlockError("layers: missing or empty")
    if payload_at >= len(view):
        raise CorruptBlockError("value: truncated before the payload")
    start, length = _payload_span(view, payload_at)
    specs = _layer_specs(layer_specs, n_tokens)
    if sum(size for _, _, _, size in specs) != length:
        raise CorruptBlockError(f"payload: {length} bytes, layers describe {sum(s for *_, s in specs)}")
    fmt = _Format(bytes(view[:start]), header, specs, _spec_layout(specs), start, length)
    _remember_format(fmt)
    return fmt


def _spec_layout(specs: list) -> BlockLayout:
    n = len(LAYER_ARRAYS)
    return tuple(tuple((name, dtype, shape) for name, (dtype, _, shape, _) in zip(LAYER_ARRAYS, specs[i:i + n]))
                 for i in range(0, len(specs), n))


def decode_block(value: bytes | memoryview, *, fingerprint: str, n_tokens: int) -> DecodedBlock:
    """Parse and validate a stored value; raise :class:`CorruptBlockError` saying why not.

    Checks the format version, fingerprint, token count, dtypes and shapes against
    the payload size, and the checksum. The returned arrays view ``value``.
    """
    view = memoryview(value)
    fmt = _known_format(view) or _read_format(view, n_tokens)
    header = fmt.header
    if header.get("version") != FORMAT_VERSION:
        raise CorruptBlockError(f"version: {header.get('version')!r}, expected {FORMAT_VERSION}")
    if header.get("fingerprint") != fingerprint:
        raise CorruptBlockError("fingerprint: block belongs to another model or layout")
    if header.get("tokens") != n_tokens:
        raise CorruptBlockError(f"tokens: {header.get('tokens')!r}, expected {n_tokens}")
    start, length = fmt.payload_start, fmt.payload_length
    end = start + length
    if end + 9 != len(view) or view[end] != _UINT64:
        raise CorruptBlockError(f"value: {len(view)} bytes, payload says {end + 9} (truncated or padded)")
    payload = view[start:end]
    specs = fmt.specs
    stored = int.from_bytes(view[end + 1:end + 9], "big")
    if payload_checksum(payload) != stored:
        raise CorruptBlockError("checksum: payload does not match")

    arrays = _payload_arrays(np.frombuffer(payload, dtype=np.uint8), specs)
    n = len(LAYER_ARRAYS)
    layers = [dict(zip(LAYER_ARRAYS, arrays[i:i + n])) for i in range(0, len(arrays), n)]
    return DecodedBlock(n_tokens, layers, fmt.layout)


def _payload_arrays(data: np.ndarray, specs: list) -> list[RawArray]:
    """Views of every array in the payload bytes ``data``, in payload order."""
    if specs.count(specs[0]) == len(specs):  # the usual block: one view, indexed per array
        name, bits_dtype, shape, _ = specs[0]
        stacked = data.view(bits_dtype).reshape((len(specs),) + shape)
        return [RawArray(name, stacked[i]) for i in range(len(specs))]
    arrays, pos = [], 0
    for name, bits_dtype, shape, size in specs:
        arrays.append(RawArray(name, data[pos:pos + size].view(bits_dtype).reshape(shape)))
        pos += size
    return arrays
