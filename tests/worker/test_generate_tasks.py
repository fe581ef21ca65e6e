"""Generate jobs in-process: fake draft scoring (tests/support/fake_worker.py's fakes), a real tiny
random target model, fakeredis. Events, text streaming, stop strings, stop, validation."""
from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from jobs.contract.keys import stream_key
from jobs.contract.results import GenerateResult
from jobs.contract.spec import JobSpecError, build_spec, spec_from_payload
from jobs.progress import ProgressPublisher, parse_stream_events
from jobs.settings import Settings
from specprefill.wrapping import Wrapper
from specprefill_testkit.tiny_models import make_model
from tests.support.fake_worker import FakeModel, FakeTokenizer, fake_backend, identify_all_but
from worker.job.context import JobContext, JobStopped
from worker.job.detokenize import TextStream
from worker.job.tasks import execute
from worker.job.tokenizer_pair import check_shared_tokenizer
from worker.models import ModelPool
from worker.runtime import WorkerRuntime

EOS = 250  # outside FakeTokenizer's 2..201 text ids


class TargetTokenizer(FakeTokenizer):
    eos_token_id = EOS


def pool_with_target(seed=1):
    targets = {}

    def load(name):
        if name == "fake-draft":
            return FakeModel(), FakeTokenizer()
        if name not in targets:  # one instance per name, like a real load kept in the LRU
            targets[name] = make_model("llama", seed=seed + len(targets))
        return targets[name], TargetTokenizer()

    pool = ModelPool(2, loader=load, profile=lambda m: None, fingerprint=lambda m, i, bs: "fp-" + i,
                     identify=lambda name: "fake:" + name, warm=lambda m: None)
    return pool, targets


def runtime(settings=None, **over):
    settings = settings or Settings().replace(draft_model="fake-draft", target_model="tiny-target",
                                              threshold=64, tail_tokens=16, chunk_size=8, keep=0.25, **over)
    pool, targets = pool_with_target()
    be = fake_backend()
    rt = WorkerRuntime(settings, fakeredis.FakeRedis(), None, pool, backend_factory=lambda: be)
    rt.cache_client = rt.connection
    return rt, targets


def run(rt, job_id="g", min_interval_s=0.0, clock=None, **fields):
    fields.setdefault("text", DOC)
    spec = build_spec(rt.settings, kind="generate", **fields)
    kw = {"clock": clock} if clock else {}
    pub = ProgressPublisher(rt.connection, job_id, min_interval_s=min_interval_s, **kw)
    return GenerateResult.from_json(execute(spec.to_payload(), JobContext(job_id, rt, pub)))


def events(rt, job_id="g"):
    return parse_stream_events(rt.connection.xrange(stream_key("specprefill", job_id)))


def streamed_text(evs):
    text = ""
    for e in evs:
        if e.kind == "text":
            assert e.data["offset"] == len(text)  # contiguous, in order, nothing lost
            text += e.data["delta"]
    return text


def ropes_are_genuine(model):
    return not any(isinstance(m, Wrapper) for _, m in model.named_modules())


DOC = "".join(chr(40 + (i * 7 + i * i) % 80) for i in range(200))


def test_generate_job_returns_text_with_events_and_timings():
    rt, targets = runtime()
    res = run(rt, **{"max_tokens": 24, "greedy": True})
    assert res.total == 201 and 0 < res.kept < res.total and res.reason is None
    assert res.generated_tokens == len(res.token_ids) > 0 and res.text
    assert res.finish_reason in ("length", "eos") and res.target_model == "fake:tiny-target"
    assert 0 < res.ttft_s <= res.timings["total"]
    assert {"load_models", "draft_scoring", "selection", "target_prefill", "decode"} <= set(res.timings)
    assert {"target_prefill", "decode"} <= set(res.tokens_per_s)
    evs = events(rt)
    kinds = [e.kind for e in evs]
    assert kinds.index("selection") < kinds.index("target_prefill") < kinds.index("decode")
    # the target first: a bad target or tokenizer fails before the draft scores anything
    assert [e.data.get("role") for e in evs if e.kind == "loading_model"] == ["target", "draft"]
    assert kinds[-1] == "done" and evs[-1].data["generated_tokens"] == res.generated_tokens
    assert streamed_text(evs) == res.text
    assert [e.seq for e in evs] == list(range(1, len(evs) + 1))
    assert ropes_are_genuine(targets["tiny-target"])


def test_keep_one_sparse_path_equals_full_prefill_greedy():
    rt, targets = runtime()
    gen = {"max_tokens": 20, "greedy": True}
    sparse = run(rt, "a", keep=1.0, **gen)
    full = run(rt, "b", keep=1.0, **{**gen, "full_prefill": True})
    assert "keep all" in sparse.reason and not sparse.full_prefill and sparse.kept == sparse.total
    assert full.full_prefill and full.reason == "full_prefill requested" and "draft_scoring" not in full.timings
    assert sparse.token_ids == full.token_ids and sparse.text == full.text
    # A real drop changes what the target saw (and still decodes at the true positions).
    dropped = run(rt, "c", keep=0.25, **gen)
    assert dropped.kept < dropped.total and ropes_are_genuine(targets["tiny-target"])


def test_stop_string_cuts_text_and_is_never_streamed():
    rt, _ = runtime()
    base = run(rt, "a", **{"max_tokens": 40, "greedy": True})
    assert len(base.text) >= 12
    stop = base.text[8:11]
    first = base.text.find(stop)
    res = run(rt, "b", **{"max_tokens": 40, "greedy": True, "stop": [stop]})
    assert res.finish_reason == "stop" and res.text == base.text[:first]
    assert streamed_text(events(rt, "b")) == res.text


def test_each_decoded_token_leaves_as_its_own_text_delta_while_rate_events_stay_throttled():
    """Issue 39 item 3: text is the answer a client waits on; the throttle of progress events
    (here 10 s, the clock standing still) holds the decode rate events, never the text."""
    now = [0.0]
    rt, _ = runtime()
    res = run(rt, min_interval_s=10.0, clock=lambda: now[0], **{"max_tokens": 30, "greedy": True})
    evs = events(rt)
    text_events = [e for e in evs if e.kind == "text"]
    decode_events = [e for e in evs if e.kind == "decode"]
    # The text each token adds, replayed through the worker's detokenizer: each is its own event.
    replay, per_token = TextStream(TargetTokenizer()), []
    for token in res.token_ids:
        replay.add(token)
        per_token.append(replay.take()[1])
    replay.finish()
    per_token.append(replay.take()[1])
    assert res.generated_tokens == 30 and sum(map(bool, per_token)) >= 25
    assert [e.data["delta"] for e in text_events] == [d for d in per_token if d]
    assert len(decode_events) <= 2  # the last one, and one the throttle let through at most
    assert streamed_text(evs) == res.text


def test_stop_during_decode_ends_stopped_and_next_job_matches_a_fresh_worker():
    rt, targets = runtime()
    calls = {"n": 0}

    def stop_after_some_decoding():
        decoding = any(e.kind == "decode" for e in events(rt, "long"))
        calls["n"] += decoding
        return calls["n"] >= 3

    rt.stop_requested = stop_after_some_decoding
    with pytest.raises(JobStopped):
        run(rt, "long", **{"max_tokens": 200, "greedy": True})
    kinds = [e.kind for e in events(rt, "long")]
    assert kinds[-1] == "stopped" and "decode" in kinds and "done" not in kinds
    assert ropes_are_genuine(targets["tiny-target"])
    rt.stop_requested = lambda: False
    after = run(rt, "next", **{"max_tokens": 16, "greedy": True})
    fresh_rt, _ = runtime()
    fresh = run(fresh_rt, "next", **{"max_tokens": 16, "greedy": True})
    assert after.token_ids == fresh.token_ids and after.text == fresh.text


def test_stop_during_target_prefill():
    rt, targets = runtime()
    rt.stop_requested = lambda: any(e.kind == "loading_model" and e.data.get("role") == "target"
                                    for e in events(rt))
    with pytest.raises(JobStopped):
        run(rt, **{"max_tokens": 8})
    assert events(rt)[-1].kind == "stopped" and ropes_are_genuine(targets["tiny-target"])


def test_sampling_is_seeded():
    rt, _ = runtime()
    a = run(rt, "a", **{"max_tokens": 20, "temperature": 1.0, "seed": 5})
    b = run(rt, "b", keep=0.25, n_lookahead=8, **{"max_tokens": 20, "temperature": 1.0, "seed": 5,
                                                     "top_p": 0.95})
    assert a.token_ids == b.token_ids  # same spec content (defaults filled in), same draw
    other = run(rt, "c", **{"max_tokens": 20, "temperature": 1.0, "seed": 6})
    assert other.token_ids != a.token_ids


@pytest.mark.parametrize("extra, message", [
    ({"max_tokens": 5000}, "max_tokens: 5000 is outside the allowed range [1, 4096] (max_generate_tokens)"),
    ({"max_tokens": 0}, "max_tokens: 0 is outside the allowed range [1, "),
    ({"temperature": -1}, "temperature: -1.0 is outside the allowed range [0, 100]"),
    ({"top_p": 0}, "top_p: 0.0 is outside the allowed range (0, 1]"),
    ({"greedy": "yes"}, "greedy: expected true or false"),
    ({"stop": [""]}, "stop[0]: expected a string of 1..256 characters"),
    ({"stop": ["x"] * 17}, "stop: 17 strings, allowed 0..16"),
    ({"target_model": ""}, "target_model: expected a model name, hub id or worker folder"),
    ({"beam": 4}, "beam: unknown"),  # a field by name, a generate option in a payload
])
def test_bad_generate_fields_fail_with_the_field_and_range(extra, message):
    with pytest.raises(JobSpecError) as info:
        build_spec(Settings(draft_model="m"), kind="generate", text="hi", **extra)
    assert message in str(info.value)
    # The worker rejects the same options read off the queue, with the same message: in a
    # version-3 payload, and in the extra of a version-2 one.
    rt, _ = runtime()
    own = {k: v for k, v in extra.items() if k != "target_model"}
    v3 = {"v": 3, "draft_model": "fake-draft", "text": "hi", "generate": own,
          "target_model": extra.get("target_model", "tiny-target")}
    v2 = {"v": 2, "draft_model": "fake-draft", "text": "hi", "kind": "generate",
          "extra": {"target_model": "tiny-target", **extra}}
    for n, payload in enumerate((v3, v2)):
        pub = ProgressPublisher(rt.connection, f"bad{n}", min_interval_s=0.0)
        with pytest.raises(JobSpecError):
            execute(payload, JobContext(f"bad{n}", rt, pub))
        assert message in events(rt, f"bad{n}")[-1].data["error"]


def test_max_generate_tokens_comes_from_settings_and_defaults_fill_the_spec():
    s = Settings(draft_model="m", target_model="t", max_generate_tokens=8)
    with pytest.raises(JobSpecError, match=r"\[1, 8\] \(max_generate_tokens\)"):
        build_spec(s, kind="generate", text="hi", max_tokens=9)
    spec = build_spec(s, kind="generate", text="hi")
    assert spec.generate.max_tokens == 8 and spec.target_model == "t"
    assert build_spec(Settings(), kind="generate", text="hi").target_model == "target"
    assert spec_from_payload(spec.to_payload(), s) == spec
    assert spec.job_id().startswith("generate-")
    assert build_spec(s, text="hi").generate is None and build_spec(s, text="hi").kind == "prefill"


def test_text_stream_holds_back_possible_stop_prefixes():
    class Chars:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    s = TextStream(Chars(), stop=["END"])
    out = []
    for ch in "abcEN":
        s.add(ord(ch))
        out.append(s.take()[1])
    assert "".join(out) == "abc"  # "EN" might begin "END"
    s.add(ord("X"))
    assert s.take() == (3, "ENX") and not s.stopped  # no tail of "abcENX" starts "END"
    for ch in "yE":
        s.add(ord(ch))
    assert s.take() == (6, "y")
    for ch in "ND!":
        s.add(ord(ch))
    assert s.stopped and s.text == "abcENXy" and s.take() == (7, "")
    s.finish()
    assert s.take() == (7, "")


def test_target_with_another_tokenizer_is_rejected():
    class Other(FakeTokenizer):
        def encode(self, text, add_special_tokens=True):
            return [3] + super().encode(text, add_special_tokens)

    check_shared_tokenizer(FakeTokenizer(), TargetTokenizer())
    with pytest.raises(JobSpecError, match="target_model: its tokenizer differs"):
        check_shared_tokenizer(FakeTokenizer(), Other())


def test_target_whose_vocabulary_gives_other_ids_is_rejected():
    class Vocab(FakeTokenizer):
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    base = {"a": 5, "b": 6, "<pad>": 7}
    check_shared_tokenizer(Vocab(base), Vocab({**base, "<extra>": 8}))  # extra tokens are fine
    with pytest.raises(JobSpecError, match=r"target_model: .*1 of 3 tokens have other ids .*\(e.g. 'b'\)"):
        check_shared_tokenizer(Vocab(base), Vocab({"a": 5, "b": 9, "<pad>": 7}))
    # an id both hold, meaning another token in each (reserved slot vs a new special token)
    with pytest.raises(JobSpecError, match=r"share an id with another token \(e.g. '<pad>'\)"):
        check_shared_tokenizer(Vocab(base), Vocab({"a": 5, "b": 6, "<tool_call>": 7}))


def test_shipped_draft_and_target_share_one_tokenizer():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    root = Path(__file__).resolve().parents[2] / "models"
    check_shared_tokenizer(load_tokenizer(root / "draft-tiny"), load_tokenizer(root / "target-tiny"))


def test_bad_target_fails_naming_it_before_the_draft_scores():
    rt, _ = runtime()
    rt.models._identify = identify_all_but("bad/target", "'bad/target' is neither a model folder nor a hub model")
    with pytest.raises(ValueError, match="^target_model: 'bad/target': .*is neither"):
        run(rt, **{"target_model": "bad/target"})
    kinds = [e.kind for e in events(rt)]
    assert kinds == ["loading_model", "failed"]  # nothing scored


def test_unsupported_target_is_named():
    """A target is verified by what sparse prefill needs (its own profiler), never by the draft's probe."""
    rt, _ = runtime()

    def check(model):
        raise ValueError("rope DynamicNTKScalingRoPE cannot be driven by original positions")

    rt.models._profile = lambda model: (_ for _ in ()).throw(AssertionError("draft probe run on the target"))
    rt.models._target_profile = check
    with pytest.raises(ValueError, match="^target_model: 'tiny-target': rope DynamicNTKScalingRoPE"):
        run(rt)


def test_target_with_sliding_windows_keeps_the_last_window():
    """gemma3's windowed layers (window 16 in the tiny model) see what a full prefill would:
    the last 16 prompt tokens are prefilled even when the selection drops some of them."""
    rt, targets = runtime()
    targets["tiny-target"] = make_model("gemma3_text", seed=4)
    res = run(rt, keep=0.25, tail_tokens=8, **{"max_tokens": 4, "greedy": True})
    assert res.kept < res.total and res.kept_ranges[-1][1] == res.total
    assert res.kept_ranges[-1][1] - res.kept_ranges[-1][0] >= 16
    assert sum(e - s for s, e in res.kept_ranges) == res.kept


def test_pool_evicts_before_it_loads():
    peak = []
    pool, _ = pool_with_target()
    inner = pool._loader

    def load(name):
        peak.append(len(pool.names()) + 1)  # the pool's models plus the one being loaded
        return inner(name)

    pool._loader = load
    for name in ("fake-draft", "target-a", "target-b", "fake-draft"):
        pool.get(name)
    assert max(peak) == pool.capacity == 2 and pool.names() == ["target-b", "fake-draft"]


def test_stream_text_fills_a_gap_from_the_result():
    from jobs.client import JobFailed, JobHandle, StreamDiverged
    from jobs.progress import ProgressEvent

    class Handle(JobHandle):
        def __init__(self, evs, status="finished"):
            self.id, self.evs, self._status = "h", evs, status

        def events(self, timeout=None, poll_s=1.0):
            return iter(self.evs)

        def status(self):
            return self._status

        def error(self):
            return "boom"

        def result(self, timeout=None):
            return GenerateResult(job_id="h", text="abcdefghij", finish_reason="length", token_ids=[],
                                  ttft_s=0.1, kept=1, total=1)

    def ev(seq, kind, **data):
        return ProgressEvent("h", seq, kind, data)

    # "def" was trimmed from the capped stream; "abc" arrives twice (replay after reconnect).
    evs = [ev(1, "text", offset=0, delta="abc"), ev(2, "text", offset=0, delta="abc"),
           ev(3, "text", offset=6, delta="ghi"), ev(4, "done")]
    assert "".join(Handle(evs).stream_text()) == "abcdefghij"
    with pytest.raises(JobFailed, match="boom"):
        list(Handle([ev(1, "text", offset=0, delta="a"), ev(2, "failed", error="x")], "failed").stream_text())
    # The failed event arrived before RQ marked the job failed: it is reported failed, not "started".
    with pytest.raises(JobFailed, match="failed: ValueError: target_model") as raised:
        list(Handle([ev(1, "failed", error="ValueError: target_model: nope")], "started").stream_text())
    assert raised.value.status == "failed"
    # A retry (the worker died mid-decode) generates again from offset 0: the same text is
    # not repeated, and the stream continues where it was.
    evs = [ev(1, "text", offset=0, delta="abcd"), ev(2, "retrying", error="worker died"),
           ev(3, "text", offset=0, delta="ab"), ev(4, "text", offset=2, delta="cdefghij"), ev(5, "done")]
    assert list(Handle(evs).stream_text()) == ["abcd", "efghij"]
    # ... and a retry that samples other text is reported, not spliced in.
    evs = [ev(1, "text", offset=0, delta="abcd"), ev(2, "retrying", error="worker died"),
           ev(3, "text", offset=0, delta="abXY"), ev(4, "done")]
    with pytest.raises(StreamDiverged, match="from character 2 on"):
        list(Handle(evs).stream_text())
