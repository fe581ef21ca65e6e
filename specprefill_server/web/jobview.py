"""What the web page shows for one finished job: the document cut into kept and dropped
segments, each marked with the regions it holds (restored, prefix, tail, healed: see
``jobs.contract.layout``) (pure functions).

The worker keeps the kept token ranges and the text of each kept range with the result. The server has no tokenizer, so the dropped text between two kept
spans is found by locating each span's text in the document, in order. When every span is
found exactly once, the dropped segments are the document's own text between them; when
one is not (a repeated passage, token input, text the tokenizer normalised), no text is
guessed: dropped segments show only their token counts.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from jobs.contract.layout import Region

# Tokens such as <|user|>, <s>, </s>, <|end|>: in a span's text, not in the document.
_SPECIAL = re.compile(r"<\|?/?[A-Za-z0-9_.-]{1,32}\|?>")


@dataclass
class Segment:
    kind: str                 # "kept" | "dropped"
    start: int                # token positions [start, end)
    end: int
    text: str | None          # None: text unknown (dropped, not aligned)
    marks: list[str] = field(default_factory=list)  # region kinds inside: "restored", "prefix", "tail", "healed"

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


MARKS = ("restored", "prefix", "tail", "healed")  # region kinds a segment is marked with


def _marks(start: int, end: int, layout: Sequence[Region]) -> list[str]:
    inside = {r.kind for r in layout if r.start < end and start < r.end}
    return [k for k in MARKS if k in inside]


def segments(total: int, kept_ranges: Sequence[Sequence[int]], *, spans: Sequence[dict] | None,
             document: str | None, regions: Sequence[Region] = ()) -> tuple[list[Segment], bool]:
    """The document as kept/dropped segments over token positions ``[0, total)``, each marked
    with the ``regions`` it overlaps, and whether the dropped text could be placed (every kept
    span found in ``document``)."""
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
            out.append(Segment("dropped", tok, s, gap, _marks(tok, s, regions)))
        text = document[place[0]:place[1]] if aligned and place else by_start.get(s)
        out.append(Segment("kept", s, e, text, _marks(s, e, regions)))
        tok, char = e, (place[1] if place else char)
    if tok < total:
        rest = document[char:] if aligned else None
        out.append(Segment("dropped", tok, total, rest, _marks(tok, total, regions)))
    return out, aligned


def document_text(spec: Any) -> str | None:
    """The text a span search runs over: the prompt text, or the messages' contents."""
    if spec.text is not None:
        return spec.text
    if spec.messages is not None:
        return "\n".join(m.get("content") or "" for m in spec.messages)
    return None
