"""Generated token ids -> text: incremental detokenizing, stop strings, safe streaming."""
from __future__ import annotations

from typing import Any, Sequence


class TextStream:
    """Generated ids -> text, with stop strings and hold-back for safe streaming.

    ``text`` never contains a stop string: it is cut before the first occurrence and
    ``stopped`` is set. :meth:`take` hands out each character once; it holds back a tail that
    could be the start of a stop string until more text (or :meth:`finish`) decides.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # mlx-lm's streaming detokenizer is incremental; plain tokenizers are re-decoded.
        self._detok = getattr(tokenizer, "detokenizer", None)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.final = False
        self.sent = 0

    def add(self, token: int) -> None:
        """Append one generated id (ignored once a stop string was seen)."""
        if self.stopped:
            return
        self.ids.append(int(token))
        if self._detok is not None:
            self._detok.add_token(int(token))
            self._update(self._detok.text)
        else:
            self._update(self.tokenizer.decode(self.ids))

    def finish(self) -> None:
        """No more tokens: flush the detokenizer; everything becomes takeable."""
        if not self.stopped and self._detok is not None:
            self._detok.finalize()
            self._update(self._detok.text)
        self.final = True

    def _update(self, text: str) -> None:
        start = max(0, min(len(self.text), len(text)) - self.hold)
        cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        self.text = text

    def _held(self) -> int:
        """Length of the longest tail of ``text`` that starts some stop string."""
        for k in range(min(self.hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def take(self) -> tuple[int, str]:
        """``(offset, delta)``: the characters not handed out yet that are safe to show."""
        end = len(self.text) if self.final or self.stopped else len(self.text) - self._held()
        if end <= self.sent:
            return self.sent, ""
        offset, delta = self.sent, self.text[self.sent:end]
        self.sent = end
        return offset, delta


def stop_token_ids(tokenizer: Any) -> set[int]:
    """The ids that end generation (EOS), from an mlx-lm or a plain tokenizer."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [] if one is None else [one]
    return {int(i) for i in ids}
