"""A finished job's prompt as regions of token positions: what the target did with each token.

The one reading of the layout facts a result carries (``kept_ranges``, ``protected_prefix``,
``tail_start``, the target's restored tokens, ``healed_ranges``); the job page and anything
else that draws a prompt read it here rather than re-deriving it. Kinds, in the order a
token is classified:

- ``healed``: restored from blocks a heal job prefilled (an earlier turn dropped the token,
  the heal filled its KV in);
- ``restored``: the target restored the token's KV from the block store (held whole);
- ``dropped``: not prefilled;
- ``prefix``: the protected system block (kept by rule);
- ``tail``: the selection's mandatory tail (kept by rule);
- ``kept``: chosen by the draft's importance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

KINDS = ("restored", "healed", "dropped", "prefix", "tail", "kept")


@dataclass(frozen=True)
class Region:
    kind: str
    start: int  # token positions [start, end)
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "start": self.start, "end": self.end}


def _inside(ranges: Sequence[tuple[int, int]], a: int, b: int) -> bool:
    return any(s <= a and b <= e for s, e in ranges)


def layout(total: int, kept_ranges: Sequence[Sequence[int]], *, protected_prefix: int = 0,
           tail_start: int | None = None, restored: int = 0,
           healed_ranges: Sequence[Sequence[int]] = ()) -> list[Region]:
    """``[0, total)`` as regions in order, adjacent regions of one kind merged."""
    kept = sorted((int(s), int(e)) for s, e in kept_ranges)
    healed = sorted((int(s), int(e)) for s, e in healed_ranges)
    cuts = {0, total, min(max(restored, 0), total), min(max(protected_prefix, 0), total)}
    if tail_start is not None:
        cuts.add(min(max(tail_start, 0), total))
    for s, e in kept + healed:
        cuts.update((min(max(s, 0), total), min(max(e, 0), total)))
    points = sorted(cuts)
    out: list[Region] = []
    for a, b in zip(points, points[1:]):
        if _inside(healed, a, b):  # restored from blocks a heal job prefilled
            kind = "healed"
        elif a < restored:
            kind = "restored"
        elif not _inside(kept, a, b):
            kind = "dropped"
        elif a < protected_prefix:
            kind = "prefix"
        elif tail_start is not None and a >= tail_start:
            kind = "tail"
        else:
            kind = "kept"
        if out and out[-1].kind == kind:
            out[-1] = Region(kind, out[-1].start, b)
        else:
            out.append(Region(kind, a, b))
    return out


def regions(result: Any) -> list[Region]:
    """The regions of a ``JobResult`` (a prefill or generate job's)."""
    return layout(result.total, result.kept_ranges, protected_prefix=result.protected_prefix,
                  tail_start=result.tail_start, restored=result.restored,
                  healed_ranges=result.healed_ranges)
