"""The settings every process of a deployment reads (clients, workers, the HTTP server): where its
Redis is, its namespace and queues, how jobs are routed to nodes, how processes log. Processes of
one deployment agree on them."""
from __future__ import annotations

from dataclasses import dataclass

from cache_store.keys import check_namespace
from jobs.log_format import LOG_FORMATS
from jobs.settings.check import Bounds

ROUTING_MODES = ("off", "prefix")  # jobs/client/routing.py
HEAL_QUEUE_SUFFIX = "-heal"


@dataclass(frozen=True)
class DeploymentSettings:
    """Every process: the deployment's Redis, namespace and queues, routing, logs."""

    redis_url: str = ""
    """The queue's Redis (``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``). Empty:
    ``REDIS_URL``, else the CLI starts an embedded Redis."""
    cache_redis_url: str = ""
    """The block store's Redis (``redis+cluster://`` too). Empty: the queue's."""
    namespace: str = "specprefill"
    """The prefix of every key this deployment writes (deployments sharing a Redis differ in it)."""
    queue_names: tuple[str, ...] = ()
    """The RQ queues. Empty: one queue named like the namespace."""
    redis_retries: int = 3
    """Retries of a failed command on the queue's Redis (jittered exponential backoff, 1 s base,
    10 s cap); the block store's client never retries (its errors are misses)."""
    cache_socket_timeout_s: float = 5.0
    """A call to a separate block-store Redis that hangs this long is a miss (the job runs cold)
    instead of a stuck job."""
    routing: str = "prefix"
    """``prefix``: a submitter sends a job to the node that last served the longest prefix of its
    prompt (``bench.scale`` section 3, two nodes on one host: local share 0.91-1.00 against
    0.68-0.78 unrouted; median TTFT 0.83x-1.56x unrouted's, see ``docs/deploy.md``), and workers
    record what they served; ``off``: every job goes to the shared queue."""
    route_index_ttl_s: int = 3600
    """How long a node is remembered to hold a prefix."""
    log_format: str = "text"
    """The logs of workers and the server: ``text`` lines, or ``json`` (one object per line with
    ``job_id``, ``worker`` and ``event``, for log collectors; jobs/log_format.py)."""

    @property
    def block_store_url(self) -> str:
        return self.cache_redis_url or self.redis_url

    @property
    def queues(self) -> tuple[str, ...]:
        """The RQ queues this deployment uses (RQ's keys are not under ``namespace``, so
        deployments sharing a Redis are kept apart by queue name and by job id)."""
        return self.queue_names or (self.namespace,)

    @property
    def heal_queues(self) -> tuple[str, ...]:
        """The low-priority queue behind each of :attr:`queues` (``<queue>-heal``)."""
        return tuple(heal_queue_name(q) for q in self.queues)


RANGES: dict[str, Bounds] = {"redis_retries": (0, 100), "cache_socket_timeout_s": (0.001, None),
                             "route_index_ttl_s": (1, None)}
CHOICES = {"routing": ROUTING_MODES, "log_format": LOG_FORMATS}


def check(settings: DeploymentSettings) -> None:
    check_namespace(settings.namespace)


def is_heal_queue(queue: str | None) -> bool:
    """Whether ``queue`` is a heal queue (its jobs are heals, not a user's)."""
    return (queue or "").endswith(HEAL_QUEUE_SUFFIX)


def heal_queue_name(queue: str) -> str:
    """The heal queue behind user queue ``queue``. A node queue's (``<queue>@<node>``,
    jobs.client.routing) is its shared queue's: any node may heal, the blocks go to the shared
    store, and a heal queue of a node nobody listens on would strand its heals."""
    if is_heal_queue(queue):
        return queue
    return queue.partition("@")[0] + HEAL_QUEUE_SUFFIX
