"""Scan a namespace's blocks and memo entries, count and remove every one failing a check.

Corruption is otherwise found only when a block is read; :func:`verify_namespace` finds it
everywhere, on a live Redis: keys come from ``SCAN`` (never ``KEYS``), values are fetched
with pipelined ``GET`` in batches of ``batch`` keys (bounded memory and server time per
round trip), and a bad value is deleted only if it is still the value that was read (a
compare-and-delete script), so a block rewritten meanwhile by a worker survives.

Checks per block, under ``{ns}:kv:{fingerprint[:16]}:{digest}``, and per recurrent-state
checkpoint, under ``{ns}:kvstate:...`` (counted with the blocks): a well-formed value of this
format version (``header``, ``version``), a fingerprint the key names (``fingerprint``), a
header digest equal to the key's (``key``: a valid block under another key), the payload
checksum (``checksum``), and one layout per model (``layout``: a block whose layers differ
from the model's ``{ns}:kvlayout:{fingerprint}`` record, written by stores given a layout).
Memo entries: see :func:`cache_store.memo.decode_entry`. Bad blocks are added to their
model's ``corrupt_blocks`` counter, bad memo entries to ``memo_corrupt``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import redis

from .cluster import primaries
from .codec import CorruptBlockError, decode_block, read_header, split_layout
from .inventory import recorded_layout
from .keys import key_patterns, layout_key, stats_key
from .memo import decode_entry
from .replies import as_text

BLOCK_KEY = re.compile(r".*:(?P<kind>kv|kvstate|kvtail):(?P<fp>[0-9a-f]{16}):(?P<digest>[0-9a-f]{64})")
DEFAULT_BATCH = 100

# Delete KEYS[1] only if it still holds ARGV[1] (or is not a string at all).
_COMPARE_AND_DELETE = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if kind ~= 'string' or redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass
class VerifyReport:
    """What a scan found: counts per kind of key, bad ones by reason, what was removed."""

    namespace: str
    blocks: int = 0
    valid_blocks: int = 0
    bad_blocks: dict[str, int] = field(default_factory=dict)  # reason -> count
    memo_entries: int = 0
    bad_memo: dict[str, int] = field(default_factory=dict)
    removed: int = 0
    bad_keys: list[tuple[str, str]] = field(default_factory=list)  # (key, reason), first 100

    def as_dict(self) -> dict[str, Any]:
        """JSON data of the report."""
        return {"namespace": self.namespace, "blocks": self.blocks, "valid_blocks": self.valid_blocks,
                "bad_blocks": dict(self.bad_blocks), "memo_entries": self.memo_entries,
                "bad_memo": dict(self.bad_memo), "removed": self.removed,
                "bad_keys": [list(k) for k in self.bad_keys]}


def _scan(client: redis.Redis, pattern: str, batch: int) -> Iterator[list[bytes]]:
    cursor = 0
    while True:
        cursor, keys = client.scan(cursor, match=pattern, count=batch)
        for start in range(0, len(keys), batch):
            yield keys[start:start + batch]
        if not int(cursor):
            return


def block_problem(key: str, value: Any, layouts: dict[str, Any]) -> tuple[str | None, str | None]:
    """``(reason, fingerprint)`` for one stored block: reason None if it passes every check."""
    match = BLOCK_KEY.fullmatch(key)
    if match is None:
        return "key", None
    if not isinstance(value, (bytes, bytearray)):
        return "header", None
    try:
        header, _ = read_header(value)
        fingerprint, tokens = header.get("fingerprint"), header.get("tokens")
        if not isinstance(fingerprint, str) or not fingerprint.startswith(match["fp"]):
            return "fingerprint", None
        block = decode_block(value, fingerprint=fingerprint, n_tokens=tokens if isinstance(tokens, int) else 0,
                             digest=bytes.fromhex(match["digest"]))
    except CorruptBlockError as exc:
        return exc.reason, None
    except Exception:  # a verifier never dies on a value: anything unreadable is bad
        return "header", None
    recorded = layouts.get(fingerprint)
    if recorded is not None:  # a block holds the token arrays of the model's layout, a checkpoint the rest
        blocks, states = split_layout(recorded)
        if match["kind"] == "kvtail":  # a tail holds the blocks' arrays for fewer tokens
            blocks = tuple(tuple((n, d, (*shape[:2], block.n_tokens, *shape[3:])) for n, d, shape in layer)
                           for layer in blocks)
        if block.layout != (states if match["kind"] == "kvstate" else blocks):
            return "layout", fingerprint
    return None, fingerprint


def _model_layouts(client: redis.Redis, namespace: str) -> dict[str, Any]:
    """Per fingerprint, the layout its stores recorded (``RedisBlockStore(layout=...)``)."""
    out = {}
    for key in client.scan_iter(match=layout_key(namespace, "*"), count=500):
        fp = as_text(key).rsplit(":", 1)[1]
        layout = recorded_layout(client.get(key))
        if layout is not None:
            out[fp] = layout
    return out


def verify_namespace(client: redis.Redis, namespace: str, *, batch: int = DEFAULT_BATCH,
                     remove: bool = True) -> VerifyReport:
    """Check every block and memo entry under ``namespace``; count and (``remove``) delete bad ones.

    On a Redis Cluster every primary is scanned on its own connection. Bad keys are added to
    their model's counters only when removed (a dry run writes nothing).
    """
    if not isinstance(batch, int) or not 1 <= batch <= 10000:
        raise ValueError(f"batch: {batch!r}; allowed integers in [1, 10000]")
    report = VerifyReport(namespace)
    patterns = key_patterns(namespace)
    fingerprints = {as_text(k).rsplit(":", 1)[1] for k in client.scan_iter(match=patterns["stats"], count=500)}
    layouts = _model_layouts(client, namespace)
    for node in primaries(client):
        settle = _Settler(node, client, namespace, fingerprints, report, remove)
        for keys in (k for kind in ("blocks", "checkpoints", "tails") for k in _scan(node, patterns[kind], batch)):
            bad = []
            for key, value in zip(keys, _get_many(node, keys)):
                reason, _ = block_problem(as_text(key), value, layouts)
                report.blocks += 1
                if reason is None:
                    report.valid_blocks += 1
                    continue
                report.bad_blocks[reason] = report.bad_blocks.get(reason, 0) + 1
                bad.append((key, value, reason, "corrupt_blocks"))
            settle(bad)
        for keys in _scan(node, patterns["memo"], batch):
            bad = []
            for key, value in zip(keys, _get_many(node, keys)):
                report.memo_entries += 1
                reason = "header" if not isinstance(value, bytes) else decode_entry(value, as_text(key), None, None)[1]
                if reason:
                    report.bad_memo[reason] = report.bad_memo.get(reason, 0) + 1
                    bad.append((key, value, reason, None if reason == "version" else "memo_corrupt"))
            settle(bad)
    return report


def _get_many(client: redis.Redis, keys: list[bytes]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return pipe.execute(raise_on_error=False)  # a WRONGTYPE reply comes back as an exception


class _Settler:
    """Deletes (if still unchanged) and counts one node's bad keys, batch by batch; without
    ``remove``, only reports them (nothing is written: ``removed`` says how many would go).
    Deletions go to the node that holds the keys, counters through ``counters`` (any key's node)."""

    def __init__(self, node: redis.Redis, counters: redis.Redis, namespace: str, fingerprints: set[str],
                 report: VerifyReport, remove: bool) -> None:
        self.node, self.counters, self.namespace = node, counters, namespace
        self.fingerprints, self.report, self.remove = fingerprints, report, remove
        self.delete = node.register_script(_COMPARE_AND_DELETE)

    def __call__(self, bad: list[tuple]) -> None:
        if not bad:
            return
        if self.remove:
            pipe = self.node.pipeline(transaction=False)
            for key, value, _, _ in bad:
                self.delete(keys=[key], args=[value if isinstance(value, bytes) else b""], client=pipe)
            results = pipe.execute(raise_on_error=False)
        else:
            results = [1] * len(bad)
        counts: dict[tuple[str, str], int] = {}
        for (key, _, reason, counter), removed in zip(bad, results):
            text = as_text(key)
            if len(self.report.bad_keys) < 100:
                self.report.bad_keys.append((text, reason))
            if removed is True or (isinstance(removed, int) and removed > 0):
                self.report.removed += 1
            fp = _full_fingerprint(text, self.fingerprints)
            if counter and fp and self.remove:
                counts[(fp, counter)] = counts.get((fp, counter), 0) + 1
        if counts:
            pipe = self.counters.pipeline(transaction=False)
            for (fp, counter), n in counts.items():
                pipe.hincrby(stats_key(self.namespace, fp), counter, n)
            pipe.execute(raise_on_error=False)


def _full_fingerprint(key: str, fingerprints: set[str]) -> str | None:
    """The one model fingerprint with counters whose prefix the key names, if any."""
    parts = key.split(":")
    prefix = parts[-2] if len(parts) >= 4 else ""
    found = [fp for fp in fingerprints if prefix and fp.startswith(prefix)]
    return found[0] if len(found) == 1 else None
