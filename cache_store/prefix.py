"""A prefix's arrays, built from its blocks as they are read.

Each block's token arrays are read once, straight into their place in destinations sized
for the whole chain (:meth:`PrefixAssembler.place`, then :meth:`commit` once the block passed
its checks); state arrays are taken from the last block only, so the blocks before it may come
without theirs. The destinations come from ``allocate``, so a caller that wants the prefix in
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
Places = dict[tuple[int, str], np.ndarray]


def numpy_empty(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The default ``allocate``: plain numpy memory."""
    return np.empty(shape, dtype=DTYPES[dtype])


class PrefixAssembler:
    """Joins consecutive valid blocks of one chain (placed and committed in prompt order) into one prefix."""

    def __init__(self, block_size: int, n_blocks: int, allocate: Allocate | None = None) -> None:
        self.block_size = block_size
        self.capacity = n_blocks  # blocks the destinations are sized for
        self.n_blocks = 0  # committed
        self._placed = 0
        self._allocate = allocate or numpy_empty
        self._token_arrays: list[dict[str, np.ndarray]] | None = None
        self._first_layout: BlockLayout | None = None
        self._last: DecodedBlock | None = None
        self._state: DecodedBlock | None = None  # the last block with its state arrays, if read

    @property
    def first_layout(self) -> BlockLayout | None:
        """The layout of the chain's first block (every later one must match it), once placed."""
        return self._first_layout

    def place(self, layout: BlockLayout, state: bool) -> Places:
        """Where the next block's arrays go: its token arrays' slot in the joined arrays, and new
        arrays for its state arrays (with ``state``). Blocks are placed in prompt order; one may
        be placed before the one before it is committed."""
        if self._placed >= self.capacity:
            raise ValueError(f"prefix: more than the {self.capacity} blocks it was sized for")
        if self._token_arrays is None:
            self._first_layout = layout
            self._token_arrays = [{name: self._new(dtype, _joined_shape(shape, self.capacity * self.block_size))
                                   for name, dtype, shape in layer if is_token_array(name)} for layer in layout]
        span = slice(self._placed * self.block_size, (self._placed + 1) * self.block_size)
        self._placed += 1
        places = {(i, name): destinations[name][:, :, span]
                  for i, destinations in enumerate(self._token_arrays) for name in destinations}
        if state:
            places.update(self._state_places(layout))
        return places

    def place_state(self, layout: BlockLayout, state: bool = True) -> Places:
        """Where the last committed block's arrays go when it is read again for its state: its
        token arrays into scratch (the committed ones stay as they are), state arrays new."""
        scratch = {(i, name): np.empty(shape, DTYPES[dtype]) for i, layer in enumerate(layout)
                   for name, dtype, shape in layer if is_token_array(name)}
        return {**scratch, **(self._state_places(layout) if state else {})}

    def _state_places(self, layout: BlockLayout) -> Places:
        return {(i, name): self._new(dtype, shape) for i, layer in enumerate(layout)
                for name, dtype, shape in layer if not is_token_array(name)}

    def commit(self, block: DecodedBlock) -> None:
        """The next placed block passed its checks: it follows the blocks committed before."""
        if self.n_blocks >= self._placed:
            raise ValueError("prefix: commit of a block that was never placed")
        self._last = block
        self._state = block if _has_state(block) else None  # never an earlier block's state
        self.n_blocks += 1

    @property
    def needs_state(self) -> bool:
        """True when the last block committed came without the state arrays its layout has."""
        return self._last is not None and self._state is None

    def take_state(self, block: DecodedBlock) -> None:
        """The state arrays of the last block committed, from ``block`` (placed by
        :meth:`place_state`): that block read whole."""
        if block.layout != self._last.layout or not _has_state(block):
            raise ValueError("prefix: the state must come from the last block, read whole")
        self._state = block

    def result(self) -> list[dict[str, RawArray]] | None:
        """Per layer its named arrays: token arrays of the blocks committed, state arrays of the
        last; None if no block was committed."""
        if self._last is None:
            return None
        if self._state is None:
            raise ValueError("prefix: the last block's state arrays were never read")
        n_tokens = self.n_blocks * self.block_size
        out = []
        for destinations, layer in zip(self._token_arrays, self._state.layers):
            arrays = {}
            for name, a in layer.items():
                if name in destinations:
                    arrays[name] = RawArray(a.dtype, self._trimmed(a.dtype, destinations[name], n_tokens))
                else:
                    arrays[name] = a  # read into a new array of its own
            out.append(arrays)
        return out

    def _trimmed(self, dtype: str, destination: np.ndarray, n_tokens: int) -> np.ndarray:
        """``destination`` if it holds exactly ``n_tokens``, else its first ``n_tokens`` in a new array
        (a block that vanished or failed after the sizing: rare)."""
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


def _has_state(block: DecodedBlock) -> bool:
    """Whether ``block`` holds every array its layout lists (a token-section read holds none of
    the state arrays)."""
    return all(name in arrays for layer, arrays in zip(block.layout, block.layers) for name, _, _ in layer)


def _joined_shape(shape: Sequence[int], n_tokens: int) -> tuple[int, ...]:
    return (*shape[:2], n_tokens, *shape[3:])
