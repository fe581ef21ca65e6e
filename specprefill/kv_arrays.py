"""mlx arrays as raw bits and back, for the block store.

Storage (``cache_store``) knows neither mlx nor mlx-lm: it keeps, per layer, named arrays
of raw bits, each a ``(dtype name, numpy unsigned-int view of the bits)`` pair. This module
is the one place mlx arrays cross into that form and back; which arrays a layer's cache
holds (every mlx-lm cache type) is :mod:`specprefill.attention.caches`'s, and
:class:`specprefill.draft_cache.BlockDraftCache` joins the two. Arrays travel as bits
(``bfloat16`` as ``uint16``), so float32, float16 and bfloat16 round-trip bit-exactly.
"""
from __future__ import annotations

import io
import logging
from typing import Mapping, Sequence

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

RawBits = tuple[str, np.ndarray]  # (dtype name, numpy view of the bits; logical shape)
LayerArrays = Mapping[str, RawBits]  # one layer's named arrays

# dtype name -> (mlx dtype, numpy dtype of the same width that carries the bits)
DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "float32": (mx.float32, np.dtype("<u4")),
    "float16": (mx.float16, np.dtype("<u2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
    "uint32": (mx.uint32, np.dtype("<u4")),  # a quantized cache's packed values
}
DTYPE_NAMES: dict[mx.Dtype, str] = {mx_dtype: name for name, (mx_dtype, _) in DTYPES.items()}
_NUMPY_FLOATS = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "uint32": np.dtype("<u4")}


def dtype_name(dtype: mx.Dtype) -> str:
    """The storage name of an mlx dtype; ``ValueError`` for dtypes a KV block cannot hold."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype: {dtype} not storable; allowed: {', '.join(DTYPES)}") from None


def raw_bits_many(arrays: Sequence[mx.array]) -> list[RawBits]:
    """Zero-copy numpy views of mlx arrays' bits, evaluating all of them at once.

    A view may be strided (a slice of a bigger cache buffer); storing it copies it.
    """
    names = [dtype_name(a.dtype) for a in arrays]
    # float32/float16 are numpy dtypes too; only bfloat16 needs an mlx-side bit view.
    carriers = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
    mx.eval(carriers)
    return [(name, np.asarray(c).view(DTYPES[name][1])) for name, c in zip(names, carriers)]


def to_mlx_many(raws: Sequence[RawBits]) -> list[mx.array]:
    """mlx arrays (their own copies) from raw bits, evaluated together."""
    out = []
    for name, bits in raws:
        numpy_float = _NUMPY_FLOATS.get(name)
        if numpy_float is None:  # bfloat16: numpy has no such type, view the bits in mlx
            out.append(mx.array(bits).view(DTYPES[name][0]))
        else:
            out.append(mx.array(bits.view(numpy_float)))
    mx.eval(out)
    return out


_CARRIERS = {np.dtype("<u2"): mx.uint16, np.dtype("<u4"): mx.uint32}


class _Unfilled(io.RawIOBase):
    """An ``.npy`` stream whose payload is never written: ``mx.load`` reads it into the new
    array's own buffer, so the array is allocated without the zero fill ``mx.zeros`` runs
    (mlx has no uninitialised allocation: ``mx.empty`` is ``mx.zeros``)."""

    name = "unfilled.npy"  # mx.load asks a file object for its name and mode
    mode = "rb"

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        super().__init__()
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, {"descr": dtype.str, "fortran_order": False, "shape": shape})
        self._head = head.getvalue()
        self._size = len(self._head) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = (offset, self._pos + offset, self._size + offset)[whence]
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(memoryview(buffer).cast("B")), self._size - self._pos)
        head = self._head[self._pos:self._pos + n]
        if head:
            memoryview(buffer).cast("B")[:len(head)] = head
        self._pos += n  # the payload's bytes are left as allocated: the fetch writes every one it keeps
        return n


_UNFILLED_WORKS = [True]  # until an mlx reads the stream otherwise; then zero-filled, as before


def _unfilled(shape: tuple[int, ...], carrier: np.dtype) -> mx.array:
    """A new evaluated mlx array of ``shape`` whose contents are whatever its memory held (zeros
    on an mlx whose ``.npy`` reader does not take the stream: slower, never wrong)."""
    if _UNFILLED_WORKS[0]:
        try:
            array = mx.load(_Unfilled(carrier, shape))
            if array.shape == tuple(shape) and array.dtype == _CARRIERS[carrier]:
                return array
        except (ValueError, RuntimeError, OSError) as exc:
            log.warning("unfilled allocation unavailable (%s): fetch destinations are zero-filled", exc)
        _UNFILLED_WORKS[0] = False
    return mx.zeros(shape, dtype=_CARRIERS[carrier])


class MlxDestinations:
    """The ``allocate`` of a block store's fetch that puts the prefix straight into mlx memory.

    Each destination is a writable numpy view of a new mlx array holding the bits (mlx documents
    that writes through ``np.array(a, copy=False)`` are the array's), so the store copies each
    block once, into the arrays the restored cache then holds: no join in numpy and no second
    copy into mlx. The arrays are allocated unfilled (:class:`_Unfilled`; the zero fill was a
    quarter of a warm local-tier fetch): the store writes every token it returns and trims the
    rest away (``cache_store.prefix``), so no unwritten byte is ever restored.
    """

    def __init__(self) -> None:
        self._made: dict[int, tuple[np.ndarray, mx.array]] = {}

    def __call__(self, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        carrier = _unfilled(shape, DTYPES[dtype][1])
        view = np.array(carrier, copy=False)  # evaluates the carrier: the view is its memory
        self._made[id(view)] = (view, carrier)
        return view

    def to_mlx_many(self, raws: Sequence[RawBits]) -> list[mx.array]:
        """mlx arrays of raw bits: the arrays behind this allocation's views as they are, any
        other raw bits copied in (:func:`to_mlx_many`)."""
        out: list[mx.array | None] = []
        copies = []
        for name, bits in raws:
            made = self._made.get(id(bits))
            if made is not None and made[0] is bits:
                out.append(made[1] if made[1].dtype == DTYPES[name][0] else made[1].view(DTYPES[name][0]))
            else:
                out.append(None)
                copies.append((name, bits))
        copied = iter(to_mlx_many(copies))
        out = [a if a is not None else next(copied) for a in out]
        mx.eval(out)
        return out
