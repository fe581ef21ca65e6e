"""Each decision once (issue 38 item 3, issue 39 item 5), counted by spies over whole jobs on the
shipped draft and target: a chat message from an Anthropic Messages request through the client,
the queue (RQ on fakeredis), the worker and the routing note after the job is checked once on
each side of the queue, by the one validator; so are the selection options; a job's plan
(admission, budget, tail, keep_effect) is made once; the importance is checked once; the chat
template renders the prompt once. Each spy wraps the one function wherever a module imported it,
so a second caller anywhere counts."""
from __future__ import annotations

import sys
from collections import Counter

import fakeredis
import pytest

import jobs.contract.conversation
import specprefill.plan
import specprefill.selection
import worker.job.prompt
from jobs.client import Client
from jobs.contract.results import GenerateResult
from jobs.contract.spec import build_spec
from jobs.progress import ProgressPublisher
from jobs.settings import SHIPPED_MODELS, Settings
from specprefill.options import SelectionOptions
from specprefill.plan import PrefillPlan
from specprefill_server.apis.anthropic.convert import message_fields
from specprefill_server.apis.anthropic.types import MessagesRequest
from specprefill_server.parse import parse
from tools import recall_task
from worker.job.context import JobContext
from worker.job.tasks import execute
from worker.models import ModelPool
from worker.process.queues import listen_order
from worker.process.rq_worker import InProcessWorker
from worker.runtime import WorkerRuntime

DRAFT, TARGET = str(SHIPPED_MODELS / "draft-tiny"), str(SHIPPED_MODELS / "target-tiny")


@pytest.fixture(scope="module")
def models():
    return ModelPool(2, block_size=32)


def runtime(models, **over) -> WorkerRuntime:
    settings = Settings().replace(draft_model=DRAFT, target_model=TARGET, block_size=32, threshold=96,
                                  tail_tokens=32, keep=0.4, heal=False, **over)
    return WorkerRuntime.from_settings(settings, fakeredis.FakeRedis(), models=models)


class Spies:
    """Counts calls of functions (every module's reference to each) and methods, by name."""

    def __init__(self, monkeypatch):
        self.calls: Counter[str] = Counter()
        self.monkeypatch = monkeypatch

    def function(self, module, name: str) -> None:
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return original(*args, **kwargs)

        for mod in list(sys.modules.values()):
            for attr, value in list(getattr(mod, "__dict__", {}).items()):
                if value is original:
                    self.monkeypatch.setattr(mod, attr, counted)

    def method(self, cls, name: str, label: str, when=lambda *a, **k: True) -> None:
        original = getattr(cls, name)

        def counted(*args, **kwargs):
            if when(*args, **kwargs):
                self.calls[label] += 1
            return original(*args, **kwargs)

        self.monkeypatch.setattr(cls, name, counted)

    def take(self) -> Counter[str]:
        out, self.calls = self.calls, Counter()
        return out


@pytest.fixture
def spies(monkeypatch):
    from transformers import PreTrainedTokenizerFast

    s = Spies(monkeypatch)
    s.function(jobs.contract.conversation, "check_messages")
    s.function(specprefill.plan, "plan_prefill")
    s.function(specprefill.plan, "chunk_budget")
    s.function(specprefill.plan, "admission_reason")
    s.function(specprefill.selection, "_as_importance")
    s.function(worker.job.prompt, "tokenize_prompt")
    s.method(SelectionOptions, "__post_init__", "SelectionOptions")
    s.method(PrefillPlan, "keep_effect", "keep_effect")
    s.method(PreTrainedTokenizerFast, "apply_chat_template", "render_prompt",
             when=lambda self, messages, **k: k.get("add_generation_prompt") and messages == CONVERSATION)
    return s


def document() -> tuple[str, str]:
    task, rng = recall_task.load(), random_state()
    doc = task.make_document(rng, 384, 2)
    return task.decode(task.haystack(rng, 64)), doc.text + recall_task.QUESTION.format(doc.needles[0].key)


def random_state():
    import random

    return random.Random(5)


SYSTEM, QUESTION = document()
# The conversation as the template takes it: what the render spy matches.
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def test_a_chat_message_from_the_messages_api_is_checked_once_on_each_side_of_the_queue(models, spies):
    """Client side: the request's conversion, the spec, the enqueue. Worker side: the payload,
    the job, the routing note after it (routing=prefix, the default)."""
    rt = runtime(models)
    assert rt.settings.routing == "prefix"
    client = Client(rt.connection, rt.settings)
    spies.take()  # building the settings (their default options) is no part of a job
    body = {"model": TARGET, "max_tokens": 4, "system": SYSTEM, "keep": 0.3, "greedy": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]}
    handle = client.submit(client.generate_spec(**message_fields(parse(MessagesRequest, body))))
    sent = spies.take()
    assert sent["check_messages"] == 1 and sent["SelectionOptions"] == 1  # keep's range: checked once here
    assert sent["plan_prefill"] == sent["tokenize_prompt"] == 0  # the client plans nothing
    InProcessWorker(listen_order(rt.settings), runtime=rt, name="once").work(burst=True, max_jobs=1)
    result = handle.result(timeout=5)
    ran = spies.take()
    assert result.reason is None and 0 < result.kept < result.total  # the draft selected
    assert ran["check_messages"] == 1 and ran["SelectionOptions"] == 1  # the payload, validated once
    assert ran["tokenize_prompt"] == ran["render_prompt"] == 1  # the prompt rendered once
    assert ran["plan_prefill"] == ran["chunk_budget"] == ran["admission_reason"] == 1
    assert ran["_as_importance"] == 1 and ran["keep_effect"] == 1
    assert rt.connection.keys("specprefill:route:*")  # the routing note read the job's spec


def run(rt, job_id, **fields):
    pub = ProgressPublisher(rt.connection, job_id, min_interval_s=0.0)
    return execute(build_spec(rt.settings, **fields).to_payload(), JobContext(job_id, rt, pub))


@pytest.mark.parametrize("fields", [
    {},  # scored and selected
    {"threshold": 10_000},  # not admitted: every token kept, no draft
    {"return_importance": True, "threshold": 10_000},  # scored, yet kept whole as admission said
], ids=["selected", "admission", "importance"])
def test_a_prefill_job_plans_once_and_renders_once(models, spies, fields):
    rt = runtime(models)
    spies.take()
    out = run(rt, "p", messages=CONVERSATION, **fields)
    n = spies.take()
    assert n["plan_prefill"] == n["chunk_budget"] == n["admission_reason"] == n["keep_effect"] == 1
    assert n["tokenize_prompt"] == n["render_prompt"] == 1
    assert n["_as_importance"] == (0 if fields.get("threshold") and not fields.get("return_importance") else 1)
    assert (out["reason"] is None) == (not fields)
    again = run(rt, "p2", messages=CONVERSATION, **fields)  # a memo hit (or the same admission)
    m = spies.take()
    assert m["plan_prefill"] == m["keep_effect"] == m["render_prompt"] == 1 and m["_as_importance"] <= 1
    assert {k: again[k] for k in ("kept_ranges", "reason", "keep_effect", "tail_start")} == \
        {k: out[k] for k in ("kept_ranges", "reason", "keep_effect", "tail_start")}


def test_a_turn_on_a_restored_prefix_plans_once(models, spies):
    """The second turn restores the first turn's prompt for the target: admission, the protected
    region and keep_effect come from one plan that knows it."""
    rt = runtime(models)
    first = GenerateResult.from_json(run(rt, "t1", kind="generate", messages=CONVERSATION, max_tokens=4,
                                         greedy=True))
    spies.take()
    turn = CONVERSATION + [{"role": "assistant", "content": first.text},
                           {"role": "user", "content": QUESTION + " again, in other words"}]
    second = GenerateResult.from_json(run(rt, "t2", kind="generate", messages=turn, max_tokens=4, greedy=True))
    n = spies.take()
    assert second.target_tokens["restored"] > 0 and second.reason is None
    assert "restored its first" in second.keep_effect
    assert n["plan_prefill"] == n["chunk_budget"] == n["admission_reason"] == n["keep_effect"] == 1
    assert n["tokenize_prompt"] == 1 and n["_as_importance"] == 1 and n["check_messages"] == 2  # spec + payload


@pytest.mark.parametrize("given", [{"keep": 0.3}, {"selection": {"keep": 0.3}}, {"selection": "object"}],
                         ids=["by name", "as fields", "as an object"])
def test_keep_is_range_checked_once_however_a_client_gives_it(spies, given):
    """By name (the CLI's --keep, the HTTP extra field, Client.submit(keep=)), as the group's
    fields, or as a SelectionOptions object (checked when the caller built it, taken as it is)."""
    settings = Settings().replace(draft_model=DRAFT)
    spies.take()
    if given == {"selection": "object"}:
        given = {"selection": SelectionOptions(keep=0.3)}
    spec = build_spec(settings, text="a prompt", **given)
    assert spec.selection.keep == 0.3 and spies.take()["SelectionOptions"] == 1
    with pytest.raises(Exception, match="keep: 1.5 is outside the allowed range"):
        build_spec(settings, text="a prompt", keep=1.5)
