"""What the store holds under one namespace: per-model counters (by fingerprint, and under the
names results use), hit rates, the layout each model's stores recorded, the bytes of its own
keys, and clearing it (that namespace only)."""
from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import redis

from .codec import BlockLayout
from .keys import key_patterns, models_key
from .replies import as_int, as_text

_BATCH = 500  # keys per pipelined round trip


def _keys(client: redis.Redis, namespace: str) -> Iterator[tuple[str, bytes]]:
    """(kind, key) for every key the store wrote under ``namespace``."""
    for kind, pattern in key_patterns(namespace).items():
        for key in client.scan_iter(match=pattern, count=1000):
            yield kind, key


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def hit_rates(counters: dict[str, int]) -> dict[str, float | None]:
    """Block hit rate (restored / looked-for full blocks), memo hit rate (hits / lookups) and the
    share of restored blocks a node read from its own local tier (``local_tier_share``)."""
    hit, missed = counters.get("hit_blocks", 0), counters.get("missed_blocks", 0)
    return {"block_hit_rate": _ratio(hit, hit + missed),
            "memo_hit_rate": _ratio(counters.get("memo_hits", 0), counters.get("memo_lookups", 0)),
            "local_tier_share": _ratio(counters.get("local_tier_hit_blocks", 0), hit)}


def _labels(client: redis.Redis, namespace: str) -> dict[str, dict[str, Any]]:
    """What workers recorded of each fingerprint's model (identity, name, role)."""
    return {as_text(fp): json.loads(as_text(v)) for fp, v in client.hgetall(models_key(namespace)).items()}


def counters_by_name(client: redis.Redis, namespace: str, show: Callable[[str], str] = str,
                     ) -> dict[tuple[str, str], dict[str, int]]:
    """The counters summed per (model name as jobs name it, passed through ``show``; role
    ``draft``/``target``), for metrics labels: a model's fingerprints (block formats, KV
    settings) add up under its name. A fingerprint no worker recorded is
    ``fingerprint:<prefix>``, role ``unknown``."""
    labels = _labels(client, namespace)
    out: dict[tuple[str, str], dict[str, int]] = {}
    for fp, counters in counters_by_model(client, namespace).items():
        label = labels.get(fp, {})
        name = label.get("name") or label.get("model")
        key = (show(name) if name else f"fingerprint:{fp[:16]}", label.get("role") or "unknown")
        total = out.setdefault(key, {})
        for field, value in counters.items():
            total[field] = total.get(field, 0) + value
    return out
def counters_by_model(client: redis.Redis, namespace: str) -> dict[str, dict[str, int]]:
    """Every model's shared counters under ``namespace`` (fingerprint -> counters), pipelined."""
    keys = list(client.scan_iter(match=key_patterns(namespace)["stats"], count=500))
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hgetall(key)
        hashes = pipe.execute()
    return {as_text(key).rsplit(":", 1)[1]: {as_text(f): as_int(v) for f, v in counters.items()}
            for key, counters in zip(keys, hashes)}


def recorded_layout(value: Any) -> BlockLayout | None:
    """The layout a store recorded (see :func:`cache_store.keys.layout_key`), or None if unreadable."""
    try:
        return tuple(tuple((str(name), str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in layer)
                     for layer in json.loads(value))
    except (TypeError, ValueError):
        return None


def labelled_counters(client: redis.Redis, namespace: str) -> dict[str, dict[str, Any]]:
    """Each model's counters and hit rates, keyed by the model name results carry
    (``local:…``/``hub:…``; the fingerprint when no worker recorded it)."""
    labels = _labels(client, namespace)
    out: dict[str, dict[str, Any]] = {}
    for fp, counters in sorted(counters_by_model(client, namespace).items()):
        label = labels.get(fp, {})
        key = label.get("model") or f"fingerprint:{fp}"
        if key in out:  # one model under two block formats: keep both apart
            key = f"{key} ({fp[:12]})"
        out[key] = {"fingerprint": fp, "name": label.get("name"), **counters, **hit_rates(counters)}
    return out


def usage(client: redis.Redis, namespace: str) -> dict[str, int]:
    """Key counts and bytes (Redis ``MEMORY USAGE``) of the store's own keys by kind."""
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    batch: list[tuple[str, bytes]] = []

    def flush() -> None:
        with client.pipeline(transaction=False) as pipe:
            for _, key in batch:
                pipe.memory_usage(key, samples=0)
            for (kind, _), size in zip(batch, pipe.execute()):
                sizes[kind] = sizes.get(kind, 0) + int(size or 0)
        batch.clear()

    for kind, key in _keys(client, namespace):
        counts[kind] = counts.get(kind, 0) + 1
        batch.append((kind, key))
        if len(batch) >= _BATCH:
            flush()
    if batch:
        flush()
    return {"keys": counts, "bytes": sizes, "total_bytes": sum(sizes.values())}


def clear(client: redis.Redis, namespace: str) -> dict[str, int]:
    """Delete every key the store wrote under ``namespace`` (blocks, memo entries,
    counters, model names); other namespaces and other data are untouched."""
    deleted: dict[str, int] = {}
    batch: list[bytes] = []
    for kind, key in _keys(client, namespace):
        deleted[kind] = deleted.get(kind, 0) + 1
        batch.append(key)
        if len(batch) >= _BATCH:
            client.unlink(*batch)
            batch.clear()
    if batch:
        client.unlink(*batch)
    return deleted
