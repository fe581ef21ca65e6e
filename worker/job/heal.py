"""Heal jobs: after every answer, the conversation's target KV stored whole off the critical path.

Every generate job queues a heal (:func:`queue_heal`) of the tokens the next turn will start
with (``worker.job.next_turn``: the prompt, the answer and the template's end of turn as the next
render holds them) when its target's prefix store lacks some of them: the holes of a sparse
prefill (or of a fallback that prefilled only part), and after any prefill the answer, whose
KV the job's own store never holds (the next render re-tokenizes it and adds the end of turn).
It goes on ``<queue>-heal``, behind every user queue (RQ takes a worker's queues in order, so a
heal starts only when no user job waits); the job's result does not wait for it. The heal job
(:func:`run_heal`) restores what the target's prefix store holds, prefills the rest in block
steps (the steps every job prefills its protected prefix in, so a healed block is bit for bit
what a job would compute) and stores the blocks through the same target-prefix path, marked
healed. Before each block it looks at its worker's user queues and its node's running user jobs
(``worker.process.node_busy``: workers of a node share its cores): when a user job waits or runs there
it stores what it has and queues its continuation (content-addressed: the continuation restores
the stored blocks), so a user job waits for, or shares its node with, at most one block of a heal.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping, Sequence

from jobs.contract.heal import HealSpec
from jobs.contract.keys import healing_key
from jobs.contract.spec import JobSpec
from jobs.settings import heal_queue_name, is_heal_queue
from worker.engine import sleep as engine_sleep
from worker.job import target_prefill
from worker.job.context import JobContext
from worker.job.next_turn import next_turn
from worker.job.prompt import _common_prefix_len, check_prompt
from worker.job.reporting import JobReporter
from worker.job.selection_pipeline import load_model
from worker.job.target_prefix import TargetPrefixCache, prefix_cache
from worker.models import LoadedModel
from worker.process.node_busy import add_busy_read, others_busy

log = logging.getLogger(__name__)
_pause = engine_sleep  # a waiting turn's pause between looks (tests script a heal's progress here)


def heal_skip_reason(spec: JobSpec, ctx: JobContext, has_store: bool) -> str | None:
    """Why a generate job queues no heal of its conversation (None: it may queue one;
    :func:`queue_heal` still finds whether the next turn holds anything not stored)."""
    if not ctx.settings.heal:
        return "heal is off on this worker (setting heal)"
    if spec.generate is not None and not spec.generate.heal:
        return "heal is off for this job (option heal)"
    if not has_store:
        return "no target prefix store (setting target_prefix_cache, or none could be made)"
    return None


def queue_heal(spec: JobSpec, ctx: JobContext, target: LoadedModel, prompt_tokens: list[int],
               stored: int, answer: str | Mapping[str, Any], answer_ids: list[int],
               keeps_tails: bool = False) -> dict[str, Any]:
    """Queue the heal of this turn's conversation (``answer``: its text, or the assistant message
    with its tool calls and reasoning) unless the store holds all of its next turn: the store
    holds the first ``stored`` prompt tokens (to the last full block unless ``keeps_tails``),
    as far as the next render repeats them. What the result says of it."""
    turn = next_turn(spec, target.tokenizer, prompt_tokens, answer, answer_ids)
    block = ctx.settings.block_size
    out: dict[str, Any] = {"queued": False, "tokens": len(turn.tokens), "rendered": turn.rendered}
    if turn.note:
        out["note"] = turn.note
    held = min(stored, _common_prefix_len(turn.tokens, prompt_tokens))
    end = len(turn.tokens) if keeps_tails else len(turn.tokens) // block * block
    if end <= held:
        out["reason"] = (f"nothing to heal: the next turn's {len(turn.tokens)} stable tokens end within "
                         f"the {held} stored")
        return out
    heal = HealSpec(spec.target_model or "", tuple(turn.tokens), 0, turn.note, ctx.job_id)
    try:
        handle = enqueue_heal(ctx, heal)
    except Exception as exc:  # the answer is made; a heal is only an optimisation
        log.warning("heal: could not queue the heal of %s: %s: %s", ctx.job_id, type(exc).__name__, exc)
        out["reason"] = f"could not queue: {type(exc).__name__}: {exc}"[:300]
        return out
    ctx.publisher.publish("heal_queued", heal_job=handle.id, tokens=len(turn.tokens))
    return {**out, "queued": True, "job_id": handle.id, "created": handle.created}


def enqueue_heal(ctx: JobContext, heal: HealSpec) -> Any:
    """Put ``heal`` on the heal queue behind the queue this job came from (a handle)."""
    from jobs.client import Client

    queue = heal_queue_name(ctx.queue or ctx.settings.queues[0])
    client = Client(ctx.runtime.connection, ctx.settings, queue_name=queue)
    return client.submit(heal, name=f"after {heal.source_job or 'a job'}")


def user_job_ahead(ctx: JobContext) -> str | None:
    """Why this heal should yield now, or None: a user job waits on one of this worker's own
    (not heal) queues, or runs on another worker of this node (``worker.process.node_busy``: they
    share its cores). One round trip: an LLEN per queue and the node's busy set."""
    from rq import Queue

    queues = [q for q in ctx.runtime.listen_queues or ctx.settings.queues if not is_heal_queue(q)]
    conn = ctx.runtime.connection
    with conn.pipeline(transaction=False) as pipe:
        for name in queues:
            pipe.llen(Queue(name, connection=conn).key)
        add_busy_read(pipe, ctx.settings)
        replies = pipe.execute()
    waiting = [q for q, n in zip(queues, replies) if int(n) > 0]
    if waiting:
        return f"a user job waits on {waiting[0]}"
    running = others_busy(replies[-1], ctx.runtime.worker_name)
    return f"a user job runs on this node (worker {running[0]})" if running else None


def wait_for_quiet(ctx: JobContext) -> None:
    """Wait (letting the engine run the rest) until ``heal_idle_s`` has passed since a user job
    last started or ended on this worker: the next request of the client just answered is likely
    on its way, and a block started now would hold it for the block's length."""
    while True:
        left = ctx.runtime.user_activity_at + ctx.settings.heal_idle_s - time.monotonic()
        if left <= 0:
            return
        _pause(left)


def run_heal(spec: HealSpec, ctx: JobContext) -> dict[str, Any]:
    """A heal job: restore, prefill the rest in block steps (yielding to user jobs), store."""
    t0 = time.perf_counter()
    wait_for_quiet(ctx)  # its restore too would hold a request arriving now
    target, load_s = load_model(ctx, spec.target_model, "target")
    tokens = list(spec.tokens)
    check_prompt(tokens, target, ctx.settings)
    prefix = prefix_cache(ctx, target)
    result: dict[str, Any] = {"kind": "heal", "job_id": ctx.job_id, "total": len(tokens),
                              "kept": len(tokens), "resume": spec.resume, "note": spec.note,
                              "source_job": spec.source_job, "yielded": False}
    if prefix is None:
        return {**result, "healed": 0, "restored": 0, "reason": "no target prefix store on this worker"}
    restored_cache, restored = prefix.restore(tokens)
    # Every token when the store keeps tails (K/V targets), else up to the last full block.
    end = len(tokens) if prefix.keeps_tails else len(tokens) // ctx.settings.block_size * ctx.settings.block_size
    if prefix.stored_all:  # every block is stored already (another heal, or a plain prefill)
        return {**result, "restored": len(tokens), "healed": 0, "blocks_written": 0, "stored": len(tokens),
                "reason": "already stored"}
    # A hybrid target's blocks are restorable up to a checkpoint only: the heal's end is one,
    # and so is where it yields (added when it does), or its continuation restores less.
    rec, board = prefix.recorder(end), _Board(ctx, prefix, tokens, restored, end)
    cache, stored_to, yielded = _prefill_blocks(ctx, target, board, tokens, restored_cache, restored, end, rec)
    written = prefix.save(tokens, cache, stored_to, rec) if stored_to > restored else 0
    board.clear()  # stored: a waiting turn restores it now
    if rec is not None:
        stored_to = max(restored, min(stored_to, max(rec.states, default=0)))
    if written:
        prefix.mark_healed(tokens, restored, stored_to)
    elif stored_to > restored:  # the store refused the cache (logged): nothing was healed
        result["reason"] = "the target's cache could not be stored as blocks"
        stored_to = restored
    result.update(restored=restored, healed=stored_to - restored, blocks_written=written, stored=stored_to)
    if yielded:
        result.update(yielded=True, yielded_for=yielded, continuation=_continue(ctx, spec, stored_to))
    result["timings"] = {"load_models": round(load_s, 6), **{k: round(v, 6) for k, v in prefix.timings.items()},
                         "total": round(time.perf_counter() - t0, 6)}
    return result


def _prefill_blocks(ctx: JobContext, target: LoadedModel, board: "_Board", tokens: list[int],
                    cache: list | None, start: int, end: int, rec: Any = None) -> tuple[list | None, int, str | None]:
    """Prefill ``tokens[start:end]`` one block at a time on top of ``cache`` (each step handed to
    the block recorder ``rec``, if any; where it stands published on ``board``); stop early after a block when a user job waits or runs
    on this node (:func:`user_job_ahead`), that block's end then kept as a checkpoint. The cache,
    how far it holds and why it yielded (None: it did not)."""
    block, reporter = ctx.settings.block_size, JobReporter(ctx)
    bits, group = ctx.settings.kv_quantization("target")
    pos, waiting = start, None

    def step(lo: int, hi: int, step_cache: list) -> None:
        nonlocal waiting
        waiting = hi < end and user_job_ahead(ctx)
        if rec is not None:
            if waiting:
                rec.keep_state = _with_checkpoint(rec.keep_state, hi)
            rec(lo, hi, step_cache)

    while pos < end:
        wait_for_quiet(ctx)
        board.announce(pos)
        stop = min(end, (pos // block + 1) * block)  # block ends (a restored tail, the heal's own: partial)
        cache = target_prefill.prefill_prefix(target.model, tokens, cache, stop, block_size=block,
                                              progress=reporter.begin(), kv_bits=bits, kv_group_size=group,
                                              on_step=step, cached_tokens=pos if cache else None)
        pos = stop
        ctx.publisher.progress("heal", pos, end)
        if waiting:
            log.info("heal %s: %s; stored to %d of %d tokens, continuing later",
                     ctx.job_id, waiting, pos, end)
            return cache, pos, waiting
    return cache, pos, None


class _Board:
    """Where a running heal stands (:func:`jobs.contract.keys.healing_key`, under the first block it
    prefills), for a next turn that may wait for it (:func:`wait_for_heal`). Best effort."""

    def __init__(self, ctx: JobContext, prefix: TargetPrefixCache, tokens: list[int], start: int,
                 end: int) -> None:
        self.ctx, self.start, self.end, self.t0 = ctx, start, end, time.monotonic()
        self.key = _healing_key(ctx, prefix, tokens, start)

    def announce(self, pos: int) -> None:
        """Publish the heal's rate so far and its ETA (none before its first block)."""
        elapsed = time.monotonic() - self.t0
        rate = (pos - self.start) / elapsed if pos > self.start and elapsed > 0 else None
        eta = time.time() + (self.end - pos) / rate if rate else None
        value = json.dumps({"job_id": self.ctx.job_id, "end": self.end, "rate": rate, "eta": eta})
        self._call(lambda c: c.set(self.key, value, ex=max(1, int(self.ctx.settings.heartbeat_ttl_s))))

    def clear(self) -> None:
        self._call(lambda c: c.delete(self.key))

    def _call(self, op: Any) -> None:
        if self.key is None:
            return
        try:
            op(self.ctx.runtime.connection)
        except Exception as exc:  # only a waiting turn's optimisation
            log.warning("heal %s: progress not published: %s: %s", self.ctx.job_id, type(exc).__name__, exc)


def _healing_key(ctx: JobContext, prefix: TargetPrefixCache | None, tokens: list[int], start: int) -> str | None:
    """The key of a heal whose first prefilled block is ``tokens[start:start + block]`` (None:
    no such full block, or no store)."""
    from cache_store.keys import block_digests

    block = ctx.settings.block_size
    if prefix is None or start + block > len(tokens):
        return None
    raw = prefix.store.raw_store
    digest = block_digests(raw.fingerprint, list(tokens[:start + block]), block)[-1]
    return healing_key(ctx.settings.namespace, raw.fingerprint, digest.hex())


def wait_for_heal(ctx: JobContext, prefix: TargetPrefixCache | None, tokens: list[int], restored: int,
                  sparse_tokens: int) -> dict[str, Any]:
    """Wait (up to ``heal_wait_ms``) for the running heal of this turn's conversation, when its
    ETA is within that and shorter than this turn's own ``sparse_tokens`` prefill at the heal's
    rate (a lower bound of its sparse path: the draft's scoring comes on top). What it did:
    empty when no heal of it is running; ``waited`` and ``stored`` (the heal ended) if it waited."""
    wait_s, key = ctx.settings.heal_wait_ms / 1000, _healing_key(ctx, prefix, tokens, restored)
    conn = ctx.runtime.connection
    raw = conn.get(key) if wait_s > 0 and key is not None else None
    if raw is None:
        return {}
    rec = json.loads(raw)
    eta_s = max(0.0, rec["eta"] - time.time()) if rec.get("eta") else None
    own_s = sparse_tokens / rec["rate"] if rec.get("rate") else None
    out: dict[str, Any] = {"waited": False, "heal_job": rec.get("job_id"),
                           "eta_ms": None if eta_s is None else round(1000 * eta_s, 1)}
    if eta_s is None or own_s is None:
        return {**out, "reason": "the heal has no ETA yet (before its first block)"}
    if eta_s > wait_s or eta_s >= own_s:
        return {**out, "reason": f"its ETA {1000 * eta_s:.0f} ms is over heal_wait_ms={ctx.settings.heal_wait_ms} "
                                 f"or this turn's own sparse prefill (~{1000 * own_s:.0f} ms)"}
    t0 = time.monotonic()
    while conn.exists(key) and time.monotonic() - t0 < wait_s and not ctx.runtime.stop_requested():
        _pause(min(0.02, wait_s / 10))
    return {**out, "waited": True, "waited_ms": round(1000 * (time.monotonic() - t0), 1),
            "stored": not conn.exists(key)}


def _with_checkpoint(keep_state: Any, at: int) -> Any:
    """A recorder's ``keep_state`` that also keeps the state at block end ``at``."""
    return lambda e: e == at or keep_state is None or keep_state(e)


def _continue(ctx: JobContext, spec: HealSpec, stored: int) -> str | None:
    try:
        return enqueue_heal(ctx, spec.resumed_at(stored)).id
    except Exception as exc:  # what is stored stays; the next turn restores it
        log.warning("heal %s: continuation not queued: %s: %s", ctx.job_id, type(exc).__name__, exc)
        return None


def healed_ranges(prefix: TargetPrefixCache | None, tokens: list[int], restored: int) -> list[tuple[int, int]]:
    """The ranges of a job's ``restored`` prompt tokens that came from heal jobs."""
    return prefix.healed_ranges(tokens, restored) if prefix is not None and restored else []
