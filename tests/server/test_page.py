"""The web page in headless Chromium (Debian's ``chromium``, driven by Playwright without a
browser download): the job view highlights what was kept, the batch view moves while a
batch runs. Screenshots go to ``test-artifacts/http/``."""
from __future__ import annotations

import io
import json
import os
import shutil
import time
import urllib.request

import pytest
from openai import OpenAI

from tests.server.conftest import API_KEY, ARTIFACTS, TARGET, words

CHROMIUM = os.environ.get("SPECPREFILL_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"no chromium at {CHROMIUM} (apt-get install chromium)")]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1200, "height": 1400})
    ctx.add_init_script(f"localStorage.setItem('specprefill-api-key', {json.dumps(API_KEY)})")
    pg = ctx.new_page()
    yield pg
    ctx.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _jobs_known(stack) -> int:
    """Every job the queue holds, in any state (a companion job would add one)."""
    req = urllib.request.Request(f"{stack.server.url}/api/overview", headers={"Authorization": f"Bearer {API_KEY}"})
    data = json.loads(urllib.request.urlopen(req, timeout=30).read())
    return sum(q["queued"] + q["started"] + q["finished"] + q["failed"] for q in data["queues"])


def test_job_view_shows_what_the_job_kept_without_running_the_model(stack, page):
    """A second job on the same system prompt restores it: the page shows the restored band, the
    kept text and the curve from the job's own result, queues nothing, and its "from the block
    store" figure is the restored band's length."""
    client = OpenAI(base_url=stack.base, api_key=API_KEY, max_retries=0)
    system, text = words(300, seed=91), words(700, seed=90)
    ask = lambda doc: client.chat.completions.create(model=TARGET, max_tokens=4, extra_body={"keep": 0.2, "follow_chunks": 2}, messages=[  # noqa: E731
        {"role": "system", "content": system}, {"role": "user", "content": doc}])
    ask(words(700, seed=92))  # stores the system prefix
    r = ask(text)
    info = r.model_extra["specprefill"]
    job_id, restored = info["job_id"], info["target_tokens_restored"]
    assert restored >= 256
    before = _jobs_known(stack)
    page.goto(f"{stack.server.url}/#/job/{job_id}")
    page.wait_for_selector("#job-curve svg.importance", timeout=20_000)
    assert _jobs_known(stack) == before  # the page ran nothing
    band = page.locator("#job-strip .restored")
    assert band.count() == 1 and band.get_attribute("data-start") == "0"
    assert int(band.get_attribute("data-end")) == restored
    assert page.locator("#restored-tokens").get_attribute("data-tokens") == str(restored)
    kept = page.locator("#job-doc .seg.kept")
    assert kept.count() >= 2
    whole = " ".join((system + " " + text).split())
    assert all(t.strip() and " ".join(t.split()) in whole for t in kept.all_inner_texts())
    assert page.locator("#job-doc .seg.dropped").count() >= 1
    assert page.locator("#job-doc .seg.kept.restored").count() == 1  # the system message
    assert page.locator("#job-doc .seg.kept.tail").count() == 1
    assert page.locator("#job-curve svg rect.kept").count() >= 1
    assert page.locator("#job-curve svg rect.restored").count() == 1
    assert page.locator("#job-curve svg rect.tail").count() == 1
    assert page.locator(".note").count() == 0  # nothing contradicts the result
    shot(page, "job-view")


def test_recent_jobs_list_names_each_job_newest_first(stack, page):
    client = OpenAI(base_url=stack.base, api_key=API_KEY, max_retries=0)
    firsts = []
    for seed in (180, 181):  # seeds no other test uses: labels are a text's first words
        text = words(400, seed=seed)
        firsts.append(" ".join(text.split()[:8]))
        client.chat.completions.create(model=TARGET, max_tokens=2, messages=[{"role": "user", "content": text}])
    page.goto(stack.server.url + "/")
    page.wait_for_selector(f"td.label:text-is('{firsts[-1]} …')")
    rows = page.locator("tr[data-job]")
    labels = rows.locator("td.label").all_inner_texts()  # other tests' jobs may end in between
    assert labels.index(f"{firsts[1]} …") < labels.index(f"{firsts[0]} …")  # newest first
    first = rows.filter(has_text=firsts[1]).first  # the newest chat job's row
    assert first.locator("td.share").inner_text().endswith("%")
    assert first.locator("td.ttft").inner_text().endswith(" ms")
    assert first.locator("td.ended").inner_text()
    shot(page, "recent-jobs")


def test_batch_view_updates_while_running(stack, page):
    client = OpenAI(base_url=stack.base, api_key=API_KEY, max_retries=0)
    lines = [json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": TARGET, "max_tokens": 16,
                                  "messages": [{"role": "user", "content": words(900, seed=100 + i)}]}})
             for i in range(6)]
    f = client.files.create(file=("page.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    page.goto(f"{stack.server.url}/#/batch/{b.id}")
    page.wait_for_selector("#batch-progress")
    seen, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        # Both attributes in one read inside the page: it re-renders the bar between two reads.
        read = page.evaluate("() => { const e = document.querySelector('#batch-progress');"
                             " return e && [e.dataset.done, e.dataset.status]; }")
        if read is None:  # between two renders
            page.wait_for_timeout(50)
            continue
        state = (int(read[0]), read[1])
        if not seen or seen[-1] != state:
            seen.append(state)
            if len(seen) == 2:
                shot(page, "batch-view-running")
        if state[1] == "completed":
            break
        page.wait_for_timeout(100)
    assert seen[-1] == (6, "completed"), seen
    assert len({done for done, _ in seen}) >= 3, seen  # the page moved while the batch ran
    assert page.locator("tr[data-status=finished]").count() == 6
    assert page.locator("a.file-link").count() == 1  # the output file (no errors)
    shot(page, "batch-view-done")


def test_overview_lists_the_worker(stack, page):
    page.goto(stack.server.url + "/")
    page.wait_for_selector(f"text={stack.worker.name}")
    assert page.locator("#live.on").count() == 1  # following the live stream
    shot(page, "overview")


def test_job_view_shows_target_tokens_and_the_heal(stack, page):
    """A generate job's page says how its target tokens came (restored / healed / full / sparse)
    and what became of its heal (and the options it ran with, follow_chunks among them); a heal
    job's page says what it heals, for which job."""
    import redis as redis_py

    from jobs.client import Client
    from jobs.contract.heal import HealSpec
    from jobs.settings import Settings

    client = OpenAI(base_url=stack.base, api_key=API_KEY, max_retries=0)
    r = client.chat.completions.create(model=TARGET, max_tokens=4, extra_body={"keep": 0.2, "follow_chunks": 2}, messages=[
        {"role": "system", "content": words(300, seed=81)}, {"role": "user", "content": words(700, seed=82)}])
    info = r.model_extra["specprefill"]
    t = {k: info[f"target_tokens_{k}"] for k in ("restored", "healed", "prefilled_full", "prefilled_sparse")}
    assert t["prefilled_sparse"] > 0 and info["heal"]["reason"].startswith("heal is off")  # the stack's worker
    page.goto(f"{stack.server.url}/#/job/{info['job_id']}")
    shown = page.wait_for_selector("#target-tokens", timeout=20_000)
    assert [shown.get_attribute(f"data-{k}") for k in ("restored", "healed", "full", "sparse")] == [
        str(t.get(k, 0)) for k in ("restored", "healed", "prefilled_full", "prefilled_sparse")]
    assert page.locator("#heal-state").inner_text() == info["heal"]["reason"]
    assert "keep 0.2, chunk 32, follow 2," in page.locator("#job-options").inner_text()  # the option it ran with
    settings = Settings(redis_url=stack.redis_url)
    heal = HealSpec(TARGET, tuple(range(5, 300)), source_job=info["job_id"])
    handle = Client(redis_py.Redis.from_url(stack.redis_url), settings,
                    queue_name=settings.heal_queues[0]).submit(heal, name=f"after {info['job_id']}")
    try:
        page.goto(f"{stack.server.url}/#/job/{handle.id}")
        heals = page.wait_for_selector("#heal-tokens", timeout=20_000)  # queued: nobody heals on this stack
        assert heals.get_attribute("data-tokens") == "295" and "295 tokens of" in heals.inner_text()
        assert page.locator("#heal-tokens a").get_attribute("href") == f"#/job/{info['job_id']}"
        shot(page, "heal-job-view")
    finally:
        handle.cancel(force=True)
