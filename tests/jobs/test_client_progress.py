"""Issue 16 finding 13: the Python client's batch view prints as one line, its tokens/s is
smoothed (no drop to 0 between one job's end and the next one's first report), and the
CLI's option names are accepted next to the Python ones. Real Redis, real worker process."""
from __future__ import annotations

from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.progress import batch_progress
from tests.support.fake_worker_process import client_for, start_worker  # noqa: F401


def test_batch_progress_prints_short_and_its_rate_does_not_flicker(redis_url, start_worker):
    start_worker(0.02)
    c = client_for(redis_url)
    batch = c.submit_many([{"tokens": list(range(2 + i, 250))} for i in range(8)])
    rates, raw_rates, lines = [], [], []
    for view in batch.events(poll_s=0.1, timeout=120):
        lines.append(str(view))
        if not view.complete:
            rates.append(view.tokens_per_s)
            raw_rates.append(batch_progress(c.connection, batch.job_ids).tokens_per_s)
    errors = [h.error() for h in batch.handles if h.status() == "failed"]
    assert view.done == 8, errors
    assert len(repr(view)) < 300 and "ProgressEvent" not in repr(view)
    assert lines[-1].startswith("8 jobs: 8 done, 0 running, 0 queued;") and len(lines[-1]) < 80
    started = next(i for i, r in enumerate(rates) if r > 0)
    assert all(r > 0 for r in rates[started:]), rates  # steady while the batch runs
    steady = rates[started + 3:]
    assert steady and max(steady) < 4 * min(steady), rates  # no flicker between 0 and the peak
    # the workers' own reports, summed, do drop to 0 between jobs: what the smoothing hides
    assert 0.0 in raw_rates[started:] or len(raw_rates) < 5


def test_cli_option_names_are_accepted_from_python(redis_url):
    c = client_for(redis_url)
    h = c.submit(tokens=[3, 4, 5], spans=True, model="other-draft", importance=True)
    payload = Job.fetch(h.id, connection=c.connection, serializer=JSONSerializer).args[0]
    assert payload["return_spans"] is True and payload["return_importance"] is True
    assert payload["draft_model"] == "other-draft"
    same = c.submit(tokens=[3, 4, 5], return_spans=True, draft_model="other-draft", return_importance=True)
    assert same.id == h.id  # the two spellings are one job
    import pytest

    from jobs.contract.spec import JobSpecError
    with pytest.raises(JobSpecError, match="spans: the CLI's name of return_spans"):
        c.submit(tokens=[3], spans=True, return_spans=False)


def test_cli_accepts_the_python_names_too(redis_url, tmp_path):
    """``--spans``/``--return-spans``, ``--model``/``--draft-model``: one job whichever
    spelling, the same one Python's ``spans=``/``return_spans=`` builds."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import redis

    from jobs.client import Client
    from jobs.settings import Settings

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPREFILL_") and k != "REDIS_URL"}
    base = [str(Path(sys.executable).with_name("specprefill")), "submit", "--redis-url", redis_url,
            "--tokens", "[3, 4, 5]", "--json"]

    def submit(*opts):
        out = subprocess.run(base + list(opts), capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first = submit("--spans", "--model", "other-draft", "--importance")
    again = submit("--return-spans", "--draft-model", "other-draft", "--return-importance")
    assert first["created"] and again["job_id"] == first["job_id"] and not again["created"]
    py = Client(redis.Redis.from_url(redis_url), Settings()).submit(
        tokens=[3, 4, 5], spans=True, model="other-draft", importance=True)
    assert py.id == first["job_id"]
