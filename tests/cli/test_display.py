"""The one progress renderer (watch, batch, demo): rich rows at the terminal's width, plain
lines elsewhere, and no hand-written line redraw anywhere else."""
from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from specprefill_cli.display import ProgressDisplay, Row

ROOT = Path(__file__).resolve().parents[2]
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LONG = "a-document-with-a-very-long-name-indeed.txt"


def rows(*pct):
    return [Row(f"doc-{i}", "scoring", p, 100, f"{300 + i} tok/s, eta 2.0s") for i, p in enumerate(pct)]


TOTAL = Row("overall", "", 1, 3, "done 1 failed 0 running 2 queued 0 | 5000 tok/s (812 tok/s now) eta 3s")


def live_display(width):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=width, color_system=None)
    return buf, ProgressDisplay(buf, live=True, console=console)


def last_frame(text, n_rows):
    """The lines of the last redraw (rich moves the cursor up over the previous frame)."""
    lines = [ESCAPE.sub("", part) for part in re.split(r"\r|\n", text)]
    return [line for line in lines if line.strip()][-n_rows:]


@pytest.mark.parametrize("width", [40, 72, 140])
def test_live_rows_fit_the_terminal_and_the_total_comes_last(width):
    buf, display = live_display(width)
    with display:
        display.show([Row(LONG, "scoring", 70, 100, "300 tok/s"), *rows(20)], TOTAL)
    frame = last_frame(buf.getvalue(), 3)
    assert all(len(line) <= width for line in frame), frame
    assert frame[-1].startswith("overall") and frame[1].startswith("doc-0")
    assert all("%" in line for line in frame)  # the percentage survives a narrow terminal
    if width >= 80:
        assert "70%" in frame[0] and "done 1 failed 0" in frame[2]


def test_live_rows_that_end_leave_and_lines_stay_above():
    buf, display = live_display(100)
    with display:
        display.show(rows(10, 20), TOTAL)
        display.line("  doc-0: kept 3/10")
        before = len(buf.getvalue())
        display.show(rows(10, 90)[1:], TOTAL)
        assert "doc-0 " not in ESCAPE.sub("", buf.getvalue()[before:])  # its row left
    text = ESCAPE.sub("", buf.getvalue())
    assert text.count("doc-0: kept 3/10") == 1  # printed once, above the rows
    frame = last_frame(buf.getvalue(), 2)
    assert frame[0].startswith("doc-1") and "90%" in frame[0] and frame[1].startswith("overall")


def test_plain_lines_when_not_a_terminal_and_only_on_change():
    out = io.StringIO()
    with ProgressDisplay(out) as display:  # StringIO is not a TTY
        assert not display.live
        display.show(rows(10, 20), TOTAL)
        display.show(rows(10, 20), TOTAL)  # nothing changed: nothing written
        display.line("  doc-0: kept 3/10")
        display.show([Row("job-1", "decode", 5, 8, "12.0 tok/s")])
    lines = out.getvalue().splitlines()
    assert lines == [
        "overall 33% (1/3), done 1 failed 0 running 2 queued 0 | 5000 tok/s (812 tok/s now) eta 3s"
        " | doc-0 scoring 10% (10/100), 300 tok/s, eta 2.0s | doc-1 scoring 20% (20/100), 301 tok/s, eta 2.0s",
        "  doc-0: kept 3/10",
        "job-1 decode 62% (5/8), 12.0 tok/s",
    ]
    assert "\x1b" not in out.getvalue()


def test_no_output_is_silent():
    with ProgressDisplay(None) as display:
        display.show(rows(10), TOTAL)
        display.line("nothing")
    assert not display.live


def test_the_line_redraw_escape_is_nowhere_else():
    pattern = re.compile(r"\\r\\033\[K|\\033\[K|\\x1b\[K|\\x1b\[2K|chr\(27\)")
    offenders = [str(p.relative_to(ROOT)) for package in ("specprefill_cli", "jobs", "worker")
                 for p in sorted((ROOT / package).rglob("*.py")) if pattern.search(p.read_text())]
    assert offenders == []


def test_running_rows_show_every_rate_event_of_running_jobs():
    from specprefill_cli.display import running_rows
    from jobs.progress import BatchProgress, ProgressEvent

    events = {
        "a": ProgressEvent("a", 3, "scoring", {"processed": 50, "total": 200, "tokens_per_s": 812.4, "eta_s": 1.25}),
        "b": ProgressEvent("b", 9, "decode", {"tokens": 4, "max_tokens": 16, "tokens_per_s": 20.0}),
        "c": ProgressEvent("c", 5, "target_prefill", {"processed": 10, "total": 40, "tokens_per_s": 99.0}),
        "d": ProgressEvent("d", 2, "cache_lookup", {"hit_tokens": 0, "total": 9}),
        "e": ProgressEvent("e", 7, "done", {"kept": 1, "total": 2}),
    }
    view = BatchProgress(total=5, running=4, done=1, last_events=events)
    rows = running_rows(view, {"a": "doc-a", "b": "doc-b"})
    assert [r.plain() for r in rows] == ["doc-a scoring 25% (50/200), eta 1.2s",
                                         "doc-b decode 25% (4/16)",
                                         "c target prefill 25% (10/40)"]
    assert [r.rate for r in rows] == [812.4, 20.0, 99.0]


def test_rates_are_smoothed_per_row():
    buf = io.StringIO()
    display = ProgressDisplay(buf, live=False)
    for rate in (1000.0, 0.0, 1000.0):  # a report between two completions reads 0
        display.show([Row("doc", "scoring", 1, 2, "", rate)])
    shown = [float(m) for m in re.findall(r"([\d.]+) tok/s", buf.getvalue())]
    assert shown[0] == 1000 and 0 < shown[1] < 1000 and shown[1] < shown[2] < 1000
