"""The engine: each worker process runs every job it holds in one loop on its one MLX thread.

- :class:`Engine` (:mod:`worker.engine.loop`): ``start(run, priority=, name=)`` a job's whole
  execution as a :class:`Task` (a greenlet); ``step()`` one loop turn (a batched decode step
  of every generating job, then prefill / scoring chunks of ready jobs by priority within the
  ``max_decode_gap_s`` budget); ``tasks()``; ``batch_size``.
- Inside a task (:mod:`worker.engine.context`): :func:`yield_point` at every chunk boundary
  (``worker.job.reporting.JobReporter`` calls it), :func:`batched_decode` (the decode hand-off),
  :func:`sleep`, :func:`chunk_tokens`. Each is today's behaviour outside an engine.
- :mod:`worker.engine.batch`: the decode batch (mlx-lm's batch caches, per-sequence RoPE
  offsets and samplers); :mod:`worker.engine.scheduler`: which chunk runs next.

Priorities: smaller runs first; :data:`USER` jobs, :data:`HEAL` jobs only when no user work is
ready or decoding (:func:`job_priority` of a queued payload).
"""
from worker.engine.context import batched_decode, chunk_tokens, current, sleep, yield_point
from worker.engine.loop import Engine, EngineStats
from worker.engine.task import HEAL, USER, Task, TaskCancelled, job_priority

__all__ = ["Engine", "EngineStats", "HEAL", "Task", "TaskCancelled", "USER", "batched_decode", "chunk_tokens",
           "current", "job_priority", "sleep", "yield_point"]
