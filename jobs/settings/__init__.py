"""The service's configuration: one object, read from ``SPECPREFILL_*`` environment variables.

Library code (``specprefill``, ``cache_store``) takes explicit arguments; only the
service layers (``jobs``, ``worker``) read settings, and they pass values down.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from cache_store.keys import check_namespace
from jobs.log_format import LOG_FORMATS
from jobs.settings import check as settings_check
from jobs.settings.check import SettingsError
from specprefill.options import (COMPUTE_DTYPES, PREFILL_STEP, STATE_CHECKPOINT_BLOCKS, OptionError, ScoringOptions,
                                 SelectionOptions)

ENV_PREFIX = "SPECPREFILL_"
KV_BITS = (0, 2, 3, 4, 5, 6, 8)  # what mx.quantize takes (0: a plain cache)
KV_GROUP_SIZES = (32, 64, 128)
REPO_ROOT = Path(__file__).resolve().parents[2]
# The settings named by option fields: setting (and SPECPREFILL_<NAME>) -> (group, field).
OPTION_GROUPS = {"scoring": ScoringOptions, "selection": SelectionOptions}
OPTION_SETTINGS = {f.name: (group, f.name) for group, cls in OPTION_GROUPS.items() for f in fields(cls)}


def _shipped_models() -> Path:
    """The shipped models: a source checkout's ``models/`` folder, else the installed
    package data (``specprefill_models``, what the wheel ships)."""
    if (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "models" / "draft-tiny").is_dir():
        return REPO_ROOT / "models"
    from importlib.util import find_spec

    spec = find_spec("specprefill_models")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return REPO_ROOT / "models"  # neither: messages name the missing folder


SHIPPED_MODELS = _shipped_models()


def _default_draft_model() -> str:
    return str(SHIPPED_MODELS / "draft-tiny")


def _default_target_model() -> str:
    return str(SHIPPED_MODELS / "target-tiny")


@dataclass(frozen=True)
class Settings:
    """Every tunable of the service. Override any field with ``SPECPREFILL_<FIELD>``."""

    # Where things live.
    redis_url: str = ""  # empty: REDIS_URL, else the CLI starts an embedded Redis
    cache_redis_url: str = ""  # block store Redis; empty: same as redis_url
    namespace: str = "specprefill"  # prefix of every key this deployment writes
    queue_names: tuple[str, ...] = ()  # RQ queues; empty: one queue named like the namespace

    # Models.
    draft_model: str = field(default_factory=_default_draft_model)
    target_model: str = field(default_factory=_default_target_model)
    preload_models: tuple[str, ...] = ()
    model_lru_size: int = 2
    # Models a job may name. Empty: any local folder or hub id. Otherwise these plus
    # draft_model, target_model and preload_models; a job naming another one is refused.
    allowed_models: tuple[str, ...] = ()
    # Model names (jobs.contract.model_names): aliases NAME=PATH_OR_HUB_ID a job may name, and whether
    # a hub id missing from this worker's hub cache is downloaded (else refused, saying how
    # to pre-download it). Worker name: empty is "<host>.<pid>".
    models: tuple[str, ...] = ()
    allow_downloads: bool = False
    worker_name: str = ""
    # Prefix-aware routing (jobs/client/routing.py). A node is one machine with its own local tier; its
    # workers listen on its node queue (``<queue>@<node>``) before the shared queue. "prefix":
    # the submitter sends a job to the node that last served the longest prefix of its prompt
    # while that node's queue holds at most route_max_queue jobs; "off": the shared queue.
    node_name: str = ""  # empty: the host name
    routing: str = "prefix"  # bench/scale.py section 3: local share 1.00 vs 0.70, median TTFT 0.83x
    route_max_queue: int = 2
    route_index_ttl_s: int = 3600  # how long a node is remembered to hold a prefix

    # SpecPrefill defaults of every job that does not set them, one object per group (their
    # fields and ranges: specprefill/options.py). Each field is also a setting of its own name
    # (SPECPREFILL_KEEP, SPECPREFILL_TEMPERATURE for the lookahead, ...: OPTION_SETTINGS).
    scoring: ScoringOptions = field(default_factory=ScoringOptions)
    selection: SelectionOptions = field(default_factory=SelectionOptions)
    prefill_step: int = PREFILL_STEP  # tokens per forward pass of this worker's prefills

    # KV-cache quantization (mlx-lm's kv_bits / kv_group_size) of the draft's cache (scoring
    # and stored blocks) and of the target's (sparse prefill and decoding). 0: not quantized.
    # Models with sliding-window layers cannot be quantized (refused at load).
    draft_kv_bits: int = 0
    draft_kv_group_size: int = 64
    target_kv_bits: int = 0
    target_kv_group_size: int = 64
    # What the draft and the target compute in (specprefill/compute_dtype.py): their floating
    # weights cast after loading, quantized ones dequantized. "auto": float32 on MLX's CPU
    # backend (bf16 and quantized matmuls there are 8x and more slower), the model's own dtype
    # on Metal; "model": always the model's own; or float32, bfloat16, float16.
    compute_dtype: str = "auto"

    # Block store.
    block_size: int = 256
    block_ttl_s: int = 24 * 3600
    # A hybrid model's recurrent state is stored at checkpoints only: the end of the system
    # prefix, each stored prompt's last full block, and every this many blocks (0: only those).
    state_checkpoint_blocks: int = STATE_CHECKPOINT_BLOCKS
    # This node's local tier of blocks in front of the shared store (a folder on its SSD, shared
    # by the node's workers, least recently used out past local_cache_bytes). Empty: none.
    local_cache_dir: str = ""
    local_cache_bytes: int = 16 * 2**30
    # A separate block-store Redis is a cache: a call to it that hangs this long is a miss
    # (the job runs cold) instead of a stuck job.
    cache_socket_timeout_s: float = 5.0
    # Retries (jittered exponential backoff, 1 s base, 10 s cap) of a failed command on the
    # queue's Redis; the block store's client never retries (its errors are misses).
    redis_retries: int = 3
    memo_ttl_s: int = 24 * 3600
    # Store the target's KV of fully prefilled prompt prefixes (system prompt, tools, short
    # earlier turns) as blocks under its fingerprint, and restore them for the next job.
    target_prefix_cache: bool = True
    # Heal jobs (worker.job.heal): after every generate job, the target's prefill of what the store
    # lacks of the conversation as the next turn renders it (a sparse prompt's holes, the
    # answer and the template's end of turn), stored as target blocks, queued on
    # "<queue>-heal" (workers listen there after their own queues, so a heal runs only when no
    # user job waits). heal: this worker enqueues and runs them (a job turns its own off with
    # the generate option heal). heal_ttl_s: how long a
    # queued heal may wait before RQ drops it (a stale conversation is not worth it).
    # heal_wait_ms: how long a turn that would go sparse may wait for the running heal of its
    # conversation when that heal's ETA is under this and shorter than the turn's own sparse
    # prefill at the heal's rate (0: never wait; it uses what is stored).
    heal: bool = True
    heal_ttl_s: int = 3600
    heal_wait_ms: int = 0

    # When the draft's scoring, its block store or the sparse prefill fails, a generate job
    # answers with a plain full prefill and a prefill job keeps every token, both saying
    # why (``fallback``). Strict: the job fails instead.
    fallback_strict: bool = False
    # The draft's scoring time budget per job: past it the draft stops (a stop of the draft
    # only) and the job falls back as above. 0: no budget.
    draft_timeout_s: float = 0.0

    # The engine (worker/engine): every job the worker holds runs in one loop; decoding jobs
    # advance together one token per step. max_decode_gap_s bounds the time between two decode
    # steps: prefill and scoring chunks run between them, each sized to fit this (the model's
    # measured tokens/s times it, rounded down to a power of two, 128 to prefill_step), so a
    # decode step waits at most one chunk. prefill_chunk_tokens fixes the chunk instead (0:
    # sized from max_decode_gap_s). prefill_order: which ready prefill runs first, "shortest"
    # (the fewest tokens left in its phase) or "fifo" (arrival).
    max_decode_gap_s: float = 0.1
    prefill_chunk_tokens: int = 0
    prefill_order: str = "shortest"
    # How many jobs a worker holds at once (worker/process/room.py): it takes jobs off its
    # queues while it has a free slot, and, with kv_budget_bytes set, while the job's KV (its
    # model's KV bytes per token times its prompt plus max_tokens) fits beside what its jobs in
    # flight hold; a job that does not fit stays queued for another worker. 1: one job at a
    # time. kv_budget_bytes 0: slots only.
    max_jobs_in_flight: int = 8
    kv_budget_bytes: int = 0

    # Limits.
    max_prompt_tokens: int = 131072
    max_batch_documents: int = 10000
    max_generate_tokens: int = 4096
    # What a result keeps for the job page: the importance in at most this many points (the
    # maximum of each run of positions), and the kept text when at most this many tokens are kept.
    page_curve_points: int = 1024
    page_text_tokens: int = 32768

    # Queue behaviour.
    job_timeout_s: int = 1800
    result_ttl_s: int = 24 * 3600
    failure_ttl_s: int = 7 * 24 * 3600
    retry_max: int = 3
    # A submission of work whose last holder just canceled it waits this long for the stop,
    # then enqueues it afresh (identical submissions share one job; see jobs/client/holders.py).
    stop_wait_s: float = 30.0
    progress_stream_maxlen: int = 1000
    progress_ttl_s: int = 24 * 3600
    # Progress is sent at most once per interval (batched; rate events thinned to the sends).
    progress_interval_s: float = 0.25
    # A batch's tokens/s (BatchHandle.progress()) is smoothed exponentially over this window.
    rate_window_s: float = 3.0
    heartbeat_interval_s: float = 10.0
    # A started job whose worker sent no heartbeat for this long counts as abandoned (the
    # worker died) and is retried elsewhere; must exceed heartbeat_interval_s comfortably.
    heartbeat_ttl_s: float = 60.0
    # How often a worker sweeps RQ's registries for abandoned jobs: an idle one on this
    # interval, a busy one between its jobs (a requeued job waits for a free worker anyway).
    maintenance_interval_s: float = 60.0

    # Logs of workers and the server: "text" lines, or "json" (one object per line with
    # job_id, worker and event, for log collectors; jobs/log_format.py).
    log_format: str = "text"

    # Linux CPU speed-up: preload a system OpenBLAS before mlx.
    openblas: bool = True
    openblas_path: str = ""

    # HTTP front door (`specprefill serve`, package `specprefill_server`) and metrics.
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    # Bearer keys a request must carry (Authorization: Bearer KEY). Empty: no auth.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Refuse new requests with 429 while this many jobs wait in the queue. 0: no limit.
    max_queue_depth: int = 0
    max_upload_bytes: int = 100 * 1024 * 1024  # one Batch API input file
    http_threads: int = 256  # threads that wait on jobs (one per open request)
    batch_poll_s: float = 1.0  # how often the server advances its running batches
    # A request without its answer this long after it arrived gets a 504 (a stream: an error
    # event) and releases its hold on its job. 0: no deadline. A non-streamed request that
    # says how long its SDK waits (X-Stainless-Timeout, x-stainless-read-timeout) is
    # answered within that share of it, so the 504 reaches the client before it gives up.
    http_request_timeout_s: float = 600.0
    http_sdk_timeout_share: float = 0.9
    # How stale the server's view of the live workers and the models they serve may be
    # (a request for a model none serves is a 503 at once instead of waiting in the queue).
    http_workers_refresh_s: float = 1.0
    # /healthz and /readyz: each Redis call of a probe waits at most this long (its own
    # connection, no retries), so a probe answers within a second whatever Redis does.
    http_probe_timeout_s: float = 0.4
    # Origins a browser may call the API from (CORS; "*" any). Empty: no CORS headers.
    http_cors_origins: tuple[str, ...] = ()
    # How long a stored Responses API answer (its conversation, for previous_response_id
    # and GET /v1/responses/{id}) is kept in Redis.
    http_response_ttl_s: int = 24 * 3600
    # A stream that has sent nothing for this long sends a keep-alive (Anthropic's ``ping``
    # event; an SSE comment on the OpenAI APIs), so a client's idle read timeout does not fire
    # during a long prefill. 0: none.
    stream_keepalive_s: float = 10.0
    worker_metrics_port: int = 0  # a worker's Prometheus port; 0: no metrics endpoint
    worker_metrics_host: str = "127.0.0.1"  # its bind address (0.0.0.0 for a remote Prometheus)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Build settings from ``SPECPREFILL_*`` variables, then explicit overrides.

        Without ``environ``: the process environment over a ``.env`` file (the working
        directory's, or ``SPECPREFILL_ENV_FILE``). Every field is checked here (type and
        range, :class:`SettingsError` naming the field, variable and source); unknown
        ``SPECPREFILL_*`` variables are logged with the closest valid name.
        """
        environ, sources = settings_check.merged_environ(environ, ENV_PREFIX)
        settable = _settable_fields()
        settings_check.warn_unknown(environ, list(settable), ENV_PREFIX, sources)
        # REDIS_URL names the queue's Redis unless SPECPREFILL_REDIS_URL does.
        values: dict[str, Any] = {"redis_url": environ["REDIS_URL"]} if environ.get("REDIS_URL") else {}
        try:
            for name, f in settable.items():
                raw = environ.get(ENV_PREFIX + name.upper())
                if raw is not None:
                    values[name] = _parse(name, raw, _field_type(f))
            values.update({k: v for k, v in overrides.items() if v is not None})
            return cls(**_grouped(values, {g: c() for g, c in OPTION_GROUPS.items()}))
        except SettingsError as exc:
            var = ENV_PREFIX + (exc.field or "").upper()
            if exc.field and var in environ and exc.field not in overrides:
                source = sources.get(var, "the environment")
                raise SettingsError(f"{exc} (from {source})", exc.field) from None
            raise

    def __post_init__(self) -> None:
        for group, cls in OPTION_GROUPS.items():
            if not isinstance(getattr(self, group), cls):
                raise SettingsError(f"setting {group}: expected {cls.__name__}, got "
                                    f"{type(getattr(self, group)).__name__}", group)
        check_namespace(self.namespace)
        settings_check.validate(self, ENV_PREFIX)
        if self.log_format not in LOG_FORMATS:
            raise SettingsError(f"setting log_format ({ENV_PREFIX}LOG_FORMAT): must be one of "
                                f"{', '.join(LOG_FORMATS)}, got {self.log_format!r:.40}", "log_format")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise settings_check.SettingsError(
                f"setting compute_dtype ({ENV_PREFIX}COMPUTE_DTYPE): must be one of {', '.join(COMPUTE_DTYPES)}, "
                f"got {self.compute_dtype!r}", "compute_dtype")
        for role in ("draft", "target"):
            bits, group = f"{role}_kv_bits", f"{role}_kv_group_size"
            if getattr(self, bits) not in KV_BITS:
                raise settings_check.SettingsError(
                    f"setting {bits} ({ENV_PREFIX}{bits.upper()}): must be one of {KV_BITS} "
                    f"(0: not quantized), got {getattr(self, bits)!r}", bits)
            if getattr(self, group) not in KV_GROUP_SIZES:
                raise settings_check.SettingsError(
                    f"setting {group} ({ENV_PREFIX}{group.upper()}): must be one of "
                    f"{KV_GROUP_SIZES}, got {getattr(self, group)!r}", group)

    def kv_quantization(self, role: str) -> tuple[int | None, int]:
        """``(kv_bits or None, kv_group_size)`` of the ``"draft"`` or ``"target"`` cache."""
        bits = getattr(self, f"{role}_kv_bits")
        return (bits or None), getattr(self, f"{role}_kv_group_size")

    def replace(self, **changes: Any) -> "Settings":
        """These settings with ``changes``: fields, or option settings by name (``keep=0.3``)."""
        return dataclasses.replace(self, **_grouped(changes, {g: getattr(self, g) for g in OPTION_GROUPS}))

    @property
    def block_store_url(self) -> str:
        return self.cache_redis_url or self.redis_url

    @property
    def heal_queues(self) -> tuple[str, ...]:
        """The low-priority queue behind each of :attr:`queues` (``<queue>-heal``)."""
        return tuple(heal_queue_name(q) for q in self.queues)

    @property
    def queues(self) -> tuple[str, ...]:
        """The RQ queues this deployment uses (RQ's keys are not under ``namespace``, so
        deployments sharing a Redis are kept apart by queue name and by job id)."""
        return self.queue_names or (self.namespace,)


HEAL_QUEUE_SUFFIX = "-heal"


def is_heal_queue(queue: str | None) -> bool:
    """Whether ``queue`` is a heal queue (its jobs are heals, not a user's)."""
    return (queue or "").endswith(HEAL_QUEUE_SUFFIX)


def heal_queue_name(queue: str) -> str:
    """The heal queue behind user queue ``queue``. A node queue's (``<queue>@<node>``, jobs.client.routing)
    is its shared queue's: any node may heal, the blocks go to the shared store, and a heal
    queue of a node nobody listens on would strand its heals."""
    if is_heal_queue(queue):
        return queue
    return queue.partition("@")[0] + HEAL_QUEUE_SUFFIX


def _settable_fields() -> dict[str, dataclasses.Field]:
    """Every setting by name: the plain fields, and each option field (not the groups)."""
    plain = {f.name: f for f in fields(Settings) if f.name not in OPTION_GROUPS}
    options = {name: OPTION_GROUPS[group].__dataclass_fields__[name]
               for name, (group, _) in OPTION_SETTINGS.items()}
    return {**plain, **options}


def _grouped(values: dict[str, Any], bases: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with the option settings (``keep``, ...) folded into their group objects,
    built on ``values``' own group or ``bases``'; a bad one is a :class:`SettingsError`."""
    out = {k: v for k, v in values.items() if k not in OPTION_SETTINGS}
    changes: dict[str, dict[str, Any]] = {}
    for name in values.keys() & OPTION_SETTINGS.keys():
        group, option = OPTION_SETTINGS[name]
        changes.setdefault(group, {})[option] = values[name]
    for group, given in changes.items():
        try:
            out[group] = dataclasses.replace(out.get(group, bases[group]), **given)
        except OptionError as exc:
            raise SettingsError(f"setting {exc.field} ({ENV_PREFIX}{exc.field.upper()}): {exc.problem}",
                                exc.field) from None
    return out


def _field_type(f: dataclasses.Field) -> str:
    return settings_check.field_type(f)


def _parse(name: str, raw: str, type_name: str) -> Any:
    try:
        if type_name == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name.startswith("tuple"):
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        return raw
    except ValueError:
        raise SettingsError(
            f"{ENV_PREFIX}{name.upper()}={raw!r}: expected a {type_name} value", name
        ) from None
