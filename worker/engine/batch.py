"""The decode batch of one target model: every generating sequence advances one token per step
in one forward pass.

Built on mlx-lm's batch caches (``BatchKVCache`` / ``BatchRotatingKVCache`` / ``ArraysCache`` /
``CacheList`` ``merge``, ``extend``, ``filter``, ``extract``): a sequence joins with its own
prompt cache, merged and extended into the batch's; it leaves by ``filter`` and, when the job
needs its cache back (to store its prefix), ``extract``. Each sequence's RoPE position is the
batch cache's per-sequence ``offset``, kept apart from the mask's ``left_padding``: a sparse
sequence whose cache holds K tokens while its next position is N gets offset N, so it decodes
at its original positions with the genuine rope modules.

Sampling is the project's own (:func:`specprefill.sampling.sample`, float32 logits), one
seeded key per sequence split per token as ``specprefill.sparse.generate_tokens`` does, so a
job's tokens equal its tokens alone. Not reused from mlx-lm's ``GenerationBatch``: its sampler
reads log-probabilities in the model's dtype (see ``specprefill.sparse``), and its stop
sequences and token bookkeeping (the job's own detokenizer and stop strings run in the job).

Like ``GenerationBatch``, a step runs one ahead: as soon as a step's tokens are read, the next
step's forward pass is queued (``mx.async_eval``) with them as input, and it computes while the
jobs publish their tokens, detokenize and check their stop strings (the host's share of a step,
otherwise a pause of the device). A sequence that leaves meanwhile has one token too many in the
batch cache: its extracted cache is trimmed by one, so it gets back exactly what it fed. A batch
runs ahead only while that trim is exact (:func:`runs_ahead`); else its steps run one at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, QuantizedKVCache

from specprefill.options import Sampling
from specprefill.sampling import sample


@dataclass(eq=False)
class Sequence:
    """One job's place in a batch."""

    task: Any
    sampling: Sampling
    key: mx.array
    position: int  # the RoPE position of ``pending`` (its true position in the conversation)
    pending: int  # the token the next step feeds
    cache: list  # the job's own cache list: emptied while batched, refilled on leaving (keep_cache)
    keep_cache: bool = True
    token: int | None = None  # the token the last step produced for it
    leaving: bool = False
    extracted: list | None = field(default=None, repr=False)


def unbatchable_reason(cache: list) -> str | None:
    """Why a job's cache cannot join a batch (None: it can)."""
    for layer in cache:
        for leaf in (layer.caches if isinstance(layer, CacheList) else (layer,)):
            if isinstance(leaf, QuantizedKVCache):
                return "quantized KV cache (kv_bits): mlx-lm has no batched QuantizedKVCache (no merge)"
            if not hasattr(type(leaf), "merge"):
                return f"{type(leaf).__name__}: mlx-lm cannot merge it into a batch cache"
    return None


def _leaves(layer: Any) -> tuple:
    return layer.caches if isinstance(layer, CacheList) else (layer,)


def _shift_offset(layer: Any, delta: mx.array) -> None:
    """Add ``delta`` (per sequence) to the RoPE offsets of a merged batch layer."""
    for leaf in _leaves(layer):
        if not isinstance(leaf, ArraysCache):  # recurrent state has no positions
            leaf.offset = leaf.offset + delta


def runs_ahead(seqs: list[Sequence], cache: list) -> bool:
    """Whether a batch may queue its next step before its tasks read this one's tokens: every
    leaf is a ``BatchKVCache`` (a sequence that leaves gets its cache back trimmed by the extra
    token, exactly), or no sequence wants its cache back. A recurrent state or a rotated window
    cannot be trimmed."""
    return not any(s.keep_cache for s in seqs) or all(
        isinstance(leaf, BatchKVCache) for layer in cache for leaf in _leaves(layer))


def _drop_last(leaf: Any) -> None:
    """Take the last token out of an extracted ``KVCache`` (its arrays end at its offset, as
    an extracted cache's do: ``trim`` alone would leave the slot in ``state``)."""
    leaf.keys, leaf.values = leaf.keys[..., :-1, :], leaf.values[..., :-1, :]
    leaf.offset -= 1


def cache_length(cache: list) -> int:
    """Tokens a job's cache holds (its KV layers' offset)."""
    for layer in cache:
        for leaf in _leaves(layer):
            if not isinstance(leaf, ArraysCache):
                return int(leaf.offset)
    return 0


class DecodeBatch:
    """The generating sequences of one model and their merged cache."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seqs: list[Sequence] = []
        self.cache: list = []
        self._joining: list[Sequence] = []
        self._ahead: tuple[mx.array, list[Sequence]] | None = None  # a queued step: its tokens, its rows
        self.broken = False  # its forward pass raised: leaving takes nothing back

    def __len__(self) -> int:
        return len(self.seqs) + len(self._joining)

    @property
    def joining(self) -> list[Sequence]:
        """Sequences that join at the next step."""
        return list(self._joining)

    def join(self, seq: Sequence) -> None:
        """Add ``seq`` before the next step (its cache is moved into the batch then)."""
        self._joining.append(seq)

    def leave(self, seq: Sequence) -> None:
        """Drop ``seq`` before the next step; with ``keep_cache`` its cache goes back to the job now."""
        if seq in self._joining:
            self._joining.remove(seq)
            return
        if seq.leaving or seq not in self.seqs:
            return
        seq.leaving = True
        if seq.keep_cache and not self.broken:
            index = self.seqs.index(seq)
            seq.cache[:] = [layer.extract(index) for layer in self.cache]
            if self._ahead is not None:  # the queued step fed it one token it never read
                for layer in seq.cache:
                    for leaf in _leaves(layer):
                        _drop_last(leaf)

    def _settle(self) -> None:
        """Apply the leaves (one ``filter``) and the joins (one ``merge``, one ``extend``)."""
        if any(s.leaving for s in self.seqs):
            keep = [i for i, s in enumerate(self.seqs) if not s.leaving]
            self.seqs = [self.seqs[i] for i in keep]
            if keep:
                for layer in self.cache:
                    layer.filter(keep)
            else:
                self.cache = []
        if not self._joining:
            return
        joining, self._joining = self._joining, []
        merged = [type(layers[0]).merge(list(layers)) for layers in zip(*(s.cache for s in joining))]
        delta = mx.array([s.position - cache_length(s.cache) for s in joining])
        for layer in merged:
            _shift_offset(layer, delta)
        for s in joining:
            s.cache[:] = []  # the batch holds the only copy while it decodes
        if self.cache:
            for mine, theirs in zip(self.cache, merged):
                mine.extend(theirs)
        else:
            self.cache = merged
        self.seqs.extend(joining)

    def logits(self) -> mx.array | None:
        """The joins and leaves applied, one forward pass of every sequence's pending token: the
        next-token logits, one row per sequence of :attr:`seqs` (None: no sequence)."""
        self._settle()
        if not self.seqs:
            return None
        inputs = mx.array([[s.pending] for s in self.seqs], dtype=mx.int32)
        return self.model(inputs, cache=self.cache)[:, -1, :]

    def step(self) -> list[Sequence]:
        """One forward pass of every sequence; each one's ``token`` is set. The sequences stepped
        (a sequence that left while its step was queued is not among them). With
        :func:`runs_ahead`, the next step is queued before this returns."""
        if self._ahead is None:
            self._queue()
        if self._ahead is None:
            return []
        (tokens, seqs), self._ahead = self._ahead, None
        for seq, token in zip(seqs, tokens.tolist()):
            seq.token, seq.pending = int(token), int(token)
            seq.position += 1
        self._queue(ahead=True)
        return [s for s in seqs if not s.leaving]

    def _queue(self, *, ahead: bool = False) -> None:
        """The joins and leaves applied, the next step's forward pass and sampling queued (with
        ``ahead``, only where :func:`runs_ahead`)."""
        self._settle()
        if ahead and not runs_ahead(self.seqs, self.cache):
            return
        logits = self.logits()
        if logits is None:
            return
        tokens = _sample_rows(logits, self.seqs)
        mx.async_eval(tokens, [layer.state for layer in self.cache])
        self._ahead = (tokens, list(self.seqs))


def _sample_rows(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    """One token per row: greedy rows in one argmax, the others with their own key and options."""
    greedy = [i for i, s in enumerate(seqs) if s.sampling.greedy or s.sampling.temperature == 0]
    if len(greedy) == len(seqs):  # a greedy row never reads its key
        return mx.argmax(logits.astype(mx.float32), axis=-1)
    rows = []
    for i, s in enumerate(seqs):
        s.key, step_key = mx.random.split(s.key)
        rows.append(sample(logits[i:i + 1], step_key, s.sampling).reshape(1))
    return mx.concatenate(rows)
