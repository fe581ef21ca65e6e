"""Progress events: publisher (fakeredis), subscriber replay/reconnect (real Redis), batch view."""
import threading
import time

import fakeredis
import pytest
import redis

from jobs.contract.keys import channel_name, stream_key
from jobs.progress import (BatchProgress, ProgressEvent, ProgressPublisher, ProgressTimeout,
                           batch_progress, iter_events, parse_stream_events)


def test_publisher_numbers_caps_and_expires():
    r = fakeredis.FakeRedis()
    pub = ProgressPublisher(r, "j1", namespace="t", maxlen=5, ttl_s=100)
    for i in range(20):
        pub.publish("lookahead", step=i)
    pub.publish("done", elapsed_s=1.0)
    assert pub.publish("failed", error="late") is None  # exactly one terminal
    entries = r.xrange(stream_key("t", "j1"))
    events = parse_stream_events(entries)
    assert len(events) <= 21 and events[-1].kind == "done" and events[-1].seq == 21
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert 0 < r.ttl(stream_key("t", "j1")) <= 100


def test_resume_continues_sequence():
    r = fakeredis.FakeRedis()
    ProgressPublisher(r, "j", namespace="t").publish("queued")
    pub = ProgressPublisher.resume(r, "j", namespace="t")
    assert pub.publish("loading_model", model="m").seq == 2


def test_rate_events_are_throttled_but_the_last_always_goes_out():
    r = fakeredis.FakeRedis()
    now = [0.0]
    pub = ProgressPublisher(r, "j", namespace="t", min_interval_s=1.0, clock=lambda: now[0])
    sent = []
    for i in range(1, 101):
        now[0] = i * 0.05  # 20 chunks per second
        sent.append(pub.progress("scoring", i * 10, 1000, tokens_per_s=200.0, eta_s=1.0))
    assert sent[-1] is True
    assert 5 <= sum(sent) <= 7


def test_unknown_kind_rejected():
    with pytest.raises(ValueError, match="kind"):
        ProgressPublisher(fakeredis.FakeRedis(), "j").publish("exploded")


def test_publish_faults_are_counted_not_raised():
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    r = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2,  # nothing listens
                    retry=Retry(NoBackoff(), 0))
    pub = ProgressPublisher(r, "j")
    assert pub.publish("queued") is None and pub.dropped == 1


def test_batch_progress_counts_and_rates():
    r = fakeredis.FakeRedis()
    ids = ["a", "b", "c", "d"]
    for jid, status in zip(ids, ["finished", "started", "queued", "failed"]):
        r.hset(f"rq:job:{jid}", "status", status)
    ProgressPublisher(r, "a").publish("done", elapsed_s=2.0)
    ProgressPublisher(r, "b").publish("scoring", processed=5, total=10, tokens_per_s=300.0, eta_s=1.5)
    view = batch_progress(r, ids + ["zz"])
    assert (view.done, view.running, view.queued, view.failed, view.missing) == (1, 1, 1, 1, 1)
    assert view.tokens_per_s == 300.0 and view.eta_s == pytest.approx(2.0 + 1.5)
    assert not view.complete
    assert BatchProgress(total=2, done=1, failed=1).complete


def test_batch_rates_show_throughput_and_the_live_rate_only_when_reported():
    assert BatchProgress(total=3).rates_text(5000, 2.0) == "2500 tok/s"
    assert BatchProgress(total=3, tokens_per_s=812.4).rates_text(5000, 2.0) == "2500 tok/s (812 tok/s now)"
    assert BatchProgress(total=3).rates_text(0, 0.0) == "0 tok/s"


# ---- real Redis: pub/sub + stream ----

def _publish_slowly(url, job_id, n, delay):
    pub = ProgressPublisher(redis.Redis.from_url(url), job_id)
    for i in range(n):
        pub.publish("lookahead", step=i)
        time.sleep(delay)
    pub.publish("done", elapsed_s=n * delay)


def test_late_subscriber_sees_every_event_in_order(redis_url):
    r = redis.Redis.from_url(redis_url)
    t = threading.Thread(target=_publish_slowly, args=(redis_url, "late", 10, 0.02))
    t.start()
    time.sleep(0.1)  # attach mid-job: pub/sub alone would miss the first events
    events = list(iter_events(r, "late", timeout=10))
    t.join()
    assert [e.seq for e in events] == list(range(1, 12))
    assert events[-1].kind == "done" and sum(e.terminal for e in events) == 1


def test_subscriber_after_job_end_replays_and_ends(redis_url):
    r = redis.Redis.from_url(redis_url)
    _publish_slowly(redis_url, "old", 3, 0)
    events = list(iter_events(r, "old", timeout=5))
    assert [e.kind for e in events] == ["lookahead"] * 3 + ["done"]


def test_after_seq_skips_seen_events(redis_url):
    r = redis.Redis.from_url(redis_url)
    _publish_slowly(redis_url, "j", 3, 0)
    assert [e.seq for e in iter_events(r, "j", after_seq=2, timeout=5)] == [3, 4]


def test_subscriber_survives_connection_kill(redis_url):
    r = redis.Redis.from_url(redis_url)
    admin = redis.Redis.from_url(redis_url)
    got = []

    def watch():
        got.extend(iter_events(r, "rc", timeout=15, poll_s=0.2))

    w = threading.Thread(target=watch)
    w.start()
    pub = ProgressPublisher(admin, "rc")
    for i in range(5):
        pub.publish("lookahead", step=i)
    time.sleep(0.3)
    admin.client_kill_filter(_type="pubsub")  # drop the watcher's subscription
    for i in range(5, 10):
        pub.publish("lookahead", step=i)
    time.sleep(0.3)
    pub.publish("done")
    w.join(15)
    assert [e.seq for e in got] == list(range(1, 12))


def test_gap_on_channel_is_filled_from_stream(redis_url):
    r = redis.Redis.from_url(redis_url)
    got = []
    w = threading.Thread(target=lambda: got.extend(iter_events(r, "gap", timeout=10, poll_s=5)))
    w.start()
    time.sleep(0.2)
    # Event 1 only in the stream (as if its PUBLISH was lost), then 2 on both.
    r.xadd(stream_key("specprefill", "gap"), {"e": ProgressEvent("gap", 1, "queued").to_json()})
    ProgressPublisher(r, "gap", start_seq=1).publish("done")
    w.join(10)
    assert [e.seq for e in got] == [1, 2]


def test_timeout_and_idle_check(redis_url):
    r = redis.Redis.from_url(redis_url)
    with pytest.raises(ProgressTimeout):
        list(iter_events(r, "never", timeout=0.3, poll_s=0.1))
    synth = ProgressEvent("gone", 0, "failed", {"error": "expired"})
    assert list(iter_events(r, "gone", timeout=5, poll_s=0.1, idle_check=lambda s: synth)) == [synth]


def test_channel_and_stream_names_are_per_job():
    assert channel_name("ns", "a") != channel_name("ns", "b")
    assert stream_key("ns", "a").startswith("ns:")


def test_events_are_batched_between_flushes_and_terminal_flushes_all():
    r = fakeredis.FakeRedis()
    now = [0.0]
    pub = ProgressPublisher(r, "b", namespace="t", min_interval_s=1.0, clock=lambda: now[0])
    pub.publish("loading_model")  # first event: sent at once
    assert len(r.xrange(stream_key("t", "b"))) == 1
    pub.publish("cache_lookup", hit_tokens=0)
    pub.publish("lookahead")
    assert len(r.xrange(stream_key("t", "b"))) == 1  # held for the next send
    now[0] = 1.5
    pub.publish("importance")  # interval passed: everything pending goes in one trip
    assert len(r.xrange(stream_key("t", "b"))) == 4
    pub.publish("selection", kept=1, total=2)
    pub.publish("done")
    events = parse_stream_events(r.xrange(stream_key("t", "b")))
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6] and events[-1].kind == "done"


def test_publisher_for_takes_the_stream_settings_and_continues_the_sequence():
    from jobs.progress import publisher_for
    from jobs.settings import Settings

    r = fakeredis.FakeRedis()
    s = Settings(namespace="ns1", progress_stream_maxlen=7, progress_ttl_s=50, progress_interval_s=3.0)
    pub = publisher_for(r, "j", s)
    assert (pub.namespace, pub.maxlen, pub.ttl_s, pub.throttle.interval_s) == ("ns1", 7, 50, 3.0)
    pub.publish("queued")
    later = publisher_for(r, "j", s)  # reads nothing: its first event is sent at once, numbered by Redis
    assert later.seq == 0 and later.publish("loading_model").seq == 2 and later.seq == 2
    assert 0 < r.ttl(stream_key("ns1", "j")) <= 50


def test_two_attempts_publishing_at_once_never_share_a_number():
    """A retried job's new attempt and an old copy still running both append: Redis numbers
    their events in one sequence, and a watcher skips the superseded attempt's late events."""
    r = fakeredis.FakeRedis()
    old = ProgressPublisher(r, "dup", namespace="t", min_interval_s=0.0, attempt="a1")
    old.publish("loading_model")
    old.publish("scoring", processed=1, total=4)
    new = ProgressPublisher(r, "dup", namespace="t", min_interval_s=0.0, attempt="a2")  # start_seq 0
    new.publish("loading_model")
    old.publish("scoring", processed=2, total=4)  # the old copy has not noticed yet
    new.publish("done")
    events = parse_stream_events(r.xrange(stream_key("t", "dup")))
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert [(e.attempt, e.kind) for e in events] == [("a1", "loading_model"), ("a1", "scoring"),
                                                     ("a2", "loading_model"), ("a1", "scoring"),
                                                     ("a2", "done")]
    assert new.seq == 5 and old.seq == 4


def test_a_fenced_publisher_sends_nothing_once_its_member_is_gone():
    r = fakeredis.FakeRedis()
    r.zadd("wip", {"job:exec1": 100})
    pub = ProgressPublisher(r, "f", namespace="t", min_interval_s=0.0, fence=("wip", "job:exec1"))
    assert pub.publish("loading_model").seq == 1
    r.zrem("wip", "job:exec1")  # the claim was taken (RQ's sweep) or lost with Redis's data
    assert pub.publish("scoring", processed=1, total=2) is None
    assert pub.fenced and pub.finished and pub.publish("done") is None
    assert [e.kind for e in parse_stream_events(r.xrange(stream_key("t", "f")))] == ["loading_model"]


def test_watcher_skips_a_superseded_attempt_and_follows_a_recreated_stream(redis_url):
    r = redis.Redis.from_url(redis_url)
    a1 = ProgressPublisher(r, "sup", min_interval_s=0.0, attempt="a1")
    a2 = ProgressPublisher(r, "sup", min_interval_s=0.0, attempt="a2")
    ProgressPublisher(r, "sup", min_interval_s=0.0).publish("queued")
    a1.publish("loading_model")
    a2.publish("loading_model")
    a1.publish("scoring", processed=1, total=2)  # late, from the copy that lost its claim
    a2.publish("done")
    got = list(iter_events(r, "sup", timeout=5))
    assert [(e.seq, e.attempt, e.kind) for e in got] == [
        (1, "", "queued"), (2, "a1", "loading_model"), (3, "a2", "loading_model"), (5, "a2", "done")]
    # Redis lost the stream and the job was resubmitted: numbering starts over, after what was read.
    r.delete(stream_key("specprefill", "sup2"))
    first = ProgressPublisher(r, "sup2", min_interval_s=0.0, attempt="b1")
    first.publish("loading_model")
    seen = []
    w = threading.Thread(target=lambda: seen.extend(iter_events(r, "sup2", timeout=10, poll_s=0.2)))
    w.start()
    wait = time.monotonic() + 5
    while not seen and time.monotonic() < wait:
        time.sleep(0.02)
    r.delete(stream_key("specprefill", "sup2"))
    again = ProgressPublisher(r, "sup2", min_interval_s=0.0, attempt="b2")
    again.publish("loading_model")
    again.publish("done")
    w.join(10)
    assert [(e.seq, e.attempt, e.kind) for e in seen] == [
        (1, "b1", "loading_model"), (1, "b2", "loading_model"), (2, "b2", "done")]


def _count_pipelines(r):
    """``r`` whose pipelines are counted (each one a round trip when executed)."""
    sent = []
    genuine = r.pipeline

    def pipeline(*args, **kwargs):
        pipe = genuine(*args, **kwargs)
        execute = pipe.execute

        def counted(*a, **k):
            sent.append(len(pipe.command_stack))
            return execute(*a, **k)
        pipe.execute = counted
        return pipe
    r.pipeline = pipeline
    return sent


def test_a_send_batch_sends_every_jobs_token_of_a_step_in_one_round_trip():
    """Eight jobs' text published while a decode step holds: nothing leaves until the step ends,
    then one pipeline carries all eight, each job's events in its own order and numbering."""
    from jobs.progress import SendBatch

    r = fakeredis.FakeRedis()
    batch = SendBatch(r)
    pubs = [ProgressPublisher(r, f"j{i}", namespace="t", min_interval_s=60.0) for i in range(8)]
    for pub in pubs:
        pub.batch = batch
        pub.publish("loading_model")  # the first event of each: at once (outside a step)
    sent = _count_pipelines(r)
    for step in range(3):
        with batch.holding():
            for i, pub in enumerate(pubs):
                pub.publish("text", offset=step, delta=f"{i}-{step} ")
            assert all(len(r.xrange(stream_key("t", f"j{i}"))) == 1 + step for i in range(8))  # held
    assert len(sent) == 3 and sent == [8, 8, 8]  # one round trip per step, every job in it
    assert batch.round_trips == 3 and batch.held_sends == 24
    for i, pub in enumerate(pubs):
        events = parse_stream_events(r.xrange(stream_key("t", f"j{i}")))
        assert [e.seq for e in events] == [1, 2, 3, 4] and pub.seq == 4
        assert "".join(e.data["delta"] for e in events[1:]) == f"{i}-0 {i}-1 {i}-2 "


def test_a_send_batch_keeps_terminal_events_immediate_and_due_sends_mirrored():
    from jobs.progress import SendBatch

    r = fakeredis.FakeRedis()
    batch = SendBatch(r)
    mirrored = []
    a = ProgressPublisher(r, "a", namespace="t", min_interval_s=0.0)  # every send due
    a.on_flush = lambda pipe, events: (mirrored.append(events[-1].kind), pipe.set("meta-a", events[-1].kind))
    b = ProgressPublisher(r, "b", namespace="t", min_interval_s=60.0)
    a.batch = b.batch = batch
    b.publish("loading_model")
    with batch.holding():
        a.publish("decode", tokens=1, max_tokens=4)  # due: held, then sent as its interval's send
        b.publish("text", offset=0, delta="x")
        b.publish("done")  # terminal: at once, with the text it held before it
        assert [e.kind for e in parse_stream_events(r.xrange(stream_key("t", "b")))] == ["loading_model", "text",
                                                                                          "done"]
        assert not r.xrange(stream_key("t", "a")) and not mirrored
    assert [e.kind for e in parse_stream_events(r.xrange(stream_key("t", "a")))] == ["decode"]
    assert mirrored == ["decode"] and r.get("meta-a") == b"decode"
    a.publish("decode", tokens=2, max_tokens=4)  # outside a step: at once, as without a batch
    assert len(r.xrange(stream_key("t", "a"))) == 2


@pytest.mark.parametrize("background", [False, True])
def test_a_send_batch_refuses_a_fenced_publisher_alone(background):
    """Synchronous, or settled in the batch's thread (``background``): the fenced one closes alone."""
    from jobs.progress import SendBatch

    r = fakeredis.FakeRedis()
    r.zadd("wip", {"job:ok": 1})
    batch = SendBatch(r, background=background)
    ok = ProgressPublisher(r, "ok", namespace="t", min_interval_s=60.0, fence=("wip", "job:ok"))
    gone = ProgressPublisher(r, "gone", namespace="t", min_interval_s=60.0, fence=("wip", "job:gone"))
    ok.batch = gone.batch = batch
    with batch.holding():
        ok.publish("text", offset=0, delta="a")
        gone.publish("text", offset=0, delta="b")
    assert batch.drain(10)
    assert [e.data["delta"] for e in parse_stream_events(r.xrange(stream_key("t", "ok")))] == ["a"]
    assert not r.xrange(stream_key("t", "gone")) and gone.fenced and gone.finished and not ok.fenced
    assert gone.publish("done") is None  # closed: nothing more leaves


def test_a_background_send_batch_does_not_hold_the_step_and_keeps_each_jobs_order():
    """With ``background`` the step ends before Redis answers (its sends are made by the batch's
    thread); a job's terminal event, sent by the job itself, waits for its sends in the thread,
    so every stream keeps the job's order and numbering."""
    import threading

    from jobs.progress import SendBatch

    r = fakeredis.FakeRedis()
    batch = SendBatch(r, background=True)
    order, release = [], threading.Event()
    genuine = batch._execute

    def slow(sends):
        release.wait(10)
        order.append("sent")
        return genuine(sends)
    batch._execute = slow
    pubs = [ProgressPublisher(r, f"j{i}", namespace="t", min_interval_s=60.0) for i in range(4)]
    for pub in pubs:
        pub.batch = batch
    for step in range(3):
        with batch.holding():
            for i, pub in enumerate(pubs):
                pub.publish("text", offset=step, delta=f"{i}-{step} ")
        order.append(f"step {step} ended")
    assert order == ["step 0 ended", "step 1 ended", "step 2 ended"]  # none waited for Redis
    assert not any(r.xrange(stream_key("t", f"j{i}")) for i in range(4))
    threading.Timer(0.2, release.set).start()
    pubs[0].publish("done")  # waits for its three sends, then goes after them
    assert order[:4] == ["step 0 ended", "step 1 ended", "step 2 ended", "sent"]
    assert batch.drain(10) and batch.round_trips == 3 and batch.held_sends == 12
    for i, pub in enumerate(pubs):
        events = parse_stream_events(r.xrange(stream_key("t", f"j{i}")))
        assert [e.seq for e in events] == list(range(1, len(events) + 1)) and pub.seq == events[-1].seq
        assert "".join(e.data["delta"] for e in events if e.kind == "text") == f"{i}-0 {i}-1 {i}-2 "
    assert [e.kind for e in parse_stream_events(r.xrange(stream_key("t", "j0")))][-1] == "done"
