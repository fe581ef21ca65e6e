"""What one job does, from its payload to its result: dispatch (:mod:`worker.job.tasks`), the
selection, generate and heal pipelines and the pieces they share (see :mod:`worker`)."""
