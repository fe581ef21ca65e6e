"""What the web page shows for one finished job: the document cut into kept and dropped
segments, with the protected prefix and the tail marked (pure functions).

The worker reports kept token ranges and, on request, the text of each kept range
(``return_spans``). The server has no tokenizer, so the dropped text between two kept
spans is found by locating each span's text in the document, in order. When every span is
found exactly once, the dropped segments are the document's own text between them; when
one is not (a repeated passage, token input, text the tokenizer normalised), no text is
guessed: dropped segments show only their token counts.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

# Tokens such as <|user|>, <s>, </s>, <|end|>: in a span's text, not in the document.
_SPECIAL = re.compile(r"<\|?/?[A-Za-z0-9_.-]{1,32}\|?>")


@dataclass
class Segment:
    kind: str                 # "kept" | "dropped"
    start: int                # token positions [start, end)
    end: int
    text: str | None          # None: text unknown (dropped, not aligned)
    marks: list[str] = field(default_factory=list)  # "prefix", "tail"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _find(document: str, span_text: str, at: int) -> tuple[int, int] | None:
    """(start, end) of the one place ``span_text`` occurs in ``document`` after ``at``
    (whitespace runs match loosely, special tokens are dropped); None if it does not
    occur or occurs twice (a repeated passage: which copy was kept is unknown)."""
    words = _SPECIAL.sub(" ", span_text).split()
    if not words:
        return at, at  # only special tokens: nothing of the document
    pattern = re.compile(r"\s+".join(map(re.escape, words)))
    m = pattern.search(document, at)
    if m is None or pattern.search(document, m.start() + 1) is not None:
        return None
    return m.start(), m.end()


def _marks(start: int, end: int, prefix: int, tail_start: int | None) -> list[str]:
    marks = []
    if start < prefix:
        marks.append("prefix")
    if tail_start is not None and end > tail_start:
        marks.append("tail")
    return marks


def segments(total: int, kept_ranges: Sequence[Sequence[int]], *, spans: Sequence[dict] | None,
             document: str | None, protected_prefix: int = 0,
             tail_start: int | None = None) -> tuple[list[Segment], bool]:
    """The document as kept/dropped segments over token positions ``[0, total)``, and
    whether the dropped text could be placed (every kept span found in ``document``)."""
    by_start = {int(s["start"]): s.get("text") for s in spans or ()}
    ranges = sorted((int(s), int(e)) for s, e in kept_ranges)
    places: list[tuple[int, int] | None] = []
    cursor, aligned = 0, document is not None and spans is not None
    for s, _ in ranges:
        place = _find(document, by_start[s], cursor) if aligned and by_start.get(s) is not None else None
        aligned = aligned and place is not None
        places.append(place)
        cursor = place[1] if place else cursor
    out: list[Segment] = []
    tok, char = 0, 0
    for (s, e), place in zip(ranges, places):
        if s > tok:
            gap = document[char:place[0]] if aligned and place else None
            out.append(Segment("dropped", tok, s, gap, _marks(tok, s, protected_prefix, tail_start)))
        text = document[place[0]:place[1]] if aligned and place else by_start.get(s)
        out.append(Segment("kept", s, e, text, _marks(s, e, protected_prefix, tail_start)))
        tok, char = e, (place[1] if place else char)
    if tok < total:
        rest = document[char:] if aligned else None
        out.append(Segment("dropped", tok, total, rest, _marks(tok, total, protected_prefix, tail_start)))
    return out, aligned


def bands(total: int, kept_ranges: Sequence[Sequence[int]], protected_prefix: int = 0,
          tail_start: int | None = None) -> list[tuple[str, int, int]]:
    """``[0, total)`` as exact token bands: ``prefix`` and ``tail`` (kept, by rule),
    ``kept`` (chosen by importance) and ``dropped``, in order (the page's strip)."""
    cuts = {0, total, min(protected_prefix, total)}
    if tail_start is not None:
        cuts.add(min(max(tail_start, 0), total))
    for s, e in kept_ranges:
        cuts.update((int(s), int(e)))
    points = sorted(c for c in cuts if 0 <= c <= total)
    kept = sorted((int(s), int(e)) for s, e in kept_ranges)
    out: list[tuple[str, int, int]] = []
    for a, b in zip(points, points[1:]):
        if a == b:
            continue
        if not any(s <= a and b <= e for s, e in kept):
            kind = "dropped"
        elif a < protected_prefix:
            kind = "prefix"
        elif tail_start is not None and a >= tail_start:
            kind = "tail"
        else:
            kind = "kept"
        if out and out[-1][0] == kind and out[-1][2] == a:
            out[-1] = (kind, out[-1][1], b)
        else:
            out.append((kind, a, b))
    return out


def document_text(spec: Any) -> str | None:
    """The text a span search runs over: the prompt text, or the messages' contents."""
    if spec.text is not None:
        return spec.text
    if spec.messages is not None:
        return "\n".join(m.get("content") or "" for m in spec.messages)
    return None
