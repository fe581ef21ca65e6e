"""The engine: every job a worker holds, run in one loop on the worker's one MLX thread.

Each job's whole execution is a :class:`~worker.engine.task.Task` (a greenlet). The existing
pipelines already work in chunks and call their progress callback after each; that callback
(``worker.job.reporting.JobReporter``) calls :func:`worker.engine.yield_point`, which switches
back here. One :meth:`Engine.step`:

1. delivers cancels (raised inside their tasks now) and wakes sleepers that are due;
2. decodes: one batched forward pass per target model for every sequence in its
   :class:`~worker.engine.batch.DecodeBatch`, each task resumed with its token; a task whose
   cache cannot be batched (:func:`~worker.engine.batch.unbatchable_reason`) decodes one token
   in its own turn instead;
3. runs prefill / scoring turns of ready tasks (:mod:`worker.engine.scheduler`: priority, then
   ``prefill_order``) while the ``max_decode_gap_s`` budget allows, at least one.

Nothing a task raises reaches the loop (it fails that task alone).
"""
from __future__ import annotations

import logging
import time
import weakref
from contextlib import nullcontext
from typing import Any, Callable

from greenlet import getcurrent

from worker.engine import scheduler
from worker.engine.task import USER, Task

log = logging.getLogger(__name__)

# The smallest prefill chunk the gap budget sizes: smaller ones cost more than they save
# (target-tiny on this 2-core CPU: 1900 tokens in 64-token chunks take 1.6x as long as in 256).
MIN_CHUNK = 128
PADDING_FLOOR = 4096  # sequences up to this many tokens share one batch whatever their lengths


def length_bucket(tokens: int) -> int:
    """Which batch a sequence of ``tokens`` cached tokens joins: one for up to
    :data:`PADDING_FLOOR`, then one per doubling. A batch pads each row to its longest, so a
    short request beside a 16K-token one would hold (and attend over) 16K slots; within a
    bucket a row is padded to at most twice its length (or the floor). More buckets mean more
    forward passes per step (the weights read once per batch)."""
    return max(0, (max(tokens, 1) - 1) // PADDING_FLOOR).bit_length()
CALIBRATION_TOKENS = 128  # tokens of the timed forward passes that size a model's chunks
CONTEXT_PROBE = 2048  # cached tokens beside the second timed pass: how a chunk's cost grows with its context


class Engine:
    """The step loop, the decode batches and the scheduler of one worker process."""

    def __init__(self, *, max_decode_gap_s: float | None = None, prefill_chunk_tokens: int | None = None,
                 prefill_order: str | None = None) -> None:
        from jobs.settings import Settings

        defaults = Settings.__dataclass_fields__
        self.max_decode_gap_s = float(defaults["max_decode_gap_s"].default if max_decode_gap_s is None
                                      else max_decode_gap_s)
        self.prefill_chunk_tokens = prefill_chunk_tokens or None  # None/0: sized from the gap
        self.prefill_order = prefill_order or defaults["prefill_order"].default
        if self.prefill_order not in scheduler.ORDERS:
            raise ValueError(f"prefill_order: must be one of {', '.join(scheduler.ORDERS)}, got {self.prefill_order!r}")
        self._tasks: list[Task] = []
        self._ready: list[Task] = []  # tasks with a turn to run (new, or back from a yield point)
        self._solo: list[Task] = []  # unbatchable decoders waiting for their next token's turn
        self._batches: dict[tuple[int, int], Any] = {}  # (id(model), length bucket) -> DecodeBatch
        self._chunks: dict[int, tuple[weakref.ref, tuple[float, float]]] = {}  # id(model) -> its measured cost
        self._probed: dict[int, tuple[weakref.ref, str | None]] = {}
        self._mean_turn_s = 0.0  # a moving average of turn lengths (a new task's expected turn)
        self._loop: Any = None
        self._current: Task | None = None
        self.stats = EngineStats()
        # What holds the answers a decode step's tasks publish, to send them together at its
        # end (jobs.progress.SendBatch: one Redis round trip per step, not one per job); None:
        # each task sends its own at once.
        self.sends: Any = None

    @classmethod
    def from_settings(cls, settings: Any) -> "Engine":
        return cls(max_decode_gap_s=settings.max_decode_gap_s, prefill_chunk_tokens=settings.prefill_chunk_tokens,
                   prefill_order=settings.prefill_order)

    # ---- the API ----

    def start(self, run: Callable[[], Any], *, priority: int = USER, name: str = "") -> Task:
        """A task running ``run()`` (a job's whole execution) in its own greenlet, from the next step."""
        task = Task(run, priority=priority, name=name or f"task-{len(self._tasks)}")
        self._tasks.append(task)
        self._ready.append(task)
        return task

    def tasks(self) -> list[Task]:
        """The tasks in flight (not done)."""
        return [t for t in self._tasks if not t.done]

    @property
    def batch_size(self) -> int:
        """Sequences decoding now (in batches, and alone)."""
        return sum(len(b.seqs) for b in self._batches.values()) + len(self._solo_decoding())

    @property
    def batch_kv_bytes(self) -> int:
        """Bytes the decode batches' caches hold (left padding included; jobs still prefilling
        and solo decoders hold their own caches, not counted here)."""
        return sum(layer.nbytes for b in self._batches.values() for layer in b.cache)

    @property
    def current_task(self) -> Task | None:
        """The task whose greenlet is running (None: the loop itself, or no engine)."""
        return self._current if self._current is not None and getcurrent() is not self._loop else None

    def step(self, *, idle_sleep: bool = True) -> bool:
        """One loop turn (module docstring); True while tasks remain. When nothing ran and every
        task sleeps, it sleeps a little (:meth:`_idle`) unless told not to (``idle_sleep``: the
        caller waits on something of its own, as the worker on its queues)."""
        from worker.engine import context

        self._loop = getcurrent()
        with context.running(self):
            self._deliver_cancels()
            self._wake_sleepers()
            decoded = self._decode()
            self._prefill_turns(decoded)
        self._tasks = [t for t in self._tasks if not t.done]
        if not decoded:
            self.stats.idle()
            if idle_sleep:
                self._idle()
        return bool(self._tasks)

    def run_until_done(self) -> None:
        """Step until every task ended (tests, scripts)."""
        while self.step():
            pass

    def close(self) -> None:
        """End every task (a started one's ``finally`` blocks run) and drop the batches."""
        from worker.engine import context

        self._loop = getcurrent()
        with context.running(self):
            for task in self.tasks():
                self._run(task, kill=True)
        self._batches.clear()

    # ---- inside a task (worker.engine.context calls these) ----

    def yield_now(self, task: Task, work_left: int | None) -> None:
        """A chunk boundary: back to the loop, resumed when the scheduler picks it."""
        if work_left is not None:
            task.work_left = work_left
        self._ready.append(task)
        self._switch_out(task)

    def wait_token(self, task: Task) -> None:
        """A batched sequence waits for the next step's token (set on its Sequence)."""
        self._switch_out(task)

    def solo_turn(self, task: Task) -> None:
        """An unbatchable decoder waits for its next token's turn."""
        self._solo.append(task)
        self._switch_out(task)

    def sleep(self, task: Task, seconds: float) -> None:
        task.wake_at, task.phase = time.perf_counter() + max(0.0, seconds), "waiting"
        try:
            self._switch_out(task)
        finally:
            task.wake_at, task.phase = None, "prefill"

    def batch_for(self, model: Any, tokens: int) -> Any:
        """The decode batch of ``model`` for a sequence whose cache holds ``tokens``
        (:func:`length_bucket`: a batch left-pads every row to its longest)."""
        from worker.engine.batch import DecodeBatch

        key = (id(model), length_bucket(tokens))
        batch = self._batches.get(key)
        if batch is None or batch.model is not model:
            batch = self._batches[key] = DecodeBatch(model)
        return batch

    def _switch_out(self, task: Task) -> None:
        self._loop.switch()
        # resumed: a cancel was thrown in by Task.resume before we get here

    # ---- the step's parts ----

    def _run(self, task: Task, value: Any = None, *, kill: bool = False) -> None:
        outer, self._current = self._current, task
        try:
            task.kill() if kill else task.resume(value)
        finally:
            self._current = outer
        if task.done:
            self._forget(task)

    def _forget(self, task: Task) -> None:
        for queue in (self._ready, self._solo):
            while task in queue:
                queue.remove(task)

    def _deliver_cancels(self) -> None:
        for task in [t for t in self._tasks if t.cancel_pending and not t.done]:
            self._forget(task)
            if task.started:
                self._run(task)  # Task.resume throws the cancel in
            else:
                task.resume()  # ends it without running
                self._forget(task)

    def _wake_sleepers(self) -> None:
        now = time.perf_counter()
        for task in self._tasks:
            if task.wake_at is not None and task.wake_at <= now and not task.done:
                task.wake_at = now + 3600  # resumed once; sleep() resets it
                self._run(task)

    def _decode(self) -> bool:
        """One decode step of every batch, then one token of every solo decoder; what their
        tasks publish while resumed leaves together at the end (:attr:`sends`)."""
        with self.sends.holding() if self.sends is not None else nullcontext():
            return self._decode_steps()

    def _decode_steps(self) -> bool:
        stepped = False
        for key, batch in list(self._batches.items()):
            try:
                seqs = batch.step()
            except Exception as exc:  # the batched pass itself failed: its jobs fail, the loop goes on
                self._fail_batch(key, batch, exc)
                continue
            if not seqs:
                if not len(batch):
                    del self._batches[key]
                continue
            stepped = True
            self.stats.decode_step(len(seqs))
            for seq in seqs:
                if not seq.leaving and not seq.task.done:
                    self._run(seq.task, seq.token)
        solo, self._solo = self._solo, []
        for task in solo:
            stepped = True
            self._run(task)
        if stepped:
            self.stats.decoded()
        return stepped

    def _fail_batch(self, key: tuple, batch: Any, exc: Exception) -> None:
        """A batch whose forward pass raised: dropped, each of its jobs failed with the error."""
        log.error("engine: a batched decode step of %d sequences failed: %s: %s", len(batch),
                  type(exc).__name__, exc)
        del self._batches[key]
        batch.broken = True
        for seq in batch.seqs + batch.joining:
            seq.task.cancel(exc)
            self._run(seq.task)

    def _solo_decoding(self) -> list[Task]:
        return [t for t in self._tasks if not t.done and t.phase == "decode" and not t.batched]

    def _user_busy(self) -> bool:
        return any(len(b) for b in self._batches.values()) or any(
            t.priority <= USER and not t.done and t.phase == "decode" for t in self._tasks)

    def _prefill_turns(self, decoded: bool) -> None:
        started, turns = time.perf_counter(), 0
        while self._ready:
            task = scheduler.next_task(self._ready, self.prefill_order, user_busy=self._user_busy())
            if task is None:
                return
            elapsed = time.perf_counter() - started
            expected = task.last_turn_s if task.turns else self._mean_turn_s  # a new task: the usual turn
            if not scheduler.fits(elapsed, expected, self.max_decode_gap_s, turns):
                return
            self._ready.remove(task)
            t = time.perf_counter()
            self._run(task)
            took = time.perf_counter() - t
            task.service_s += took
            self._mean_turn_s = 0.8 * self._mean_turn_s + 0.2 * took
            turns += 1
            self.stats.turn(decoded)

    def idle_for(self, longest_s: float) -> float:
        """Seconds the loop has nothing to run for (0: work is ready or decoding), at most
        ``longest_s``: until its first sleeper is due. A caller may block that long on its own
        wait (the worker on its queues) instead of stepping an idle loop."""
        if self._ready or self._solo or any(len(b) for b in self._batches.values()):
            return 0.0
        wakes = [t.wake_at for t in self._tasks if t.wake_at is not None and not t.done]
        if not wakes:
            return 0.0  # tasks that neither sleep nor are ready: let the loop look at them
        return max(0.0, min(longest_s, min(wakes) - time.perf_counter()))

    def _idle(self) -> None:
        """Nothing ran: sleep until the first sleeper is due (at most a few ms: the caller polls);
        not while a task is ready or a sequence waits to join its batch (:meth:`idle_for`)."""
        wait_s = self.idle_for(0.005)
        if wait_s > 0:
            time.sleep(wait_s)

    def batch_reason(self, model: Any) -> str | None:
        """Why ``model`` cannot decode in a batch (:func:`worker.engine.probe.batch_reason`, once per model)."""
        known = self._probed.get(id(model))
        if known is None or known[0]() is not model:
            from worker.engine.probe import batch_reason

            reason = batch_reason(model)
            if reason is not None:
                log.warning("engine: %s; its jobs decode one at a time", reason)
            known = self._probed[id(model)] = (weakref.ref(model), reason)
        return known[1]

    # ---- chunk sizes ----

    def chunk_tokens(self, model: Any, default: int, context: int = 0) -> int:
        """Prefill tokens per forward pass of ``model`` in this engine for a prompt of ``context``
        tokens: ``prefill_chunk_tokens`` if set, else what fits ``max_decode_gap_s`` at the
        model's measured cost (:func:`measure_cost`, once per model in the process) when every
        token of the chunk attends to ``context`` cached tokens (its last chunk's), a power of two
        in [:data:`MIN_CHUNK`, ``default``]. A chunk sized for an empty cache ran 10-20x over the
        gap at 16K tokens (attention grows with the context). Fixed per model and prompt length
        for the engine's life, so a job's prefill runs in the same chunks alone and beside others."""
        if self.prefill_chunk_tokens:
            return min(self.prefill_chunk_tokens, default)
        cost = self._cost(model)
        return default if cost is None else min(chunk_fitting(cost, context, self.max_decode_gap_s), default)

    def prepare(self, model: Any, *, decodes: bool) -> None:
        """Measure ``model``'s prefill cost now and, if it ``decodes`` (a target), check that it
        batches: what the first job of it would otherwise pay (a worker calls this for the
        models it preloads)."""
        if not self.prefill_chunk_tokens:
            self._cost(model)
        if decodes:
            self.batch_reason(model)

    def _cost(self, model: Any) -> tuple[float, float] | None:
        """``model``'s measured prefill cost (:func:`measure_cost`, once); None: not measurable."""
        known = self._chunks.get(id(model))
        if known is None or known[0]() is not model:
            try:
                cost = measure_cost(model)
            except Exception as exc:  # not an mlx-lm model (a test's fake): its own chunks
                log.info("engine: %s not measured (%s: %s): its default chunks", type(model).__name__,
                         type(exc).__name__, exc)
                return None
            known = self._chunks[id(model)] = (weakref.ref(model), cost)
            log.info("engine: %s prefills %.0f tokens/s on an empty cache, %.0f beside %d cached tokens: "
                     "chunks of %d tokens (empty) and %d (%d cached) fit max_decode_gap_s=%g",
                     type(model).__module__, 1 / cost[0], 1 / (cost[0] + cost[1] * CONTEXT_PROBE), CONTEXT_PROBE,
                     chunk_fitting(cost, 0, self.max_decode_gap_s), chunk_fitting(cost, 16384, self.max_decode_gap_s),
                     16384, self.max_decode_gap_s)
        return known[1]


def chunk_fitting(cost: tuple[float, float], context: int, gap_s: float) -> int:
    """The largest power of two (at least :data:`MIN_CHUNK`) whose tokens, each attending to
    ``context`` cached tokens at ``cost`` (seconds per token, and per token per cached token),
    take at most ``gap_s``."""
    per_token = cost[0] + cost[1] * max(0, context)
    fit = max(MIN_CHUNK, int(gap_s / max(per_token, 1e-9)))
    return 1 << (fit.bit_length() - 1)


_costs: dict[int, tuple[weakref.ref, tuple[float, float]]] = {}  # id(model) -> (model, cost): one measure per process


def measure_cost(model: Any) -> tuple[float, float]:
    """What a prefill token of ``model`` costs: (seconds per token on an empty cache, seconds
    per token per cached token it attends to), from :data:`CALIBRATION_TOKENS` tokens on a fresh
    cache (the fastest of three passes: a busy machine only ever adds time) and beside
    :data:`CONTEXT_PROBE` cached tokens (the fastest of two), measured once per model."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    known = _costs.get(id(model))
    if known is not None and known[0]() is model:
        return known[1]
    if not isinstance(model, nn.Module):
        raise TypeError("not an mlx.nn.Module")
    tokens = mx.arange(1, CALIBRATION_TOKENS + 1, dtype=mx.int32)[None] % 2 + 1

    def timed(cache: list) -> float:
        t = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        return time.perf_counter() - t

    empty = min(timed(make_prompt_cache(model)) for _ in range(3))
    cache = make_prompt_cache(model)
    for _ in range(CONTEXT_PROBE // CALIBRATION_TOKENS):
        mx.eval(model(tokens, cache=cache))
    beside = min(timed(cache) for _ in range(2))
    cost = (empty / CALIBRATION_TOKENS, max(0.0, beside - empty) / (CALIBRATION_TOKENS * CONTEXT_PROBE))
    _costs[id(model)] = (weakref.ref(model), cost)
    return cost


class EngineStats:
    """What the loop did: decode steps, batch sizes, prefill turns between decode steps, gaps."""

    def __init__(self) -> None:
        self.decode_steps = 0
        self.sequences_stepped = 0
        self.max_batch = 0
        self.turns_between = 0  # prefill turns since the last decode step
        self.max_turns_between = 0
        self.max_gap_s = 0.0
        self._last_decode: float | None = None

    def decode_step(self, size: int) -> None:
        self.decode_steps += 1
        self.sequences_stepped += size
        self.max_batch = max(self.max_batch, size)

    def decoded(self) -> None:
        now = time.perf_counter()
        if self._last_decode is not None:
            self.max_gap_s = max(self.max_gap_s, now - self._last_decode)
        self._last_decode = now
        self.turns_between = 0

    def turn(self, decoding: bool) -> None:
        self.turns_between += 1
        if decoding:
            self.max_turns_between = max(self.max_turns_between, self.turns_between)

    def idle(self) -> None:
        self._last_decode = None
