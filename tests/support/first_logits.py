"""The logits a job decodes from, recorded: how the exactness tests compare a restored,
healed or sparse job with a full prefill of the same tokens."""
from __future__ import annotations

import numpy as np

from specprefill import sparse


def record_decode_logits(monkeypatch) -> list[np.ndarray]:
    """Patch ``sparse.generate_tokens`` to record the logits each decode starts from; the
    returned list fills as jobs run."""
    seen: list[np.ndarray] = []
    decode = sparse.generate_tokens

    def recording(model, logits, *a, **k):
        seen.append(np.array(logits))
        return decode(model, logits, *a, **k)

    monkeypatch.setattr(sparse, "generate_tokens", recording)
    return seen
