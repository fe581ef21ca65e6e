"""A prefix's arrays, built from its blocks as they are read.

Each block's token arrays are read once, straight into their place in destinations sized
for the whole chain (:meth:`PrefixAssembler.place`, then :meth:`commit` once the block passed
its checks); a hybrid model's recurrent state comes from one checkpoint value, the latest the
chain reaches (:meth:`PrefixAssembler.take_checkpoint`: the prefix then ends there); a K/V
model's prefix may end with a *tail*, a partial last block (:meth:`PrefixAssembler.place_tail`). The destinations come from ``allocate``, so a caller that wants the prefix in
another library's memory (``specprefill.kv_arrays.MlxDestinations``: mlx arrays) gets it
there with no copy at all beyond the read.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .codec import DTYPES, BlockLayout, DecodedBlock, RawArray, is_token_array

# (dtype name, shape) -> a new writable C-contiguous array of that shape whose dtype is the
# name's bits dtype (``codec.DTYPES``: "bfloat16" -> uint16); its contents are overwritten.
Allocate = Callable[[str, tuple[int, ...]], np.ndarray]
# (layer index, array name) -> the array a block's bits go to, or (that array, its C-contiguous
# byte pieces in C order) when the placer has them at hand (``cache_store.block_reader.Place``).
Places = dict[tuple[int, str], "np.ndarray | tuple[np.ndarray, list[memoryview]]"]


def numpy_empty(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The default ``allocate``: plain numpy memory."""
    return np.empty(shape, dtype=DTYPES[dtype])


class PrefixAssembler:
    """Joins consecutive valid blocks of one chain (placed and committed in prompt order) into one
    prefix, with the recurrent state of a checkpoint it reaches (:meth:`take_checkpoint`)."""

    def __init__(self, block_size: int, n_blocks: int, allocate: Allocate | None = None, tail: int = 0) -> None:
        if not 0 <= tail < block_size:
            raise ValueError(f"tail: {tail!r} tokens; allowed 0 to {block_size - 1}")
        self.block_size = block_size
        self.capacity = n_blocks  # blocks the destinations are sized for
        self.tail = tail  # tokens of a partial last block after them the destinations hold room for
        self.n_blocks = 0  # committed (or, after a checkpoint, the blocks it ends)
        self.tail_committed = False
        self._placed = 0
        self._allocate = allocate or numpy_empty
        self._token_arrays: list[dict[str, np.ndarray]] | None = None
        self._pieces: dict[tuple[int, str], tuple[memoryview, int, int, int]] = {}  # see _slot
        self._first_layout: BlockLayout | None = None
        self._state: DecodedBlock | None = None  # the checkpoint's state arrays, if read
        self._tail_layout: BlockLayout | None = None  # the tail's, when no block came before it

    @property
    def first_layout(self) -> BlockLayout | None:
        """The layout of the chain's first block (every later one must match it), once placed."""
        return self._first_layout

    def place(self, layout: BlockLayout, state: bool = False) -> Places:
        """Where the next block's arrays go: its token arrays' slot in the joined arrays. Blocks
        are placed in prompt order; one may be placed before the one before it is committed."""
        if self._placed >= self.capacity:
            raise ValueError(f"prefix: more than the {self.capacity} blocks it was sized for")
        if self._token_arrays is None:
            self._first_layout = layout
            room = self.capacity * self.block_size + self.tail
            self._token_arrays = [{name: self._new(dtype, _joined_shape(shape, room))
                                   for name, dtype, shape in layer if is_token_array(name)} for layer in layout]
        start = self._placed * self.block_size
        self._placed += 1
        places = {(i, name): self._slot(i, name, start, start + self.block_size)
                  for i, destinations in enumerate(self._token_arrays) for name in destinations}
        if state:  # a value holding state arrays too (another writer's): they go to new arrays
            places.update(self.place_checkpoint(layout))
        return places

    def place_tail(self, layout: BlockLayout, state: bool = False) -> Places:
        """Where the tail's token arrays go (right after the last block, once every block it
        was sized for is committed); a tail holds no state arrays (``state`` is only whether the
        reader reads a value's state section: a tail's is empty)."""
        if not self.tail or self.tail_committed or self.n_blocks != self.capacity:
            raise ValueError("prefix: a tail follows all the blocks it was sized for, once")
        if any(not is_token_array(name) for layer in layout for name, _, _ in layer):
            raise ValueError("prefix: a tail holds token arrays only")
        if self._token_arrays is None:  # a tail with no block before it
            self._token_arrays = [{name: self._new(dtype, _joined_shape(shape, self.tail))
                                   for name, dtype, shape in layer if is_token_array(name)} for layer in layout]
            self._tail_layout = layout
        start = self.capacity * self.block_size
        return {(i, name): self._slot(i, name, start, start + self.tail)
                for i, destinations in enumerate(self._token_arrays) for name in destinations}

    def _slot(self, i: int, name: str, start: int, stop: int) -> "np.ndarray | tuple[np.ndarray, list[memoryview]]":
        """Tokens ``[start, stop)`` of layer ``i``'s joined ``name``: the slice, with its pieces (one
        per batch row and head, cut from the destination's bytes: cheaper than the reader splitting
        the slice, per block and array) when the destination is C-contiguous."""
        destination = self._token_arrays[i][name]
        pieces = self._pieces.get((i, name))
        if pieces is None and destination.flags.c_contiguous:
            b, h, n = destination.shape[:3]
            row = destination.itemsize * int(np.prod(destination.shape[3:], dtype=np.int64))
            pieces = self._pieces[(i, name)] = (memoryview(destination).cast("B"), b * h, n, row)
        view = destination[:, :, start:stop]
        if pieces is None:
            return view
        flat, rows, n, row = pieces
        return view, [flat[(k * n + start) * row:(k * n + stop) * row] for k in range(rows)]

    def commit_tail(self, block: DecodedBlock) -> None:
        """The tail passed its checks: the prefix ends ``tail`` tokens after its last block."""
        if self.n_blocks != self.capacity or self.has_state:
            raise ValueError("prefix: a tail commits after every block, and never after a checkpoint")
        self.tail_committed = True

    @property
    def n_tokens(self) -> int:
        """Tokens of the prefix committed so far (blocks, and the tail if it was committed)."""
        return self.n_blocks * self.block_size + (self.tail if self.tail_committed else 0)

    def place_checkpoint(self, layout: BlockLayout, state: bool = True) -> Places:
        """Where a checkpoint value's arrays go: each state array to a new array of its own."""
        return {(i, name): self._new(dtype, shape) for i, layer in enumerate(layout)
                for name, dtype, shape in layer if not is_token_array(name)}

    def commit(self, block: DecodedBlock) -> None:
        """The next placed block passed its checks: it follows the blocks committed before."""
        if self.n_blocks >= self._placed:
            raise ValueError("prefix: commit of a block that was never placed")
        self.n_blocks += 1

    @property
    def has_state(self) -> bool:
        """Whether a checkpoint's state was taken (the prefix then ends at it)."""
        return self._state is not None

    def take_checkpoint(self, block: DecodedBlock, n_blocks: int) -> None:
        """The state after the last token of block ``n_blocks - 1`` (a checkpoint value read
        into :meth:`place_checkpoint`'s places): the prefix ends there."""
        if not 0 < n_blocks <= self.n_blocks:
            raise ValueError(f"prefix: a checkpoint after block {n_blocks}, {self.n_blocks} blocks committed")
        if any(is_token_array(name) for layer in block.layers for name in layer):
            raise ValueError("prefix: a checkpoint holds state arrays only")
        self._state, self.n_blocks = block, n_blocks

    def result(self) -> list[dict[str, RawArray]] | None:
        """Per layer its named arrays: token arrays of the blocks committed, state arrays of the
        checkpoint taken (if any); None if no block was committed."""
        n_tokens = self.n_tokens
        if not n_tokens:
            return None
        layout = self._first_layout if self._first_layout is not None else self._tail_layout
        dtypes = {(i, name): dtype for i, layer in enumerate(layout) for name, dtype, _ in layer}
        out = []
        for i, destinations in enumerate(self._token_arrays):
            arrays = {name: RawArray(dtypes[(i, name)], self._trimmed(dtypes[(i, name)], a, n_tokens))
                      for name, a in destinations.items()}
            if self._state is not None:
                arrays.update(self._state.layers[i])  # read into new arrays of their own
            out.append({name: arrays[name] for name in sorted(arrays)})
        return out

    def _trimmed(self, dtype: str, destination: np.ndarray, n_tokens: int) -> np.ndarray:
        """``destination`` if it holds exactly ``n_tokens``, else its first ``n_tokens`` in a new array
        (a block that vanished or failed after the sizing, or an earlier checkpoint: rare)."""
        if destination.shape[2] == n_tokens:
            return destination
        out = self._new(dtype, _joined_shape(destination.shape, n_tokens))
        np.copyto(out, destination[:, :, :n_tokens])
        return out

    def _new(self, dtype: str, shape: Sequence[int]) -> np.ndarray:
        shape = tuple(int(d) for d in shape)
        out = self._allocate(dtype, shape)
        if out.shape != shape or out.dtype != DTYPES[dtype] or not out.flags.writeable:
            raise ValueError(f"allocate: expected a writable {DTYPES[dtype]} array of shape {shape}, got "
                             f"{out.dtype} {out.shape}")
        return out


def _joined_shape(shape: Sequence[int], n_tokens: int) -> tuple[int, ...]:
    return (*shape[:2], n_tokens, *shape[3:])
