"""An independent, plain-Python statement of the selection rule (no NumPy), for exactness tests."""
from __future__ import annotations

import math


def reference_selection(importance, keep: float, chunk_size: int, tail_tokens: int, follow_chunks: int = 0,
                        protected_prefix: int = 0) -> list[int]:
    """Kept token indices: the protected prefix; the chunks touching the last ``tail_tokens``
    tokens; then, best mean first (ties: earlier chunk), each chunk and the ``follow_chunks``
    non-tail chunks after it, until ``ceil(n_chunks * keep)`` chunks in all are kept."""
    total = len(importance)
    start = min(protected_prefix, total)
    chunks = [list(range(s, min(s + chunk_size, total))) for s in range(start, total, chunk_size)]
    if not chunks or keep >= 1.0:
        return list(range(total))
    budget = max(1, math.ceil(round(len(chunks) * keep, 9)))
    first_tail = total - tail_tokens if tail_tokens > 0 else total
    tail = [i for i, c in enumerate(chunks) if c[-1] >= first_tail]
    means = [sum(float(importance[t]) for t in c) / len(c) for c in chunks]
    ranked = sorted((i for i in range(len(chunks)) if i not in tail), key=lambda i: (-means[i], i))
    room = max(0, budget - len(tail))
    chosen: list[int] = []
    for c in ranked:
        for d in range(c, c + follow_chunks + 1):
            if len(chosen) < room and d < len(chunks) and d not in tail and d not in chosen:
                chosen.append(d)
    return list(range(start)) + [t for i in sorted(chosen + tail) for t in chunks[i]]
