"""The settings of a worker: the models it loads and how they compute, its KV blocks and local
tier, heals, fallbacks, what its results keep, progress, liveness, metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jobs.settings.check import Bounds, SettingsError, variable
from specprefill.options import COMPUTE_DTYPES, PREFILL_STEP, STATE_CHECKPOINT_BLOCKS

KV_BITS = (0, 2, 3, 4, 5, 6, 8)  # what mx.quantize takes (0: a plain cache)
KV_GROUP_SIZES = (32, 64, 128)
PREFILL_ORDERS = ("shortest", "fifo")  # worker/engine/scheduler.py
REPO_ROOT = Path(__file__).resolve().parents[2]


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
class WorkerSettings:
    """A worker: its models and their caches, blocks, heals, fallbacks, results, liveness."""

    # Models (jobs/contract/model_names.py): a job names them, the worker resolves the names.
    draft_model: str = field(default_factory=_default_draft_model)
    """What the name ``draft`` loads (a folder, hub id or alias). A client that sets it sends
    it as its jobs' draft. Default: the shipped tiny draft."""
    target_model: str = field(default_factory=_default_target_model)
    """What the name ``target`` loads; as ``draft_model``. Default: the shipped tiny target."""
    preload_models: tuple[str, ...] = ()
    """Models loaded when the worker starts, so its first job does not pay for loading."""
    model_lru_size: int = 2
    """How many models a worker keeps loaded (the least recently used goes first)."""
    allowed_models: tuple[str, ...] = ()
    """Models a job may name. Empty: any local folder or hub id; otherwise these plus
    draft_model, target_model, preload_models and the aliases, and a job naming another one is
    refused."""
    models: tuple[str, ...] = ()
    """Aliases ``NAME=PATH_OR_HUB_ID`` a job may name."""
    allow_downloads: bool = False
    """Whether a hub id missing from this worker's hub cache is downloaded (else the job is
    refused, saying how to pre-download it)."""
    worker_name: str = ""
    """This worker's name. Empty: ``<host>.<pid>``."""
    node_name: str = ""
    """This worker's node: one machine with its own local tier, whose workers listen on its node
    queue (``<queue>@<node>``) before the shared queue. Empty: the host name."""

    # How the models compute.
    prefill_step: int = PREFILL_STEP
    """Tokens per forward pass of this worker's prefills."""
    draft_kv_bits: int = 0
    """KV-cache quantization of the draft's cache (scoring and stored blocks; mlx-lm's
    ``kv_bits``). 0: not quantized. Models with sliding-window layers are refused with it."""
    draft_kv_group_size: int = 64
    """The group size of the draft's quantized KV cache."""
    target_kv_bits: int = 0
    """KV-cache quantization of the target's cache (sparse prefill and decoding). 0: not quantized."""
    target_kv_group_size: int = 64
    """The group size of the target's quantized KV cache."""
    compute_dtype: str = "auto"
    """What the draft and the target compute in (specprefill/compute_dtype.py): their floating
    weights cast after loading, quantized ones dequantized. ``auto``: float32 on MLX's CPU
    backend (bf16 and quantized matmuls there are 8x and more slower), the model's own dtype on
    Metal; ``model``: always the model's own; or float32, bfloat16, float16."""

    # The block store.
    block_size: int = 256
    """Tokens per stored KV block; every worker of a deployment must agree, or they write blocks
    the others never read."""
    block_ttl_s: int = 24 * 3600
    """How long a stored block lives after its last use."""
    state_checkpoint_blocks: int = STATE_CHECKPOINT_BLOCKS
    """A hybrid model's recurrent state is stored at checkpoints only: the end of the system
    prefix, each stored prompt's last full block, and every this many blocks (0: only those)."""
    local_cache_dir: str = ""
    """This node's local tier of blocks in front of the shared store: a folder on its SSD, shared
    by the node's workers. Empty: none."""
    local_cache_bytes: int = 16 * 2**30
    """The local tier's size; the least recently used blocks go past it."""
    memo_ttl_s: int = 24 * 3600
    """How long a memoized selection (the kept ranges of a prompt and its options) is kept."""
    target_prefix_cache: bool = True
    """Store the target's KV of fully prefilled prompt prefixes (system prompt, tools, short
    earlier turns) as blocks under its fingerprint, and restore them for the next job."""

    # Heal jobs (worker.job.heal), queued on "<queue>-heal": workers listen there after their
    # own queues, so a heal runs only when no user job waits.
    heal: bool = True
    """After every generate job, enqueue and run a heal: the target's prefill of what the store
    lacks of the conversation as the next turn renders it (a sparse prompt's holes, the answer
    and the template's end of turn), stored as target blocks (a job turns its own off with the
    generate option ``heal``)."""
    heal_ttl_s: int = 3600
    """How long a queued heal may wait before RQ drops it (a stale conversation is not worth it)."""
    heal_idle_s: float = 0.1
    """A heal's next block waits until no user job has started or ended on its worker for this
    long: a client's next request (a closed loop's next, an agent's turn after a quick tool)
    arrives on the heels of the last answer and would otherwise wait for a heal block already on
    the CPU. For as long, the worker takes no heal off its queues. 0: a heal starts its blocks at once."""
    heal_wait_ms: int = 0
    """How long a turn that would go sparse may wait for the running heal of its conversation,
    when that heal's ETA is under this and shorter than the turn's own sparse prefill at the
    heal's rate. 0: never wait (it uses what is stored)."""

    # Fallbacks.
    fallback_strict: bool = False
    """When the draft's scoring, its block store or the sparse prefill fails, a generate job
    answers with a plain full prefill and a prefill job keeps every token, both saying why
    (``fallback``). Strict: the job fails instead."""
    draft_timeout_s: float = 0.0
    """The draft's scoring time budget per job: past it the draft stops and the job falls back as
    above. 0: no budget."""

    # The engine (worker/engine): every job the worker holds runs in one loop; decoding jobs
    # advance together one token per step, prefill and scoring chunks run between the steps.
    max_decode_gap_s: float = 0.1
    """The most time between two decode steps: each prefill or scoring chunk is sized to fit it
    (the model's measured tokens/s times it, rounded down to a power of two, 128 to
    prefill_step), so a decode step waits at most one chunk."""
    prefill_chunk_tokens: int = 0
    """A fixed prefill chunk instead. 0: sized from max_decode_gap_s."""
    prefill_order: str = "shortest"
    """Which ready prefill runs first: ``shortest`` (the fewest tokens left in its phase) or
    ``fifo`` (arrival); either way one that waited ``MAX_WAIT_S`` for a turn goes first
    (worker/engine/scheduler.py)."""
    max_jobs_in_flight: int = 8
    """How many jobs a worker holds at once (worker/process/room.py): it takes jobs off its
    queues while it has a free slot. 1: one job at a time."""
    kv_budget_bytes: int = 0
    """With it set, a worker also takes a job only while the job's KV (its model's KV bytes per
    token times its prompt plus max_tokens) fits beside what its jobs in flight hold; a job that
    does not fit stays queued for another worker. 0: slots only."""

    # What a result keeps for the job page.
    page_curve_points: int = 1024
    """The importance curve in at most this many points (the maximum of each run of positions)."""
    page_text_tokens: int = 32768
    """The kept text, when at most this many tokens are kept."""

    # Progress, liveness, housekeeping.
    progress_stream_maxlen: int = 1000
    """The most events a job's progress stream keeps."""
    progress_ttl_s: int = 24 * 3600
    """How long a job's progress stream lives after its last event."""
    progress_interval_s: float = 0.25
    """Progress is sent at most once per this interval (batched; rate events thinned to the sends)."""
    heartbeat_interval_s: float = 10.0
    """How often a worker beats (its RQ heartbeat and its job's claim)."""
    heartbeat_ttl_s: float = 60.0
    """A started job whose worker sent no heartbeat for this long counts as abandoned (the worker
    died) and is retried elsewhere; at least twice heartbeat_interval_s. Submitters read it too
    (whether a node queue has a live listener)."""
    maintenance_interval_s: float = 60.0
    """How often a worker sweeps RQ's registries for abandoned jobs: an idle one on this
    interval, a busy one between its jobs."""

    # The machine.
    openblas: bool = True
    """Linux CPU speed-up: preload a fast BLAS before mlx (a system OpenBLAS, else the mkl wheel's)."""
    openblas_path: str = ""
    """The BLAS library to preload. Empty: a system OpenBLAS, else the mkl wheel's libmkl_rt."""
    blas_threads: int = 0
    """Threads of the preloaded BLAS's multiplies. 0: one fewer than the cores (at least one):
    a multiply's threads wait for one another, and a core the HTTP server, Redis or a client
    takes stalls them all (docs/load.md: decode at 8 clients on 2 cores)."""
    worker_metrics_port: int = 0
    """A worker's Prometheus port. 0: no metrics endpoint."""
    worker_metrics_host: str = "127.0.0.1"
    """The metrics endpoint's bind address (0.0.0.0 for a remote Prometheus)."""

    def kv_quantization(self, role: str) -> tuple[int | None, int]:
        """``(kv_bits or None, kv_group_size)`` of the ``"draft"`` or ``"target"`` cache."""
        bits = getattr(self, f"{role}_kv_bits")
        return (bits or None), getattr(self, f"{role}_kv_group_size")


RANGES: dict[str, Bounds] = {
    "model_lru_size": (1, None), "prefill_step": (1, None), "block_size": (1, None), "block_ttl_s": (1, None),
    "state_checkpoint_blocks": (0, None), "local_cache_bytes": (1, None), "memo_ttl_s": (1, None),
    "heal_ttl_s": (1, None), "heal_idle_s": (0, 60), "heal_wait_ms": (0, None),
    "max_decode_gap_s": (0.001, 60), "prefill_chunk_tokens": (0, None),
    "max_jobs_in_flight": (1, 256), "blas_threads": (0, 4096), "kv_budget_bytes": (0, None),
    "page_curve_points": (1, None), "page_text_tokens": (0, None),
    "progress_stream_maxlen": (1, None), "progress_ttl_s": (1, None), "progress_interval_s": (0, None),
    "heartbeat_interval_s": (0.001, None), "heartbeat_ttl_s": (0.001, None), "maintenance_interval_s": (0.001, None),
    "worker_metrics_port": (0, 65535),
}
CHOICES = {"compute_dtype": COMPUTE_DTYPES, "draft_kv_bits": KV_BITS, "target_kv_bits": KV_BITS,
           "draft_kv_group_size": KV_GROUP_SIZES, "target_kv_group_size": KV_GROUP_SIZES,
           "prefill_order": PREFILL_ORDERS}


def check(settings: WorkerSettings) -> None:
    if settings.heartbeat_ttl_s < 2 * settings.heartbeat_interval_s:  # else live jobs look dead
        raise SettingsError(f"setting heartbeat_ttl_s ({variable('heartbeat_ttl_s')}): must be at least "
                            f"twice heartbeat_interval_s ({settings.heartbeat_interval_s}), got "
                            f"{settings.heartbeat_ttl_s}", "heartbeat_ttl_s")
