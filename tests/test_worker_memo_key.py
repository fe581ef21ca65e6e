"""The selection memo key covers everything that changes the selection, the protected prefix too."""
import fakeredis

from jobs.spec import build_spec
from test_worker_tasks import FakeTokenizer, _run, fake_runtime
from worker.tasks import tokenize

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3


def test_same_tokens_with_another_protected_prefix_is_not_a_memo_hit():
    r = fakeredis.FakeRedis()
    shared = {"blocks": set(), "memo": {}}
    rt = fake_runtime(r, shared=shared)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2? " * 8}]
    chat = build_spec(rt.settings, messages=messages)
    tokens, system_end = tokenize(chat, FakeTokenizer())
    assert system_end > 0 and len(tokens) > rt.settings.threshold

    as_chat = _run(rt, chat.to_payload(), job_id="chat")
    as_tokens = _run(rt, build_spec(rt.settings, tokens=tokens).to_payload(), job_id="tokens")
    assert as_chat["protected_prefix"] == system_end and as_tokens["protected_prefix"] == 0
    assert not as_tokens["memo_hit"]
    assert len(shared["memo"]) == 2
    # The chat selection keeps the whole system block; a plain-token one need not.
    assert as_chat["kept_ranges"][0][1] >= system_end
    again = _run(rt, chat.to_payload(), job_id="chat-again")
    assert again["memo_hit"] and again["kept_ranges"] == as_chat["kept_ranges"]
