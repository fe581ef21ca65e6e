"""The block codec: bit-exact round trips, one msgpack value, every kind of bad value detected."""
import msgpack
import mlx.core as mx
import numpy as np
import pytest

from cache_store.codec import (FORMAT_VERSION, CorruptBlockError, RawArray, decode_block,
                               encode_block, payload_checksum)
from kv_blocks import raw_bits, same_bits, to_mlx
from specprefill.kv_arrays import raw_bits_many

FP = "0f" * 32
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
    value = encode_block(FP, 16, block_of(raws, 16, 32))
    block = decode_block(bytes(value), fingerprint=FP, n_tokens=16)
    assert len(block.layers) == 3
    for (k, v), layer in zip(full, block.layers):
        assert same_bits(to_mlx(layer["keys"]), k[:, :, 16:32])
        assert same_bits(to_mlx(layer["values"]), v[:, :, 16:32])
    assert block.layout == tuple((("keys", str(dtype).split(".")[-1], (1, 2, 16, 8)),
                                  ("values", str(dtype).split(".")[-1], (1, 2, 16, 8))) for _ in range(3))


def test_value_is_plain_msgpack_with_aligned_payload():
    k = random_cache_array(mx.float16)
    value = bytes(encode_block(FP, 8, block_of([(raw_bits(k), raw_bits(k))], 0, 8)))
    header, payload, checksum = msgpack.unpackb(value)
    assert header["version"] == FORMAT_VERSION and header["fingerprint"] == FP and header["tokens"] == 8
    assert header["layers"] == [["float16", [1, 2, 8, 8], "float16", [1, 2, 8, 8]]]
    assert len(payload) == 2 * 2 * 8 * 8 * 2
    assert payload[:len(payload) // 2] == np.asarray(k.view(mx.uint16))[:, :, 0:8].tobytes()
    assert isinstance(checksum, int)
    assert value.index(payload) % 16 == 0


def test_decoded_arrays_do_not_depend_on_the_value_buffer():
    k = random_cache_array(mx.float32)
    value = bytearray(encode_block(FP, 8, block_of([(raw_bits(k), raw_bits(k))], 0, 8)))
    restored = to_mlx(decode_block(value, fingerprint=FP, n_tokens=8).layers[0]["keys"])
    value[:] = bytes(len(value))  # scribble over the stored bytes
    assert same_bits(restored, k[:, :, 0:8])


def test_encoding_copies_the_slice():
    k = random_cache_array(mx.float32)
    raw = raw_bits(k)
    value = encode_block(FP, 8, block_of([(raw, raw)], 8, 16))
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
    return bytes(encode_block(FP, 8, block_of([(raw_bits(k), raw_bits(k))] * 2, 0, 8)))


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
        {**h, "layers": [["int8", s1, d2, s2] for _, s1, d2, s2 in h["layers"]]}, p, c)),
    "shape_disagrees_with_payload": lambda v: repack(v, lambda h, p, c: (
        {**h, "layers": [[d1, [1, 1, 8, 8], d2, s2] for d1, _, d2, s2 in h["layers"]]}, p, c)),
    "wrong_checksum": lambda v: repack(v, lambda h, p, c: (h, p, (c + 1) % 2**64)),
    "payload_not_bytes": lambda v: repack(v, lambda h, p, c: (h, "x" * len(p), c)),
}


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_bad_values_are_rejected(kind):
    value = good_value()
    assert decode_block(value, fingerprint=FP, n_tokens=8).n_tokens == 8  # the unedited value is fine
    with pytest.raises(CorruptBlockError):
        decode_block(BAD_VALUES[kind](value), fingerprint=FP, n_tokens=8)


def test_repacked_good_value_still_decodes():
    """A value re-encoded by any msgpack writer (minimal bin markers, no alignment) still reads."""
    value = good_value(mx.bfloat16)
    again = repack(value, lambda h, p, c: (h, p, c))
    assert again != value
    a = decode_block(value, fingerprint=FP, n_tokens=8).layers[0]["keys"]
    b = decode_block(again, fingerprint=FP, n_tokens=8).layers[0]["keys"]
    assert np.array_equal(a.bits, b.bits)


def test_unsupported_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="dtype"):
        raw_bits_many([mx.zeros((1, 1, 2, 2), dtype=mx.int32)])


@pytest.mark.parametrize("layer", [{"keys": None}, {"keys": None, "values": None, "state": None}, ()],
                         ids=["values_missing", "unknown_array", "not_a_mapping"])
def test_a_layer_must_hold_exactly_the_named_arrays(layer):
    k = RawArray("float32", np.zeros((1, 1, 8, 4), dtype="<u4"))
    named = {name: k for name in layer} if isinstance(layer, dict) else layer
    with pytest.raises(ValueError, match="keys, values"):
        encode_block(FP, 8, [named])


def test_plain_pairs_are_raw_arrays():
    """What the KV conversion hands the store, (dtype name, bits) pairs, encodes like RawArrays."""
    bits = np.arange(32, dtype="<u4").reshape(1, 1, 8, 4)
    pairs = bytes(encode_block(FP, 8, [{"keys": ("float32", bits), "values": ("float32", bits)}]))
    raws = bytes(encode_block(FP, 8, [{"keys": RawArray("float32", bits), "values": RawArray("float32", bits)}]))
    assert pairs == raws


def _edit_layers(edit):
    return lambda v: repack(v, lambda h, p, c: ({**h, "layers": [edit(list(e)) for e in h["layers"]]}, p, c))


# Headers whose field types are wrong: the checksum still matches (payload untouched).
MALFORMED_HEADERS = {
    "dtype_is_a_list": _edit_layers(lambda e: [[e[0]], e[1], e[2], e[3]]),
    "dtype_is_a_map": _edit_layers(lambda e: [{"d": e[0]}, e[1], e[2], e[3]]),
    "shape_dim_is_a_list": _edit_layers(lambda e: [e[0], [[1], 2, 8, 8], e[2], e[3]]),
    "shape_dim_is_a_map": _edit_layers(lambda e: [e[0], e[1], e[2], [1, {"x": 2}, 8, 8]]),
    "shape_dim_is_a_bool": _edit_layers(lambda e: [e[0], [True, 2, 8, 8], e[2], e[3]]),
    "shape_dim_is_a_float": _edit_layers(lambda e: [e[0], [1.0, 2, 8, 8], e[2], e[3]]),
    "shape_of_wrong_rank": _edit_layers(lambda e: [e[0], [2, 8, 8], e[2], e[3]]),
    "shape_is_a_string": _edit_layers(lambda e: [e[0], "1288", e[2], e[3]]),
    "keys_and_values_disagree": _edit_layers(lambda e: [e[0], [1, 4, 8, 8], e[2], [1, 1, 8, 8]]),
    "layers_is_a_map": lambda v: repack(v, lambda h, p, c: ({**h, "layers": {"a": 1}}, p, c)),
    "tokens_is_a_list": lambda v: repack(v, lambda h, p, c: ({**h, "tokens": [8]}, p, c)),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED_HEADERS))
def test_malformed_header_types_are_corrupt_not_type_errors(kind):
    value = good_value()
    with pytest.raises(CorruptBlockError):
        decode_block(MALFORMED_HEADERS[kind](value), fingerprint=FP, n_tokens=8)


def test_reviewer_header_is_corrupt():
    """The reported case: a list where the keys' dtype belongs, valid checksum."""
    k = RawArray("float32", np.zeros((1, 1, 16, 4), dtype="<u4"))
    good = bytes(encode_block(FP, 16, [{"keys": k, "values": k}]))
    header, payload, checksum = msgpack.unpackb(good)
    header["layers"] = [[["float32"], [1, 1, 16, 4], "float32", [1, 1, 16, 4]]]
    with pytest.raises(CorruptBlockError):
        decode_block(msgpack.packb([header, payload, checksum]), fingerprint=FP, n_tokens=16)


def test_parsed_header_cache_is_bounded_and_thread_safe():
    """Many threads decoding blocks of more formats than the cache holds: no error, no growth."""
    import sys
    import threading

    from cache_store import codec

    values = []
    for heads in range(1, 25):  # 24 formats, more than the cache keeps
        k = RawArray("float32", np.full((1, heads, 8, 4), heads, dtype="<u4"))
        values.append((heads, bytes(encode_block(FP, 8, [{"keys": k, "values": k}]))))
    errors = []

    def work(offset):
        try:
            for i in range(300):
                heads, value = values[(i + offset) % len(values)]
                block = decode_block(value, fingerprint=FP, n_tokens=8)
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
