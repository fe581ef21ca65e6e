"""What a job needs from the worker process it runs in: settings, Redis, models, stop flag.

RQ calls a job function by import path with only its payload, so the worker installs one
:class:`WorkerRuntime` per process before working; a job run by a plain ``rq worker``
gets a default runtime built from the environment on first use.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import redis

from jobs.connection import cache_connection, queue_connection
from jobs.contract.model_names import ModelCatalog
from jobs.settings import Settings
from worker.models import LoadedModel, ModelPool, draft_profiler, target_profiler
from worker.process.claims import Claim


@dataclass
class SelectionBackend:
    """The scoring, selection and storage functions the selection pipeline calls, for prefill
    and generate jobs alike (a test seam)."""

    score_with_cache: Callable[..., Any]
    plan_selection: Callable[..., Any]  # (importance, the job's PrefillPlan) -> Selection
    to_ranges: Callable[[Any], list]
    # (client, draft, settings, on_fetch=, on_store=) -> the draft's DraftCache for one job
    block_store: Callable[..., Any]
    memo: Callable[[redis.Redis, str, Settings], Any]
    # The target's prefix KV store (a DraftCache over the target's blocks); None: none.
    target_store: Callable[[redis.Redis, LoadedModel, Settings], Any] | None = None
    selection_rule: int = 0  # part of the memo key: a new rule never reuses old selections

    @classmethod
    def default(cls) -> "SelectionBackend":
        from cache_store import SelectionMemo
        from specprefill.reuse import score_with_cache
        from specprefill.selection import SELECTION_RULE, plan_selection, to_ranges

        return cls(
            selection_rule=SELECTION_RULE,
            score_with_cache=score_with_cache, plan_selection=plan_selection,
            to_ranges=to_ranges,
            block_store=_block_store, target_store=_target_store,
            memo=lambda client, fp, s: SelectionMemo(client, fp, namespace=s.namespace,
                                                     ttl_s=s.memo_ttl_s),
        )


def _block_store(client: redis.Redis, loaded: LoadedModel, s: Settings, role: str = "draft",
                 **callbacks: Any) -> Any:
    """A model's ``DraftCache``, the draft's KV (or, with ``role="target"``, the target's
    prefix KV), wired by :func:`wire_block_store` for every cache type the model's fresh
    cache (with that role's KV quantization) holds. ``callbacks``: ``on_fetch`` / ``on_store``."""
    from specprefill.attention.probe import make_cache

    verified = loaded.profile if role == "draft" else loaded.target_profile
    model = verified.model if role == "draft" else loaded.model  # the profile's model: what was verified
    kv = (getattr(verified, "kv_bits", None), getattr(verified, "kv_group_size", 64))

    def fresh() -> list:
        return make_cache(model, *kv)

    fingerprint = (loaded.fingerprint if role == "draft"
                   else _target_fingerprint(loaded, fresh, kv, s.block_size))
    return wire_block_store(client, model, fresh, fingerprint, namespace=s.namespace, block_size=s.block_size,
                            ttl_s=s.block_ttl_s, label={"model": loaded.identity, "name": loaded.name, "role": role},
                            local=local_tier(s), checkpoint_blocks=s.state_checkpoint_blocks,
                            tails=role == "target", **callbacks)


def wire_block_store(client: redis.Redis, model: Any, fresh: Callable[[], list], fingerprint: str, *,
                     namespace: str, block_size: int, ttl_s: int, label: dict[str, str] | None = None,
                     local: Any = None, on_fetch: Callable[..., None] | None = None,
                     on_store: Callable[..., None] | None = None, checkpoint_blocks: int | None = None,
                     tails: bool = False) -> Any:
    """The one wiring of a block store (the worker's, and every test's and benchmark's): the Redis
    block store under ``fingerprint``, which rejects blocks of another layout than ``model``'s
    as corrupt, with this node's local tier (``local``, None: none) in front, behind the cache <->
    raw-arrays adapter for the caches ``fresh()`` makes. ``label``: how results name the model
    (``cache stats`` shows it, metrics label by name and role). ``checkpoint_blocks``: blocks
    between recurrent-state checkpoints (None: ``BlockDraftCache``'s default). ``tails``: the store
    also keeps each stored prefix's partial last block (the target's: a conversation's next turn
    restores every token of the last one; a draft's prompts are scored whole, so it keeps none)."""
    from cache_store import RedisBlockStore
    from specprefill.draft_cache import BlockDraftCache

    raw_store = RedisBlockStore(client, fingerprint, namespace=namespace, block_size=block_size, ttl_s=ttl_s,
                                layout=_block_layout(fingerprint, model, fresh), model=label, local=local,
                                tails=tails)
    every = {} if checkpoint_blocks is None else {"checkpoint_blocks": checkpoint_blocks}
    return BlockDraftCache(raw_store, fresh, on_fetch=on_fetch, on_store=on_store, **every)


_LOCAL_TIERS: dict[tuple[str, int], Any] = {}


def local_tier(s: Settings) -> Any:
    """This node's local tier (``local_cache_dir``), one per process and folder; None without one."""
    if not s.local_cache_dir:
        return None
    key = (s.local_cache_dir, s.local_cache_bytes)
    if key not in _LOCAL_TIERS:
        from cache_store.local_tier import LocalTier

        _LOCAL_TIERS[key] = LocalTier(s.local_cache_dir, s.local_cache_bytes)
    return _LOCAL_TIERS[key]


def _target_store(client: redis.Redis, loaded: LoadedModel, s: Settings) -> Any:
    """The target's prefix store (blocks under the target's own fingerprint)."""
    return _block_store(client, loaded, s, role="target")


_LAYOUTS: dict[str, list | None] = {}  # fingerprint -> block layout: one forward pass per model, not per job
_TARGET_FINGERPRINTS: dict[tuple, str] = {}


def _block_layout(fingerprint: str, model: Any, fresh: Callable[[], list]) -> list | None:
    """The model's block layout (one forward pass per model, not per job); None when its cache
    has no exact block form (its draft cache then refuses every store and misses every fetch)."""
    from specprefill.attention.caches import storable_reason
    from specprefill.draft_cache import block_layout_of

    if fingerprint not in _LAYOUTS:
        if len(_LAYOUTS) >= 64:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[fingerprint] = None if storable_reason(fresh()) else block_layout_of(model, fresh)
    return _LAYOUTS[fingerprint]


def _target_fingerprint(loaded: LoadedModel, fresh: Callable[[], list], kv: tuple, block_size: int) -> str:
    """Names the target's prefix blocks: its weights, its cache description and the role (the
    target prefills its prefix in block steps of its own, so its blocks are not the draft's)."""
    key = (loaded.identity, loaded.dtypes, kv, block_size)  # the description hashes the dtypes too
    if key not in _TARGET_FINGERPRINTS:
        from cache_store import model_fingerprint
        from specprefill.draft_cache import block_description

        description = {"role": "target prefix", **block_description(loaded.model, fresh)}
        _TARGET_FINGERPRINTS[key] = model_fingerprint(description, loaded.identity, block_size=block_size)
    return _TARGET_FINGERPRINTS[key]


@dataclass
class WorkerRuntime:
    """Per-process state shared by the worker loop and the jobs it runs."""

    settings: Settings
    connection: redis.Redis        # queue + progress
    cache_client: redis.Redis      # block store + memo (may be another Redis)
    models: ModelPool
    backend_factory: Callable[[], SelectionBackend] = SelectionBackend.default
    # Stop every job in flight (a second SIGTERM); one job's stop: stop_job(job_id).
    stop_event: threading.Event = field(default_factory=threading.Event)
    # Jobs asked to stop (RQ's stop-job command, a cancel): each stops at its next check.
    stopping: set[str] = field(default_factory=set)
    # Jobs that ended by stopping themselves (JobStopped): RQ must record them as stopped.
    stopped_job_ids: set[str] = field(default_factory=set)
    # The claim of each job in flight, by job id, kept by the worker's heartbeat thread.
    claims: dict[str, Claim] = field(default_factory=dict)
    # The queues the worker takes jobs from, in order (a heal yields when a user job waits on
    # one of them); empty: the settings' queues.
    listen_queues: tuple[str, ...] = ()
    # time.monotonic() when a user job last started or ended here (a heal waits heal_idle_s past it).
    user_activity_at: float = float("-inf")
    # The RQ worker's name (its entry in its node's busy set, worker.process.node_busy); None: no worker.
    worker_name: str | None = None
    # Where the jobs' answer sends wait during a decode step, sent together at its end
    # (jobs.progress.SendBatch, the engine's ``sends``); None: each job sends its own at once.
    sends: Any = None
    # (draft identity, target identity) pairs whose tokenizers were found to agree.
    tokenizer_pairs_checked: set[tuple[str, str]] = field(default_factory=set)
    _backend: SelectionBackend | None = None

    def __post_init__(self) -> None:
        if self.models.catalog is None:  # the pool resolves job names with these settings
            self.models.catalog = ModelCatalog.from_settings(self.settings)
            self.models.allow_downloads = self.settings.allow_downloads

    @property
    def backend(self) -> SelectionBackend:
        if self._backend is None:  # imported on first job so the worker starts without them
            self._backend = self.backend_factory()
        return self._backend

    def stop_requested(self) -> bool:
        """Whether every job in flight is to stop (a second SIGTERM)."""
        return self.stop_event.is_set()

    def stop_job(self, job_id: str) -> None:
        """Ask job ``job_id`` to stop at its next check (any thread may call this)."""
        self.stopping.add(job_id)

    def job_stop_requested(self, job_id: str) -> bool:
        return job_id in self.stopping

    def claim_of(self, job_id: str) -> Claim | None:
        """The claim of job ``job_id`` while it is in flight (None: run directly, or ended)."""
        return self.claims.get(job_id)

    @classmethod
    def from_settings(cls, settings: Settings, connection: redis.Redis | None = None,
                      **kwargs: Any) -> "WorkerRuntime":
        connection = connection or queue_connection(settings.redis_url, settings)
        cache_client = (cache_connection(settings) if settings.cache_redis_url else connection)
        models = kwargs.pop("models", None) or ModelPool(
            settings.model_lru_size, block_size=settings.block_size, compute_dtype=settings.compute_dtype,
            profile=draft_profiler(*settings.kv_quantization("draft")),
            target_profile=target_profiler(*settings.kv_quantization("target")))
        return cls(settings, connection, cache_client, models, **kwargs)


_current: WorkerRuntime | None = None


def install(runtime: WorkerRuntime | None) -> None:
    """Make ``runtime`` the one jobs in this process use (None uninstalls)."""
    global _current
    _current = runtime


def current(connection: redis.Redis | None = None) -> WorkerRuntime:
    """The installed runtime, or a default one from ``SPECPREFILL_*`` settings."""
    global _current
    if _current is None:
        _current = WorkerRuntime.from_settings(Settings.from_env(), connection)
    return _current


def current_settings() -> Settings:
    """Settings of the installed runtime, else from the environment (no runtime built)."""
    return _current.settings if _current is not None else Settings.from_env()
