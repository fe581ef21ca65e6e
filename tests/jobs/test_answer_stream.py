"""The answer stream contract (jobs.client.answer_stream) over scripted progress events: order,
deltas never repeated or lost, retries, tool calls, the finish event."""
import pytest

from jobs.client import JobFailed, JobHandle, StreamDiverged
from jobs.client.answer_stream import (Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart, Usage,
                                       answer_events)
from jobs.contract.results import GenerateResult
from jobs.progress import ProgressEvent

CALL = {"id": "a1b2c3d4e", "name": "lookup", "arguments": {"key": "alpha"}}


def result(**kw):
    base = dict(job_id="generate-x", kept=10, total=10, text="", finish_reason="eos", token_ids=[1, 2, 3],
                ttft_s=0.1, target_tokens={"restored": 4})
    return GenerateResult(**{**base, **kw})


class ScriptedHandle(JobHandle):
    def __init__(self, events, res):
        self.id, self._events, self._res = "generate-x", events, res

    def events(self, timeout=None, after_seq=0, poll_s=1.0):
        yield from self._events

    def result(self, timeout=None, poll_s=0.05):
        return self._res

    def status(self):
        return "failed"

    def error(self):
        return "ValueError: boom"


def ev(seq, kind, attempt="r1", **data):
    return ProgressEvent("generate-x", seq, kind, data, attempt=attempt)


def test_events_in_generation_order_then_finish():
    events = [ev(1, "reasoning", offset=0, delta="think"), ev(2, "text", offset=0, delta="Let me "),
              ev(3, "text", offset=7, delta="look."), ev(4, "tool_call", index=0, **CALL), ev(5, "done")]
    res = result(reasoning="think", text="Let me look.", tool_calls=[CALL], finish_reason="tool_calls")
    out = list(answer_events(ScriptedHandle(events, res)))
    assert out[:-1] == [ReasoningDelta("think"), TextDelta("Let me "), TextDelta("look."),
                        ToolCallStart(0, "a1b2c3d4e", "lookup"), ToolCallArguments(0, '{"key": "alpha"}')]
    assert out[-1] == Finish("tool_calls", Usage(10, 3, 4), res)


def test_lost_deltas_and_calls_come_from_the_result_and_replays_are_not_repeated():
    second = {**CALL, "id": "zzzzzzzz9", "arguments": {"key": "beta"}}
    events = [ev(1, "text", offset=0, delta="ab"), ev(2, "text", offset=0, delta="ab"),  # a replay
              ev(3, "text", offset=5, delta="fg"),  # after a gap: skipped, the result fills it
              ev(4, "tool_call", index=0, **CALL), ev(5, "done")]
    res = result(text="abcdefg", tool_calls=[CALL, second], finish_reason="tool_calls")
    out = list(answer_events(ScriptedHandle(events, res)))
    assert [e for e in out if isinstance(e, TextDelta)] == [TextDelta("ab"), TextDelta("cdefg")]
    assert [e.id for e in out if isinstance(e, ToolCallStart)] == ["a1b2c3d4e", "zzzzzzzz9"]


def test_a_retry_says_it_again_without_repeats_and_a_different_retry_diverges():
    events = [ev(1, "text", offset=0, delta="hel"), ev(2, "retrying", attempt=""),
              ev(3, "text", attempt="r2", offset=0, delta="hello"), ev(4, "done", attempt="r2")]
    out = list(answer_events(ScriptedHandle(events, result(text="hello"))))
    assert [e.text for e in out if isinstance(e, TextDelta)] == ["hel", "lo"]
    events[2] = ev(3, "text", attempt="r2", offset=0, delta="HELLO")
    with pytest.raises(StreamDiverged):
        list(answer_events(ScriptedHandle(events, result(text="HELLO"))))
    calls = [ev(1, "tool_call", index=0, **CALL), ev(2, "retrying", attempt=""),
             ev(3, "tool_call", attempt="r2", index=0, **{**CALL, "name": "other"}), ev(4, "done", attempt="r2")]
    with pytest.raises(StreamDiverged, match="tool call 0"):
        list(answer_events(ScriptedHandle(calls, result(tool_calls=[CALL]))))


def test_a_failed_job_raises_job_failed():
    with pytest.raises(JobFailed, match="boom"):
        list(answer_events(ScriptedHandle([ev(1, "text", offset=0, delta="x"), ev(2, "failed")], result())))
