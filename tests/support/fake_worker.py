"""Fakes of the worker's model and scoring backend (no model, no mlx): a tokenizer, a model, a
block store and memo in a shared dict, and a scoring function with controllable chunk delays.

Used in-process by the worker tests and inside real worker subprocesses
(tests/support/fake_worker_process.py, tests/reliability/worker_harness.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from jobs.contract.keys import stream_key
from jobs.progress import ProgressPublisher, parse_stream_events
from jobs.settings import Settings
from specprefill.selection import plan_selection, to_ranges
from worker.job.context import JobContext
from worker.job.tasks import execute
from worker.models import ModelPool
from worker.runtime import SelectionBackend, WorkerRuntime

class FakeTokenizer:
    chat_template = "fake"

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [2 + ord(c) % 200 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 2 + 32) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeModel:
    class args:
        vocab_size = 256


def fake_pool(capacity=2):
    return ModelPool(capacity, loader=lambda name: (FakeModel(), FakeTokenizer()),
                     profile=lambda m: None, fingerprint=lambda m, ident, bs: "fp-" + ident,
                     identify=lambda name: "fake:" + name, warm=lambda m: None)


def identify_all_but(missing: str, reason: str):
    """A ``ModelPool`` identify seam that cannot find ``missing`` (``ValueError(reason)``, as
    ``worker.models.locate`` says it) and names every other model ``fake:<name>``."""
    def identify(name: str) -> str:
        if name == missing:
            raise ValueError(reason)
        return "fake:" + name
    return identify


@dataclass
class FakeScore:
    importance: np.ndarray
    kv_cache: list
    lookahead_tokens: list
    timings: dict
    cached_tokens: int
    prompt_tokens: int


class FakeStore:
    """A DraftCache: longest stored prefix in blocks of 8 tokens; fetch always leaves >= 1 token.
    Reports every fetch and store to ``on_fetch`` / ``on_store``, as ``BlockDraftCache`` does."""

    block_size = 8

    def __init__(self, shared, on_fetch=None, on_store=None):
        self.shared = shared
        self.on_fetch, self.on_store = on_fetch or (lambda *a: None), on_store or (lambda *a: None)

    def recorder(self, tokens=None, checkpoints=()):
        return None

    def fetch(self, tokens):
        n = 0
        for end in range(8, len(tokens), 8):
            if tuple(tokens[:end]) in self.shared:
                n = end
        self.on_fetch(n, len(tokens), 0.0)
        return (["kv"] if n else None), n

    def store(self, tokens, cache, recorder=None):
        new = [tuple(tokens[:e]) for e in range(8, len(tokens) + 1, 8) if tuple(tokens[:e]) not in self.shared]
        self.shared.update(new)
        self.on_store(len(new), 0.0, None)
        return len(new)


class FakeMemo:
    def __init__(self, shared):
        self.shared = shared

    def get(self, tokens, settings):
        return self.shared.get((tuple(tokens), tuple(sorted(settings.items()))))

    def put(self, tokens, settings, ranges):
        self.shared[(tuple(tokens), tuple(sorted(settings.items())))] = list(ranges)


POISON_TOKEN = 255  # a prompt holding it fails at its second chunk (a bad chunk mid-job)


def make_fake_score(chunk_delay_s=0.0, step=16):
    def score_with_cache(profile, tokens, draft_cache, options, *, progress=None, prefill_step=2048,
                         checkpoints=()):
        cache, n = draft_cache.fetch(tokens) if draft_cache is not None else (None, 0)
        t0 = time.perf_counter()
        for p in range(n, len(tokens), step):
            if POISON_TOKEN in tokens and p > n:
                raise RuntimeError(f"bad chunk at token {p}: the poison token")
            time.sleep(chunk_delay_s)
            if progress:
                progress(min(p + step, len(tokens)), len(tokens), "prefill")
        if progress:
            progress(len(tokens), len(tokens), "lookahead")
            progress(len(tokens), len(tokens), "importance")
        importance = np.array([(t * 7919) % 101 for t in tokens], dtype=np.float32)
        if draft_cache is not None:
            draft_cache.store(tokens, ["kv"], draft_cache.recorder(tokens))
        return FakeScore(importance, ["kv"], [1] * options.n_lookahead,
                         {"prefill": time.perf_counter() - t0, "lookahead": 0.001, "importance": 0.001},
                         n, len(tokens))
    return score_with_cache


def fake_backend(chunk_delay_s=0.0, shared=None):
    shared = shared if shared is not None else {"blocks": set(), "memo": {}}
    return SelectionBackend(
        score_with_cache=make_fake_score(chunk_delay_s), plan_selection=plan_selection,
        to_ranges=to_ranges,
        block_store=lambda client, loaded, s, **callbacks: FakeStore(shared["blocks"], **callbacks),
        memo=lambda client, fp, s: FakeMemo(shared["memo"]))


def fake_runtime(connection, settings=None, chunk_delay_s=0.0, shared=None):
    settings = settings or Settings(draft_model="fake-draft").replace(threshold=64, tail_tokens=16,
                                                                      chunk_size=8, keep=0.25)
    be = fake_backend(chunk_delay_s, shared)
    return WorkerRuntime(settings, connection, connection, fake_pool(settings.model_lru_size),
                         backend_factory=lambda: be)


def _run(rt, payload, job_id="j"):
    pub = ProgressPublisher(rt.connection, job_id, min_interval_s=0.0)
    return execute(payload, JobContext(job_id, rt, pub))


def _events(r, job_id="j"):
    return parse_stream_events(r.xrange(stream_key("specprefill", job_id)))
