"""The answer stream contract: a generate job's answer as a neutral sequence of events, the one
thing every HTTP formatter (chat completions, Anthropic Messages, OpenAI Responses) consumes.

:func:`answer_events` follows a job and yields, in the order the target generated them:

- :class:`ReasoningDelta` ``(text)`` -- reasoning ("thinking") text, separated from the answer
  as mlx-lm's server does (the tokenizer's think start/end markers; ``reasoning_content``).
- :class:`TextDelta` ``(text)`` -- visible answer text (``content``), markers stripped.
- :class:`ToolCallStart` ``(index, id, name)`` -- a tool call, parsed by the model's own
  mlx-lm tool parser the moment its closing marker was generated. ``index`` counts the
  answer's calls from 0; ``id`` is opaque (9 letters and digits unless the model gave its
  own: the strictest templates, Mistral's, accept only that) and is what the client sends
  back as the tool result's ``tool_call_id``.
- :class:`ToolCallArguments` ``(index, delta)`` -- JSON text of that call's arguments; the
  fragments of one index, concatenated, are one JSON object.
- :class:`Finish` ``(reason, usage, result)`` -- always last, exactly once. ``reason`` is
  ``"eos"`` (the model ended its turn), ``"stop"`` (a stop string; not in the text),
  ``"length"`` (``max_tokens``) or ``"tool_calls"`` (the turn ended with tool calls).
  OpenAI says stop/stop/length/tool_calls; Anthropic end_turn/stop_sequence/max_tokens/tool_use.
  ``usage`` counts prompt, generated and block-store-restored prompt tokens; ``result`` is
  the :class:`jobs.contract.results.GenerateResult` (``text``, ``reasoning``, ``tool_calls``).

Guarantees: a call's :class:`ToolCallStart` comes before its arguments, calls come in index
order, each complete before the next starts; deltas are never repeated and never lost
(what the capped progress stream dropped comes from the result before :class:`Finish`); a
job that fails raises :class:`jobs.client.JobFailed` (a retry that generated other text
raises :class:`jobs.client.StreamDiverged`), ``TimeoutError`` once ``timeout`` passed.
On the queue the worker publishes ``text`` and ``reasoning`` events (``offset``, ``delta``)
and one ``tool_call`` event per call (``index``, ``id``, ``name``, ``arguments``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Union

from jobs.client.client import JobHandle, StreamDiverged, check_same
from jobs.contract.results import GenerateResult

FINISH_REASONS = ("eos", "stop", "length", "tool_calls")
CHANNELS = ("reasoning", "text")  # the progress event kinds of the two text channels


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    delta: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the target restored from the block store

    @classmethod
    def of(cls, result: GenerateResult) -> "Usage":
        return cls(result.total, result.generated_tokens, int(result.target_tokens.get("restored", 0)))


@dataclass(frozen=True)
class Finish:
    reason: str
    usage: Usage
    result: GenerateResult


AnswerEvent = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolCallArguments, Finish]
_DELTAS = {"text": TextDelta, "reasoning": ReasoningDelta}


def arguments_json(arguments: Any) -> str:
    """A call's arguments as the JSON text its argument deltas carry."""
    return json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))


def tool_call_events(index: int, call: dict[str, Any]) -> list[AnswerEvent]:
    """The events of one complete tool call (``{"id", "name", "arguments"}``)."""
    return [ToolCallStart(index, call["id"], call["name"]),
            ToolCallArguments(index, arguments_json(call["arguments"]))]


class _Follower:
    """What one stream has yielded, and what the current attempt of the job has said."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.shown = {c: "" for c in CHANNELS}
        self.calls: list[dict[str, Any]] = []  # yielded
        self.reset()

    def reset(self) -> None:
        """A new attempt (a retry) says everything again from the start."""
        self.said = {c: "" for c in CHANNELS}
        self.said_calls = 0

    def channel(self, kind: str, said: str) -> Iterator[AnswerEvent]:
        """The part of ``said`` (all the attempt said on ``kind``) not yielded yet."""
        check_same(self.job_id, self.shown[kind], said, final="answer")
        self.said[kind] = said
        if len(said) > len(self.shown[kind]):
            yield _DELTAS[kind](said[len(self.shown[kind]):])
            self.shown[kind] = said

    def delta(self, kind: str, offset: int, delta: str) -> Iterator[AnswerEvent]:
        said = self.said[kind]
        if offset <= len(said) < offset + len(delta):  # else a replay, or after a gap
            yield from self.channel(kind, said + delta[len(said) - offset:])

    def call(self, index: int, call: dict[str, Any]) -> Iterator[AnswerEvent]:
        if index != self.said_calls:  # a replay, or after a gap (the result fills it)
            return
        self.said_calls += 1
        if index < len(self.calls):
            if self.calls[index] != call:
                raise StreamDiverged(f"job {self.job_id}: a retry made another tool call {index}")
            return
        self.calls.append(call)
        yield from tool_call_events(index, call)


def _call_of(data: dict[str, Any]) -> dict[str, Any]:
    return {"id": str(data.get("id", "")), "name": str(data.get("name", "")),
            "arguments": data.get("arguments") or {}}


def answer_events(handle: JobHandle, timeout: float | None = None,
                  poll_s: float = 1.0) -> Iterator[AnswerEvent]:
    """A generate job's answer as :data:`AnswerEvent` s, as it is generated (late attach
    replays), ending with :class:`Finish`. See the module docstring for the contract."""
    follow, last = _Follower(handle.id), None
    run = ""  # the attempt the events come from (a new one says everything again)
    for ev in handle.events(timeout=timeout, poll_s=poll_s):
        last = ev
        if ev.kind == "retrying" or (ev.attempt and ev.attempt != run):
            follow.reset()
            run = ev.attempt or run
        if ev.kind in CHANNELS:
            yield from follow.delta(ev.kind, int(ev.data.get("offset", 0)), str(ev.data.get("delta", "")))
        elif ev.kind == "tool_call":
            yield from follow.call(int(ev.data.get("index", -1)), _call_of(ev.data))
    if last is None or last.kind != "done":
        raise handle.failure(last)
    result = handle.result(timeout=timeout)
    if not isinstance(result, GenerateResult):
        raise TypeError(f"job {handle.id}: not a generate job")
    yield from follow.channel("reasoning", result.reasoning)
    yield from follow.channel("text", result.text)
    follow.reset()
    for index, call in enumerate(result.tool_calls):
        yield from follow.call(index, _call_of(call))
    yield Finish(result.finish_reason, Usage.of(result), result)
