"""Comparisons for the block-store tests of every cache type: arrays bit for bit, warm = cold."""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


def same_arrays(a: dict, b: dict) -> bool:
    """Same names, dtypes, shapes and values (bit for bit but NaN)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]).item() for k in a)


def assert_warm_is_cold(warm: Any, cold: Any) -> None:
    """A warm score (prefix restored) is the cold one, both prefilled in steps ending at block
    ends: importance, selection and cache arrays bit for bit; lookahead tokens equal."""
    from specprefill.attention.caches import layer_arrays
    from specprefill.options import SelectionOptions
    from specprefill.selection import plan_selection

    assert warm.lookahead_tokens == cold.lookahead_tokens
    assert np.array_equal(np.array(warm.importance), np.array(cold.importance))
    options = SelectionOptions(keep=0.3, chunk_size=8, tail_tokens=8, threshold=0)
    assert (plan_selection(warm.importance, options=options).indices.tolist()
            == plan_selection(cold.importance, options=options).indices.tolist())
    for ours, theirs in zip(warm.kv_cache, cold.kv_cache):  # the warm cache is the cold one
        assert same_arrays(layer_arrays(ours)[1], layer_arrays(theirs)[1])
