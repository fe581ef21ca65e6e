"""The block codec: bit-exact round trips, one msgpack value, every kind of bad value detected."""
import msgpack
import mlx.core as mx
import numpy as np
import pytest

from cache_store.codec import (FORMAT_VERSION, CorruptBlockError, RawArray, decode_block,
                               encode_block, payload_checksum)
from tests.support.kv_blocks import raw_bits, same_bits, to_mlx
from specprefill.kv_arrays import raw_bits_many

FP = "0f" * 32
D = bytes(range(32))  # the chain digest every test block is bound to


def encode(n_tokens, layers, digest=D):
    return encode_block(FP, n_tokens, layers, digest=digest)
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def random_cache_array(dtype, tokens=40, heads=2, head_dim=8, seed=0):
    """Random bits reinterpreted as ``dtype``: covers NaN payloads, infinities, subnormals, -0."""
    rng = np.random.default_rng(seed)
    width = {2: np.uint16, 4: np.uint32}[dtype.size]
    raw = rng.integers(0, np.iinfo(width).max, size=(1, heads, tokens, head_dim), dtype=width, endpoint=True)
    out = mx.array(raw).view(dtype)
    mx.eval(out)
    return out


def block_of(arrays, start, end):
    return [{"keys": RawArray(k.dtype, k.bits[:, :, start:end]), "values": RawArray(v.dtype, v.bits[:, :, start:end])}
            for k, v in arrays]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_round_trip_is_bit_exact(dtype):
    full = [(random_cache_array(dtype, seed=2 * i), random_cache_array(dtype, seed=2 * i + 1)) for i in range(3)]
    raws = [(raw_bits(k), raw_bits(v)) for k, v in full]
    value = encode(16, block_of(raws, 16, 32))
    block = decode_block(bytes(value), fingerprint=FP, n_tokens=16, digest=D)
    assert len(block.layers) == 3
    for (k, v), layer in zip(full, block.layers):
        assert same_bits(to_mlx(layer["keys"]), k[:, :, 16:32])
        assert same_bits(to_mlx(layer["values"]), v[:, :, 16:32])
    assert block.layout == tuple((("keys", str(dtype).split(".")[-1], (1, 2, 16, 8)),
                                  ("values", str(dtype).split(".")[-1], (1, 2, 16, 8))) for _ in range(3))


def test_value_is_plain_msgpack_with_aligned_payload():
    k = random_cache_array(mx.float16)
    value = bytes(encode(8, block_of([(raw_bits(k), raw_bits(k))], 0, 8)))
    header, payload, checksum = msgpack.unpackb(value)
    assert header["version"] == FORMAT_VERSION and header["fingerprint"] == FP and header["tokens"] == 8
    assert header["layers"] == [[["keys", "float16", [1, 2, 8, 8]], ["values", "float16", [1, 2, 8, 8]]]]
    assert header["digest"] == D and list(header)[-1] == "digest"
    assert len(payload) == 2 * 2 * 8 * 8 * 2
    assert payload[:len(payload) // 2] == np.asarray(k.view(mx.uint16))[:, :, 0:8].tobytes()
    assert isinstance(checksum, int)
    assert value.index(payload) % 16 == 0


def test_decoded_arrays_do_not_depend_on_the_value_buffer():
    k = random_cache_array(mx.float32)
    value = bytearray(encode(8, block_of([(raw_bits(k), raw_bits(k))], 0, 8)))
    restored = to_mlx(decode_block(value, fingerprint=FP, n_tokens=8, digest=D).layers[0]["keys"])
    value[:] = bytes(len(value))  # scribble over the stored bytes
    assert same_bits(restored, k[:, :, 0:8])


def test_encoding_copies_the_slice():
    k = random_cache_array(mx.float32)
    raw = raw_bits(k)
    value = encode(8, block_of([(raw, raw)], 8, 16))
    assert not np.shares_memory(np.frombuffer(value, np.uint8), raw.bits)


def test_checksum_sees_flips_truncation_and_swapped_segments():
    data = np.random.default_rng(1).bytes(4096)
    base = payload_checksum(memoryview(data))
    flipped = bytearray(data)
    flipped[1000] ^= 0x10
    assert payload_checksum(memoryview(bytes(flipped))) != base
    swapped = data[2048:] + data[:2048]
    assert payload_checksum(memoryview(swapped)) != base
    assert payload_checksum(memoryview(data[:4095])) != base
    assert payload_checksum(memoryview(data)) == base


def good_value(dtype=mx.float32):
    k = random_cache_array(dtype)
    return bytes(encode(8, block_of([(raw_bits(k), raw_bits(k))] * 2, 0, 8)))


def repack(value, edit):
    header, payload, checksum = msgpack.unpackb(value)
    header, payload, checksum = edit(header, payload, checksum)
    return msgpack.packb([header, payload, checksum])


def _flip_payload_byte(value):
    out = bytearray(value)
    out[-100] ^= 1
    return bytes(out)


BAD_VALUES = {
    "truncated": lambda v: v[:-1],
    "truncated_mid_payload": lambda v: v[: len(v) // 2],
    "padded": lambda v: v + b"\0",
    "payload_bit_flip": _flip_payload_byte,
    "not_msgpack": lambda v: b"\xc1garbage",
    "empty": lambda v: b"",
    "text": lambda v: b"hello world",
    "msgpack_but_not_a_block": lambda v: msgpack.packb({"a": 1}),
    "wrong_version": lambda v: repack(v, lambda h, p, c: ({**h, "version": FORMAT_VERSION + 1}, p, c)),
    "wrong_fingerprint": lambda v: repack(v, lambda h, p, c: ({**h, "fingerprint": "ab" * 32}, p, c)),
    "wrong_token_count": lambda v: repack(v, lambda h, p, c: ({**h, "tokens": 9}, p, c)),
    "unknown_dtype": lambda v: repack(v, lambda h, p, c: (
        {**h, "layers": [[[n, "int8", s] for n, _, s in layer] for layer in h["layers"]]}, p, c)),
    "shape_disagrees_with_payload": lambda v: repack(v, lambda h, p, c: (
        {**h, "layers": [[[n, d, [1, 1, 8, 8]] for n, d, _ in layer] for layer in h["layers"]]}, p, c)),
    "other_key": lambda v: repack(v, lambda h, p, c: ({**h, "digest": bytes(32)}, p, c)),
    "no_digest": lambda v: repack(v, lambda h, p, c: ({k: x for k, x in h.items() if k != "digest"}, p, c)),
    "version_1": lambda v: repack(v, lambda h, p, c: ({**h, "version": 1}, p, c)),
    "wrong_checksum": lambda v: repack(v, lambda h, p, c: (h, p, (c + 1) % 2**64)),
    "payload_not_bytes": lambda v: repack(v, lambda h, p, c: (h, "x" * len(p), c)),
}


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_bad_values_are_rejected(kind):
    value = good_value()
    assert decode_block(value, fingerprint=FP, n_tokens=8, digest=D).n_tokens == 8  # the unedited value is fine
    with pytest.raises(CorruptBlockError):
        decode_block(BAD_VALUES[kind](value), fingerprint=FP, n_tokens=8, digest=D)


def test_repacked_good_value_still_decodes():
    """A value re-encoded by any msgpack writer (minimal bin markers, no alignment) still reads."""
    value = good_value(mx.bfloat16)
    again = repack(value, lambda h, p, c: (h, p, c))
    assert again != value
    a = decode_block(value, fingerprint=FP, n_tokens=8, digest=D).layers[0]["keys"]
    b = decode_block(again, fingerprint=FP, n_tokens=8, digest=D).layers[0]["keys"]
    assert np.array_equal(a.bits, b.bits)


def test_unsupported_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="dtype"):
        raw_bits_many([mx.zeros((1, 1, 2, 2), dtype=mx.int32)])


@pytest.mark.parametrize("layer, match", [
    ({"keys": ("int8", np.zeros((1, 1, 8, 4), dtype="<u1"))}, "dtype"),
    ({"keys": ("float32", np.zeros((1, 1, 7, 4), dtype="<u4"))}, "8 tokens"),
    ({"values.scales": ("float32", np.zeros((1, 8, 4), dtype="<u4"))}, "8 tokens"),
    ({"bad name!": ("float32", np.zeros((2,), dtype="<u4"))}, "name"),
    ({"state.0": ("float32", np.zeros((1, 0, 3), dtype="<u4"))}, "positive"),
    ((), "mapping"),
], ids=["dtype", "token_axis", "token_rank", "name", "empty_dim", "not_a_mapping"])
def test_a_layer_is_a_mapping_of_valid_named_arrays(layer, match):
    with pytest.raises(ValueError, match=match):
        encode(8, [layer])


def test_hybrid_layers_round_trip():
    """Token arrays (K/V, quantized parts), state arrays of any rank and empty layers, bit-exact."""
    rng = np.random.default_rng(3)
    u32 = lambda *shape: rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype("<u4")  # noqa: E731
    layers = [
        {"state.0": ("float32", u32(1, 3, 40)), "state.1": ("bfloat16", u32(1, 4, 8, 8).view("<u2")[..., :8])},
        {},
        {"keys.packed": ("uint32", u32(1, 2, 8, 4)), "keys.scales": ("float16", u32(1, 2, 8, 1).view("<u2")[..., :1]),
         "keys.biases": ("float16", u32(1, 2, 8, 1).view("<u2")[..., :1]), "values.packed": ("uint32", u32(1, 2, 8, 4)),
         "values.scales": ("float16", u32(1, 2, 8, 2).view("<u2")[..., :1]),
         "values.biases": ("float16", u32(1, 2, 8, 2).view("<u2")[..., :1])},
        {"0.state.0": ("float32", u32(1, 5)), "1.keys": ("float32", u32(1, 1, 8, 4)),
         "1.values": ("float32", u32(1, 1, 8, 6))},
    ]
    block = decode_block(bytes(encode(8, layers)), fingerprint=FP, n_tokens=8, digest=D)
    assert [sorted(layer) for layer in block.layers] == [sorted(layer) for layer in layers]
    for ours, theirs in zip(block.layers, layers):
        for name, (dtype, bits) in theirs.items():
            assert ours[name].dtype == dtype and np.array_equal(ours[name].bits, bits)


def test_a_valid_block_under_another_key_is_named_as_such():
    value = good_value()
    with pytest.raises(CorruptBlockError, match="another key") as info:
        decode_block(value, fingerprint=FP, n_tokens=8, digest=bytes(32))
    assert info.value.reason == "key"
    # the same bytes re-encoded by another msgpack writer: the digest is still read and checked
    again = repack(value, lambda h, p, c: (h, p, c))
    with pytest.raises(CorruptBlockError, match="another key"):
        decode_block(again, fingerprint=FP, n_tokens=8, digest=bytes(32))
    assert decode_block(again, fingerprint=FP, n_tokens=8, digest=D).n_tokens == 8


def test_version_1_is_refused_as_an_old_format():
    from cache_store import OldFormatError

    with pytest.raises(OldFormatError, match="earlier format"):
        decode_block(BAD_VALUES["version_1"](good_value()), fingerprint=FP, n_tokens=8, digest=D)


def test_plain_pairs_are_raw_arrays():
    """What the KV conversion hands the store, (dtype name, bits) pairs, encodes like RawArrays."""
    bits = np.arange(32, dtype="<u4").reshape(1, 1, 8, 4)
    pairs = bytes(encode(8, [{"keys": ("float32", bits), "values": ("float32", bits)}]))
    raws = bytes(encode(8, [{"keys": RawArray("float32", bits), "values": RawArray("float32", bits)}]))
    assert pairs == raws


def _edit_layers(edit):
    return lambda v: repack(v, lambda h, p, c: (
        {**h, "layers": [[edit(list(e)) for e in layer] for layer in h["layers"]]}, p, c))


# Headers whose field types are wrong: the checksum still matches (payload untouched).
MALFORMED_HEADERS = {
    "dtype_is_a_list": _edit_layers(lambda e: [e[0], [e[1]], e[2]]),
    "dtype_is_a_map": _edit_layers(lambda e: [e[0], {"d": e[1]}, e[2]]),
    "shape_dim_is_a_list": _edit_layers(lambda e: [e[0], e[1], [[1], 2, 8, 8]]),
    "shape_dim_is_a_map": _edit_layers(lambda e: [e[0], e[1], [1, {"x": 2}, 8, 8]]),
    "shape_dim_is_a_bool": _edit_layers(lambda e: [e[0], e[1], [True, 2, 8, 8]]),
    "shape_dim_is_a_float": _edit_layers(lambda e: [e[0], e[1], [1.0, 2, 8, 8]]),
    "shape_of_wrong_rank": _edit_layers(lambda e: [e[0], e[1], [2, 8, 8]]),
    "shape_is_a_string": _edit_layers(lambda e: [e[0], e[1], "1288"]),
    "name_is_an_int": _edit_layers(lambda e: [7, e[1], e[2]]),
    "entry_is_short": _edit_layers(lambda e: e[:2]),
    "duplicate_names": _edit_layers(lambda e: ["keys", e[1], e[2]]),
    "layers_is_a_map": lambda v: repack(v, lambda h, p, c: ({**h, "layers": {"a": 1}}, p, c)),
    "layer_is_a_map": lambda v: repack(v, lambda h, p, c: ({**h, "layers": [{"a": 1}]}, p, c)),
    "tokens_is_a_list": lambda v: repack(v, lambda h, p, c: ({**h, "tokens": [8]}, p, c)),
    "digest_is_a_string": lambda v: repack(v, lambda h, p, c: ({**h, "digest": "x" * 32}, p, c)),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED_HEADERS))
def test_malformed_header_types_are_corrupt_not_type_errors(kind):
    value = good_value()
    with pytest.raises(CorruptBlockError):
        decode_block(MALFORMED_HEADERS[kind](value), fingerprint=FP, n_tokens=8, digest=D)


def test_reviewer_header_is_corrupt():
    """The reported case: a list where the keys' dtype belongs, valid checksum."""
    k = RawArray("float32", np.zeros((1, 1, 16, 4), dtype="<u4"))
    good = bytes(encode(16, [{"keys": k, "values": k}]))
    header, payload, checksum = msgpack.unpackb(good)
    header["layers"] = [[["keys", ["float32"], [1, 1, 16, 4]], ["values", "float32", [1, 1, 16, 4]]]]
    with pytest.raises(CorruptBlockError):
        decode_block(msgpack.packb([header, payload, checksum]), fingerprint=FP, n_tokens=16, digest=D)


def test_parsed_header_cache_is_bounded_and_thread_safe():
    """Many threads decoding blocks of more formats than the cache holds: no error, no growth."""
    import sys
    import threading

    from cache_store import codec

    values = []
    for heads in range(1, 25):  # 24 formats, more than the cache keeps
        k = RawArray("float32", np.full((1, heads, 8, 4), heads, dtype="<u4"))
        values.append((heads, bytes(encode(8, [{"keys": k, "values": k}]))))
    errors = []

    def work(offset):
        try:
            for i in range(300):
                heads, value = values[(i + offset) % len(values)]
                block = decode_block(value, fingerprint=FP, n_tokens=8, digest=D)
                assert block.layers[0]["keys"].shape == (1, heads, 8, 4)
        except Exception as exc:  # reported below
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors[:3]
    assert len(codec._FORMATS) <= codec._MAX_FORMATS


def hybrid_layers(seed=7):
    """Two layers: a recurrent one (state only) and an attention one (K/V), 8 tokens."""
    rng = np.random.default_rng(seed)
    u32 = lambda *shape: rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype("<u4")  # noqa: E731
    return [{"state.0": ("float32", u32(1, 3, 40)), "state.1": ("float32", u32(1, 4, 8, 8))},
            {"keys": ("float32", u32(1, 2, 8, 4)), "values": ("float32", u32(1, 2, 8, 4))}]


def test_the_token_section_is_read_and_checked_alone():
    from cache_store.codec import token_section_end

    layers = hybrid_layers()
    value = bytes(encode(8, layers))
    full = decode_block(value, fingerprint=FP, n_tokens=8, digest=D)
    end = token_section_end(FP, 8, full.layout)
    assert end < len(value) - 3 * 40 * 4  # the state section (and checksum) left out
    part = decode_block(value[:end], fingerprint=FP, n_tokens=8, digest=D, state=False)
    assert part.layout == full.layout
    assert part.layers == [{}, {"keys": part.layers[1]["keys"], "values": part.layers[1]["values"]}]
    assert np.array_equal(part.layers[1]["keys"].bits, layers[1]["keys"][1])
    assert decode_block(value, fingerprint=FP, n_tokens=8, digest=D, state=False).layers[0] == {}
    for cut in (end - 1, end + 1):  # GETRANGE must return exactly the section
        with pytest.raises(CorruptBlockError, match="truncated"):
            decode_block(value[:cut], fingerprint=FP, n_tokens=8, digest=D, state=False)
    with pytest.raises(CorruptBlockError, match="truncated"):
        decode_block(value[:end], fingerprint=FP, n_tokens=8, digest=D)


def test_each_section_has_its_own_checksum():
    from cache_store.codec import token_section_end

    value = bytes(encode(8, hybrid_layers()))
    end = token_section_end(FP, 8, decode_block(value, fingerprint=FP, n_tokens=8, digest=D).layout)
    state_flipped = bytearray(value)
    state_flipped[end + 3] ^= 0x01  # a bit of the state section
    with pytest.raises(CorruptBlockError, match="state section") as info:
        decode_block(bytes(state_flipped), fingerprint=FP, n_tokens=8, digest=D)
    assert info.value.reason == "checksum"
    # a reader of the token section alone does not see it (nor use it)
    decode_block(bytes(state_flipped)[:end], fingerprint=FP, n_tokens=8, digest=D, state=False)
    token_flipped = bytearray(value)
    token_flipped[end - 3] ^= 0x01  # a bit of the last value array
    for data, state in ((bytes(token_flipped), True), (bytes(token_flipped)[:end], False)):
        with pytest.raises(CorruptBlockError, match="token section"):
            decode_block(data, fingerprint=FP, n_tokens=8, digest=D, state=state)


@pytest.mark.parametrize("version", [2, 3])
def test_earlier_versions_are_refused_as_an_old_format(version):
    """Format 3 kept a hybrid model's recurrent state in every block; 4 keeps it in checkpoints."""
    from cache_store import OldFormatError

    with pytest.raises(OldFormatError, match="earlier format"):
        decode_block(repack(good_value(), lambda h, p, c: ({**h, "version": version}, p, c)),
                     fingerprint=FP, n_tokens=8, digest=D)


# ---- the token-array rule: one rule on both sides of the store ----

def test_both_sides_name_token_arrays_by_one_rule():
    """cache_store cannot import specprefill nor the other way round, so each holds the rule
    "a name with a dot-separated part keys or values is a token array (tokens on axis 2)";
    here they agree on every array name any cache type gives (quantized K/V, CacheList members,
    recurrent state) and on edge names, and the rule is what the arrays really are: a token
    array grows along axis 2 with the prompt, a state array does not."""
    from cache_store.codec import is_token_array as codec_rule
    from specprefill.attention.caches import is_token_array as caches_rule
    from specprefill.attention.caches import layer_arrays
    from specprefill.attention.probe import make_cache
    import specprefill_testkit.families as F

    def named_shapes(model, kv_bits, n_tokens):
        cache = make_cache(model, kv_bits, 32)
        model(mx.array([list(range(1, n_tokens + 1))]), cache=cache)
        mx.eval([c.state for c in cache if c is not None])
        return {(i, name): a.shape for i, c in enumerate(cache) for name, a in layer_arrays(c)[1].items()}

    seen = set()  # every cache type: K/V, window, recurrent, CacheList, shared-KV layers without a cache
    for name in ("llama", "gemma3_text", "qwen3_5", "falcon_h1", "nemotron_h", "gemma4_text", "lfm2", "mamba2"):
        for kv_bits in ((None, 4) if name in ("llama", "qwen3_5", "falcon_h1") else (None,)):
            model = F.build(name, seed=1, **(F.for_kv_quantization(name) if kv_bits else {}))
            short, longer = named_shapes(model, kv_bits, 5), named_shapes(model, kv_bits, 9)
            for key, shape in short.items():
                grows = shape[2:3] != longer[key][2:3] if len(shape) > 2 else False
                assert codec_rule(key[1]) == caches_rule(key[1]) == grows, (name, kv_bits, key, shape)
                seen.add(key[1])
    assert {"keys", "values.packed", "keys.scales", "state.0", "1.keys", "0.state.1"} <= seen
    for edge in ("keysx", "my_values", "state.keys", "0.values.biases", "key", "values_1", "k.v"):
        assert codec_rule(edge) == caches_rule(edge), edge


def reference_value(n_tokens, layers, digest=D):
    """A value built from the documented format with plain msgpack and one-shot XXH3 (no shared
    code with the encoder): the header map in its order, the pad aligning the payload to 16, the
    token section then the state section (layer, name order), the state section's checksum."""
    import xxhash

    def tokens_on_axis_2(name):
        return bool({"keys", "values"} & set(name.split(".")))

    named = [sorted((name, RawArray(*a)) for name, a in layer.items()) for layer in layers]
    token = b"".join(a.bits.tobytes() for layer in named for n, a in layer if tokens_on_axis_2(n))
    state = b"".join(a.bits.tobytes() for layer in named for n, a in layer if not tokens_on_axis_2(n))
    payload = token + state
    header = {"version": FORMAT_VERSION, "fingerprint": FP, "tokens": n_tokens,
              "layers": [[[n, a.dtype, list(a.bits.shape)] for n, a in layer] for layer in named]}
    for pad in range(16):
        head = b"\x93" + msgpack.packb({**header, "pad": bytes(pad),
                                        "token_checksum": xxhash.xxh3_64_digest(token), "digest": digest})
        head += b"\xc6" + len(payload).to_bytes(4, "big")  # the payload as a bin32, whatever its size
        if len(head) % 16 == 0:  # the state checksum as a uint64, whatever its value
            return head + payload + b"\xcf" + xxhash.xxh3_64_intdigest(state).to_bytes(8, "big")
    raise AssertionError("no pad aligns the payload")


@pytest.mark.parametrize("kind", ["kv", "hybrid", "quantized", "state only", "strided slices"])
def test_values_are_the_documented_bytes(kind):
    """The encoder's bytes are the format's, checked against an independent build of it for
    uniform, mixed, quantized and strided blocks (values stay byte-identical across encoders)."""
    rng = np.random.default_rng(3)
    bits = lambda dt, *shape: rng.integers(0, 2**16, size=shape).astype(dt)  # noqa: E731
    big = bits("<u4", 1, 2, 32, 4)
    layers = {
        "kv": [{"keys": ("float32", bits("<u4", 1, 2, 8, 4)), "values": ("float32", bits("<u4", 1, 2, 8, 4))}] * 3,
        "hybrid": hybrid_layers() + [{}, {"values": ("bfloat16", bits("<u2", 1, 1, 8, 2)),
                                          "keys": ("bfloat16", bits("<u2", 1, 1, 8, 2)), "state.0": ("float16", bits("<u2", 5))}],
        "quantized": [{"keys.packed": ("uint32", bits("<u4", 1, 2, 8, 2)), "keys.scales": ("bfloat16", bits("<u2", 1, 2, 8, 1)),
                       "1.values": ("float32", bits("<u4", 1, 1, 8, 3))}],
        "state only": [{"state.0": ("float32", bits("<u4", 2, 3, 4))}],
        "strided slices": [{"keys": ("float32", big[:, :, 8:16]), "values": ("float32", big[:, :, 16:24])}],
    }[kind]
    assert bytes(encode(8, layers)) == reference_value(8, layers)
