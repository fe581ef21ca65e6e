"""Hostile and malformed job specs (hypothesis), through the client and straight onto the
queue as raw JSON payloads (bypassing the client): each is rejected with an error that
names the bad field, and the worker never crashes and serves the next valid job."""
from __future__ import annotations

import math
import time

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings, strategies as st
from rq import Queue, Retry
from rq.serializers import JSONSerializer

from jobs.client import JobFailed
from jobs.contract.spec import JobSpecError
from tests.reliability.conftest import client_for, fake_settings

pytestmark = pytest.mark.timeout(180)  # every reliability test is bounded

MAX_PROMPT = 512  # small limits keep oversized examples cheap
LIMITS = dict(max_prompt_tokens=MAX_PROMPT, max_batch_documents=20)
VALID = {"draft_model": "fake-draft", "tokens": [2 + i % 200 for i in range(60)]}

INTS = ["chunk_size", "tail_tokens", "threshold", "n_lookahead", "pool_kernel", "lookahead_seed"]
FLOATS = ["keep", "lookahead_temperature", "lookahead_top_p"]
OLD_NAMES = {"seed": "lookahead_seed", "temperature": "lookahead_temperature", "top_p": "lookahead_top_p"}
BOOLS = ["include_last_query", "allow_beyond_context", "return_importance", "return_spans"]

not_a_number = st.one_of(st.text(max_size=5), st.lists(st.integers(), max_size=2),
                         st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
huge = st.one_of(st.integers(min_value=2**40, max_value=2**70),
                 st.integers(min_value=-(2**70), max_value=-1))


def bad_number(name):
    floats = st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                       st.floats(min_value=100.5, max_value=1e300), st.floats(max_value=-0.01))
    bad_ints = st.one_of(huge, st.floats(allow_nan=True).filter(lambda f: not float(f).is_integer()))
    return st.one_of(not_a_number, st.booleans(), floats if name in FLOATS else bad_ints)


def with_field(name, values, prefix=None):
    return values.map(lambda v: (prefix or name, {**VALID, name: v}))


def with_input(name, values, prefix=None):
    def build(v):
        payload = {k: x for k, x in VALID.items() if k != "tokens"}
        payload[name] = v
        return prefix or name, payload
    return values.map(build)


role = st.sampled_from(["user", "system", "assistant"])
good_message = st.fixed_dictionaries({"role": role, "content": st.text(max_size=20)})
bad_message = st.one_of(
    st.fixed_dictionaries({"role": st.text(max_size=8).filter(
        lambda r: r not in ("system", "developer", "user", "assistant", "tool")),
        "content": st.text(max_size=5)}),
    st.fixed_dictionaries({"role": role, "content": st.one_of(st.integers(), st.none(),
                                                              st.lists(st.text(), max_size=2))}),
    st.fixed_dictionaries({"role": role, "content": st.text(max_size=5), "name": st.text(max_size=3)}),
    st.fixed_dictionaries({"role": role}),
    st.text(max_size=5), st.integers(), st.lists(st.text(), max_size=2),
)
bad_messages = st.one_of(
    st.tuples(st.lists(good_message, max_size=3), bad_message, st.lists(good_message, max_size=3))
    .map(lambda t: t[0] + [t[1]] + t[2]),
    st.just([]), st.text(max_size=5), st.integers(),
    st.lists(st.fixed_dictionaries({"role": st.just("system"), "content": st.text(max_size=5)}),
             min_size=1, max_size=3),  # a system prompt and nothing to answer
    st.just([{"role": "user", "content": "x" * (MAX_PROMPT * 32 + 1)}]),
)
bad_tokens = st.one_of(
    st.just([]), st.text(max_size=5), st.integers(), st.dictionaries(st.text(), st.integers(), max_size=2),
    st.integers(MAX_PROMPT + 1, MAX_PROMPT + 40).map(lambda n: [7] * n),  # too long (drawn cheaply)
    st.tuples(st.lists(st.integers(0, 255), max_size=5),
              st.one_of(st.integers(max_value=-1), st.integers(min_value=2**31),
                        st.just(math.nan), st.floats(), st.text(max_size=3), st.booleans(), st.none()),
              st.lists(st.integers(0, 255), max_size=5)).map(lambda t: t[0] + [t[1]] + t[2]),
)
bad_text = st.one_of(st.just(""), st.integers(), st.lists(st.text(), max_size=2),
                     st.just("y" * (MAX_PROMPT * 32 + 1)))
bad_model = st.one_of(st.just(""), st.just("   "), st.integers(), st.lists(st.text(), max_size=1),
                      st.just("m" * 1025), st.just("evil\x00name"), st.just("a\nb"))

# (field the error must name, payload) pairs that any validator can reject.
HOSTILE = st.one_of(
    *[with_field(n, bad_number(n)) for n in INTS + FLOATS],
    *[with_field(old, bad_number(new), prefix=new) for old, new in OLD_NAMES.items()],  # still accepted
    *[with_field(n, st.one_of(st.integers(), st.text(max_size=4), st.floats(allow_nan=True)))
      for n in BOOLS],
    with_field("draft_model", bad_model),
    with_field("tokens", bad_tokens),
    with_input("text", bad_text),
    with_input("messages", bad_messages),
    st.just(("input", {**VALID, "text": "both"})),
    st.just(("input", {"draft_model": "fake-draft"})),
    with_field("kind", st.text(max_size=10).filter(lambda k: k not in ("prefill", "generate"))),
    st.text(min_size=1, max_size=10).filter(lambda k: k.isidentifier() and k not in
                                              {*VALID, *INTS, *FLOATS, *BOOLS, *OLD_NAMES, "text",
                                               "messages", "kind", "extra", "v"})
    .map(lambda k: (k, {**VALID, k: 1})),
)
# Only the worker can reject these: it knows its models and their vocabularies.
WORKER_ONLY = st.one_of(
    with_field("draft_model", st.sampled_from(["no-such-org/no-such-model", "/nonexistent/model",
                                               "../../etc", "a b c"])),
    with_field("tokens", st.lists(st.integers(256, 2**31 - 1), min_size=1, max_size=5)
               .map(lambda bad: VALID["tokens"] + bad)),
)


# Issue 28 item 16: with tests/reliability/test_hostile_surfaces.py, over 1000 in the default run.
CLIENT_EXAMPLES = 300
WORKER_EXAMPLES = 60  # each one a job through a real worker


def test_client_rejects_hostile_specs_naming_the_field(redis_url):
    c = client_for(redis_url, fake_settings(**LIMITS))
    seen = []

    @settings(max_examples=CLIENT_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=HOSTILE)
    def refused_naming_the_field(case):
        field, payload = case
        with pytest.raises(JobSpecError) as info:
            c.submit(**payload)
        assert str(info.value).startswith(field), (field, str(info.value))
        with pytest.raises(JobSpecError):
            c.submit_many([VALID, payload])  # a batch with one bad document is refused whole
        seen.append(field)

    refused_naming_the_field()
    assert len(seen) >= CLIENT_EXAMPLES and c.queue.count == 0


def test_queue_payloads_rejected_by_the_worker_which_keeps_serving(redis_url, workers):
    s = fake_settings(**LIMITS)
    w = workers.fake(redis_url, s)
    c = client_for(redis_url, s)
    q = Queue("specprefill", connection=redis.Redis.from_url(redis_url), serializer=JSONSerializer)
    seen = []

    @settings(max_examples=WORKER_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=st.one_of(HOSTILE, WORKER_ONLY,
                          st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=8),
                                    st.integers(), st.none()).map(lambda p: ("payload", p))))
    @example(("draft_model", {**VALID, "draft_model": "no-such-org/no-such-model"}))
    @example(("tokens", {**VALID, "tokens": VALID["tokens"] + [300]}))
    @example(("tokens", {**VALID, "tokens": [5, math.nan]}))
    @example(("messages", {"draft_model": "fake-draft", "messages": [{"role": "user", "content": 5}]}))
    @example(("payload", [VALID]))
    @example(("payload", None))
    def hostile_job_fails_naming_the_field(case):
        field, payload = case
        job = q.enqueue("worker.tasks.run_job", payload, job_timeout=30, retry=Retry(max=2))
        deadline = time.monotonic() + 15
        while job.get_status(refresh=True) not in ("failed", "finished"):
            assert w.alive(), w.text()[-3000:]
            assert time.monotonic() < deadline, f"job for {field} not done: {job.get_status()}"
            time.sleep(0.02)
        assert job.get_status() == "failed", (field, payload)
        error = c.handle(job.id).error()
        message = error.split(": ", 1)[1] if ": " in error else error
        assert message.startswith(field), (field, error)
        # "failed", not requeued: bad input is never retried (a retry would show "queued")
        seen.append(field)

    hostile_job_fails_naming_the_field()
    print(sorted(__import__("collections").Counter(seen).items()))
    assert len(seen) >= WORKER_EXAMPLES and len(set(seen)) >= 8
    assert w.alive()
    assert c.submit(tokens=VALID["tokens"]).result(timeout=15).kept == 60
