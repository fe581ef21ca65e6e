"""Helpers for the block-store tests: real draft caches from tiny models, and the worker's wiring of
their block store."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def prefilled(model, tokens, *, chunks=()):
    """The model's cache after prefilling ``tokens`` (split at the ``chunks`` offsets), evaluated."""
    cache = make_prompt_cache(model)
    bounds = [0, *chunks, len(tokens)]
    logits = None
    for start, end in zip(bounds, bounds[1:]):
        logits = model(mx.array([list(tokens[start:end])]), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return cache, logits


def continue_prefill(model, cache, tokens):
    """Run ``tokens`` through ``cache`` (in place); return the last logits."""
    logits = model(mx.array([list(tokens)]), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits


def bits(array: mx.array):
    """The array's raw bits as numpy (bfloat16 included), for bit-exact comparisons."""
    import numpy as np

    view = {2: mx.uint16, 4: mx.uint32}[array.dtype.size]
    return np.asarray(array.view(view))


def same_bits(a: mx.array, b: mx.array) -> bool:
    import numpy as np

    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


def raw_bits(array: mx.array):
    """One array's raw bits, as the store takes them (a ``RawArray``)."""
    from cache_store import RawArray
    from specprefill.kv_arrays import raw_bits_many

    return RawArray(*raw_bits_many([array])[0])


def to_mlx(raw) -> mx.array:
    """One raw array back to mlx through the conversion's batch form."""
    from specprefill.kv_arrays import to_mlx_many

    return to_mlx_many([raw])[0]


def kv_layer(keys: mx.array, values: mx.array) -> dict:
    """One layer of a block: its keys and values as named raw arrays."""
    return {"keys": raw_bits(keys), "values": raw_bits(values)}


def fingerprint(model, identity: str, *, block_size: int, kv_bits=None, kv_group_size: int = 64) -> str:
    """A tiny model's block-store fingerprint, derived as the worker derives a draft's (from its profile)."""
    from cache_store import model_fingerprint
    from specprefill.profile import profile_model

    profile = profile_model(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
    return model_fingerprint(profile.description, identity, block_size=block_size)


def draft_store(client, model, *, block_size: int, identity: str = "tiny", kv_bits=None, kv_group_size: int = 64,
                namespace: str = "specprefill", ttl_s: int = 86400, local=None, on_fetch=None, on_store=None,
                checkpoint_blocks=None, tails: bool = False):
    """The worker's block store for a draft ``model`` (``worker.runtime.wire_block_store``: a
    ``RedisBlockStore`` with the model's layout behind ``BlockDraftCache`` over its fresh cache);
    ``tails``: keeping partial last blocks, as the target's prefix store does."""
    from specprefill.attention.probe import make_cache
    from worker.runtime import wire_block_store

    def fresh():
        return make_cache(model, kv_bits, kv_group_size)

    fp = fingerprint(model, identity, block_size=block_size, kv_bits=kv_bits, kv_group_size=kv_group_size)
    return wire_block_store(client, model, fresh, fp, namespace=namespace, block_size=block_size, ttl_s=ttl_s,
                            label={"model": identity, "name": "draft"}, local=local, on_fetch=on_fetch,
                            on_store=on_store, checkpoint_blocks=checkpoint_blocks, tails=tails)


def worker_store(client, model, *, block_size: int, namespace: str = "specprefill", local=None, identity="tiny"):
    """A model's block store wired as ``worker.runtime`` wires it (:func:`draft_store`), optionally
    with a local tier in front."""
    return draft_store(client, model, block_size=block_size, namespace=namespace, local=local, identity=identity)


def assert_restored_prefix(restored, cache, n_tokens: int) -> None:
    """``restored`` (a fetch's cache, None for a miss) holds exactly the first ``n_tokens`` of
    ``cache``'s keys and values, bit for bit."""
    from specprefill.attention.caches import layer_arrays

    if n_tokens == 0:
        assert restored is None
        return
    for ours, theirs in zip(restored, cache):
        a, b = layer_arrays(ours)[1], layer_arrays(theirs)[1]
        for name in ("keys", "values"):
            assert mx.array_equal(a[name], b[name][:, :, :n_tokens]).item(), name


def stored_chain(client, model, tokens, *, block_size: int, **kwargs):
    """``(store, cache, keys)``: ``tokens`` prefilled by ``model`` and stored through
    :func:`worker_store` (``kwargs`` go to it), with the keys of its blocks."""
    store = worker_store(client, model, block_size=block_size, **kwargs)
    cache, _ = prefilled(model, tokens)
    store.store(tokens, cache)
    return store, cache, store.raw_store.block_keys(tokens)
