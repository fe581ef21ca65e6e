"""The heal job's contract: which target prefills which tokens in full, off the critical path.

A generate job that answered from a sparse prefill leaves the target's KV of its prompt with
holes; the next turn of the conversation would score and sparsely prefill it all again. A
heal job (run by ``worker.job.heal``) prefills the conversation as the next turn will render it
(the prompt, the answer, the template's end of turn) in full and stores it as target blocks,
so the next turn restores it and prefills only what is new.

The spec carries the tokens themselves (the generate job rendered them with the target's own
template), so a heal does not depend on the message format, and its id is content-addressed:
two identical conversations heal once. A heal that yielded to a user job queues its
continuation (``resume``: the tokens stored when it yielded); the block store is
content-addressed, so the continuation restores what is stored and goes on from there.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from jobs.contract.spec import JobSpecError, Limits, _model_name, _tokens
from jobs.settings import Settings

HEAL_KIND = "heal"
HEAL_PAYLOAD_VERSION = 1
MAX_NOTE_CHARS = 500
HEAL_FIELDS = ("v", "kind", "target_model", "tokens", "resume", "note", "source_job")


@dataclass(frozen=True)
class HealSpec:
    """Prefill ``tokens`` through ``target_model`` in full and store them as target blocks.

    ``note`` says why the heal stops short of the next turn's whole render (None: it does
    not); ``source_job`` names the generate job it heals (shown by RQ's tools, not in the id).
    """

    target_model: str
    tokens: tuple[int, ...]
    resume: int = 0
    note: str | None = None
    source_job: str = ""

    kind = HEAL_KIND
    text = None  # what the client's description reads of an input
    messages = None

    def to_payload(self) -> dict[str, Any]:
        d = {"v": HEAL_PAYLOAD_VERSION, "kind": HEAL_KIND, "target_model": self.target_model,
             "tokens": list(self.tokens), "resume": self.resume, "source_job": self.source_job}
        if self.note:
            d["note"] = self.note
        return d

    def job_id(self, namespace: str = "specprefill") -> str:
        """``heal-<sha256>`` of the namespace, target, tokens and resume point (not the source
        job: identical conversations from different jobs share one heal)."""
        content = {"namespace": namespace, "target_model": self.target_model,
                   "tokens": list(self.tokens), "resume": self.resume}
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return f"{HEAL_KIND}-{hashlib.sha256(canonical.encode()).hexdigest()[:40]}"

    def resumed_at(self, stored: int) -> "HealSpec":
        """The continuation of this heal after ``stored`` tokens were stored."""
        return HealSpec(self.target_model, self.tokens, stored, self.note, self.source_job)


def is_heal_payload(payload: Any) -> bool:
    return isinstance(payload, Mapping) and payload.get("kind") == HEAL_KIND


def heal_spec_from_payload(payload: Any, settings: Settings | None = None, *,
                           limits: Limits | None = None) -> HealSpec:
    """Validate a heal payload read off the queue (never trusted) into a :class:`HealSpec`."""
    settings = settings or Settings()
    limits = limits or Limits.from_settings(settings)
    if not is_heal_payload(payload):
        raise JobSpecError("kind: expected a heal payload")
    unknown = sorted(str(k) for k in payload if k not in HEAL_FIELDS)
    if unknown:
        raise JobSpecError(f"{unknown[0]:.60}: unknown heal field (allowed: {', '.join(HEAL_FIELDS)})")
    if payload.get("v") != HEAL_PAYLOAD_VERSION:
        raise JobSpecError(f"v: heal payload version {payload.get('v')!r:.20} is not supported "
                           f"(expected {HEAL_PAYLOAD_VERSION})")
    tokens = _tokens(payload.get("tokens"), limits)
    resume = payload.get("resume", 0)
    if isinstance(resume, bool) or not isinstance(resume, int) or not 0 <= resume <= len(tokens):
        raise JobSpecError(f"resume: expected a token count in [0, {len(tokens)}], got {resume!r:.40}")
    note, source = payload.get("note"), payload.get("source_job", "")
    if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE_CHARS):
        raise JobSpecError(f"note: expected a string of at most {MAX_NOTE_CHARS} characters")
    if not isinstance(source, str) or len(source) > 200:
        raise JobSpecError("source_job: expected a job id (at most 200 characters)")
    return HealSpec(_model_name(payload.get("target_model"), limits, "target_model"), tokens,
                    resume, note, source)
