"""The one progress renderer of ``watch``, ``batch`` and the demo.

On a terminal it is one rich live display: a row per running job or document (a bar, its
phase and rate) plus a total row, redrawn in place at the terminal's width, with finished
items and other events printed as lines above it. Anywhere else (a pipe, a log file) it
writes plain lines: each event, and the rows whenever they change. :func:`event_row` and
:func:`describe` say what each progress event shows, for every command alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, TextIO

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from specprefill_cli.outcome import is_bad_input, split_error
from jobs.progress import BatchProgress, ProgressEvent

NAME_WIDTH = 28
BAR_WIDTH = 24
WIDE = 80  # narrower terminals get a shorter name and bar
PLAIN_ROWS = 4  # running rows a plain line names besides the total
SMOOTHING = 0.3  # weight of the newest rate in a row's moving average


@dataclass(frozen=True)
class Row:
    """One live row: ``done`` of ``total`` in ``phase`` (e.g. scoring), with a short note."""

    name: str
    phase: str
    done: float
    total: float
    note: str = ""
    rate: float | None = None  # tokens/s as reported; the display shows it smoothed

    @property
    def percent(self) -> float:
        return 100.0 * min(1.0, self.done / self.total) if self.total > 0 else 0.0

    def plain(self) -> str:
        head = " ".join(part for part in (self.name, self.phase) if part)
        text = f"{head} {self.percent:.0f}% ({int(self.done)}/{int(self.total)})"
        return f"{text}, {self.note}" if self.note else text


# ---- what the commands show of progress events ----

def event_row(ev: ProgressEvent, name: str) -> Row | None:
    """The live row of a rate event (scoring, target prefill, decode), else None."""
    d = ev.data
    rate = d.get("tokens_per_s")
    rate = float(rate) if isinstance(rate, (int, float)) else None
    if ev.kind == "scoring":
        eta = f"eta {human_seconds(d['eta_s'])}" if d.get("eta_s") is not None else ""
        return Row(name, "scoring", d["processed"], d["total"], eta, rate)
    if ev.kind == "target_prefill":
        return Row(name, "target prefill", d["processed"], d["total"], "", rate)
    if ev.kind == "decode":
        return Row(name, "decode", d["tokens"], d["max_tokens"], "", rate)
    return None


def human_seconds(s: float) -> str:
    s = float(s)
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f}s" if s < 120 else f"{s / 60:.1f} min"


def human(key: str, v: object) -> str:
    """A value as a person reads it: 20.0% not 0.20039980009995004, 1.2s, yes/no."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if key.endswith("_per_s") and isinstance(v, (int, float)):  # a rate, not a duration
        unit = " tok/s" if key == "tokens_per_s" else "/s"
        return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    if isinstance(v, float):
        if key == "ratio" or key.endswith("_share"):
            return f"{100 * v:.1f}%"
        if key.endswith("_s"):
            return human_seconds(v)
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return f"{len(v)} items"
    text = str(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _label(key: str) -> str:
    if key == "tokens_per_s":  # "rate 1880 tok/s"
        return "rate"
    if key.endswith("_per_s"):  # "blocks_per_s": "blocks 12/s"
        return key[:-len("_per_s")].replace("_", " ")
    return (key[:-2] if key.endswith("_s") else key).replace("_", " ")


def _pairs(d: Mapping[str, object], skip: tuple[str, ...] = ()) -> str:
    return ", ".join(f"{_label(k)} {human(k, v)}" for k, v in d.items()
                     if v is not None and k not in skip)


def describe(ev: ProgressEvent) -> str:
    """One line for an event that is not a rate event (no raw Python values, no None)."""
    d = ev.data
    if ev.kind == "cache_lookup":
        return f"cache lookup: {d.get('hit_tokens', 0)}/{d.get('total', '?')} tokens cached" + \
               (" (selection memo)" if d.get("memo") else "")
    if ev.kind == "selection":
        return f"selection: kept {d['kept']}/{d['total']} tokens"
    if ev.kind == "text":
        return f"text: {d.get('delta', '')!r}"
    if ev.kind in ("failed", "retrying"):
        left = f" ({d['retries_left']} retries left)" if d.get("retries_left") else ""
        error = str(d.get("error", ""))
        return f"{ev.kind}: {split_error(error)[1] if is_bad_input(error) else error}{left}"
    if ev.kind == "loading_model":
        return f"loading model {d.get('model', '?')}" + (f" as {d['role']}" if d.get("role") else "")
    if ev.kind == "done" and "kept" in d and "total" in d:
        share = d.get("ratio", d["kept"] / max(1, d["total"]))  # of the tokens not restored
        parts = [f"kept {d['kept']}/{d['total']} tokens ({human('ratio', share)})"]
        if d.get("restored_ratio"):
            parts.append(f"restored {human('ratio', d['restored_ratio'])} of the prompt")
        if d.get("keep_effect") or d.get("reason"):
            parts.append(str(d.get("keep_effect") or d["reason"]))
        parts.append(_pairs(d, skip=("kept", "total", "ratio", "restored_ratio", "reason", "keep_effect")))
        return "done: " + ", ".join(p for p in parts if p)
    extra = _pairs(d)
    return ev.kind.replace("_", " ") + (f": {extra}" if extra else "")


def total_row(name: str, view: BatchProgress, finished_tokens: int, elapsed_s: float) -> Row:
    """The total row of a batch: the prompt tokens finished jobs got through by running
    (memo hits excluded: :func:`jobs.client.rate.worked_tokens`) per wall second (cumulative, so
    it does not flicker between completions), the counts and the ETA."""
    eta = f", eta {human_seconds(view.eta_s)}" if view.eta_s else ""
    overall = finished_tokens / max(elapsed_s, 1e-9)
    return Row(name, "", view.finished, view.total,
               f"{overall:.0f} tok/s, done {view.done} failed {view.failed} running {view.running} "
               f"queued {view.queued}{eta}")


def running_rows(view: BatchProgress, names: Mapping[str, str]) -> list[Row]:
    """A row per running job of a batch (named by ``names[job_id]``) that reported progress."""
    rows = []
    for job_id, ev in view.last_events.items():
        row = None if ev.terminal else event_row(ev, names.get(job_id, job_id))
        if row is not None:
            rows.append(row)
    return rows


# ---- the renderer ----

class ProgressDisplay:
    """Rows redrawn in place (rich) on a terminal, plain lines elsewhere; silent without ``out``.

    ``live`` forces the mode (default: ``out.isatty()``); ``console`` replaces the one made
    for ``out`` (tests give a fixed width).
    """

    def __init__(self, out: TextIO | None, *, live: bool | None = None,
                 console: Console | None = None) -> None:
        self.out = out
        self._last_plain = ""
        self._rates: dict[tuple[str, str], float] = {}
        self._live: Live | None = None
        if out is not None and (out.isatty() if live is None else live):
            self._live = Live(console=console or Console(file=out), auto_refresh=False,
                              redirect_stdout=False, redirect_stderr=False)  # other output keeps its stream
            self._live.start()

    @property
    def live(self) -> bool:
        return self._live is not None

    def __enter__(self) -> "ProgressDisplay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self, text: str) -> None:
        """A line that stays (an event, a finished document)."""
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False, soft_wrap=True)
            self._live.refresh()
        elif self.out is not None:
            print(text, file=self.out, flush=True)

    def show(self, rows: Sequence[Row], total: Row | None = None) -> None:
        """The live rows now: the running ones, then the total."""
        rows = [self._smoothed(r) for r in rows]
        total = self._smoothed(total) if total is not None else None
        if self._live is not None:
            table = _table([*rows, *([total] if total is not None else [])], self._live.console.width)
            self._live.update(table, refresh=True)
        elif self.out is not None:
            self._show_plain(rows, total)

    def _smoothed(self, row: Row) -> Row:
        """The row with its rate as a moving average (a new phase starts afresh) in its note."""
        if row.rate is None:
            return row
        key = (row.name, row.phase)
        old = self._rates.get(key)
        rate = row.rate if old is None else SMOOTHING * row.rate + (1 - SMOOTHING) * old
        self._rates[key] = rate
        text = f"{rate:.1f} tok/s" if rate < 10 else f"{rate:.0f} tok/s"
        return Row(row.name, row.phase, row.done, row.total, ", ".join(p for p in (text, row.note) if p))

    def _show_plain(self, rows: Sequence[Row], total: Row | None) -> None:
        parts = [total.plain()] if total is not None else []
        parts += [r.plain() for r in rows[:PLAIN_ROWS]]
        text = " | ".join(parts)
        if text and text != self._last_plain:
            print(text, file=self.out, flush=True)
        self._last_plain = text

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def _table(rows: Sequence[Row], width: int) -> Table:
    """One line per row at the console's ``width``: name, phase, bar, percent, note (cut to fit)."""
    narrow = width < WIDE
    table = Table.grid(padding=(0, 1), expand=True)
    table.add_column(no_wrap=True, overflow="ellipsis", max_width=NAME_WIDTH // (2 if narrow else 1))
    table.add_column(no_wrap=True)
    table.add_column(width=BAR_WIDTH // (3 if narrow else 1))
    table.add_column(justify="right", no_wrap=True)
    table.add_column(no_wrap=True, overflow="ellipsis", ratio=1)  # what is left, cut to fit
    for r in rows:
        table.add_row(r.name, r.phase, ProgressBar(total=max(r.total, 1e-9), completed=r.done),
                      f"{r.percent:3.0f}%", r.note)
    return table
