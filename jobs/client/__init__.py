"""The client: submit, follow and cancel jobs, and read the queue.

- :mod:`jobs.client.client`: ``Client`` and its job and batch handles.
- :mod:`jobs.client.answer_stream`: a generate job's answer as neutral events (what the HTTP
  formatters consume).
- :mod:`jobs.client.holders`: who holds a shared job, and when a cancel stops it.
- :mod:`jobs.client.routing`: prefix-aware routing to the node holding a prompt's prefix;
  :mod:`jobs.client.node_queues`: who listens on a node queue, moving a dead node's jobs.
- :mod:`jobs.client.inspect`: read-only views of the queue for operators.
- :mod:`jobs.client.rate`: a batch's smoothed tokens/s.

``from jobs.client import Client`` (and the handles and errors) works as before the split.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobs import lazy_exports

# module -> the public names it defines (what ``from jobs.client import NAME`` finds), loaded on first use
_MODULE_OF, __getattr__, __dir__ = lazy_exports(__name__, {
    "jobs.client.client": ("Client", "JobHandle", "BatchHandle", "JobFailed", "JobLost", "StreamDiverged"),
})
__all__ = sorted(_MODULE_OF)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from jobs.client.client import Client, JobHandle, BatchHandle, JobFailed, JobLost, StreamDiverged
