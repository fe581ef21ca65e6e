"""Prefix-aware routing: send a job to the node whose local tier holds the longest prefix of it.

An approximate prefix index in Redis, as SGLang's router keeps one (there a radix tree of
recent prompts per worker; here hashes): a prompt's *routing text* (its text, its token ids,
or its conversation rendered message by message) is cut at a few lengths (``FIRST_CUT``
characters, doubling, and the whole text), and each cut's digest names a sorted set of the
nodes that served a prompt with that prefix, by when (:func:`jobs.contract.keys.route_index_key`).
A worker records its node under every cut of a job it finished (:func:`record_served`); the
submitter (:class:`Router`) looks its prompt's cuts up, longest first, and picks, among the
nodes holding the longest one that have a live worker on their node queue and at most
``route_max_queue`` jobs waiting there, the least loaded (jobs waiting less the jobs its
workers would take at once, their free slots of ``max_jobs_in_flight``; then the most
recent): every conversation's first turn shares the system prompt, and without the tiebreak
they all went to whichever node served it last. No such node: the next shorter cut's
holders, and past the shortest the shared queue. A
``prompt_cache_key`` (the OpenAI field) replaces the text as the whole index entry.

Approximate, by design: a cut says a node served that prefix recently, not that its local
tier still holds every block (a miss there is the shared store's fetch, as without routing).
"""
from __future__ import annotations

import hashlib
import json
import socket
import time
from typing import Any, Iterable, Mapping, Sequence

import redis

from jobs.client.node_queues import queue_states
from jobs.contract.keys import node_queue_name, route_index_key
from jobs.settings import Settings

FIRST_CUT = 256  # characters of the shortest indexed prefix; each next cut doubles
_KEEP_NODES = 8  # nodes remembered per prefix (the most recent)


def node_of(settings: Settings) -> str:
    """This machine's node name: ``node_name``, else the host name (macOS's .local dropped)."""
    return settings.node_name or socket.gethostname().removesuffix(".local") or "node"


def routing_text(spec: Any) -> str:
    """The text a prompt is routed by: its text, its token ids, or its tools and messages one
    JSON line each (a conversation's next turn extends its last one's routing text)."""
    if spec.text is not None:
        return spec.text
    if spec.tokens is not None:
        return " ".join(map(str, spec.tokens))
    lines = [json.dumps(list(spec.tools), sort_keys=True, default=str)] if spec.tools else []
    lines += [json.dumps(dict(m), sort_keys=True, default=str) for m in spec.messages or ()]
    return "\n".join(lines)


def prefix_cuts(text: str, route_key: str | None = None) -> list[tuple[int, str]]:
    """``(length, digest)`` of each indexed prefix of ``text``, longest first; with a
    ``route_key`` that key alone (it names the shared prefix)."""
    if route_key:
        return [(1 << 62, "key-" + hashlib.blake2b(route_key.encode(), digest_size=16).hexdigest())]
    data = text.encode()
    cuts = [n for n in _doubling(FIRST_CUT, len(data))] + [len(data)]
    h, done, out = hashlib.blake2b(digest_size=16), 0, []
    for n in sorted(set(cuts)):
        h.update(data[done:n])
        done = n
        out.append((n, h.copy().hexdigest()))
    return out[::-1]


def _doubling(first: int, limit: int) -> Iterable[int]:
    n = first
    while n < limit:
        yield n
        n *= 2


def record_served(conn: redis.Redis, settings: Settings, node: str, text: str,
                  route_key: str | None = None) -> None:
    """Note that ``node`` now holds the prefixes of ``text`` (one pipelined round trip)."""
    moment, ttl = time.time(), settings.route_index_ttl_s
    with conn.pipeline(transaction=False) as pipe:
        for _, digest in prefix_cuts(text, route_key):
            key = route_index_key(settings.namespace, digest)
            pipe.zadd(key, {node: moment})
            pipe.zremrangebyscore(key, "-inf", moment - ttl)
            pipe.zremrangebyrank(key, 0, -_KEEP_NODES - 1)
            pipe.expire(key, ttl)
        pipe.execute()


class Router:
    """Picks each job's queue: a node queue by prefix, else the shared ``queue``."""

    def __init__(self, conn: redis.Redis, settings: Settings, queue: str) -> None:
        self.conn, self.settings, self.queue = conn, settings, queue

    def queues_for(self, texts: Sequence[str], route_keys: Sequence[str | None]) -> list[str]:
        """The queue of each prompt, in three pipelined round trips for the whole batch."""
        if self.settings.routing != "prefix" or not texts:
            return [self.queue] * len(texts)
        candidates = self._candidates(texts, route_keys)
        nodes = {n for ranked in candidates for holders in ranked for n in holders}
        states = queue_states(self.conn, [node_queue_name(self.queue, n) for n in nodes],
                              self.settings.heartbeat_ttl_s)
        waiting = {n: states[node_queue_name(self.queue, n)].waiting for n in nodes}
        out = []
        for ranked in candidates:
            node = self._pick(ranked, states, waiting)
            if node is None:
                out.append(self.queue)
                continue
            waiting[node] += 1  # the jobs of this batch count too
            out.append(node_queue_name(self.queue, node))
        return out

    def _pick(self, ranked: list[list[str]], states: Mapping[str, Any], waiting: dict[str, int]) -> str | None:
        """The least loaded node open to a job among the holders of the longest cut that has one
        (``ranked``: per cut, longest first, its holders most recent first)."""
        for holders in ranked:
            open_nodes = [n for n in holders if states[node_queue_name(self.queue, n)].live_listeners
                          and waiting[n] <= self.settings.route_max_queue]
            if open_nodes:  # the most free room; min keeps the first of equals: the most recent
                return min(open_nodes, key=lambda n: waiting[n] - states[node_queue_name(self.queue, n)].room)
        return None

    def _candidates(self, texts: Sequence[str], route_keys: Sequence[str | None]) -> list[list[list[str]]]:
        """Each prompt's holder nodes per cut, the longest cut first (a node under its longest
        only), the most recent first."""
        cuts = [prefix_cuts(t, k) for t, k in zip(texts, route_keys)]
        oldest = time.time() - self.settings.route_index_ttl_s
        with self.conn.pipeline(transaction=False) as pipe:
            for prompt_cuts in cuts:
                for _, digest in prompt_cuts:
                    pipe.zrevrangebyscore(route_index_key(self.settings.namespace, digest),
                                          "+inf", oldest)
            replies = iter(pipe.execute())
        out = []
        for prompt_cuts in cuts:
            seen: set[str] = set()
            ranked = []
            for _ in prompt_cuts:
                holders = [n for n in map(_text, next(replies)) if n not in seen]
                seen.update(holders)
                if holders:
                    ranked.append(holders)
            out.append(ranked)
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def route_key_of(meta: Mapping[str, Any] | None) -> str | None:
    """The ``prompt_cache_key`` a job was submitted with (kept in RQ's job meta, not the spec:
    it says where to run, not what)."""
    value = (meta or {}).get("route_key")
    return value if isinstance(value, str) and value else None
