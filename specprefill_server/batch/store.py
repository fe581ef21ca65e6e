"""The Batch API's files and batches in Redis, kept for the result TTL.

Keys (under ``{namespace}:http:``): ``file:{id}`` a hash (``meta`` JSON, ``content``
bytes), ``files`` a sorted set by creation time; ``batch:{id}`` the batch object (JSON),
``batch-lines:{id}`` its input lines and their jobs, ``batches`` a sorted set by creation
time, ``batches-active`` the set of batches not yet ended (what a restarted server resumes),
``batch-counted:{id}`` the jobs whose answers a server's metrics counted already.
"""
from __future__ import annotations

import json
import secrets
import time
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

import redis

from cache_store.replies import as_text

from specprefill_server.batch.lines import BatchLine

TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    """Thin, decoded reads and writes; every key expires after ``ttl_s``."""

    def __init__(self, connection: redis.Redis, namespace: str, ttl_s: int) -> None:
        self.r, self.ttl_s = connection, ttl_s
        self.prefix = f"{namespace}:http:"

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- files ---------------------------------------------------------------

    def put_file(self, content: bytes, *, filename: str, purpose: str,
                 file_id: str | None = None) -> dict[str, Any]:
        """Store a file; returns its OpenAI file object."""
        now = int(time.time())
        meta = {"id": file_id or new_id("file-"), "object": "file", "bytes": len(content),
                "created_at": now, "expires_at": now + self.ttl_s, "filename": filename,
                "purpose": purpose, "status": "processed", "status_details": None}
        key = self._key("file", meta["id"])
        with self.r.pipeline() as pipe:
            pipe.hset(key, mapping={"meta": json.dumps(meta), "content": content})
            pipe.expire(key, self.ttl_s)
            pipe.zadd(self._key("files"), {meta["id"]: time.time()})
            self._prune(pipe, "files")
            pipe.execute()
        return meta

    def file(self, file_id: str) -> dict[str, Any] | None:
        raw = self.r.hget(self._key("file", file_id), "meta")
        return json.loads(raw) if raw else None

    def file_content(self, file_id: str) -> bytes | None:
        return self.r.hget(self._key("file", file_id), "content")

    def delete_file(self, file_id: str) -> bool:
        with self.r.pipeline() as pipe:
            pipe.delete(self._key("file", file_id))
            pipe.zrem(self._key("files"), file_id)
            return bool(pipe.execute()[0])

    def list_files(self, limit: int = 100) -> list[dict[str, Any]]:
        ids = [as_text(i) for i in self.r.zrevrange(self._key("files"), 0, limit - 1)]
        return [f for f in (self.file(i) for i in ids) if f is not None]

    # -- batches -------------------------------------------------------------

    def put_batch(self, batch: dict[str, Any], lines: list[BatchLine] | None = None) -> None:
        """Write the batch object (and its lines, when given); track it while it runs."""
        key = self._key("batch", batch["id"])
        with self.r.pipeline() as pipe:
            pipe.set(key, json.dumps(batch), ex=self.ttl_s)
            if lines is not None:
                pipe.set(self._key("batch-lines", batch["id"]),
                         json.dumps([entry.to_json() for entry in lines]), ex=self.ttl_s)
                pipe.zadd(self._key("batches"), {batch["id"]: batch["created_at"]})
                self._prune(pipe, "batches")
            if batch["status"] in TERMINAL:
                pipe.srem(self._key("batches-active"), batch["id"])
            else:
                pipe.sadd(self._key("batches-active"), batch["id"])
            pipe.execute()

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.r.get(self._key("batch", batch_id))
        return json.loads(raw) if raw else None

    def lines(self, batch_id: str) -> list[BatchLine]:
        raw = self.r.get(self._key("batch-lines", batch_id))
        return [BatchLine.from_json(d) for d in json.loads(raw)] if raw else []

    def list_batches(self, limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        """Newest first; ``after`` a batch id (the page before)."""
        ids = [as_text(i) for i in self.r.zrevrange(self._key("batches"), 0, -1)]
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        return [b for b in (self.batch(i) for i in ids[:limit]) if b is not None]

    def active_ids(self) -> list[str]:
        return sorted(as_text(i) for i in self.r.smembers(self._key("batches-active")))

    def forget_active(self, batch_id: str) -> None:
        self.r.srem(self._key("batches-active"), batch_id)

    def newly_counted(self, batch_id: str, job_ids: list[str]) -> list[str]:
        """Of ``job_ids``, those no server counted in its metrics yet, marked counted now
        (so servers sharing the Redis, or one restarted, count each answer once)."""
        if not job_ids:
            return []
        key = self._key("batch-counted", batch_id)
        with self.r.pipeline() as pipe:
            for jid in job_ids:
                pipe.sadd(key, jid)
            pipe.expire(key, self.ttl_s)
            added = pipe.execute()[:-1]
        return [jid for jid, n in zip(job_ids, added) if n]

    @contextmanager
    def lock(self, batch_id: str, ttl_s: int = 15) -> Iterator[bool]:
        """Yields whether this process holds the batch's lock (several servers may run).

        Short-lived: a server killed while holding it delays the batch by ``ttl_s`` at most
        (every step is safe to repeat, so an expired lock costs at most a repeated step)."""
        key, token = self._key("batch-lock", batch_id), secrets.token_hex(8)
        held = bool(self.r.set(key, token, nx=True, ex=ttl_s))
        try:
            yield held
        finally:
            if held and self.r.get(key) == token.encode():
                self.r.delete(key)

    def _prune(self, pipe: Any, index: str) -> None:
        """Drop index entries older than the TTL (their records have expired)."""
        pipe.zremrangebyscore(self._key(index), "-inf", time.time() - self.ttl_s)
