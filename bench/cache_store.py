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
4. Sizes: bytes per token and per 256-token block actually stored (``STRLEN`` of the values,
   headers included) for a Qwen3.5-0.8B-shaped hybrid draft (its real 24 layers, widths and
   3:1 Gated-DeltaNet/attention pattern; random bfloat16 weights, a 1024-word vocabulary since
   the vocabulary changes no cached byte) next to a dense Qwen2.5-0.5B-shaped one, each with
   bfloat16 and 4-bit KV; split into K/V bytes and recurrent-state bytes; for the hybrid, the
   bytes a fetch of a 127-block prefix (a 32K-token prompt) reads, K/V sections and one state.

    .venv/bin/python bench/cache_store.py [--lengths 4096 8192] [--repeats 3] [--no-sizes] [--quick]
"""
from __future__ import annotations

import benchlib  # noqa: F401 - first: sys.path and the OpenBLAS preload, before mlx
from benchlib import blas_in_use, report  # noqa: E402

import argparse  # noqa: E402
import sys  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import redis  # noqa: E402
from redis._parsers import _HiredisParser, _RESP2Parser  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from cache_store import SelectionMemo, is_token_array, model_fingerprint  # noqa: E402
from cache_store.block_reader import OVERLAP  # noqa: E402
from cache_store.codec import RawArray, decode_block, encode_block, payload_checksum  # noqa: E402
from cache_store.streamed_gets import streamed_gets  # noqa: E402
from specprefill_cli.embedded_redis import EmbeddedRedis  # noqa: E402
from specprefill.attention.caches import sliced_blocks  # noqa: E402
from specprefill.attention.probe import make_cache  # noqa: E402
from specprefill.kv_arrays import raw_bits_many, to_mlx_many  # noqa: E402
from specprefill.options import ScoringOptions, SelectionOptions  # noqa: E402
from specprefill.profile import ModelProfile, profile_model  # noqa: E402
from specprefill.reuse import score_with_cache  # noqa: E402
from specprefill.selection import plan_selection, to_ranges  # noqa: E402
from worker.runtime import wire_block_store  # noqa: E402

GB = 1e9
BLOCK = 256
FP = hashlib.sha256(b"bench/cache_store").hexdigest()
DIGEST = hashlib.sha256(b"a block's chain digest").digest()
SELECT = SelectionOptions(keep=0.2, chunk_size=32, tail_tokens=512, threshold=0)
GOALS = {"codec": 0.5, "transport": 0.9, "warm": 0.25, "memo": 0.02, "hiredis": 1.2, "kv4_dense": 0.3}
PARSERS = {"hiredis": _HiredisParser, "python": _RESP2Parser}


def _scoring_bench():
    """``bench/scoring.py`` as a module: its draft model and prompts are the reference."""
    spec = importlib.util.spec_from_file_location("bench_scoring", benchlib.HERE / "scoring.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    MLX destinations (``MlxDestinations``: allocation and MLX's zero fill) and in checksums run
    on the helper thread; the rest is header checks, Python, the rebuild and the bookkeeping."""

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

        self._saved = (wire._SocketReader._recv_into, kv_arrays.MlxDestinations.__call__, block_reader._hash)
        recv, allocate, hash_ = self._saved
        wire._SocketReader._recv_into = self._timed(recv, "socket")
        kv_arrays.MlxDestinations.__call__ = self._timed(allocate, "allocate")
        block_reader._hash = self._timed(hash_, "checksums")
        return self

    def __exit__(self, *exc) -> None:
        from cache_store import block_reader, wire
        from specprefill import kv_arrays

        wire._SocketReader._recv_into, kv_arrays.MlxDestinations.__call__, block_reader._hash = self._saved


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
        rows.append(("  a timed fetch: outside its socket reads / of which MLX allocation (zero fill)",
                     f"{(t['clocked'] - t['socket']) * 1e3:.1f} of {t['clocked'] * 1e3:.1f} ms",
                     f"{t['allocate'] * 1e3:.1f} ms; " + (f"checksums {t['checksums'] * 1e3:.1f} ms on the helper "
                                                        "thread" if OVERLAP else "checksums inline as pieces land"),
                     ""))
        rows.append(("  context: raw GETs, one pipeline", "", f"{t['bytes'] / t['raw'] / GB:.2f} GB/s "
                     f"({t['raw'] * 1e3:.0f} ms)", f"{t['raw'] / t['store']:.2f}"))
        slow = results["python", where]
        rows.append((f"parsers ({where}): raw GETs streamed with hiredis",
                     f"{t['bytes'] / t['streamed'] / GB:.2f} GB/s",
                     f"Python parser {slow['bytes'] / slow['streamed'] / GB:.2f} GB/s",
                     f"{slow['streamed'] / t['streamed']:.2f}"))
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


def stored_sizes(client: redis.Redis, model, kv_bits: int | None, namespace: str) -> dict[str, float]:
    """Bytes of one stored block (value, K/V arrays, state arrays) after scoring BLOCK + 1 tokens."""
    profile = profile_model(model, kv_bits=kv_bits, kv_group_size=64)
    store = block_store(client, profile, namespace)
    raw = store.raw_store
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 1024, BLOCK + 1)]
    score_with_cache(profile, tokens, store, ScoringOptions(n_lookahead=2))
    (key,) = raw.block_keys(tokens)
    layers, _ = raw.fetch(tokens + [0])
    arrays = [(name, a) for layer in layers for name, a in layer.items()]
    kv = sum(a.bits.nbytes for name, a in arrays if is_token_array(name))
    value = client.strlen(key)
    return {"value": value, "kv": kv, "state": sum(a.bits.nbytes for _, a in arrays) - kv,
            "read_before_last": raw._token_end or value}  # what a fetch reads of a block before its last


def bench_sizes(client: redis.Redis) -> tuple[list[tuple[str, str, str, str]], dict[str, float]]:
    """Rows of the size table, and the 4-bit / bfloat16 block-size ratio per model."""
    rows, ratios = [], {}
    for label, config in (("Qwen3.5-0.8B-shaped hybrid (6 attention + 18 DeltaNet layers)", QWEN35_08B),
                          ("Qwen2.5-0.5B-shaped dense (24 attention layers)", QWEN25_05B)):
        model = shaped_model(config)
        sizes = {bits: stored_sizes(client, model, bits, f"size-{config['model_type']}-{bits}") for bits in (None, 4)}
        for bits, size in sizes.items():
            rows.append((f"{label}, {'bf16' if bits is None else '4-bit'} KV",
                         f"{size['value'] / BLOCK:,.0f} B/token", f"{size['value'] / 2**20:.2f} MiB/block",
                         f"K/V {size['kv'] / 2**20:.2f} + state {size['state'] / 2**20:.2f} MiB"))
            if size["read_before_last"] < size["value"]:
                # A 32K-token prompt restores 127 blocks: all but the last read up to their K/V's end.
                whole, sections = 127 * size["value"], 126 * size["read_before_last"] + size["value"]
                rows.append(("  fetch of a 127-block prefix: bytes read (K/V sections, then the last block whole)",
                             f"{sections / 2**20:,.0f} MiB", f"whole blocks {whole / 2**20:,.0f} MiB",
                             f"{sections / whole:.3f}"))
        ratios[config["model_type"]] = sizes[4]["value"] / sizes[None]["value"]
        del model
    return rows, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-sizes", action="store_true", help="skip the per-model block sizes (4.)")
    parser.add_argument("--quick", action="store_true",
                        help="seconds: a 16-block chain, one 2048-token prompt twice, no sizes (the same code)")
    opts = parser.parse_args()
    if opts.quick:
        opts.lengths, opts.repeats, opts.no_sizes = [2048], 2, True

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
        scoring = _scoring_bench()
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
        if not opts.no_sizes:
            size_rows, ratios = bench_sizes(client)
            rows.append(("**stored sizes** (one 256-token block, header included)", "per token", "per block",
                         "split"))
            rows.extend(size_rows)
            # 4-bit K/V with a bfloat16 scale and bias per 64 values: 36 / 128 of bfloat16.
            verdicts.append(("quantized_kv_block_over_bf16_dense", ratios["qwen2"], "<=", GOALS["kv4_dense"]))
            print(f"hybrid 4-bit / bf16 block size: {ratios['qwen3_5']:.3f} (recurrent state is not quantized)")
        client.close()

    return report(rows, verdicts)


if __name__ == "__main__":
    sys.exit(main())
