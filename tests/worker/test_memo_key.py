"""The selection memo key covers everything that changes the selection, the protected prefix too."""
import fakeredis

from jobs.contract.spec import build_spec
from tests.support.fake_worker import FakeTokenizer, _run, fake_runtime
from tests.support.prompts import tokenize

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3


def test_same_tokens_with_another_protected_prefix_is_not_a_memo_hit():
    r = fakeredis.FakeRedis()
    shared = {"blocks": set(), "memo": {}}
    rt = fake_runtime(r, shared=shared)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2? " * 8}]
    chat = build_spec(rt.settings, messages=messages)
    tokens, protected_prefix = tokenize(chat, FakeTokenizer())
    assert protected_prefix > 0 and len(tokens) > rt.settings.selection.threshold

    as_chat = _run(rt, chat.to_payload(), job_id="chat")
    as_tokens = _run(rt, build_spec(rt.settings, tokens=tokens).to_payload(), job_id="tokens")
    assert as_chat["protected_prefix"] == protected_prefix and as_tokens["protected_prefix"] == 0
    assert not as_tokens["memo_hit"]
    assert len(shared["memo"]) == 2
    # The chat selection keeps the whole system block; a plain-token one need not.
    assert as_chat["kept_ranges"][0][1] >= protected_prefix
    again = _run(rt, chat.to_payload(), job_id="chat-again")
    assert again["memo_hit"] and again["kept_ranges"] == as_chat["kept_ranges"]


def test_a_new_selection_rule_does_not_reuse_old_selections():
    r = fakeredis.FakeRedis()
    shared = {"blocks": set(), "memo": {}}
    rt = fake_runtime(r, shared=shared)
    payload = build_spec(rt.settings, tokens=list(range(2, 130))).to_payload()
    assert not _run(rt, payload, job_id="a")["memo_hit"]
    assert _run(rt, payload, job_id="b")["memo_hit"]
    rt.backend.selection_rule += 1  # a worker with the next rule
    assert not _run(rt, payload, job_id="c")["memo_hit"] and len(shared["memo"]) == 2


def test_the_shipped_backend_keys_its_memo_by_the_selection_rule():
    from specprefill.selection import SELECTION_RULE
    from worker.runtime import SelectionBackend

    assert SelectionBackend.default().selection_rule == SELECTION_RULE >= 2
