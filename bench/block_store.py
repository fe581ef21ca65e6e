"""The draft-KV block store, measured side by side in one run on a private local Redis.

1. Codec: encode + decode of one 256-token block of the scoring benchmark's draft
   model (4 layers, 2 KV heads, head dim 64, float32: 1 MiB), against a plain copy
   of the same arrays out of MLX into one bytes buffer and back (no framing, no
   checksum). A single memcpy of the value and the candidate checksums are shown
   for context.
2. Transport: a 64-block chain fetched through the worker's draft cache
   (``RedisBlockStore.fetch`` behind ``BlockDraftCache``: values read off the socket straight
   into MLX-owned arrays, validated, rebuilt ``KVCache`` objects) against raw GETs of the same
   keys streamed the same way, a few requests ahead, with nothing done to the values but
   redis-py's parser making them ``bytes`` (hiredis; ``cache_store.streamed_gets``), kept as
   they come: the wire's own rate for a chain that ends up in memory. Raw GETs that drop each
   value as the next comes are shown beside it: they write every value into the same freed,
   cache-hot buffer, while any reader of a chain (the fetch included) writes 64 MiB of new
   memory. Beside it too, where the fetch's time goes outside its socket reads (making the MLX
   arrays, header checks, Python, the rebuild). For context: one pipeline of all 64 GETs, and
   the streamed raw GETs with redis-py's own Python parser (why hiredis is a dependency), over
   TCP loopback and a unix socket.
3. End to end: scoring 4K and 8K-token prompts whose first 90% is stored (warm)
   against cold scoring with no store, same model as ``bench/scoring.py``; and the
   identical request answered from the selection memo.
4. Recurrent-state checkpoints: a tiny draft of the Qwen3.5 layer pattern scored warm (restored
   from its last checkpoint; and a prompt sharing 3/4 of it, from an earlier one) against cold,
   at 8K tokens (importance and selections must agree); then the bytes the store holds for an 8K
   prompt (``STRLEN`` of the values written by ``store_blocks``, headers included; arrays of
   random bits, since sizes depend on shapes alone) for a Qwen3.5-0.8B-shaped hybrid draft (its
   real 24 layers, widths and 3:1 Gated-DeltaNet/attention pattern; a 1024-word vocabulary since
   the vocabulary changes no cached byte), with checkpoints every 1 (format 3's state in every
   block), 4, 8, 16 (the default), 32 blocks or at the prompt's end only, against its K/V alone;
   a dense Qwen2.5-0.5B-shaped draft (bfloat16 and 4-bit KV); a Qwen3.6-35B-A3B-shaped target;
   and from the measured block and checkpoint sizes, a 64K-token conversation's bytes.

    .venv/bin/python -m bench.block_store [--lengths 4096 8192] [--repeats 3] [--no-sizes] [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import zlib

import mlx.core as mx
import numpy as np
import redis
from mlx_lm.models.cache import KVCache
from redis._parsers import _HiredisParser, _RESP2Parser

from bench import scoring  # its draft model and prompts are the reference
from bench.benchlib import blas_in_use, parse_quick, report
from cache_store import SelectionMemo, is_token_array, model_fingerprint
from cache_store.block_reader import OVERLAP
from cache_store.codec import RawArray, decode_block, encode_block, payload_checksum
from cache_store.streamed_gets import streamed_gets
from cache_store.trailing import BOOKKEEPING
from specprefill.attention.caches import sliced_blocks
from specprefill.attention.probe import make_cache
from specprefill.kv_arrays import raw_bits_many, to_mlx_many
from specprefill.options import ScoringOptions, SelectionOptions
from specprefill.profile import ModelProfile, profile_model
from specprefill.reuse import score_with_cache
from specprefill.selection import plan_selection, to_ranges
from specprefill_cli.embedded_redis import EmbeddedRedis
from worker.runtime import wire_block_store


GB = 1e9
BLOCK = 256
FP = hashlib.sha256(b"bench/block_store").hexdigest()
DIGEST = hashlib.sha256(b"a block's chain digest").digest()
SELECT = SelectionOptions(keep=0.2, chunk_size=32, tail_tokens=512, threshold=0)
GOALS = {"codec": 0.5, "transport": 0.9, "warm": 0.25, "memo": 0.02, "hiredis": 1.2,
         "kv4_dense": 0.3, "checkpoint_bytes": 1.5, "checkpoint_exact": 1e-5}
PARSERS = {"hiredis": _HiredisParser, "python": _RESP2Parser}


def block_store(client: redis.Redis, profile: ModelProfile, namespace: str, identity: str = "bench"):
    """The draft's block store for ``profile``'s model, wired as the worker wires it."""
    model, kv = profile.model, (profile.kv_bits, profile.kv_group_size)
    fp = model_fingerprint(profile.description, identity, block_size=BLOCK)
    return wire_block_store(client, model, lambda: make_cache(model, *kv), fp, namespace=namespace,
                            block_size=BLOCK, ttl_s=3600)


def random_cache(n_tokens: int, layers: int = 4, kv_heads: int = 2, head_dim: int = 64,
                 dtype=mx.float32, seed: int = 0) -> list[KVCache]:
    """KVCache objects shaped like the draft model's, filled with random values."""
    mx.random.seed(seed)
    cache = []
    for _ in range(layers):
        c = KVCache()
        shape = (1, kv_heads, n_tokens, head_dim)
        c.state = (mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype), n_tokens)
        mx.eval(c.keys, c.values)
        cache.append(c)
    return cache


def best_rate(n_bytes: int, fn, *, inner: int, rounds: int = 7) -> float:
    """Bytes per second of ``fn`` (best of ``rounds`` rounds of ``inner`` calls)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return n_bytes / best


def bench_codec() -> dict[str, float]:
    _, layers = sliced_blocks(random_cache(4 * BLOCK), 4 * BLOCK, BLOCK)[1]  # a block from the middle:
    names = [(i, name) for i, layer in enumerate(layers) for name in layer]  # strided slices, as a store's
    raws = raw_bits_many([layers[i][name] for i, name in names])
    block = [{} for _ in layers]
    for (i, name), raw in zip(names, raws):
        block[i][name] = RawArray(*raw)
    arrays = [a for layer in block for a in layer.values()]
    n_bytes = sum(a.bits.nbytes for a in arrays)
    value = bytes(encode_block(FP, BLOCK, block, digest=DIGEST))

    def codec_round_trip():
        encoded = encode_block(FP, BLOCK, block, digest=DIGEST)
        decoded = decode_block(encoded, fingerprint=FP, n_tokens=BLOCK, digest=DIGEST)
        to_mlx_many([a for layer in decoded.layers for a in layer.values()])

    def plain_round_trip():
        # The same copies with no framing and no checksum, written as tightly as the codec's.
        buf = np.empty(n_bytes, dtype=np.uint8)
        stacked = buf.view(arrays[0].bits.dtype).reshape((len(arrays),) + arrays[0].shape)
        for i, a in enumerate(arrays):
            np.copyto(stacked[i], a.bits)
        to_mlx_many([RawArray(a.dtype, stacked[i]) for i, a in enumerate(arrays)])

    payload = memoryview(value)[len(value) - 9 - n_bytes:len(value) - 9]
    sizes = [a.bits.nbytes for a in arrays]
    rates = {}
    for _ in range(6):  # interleave the pair so both see the same machine load; keep each one's best
        for name, fn in (("codec", codec_round_trip), ("plain", plain_round_trip)):
            rates[name] = max(rates.get(name, 0.0), best_rate(n_bytes, fn, inner=30, rounds=3))
    rates["memcpy"] = best_rate(n_bytes, lambda: bytes(memoryview(value)[1:]), inner=50)
    rates["checksum_xxh3"] = best_rate(n_bytes, lambda: payload_checksum(payload), inner=50)
    rates["checksum_crc32"] = best_rate(n_bytes, lambda: zlib.crc32(payload), inner=20)
    rates["checksum_blake2b"] = best_rate(
        n_bytes, lambda: hashlib.blake2b(payload, digest_size=16).digest(), inner=5)
    rates["block_bytes"] = n_bytes
    return rates


class _Clock:
    """Time a fetch spends inside its socket reads (the block store's wire reader), making its
    MLX destinations (``MlxDestinations``: allocation, unfilled since issue 27) and in checksums (on
    the helper thread, or inline after each block's read); the rest is header checks, Python, the
    rebuild and the bookkeeping."""

    def __init__(self) -> None:
        self.socket = self.allocate = self.checksums = 0.0

    def _timed(self, fn, field: str):
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)
        return timed

    def __enter__(self) -> "_Clock":
        from cache_store import block_reader, wire
        from specprefill import kv_arrays

        self._saved = (wire._SocketReader._receive, kv_arrays.MlxDestinations.__call__, block_reader._hash)
        recv, allocate, hash_ = self._saved
        wire._SocketReader._receive = self._timed(recv, "socket")
        kv_arrays.MlxDestinations.__call__ = self._timed(allocate, "allocate")
        block_reader._hash = self._timed(hash_, "checksums")
        return self

    def __exit__(self, *exc) -> None:
        from cache_store import block_reader, wire
        from specprefill import kv_arrays

        wire._SocketReader._receive, kv_arrays.MlxDestinations.__call__, block_reader._hash = self._saved


def bench_transport(clients: dict[str, redis.Redis], profile: ModelProfile, n_blocks: int = 64,
                    repeats: int = 9) -> dict[str, dict[str, float]]:
    """Per client (one per parser and transport, all on one server): a chain fetched
    through the draft cache (of ``profile``'s model, whose cache shape ``random_cache`` has) and
    by raw GETs (one pipeline; streamed). Every repeat runs every client's set in turn, so all
    of them see the same machine state."""
    n_tokens = n_blocks * BLOCK
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 32000, n_tokens + 1)]
    stores = {name: block_store(c, profile, "transport") for name, c in clients.items()}
    first = next(iter(stores.values()))
    assert first.store(tokens, random_cache(n_tokens + 1, seed=1)) == n_blocks
    keys = first.raw_store.block_keys(tokens[:-1])
    n_bytes = sum(next(iter(clients.values())).strlen(k) for k in keys)

    def raw_gets(client):
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        values = pipe.execute()
        assert all(v is not None for v in values)

    def raw_streamed(client):  # each value dropped as the next comes: one buffer, reused, cache-hot
        assert all(v is not None for v in streamed_gets(client, keys))

    def raw_kept(client):  # the chain's values kept, as any reader of a chain must hold them
        values = list(streamed_gets(client, keys))
        assert all(v is not None for v in values)

    def store_fetch(store):
        cache, n = store.fetch(tokens)
        assert n == n_tokens
        mx.eval([c.state[:2] for c in cache])

    times = {name: {"raw": [], "streamed": [], "kept": [], "store": []} for name in clients}
    for rep in range(repeats + 1):  # the first round warms up
        for name in clients:
            for kind, fn, arg in (("raw", raw_gets, clients[name]), ("streamed", raw_streamed, clients[name]),
                                  ("kept", raw_kept, clients[name]), ("store", store_fetch, stores[name])):
                start = time.perf_counter()
                fn(arg)
                if rep:
                    times[name][kind].append(time.perf_counter() - start)
    out = {name: {"bytes": n_bytes, **{kind: min(t[kind]) for kind in t},
                  **{f"{kind}_median": statistics.median(t[kind]) for kind in t}}
           for name, t in times.items()}
    for name, store in stores.items():  # where a fetch's time goes, measured apart (timers cost a little)
        best = None
        for _ in range(3):
            with _Clock() as clock:
                start = time.perf_counter()
                store_fetch(store)
                total = time.perf_counter() - start
            if best is None or total < best[0]:
                best = (total, clock)
        out[name].update(clocked=best[0], socket=best[1].socket, allocate=best[1].allocate,
                         checksums=best[1].checksums)
    return out


def bench_end_to_end(client: redis.Redis, profile, tokens: list[int], repeats: int) -> dict[str, float]:
    """Cold scoring (no store) vs warm (first 90% stored) vs the memo, in seconds (best of repeats)."""
    store = block_store(client, profile, f"e2e{len(tokens)}")
    raw_store = store.raw_store
    memo = SelectionMemo(client, FP, namespace=f"e2e{len(tokens)}")
    settings = dict(keep=SELECT.keep, chunk_size=SELECT.chunk_size, tail_tokens=SELECT.tail_tokens,
                    protected_prefix=0, threshold=SELECT.threshold, n_lookahead=8, seed=0,
                    include_last_query=True)
    stored = int(0.9 * len(tokens))
    keys = raw_store.block_keys(tokens)
    cold, warm, memo_s = [], [], []
    cached, phases = 0, {}
    for _ in range(repeats):
        start = time.perf_counter()
        result = score_with_cache(profile, tokens, None)
        cold.append(time.perf_counter() - start)
        selection = plan_selection(result.importance, SELECT)
        ranges = [(int(s), int(e)) for s, e in to_ranges(selection.indices)]

        # Keep exactly the blocks of the first 90% stored, as a returning prompt would find them.
        client.delete(*keys)
        store.store(tokens[:stored], result.kv_cache)
        del result
        start = time.perf_counter()
        warm_result = score_with_cache(profile, tokens, store)
        warm.append(time.perf_counter() - start)
        if warm[-1] == min(warm):
            phases = dict(warm_result.timings)
        cached = warm_result.cached_tokens
        warm_ranges = [(int(s), int(e)) for s, e in
                       to_ranges(plan_selection(warm_result.importance, SELECT).indices)]
        assert warm_ranges == ranges, "warm and cold selections differ"
        del warm_result

        memo.put(tokens, settings, ranges)
        start = time.perf_counter()
        remembered = memo.get(tokens, settings)
        memo_s.append(time.perf_counter() - start)
        assert remembered == ranges
    return {"cold": min(cold), "warm": min(warm), "memo": min(memo_s), "cached": cached, "phases": phases}


def transport_rows(server: EmbeddedRedis, profile: ModelProfile, rows: list, n_blocks: int = 64,
                   repeats: int = 9) -> list[tuple[str, float, str, float]]:
    """Fetch throughput against the wire's (raw streamed GETs) per transport, where the rest
    goes, and the parsers side by side on raw GETs; the verdicts on them."""
    configs = [(parser, where) for parser in PARSERS for where in ("TCP", "unix")]
    clients = {c: redis.Redis.from_url(server.url if c[1] == "TCP" else server.unix_url,
                                       parser_class=PARSERS[c[0]]) for c in configs}
    results = bench_transport(clients, profile, n_blocks, repeats)
    for where in ("TCP", "unix"):
        t = results["hiredis", where]
        rows.append((f"transport ({where}): fetch of a {n_blocks}-block chain",
                     f"{t['bytes'] / t['store'] / GB:.2f} GB/s ({t['store'] * 1e3:.0f} ms)",
                     f"raw GETs streamed, values kept (hiredis) {t['bytes'] / t['kept'] / GB:.2f} GB/s "
                     f"({t['kept'] * 1e3:.0f} ms)", f"{t['kept'] / t['store']:.2f}"))
        rows.append(("  context: raw GETs streamed, each value dropped as the next comes", "",
                     f"{t['bytes'] / t['streamed'] / GB:.2f} GB/s ({t['streamed'] * 1e3:.0f} ms)",
                     f"{t['streamed'] / t['store']:.2f}"))
        rows.append(("  a timed fetch: outside its socket reads / of which MLX allocation",
                     f"{(t['clocked'] - t['socket']) * 1e3:.1f} of {t['clocked'] * 1e3:.1f} ms",
                     f"{t['allocate'] * 1e3:.1f} ms; checksums {t['checksums'] * 1e3:.1f} ms "
                     + ("on the helper thread" if OVERLAP else "inline, after each block's read"),
                     ""))
        rows.append(("  context: raw GETs, one pipeline", "", f"{t['bytes'] / t['raw'] / GB:.2f} GB/s "
                     f"({t['raw'] * 1e3:.0f} ms)", f"{t['raw'] / t['store']:.2f}"))
        slow = results["python", where]
        rows.append((f"parsers ({where}): raw GETs streamed with hiredis",
                     f"{t['bytes'] / t['streamed'] / GB:.2f} GB/s",
                     f"Python parser {slow['bytes'] / slow['streamed'] / GB:.2f} GB/s",
                     f"{slow['streamed'] / t['streamed']:.2f}"))
    BOOKKEEPING.flush()  # the fetches' counters ride these clients: done before they close
    for c in clients.values():
        c.close()
    tcp, unix = results["hiredis", "TCP"], results["hiredis", "unix"]
    return [("transport_vs_raw_gets", tcp["kept"] / tcp["store"], ">=", GOALS["transport"]),
            ("transport_vs_raw_gets_unix", unix["kept"] / unix["store"], ">=", GOALS["transport"]),
            ("hiredis_vs_python_parser_gets", results["python", "TCP"]["streamed"] / tcp["streamed"], ">=",
             GOALS["hiredis"])]


# Real text configs (vocabulary reduced: it changes no cached byte).
QWEN35_08B = dict(model_type="qwen3_5", vocab_size=1024, hidden_size=1024, intermediate_size=3584,
                  num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=262144,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
QWEN25_05B = dict(model_type="qwen2", vocab_size=1024, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=32768)


def shaped_model(config: dict):
    """A bfloat16 model of ``config`` (an mlx-lm model type's ``ModelArgs``) with mlx's random
    initial weights (the sizes measured here depend on shapes and dtypes only)."""
    import importlib

    from mlx.utils import tree_flatten, tree_unflatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(dict(config)))
    cast = getattr(model, "cast_predicate", lambda _: True)  # what mlx-lm's convert keeps in float32
    model.update(tree_unflatten([(path, p.astype(mx.bfloat16) if cast(path) else p)
                                 for path, p in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


# A Qwen3.6-35B-A3B-shaped target's cache: its 2048 width, 16 attention heads (2 KV) of 256 and
# 16 key / 32 value DeltaNet heads of 128, 3:1 DeltaNet/attention. Its MoE MLPs hold no cache, so
# a small dense MLP stands in; 4 of its 40 layers are built (3 DeltaNet + 1 attention) and the
# sizes scaled by 10 (every layer of a kind stores the same arrays).
QWEN36_35B_A3B_4_LAYERS = dict(QWEN35_08B, hidden_size=2048, intermediate_size=256, num_hidden_layers=4,
                               num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               linear_num_key_heads=16, linear_num_value_heads=32)
# A tiny model of the Qwen3.5 layer pattern, for warm = cold at 8K tokens on two CPU cores.
TINY_QWEN35 = dict(QWEN35_08B, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                   head_dim=32, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32)


def random_block(layout: list[dict[str, list]], seed: int = 5) -> list[dict[str, RawArray]]:
    """One block of ``layout`` (``block_layout_of``: per layer ``{name: [dtype, shape]}``; a token
    array's axis 2 set to BLOCK) filled with random bits: stored sizes depend on shapes alone."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in layout:
        arrays = {}
        for name, (dtype, shape) in layer.items():
            shape = [BLOCK if is_token_array(name) and axis == 2 else d for axis, d in enumerate(shape)]
            bits = np.dtype("<u2" if dtype in ("bfloat16", "float16") else "<u4")
            arrays[name] = RawArray(dtype, rng.integers(0, 1 << 15, size=shape).astype(bits))
        out.append(arrays)
    return out


def stored_prompt(client: redis.Redis, model, namespace: str, n_tokens: int, every: int,
                  kv_bits: int | None = None) -> dict[str, int]:
    """Bytes (``STRLEN``, headers included) the worker's store holds for one ``n_tokens`` prompt
    of ``model``: its K/V blocks, and its checkpoints every ``every`` blocks (1: one per block, as
    format 3 kept the state) plus the prompt's last block; written by ``store_blocks``."""
    from specprefill.draft_cache import block_layout_of, checkpoint_ends

    profile = profile_model(model, kv_bits=kv_bits, kv_group_size=64)
    raw = block_store(client, profile, namespace).raw_store
    block = random_block(block_layout_of(model, lambda: make_cache(model, kv_bits, 64)))
    kv_only = [{n: a for n, a in layer.items() if is_token_array(n)} for layer in block]
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 1024, n_tokens)]
    ends = checkpoint_ends(n_tokens, BLOCK, every)
    for end in range(BLOCK, n_tokens + 1, BLOCK):
        raw.store_blocks(tokens, [(end, block if end in ends else kv_only)])
    sizes = {kind: sum(client.strlen(k) for k in client.scan_iter(f"{namespace}:{kind}:*", count=1000))
             for kind in ("kv", "kvstate")}
    client.flushall()
    n_checkpoints = len(ends) if sizes["kvstate"] else 0
    return {"kv": sizes["kv"], "state": sizes["kvstate"], "checkpoints": n_checkpoints,
            "per_checkpoint": sizes["kvstate"] // max(1, n_checkpoints)}


def bench_sizes(client: redis.Redis, quick: bool) -> tuple[list[tuple[str, str, str, str]], dict[str, float]]:
    """Rows of the size table: per model, bytes per token of an 8K prompt with checkpoints every K
    blocks (1: every block, as format 3 stored the state), and of a 64K conversation; and the
    ratios the targets check. ``quick``: the hybrid draft's 4 first layers (its 1:3 pattern), x6."""
    from specprefill.options import STATE_CHECKPOINT_BLOCKS

    hybrid = (("Qwen3.5-0.8B-shaped hybrid draft (4 of its 24 layers built, x6)", dict(QWEN35_08B, num_hidden_layers=4),
               6, (None,)) if quick else
              ("Qwen3.5-0.8B-shaped hybrid draft (6 attention + 18 DeltaNet layers)", QWEN35_08B, 1, (None, 4)))
    shapes = [hybrid] if quick else [
        hybrid, ("Qwen2.5-0.5B-shaped dense draft (24 attention layers)", QWEN25_05B, 1, (None, 4)),
        ("Qwen3.6-35B-A3B-shaped target (10 attention + 30 DeltaNet layers; 4 built, x10)",
         QWEN36_35B_A3B_4_LAYERS, 10, (None,))]
    everies = (STATE_CHECKPOINT_BLOCKS,) if quick else (1, 4, 8, STATE_CHECKPOINT_BLOCKS, 32, 0)
    rows, ratios, kv = [], {}, {}
    for label, config, scale, kv_bits in shapes:
        model = shaped_model(config)
        for bits in kv_bits:
            name = f"{label}, {'bf16' if bits is None else '4-bit'} KV"
            for every in everies if config is not QWEN25_05B else (0,):
                s = stored_prompt(client, model, f"size-{config['model_type']}-{bits}-{every}", 8192, every, bits)
                kv[label, bits] = scale * s["kv"]
                total = scale * (s["kv"] + s["state"])
                if every == STATE_CHECKPOINT_BLOCKS and bits is None and config is hybrid[1]:
                    ratios["hybrid_draft"] = total / kv[label, bits]
                per_64k = kv[label, bits] * 8 + scale * s["per_checkpoint"] * len(_ends_64k(every))
                rows.append((f"{name}: 8K prompt, " + (f"checkpoints every {every} blocks" if every else
                                                         "checkpoints at the prompt's end only"),
                             f"{total / 8192:,.0f} B/token", f"K/V alone {kv[label, bits] / 8192:,.0f} B/token",
                             f"{total / kv[label, bits]:.2f}"))
                rows.append(("  per checkpoint / a 64K conversation",
                             f"{scale * s['per_checkpoint'] / 2**20:.1f} MiB", f"{per_64k / 2**30:.2f} GiB", ""))
        if config is QWEN25_05B:
            ratios["kv4_dense"] = kv[label, 4] / kv[label, None]
        del model
    return rows, ratios


def _ends_64k(every: int) -> set[int]:
    from specprefill.draft_cache import checkpoint_ends

    return checkpoint_ends(65536, BLOCK, every)


def bench_checkpoint_exactness(client: redis.Redis, n_tokens: int, every: int
                               ) -> tuple[list[tuple[str, str, str, str]], float]:
    """A tiny Qwen3.5-pattern draft scored cold (storing, checkpoints every ``every`` blocks) and
    warm (restored from the last checkpoint), and a prompt sharing only the first 3/4 (restored
    from an earlier checkpoint): the largest relative importance difference to a cold score
    (inf when the selections differ)."""
    model = shaped_model(TINY_QWEN35)
    profile = profile_model(model)
    store = block_store(client, profile, "exact")
    store.checkpoint_blocks = every
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, 1024, n_tokens + 100)]
    other = tokens[:3 * n_tokens // 4] + [int(t) for t in rng.integers(0, 1024, n_tokens // 4 + 100)]
    rows, worst = [], 0.0
    score_with_cache(profile, tokens, store)  # stores blocks and checkpoints
    for label, prompt in (("the same prompt", tokens), ("a prompt sharing its first 3/4", other)):
        start = time.perf_counter()
        warm = score_with_cache(profile, prompt, store)
        warm_s = time.perf_counter() - start
        start = time.perf_counter()
        cold = score_with_cache(profile, prompt, None)
        cold_s = time.perf_counter() - start
        a, b = np.array(warm.importance), np.array(cold.importance)
        diff = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))
        same = plan_selection(warm.importance, SELECT).indices.tolist() == plan_selection(cold.importance,
                                                                                          SELECT).indices.tolist()
        worst = max(worst, diff if same else float("inf"))
        rows.append((f"checkpoints every {every} blocks: {label} ({len(prompt)} tokens), {warm.cached_tokens} restored",
                     f"warm {warm_s:.2f} s", f"cold {cold_s:.2f} s",
                     f"importance max rel diff {diff:.1e}, selection {'equal' if same else 'DIFFERS'}"))
    client.flushall()
    return rows, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-sizes", action="store_true", help="skip the per-model block sizes (4.)")
    # 1024 tokens: a cold 2048-token scoring is 13 s on a CPU without OpenBLAS
    opts = parse_quick(parser, None,
                       "seconds: a 16-block chain, one 1024-token prompt twice, no sizes (the same code)",
                       lengths=[1024], repeats=2, no_sizes=True)

    print(f"BLAS: {blas_in_use()}")
    rows: list[tuple[str, str, str, str]] = []
    verdicts: list[tuple[str, float, str, float]] = []

    codec = bench_codec()
    size = codec.pop("block_bytes")
    ratio = codec["codec"] / codec["plain"]
    rows.append(("codec: encode+decode of one block", f"{codec['codec'] / GB:.1f} GB/s",
                 f"plain copy out+back {codec['plain'] / GB:.1f} GB/s", f"{ratio:.2f}"))
    rows.append(("  context: memcpy of the value / XXH3 checksum", f"{codec['memcpy'] / GB:.1f} GB/s",
                 f"{codec['checksum_xxh3'] / GB:.1f} GB/s", ""))
    rows.append(("  context: CRC32 / BLAKE2b-128 (not used)", f"{codec['checksum_crc32'] / GB:.1f} GB/s",
                 f"{codec['checksum_blake2b'] / GB:.1f} GB/s", ""))
    verdicts.append(("codec_vs_plain_copy", ratio, ">=", GOALS["codec"]))

    with EmbeddedRedis(unix_socket=True) as server:
        client = redis.Redis.from_url(server.url)
        print(f"Redis {client.info('server')['redis_version']} on {server.url} (TCP loopback) "
              f"and {server.unix_url}; block {BLOCK} tokens = {size / 2**20:.2f} MiB")
        profile = profile_model(scoring.draft_model())  # its cache is random_cache's shape
        verdicts += transport_rows(server, profile, rows, *((16, 3) if opts.quick else (64, 9)))
        client.flushall()

        score_with_cache(profile, scoring.prompt_of(256), None)  # warm-up
        for length in opts.lengths:
            e = bench_end_to_end(client, profile, scoring.prompt_of(length), opts.repeats)
            rows.append((f"end to end {length}: warm ({e['cached']} tokens restored)",
                         f"{e['warm']:.3f} s", f"cold {e['cold']:.3f} s", f"{e['warm'] / e['cold']:.3f}"))
            p = e["phases"]
            rows.append(("  warm scoring phases: prefill / lookahead / importance",
                         f"{p.get('prefill', 0):.3f} / {p.get('lookahead', 0):.3f} / {p.get('importance', 0):.3f} s",
                         "", ""))
            rows.append((f"end to end {length}: selection memo", f"{e['memo'] * 1e3:.2f} ms",
                         f"cold {e['cold']:.3f} s", f"{e['memo'] / e['cold']:.5f}"))
            verdicts.append((f"warm_vs_cold_{length}", e["warm"] / e["cold"], "<=", GOALS["warm"]))
            verdicts.append((f"memo_vs_cold_{length}", e["memo"] / e["cold"], "<=", GOALS["memo"]))
        from specprefill.options import STATE_CHECKPOINT_BLOCKS

        exact_rows, worst = bench_checkpoint_exactness(client, *((1024, 2) if opts.quick
                                                                 else (8192, STATE_CHECKPOINT_BLOCKS)))
        rows.extend(exact_rows)
        verdicts.append(("hybrid_checkpoint_warm_vs_cold_importance", worst, "<=", GOALS["checkpoint_exact"]))
        size_rows, ratios = bench_sizes(client, quick=opts.quick or opts.no_sizes)
        rows.append(("**stored bytes** (values as stored, headers included; 64K: 256 blocks + checkpoints)",
                     "with checkpoints", "K/V alone", "ratio"))
        rows.extend(size_rows)
        verdicts.append(("hybrid_bytes_per_token_with_checkpoints", ratios["hybrid_draft"], "<=",
                         GOALS["checkpoint_bytes"]))
        if "kv4_dense" in ratios:  # 4-bit K/V with a bfloat16 scale and bias per 64 values: 36 / 128 of bf16
            verdicts.append(("quantized_kv_block_over_bf16_dense", ratios["kv4_dense"], "<=", GOALS["kv4_dense"]))
        BOOKKEEPING.flush()  # before the client and the server go
        client.close()

    return report(rows, verdicts)


if __name__ == "__main__":
    sys.exit(main())
