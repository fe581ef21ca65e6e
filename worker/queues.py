"""The queues a worker listens on, in order: the one place that list is built."""
from __future__ import annotations

from typing import Sequence

from jobs.keys import node_queue_name
from jobs.routing import node_of
from jobs.settings import Settings


def listen_order(settings: Settings, queues: Sequence[str] | None = None) -> list[str]:
    """This node's queue of each of ``queues`` (default the deployment's), then the shared
    ones: jobs routed here for their prefix first (:mod:`jobs.routing`), then anyone's.
    The node queues are listened on whatever ``routing`` says, so a submitter may turn it on."""
    shared = list(queues or settings.queues)
    node = node_of(settings)
    return [node_queue_name(q, node) for q in shared] + shared
