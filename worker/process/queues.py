"""The queues a worker listens on, in order: the one place that list is built."""
from __future__ import annotations

from typing import Sequence

from jobs.client.routing import node_of
from jobs.contract.keys import node_queue_name
from jobs.settings import Settings, heal_queue_name, is_heal_queue


def listen_order(settings: Settings, queues: Sequence[str] | None = None) -> list[str]:
    """RQ's order of this worker's queues (``queues``, default the deployment's): this node's
    queue of each (jobs routed here for their prefix, :mod:`jobs.client.routing`), then the shared
    ones (anyone's), then, with ``heal`` on, each shared queue's heal queue, so a heal is taken
    only when no user job waits (a heal queue named outright is kept, last). The node queues
    are listened on whatever ``routing`` says, so a submitter may turn it on."""
    given = list(queues or settings.queues)
    shared = [q for q in given if not is_heal_queue(q)]
    named_heal = [q for q in given if is_heal_queue(q)]
    node = node_of(settings)
    behind = [heal_queue_name(q) for q in shared] if settings.heal else []
    return [node_queue_name(q, node) for q in shared] + shared + list(dict.fromkeys(behind + named_heal))
