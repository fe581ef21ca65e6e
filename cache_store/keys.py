"""Deterministic names for stored KV blocks: model fingerprints, chained block digests, keys.

Everything here is SHA-256 over canonical bytes (little-endian int32 token ids,
sorted-key JSON), never Python's ``hash()``, so every process, machine and Python
version derives the same keys for the same model and prompt.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from typing import Any, Mapping, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .codec import FORMAT_VERSION, DTYPES

MAX_TOKEN_ID = 2**31 - 1
MAX_BLOCK_SIZE = 1 << 16


class UnsupportedCacheError(ValueError):
    """The model's cache layout cannot be stored as blocks (e.g. sliding-window layers)."""


def canonical_json(obj: Any) -> str:
    """Sorted-key, whitespace-free JSON: the same text for the same data everywhere."""
    return json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def _plain(obj: Any) -> Any:
    """JSON-ready data; unknown objects become their type name (never a memory address)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return _plain(obj.value)
    if isinstance(obj, mx.Dtype):
        return next((name for name, (d, _) in DTYPES.items() if d == obj), str(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return type(obj).__qualname__


def token_bytes(tokens: Sequence[int] | np.ndarray | mx.array) -> bytes:
    """Token ids as little-endian int32 bytes; ``ValueError`` for ids outside [0, 2**31-1]."""
    ids = np.asarray(tokens)
    if ids.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence of ids, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"tokens: expected integer ids, got dtype {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID):
        raise ValueError(f"tokens: ids must be in [0, {MAX_TOKEN_ID}]")
    return ids.astype("<i4").tobytes()


def cache_layout(model) -> list[dict[str, Any]]:
    """Per layer: cache class, window settings and the KV heads, head dim and dtype it holds.

    Found by running one token through a fresh cache (``make_prompt_cache``), so it
    reports what the model really writes whatever its attribute names.
    """
    cache = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    layout = []
    for c in cache:
        entry: dict[str, Any] = {"cache": type(c).__name__}
        for attr in ("max_size", "keep", "chunk_size", "group_size", "bits"):
            value = getattr(c, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                entry[attr] = value
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            entry["keys"] = [_plain(keys.dtype), keys.shape[1], keys.shape[-1]]
            entry["values"] = [_plain(values.dtype), values.shape[1], values.shape[-1]]
        else:
            entry["state"] = [[_plain(a.dtype), list(a.shape)]
                              for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
        layout.append(entry)
    return layout


def unstorable_reason(cache: Sequence[Any]) -> str | None:
    """Why a list of cache objects cannot be stored as blocks, or None if it can.

    Only plain full-attention ``KVCache`` layers are storable: a sliding-window
    ``RotatingKVCache`` no longer holds the early tokens of a long prompt, so a
    prefix could not be rebuilt exactly, and recurrent/quantized caches have no
    per-token blocks. Such models are never stored and always miss.
    """
    if not cache:
        return "cache: no layers"
    for i, c in enumerate(cache):
        if type(c) is not KVCache:
            return f"cache layer {i}: {type(c).__name__} is not storable (only KVCache layers are)"
    return None


def check_storable(model) -> None:
    """Raise :class:`UnsupportedCacheError` if the model's cache cannot be stored as blocks."""
    reason = unstorable_reason(make_prompt_cache(model))
    if reason:
        raise UnsupportedCacheError(reason)


def model_fingerprint(model, identity: str, *, block_size: int) -> str:
    """Hex SHA-256 of everything that changes stored KV values or their layout.

    Covers ``identity`` (a weights digest, or repo id + revision), the model's
    architecture arguments, its per-layer cache layout (class, KV heads, head dim,
    dtype, window), its parameter dtypes, ``block_size`` and the block format version.
    """
    if not isinstance(identity, str) or not identity:
        raise ValueError("identity: expected a non-empty string (weights digest or repo@revision)")
    check_block_size(block_size)
    description = {
        "format_version": FORMAT_VERSION,
        "identity": identity,
        "block_size": block_size,
        "model_type": type(model).__module__ + "." + type(model).__qualname__,
        "args": _plain(getattr(model, "args", None)),
        "param_dtypes": sorted({_plain(p.dtype) for _, p in tree_flatten(model.parameters())}),
        "layers": cache_layout(model),
    }
    return hashlib.sha256(canonical_json(description).encode()).hexdigest()


def check_block_size(block_size: int) -> int:
    """``block_size`` if it is an int in [1, MAX_BLOCK_SIZE], else ``ValueError`` naming it."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size: {block_size!r}; allowed integers in [1, {MAX_BLOCK_SIZE}]")
    return block_size


def check_ttl(ttl_s: int) -> int:
    """``ttl_s`` if it is an int >= 1 (seconds), else ``ValueError`` naming it."""
    if not isinstance(ttl_s, int) or isinstance(ttl_s, bool) or ttl_s < 1:
        raise ValueError(f"ttl_s: {ttl_s!r}; allowed integers >= 1 (seconds)")
    return ttl_s


def check_fingerprint(fingerprint: str) -> str:
    """``fingerprint`` if it is 64 lowercase hex digits (a :func:`model_fingerprint`), else ``ValueError``."""
    if not isinstance(fingerprint, str) or len(fingerprint) != 64 or not all(
            ch in "0123456789abcdef" for ch in fingerprint):
        raise ValueError("fingerprint: expected 64 lowercase hex digits (from model_fingerprint)")
    return fingerprint


def check_namespace(namespace: str) -> str:
    """``namespace`` if it is a non-empty string without whitespace, else ``ValueError``."""
    if not isinstance(namespace, str) or not namespace or any(ch.isspace() for ch in namespace):
        raise ValueError(f"namespace: {namespace!r}; expected a non-empty string without whitespace")
    return namespace


def block_digests(fingerprint: str, tokens, block_size: int) -> list[bytes]:
    """Chained digests of the full blocks of ``tokens``.

    ``d[i] = SHA-256(d[i-1] || int32le(block i))`` with ``d[-1]`` the fingerprint,
    so a block's digest names its whole prefix. A partial trailing block has none.
    """
    data = token_bytes(tokens)
    step = 4 * block_size
    parent = bytes.fromhex(fingerprint)
    digests = []
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + data[start:start + step]).digest()
        digests.append(parent)
    return digests


def prompt_digest(fingerprint: str, tokens) -> str:
    """Hex SHA-256 naming a whole prompt (length included) for one model."""
    data = token_bytes(tokens)
    h = hashlib.sha256(b"prompt\0" + bytes.fromhex(fingerprint))
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
    return h.hexdigest()


def block_key(namespace: str, fingerprint: str, digest: bytes) -> str:
    """``{namespace}:kv:{fingerprint[:16]}:{digest}``."""
    return f"{namespace}:kv:{fingerprint[:16]}:{digest.hex()}"


def stats_key(namespace: str, fingerprint: str) -> str:
    """The hash holding one model's store and memo counters."""
    return f"{namespace}:kvstats:{fingerprint}"


def key_patterns(namespace: str) -> dict[str, str]:
    """SCAN patterns of what this package writes under ``namespace``: blocks, counters, memo entries."""
    return {"blocks": f"{namespace}:kv:*", "stats": stats_key(namespace, "*"),
            "memo": f"{namespace}:memo:*"}


def memo_key(namespace: str, fingerprint: str, tokens, settings: Mapping[str, Any]) -> str:
    """``{namespace}:memo:{fingerprint[:16]}:{digest}`` over the prompt and its selection settings."""
    if not isinstance(settings, Mapping):
        raise ValueError("settings: expected a mapping of selection settings")
    for name, value in settings.items():
        if not isinstance(name, str):
            raise ValueError(f"settings: key {name!r} is not a string")
        if not _is_json_value(value):
            raise ValueError(f"settings[{name!r}]: {value!r} is not a JSON number, string, bool or null")
    h = hashlib.sha256(prompt_digest(fingerprint, tokens).encode())
    h.update(b"\0" + canonical_json(dict(settings)).encode())
    return f"{namespace}:memo:{fingerprint[:16]}:{h.hexdigest()}"


def _is_json_value(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(v) for v in value)
    return False
