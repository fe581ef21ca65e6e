"""The worker's models (drafts and targets alike): loaded once, profiled, warmed up, kept in a bounded LRU.

Each model is verified and described once, when it is loaded
(``specprefill.profile.profile_model``): jobs take its attention sites and cache layout
from the :class:`LoadedModel` and never probe it again. A model's *identity* roots its
block-store keys, so two workers that load the same weights share KV blocks and different
weights never do: a local folder is identified by a SHA-256 of its config and weight files,
a hub id by the repo id plus the resolved snapshot revision.
"""
from __future__ import annotations

import hashlib
import logging
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # imported for annotations only: the worker starts without mlx
    from specprefill.profile import ModelProfile

log = logging.getLogger(__name__)

_HASH_CHUNK = 1 << 22
_identities: dict[tuple, str] = {}  # (folder, file stamps) -> identity, so a folder is hashed once


def _weight_files(folder: Path) -> list[Path]:
    names = ["config.json"] + sorted(p.name for p in folder.glob("*.safetensors"))
    return [folder / n for n in names if (folder / n).is_file()]


def local_identity(folder: str | Path) -> str:
    """``local:<sha256>`` over config.json and every ``*.safetensors`` file (name + bytes)."""
    folder = Path(folder).expanduser().resolve()
    files = _weight_files(folder)
    if not files:
        raise ValueError(f"{folder} holds no config.json or *.safetensors")
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    key = (str(folder), stamp)
    if key not in _identities:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    h.update(chunk)
        _identities[key] = f"local:{h.hexdigest()}"
    return _identities[key]


def hub_identity(repo_id: str) -> str:
    """``hub:<repo>@<revision>`` from the locally resolved snapshot (no network)."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, ValueError) as exc:  # not downloaded here, or not a valid repo id
        raise ValueError(f"{repo_id[:200]!r} is neither a model folder nor a hub "
                         f"model downloaded on this worker ({type(exc).__name__})") from None
    return f"hub:{repo_id}@{path.name}"


def model_identity(name: str) -> str:
    """Identity of a model named by a local folder or a hub id."""
    return local_identity(name) if Path(name).expanduser().is_dir() else hub_identity(name)


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model (a draft or a target) with what jobs need besides the weights."""

    name: str
    model: Any
    tokenizer: Any
    identity: str
    fingerprint: str  # names its stored KV blocks (weights identity + profile description)
    vocab_size: int | None
    load_seconds: float
    profile: ModelProfile | None = None  # attention sites, cache layout (None: a test's fake model)


def _vocab_size(model: Any) -> int | None:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def warm_up(model: Any) -> None:
    """One tiny forward pass so the first job does not pay for lazy initialisation."""
    import mlx.core as mx

    mx.eval(model(mx.array([[1, 2, 3, 4]])))


def _default_loader(name: str) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(name)


def _default_prompt_tools(name: str) -> tuple[Any, int | None]:
    """A model's tokenizer and vocabulary size without its weights (config and tokenizer files)."""
    from mlx_lm.utils import _download, load_config, load_tokenizer

    path = _download(name)
    config = load_config(path)
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return (load_tokenizer(path, eos_token_ids=config.get("eos_token_id")),
            int(size) if isinstance(size, int) else None)


def _default_profile(model: Any) -> ModelProfile:
    from specprefill.profile import profile_model

    return profile_model(model)


def _default_fingerprint(profile: ModelProfile, identity: str, block_size: int) -> str:
    from cache_store import model_fingerprint

    return model_fingerprint(profile.description, identity, block_size=block_size)


def release_cached_buffers() -> None:
    """Return MLX's cache of freed buffers to the system (a no-op if MLX is not loaded).

    MLX keeps freed buffers for reuse, so an idle worker would hold on to the working set
    of its largest recent job (tiny model, 600- and 8000-token jobs: 170 MB resident
    between jobs without this, 110 MB with it). Pending work is synchronised first: a bare
    clear races in-flight evaluation.
    """
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return
    mx.synchronize()
    mx.clear_cache()


class ModelPool:
    """At most ``capacity`` loaded models, least recently used evicted first.

    The seams (``loader``, ``profile``, ``fingerprint``, ``identify``, ``warm``) default to
    mlx-lm, ``specprefill.profile.profile_model`` (verifies the model: it raises
    ``UnsupportedModelError`` saying why it cannot be scored), ``cache_store.model_fingerprint``
    of the profile's description, the weights' identity and a tiny warm-up pass.
    """

    def __init__(self, capacity: int = 2, *, block_size: int = 256,
                 loader: Callable[[str], tuple[Any, Any]] = _default_loader,
                 profile: Callable[[Any], Any] = _default_profile,
                 fingerprint: Callable[[Any, str, int], str] = _default_fingerprint,
                 identify: Callable[[str], str] = model_identity,
                 warm: Callable[[Any], None] = warm_up,
                 prompt_tools: Callable[[str], tuple[Any, int | None]] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"model_lru_size: {capacity}, must be >= 1")
        self.capacity = capacity
        self.block_size = block_size
        self._loader, self._profile, self._fingerprint = loader, profile, fingerprint
        self._identify, self._warm = identify, warm
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self.loads = 0
        if prompt_tools is None:  # a custom loader: its tokenizer (and model args) stand in
            prompt_tools = (_default_prompt_tools if loader is _default_loader else
                            lambda name: (lambda m, t: (t, _vocab_size(m)))(*loader(name)))
        self._prompt_tools = prompt_tools
        self._tokenizers: OrderedDict[str, tuple[Any, int | None]] = OrderedDict()

    def __contains__(self, name: str) -> bool:
        return name in self._models

    def names(self) -> list[str]:
        return list(self._models)

    def get(self, name: str, field: str = "draft_model") -> LoadedModel:
        """The loaded model ``name``, loading it on a miss; errors name the job's ``field``.

        The least recently used model is evicted before a load, not after it, so a worker
        never holds more than ``capacity`` models in its pool (unified memory on a Mac).
        """
        if name in self._models:
            self._models.move_to_end(name)
            return self._models[name]
        t0 = time.perf_counter()
        try:
            identity = self._identify(name)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None
        while len(self._models) >= self.capacity:
            self._evict()
        try:
            model, tokenizer = self._loader(name)
            profile = self._profile(model)  # UnsupportedModelError (a ValueError) names the reason
        except ValueError as exc:  # mlx-lm's "model type not supported" is one too
            raise ValueError(f"{field}: {name[:200]!r}: {exc}") from None
        self._warm(model)
        loaded = LoadedModel(name, model, tokenizer, identity,
                             self._fingerprint(profile, identity, self.block_size),
                             _vocab_size(model), time.perf_counter() - t0, profile)
        self.loads += 1
        log.info("model %s loaded in %.2fs (%s)", name, loaded.load_seconds, identity)
        self._models[name] = loaded
        return loaded

    def prompt_tools(self, name: str, field: str = "draft_model") -> tuple[Any, int | None]:
        """``name``'s tokenizer and vocabulary size, without loading its weights if it is not
        loaded (admission decides whether a job needs the model at all)."""
        if name in self._models:
            return self._models[name].tokenizer, self._models[name].vocab_size
        if name not in self._tokenizers:
            try:
                self._identify(name)
                self._tokenizers[name] = self._prompt_tools(name)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{field}: {name[:200]!r}: {exc}") from None
            while len(self._tokenizers) > 4 * self.capacity:
                self._tokenizers.popitem(last=False)
        return self._tokenizers[name]

    def _evict(self) -> None:
        name, _ = self._models.popitem(last=False)
        log.info("model %s evicted from the LRU", name)
        release_cached_buffers()
