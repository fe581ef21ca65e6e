"""An agent's turn on a healed conversation, on the shipped draft and target (issue 25 item 2):
a tool result longer than the threshold is scored over what is new only (the draft restores its
own blocks of the earlier turn, the target the healed conversation), sparsely prefilled over the
restored conversation, and healed after; one no longer than it is prefilled in full on it.
Every turn, a full prefill's too, queues the heal that stores its answer (issue 40 item 5): the
next turn restores the whole conversation and prefills only its new message.
The real block store and RQ's heal queue on fakeredis; jobs run in this process."""
from __future__ import annotations

import random

import fakeredis
import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.contract.results import GenerateResult
from jobs.contract.spec import build_spec
from jobs.progress import ProgressPublisher
from jobs.settings import SHIPPED_MODELS, Settings
from tools import recall_task
from worker.job.context import JobContext
from worker.job.tasks import execute
from worker.models import ModelPool
from worker.runtime import WorkerRuntime

DRAFT, TARGET = str(SHIPPED_MODELS / "draft-tiny"), str(SHIPPED_MODELS / "target-tiny")
BLOCK = 32
AGENT = dict(threshold=96, tail_tokens=32, keep=0.4)  # a tool result over 96 tokens is scored


@pytest.fixture(scope="module")
def models():
    return ModelPool(2, block_size=BLOCK)


def runtime(models, **over) -> WorkerRuntime:
    settings = Settings().replace(draft_model=DRAFT, target_model=TARGET, block_size=BLOCK, **{**AGENT, **over})
    return WorkerRuntime.from_settings(settings, fakeredis.FakeRedis(), models=models)


def run(rt: WorkerRuntime, job_id: str, payload: dict) -> dict:
    pub = ProgressPublisher(rt.connection, job_id, min_interval_s=0.0)
    queue = rt.settings.heal_queues[0] if job_id.startswith("heal-") else rt.settings.queues[0]
    return execute(payload, JobContext(job_id, rt, pub, queue=queue))


def turn(rt: WorkerRuntime, job_id: str, messages: list) -> GenerateResult:
    spec = build_spec(rt.settings, kind="generate", messages=messages, max_tokens=8, greedy=True)
    return GenerateResult.from_json(run(rt, job_id, spec.to_payload()))


def heal(rt: WorkerRuntime, result: GenerateResult) -> dict:
    assert result.heal["queued"], result.heal
    job_id = result.heal["job_id"]
    return run(rt, job_id, Job.fetch(job_id, connection=rt.connection, serializer=JSONSerializer).args[0])


def conversation(tool_tokens: int) -> tuple[list, str]:
    """A system prompt and a first turn with a document, and a tool result of ``tool_tokens``."""
    task, rng = recall_task.load(), random.Random(5)
    doc = task.make_document(rng, 384, 2)
    tool = task.make_document(rng, tool_tokens, 1)
    first = [{"role": "system", "content": task.decode(task.haystack(rng, 64))},
             {"role": "user", "content": doc.text + recall_task.QUESTION.format(doc.needles[0].key)}]
    return first, tool.text + recall_task.QUESTION.format(tool.needles[0].key)


def first_turn_healed(rt: WorkerRuntime, tool_tokens: int) -> tuple[list, GenerateResult, dict]:
    first, tool = conversation(tool_tokens)
    one = turn(rt, "t1", first)
    assert one.reason is None and one.target_tokens["prefilled_sparse"] > 0  # turn 1 is sparse
    healed = heal(rt, one)
    return first + [{"role": "assistant", "content": one.text}, {"role": "user", "content": tool}], one, healed


def test_a_long_tool_result_is_scored_over_what_is_new_and_healed_after(models):
    rt = runtime(models)
    messages, one, healed = first_turn_healed(rt, 320)
    two = turn(rt, "t2", messages)
    t, new = two.target_tokens, two.total - healed["stored"]
    assert t["restored"] == healed["stored"] == healed["total"] and t["healed"] == healed["healed"] > 0
    assert two.reason is None and t["prefilled_sparse"] > 0 and t["prefilled_full"] + t["prefilled_sparse"] < new
    assert two.kept == t["restored"] + t["prefilled_full"] + t["prefilled_sparse"]
    assert two.kept_ranges[0] == (0, t["restored"] + t["prefilled_full"])  # the restored conversation: whole
    assert two.kept - t["restored"] > two.total - two.tail_start  # the draft ranked chunks, not only the tail
    # The draft read only what it lacked: its own blocks of turn 1's prompt came from the store.
    assert two.cached_tokens == one.total // BLOCK * BLOCK > 0
    again = heal(rt, two)
    assert again["restored"] == t["restored"] + t["prefilled_full"]  # what turn 2 stored in order
    assert again["stored"] == again["total"] == two.heal["tokens"] > two.total


def test_a_short_tool_result_is_prefilled_in_full_on_the_healed_conversation(models):
    rt = runtime(models)
    messages, _, healed = first_turn_healed(rt, 48)
    two = turn(rt, "t2", messages)
    t = two.target_tokens
    assert t["restored"] == healed["stored"] and "threshold of 96" in two.reason
    assert t["prefilled_full"] == two.total - t["restored"] and t["prefilled_sparse"] == 0
    assert two.cached_tokens == 0  # no draft work
    assert two.heal["queued"] and two.heal["tokens"] > two.total  # its heal stores its answer


@pytest.mark.parametrize("first_prefill", ["full", "sparse"])
def test_the_next_turn_restores_the_conversation_with_the_answer(models, first_prefill):
    rt = runtime(models)
    task, rng = recall_task.load(), random.Random(7)
    doc = task.make_document(rng, 1024, 2)
    first = [{"role": "system", "content": task.decode(task.haystack(rng, 64))},
             {"role": "user", "content": doc.text + recall_task.QUESTION.format(doc.needles[0].key)}]
    spec = build_spec(rt.settings, kind="generate", messages=first, max_tokens=8, greedy=True,
                      full_prefill=first_prefill == "full")
    one = GenerateResult.from_json(run(rt, "t1", spec.to_payload()))
    assert (one.target_tokens["prefilled_sparse"] > 0) == (first_prefill == "sparse")
    healed = heal(rt, one)
    # What the heal prefilled: a sparse turn's holes and its answer; a full one's answer only.
    assert healed["stored"] == healed["total"] == one.heal["tokens"] > one.total + len(one.token_ids)
    assert (healed["restored"] == one.total) == (first_prefill == "full")
    two = turn(rt, "t2", first + [{"role": "assistant", "content": one.text},
                                  {"role": "user", "content": "And the other one?"}])
    t = two.target_tokens
    assert t["restored"] == healed["total"] and t["restored"] / two.total >= 0.99, (t, two.total)
    assert t["prefilled_full"] == two.total - t["restored"] and t["prefilled_sparse"] == 0
