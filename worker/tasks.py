"""The job functions as the queue names them (``worker.tasks.run_job``, the failure callback
``worker.tasks.on_job_failure``: ``jobs.client`` writes these names into every job, so they
stay put wherever the code lives; it lives in :mod:`worker.job.tasks`)."""
from worker.job.tasks import on_job_failure, run_job

__all__ = ["run_job", "on_job_failure"]
