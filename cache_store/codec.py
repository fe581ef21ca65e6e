"""One block as one msgpack value: per layer, named raw arrays in, the same out.

A block holds, for every layer, any number of named arrays (none for a layer without a
cache), each as raw little-endian bits with a dtype name and a shape. Two kinds, told apart
by the name (:func:`is_token_array`):

- token arrays (a dot-separated part of the name is ``keys`` or ``values``: ``keys``,
  ``values.scales``, ``1.keys``): 4-D, axis 2 is the block's tokens; a prefix joins its
  blocks' token arrays along that axis (attention K/V, quantized K/V parts as they are);
- state arrays (anything else, e.g. ``state.0``): a fixed-size snapshot as it is after the
  block's last token (recurrent state); a prefix takes its last block's.

A value is the msgpack array ``[header, payload, checksum]``:

- ``header``: a map with ``version``, ``fingerprint``, ``tokens`` (tokens in the block),
  ``layers`` (per layer a list of ``[name, dtype, shape]`` in name order), ``pad`` (only
  aligns the payload), ``token_checksum`` (8 bytes: the token section's 64-bit XXH3, big
  endian) and ``digest``: the block's chain digest (the last part of its key), so a valid
  block under another key is detected (:func:`decode_block` ``digest=``);
- ``payload``: one ``bin`` holding the **token section** (every layer's token arrays, in
  layer then name order) and then the **state section** (every layer's state arrays, same
  order), as raw little-endian bits (C order). It starts 16-byte aligned in the value so
  readers can view it in place;
- ``checksum``: the state section's 64-bit XXH3 (see :func:`payload_checksum`; of no bytes
  for a block without state).

The value's first :func:`token_section_end` bytes (header and token section) are a unit a
reader can fetch and check alone (``GETRANGE``; :func:`decode_block` ``state=False``). The
store (format 4) writes values of one section each: a block holds its token arrays, a
recurrent-state checkpoint its state arrays (see :func:`split_layout`).

Any msgpack reader can read a value; :func:`decode_block` reads it without copying the
payload. Arrays are carried as bits (``bfloat16`` as ``uint16``), so float32, float16 and
bfloat16 round-trip bit-exactly. Versions 1 (keys and values only, no digest) and 2 (one
checksum over the payload, arrays in layer order) are refused (:class:`OldFormatError`, a
miss): their blocks live under other keys anyway, since the model fingerprint covers the
version.
"""
from __future__ import annotations

import functools
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import msgpack
import numpy as np
import xxhash

# 4: a block holds its tokens' arrays only; recurrent state lives in checkpoint values (a
# value of state arrays only, under ``keys.checkpoint_key``) at chosen block ends.
FORMAT_VERSION = 4

# The named arrays of a plain attention layer (the KV cache), in payload order.
# A name with one of these dot-separated parts is a token array (tokens on axis 2); the
# specprefill side names arrays by the same rule (tests/cache_store/test_codec.py checks both agree).
TOKEN_PARTS = frozenset(("keys", "values"))
ARRAY_NAME = re.compile(r"[A-Za-z0-9_]{1,32}(\.[A-Za-z0-9_]{1,32}){0,3}")
MAX_RANK = 6
DIGEST_BYTES = 32

# dtype name -> numpy dtype of the same width that carries the bits
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<u4"),
    "float16": np.dtype("<u2"),
    "bfloat16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),  # quantized K/V's packed values
}

_ALIGN = 16
_BIN32 = 0xC6
_UINT64 = 0xCF
_SUM_BYTES = 8
# The encoder writes the token checksum and the digest last in the header, right before the
# payload's bin32 marker and 4-byte length: ``c4 08 <8 bytes> a6 "digest" c4 20 <32 bytes>
# c6 <4 bytes>``. The digest starts _DIGEST_TAIL bytes before the payload, the checksum
# _SUM_TAIL bytes; known prefixes are matched with those two spans masked.
_DIGEST_TAIL = DIGEST_BYTES + 5
_SUM_TAIL = _DIGEST_TAIL + 2 + 7 + _SUM_BYTES


@functools.lru_cache(maxsize=1024)  # a handful of names per model, asked per array of every block
def is_token_array(name: str) -> bool:
    """Token-indexed (tokens on axis 2: ``keys``, ``values.packed``, ``1.keys``) rather than state."""
    return bool(TOKEN_PARTS & set(name.split(".")))


class CorruptBlockError(ValueError):
    """A stored value that is not a valid block for this store (bad, stale or foreign).

    ``reason`` names the failed check: ``header`` (not a block, malformed or inconsistent
    header, wrong token count), ``version``, ``fingerprint``, ``key`` (a valid block of
    another key), ``checksum`` or ``layout`` (not this model's layers).
    """

    def __init__(self, message: str, reason: str = "header") -> None:
        super().__init__(message)
        self.reason = reason


class OldFormatError(CorruptBlockError):
    """A block of an earlier format version: never read (its keys are another fingerprint's)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "version")


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
# Per layer, per named array (in name order): (name, dtype, shape). Comparable.
BlockLayout = tuple[tuple[tuple[str, str, tuple[int, ...]], ...], ...]


def split_layout(layout: BlockLayout) -> tuple[BlockLayout, BlockLayout | None]:
    """A model's full layout as (a block's: every layer's token arrays, a checkpoint's: every
    layer's state arrays, or None when no layer has any)."""
    tokens = tuple(tuple(a for a in layer if is_token_array(a[0])) for layer in layout)
    states = tuple(tuple(a for a in layer if not is_token_array(a[0])) for layer in layout)
    return tokens, (states if any(states) else None)


def ordered_arrays(layer: Mapping[str, Sequence]) -> list[tuple[str, RawArray]]:
    """``(name, array)`` of one layer's arrays in payload (name) order; ``ValueError`` for a
    layer that is not a mapping of valid names (see :data:`ARRAY_NAME`) to raw arrays."""
    keys = getattr(layer, "keys", None)
    if keys is None:
        raise ValueError(f"layers: each layer is a mapping of named arrays, got {type(layer).__name__}")
    out = []
    for name in sorted(keys()):
        if not isinstance(name, str) or not _valid_name(name):
            raise ValueError(f"layers: array name {name!r}; allowed dot-separated parts of letters, digits, '_'")
        a = layer[name]
        out.append((name, a if type(a) is RawArray else RawArray(*a)))
    return out


@functools.lru_cache(maxsize=1024)  # a model's few names, checked for every block it stores
def _valid_name(name: str) -> bool:
    return ARRAY_NAME.fullmatch(name) is not None


def payload_checksum(payload: memoryview) -> int:
    """64-bit XXH3 of the payload: catches flips, truncation, reordering and foreign data.

    XXH3 runs at memory speed (faster than a copy here), where CRC32 or BLAKE2b would cap
    the codec far below a plain copy. An integrity check against faults, not a MAC:
    Redis is trusted not to forge values.
    """
    return xxhash.xxh3_64_intdigest(payload)


def _check_digest(digest: bytes) -> bytes:
    if not isinstance(digest, (bytes, bytearray)) or len(digest) != DIGEST_BYTES:
        raise ValueError(f"digest: expected the block's {DIGEST_BYTES}-byte chain digest")
    return bytes(digest)


@functools.lru_cache(maxsize=64)
def _aligned_prefix(fingerprint: str, n_tokens: int, specs: tuple, payload_size: int) -> bytes:
    """``fixarray(3)``, the header (a zero digest) and the payload's bin32 marker, padded so
    the payload is aligned. ``specs``: per layer, ``(name, dtype, shape)`` of its arrays."""
    header = {
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "tokens": n_tokens,
        "layers": [[[name, dtype, list(shape)] for name, dtype, shape in layer] for layer in specs],
    }

    def prefix(pad: int) -> bytes:
        return (b"\x93" + msgpack.packb({**header, "pad": b"\0" * pad, "token_checksum": bytes(_SUM_BYTES),
                                          "digest": bytes(DIGEST_BYTES)})
                + bytes([_BIN32]) + payload_size.to_bytes(4, "big"))

    pad = -len(prefix(0)) % _ALIGN
    out = prefix(pad)
    if len(out) % _ALIGN:  # the pad's own bin8 marker can never change size for pad < 16
        raise AssertionError("payload alignment")
    return out


def encode_block(fingerprint: str, n_tokens: int, layers: Sequence[Layer], *, digest: bytes) -> memoryview:
    """Serialise one block (per layer: its named arrays as raw bits) into one value bound to
    ``digest`` (its chain digest, the last part of its key).

    Copies each array once, straight into the value buffer (so a slice of a big
    cache does not pin it), and checksums it right after, while it is still in the cache.
    Returns a read-only memoryview redis-py sends as is.
    """
    digest = _check_digest(digest)
    per_layer = [ordered_arrays(layer) for layer in layers]
    flat = [a.bits for named in per_layer for _, a in named]
    plan = _plan(fingerprint, n_tokens,
                 tuple(tuple((name, a.dtype, a.bits.shape, a.bits.dtype) for name, a in named) for named in per_layer))
    start, end = len(plan.prefix), len(plan.prefix) + plan.payload_size
    # np.empty, not bytearray: no zero-fill pass over memory that is overwritten next.
    out = np.empty(end + 9, dtype=np.uint8)
    view = memoryview(out)
    view[:start] = plan.prefix
    view[start - _DIGEST_TAIL:start - 5] = digest
    arrays = [flat[i] for i in plan.order]  # payload order: the token section, then the state section
    if plan.stacked is not None:  # the usual K/V block: one stacked view, one copy per array
        places = out[start:end].view(plan.stacked[0]).reshape((len(arrays),) + plan.stacked[1])
    else:
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]) + start
        places = [out[a:b].view(x.dtype).reshape(x.shape) for a, b, x in zip(offsets, offsets[1:], arrays)]
    sums = xxhash.xxh3_64(), xxhash.xxh3_64()  # token section, state section
    for i, (place, a) in enumerate(zip(places, arrays)):
        np.copyto(place, a)
        sums[i >= plan.n_token].update(place)
    view[start - _SUM_TAIL:start - _SUM_TAIL + _SUM_BYTES] = sums[0].intdigest().to_bytes(_SUM_BYTES, "big")
    view[end] = _UINT64
    view[end + 1:] = sums[1].intdigest().to_bytes(8, "big")
    return view.toreadonly()


class _Plan(NamedTuple):
    """How a block of given arrays is laid out (one per distinct set of array specs)."""

    prefix: bytes  # ``_aligned_prefix``: everything before the payload, zero digest and checksum
    order: tuple[int, ...]  # the arrays (flat, layer then name order) in payload order
    n_token: int  # how many of them (the first in ``order``) make the token section
    payload_size: int
    stacked: tuple | None  # (bits dtype, shape) when every array has both the same


@functools.lru_cache(maxsize=64)
def _plan(fingerprint: str, n_tokens: int, specs: tuple) -> _Plan:
    """The :class:`_Plan` of a block whose layers hold ``specs`` (per layer, ``(name, dtype name,
    shape, bits dtype)`` of each array in name order); ``ValueError`` if it cannot be stored."""
    flat = [spec for layer in specs for spec in layer]
    if not flat:
        raise ValueError("layers: a block needs at least one array")
    order = ([i for i, spec in enumerate(flat) if is_token_array(spec[0])]
             + [i for i, spec in enumerate(flat) if not is_token_array(spec[0])])
    payload_size = sum(bits.itemsize * math.prod(shape) for _, _, shape, bits in flat)
    if payload_size >= 1 << 32:
        raise ValueError(f"block payload: {payload_size} bytes; allowed < 4 GiB")
    named = tuple(tuple((name, dtype, shape) for name, dtype, shape, _ in layer) for layer in specs)
    _check_encodable(named, tuple(bits.itemsize for *_, bits in flat), n_tokens)
    first = flat[0][2:]
    return _Plan(_aligned_prefix(fingerprint, n_tokens, named, payload_size), tuple(order),
                 sum(is_token_array(spec[0]) for spec in flat), payload_size,
                 (first[1], first[0]) if all(spec[2:] == first for spec in flat) else None)


def token_section_end(fingerprint: str, n_tokens: int, layout: BlockLayout) -> int:
    """How many leading bytes of a block laid out as ``layout`` (``DecodedBlock.layout``) hold its
    header and token section: what ``decode_block(..., state=False)`` needs."""
    header, token_bytes = _section_sizes(fingerprint, n_tokens, layout)
    return header + token_bytes


def header_end(fingerprint: str, n_tokens: int, layout: BlockLayout) -> int:
    """How many leading bytes of a block laid out as ``layout`` come before its payload (the
    header and the payload's marker): :attr:`ValueFormat.payload_start` of such a value."""
    return _section_sizes(fingerprint, n_tokens, layout)[0]


def _section_sizes(fingerprint: str, n_tokens: int, layout: BlockLayout) -> tuple[int, int]:
    specs = tuple(tuple((name, dtype, tuple(shape)) for name, dtype, shape in layer) for layer in layout)
    sizes = [(name, DTYPES[dtype].itemsize * math.prod(shape)) for layer in specs for name, dtype, shape in layer]
    prefix = _aligned_prefix(fingerprint, n_tokens, specs, sum(size for _, size in sizes))
    return len(prefix), sum(size for name, size in sizes if is_token_array(name))


@functools.lru_cache(maxsize=64)
def _check_encodable(specs: tuple, itemsizes: tuple, n_tokens: int) -> None:
    """``ValueError`` naming the first array a block cannot hold (cached: a store's blocks share specs)."""
    for (name, dtype, shape), itemsize in zip((a for layer in specs for a in layer), itemsizes):
        if dtype not in DTYPES or itemsize != DTYPES[dtype].itemsize:
            raise ValueError(f"{name}: dtype {dtype!r} ({itemsize}-byte bits) not storable; allowed: {', '.join(DTYPES)}")
        if is_token_array(name) and (len(shape) != 4 or shape[2] != n_tokens):
            raise ValueError(f"{name}: a token array must be 4-D with {n_tokens} tokens on axis 2, got {shape}")
        if not 1 <= len(shape) <= MAX_RANK or 0 in shape:
            raise ValueError(f"{name}: shape {shape}; allowed 1-{MAX_RANK} positive dimensions")


@dataclass(frozen=True)
class DecodedBlock:
    """A validated block; arrays are views into the stored value (no copy yet)."""

    n_tokens: int
    layers: list[dict[str, RawArray]]  # per layer, its arrays by name
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


def _array_spec(entry: object, n_tokens: int) -> tuple[str, str, np.dtype, tuple[int, ...], int]:
    """(name, dtype name, bits dtype, shape, bytes) of one header array entry, validated.

    Every field is type-checked before it is hashed or multiplied: a crafted header (a list
    where a dtype belongs) is a :class:`CorruptBlockError`, never a ``TypeError``.
    """
    if not isinstance(entry, list) or len(entry) != 3:
        raise CorruptBlockError(f"layers: array entry {entry!r} is not [name, dtype, shape]")
    name, dtype, shape = entry
    if not isinstance(name, str) or not ARRAY_NAME.fullmatch(name):
        raise CorruptBlockError(f"layers: array name {name!r} is not a valid name")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CorruptBlockError(f"{name}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_RANK or not all(_is_dim(d) for d in shape):
        raise CorruptBlockError(f"{name}: shape {shape!r} is not 1-{MAX_RANK} positive ints")
    if is_token_array(name) and (len(shape) != 4 or shape[2] != n_tokens):
        raise CorruptBlockError(f"{name}: shape {shape!r} does not hold {n_tokens} tokens on axis 2")
    bits_dtype = DTYPES[dtype]
    return name, dtype, bits_dtype, tuple(shape), bits_dtype.itemsize * math.prod(shape)


def _layer_specs(entries: list, n_tokens: int) -> list[list[tuple]]:
    """Per layer, the validated spec of each array; identical layers are validated once."""
    seen: dict[str, list] = {}
    specs = []
    for entry in entries:
        if not isinstance(entry, list):
            raise CorruptBlockError("layers: a layer entry is not a list of arrays")
        key = repr(entry)  # entries are msgpack data: repr is a faithful, always-hashable key
        layer = seen.get(key)
        if layer is None:
            layer = [_array_spec(a, n_tokens) for a in entry]
            names = [a[0] for a in layer]
            if names != sorted(set(names)):
                raise CorruptBlockError(f"layers: array names {names} are not unique and in order")
            seen[key] = layer
        specs.append(layer)
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
class ValueFormat:
    """A parsed and validated value prefix (header and payload marker)."""

    prefix: bytes
    header: dict
    specs: list  # per layer, (name, dtype name, bits dtype, shape, bytes) of its arrays
    layout: BlockLayout
    payload_start: int
    payload_length: int
    token_length: int  # bytes of the token section (the payload's first part)
    masked: bool  # the token checksum and digest sit where the encoder puts them (see _SUM_TAIL)
    uniform: bool  # every array has one dtype and shape (a plain K/V block)

    @functools.cached_property
    def flat(self) -> tuple[tuple[int, tuple], ...]:
        """``(layer index, array spec)`` of every array, in layer then name order."""
        return tuple((i, spec) for i, layer in enumerate(self.specs) for spec in layer)

    @functools.cached_property
    def stacked(self) -> bool:
        """Every array a token array of one dtype and shape (a plain K/V block): one view holds them all."""
        return self.uniform and all(is_token_array(spec[0]) for _, spec in self.flat)

    @functools.cached_property
    def payload_order(self) -> tuple[tuple[int, tuple, bool], ...]:
        """``(layer index, array spec, is a token array)`` in payload order: the token section's
        arrays, then the state section's (each in layer, name order). Worked out once per format."""
        flat = [(i, spec, is_token_array(spec[0])) for i, layer in enumerate(self.specs) for spec in layer]
        return tuple([a for a in flat if a[2]] + [a for a in flat if not a[2]])


# Parsed prefixes seen recently, most recent last: every block of a store has the same one
# but for its digest, so a fetch of many blocks parses the header once (a pure memo, like
# ``re``'s pattern cache). Bounded LRU; the lock makes lookups safe from several threads.
_FORMATS: OrderedDict[bytes, ValueFormat] = OrderedDict()
_FORMATS_LOCK = threading.Lock()
_MAX_FORMATS = 16


def _masked(view: memoryview | bytes, n: int) -> bytes:
    """The first ``n`` bytes with the token checksum and digest spans zeroed (where the encoder
    writes them)."""
    return (bytes(view[:n - _SUM_TAIL]) + bytes(_SUM_BYTES) + bytes(view[n - _SUM_TAIL + _SUM_BYTES:n - _DIGEST_TAIL])
            + bytes(DIGEST_BYTES) + bytes(view[n - 5:n]))


def _same_prefix(view: memoryview, fmt: ValueFormat) -> bool:
    n = len(fmt.prefix)
    if len(view) < n:
        return False
    if not fmt.masked:
        return view[:n] == fmt.prefix
    spans = ((0, n - _SUM_TAIL), (n - _SUM_TAIL + _SUM_BYTES, n - _DIGEST_TAIL), (n - 5, n))
    return all(view[a:b] == fmt.prefix[a:b] for a, b in spans)


def _known_format(view: memoryview) -> tuple[ValueFormat, bytes, bytes] | None:
    """A remembered format this value has, and the value's digest and token checksum."""
    with _FORMATS_LOCK:
        for key, fmt in _FORMATS.items():
            n = len(fmt.prefix)
            if _same_prefix(view, fmt):
                _FORMATS.move_to_end(key)  # iteration ends here, so moving is safe
                if not fmt.masked:
                    return fmt, fmt.header["digest"], fmt.header["token_checksum"]
                return (fmt, bytes(view[n - _DIGEST_TAIL:n - 5]),
                        bytes(view[n - _SUM_TAIL:n - _SUM_TAIL + _SUM_BYTES]))
    return None


def _remember_format(fmt: ValueFormat) -> None:
    key = _masked(fmt.prefix, len(fmt.prefix)) if fmt.masked else fmt.prefix
    with _FORMATS_LOCK:
        _FORMATS[key] = fmt
        _FORMATS.move_to_end(key)
        while len(_FORMATS) > _MAX_FORMATS:
            _FORMATS.popitem(last=False)


def read_header(value: bytes | memoryview) -> tuple[dict, int]:
    """The header map of a stored value and where the payload's marker starts; no checks
    beyond "a 3-element msgpack array whose first element is a map"."""
    view = memoryview(value)
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
    return header, payload_at


def _read_format(view: memoryview, n_tokens: int) -> ValueFormat:
    header, payload_at = read_header(view)
    if header.get("version") != FORMAT_VERSION:
        version = header.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and 1 <= version < FORMAT_VERSION:
            raise OldFormatError(f"version: {version}, an earlier format; this store reads {FORMAT_VERSION}")
        raise CorruptBlockError(f"version: {version!r}, expected {FORMAT_VERSION}", "version")
    if not _is_dim(header.get("tokens")) or header["tokens"] != n_tokens:
        raise CorruptBlockError(f"tokens: {header.get('tokens')!r}, expected {n_tokens}")
    digest = header.get("digest")
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise CorruptBlockError("digest: missing or not a 32-byte chain digest", "key")
    token_sum = header.get("token_checksum")
    if not isinstance(token_sum, bytes) or len(token_sum) != _SUM_BYTES:
        raise CorruptBlockError("token_checksum: missing or not 8 bytes")
    layer_specs = header.get("layers")
    if not isinstance(layer_specs, list) or not layer_specs:
        raise CorruptBlockError("layers: missing or empty")
    if payload_at >= len(view):
        raise CorruptBlockError("value: truncated before the payload")
    start, length = _payload_span(view, payload_at)
    specs = _layer_specs(layer_specs, n_tokens)
    described = sum(a[4] for layer in specs for a in layer)
    if described != length or not described:
        raise CorruptBlockError(f"payload: {length} bytes, layers describe {described}")
    masked = (start >= _SUM_TAIL + 2 and list(header)[-2:] == ["token_checksum", "digest"]
              and bytes(view[start - _SUM_TAIL - 2:start - _SUM_TAIL]) == b"\xc4\x08"
              and bytes(view[start - _SUM_TAIL:start - _SUM_TAIL + _SUM_BYTES]) == token_sum
              and bytes(view[start - _DIGEST_TAIL - 2:start - _DIGEST_TAIL]) == b"\xc4\x20"
              and bytes(view[start - _DIGEST_TAIL:start - 5]) == digest)
    layout = tuple(tuple((name, dtype, shape) for name, dtype, _, shape, _ in layer) for layer in specs)
    flat = [(a[1], a[3]) for layer in specs for a in layer]
    token_length = sum(a[4] for layer in specs for a in layer if is_token_array(a[0]))
    fmt = ValueFormat(bytes(view[:start]), header, specs, layout, start, length, token_length, masked,
                  flat.count(flat[0]) == len(flat))
    _remember_format(fmt)
    return fmt


def bound_format(head: memoryview, *, fingerprint: str, n_tokens: int, digest: bytes) -> tuple[ValueFormat, bytes]:
    """The format of the value whose first bytes are ``head`` (at least its header and payload
    marker: :attr:`ValueFormat.payload_start` bytes), checked against the model's fingerprint,
    the token count and the key's ``digest``; and the value's token checksum (8 bytes).
    :class:`CorruptBlockError` saying which check failed."""
    known = _known_format(head)
    if known is None:
        fmt = _read_format(head, n_tokens)
        stored_digest, token_sum = fmt.header["digest"], fmt.header["token_checksum"]
    else:
        fmt, stored_digest, token_sum = known
    header = fmt.header
    if header.get("fingerprint") != fingerprint:
        raise CorruptBlockError("fingerprint: block belongs to another model or layout", "fingerprint")
    if header.get("tokens") != n_tokens:
        raise CorruptBlockError(f"tokens: {header.get('tokens')!r}, expected {n_tokens}")
    if stored_digest != digest:
        raise CorruptBlockError("key: a valid block of another key (its digest names another prefix)", "key")
    return fmt, token_sum


def decode_block(value: bytes | memoryview, *, fingerprint: str, n_tokens: int,
                 digest: bytes, state: bool = True) -> DecodedBlock:
    """Parse and validate a stored value; raise :class:`CorruptBlockError` saying why not.

    Checks the format version, fingerprint, token count, key binding (the header's digest
    is ``digest``, the chain digest its key names), dtypes and shapes against the payload
    size, and the checksums. The returned arrays view ``value``. With ``state=False``,
    ``value`` may be just the first :func:`token_section_end` bytes (or a whole value): only
    the token section is checked and returned (``layout`` still describes every array).
    """
    view = memoryview(value)
    fmt, token_sum = bound_format(view, fingerprint=fingerprint, n_tokens=n_tokens, digest=digest)
    start, end = fmt.payload_start, fmt.payload_start + fmt.payload_length
    token_end = start + fmt.token_length
    whole = end + 9 == len(view) and view[end] == _UINT64
    if not whole and (state or len(view) != token_end):
        raise CorruptBlockError(f"value: {len(view)} bytes, payload says {end + 9} (truncated or padded)")
    if payload_checksum(view[start:token_end]) != int.from_bytes(token_sum, "big"):
        raise CorruptBlockError("checksum: token section does not match", "checksum")
    if state and payload_checksum(view[token_end:end]) != int.from_bytes(view[end + 1:end + 9], "big"):
        raise CorruptBlockError("checksum: state section does not match", "checksum")
    data = np.frombuffer(view[start:end if state else token_end], dtype=np.uint8)
    return DecodedBlock(n_tokens, _payload_arrays(data, fmt, state), fmt.layout)


def _payload_arrays(data: np.ndarray, fmt: ValueFormat, state: bool = True) -> list[dict[str, RawArray]]:
    """Per layer, views of its arrays in the payload bytes ``data`` (token section first, then,
    with ``state``, the state section)."""
    flat = fmt.flat
    out: list[dict[str, RawArray]] = [{} for _ in fmt.specs]
    if fmt.stacked:  # a plain K/V block: one view
        _, _, bits_dtype, shape, _ = flat[0][1]
        for (i, (name, dtype, *_)), view in zip(flat, data.view(bits_dtype).reshape((len(flat),) + shape)):
            out[i][name] = RawArray(dtype, view)
        return out
    ordered = [a for a in flat if is_token_array(a[1][0])] + ([a for a in flat if not is_token_array(a[1][0])]
                                                              if state else [])
    pos = 0
    for i, (name, dtype, bits_dtype, shape, size) in ordered:
        out[i][name] = RawArray(dtype, data[pos:pos + size].view(bits_dtype).reshape(shape))
        pos += size
    # Arrays of a layer in name order, as the header lists them.
    return [{name: layer[name] for name in sorted(layer)} for layer in out]
