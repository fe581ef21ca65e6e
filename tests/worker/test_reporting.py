"""The job reporter's decode events: the rate event keeps its interval while text leaves per token."""
from __future__ import annotations

from types import SimpleNamespace

import redis

from jobs.contract.keys import stream_key
from jobs.progress.events import parse_stream_events
from jobs.progress.publisher import ProgressPublisher
from worker.job.detokenize import TextStream
from worker.job.reporting import JobReporter


class Words:
    """A tokenizer whose id ``i`` reads `` w<i>``."""

    def decode(self, ids):
        return "".join(f" w{i}" for i in ids)


def test_decode_rate_events_keep_their_interval_while_every_token_sends_text(redis_url):
    clock = SimpleNamespace(now=0.0)
    conn = redis.Redis.from_url(redis_url)
    pub = ProgressPublisher(conn, "job-1", min_interval_s=0.25, clock=lambda: clock.now)
    reporter = JobReporter(SimpleNamespace(publisher=pub))
    reporter.begin_decode(TextStream(Words()), max_tokens=40)
    for token in range(40):  # one token per 0.1 s: a rate event about every third token
        reporter.token(token)
        clock.now += 0.1
    kinds = [e.kind for e in parse_stream_events(conn.xrange(stream_key("specprefill", "job-1")))]
    assert kinds.count("text") == 40
    # Before, each text send at a due moment took the interval's slot: no decode event until the end.
    assert kinds.count("decode") >= 10
