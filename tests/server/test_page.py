"""The web page in headless Chromium (Debian's ``chromium``, driven by Playwright without a
browser download): the job view highlights what was kept, the batch view moves while a
batch runs. Screenshots go to ``test-artifacts/http/``."""
from __future__ import annotations

import io
import json
import os
import shutil
import time

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


def test_job_view_highlights_kept_chunks(stack, page):
    client = OpenAI(base_url=stack.base, api_key=API_KEY, max_retries=0)
    text = words(700, seed=90)
    r = client.chat.completions.create(model=TARGET, messages=[
        {"role": "system", "content": words(40, seed=91)}, {"role": "user", "content": text}],
        max_tokens=4, extra_body={"keep": 0.2})
    job_id = r.model_extra["specprefill"]["job_id"]
    page.goto(f"{stack.server.url}/#/job/{job_id}")
    page.wait_for_selector("#job-curve svg.importance", timeout=60_000)  # the companion scoring ran
    kept = page.locator("#job-doc .seg.kept")
    assert kept.count() >= 2
    texts = kept.all_inner_texts()
    assert all(t.strip() and " ".join(t.split()) in " ".join((words(40, seed=91) + " " + text).split())
               for t in texts)
    assert page.locator("#job-doc .seg.dropped").count() >= 1
    assert page.locator("#job-doc .seg.kept.prefix").count() >= 1  # the system message
    assert page.locator("#job-doc .seg.kept.tail").count() == 1
    assert page.locator("#job-curve svg rect.kept").count() >= 2
    assert page.locator("#job-curve svg rect.tail").count() == 1
    shot(page, "job-view")


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
