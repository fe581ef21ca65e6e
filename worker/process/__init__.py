"""The worker process around its jobs: start, RQ glue, heartbeats and claims, orphans, the
node's busy set, its queues, model advertisement and metrics (see :mod:`worker`)."""
