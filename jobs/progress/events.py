"""The progress event: what a job reports, as it travels on Redis (JSON)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from cache_store.replies import hash_field

EVENT_KINDS = (
    "queued", "downloading", "loading_model", "cache_lookup", "scoring", "lookahead", "importance",
    "selection", "cache_store", "retrying", "done", "failed", "stopped",
    # generate jobs: target prefill (processed/total), decode (tokens so far, tokens/s) and
    # the generated text as ``text`` deltas (``offset`` = characters before ``delta``)
    "target_prefill", "decode", "text",
    # a chat job's reasoning text (offset, delta) and each tool call once it is complete
    # (index, id, name, arguments): jobs.client.answer_stream
    "reasoning", "tool_call",
    # admission kept the prompt whole (reason); the draft's part failed and was skipped
    # (stage, reason); the target's prefix KV looked up and stored in the block store
    "admission", "fallback", "target_cache_lookup", "target_cache_store",
    "heal_queued", "heal",  # a generate job queued its heal; a heal job's blocks (worker.job.heal)
)
TERMINAL_KINDS = frozenset({"done", "failed", "stopped"})
# The answer itself: a watcher waits on these, so each is sent the moment it is published
# (with whatever is pending), never held for the throttle of rate events.
ANSWER_KINDS = frozenset({"text", "reasoning", "tool_call"})
STREAM_FIELD = "e"  # the one field of a stream entry: the event's JSON


@dataclass(frozen=True)
class ProgressEvent:
    """One event of one job.

    ``seq`` counts from 1 per job and is unique in its stream: it is assigned by Redis when
    the event is appended, so two attempts of a job (a retry, or a copy still running after
    its claim was taken) never share a number. ``attempt`` names the run that sent it (its
    RQ execution id; empty for events of the queue itself: queued, canceled, retrying).
    """

    job_id: str
    seq: int
    kind: str
    data: dict[str, Any] = field(default_factory=dict)
    ts: float = 0.0
    attempt: str = ""

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS

    def to_json(self) -> str:
        return "{" + f'"seq":{int(self.seq)},' + self.body_json()[1:]

    def body_json(self) -> str:
        """The JSON object without ``seq`` (Redis puts the number in front when appending)."""
        body: dict[str, Any] = {"job_id": self.job_id, "kind": self.kind, "ts": self.ts, "data": self.data}
        if self.attempt:
            body["attempt"] = self.attempt
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "ProgressEvent":
        d = json.loads(raw)
        return cls(d["job_id"], int(d["seq"]), d["kind"], d.get("data") or {}, float(d.get("ts", 0)),
                   str(d.get("attempt") or ""))

    @classmethod
    def from_entry(cls, fields: Mapping) -> "ProgressEvent":
        """The event of one stream entry's fields."""
        return cls.from_json(hash_field(fields, STREAM_FIELD))


def check_kind(kind: str) -> None:
    if kind not in EVENT_KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(EVENT_KINDS)}")


def parse_stream_events(entries: Iterable[tuple[Any, Mapping]]) -> list[ProgressEvent]:
    """Decode raw XRANGE entries (for tools and tests)."""
    return [ProgressEvent.from_entry(f) for _, f in entries]
