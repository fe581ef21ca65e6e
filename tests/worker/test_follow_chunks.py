"""follow_chunks end to end (issue 26): job spec -> payload -> worker -> selection; the kept
ranges equal the plain-Python reference of the rule, and the memo tells the options apart."""
import fakeredis

from jobs.contract.results import PrefillResult
from jobs.contract.spec import build_spec
from specprefill.selection import to_ranges
from tests.support.fake_worker import _run, fake_runtime
from tests.support.selection_reference import reference_selection

TOKENS = [2 + (i * 37) % 250 for i in range(400)]  # 400 tokens: 50 chunks of 8 (the fake runtime's settings)


def test_a_job_with_follow_chunks_keeps_what_the_reference_keeps():
    rt = fake_runtime(fakeredis.FakeRedis())
    sel = rt.settings.selection
    plain = PrefillResult.from_json(_run(rt, build_spec(rt.settings, tokens=TOKENS, return_importance=True)
                                         .to_payload(), job_id="plain"))
    spec = build_spec(rt.settings, tokens=TOKENS, follow_chunks=3, return_importance=True)
    assert spec.to_payload()["selection"]["follow_chunks"] == 3
    out = PrefillResult.from_json(_run(rt, spec.to_payload(), job_id="follow"))
    assert not out.memo_hit, "a selection with followers is not the memo of one without"
    expected = reference_selection(out.importance, sel.keep, sel.chunk_size, sel.tail_tokens, follow_chunks=3)
    assert [tuple(r) for r in out.kept_ranges] == to_ranges(expected)
    assert out.kept == plain.kept, "followers count against keep"
    assert out.kept_ranges != plain.kept_ranges
    # return_importance always scores; without it the memo serves the same selection.
    first = _run(rt, build_spec(rt.settings, tokens=TOKENS, follow_chunks=3).to_payload(), job_id="memo-1")
    again = _run(rt, build_spec(rt.settings, tokens=TOKENS, follow_chunks=3).to_payload(), job_id="memo-2")
    assert [tuple(r) for r in first["kept_ranges"]] == to_ranges(expected)
    assert again["memo_hit"] and again["kept_ranges"] == first["kept_ranges"]
