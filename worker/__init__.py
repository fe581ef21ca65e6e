"""The worker process: RQ glue, the job pipelines, and what they share (imports downward only).

- :mod:`worker.launcher` / ``python -m worker``: start a worker; :mod:`worker.boot`: BLAS first.
- :mod:`worker.rq_worker`: the in-process RQ worker; :mod:`worker.tasks`: the job functions.
- :mod:`worker.selection_pipeline` (prefill jobs, and the draft half of generate jobs) and
  :mod:`worker.generate_pipeline`; :mod:`worker.prompt` (tokens, protected prefix),
  :mod:`worker.reporting` (the progress reporter), :mod:`worker.detokenize`,
  :mod:`worker.tokenizer_pair`.
- :mod:`worker.context` (one job), :mod:`worker.runtime` (the process), :mod:`worker.models`.
"""
