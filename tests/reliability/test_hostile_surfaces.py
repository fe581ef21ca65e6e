"""Issue 28, item 16: over a thousand hostile requests in the default run, on every surface
a client can reach, each answered by an error that names its field (or a result), never
a crash: job specs through the client (tests/reliability/test_hostile_input.py, 300 and the
60 the real worker refuses), raw queue payloads (flat and version 3) through the worker's
own validator, the HTTP API's OpenAI bodies (chat completions and completions, through the
real ASGI app, no worker needed where validation is the target) and Batch API lines.

Anthropic Messages and OpenAI Responses bodies go to the same app, each answered in its API's
own error shape (``test_agent_api_bodies_are_refused_naming_the_field``).

The strategies are cheap (values from small pools, sizes by ``map``) so the whole budget
stays well under a minute on two cores."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jobs.contract.spec import JobSpecError, build_spec, spec_from_payload
from jobs.settings import Settings
from tests.reliability.conftest import fake_settings
from tests.reliability.test_hostile_input import CLIENT_EXAMPLES, HOSTILE, LIMITS, VALID, WORKER_EXAMPLES, bad_number

pytestmark = pytest.mark.timeout(180)

BUDGET = {"raw_payloads": 250, "http_bodies": 300, "anthropic_bodies": 200, "responses_bodies": 120,
          "batch_files": 60}
LINES_PER_FILE = (3, 6)  # a Batch API file of 3-6 hostile lines, with a valid one and a duplicate
BATCH_LINES = BUDGET["batch_files"] * (LINES_PER_FILE[0] + 2)  # at least this many lines in all
CHEAP = dict(deadline=None, derandomize=True, database=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SETTINGS = Settings().replace(**fake_settings(**LIMITS))


# ---- raw queue payloads: the worker's own validator, in process ---------------------

SCORING = ["n_lookahead", "pool_kernel", "temperature", "top_p", "seed"]
SELECTION = ["keep", "chunk_size", "tail_tokens", "threshold"]
SPELLED = {"temperature": "lookahead_temperature", "top_p": "lookahead_top_p", "seed": "lookahead_seed"}


def v3_payload() -> dict:
    return build_spec(SETTINGS, **VALID).to_payload()


def _nested(group: str, name: str, value: object) -> tuple[str, dict]:
    payload = v3_payload()
    payload[group] = {**payload[group], name: value}
    return SPELLED.get(name, name), payload


def _replace(key: str, value: object, field: str | None = None) -> tuple[str, dict]:
    return field or key, {**v3_payload(), key: value}


junk = st.sampled_from([None, "x", [], {}, [1], {"a": 1}, -1, 2**70, 1.5, math.nan, True])
V3_HOSTILE = st.one_of(
    *[bad_number(SPELLED.get(n, n)).map(lambda v, n=n: _nested("scoring", n, v)) for n in SCORING],
    *[bad_number("keep" if n == "keep" else "chunk_size").map(lambda v, n=n: _nested("selection", n, v))
      for n in SELECTION],
    # (None is no hostile value here: an unset (None) field takes its default, spec._upgrade)
    st.sampled_from(["scoring", "selection"]).flatmap(
        lambda g: st.sampled_from(["x", 1, [], 0.5]).map(lambda v: (g, {**v3_payload(), g: v}))),
    st.sampled_from(["bogus", "kep", "chunk"]).map(lambda k: _nested("selection", k, 1)),
    st.sampled_from(["x", [], {}, 1.5, -3]).map(lambda v: _replace("tokens", v)),
    st.sampled_from(["", "   ", 5, [], "m" * 1025, "a\x00b"]).map(lambda v: _replace("draft_model", v)),
    st.sampled_from([1, "yes", [], 2.5]).map(lambda v: _replace("return_spans", v)),
    st.sampled_from([{"max_tokens": 0}, {"max_tokens": 10**9}, {"temperature": -1}, {"stop": [""]},
                     {"stop": "x" * 5000}, "gen", [], {"bogus": 1}]).map(
        lambda g: _replace("generate", g)),
)


def test_raw_queue_payloads_are_refused_naming_the_field():
    """What a hostile client puts straight on the queue, as the worker validates it first."""
    seen = []

    @settings(max_examples=BUDGET["raw_payloads"], **CHEAP)
    @given(case=st.one_of(HOSTILE, V3_HOSTILE))
    def refused(case):
        field, payload = case
        with pytest.raises(JobSpecError) as info:
            spec_from_payload(payload, SETTINGS)
        message = str(info.value)
        assert message.startswith((field, "generate", "target_model")), (field, message)
        seen.append(field)

    refused()
    assert len(seen) >= BUDGET["raw_payloads"]


# ---- HTTP bodies: the real ASGI app, in process ----------------------------------

CHAT = {"model": "target", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
COMPLETION = {"model": "target", "prompt": "hello there", "max_tokens": 4}
bad_count = st.sampled_from([0, -1, 10**9, "ten", 1.5, [], {}, True])
bad_share = st.sampled_from([-0.5, 101.0, "hot", [], {}, math.inf, math.nan])
bad_messages = st.sampled_from([[], "hi", 5, [5], [{"role": "alien", "content": "x"}], [{"role": "user"}],
                                [{"role": "user", "content": 5}], [{"content": "x"}],
                                [{"role": "user", "content": [{"type": "image_url"}]}],
                                [{"role": "system", "content": "only a system prompt"}]])
bad_prompt = st.sampled_from([[], 5, None, [[-1]], [1.5], {"a": 1}, [["x"]], [[2**40]]])
bad_option = st.sampled_from(["keep", "chunk_size", "tail_tokens", "threshold", "n_lookahead",
                              "lookahead_temperature", "lookahead_top_p"]).flatmap(
    lambda n: bad_number("keep" if n in ("keep", "lookahead_temperature", "lookahead_top_p") else "chunk_size")
    .map(lambda v: (n, v)))
unknown_name = st.sampled_from(["kep", "chunksize", "evil", "__proto__", "max_token", "draft"])


def _body(base: dict, field: str, value: object) -> tuple[str, dict]:
    return field, {**base, field: value}


def _without(base: dict, field: str) -> tuple[str, dict]:
    return field, {k: v for k, v in base.items() if k != field}


def body_cases(base: dict, url: str) -> st.SearchStrategy:
    prompt = (st.tuples(st.just("messages"), bad_messages) if "messages" in base
              else st.tuples(st.just("prompt"), bad_prompt))
    return st.one_of(
        st.tuples(st.just("max_tokens"), bad_count).map(lambda t: _body(base, *t)),
        st.tuples(st.sampled_from(["temperature", "top_p"]), bad_share).map(lambda t: _body(base, *t)),
        prompt.map(lambda t: _body(base, *t)),
        st.sampled_from([5, "", [], None, "x" * 2000]).map(lambda v: _body(base, "model", v)),
        st.sampled_from([5, [1, 2], [""], ["x"] * 50, {"a": 1}]).map(lambda v: _body(base, "stop", v)),
        st.sampled_from(["yes", 5, []]).map(lambda v: _body(base, "stream", v)),
        bad_option.map(lambda t: _body(base, *t)),
        unknown_name.map(lambda n: _body(base, n, 1)),
        st.sampled_from(["model", "messages" if "messages" in base else "prompt"]).map(lambda f: _without(base, f)),
        st.sampled_from([[], "text", 5, None]).map(lambda v: ("body", v)),
    ).map(lambda case: (url, *case))


HTTP_HOSTILE = st.one_of(body_cases(CHAT, "/v1/chat/completions"), body_cases(COMPLETION, "/v1/completions"))
# Anthropic Messages and OpenAI Responses bodies: the same app, each API's own fields.
MESSAGES = {"model": "target", "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}
RESPONSES = {"model": "target", "input": "hello there", "max_output_tokens": 4}
bad_anthropic_messages = st.sampled_from([
    [], "hi", 5, [5], [{"role": "system", "content": "x"}], [{"role": "user"}], [{"content": "x"}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image", "source": {}}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [5]}],
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "never-called", "content": "x"}]}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": 5, "input": {}}]}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": "not an object"}]}]])
bad_input = st.sampled_from([
    5, [], [5], [{"role": "alien", "content": "x"}], [{"type": "function_call_output", "call_id": "none",
                                                       "output": "x"}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}],
    [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], [{"type": "item_reference"}]])


def api_cases(base: dict, url: str, conversation: str, bad_conversation, count: str) -> st.SearchStrategy:
    """One hostile field on a body that is otherwise valid (its own token budget drawn too, so
    the cases do not run out before the budget)."""
    return st.integers(1, 64).flatmap(lambda n: _api_cases({**base, count: n}, url, conversation,
                                                           bad_conversation, count))


def _api_cases(base: dict, url: str, conversation: str, bad_conversation, count: str) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just(count), bad_count).map(lambda t: _body(base, *t)),
        st.tuples(st.sampled_from(["temperature", "top_p"]), bad_share).map(lambda t: _body(base, *t)),
        bad_conversation.map(lambda v: _body(base, conversation, v)),
        st.sampled_from([5, "", [], None, "x" * 2000]).map(lambda v: _body(base, "model", v)),
        st.sampled_from(["yes", 5, []]).map(lambda v: _body(base, "stream", v)),
        st.sampled_from([5, "x", [5], [{"name": 5}], [{"type": "function"}]]).map(lambda v: _body(base, "tools", v)),
        unknown_name.map(lambda n: _body(base, n, 1)),
        st.sampled_from(["model", conversation]).map(lambda f: _without(base, f)),
    ).map(lambda case: (url, *case))


ANTHROPIC_HOSTILE = st.one_of(
    api_cases(MESSAGES, "/v1/messages", "messages", bad_anthropic_messages, "max_tokens"),
    st.sampled_from([5, [5], [{"type": "image"}]]).map(lambda v: ("/v1/messages", *_body(MESSAGES, "system", v))),
    st.sampled_from([5, "x", [1], ["x"] * 50]).map(
        lambda v: ("/v1/messages", *_body(MESSAGES, "stop_sequences", v))),
    st.just(("/v1/messages", *_without(MESSAGES, "max_tokens"))))
RESPONSES_HOSTILE = st.one_of(
    api_cases(RESPONSES, "/v1/responses", "input", bad_input, "max_output_tokens"),
    st.sampled_from([5, [], {"a": 1}]).map(lambda v: ("/v1/responses", *_body(RESPONSES, "instructions", v))),
    st.sampled_from([5, "", "resp_nosuch"]).map(
        lambda v: ("/v1/responses", *_body(RESPONSES, "previous_response_id", v))))


@pytest.fixture(scope="module")
def http_app():
    """The real ASGI app on a Redis the module starts (no worker: validation is the target)."""
    from starlette.testclient import TestClient

    from specprefill_cli.embedded_redis import EmbeddedRedis
    from specprefill_server.app import create_app

    with EmbeddedRedis() as server:
        app = create_app(SETTINGS.replace(redis_url=server.url))
        yield TestClient(app, raise_server_exceptions=False)


def check_answer(resp, url: str, field: str) -> None:
    """A 4xx naming the field, or (a request that was valid after all: a drawn value can fall
    inside every limit) the answer that no live worker serves its model, which with a worker
    is a result: never a crash (5xx)."""
    error = resp.json()["error"]
    if resp.status_code == 503 and error["code"] == "model_not_available":
        return  # accepted: it would run on a worker
    assert resp.status_code in (400, 404, 413, 422), (url, field, resp.status_code, error)
    named = " ".join(str(x) for x in (error.get("param"), error.get("message")))
    assert field in named, (url, field, error)


def test_openai_http_bodies_are_refused_naming_the_field(http_app):
    seen = []

    @settings(max_examples=BUDGET["http_bodies"], **CHEAP)
    @given(case=HTTP_HOSTILE)
    def answered(case):
        url, field, body = case
        raw = json.dumps(body, allow_nan=True)  # NaN and Infinity as some clients send them
        resp = http_app.post(url, content=raw, headers={"Content-Type": "application/json"})
        check_answer(resp, url, field)
        seen.append(resp.status_code)

    answered()
    assert len(seen) >= BUDGET["http_bodies"] and 500 not in seen
    assert seen.count(400) > len(seen) // 2  # most are refused; the rest were valid requests


# A value of the wrong JSON type is refused by name, never converted (lax parsing read
# ``max_tokens: true`` as 1 and ``stream: "yes"`` as true): (url, field path, body).
WRONG_TYPES = [
    *[("/v1/chat/completions", f, {**CHAT, **b}) for f, b in [
        ("max_tokens", {"max_tokens": True}), ("max_tokens", {"max_tokens": 4.0}), ("max_tokens", {"max_tokens": "4"}),
        ("stream", {"stream": "yes"}), ("stream", {"stream": 1}), ("temperature", {"temperature": True}),
        ("top_p", {"top_p": "0.5"}), ("seed", {"seed": True}), ("stop", {"stop": True}),
        ("max_completion_tokens", {"max_completion_tokens": True}), ("parallel_tool_calls", {"parallel_tool_calls": 1}),
        ("stream_options.include_usage", {"stream": True, "stream_options": {"include_usage": "yes"}})]],
    *[("/v1/completions", f, {**COMPLETION, **b}) for f, b in [
        ("max_tokens", {"max_tokens": True}), ("stream", {"stream": "yes"}), ("echo", {"echo": "no"}),
        ("prompt", {"prompt": [True, 2]})]],
    *[("/v1/messages", f, {**MESSAGES, **b}) for f, b in [
        ("max_tokens", {"max_tokens": True}), ("max_tokens", {"max_tokens": "4"}), ("stream", {"stream": "yes"}),
        ("temperature", {"temperature": True}), ("top_p", {"top_p": "0.5"}),
        ("thinking.budget_tokens", {"thinking": {"type": "enabled", "budget_tokens": True}})]],
    *[("/v1/responses", f, {**RESPONSES, **b}) for f, b in [
        ("max_output_tokens", {"max_output_tokens": True}), ("stream", {"stream": "yes"}), ("store", {"store": "no"}),
        ("temperature", {"temperature": True}), ("parallel_tool_calls", {"parallel_tool_calls": 1})]],
]


@pytest.mark.parametrize("url, field, body", WRONG_TYPES, ids=[f"{u.split('/')[-1]}-{f}-{i}" for i, (u, f, _) in
                                                                enumerate(WRONG_TYPES)])
def test_a_wrong_json_type_is_refused_naming_the_field(http_app, url, field, body):
    resp = http_app.post(url, json=body)
    assert resp.status_code == 400, (url, field, resp.status_code, resp.text)
    error = error_of(resp)
    named = " ".join(str(x) for x in (error.get("param"), error.get("message")))
    assert field in named and "got " in error["message"], (url, field, error)
    if url.endswith("/messages"):  # Anthropic's own error shape on its path
        assert resp.json()["type"] == "error" and error["type"] == "invalid_request_error", resp.json()


def test_a_wrong_json_type_in_a_batch_line_is_refused_naming_the_field():
    from specprefill_server.batch.lines import plan_lines

    cases = [("max_tokens", {**COMPLETION, "max_tokens": True}), ("seed", {**COMPLETION, "seed": "5"}),
             ("echo", {**COMPLETION, "echo": 1}), ("max_tokens", {**CHAT, "max_tokens": True})]
    lines = [json.dumps({"custom_id": f"req-{n}", "method": "POST",
                         "url": "/v1/chat/completions" if "messages" in body else "/v1/completions", "body": body})
             for n, (_, body) in enumerate(cases)]
    entries, specs = plan_lines("\n".join(lines), lambda **f: build_spec(SETTINGS, kind="generate", **f), "t")
    assert specs == [] and len(entries) == len(cases)
    for entry, (field, _) in zip(entries, cases):
        assert entry.error is not None and entry.error["status"] == 400, (field, entry)
        assert field in f"{entry.error.get('param')} {entry.error.get('message')}", (field, entry.error)


def test_http_bodies_that_are_not_json(http_app):
    for raw in (b"", b"{", b"\xff\xfe", b"[1,", b"null", b'{"model": "target", "messages": [}'):
        resp = http_app.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400 and "body" in resp.json()["error"]["message"], (raw, resp.text)


def error_of(resp) -> dict:
    """The error object of either API's error shape (Anthropic's ``{"type": "error", "error":
    {"type", "message"}}`` has no ``code`` or ``param``)."""
    error = resp.json()["error"]
    return {"code": error.get("code") or error.get("type"), **error}


@pytest.mark.parametrize("budget, hostile, overloaded", [
    ("anthropic_bodies", ANTHROPIC_HOSTILE, "overloaded_error"),
    ("responses_bodies", RESPONSES_HOSTILE, "model_not_available")], ids=["messages", "responses"])
def test_agent_api_bodies_are_refused_naming_the_field(http_app, budget, hostile, overloaded):
    """Anthropic Messages and OpenAI Responses bodies: a 4xx in the API's own error shape naming
    the field, or (valid after all) the answer that no live worker serves the model."""
    seen = []

    @settings(max_examples=BUDGET[budget], **CHEAP)
    @given(case=hostile)
    def answered(case):
        url, field, body = case
        resp = http_app.post(url, content=json.dumps(body, allow_nan=True),
                             headers={"Content-Type": "application/json"})
        error = error_of(resp)
        seen.append(resp.status_code)
        if resp.status_code == 503 and overloaded in (error["code"], error.get("type")):
            return
        assert resp.status_code in (400, 404, 413, 422), (url, field, resp.status_code, error)
        named = " ".join(str(x) for x in (error.get("param"), error.get("message")))
        assert field in named, (url, field, error)

    answered()
    assert len(seen) >= BUDGET[budget] and 500 not in seen
    assert seen.count(400) > len(seen) // 2


# ---- Batch API lines ---------------------------------------------------------------

def _line(custom_id: str, case: tuple) -> tuple[str, str]:
    url, field, body = case
    return field, json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}, allow_nan=True)


broken_line = st.sampled_from([  # CID: the line's own custom_id, filled in per line
    ("line", "{"), ("line", "[]"), ("custom_id", json.dumps({"method": "POST", "url": "/v1/completions"})),
    ("custom_id", json.dumps({"custom_id": 5, "url": "/v1/completions", "body": {}})),
    ("method", json.dumps({"custom_id": "CID", "method": "GET", "url": "/v1/completions", "body": COMPLETION})),
    ("url", json.dumps({"custom_id": "CID", "url": "/v1/embeddings", "body": COMPLETION})),
    ("body", json.dumps({"custom_id": "CID", "url": "/v1/completions", "body": "x"})),
    ("stream", json.dumps({"custom_id": "CID", "url": "/v1/completions", "body": {**COMPLETION, "stream": True}})),
])
batch_file = st.lists(st.one_of(HTTP_HOSTILE.map(lambda c: ("body", c)), broken_line.map(lambda b: ("raw", b))),
                      min_size=LINES_PER_FILE[0], max_size=LINES_PER_FILE[1])


def test_batch_api_lines_are_refused_naming_the_field():
    lines_seen = []

    @settings(max_examples=BUDGET["batch_files"], **CHEAP)
    @given(cases=batch_file)
    def planned(cases):
        lines_seen.append(check_batch_file(cases))

    planned()
    assert len(lines_seen) >= BUDGET["batch_files"] and sum(lines_seen) >= BATCH_LINES


def check_batch_file(cases: list) -> int:
    """Plan one Batch API file of ``cases`` (plus a valid first line and a duplicate of
    its id at the end): each refused line names its field. Returns how many lines it had."""
    from specprefill_server.batch.lines import plan_lines

    first = json.dumps({"custom_id": "first", "url": "/v1/completions", "body": COMPLETION})
    fields, lines = [None], [first]  # a valid line, and at the end a line reusing its id
    for n, (kind, case) in enumerate(cases):
        field, line = _line(f"req-{n}", case) if kind == "body" else (case[0], case[1].replace("CID", f"raw-{n}"))
        fields.append(field)
        lines.append(line)
    lines.append(first)
    fields.append("custom_id")
    entries, specs = plan_lines("\n".join(lines), lambda **f: build_spec(SETTINGS, kind="generate", **f), "t")
    assert len(entries) == len(lines)
    for entry, field in zip(entries, fields):
        if entry.error is None:  # a line that was valid after all becomes a job
            assert entry.job_id and field not in ("line", "custom_id", "method", "url", "body", "stream"), field
            continue
        assert field is not None, entry.error
        named = f"{entry.error.get('param')} {entry.error.get('message')}"
        assert entry.error["status"] in (400, 404, 413, 422) and (field in named or field == "line"), (field, entry.error)
    assert len(specs) == sum(e.error is None for e in entries)
    return len(lines)


def test_the_default_run_sends_over_a_thousand_hostile_requests():
    """The budget of issue 28 item 16, over every surface (each test checks it ran its share)."""
    total = CLIENT_EXAMPLES + WORKER_EXAMPLES + BUDGET["raw_payloads"] + BUDGET["http_bodies"] + BATCH_LINES
    assert total >= 1000, total
