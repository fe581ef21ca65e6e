"""The worker process, in three parts (imports run downward only):

- :mod:`worker.process`: the process around the jobs: start (``python -m worker``,
  :mod:`worker.process.launcher`, :mod:`worker.process.boot`), the in-process RQ worker
  (:mod:`worker.process.rq_worker`), its heartbeats and claims (:mod:`worker.process.liveness`,
  :mod:`worker.process.claims`), orphans, the node's busy set, the queues it listens on, model
  advertisement and metrics.
- :mod:`worker.engine`: the step loop that runs every job the worker holds (the batch, the
  scheduler).
- :mod:`worker.job`: what one job does: the dispatch (:mod:`worker.job.tasks`), the selection,
  generate and heal pipelines (each job's plan is :mod:`specprefill.plan`'s), prompt, progress
  reporting, the target's prefill and prefix store, detokenizing.
- Shared by all three: :mod:`worker.runtime` (per-process state), :mod:`worker.models` (loading
  each model once) and :mod:`worker.context_window`. :mod:`worker.tasks` holds the names jobs
  carry on the queue.
"""
