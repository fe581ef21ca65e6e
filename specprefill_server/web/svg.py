"""The importance curve as an SVG the server renders (no plotting library in the page).

x is the token position, y the draft's importance of that token. A prompt longer than the
plot is wide is drawn as the maximum of each bin of positions (said in the caption), so a
token that mattered is never averaged away. Kept ranges are shaded, the protected prefix
and the tail are bands of their own colour.
"""
from __future__ import annotations

from html import escape
from typing import Sequence

WIDTH, HEIGHT, PAD_L, PAD_B, PAD_T = 900, 220, 48, 28, 12


def _bins(values: Sequence[float], n_bins: int) -> list[float]:
    """Max of each of ``n_bins`` equal runs of ``values`` (all of them when fewer)."""
    if len(values) <= n_bins:
        return list(values)
    out = []
    for b in range(n_bins):
        lo, hi = b * len(values) // n_bins, (b + 1) * len(values) // n_bins
        out.append(max(values[lo:max(hi, lo + 1)]))
    return out


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


def importance_svg(importance: Sequence[float], kept_ranges: Sequence[Sequence[int]], *,
                   protected_prefix: int = 0, tail_start: int | None = None) -> str:
    """The whole SVG document (a string)."""
    total = len(importance)
    plot_w, plot_h = WIDTH - PAD_L - 8, HEIGHT - PAD_B - PAD_T
    x = lambda pos: PAD_L + plot_w * pos / max(total, 1)  # noqa: E731
    ys = _bins(importance, plot_w)
    top = max(ys, default=0.0) or 1.0
    lo, hi = total // max(len(ys), 1), -(-total // max(len(ys), 1))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'class="importance" data-tokens="{total}" role="img">',
             f'<title>draft importance over {total} token positions</title>']

    def band(cls: str, start: int, end: int, label: str) -> None:
        parts.append(f'<rect class="{cls}" x="{x(start):.1f}" y="{PAD_T}" width="{max(0.5, x(end) - x(start)):.1f}" '
                     f'height="{plot_h}" data-start="{start}" data-end="{end}"><title>{escape(label)} '
                     f'[{start}, {end})</title></rect>')

    for s, e in kept_ranges:
        band("kept", int(s), int(e), "kept")
    if protected_prefix:
        band("prefix", 0, protected_prefix, "protected prefix")
    if tail_start is not None and tail_start < total:
        band("tail", tail_start, total, "tail")
    step = plot_w / max(len(ys), 1)
    points = " ".join(f"{PAD_L + step * (i + 0.5):.1f},{PAD_T + plot_h * (1 - v / top):.1f}"
                      for i, v in enumerate(ys))
    parts.append(f'<polyline class="curve" fill="none" points="{points}"/>')
    parts.append(f'<line class="axis" x1="{PAD_L}" y1="{PAD_T + plot_h}" x2="{WIDTH - 8}" y2="{PAD_T + plot_h}"/>')
    for t in _ticks(total):
        parts.append(f'<text class="tick" x="{x(t):.1f}" y="{HEIGHT - 10}" text-anchor="middle">{t}</text>')
    parts.append(f'<text class="tick" x="{PAD_L - 4}" y="{PAD_T + 8}" text-anchor="end">{top:.2g}</text>')
    parts.append(f'<text class="tick" x="{PAD_L - 4}" y="{PAD_T + plot_h}" text-anchor="end">0</text>')
    caption = ("importance per token" if hi <= 1 else
               f"max importance per {lo} tokens" if lo == hi else f"max importance per {lo}-{hi} tokens")
    parts.append(f'<text class="caption" x="{WIDTH - 8}" y="{PAD_T + 10}" text-anchor="end">{caption}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
