"""The importance curve as an SVG the server renders (no plotting library in the page).

x is the token position, y the draft's importance. The result keeps the importance as the
maximum of each bin of ``tokens_per_bin`` positions (``jobs.contract.results.ImportanceCurve``; said
in the caption), so a token that mattered is never averaged away. Every region but the
dropped ones is a band of its own colour (``jobs.contract.layout``: restored, prefix, kept, tail, healed).
"""
from __future__ import annotations

from html import escape
from typing import Sequence

from jobs.contract.layout import Region
from jobs.contract.results import ImportanceCurve

WIDTH, HEIGHT, PAD_L, PAD_B, PAD_T = 900, 220, 48, 28, 12
BAND_LABELS = {"restored": "restored from the block store", "prefix": "protected prefix", "kept": "kept",
               "tail": "tail", "healed": "healed"}


def _ticks(total: int, n: int = 6) -> list[int]:
    if total <= 1:
        return [0]
    raw = total / n
    step = max(1, int(10 ** len(str(int(raw))) / 10))
    for mult in (1, 2, 5, 10):
        if step * mult >= raw:
            step *= mult
            break
    return list(range(0, total + 1, step))


def importance_svg(curve: ImportanceCurve, total: int, regions: Sequence[Region]) -> str:
    """The whole SVG document (a string) of ``curve`` over a ``total``-token prompt."""
    plot_w, plot_h = WIDTH - PAD_L - 8, HEIGHT - PAD_B - PAD_T
    x = lambda pos: PAD_L + plot_w * pos / max(total, 1)  # noqa: E731
    values, per_bin = curve.max, curve.tokens_per_bin
    top = max(values, default=0.0) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'class="importance" data-tokens="{total}" data-per-bin="{per_bin}" role="img">',
             f'<title>draft importance over {total} token positions</title>']
    for r in regions:
        if r.kind in BAND_LABELS:
            parts.append(f'<rect class="{r.kind}" x="{x(r.start):.1f}" y="{PAD_T}" '
                         f'width="{max(0.5, x(r.end) - x(r.start)):.1f}" height="{plot_h}" data-start="{r.start}" '
                         f'data-end="{r.end}"><title>{escape(BAND_LABELS[r.kind])} [{r.start}, {r.end})</title></rect>')
    points = " ".join(f"{x(min(total, (i + 0.5) * per_bin)):.1f},{PAD_T + plot_h * (1 - v / top):.1f}"
                      for i, v in enumerate(values))
    parts.append(f'<polyline class="curve" fill="none" points="{points}"/>')
    parts.append(f'<line class="axis" x1="{PAD_L}" y1="{PAD_T + plot_h}" x2="{WIDTH - 8}" y2="{PAD_T + plot_h}"/>')
    for t in _ticks(total):
        parts.append(f'<text class="tick" x="{x(t):.1f}" y="{HEIGHT - 10}" text-anchor="middle">{t}</text>')
    parts.append(f'<text class="tick" x="{PAD_L - 4}" y="{PAD_T + 8}" text-anchor="end">{top:.2g}</text>')
    parts.append(f'<text class="tick" x="{PAD_L - 4}" y="{PAD_T + plot_h}" text-anchor="end">0</text>')
    caption = "importance per token" if per_bin == 1 else f"max importance per {per_bin} tokens"
    parts.append(f'<text class="caption" x="{WIDTH - 8}" y="{PAD_T + 10}" text-anchor="end">{caption}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
