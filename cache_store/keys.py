"""Deterministic names for stored KV blocks: model fingerprints, chained block digests, keys.

Everything here is SHA-256 over canonical bytes (little-endian int32 token ids,
sorted-key JSON), never Python's ``hash()``, so every process, machine and Python
version derives the same keys for the same model and prompt. The model is described to
this module as data (``specprefill.profile.ModelProfile.description``); nothing here
loads or runs a model.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping, Sequence

import numpy as np

from .codec import FORMAT_VERSION

MAX_TOKEN_ID = 2**31 - 1  # token ids are stored and hashed as int32
MAX_BLOCK_SIZE = 1 << 16
# Every key is "<namespace>:...": without ':' in a namespace, two namespaces can never
# produce the same key or match each other's SCAN patterns.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Keys the fingerprint adds to a model's description itself.
_FINGERPRINT_FIELDS = ("format_version", "identity", "block_size")


def canonical_json(obj: Any) -> str:
    """Sorted-key, whitespace-free JSON: the same text for the same data everywhere.

    ``ValueError`` for anything that is not JSON data (NaN and infinities included).
    """
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not JSON data: {exc}") from None


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes; ``ValueError`` for ids outside [0, MAX_TOKEN_ID]."""
    ids = np.asarray(tokens)
    if ids.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence of ids, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"tokens: expected integer ids, got dtype {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID):
        raise ValueError(f"tokens: ids must be in [0, {MAX_TOKEN_ID}]")
    return ids.astype("<i4").tobytes()


def model_fingerprint(description: Mapping[str, Any], identity: str, *, block_size: int) -> str:
    """Hex SHA-256 of everything that changes stored KV values or their layout.

    ``description`` is the model as JSON data (its architecture arguments, per-layer cache
    layout, parameter dtypes: ``specprefill.profile.ModelProfile.description``); it is
    hashed with ``identity`` (a weights digest, or repo id + revision), ``block_size`` and
    the block format version.
    """
    if not isinstance(identity, str) or not identity:
        raise ValueError("identity: expected a non-empty string (weights digest or repo@revision)")
    check_block_size(block_size)
    if not isinstance(description, Mapping) or any(k in description for k in _FINGERPRINT_FIELDS):
        raise ValueError("description: expected a mapping describing the model, without "
                         f"{', '.join(_FINGERPRINT_FIELDS)}")
    try:
        text = canonical_json({**_finite(description), "format_version": FORMAT_VERSION, "identity": identity,
                               "block_size": block_size})
    except ValueError as exc:
        raise ValueError(f"description: {exc}") from None
    return hashlib.sha256(text.encode()).hexdigest()


def _finite(obj: Any) -> Any:
    """``obj`` with infinities as tagged strings: configs hold them (mamba2's and nemotron-h's
    ``time_step_limit`` = (0, inf)), and JSON has no spelling for them. NaN stays refused."""
    if isinstance(obj, float) and abs(obj) == float("inf"):
        return f"float:{obj}"
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


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
    """``namespace`` if it is 1-64 letters, digits, '_', '.' or '-', else ``ValueError``."""
    if not isinstance(namespace, str) or not NAMESPACE_PATTERN.fullmatch(namespace):
        raise ValueError(f"namespace: {namespace!r}; allowed 1-64 letters, digits, '_', '.' or '-'")
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


def checkpoint_digest(block_digest: bytes) -> bytes:
    """The digest binding a state checkpoint to the block it follows: ``SHA-256("checkpoint\\0" ||
    the block's chain digest)``, so a checkpoint under a block's key (or a block under a
    checkpoint's) fails the key check."""
    return hashlib.sha256(b"checkpoint\0" + block_digest).digest()


def checkpoint_key(namespace: str, fingerprint: str, digest: bytes) -> str:
    """``{namespace}:kvstate:{fingerprint[:16]}:{checkpoint digest}``: the recurrent state after
    the last token of the block whose chain digest is ``digest``."""
    return f"{namespace}:kvstate:{fingerprint[:16]}:{checkpoint_digest(digest).hex()}"


def tail_digest(fingerprint: str, block_digest: bytes | None, tail_tokens) -> bytes:
    """The digest naming a partial last block (a *tail*) of fewer than ``block_size`` tokens:
    ``SHA-256("tail\\0" || the chain digest of the full blocks before it (the fingerprint when
    there are none) || int32le(tail tokens))``, so it names the whole prefix it ends, its length
    included, and a tail under a block's key (or a block under a tail's) fails the key check."""
    return tail_digests(fingerprint, block_digest, tail_tokens)[-1]


def prefix_tail_digest(fingerprint: str, tokens, block_size: int) -> bytes | None:
    """:func:`tail_digest` of the tail of ``tokens`` (its tokens after its full blocks), None
    when they end on a block boundary."""
    data = np.asarray(tokens)
    full = len(data) // block_size * block_size
    if full == len(data):
        return None
    digests = block_digests(fingerprint, data[:full], block_size)
    return tail_digest(fingerprint, digests[-1] if digests else None, data[full:])


def tail_digests(fingerprint: str, block_digest: bytes | None, tokens) -> list[bytes]:
    """:func:`tail_digest` of every leading part of ``tokens`` (lengths 1, 2, ...), in one pass."""
    parent = bytes.fromhex(fingerprint) if block_digest is None else block_digest
    running, data, out = hashlib.sha256(b"tail\0" + parent), token_bytes(tokens), []
    for start in range(0, len(data), 4):
        running.update(data[start:start + 4])
        out.append(running.copy().digest())
    return out


def tail_key(namespace: str, fingerprint: str, digest: bytes) -> str:
    """``{namespace}:kvtail:{fingerprint[:16]}:{tail digest}``: the K/V of a prefix's partial last block."""
    return f"{namespace}:kvtail:{fingerprint[:16]}:{digest.hex()}"


def stats_key(namespace: str, fingerprint: str) -> str:
    """The hash holding one model's store and memo counters."""
    return f"{namespace}:kvstats:{fingerprint}"


def models_key(namespace: str) -> str:
    """The hash naming each fingerprint's model as results name it (fingerprint -> JSON)."""
    return f"{namespace}:kvmodels"


def layout_key(namespace: str, fingerprint: str) -> str:
    """The record of what one model's blocks hold per layer (checked by ``cache verify``)."""
    return f"{namespace}:kvlayout:{fingerprint}"


def healed_key(namespace: str, fingerprint: str, digest: bytes) -> str:
    """``{namespace}:healed:{fingerprint[:16]}:{digest}``: the block of that digest was
    prefilled by a heal job (what a restoring job reports as healed tokens)."""
    return f"{namespace}:healed:{fingerprint[:16]}:{digest.hex()}"


def key_patterns(namespace: str) -> dict[str, str]:
    """SCAN patterns of what this package writes under ``namespace``: blocks, counters, memo
    entries, the model names, the layout records, the state checkpoints, the tails and the heal marks (every
    key of the store matches exactly one)."""
    return {"blocks": f"{namespace}:kv:*", "checkpoints": f"{namespace}:kvstate:*", "tails": f"{namespace}:kvtail:*",
            "stats": stats_key(namespace, "*"),
            "memo": f"{namespace}:memo:*", "models": models_key(namespace),
            "layouts": layout_key(namespace, "*"), "healed": f"{namespace}:healed:*"}


def memo_key(namespace: str, fingerprint: str, tokens, settings: Mapping[str, Any]) -> str:
    """``{namespace}:memo:{fingerprint[:16]}:{digest}`` over the prompt and its selection settings
    (JSON values; a group of them as a mapping, such as one options object's fields)."""
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
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_json_value(v) for k, v in value.items())
    return False
