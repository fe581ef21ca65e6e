"""The scripted test target (tests/support/scripted_target.py) answers by its script however the
engine runs it: several jobs at once, of different lengths, in one decode batch."""
from __future__ import annotations

import fakeredis

from jobs.contract.results import GenerateResult
from jobs.contract.spec import build_spec
from jobs.progress import ProgressPublisher
from jobs.settings import Settings
from tests.support.agent_script import RULES, TOOLS
from tests.support.chat_folders import save_chat_model
from tests.support.fake_worker import fake_backend
from tests.support.scripted_target import scripted_loader
from worker.engine import Engine
from worker.job.context import JobContext
from worker.job.tasks import execute
from worker.models import ModelPool
from worker.runtime import WorkerRuntime

QUESTIONS = ["What is alpha?", "And beta and gamma?"]


def test_scripted_jobs_decoding_in_one_batch_each_get_their_rules_answer(tmp_path):
    folder = str(save_chat_model(tmp_path / "agent", "qwen3", script={"rules": RULES}))
    settings = Settings().replace(draft_model="fake-draft", target_model=folder, threshold=100_000,
                                  target_prefix_cache=False)
    pool = ModelPool(2, block_size=16, loader=scripted_loader, warm=lambda m: None)
    be = fake_backend()
    rt = WorkerRuntime(settings, fakeredis.FakeRedis(), None, pool, backend_factory=lambda: be)

    def job(i):
        def run():
            messages = [{"role": "user", "content": "Hi. " * i + QUESTIONS[i % 2]}]  # rows left-padded apart
            spec = build_spec(settings, kind="generate", target_model=folder, messages=messages, tools=TOOLS,
                              greedy=True)
            pub = ProgressPublisher(rt.connection, f"g{i}", min_interval_s=0.0)
            return GenerateResult.from_json(execute(spec.to_payload(), JobContext(f"g{i}", rt, pub)))
        return run

    engine = Engine()
    tasks = [engine.start(job(i), name=f"g{i}") for i in range(4)]
    sizes = []
    while engine.step():
        sizes.append(engine.batch_size)
    assert max(sizes) >= 2
    for i, task in enumerate(tasks):
        assert task.exception is None, task.exception
        res = task.result
        assert res.batched and res.unbatched_reason is None
        keys = [c["arguments"]["key"] for c in res.tool_calls]
        assert (res.reasoning, keys) == (("I need alpha.", ["alpha"]) if i % 2 == 0 else
                                         ("Two more.", ["beta", "gamma"]))
        assert res.finish_reason == "tool_calls"
