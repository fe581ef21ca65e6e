"""A memo of final selections: identical prompt + identical options -> the same kept ranges.

Agents and retries resend byte-identical prompts; answering them from here skips
the draft model entirely. The key covers the model fingerprint, the prompt's full
digest and every selection-changing option: the caller's option objects field by field
(any dataclass; the worker gives its scoring and selection options), plus plain values such
as the protected prefix, as canonical JSON with sorted keys, so any change in them is a
different entry. Each entry carries its key's digest and the prompt's
digest, so an entry found under another key (a misdirected write, a wrong restore) is
rejected, deleted and counted as ``memo_corrupt``. Redis errors make ``get`` a miss and
``put`` a no-op, logged and counted in this process.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np
import redis

from .keys import check_fingerprint, check_namespace, check_ttl, memo_key, prompt_digest, stats_key
from .replies import as_int

log = logging.getLogger(__name__)

MEMO_VERSION = 2  # 2: entries carry their key's digest and the prompt's digest

# Counters kept in Redis in the model's stats hash (shared with the block store).
MEMO_COUNTERS = ("memo_lookups", "memo_hits", "memo_writes", "memo_corrupt")
# Counters of this process only (Redis may be the thing that is down).
MEMO_LOCAL_COUNTERS = ("memo_errors", "memo_stats_errors")


class SelectionMemo:
    """Stores each prompt's selection as half-open ``[start, end)`` index ranges."""

    def __init__(self, client: redis.Redis, fingerprint: str, *, namespace: str = "specprefill",
                 ttl_s: int = 86400) -> None:
        self.client = client
        self.fingerprint = check_fingerprint(fingerprint)
        self.namespace = check_namespace(namespace)
        self.ttl_s = check_ttl(ttl_s)
        self._stats_key = stats_key(namespace, fingerprint)
        self.local_counters = dict.fromkeys(MEMO_LOCAL_COUNTERS, 0)

    def key(self, tokens: Sequence[int], options: Mapping[str, Any]) -> str:
        """The Redis key of this prompt's entry under these selection options: each a JSON
        value or an options object (a dataclass, keyed by its fields)."""
        return memo_key(self.namespace, self.fingerprint, tokens,
                        {name: _fields_of(value) for name, value in options.items()})

    def get(self, tokens: Sequence[int], options: Mapping[str, Any]) -> list[tuple[int, int]] | None:
        """The remembered ranges for this prompt and options, or None.

        Counters are written in the same round trip but judged apart: a failing
        HINCRBY (WRONGTYPE, OOM under ``noeviction``) never turns a hit into a miss.
        """
        key = self.key(tokens, options)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(key)
            pipe.hincrby(self._stats_key, "memo_lookups", 1)
            value, counted = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            self.local_counters["memo_errors"] += 1
            log.warning("selection memo: get failed, treating as a miss: %s", exc)
            return None
        self._count_stats_failures([counted])
        if isinstance(value, Exception):
            self.local_counters["memo_errors"] += 1
            log.warning("selection memo: GET failed, treating as a miss: %s", value)
            return None
        if value is None:
            return None
        ranges, reason = decode_entry(value, key, self.fingerprint, len(np.asarray(tokens)))
        if ranges is None:
            log.warning("selection memo: deleting a bad entry %s: %s", key, reason)
            counted = [] if reason == "version" else [("hincrby", self._stats_key, "memo_corrupt", 1)]
            self._after_lookup([("delete", key), *counted])
            return None
        # A prompt in use stays remembered: its TTL counts from the last hit.
        self._after_lookup([("expire", key, self.ttl_s), ("hincrby", self._stats_key, "memo_hits", 1)])
        return ranges

    def _after_lookup(self, commands: list[tuple]) -> None:
        """Bookkeeping after a lookup; its failures are counted, never returned as a miss."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, *args in commands:
                getattr(pipe, name)(*args)
            self._count_stats_failures(pipe.execute(raise_on_error=False))
        except redis.RedisError as exc:
            self._count_stats_failures([exc])

    def _count_stats_failures(self, results: list[Any]) -> None:
        for result in results:
            if isinstance(result, Exception):
                self.local_counters["memo_stats_errors"] += 1
                log.warning("selection memo: bookkeeping write failed (entry unaffected): %s", result)

    def put(self, tokens: Sequence[int], options: Mapping[str, Any],
            ranges: Sequence[tuple[int, int]]) -> None:
        """Remember ``ranges`` (sorted, non-overlapping, within the prompt) for this prompt and options."""
        n_tokens = len(np.asarray(tokens))
        flat = [int(x) for pair in ranges for x in pair]
        if len(flat) != 2 * len(ranges) or not _valid_ranges(flat, n_tokens):
            raise ValueError(f"ranges: expected sorted, disjoint [start, end) pairs within [0, {n_tokens}]")
        key = self.key(tokens, options)
        value = msgpack.packb({"version": MEMO_VERSION, "fingerprint": self.fingerprint,
                               "key": key.rsplit(":", 1)[1], "prompt": prompt_digest(self.fingerprint, tokens),
                               "tokens": n_tokens, "ranges": flat})
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, value, ex=self.ttl_s)
            pipe.hincrby(self._stats_key, "memo_writes", 1)
            stored, counted = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            stored, counted = exc, None
        if isinstance(stored, Exception):
            self.local_counters["memo_errors"] += 1
            log.warning("selection memo: put failed, nothing stored: %s", stored)
            return
        self._count_stats_failures([counted])

    def stats(self) -> dict[str, int]:
        """This model's memo counters from Redis (all processes) plus this process's error counts."""
        counters = dict.fromkeys(MEMO_COUNTERS, 0)
        try:
            values = self.client.hmget(self._stats_key, list(MEMO_COUNTERS))
        except redis.RedisError as exc:
            values = []
            self._count_stats_failures([exc])
        for name, value in zip(MEMO_COUNTERS, values):
            counters[name] = as_int(value)
        return {**counters, **self.local_counters}


def _fields_of(value: Any) -> Any:
    """An options object (a dataclass instance) as the dict of its fields; other values as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def decode_entry(value: bytes, key: str, fingerprint: str | None,
                 n_tokens: int | None) -> tuple[list[tuple[int, int]] | None, str]:
    """``(ranges, "")`` for a valid entry stored under ``key``, else ``(None, reason)``.

    ``reason``: ``version`` (an earlier entry format: dropped, not counted as corrupt),
    ``header`` (not an entry), ``fingerprint``, ``key`` (an entry of another key) or
    ``ranges``. ``fingerprint``/``n_tokens`` None: checked against the key only (a scan).
    """
    try:
        entry = msgpack.unpackb(value)
    except Exception:  # msgpack raises several unrelated types for garbage
        return None, "header"
    if not isinstance(entry, dict):
        return None, "header"
    if entry.get("version") != MEMO_VERSION:
        old = entry.get("version")
        return None, "version" if isinstance(old, int) and 1 <= old < MEMO_VERSION else "header"
    stored_fp = entry.get("fingerprint")
    key_fp = key.rsplit(":", 2)[-2]
    if (not isinstance(stored_fp, str) or not stored_fp.startswith(key_fp)
            or (fingerprint is not None and stored_fp != fingerprint)):
        return None, "fingerprint"
    if entry.get("key") != key.rsplit(":", 1)[1] or not isinstance(entry.get("prompt"), str):
        return None, "key"
    tokens, flat = entry.get("tokens"), entry.get("ranges")
    if not isinstance(tokens, int) or (n_tokens is not None and tokens != n_tokens):
        return None, "key"
    if (not isinstance(flat, list) or len(flat) % 2
            or not all(isinstance(x, int) for x in flat) or not _valid_ranges(flat, tokens)):
        return None, "ranges"
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)], ""


def _valid_ranges(flat: list[int], n_tokens: int) -> bool:
    """Pairs are non-empty, increasing and disjoint, inside [0, n_tokens]."""
    previous_end = 0
    for i in range(0, len(flat), 2):
        start, end = flat[i], flat[i + 1]
        if not previous_end <= start < end <= n_tokens:
            return False
        previous_end = end
    return True
