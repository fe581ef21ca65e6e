"""One block read in order from a value source (a socket, a file, bytes) into memory the caller places.

:func:`cache_store.codec.decode_block` checks a value held whole in memory. A fetch instead
reads each value once, straight where its arrays belong (``place``: a prefix's token arrays
into their slot of the joined arrays, which may be MLX-owned), so no ``bytes`` object of the
value exists and nothing is copied twice. The checks are the codec's: the header (format,
version, fingerprint, token count, the key's digest, sizes) before any payload is read, then
the token-section and state-section checksums over the bytes as they landed. Those run on a
helper thread (xxhash releases the GIL), so checking one block overlaps reading the next;
:meth:`PendingBlock.result` waits for the verdict, and nothing is used before it passed.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import xxhash

from .codec import BlockLayout, CorruptBlockError, DecodedBlock, RawArray, bound_format
from .wire import ValueSource

HEAD_BYTES = 1 << 16  # read first when the header's size is not known beforehand
_MAX_HEAD = 1 << 22
_TRAILER = 9  # the state checksum: a msgpack uint64
_UINT64 = 0xCF
_CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="block-checksums")
# Checking on the helper thread pays when a core is free for it; on two cores or fewer the
# hand-over costs more than the overlap gains (bench/block_store.py), so checks run inline there.
OVERLAP = (os.cpu_count() or 1) > 2

# (the block's layout, whether its state arrays are read) -> per (layer index, array name)
# the array its bits go to (writable, the array's shape and bits dtype), or that array and its
# C-contiguous byte pieces in C order (a placer that has them saves splitting it here).
Place = Callable[[BlockLayout, bool], dict[tuple[int, str], "np.ndarray | tuple[np.ndarray, list[memoryview]]"]]


class PendingBlock:
    """A block whose bytes are in place and whose checksums are being checked."""

    def __init__(self, block: DecodedBlock, parts: list[memoryview], whole: bool, verdict: "Future | _Checked") -> None:
        self._block = block
        self.parts = parts  # the value's bytes as read, in order (a copy can be written elsewhere)
        self.whole = whole  # parts are the whole value, else its header and token section
        self._verdict = verdict

    @property
    def n_bytes(self) -> int:
        return sum(len(part) for part in self.parts)

    def result(self) -> DecodedBlock:
        """The block, once its checksums passed; :class:`CorruptBlockError` if they did not."""
        self._verdict.result()
        return self._block


class _Chained:
    """The bytes read with the head beyond its header, then the rest of the source."""

    def __init__(self, leftover: memoryview, source: ValueSource) -> None:
        self._leftover = leftover
        self._source = source

    def readinto(self, view: memoryview) -> None:
        self.readinto_many([view])

    def readinto_many(self, views: list[memoryview]) -> None:
        rest = []
        for view in views:
            have = min(len(view), len(self._leftover))
            if have:
                view[:have] = self._leftover[:have]
                self._leftover = self._leftover[have:]
            if have < len(view):
                rest.append(view[have:])
        if rest:
            self._source.readinto_many(rest)


def _runs(a: np.ndarray) -> list[memoryview]:
    """``a`` as C-contiguous byte pieces in C order (a slot of a joined array: one per head)."""
    if a.flags.c_contiguous:
        return [memoryview(a).cast("B")]
    while a.ndim > 1 and a.shape[0] == 1:  # the batch axis of a cache array: nothing to split
        a = a[0]
    if a.ndim > 1 and a[0].flags.c_contiguous:  # the usual slot: one piece per head, no recursion
        return [memoryview(sub).cast("B") for sub in a]
    return [run for sub in a for run in _runs(sub)]


def _placed(place: "np.ndarray | tuple[np.ndarray, list[memoryview]]") -> tuple[np.ndarray, list[memoryview] | None]:
    return place if type(place) is tuple else (place, None)


def _head(source: ValueSource, head_bytes: int | None, *, fingerprint: str, n_tokens: int, digest: bytes):
    """The value's first bytes and their checked format (reading more while the header does not fit)."""
    head = bytearray(min(source.length, head_bytes or HEAD_BYTES))
    source.readinto(memoryview(head))
    while True:
        try:
            return head, bound_format(memoryview(head), fingerprint=fingerprint, n_tokens=n_tokens, digest=digest)
        except CorruptBlockError as exc:
            if exc.reason != "header" or len(head) >= min(source.length, _MAX_HEAD):
                raise
        more = bytearray(min(source.length, _MAX_HEAD, 4 * len(head)) - len(head))
        source.readinto(memoryview(more))
        head += more


def _read_hashed(reader: ValueSource, runs: list[memoryview]) -> int:
    """Read ``runs`` in turn, hashing each as soon as it is in: the 64-bit XXH3 of them all."""
    h = xxhash.xxh3_64()
    read, update = reader.readinto, h.update
    for run in runs:
        read(run)
        update(run)
    return h.intdigest()


def _hash(runs: list[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for run in runs:
        h.update(run)
    return h.intdigest()


def read_block(source: ValueSource, *, fingerprint: str, n_tokens: int, digest: bytes, state: bool,
               place: Place, head_bytes: int | None = None, background: bool | None = None) -> PendingBlock:
    """Read the block in ``source`` (a whole value, or with ``state=False`` possibly only its
    header and token section) into the arrays ``place`` gives; ``head_bytes``: the header's
    size if known (``codec.header_end``). Header checks raise :class:`CorruptBlockError` at
    once; the checksums are checked on the helper thread (``background``; default: where a
    core is free for it, :data:`OVERLAP`) or here.
    Without ``state`` the state section is not read (the caller's stream drops it)."""
    head, (fmt, token_sum) = _head(source, head_bytes, fingerprint=fingerprint, n_tokens=n_tokens, digest=digest)
    start, end = fmt.payload_start, fmt.payload_start + fmt.payload_length
    whole = source.length == end + _TRAILER
    if not whole and (state or source.length != start + fmt.token_length):
        raise CorruptBlockError(f"value: {source.length} bytes, payload says {end + _TRAILER} (truncated or padded)")
    read_state = state and whole
    destinations = place(fmt.layout, read_state and fmt.payload_length > fmt.token_length)  # any state arrays
    leftover = memoryview(head)[start:]  # payload bytes read with the head (none when its size is known)
    reader = _Chained(leftover, source) if len(leftover) else source
    layers: list[dict[str, RawArray]] = [{} for _ in fmt.specs]
    token_runs: list[memoryview] = []
    state_runs: list[memoryview] = []
    for i, (name, dtype, bits_dtype, shape, _), token in fmt.payload_order:
        if not token and not read_state:
            break
        out, runs = _placed(destinations[(i, name)])
        if out.shape != shape or out.dtype != bits_dtype or not out.flags.writeable:
            raise ValueError(f"place: {name} of layer {i} needs a writable {bits_dtype} array of shape {shape}")
        (token_runs if token else state_runs).extend(_runs(out) if runs is None else runs)
        layers[i][name] = RawArray(dtype, out)
    trailer = bytearray(_TRAILER if read_state else 0)
    overlap = OVERLAP if background is None else background
    if overlap or getattr(source, "scatters", False):
        # Read it all in one call where the source can (a local file: one preadv per block, not
        # one per piece), then check it on the helper thread, or here while it is still cached.
        reader.readinto_many([*token_runs, *state_runs, memoryview(trailer)])  # in value order
        sums = None if overlap else (_hash(token_runs), _hash(state_runs))
    else:  # check each piece right after it landed, while it is still in the cache
        sums = (_read_hashed(reader, token_runs), _read_hashed(reader, state_runs))
        reader.readinto_many([memoryview(trailer)])
    parts = [memoryview(head)[:start], *token_runs, *state_runs, memoryview(trailer)]

    def check() -> None:
        token_hash, state_hash = sums or (_hash(token_runs), _hash(state_runs))
        if token_hash != int.from_bytes(token_sum, "big"):
            raise CorruptBlockError("checksum: token section does not match", "checksum")
        if read_state and (trailer[0] != _UINT64 or state_hash != int.from_bytes(trailer[1:], "big")):
            raise CorruptBlockError("checksum: state section does not match", "checksum")

    block = DecodedBlock(n_tokens, [{name: layer[name] for name in sorted(layer)} for layer in layers], fmt.layout)
    # Without the state read, the parts are the value's header and token section.
    return PendingBlock(block, parts, read_state, _verdict(check, overlap))


class _Checked:
    """The verdict of checks that ran here: a done ``Future``'s ``result()``, without its lock."""

    def __init__(self, error: BaseException | None) -> None:
        self._error = error

    def result(self) -> None:
        if self._error is not None:
            raise self._error


def _verdict(check: Callable[[], None], background: bool) -> "Future | _Checked":
    if background:
        return _CHECKS.submit(check)
    try:
        check()
    except BaseException as exc:
        return _Checked(exc)
    return _Checked(None)

