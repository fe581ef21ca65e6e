"""The worker's models (drafts and targets alike): loaded once, verified per role, warmed up, kept in a bounded LRU.

Each model is verified once per role it is used in, the first time it is asked for in that
role: as a draft by the kernel probe (``specprefill.profile.profile_model``: exact importance
or refused, with the draft's KV quantization), as a target by what sparse prefill needs
(``specprefill.attention.target.target_profile``: positions, windows, cache types), never by
the draft's probe. Jobs take the profiles from the :class:`LoadedModel` and never probe again;
a model refused in its only role is dropped from the pool. A model's *identity* roots its
block-store keys, so two workers that load the same weights share KV blocks and different
weights never do: a local folder is identified by a SHA-256 of its config and weight files,
a hub id by the repo id plus the resolved snapshot revision.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from jobs.contract.model_names import ModelCatalog, UnknownModelError, looks_like_path
from worker.context_window import ContextWindow, context_window, model_config

if TYPE_CHECKING:  # imported for annotations only: the worker starts without mlx
    from specprefill.attention.target import TargetProfile
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


def hub_snapshot(repo_id: str, *, allow_download: bool = False,
                 on_download: Callable[[], None] | None = None) -> Path:
    """The local snapshot folder of hub model ``repo_id``: from this worker's hub cache, or
    downloaded (``allow_download``; ``on_download()`` is told first). Messages name the repo
    id only (never a path of this worker's)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo_id, local_files_only=True,
                                      allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except HFValidationError:
        raise ValueError("is neither a model name this worker knows, nor a folder on it, "
                         "nor a valid hub id") from None
    except (OSError, ValueError):  # not in this worker's hub cache
        if not allow_download:
            raise ValueError(f"is a hub model not downloaded on this worker: pre-download it "
                             f"there with `hf download {repo_id}` (or let the worker download "
                             "it: SPECPREFILL_ALLOW_DOWNLOADS=1)") from None
    if on_download is not None:
        on_download()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as exc:  # network, auth, a missing repo: the job fails, the worker goes on
        raise ValueError(f"could not be downloaded from the hub ({type(exc).__name__}); "
                         f"pre-download it on the worker with `hf download {repo_id}`") from None


def hub_identity(repo_id: str, snapshot: Path | None = None) -> str:
    """``hub:<repo>@<revision>`` from the locally resolved snapshot (no network)."""
    snapshot = snapshot or hub_snapshot(repo_id)
    return f"hub:{repo_id}@{snapshot.name}"


@dataclass(frozen=True)
class Located:
    """Where the model a job named is on this worker: what to load and its identity."""

    path: str
    identity: str


def locate(name: str, catalog: ModelCatalog, *, allow_download: bool = False,
           on_download: Callable[[], None] | None = None) -> Located:
    """Resolve a job's model ``name`` (a default, an alias, a folder or a hub id) on this
    worker; a ``ValueError`` says why not without showing this worker's paths."""
    source = catalog.source(name)
    folder = Path(source).expanduser()
    if folder.is_dir():
        return Located(str(folder), local_identity(folder))
    if looks_like_path(source):
        where = "the folder it names" if catalog.kind(name) == "given" else "its folder"
        raise ValueError(f"{where} is missing on this worker")
    snapshot = hub_snapshot(source, allow_download=allow_download, on_download=on_download)
    return Located(str(snapshot), hub_identity(source, snapshot))


def scrub(text: str, *paths: str | Path) -> str:
    """``text`` with each of ``paths`` (as given, expanded and resolved) shown as ``<model>``
    (a hub id is no path: it stays)."""
    forms = set()
    for p in paths:
        p = str(p)
        if looks_like_path(p) or os.path.exists(os.path.expanduser(p)):
            forms.update({p, os.path.expanduser(p), os.path.realpath(os.path.expanduser(p))})
    for form in sorted((f for f in forms if len(f) > 1), key=len, reverse=True):
        text = text.replace(form, "<model>")
    return text


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model (a draft or a target) with what jobs need besides the weights."""

    name: str
    model: Any
    tokenizer: Any
    identity: str
    fingerprint: str  # names its stored blocks (weights + draft profile); "" until verified as a draft
    vocab_size: int | None
    load_seconds: float
    profile: ModelProfile | None = None  # as a draft: layer roles, cache layout (None: not yet, or a fake)
    target_profile: TargetProfile | None = None  # as a target: ropes, factors, window (None: not yet)
    roles: frozenset[str] = frozenset()  # roles verified ("draft", "target")
    context: ContextWindow | None = None  # the window its config declares (None: it declares none)
    dtypes: tuple[str, ...] = ()  # its parameters' dtypes after the compute-dtype cast ("": not an mlx model)


def _vocab_size(model: Any) -> int | None:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def warm_up(model: Any) -> None:
    """One tiny forward pass so the first job does not pay for lazy initialisation."""
    import mlx.core as mx

    mx.eval(model(mx.array([[1, 2, 3, 4]])))


def computing_in(model: Any, compute_dtype: str) -> tuple[Any, tuple[str, ...]]:
    """``model`` cast to the worker's ``compute_dtype`` (``Settings.compute_dtype``; quantized
    weights dequantized) and its parameter dtypes; a model that is no mlx module is left as it is."""
    import mlx.nn as nn

    if not isinstance(model, nn.Module):
        return model, ()
    from specprefill.compute_dtype import cast, parameter_dtypes, resolve

    dtype = resolve(compute_dtype)
    if dtype is not None:
        cast(model, dtype)
    return model, parameter_dtypes(model)


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


def draft_profiler(kv_bits: int | None = None, kv_group_size: int = 64) -> Callable[[Any], ModelProfile]:
    """The draft verification with the worker's KV quantization (``Settings.draft_kv_bits``)."""
    def profile(model: Any) -> ModelProfile:
        from specprefill.profile import profile_model

        return profile_model(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
    return profile


def target_profiler(kv_bits: int | None = None, kv_group_size: int = 64) -> Callable[[Any], TargetProfile]:
    """The target verification with the worker's KV quantization (``Settings.target_kv_bits``)."""
    def profile(model: Any) -> TargetProfile:
        from specprefill.attention.target import target_profile

        return target_profile(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
    return profile


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

    Jobs name models; ``catalog`` (the worker's ``jobs.contract.model_names.ModelCatalog``, set by
    its runtime) resolves the names, so two names of one folder share one loaded model.
    The seams (``loader``, ``profile``, ``target_profile``, ``fingerprint``, ``identify``,
    ``warm``) default to mlx-lm, :func:`draft_profiler` and :func:`target_profiler` (each
    raises ``UnsupportedModelError`` saying why the model cannot serve in that role),
    ``cache_store.model_fingerprint`` of the draft profile's description, :func:`locate`
    and a tiny warm-up pass.
    """

    def __init__(self, capacity: int = 2, *, block_size: int = 256,
                 loader: Callable[[str], tuple[Any, Any]] = _default_loader,
                 profile: Callable[[Any], Any] | None = None,
                 target_profile: Callable[[Any], Any] | None = None,
                 fingerprint: Callable[[Any, str, int], str] = _default_fingerprint,
                 identify: Callable[[str], str] | None = None,
                 warm: Callable[[Any], None] = warm_up,
                 catalog: ModelCatalog | None = None, allow_downloads: bool = False,
                 prompt_tools: Callable[[str], tuple[Any, int | None]] | None = None,
                 compute_dtype: str = "model") -> None:
        if capacity < 1:
            raise ValueError(f"model_lru_size: {capacity}, must be >= 1")
        self.capacity = capacity
        self.block_size = block_size
        self.compute_dtype = compute_dtype
        self._loader, self._fingerprint = loader, fingerprint
        self._profile = profile or draft_profiler()
        self._target_profile = target_profile or target_profiler()
        self._identify, self._warm = identify, warm  # identify: a test's (path as given)
        self.catalog, self.allow_downloads = catalog, allow_downloads
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()  # by the path loaded
        self.loads = 0
        if prompt_tools is None:  # a custom loader: its tokenizer (and model args) stand in
            prompt_tools = (_default_prompt_tools if loader is _default_loader else
                            lambda name: (lambda m, t: (t, _vocab_size(m)))(*loader(name)))
        self._prompt_tools = prompt_tools
        self._tokenizers: OrderedDict[str, tuple[Any, int | None]] = OrderedDict()

    def _catalog(self) -> ModelCatalog:
        if self.catalog is None:
            from jobs.settings import Settings

            self.catalog = ModelCatalog.from_settings(Settings())
        return self.catalog

    def __contains__(self, name: str) -> bool:
        return any(name in (m.name, path) for path, m in self._models.items())

    def names(self) -> list[str]:
        """The names the loaded models were first asked for."""
        return [m.name for m in self._models.values()]

    def loaded(self, name: str) -> LoadedModel | None:
        """The model loaded under ``name``, if it is (its place in the LRU order unchanged)."""
        return next((m for m in self._models.values() if m.name == name), None)

    def _locate(self, name: str, on_download: Callable[[], None] | None) -> Located:
        if self._identify is not None:
            source = self._catalog().source(name)
            return Located(source, self._identify(source))
        return locate(name, self._catalog(), allow_download=self.allow_downloads,
                      on_download=on_download)

    def get(self, name: str, field: str = "draft_model",
            on_download: Callable[[], None] | None = None) -> LoadedModel:
        """The loaded model ``name`` verified for the job's ``field`` (``target_model``: as a
        target, else as a draft), loading it on a miss; errors name the job's ``field`` and
        ``name``, never this worker's paths. ``on_download()`` runs before a download.

        The least recently used model is evicted before a load, not after it, so a worker
        never holds more than ``capacity`` models in its pool (unified memory on a Mac).
        """
        loaded = self._find(name) or self._load(name, field, on_download)
        return self._verified(loaded, "target" if field == "target_model" else "draft", field)

    def loaded_model(self, name: str) -> LoadedModel | None:
        """The model a job names if it is loaded now (its LRU place kept), else None."""
        return next((m for m in self._models.values() if m.name == name), None)

    def _find(self, name: str) -> LoadedModel | None:
        for path, m in self._models.items():  # a name asked for before: no hashing again
            if m.name == name:
                self._models.move_to_end(path)
                return m
        return None

    def _load(self, name: str, field: str, on_download: Callable[[], None] | None) -> LoadedModel:
        t0 = time.perf_counter()
        source = self._catalog().source(name)
        try:
            where = self._locate(name, on_download)
        except ValueError as exc:
            raise UnknownModelError(f"{field}: {name[:200]!r}: {scrub(str(exc), source)}") from None
        if where.path in self._models:
            self._models.move_to_end(where.path)
            return self._models[where.path]
        while len(self._models) >= self.capacity:
            self._evict()
        try:
            model, tokenizer = self._loader(where.path)
        except (ValueError, OSError, KeyError) as exc:  # mlx-lm's "model type not supported" too
            raise ValueError(f"{field}: {name[:200]!r}: {scrub(str(exc), source, where.path)}") from None
        model, dtypes = computing_in(model, self.compute_dtype)
        self._warm(model)
        loaded = LoadedModel(name, model, tokenizer, where.identity, "", _vocab_size(model),
                             time.perf_counter() - t0, context=context_window(model_config(where.path, model)),
                             dtypes=dtypes)
        self.loads += 1
        log.info("model %s loaded from %s in %.2fs (%s, computing in %s)", name, where.path,
                 loaded.load_seconds, where.identity, "/".join(dtypes) or "its own dtype")
        self._models[where.path] = loaded
        return loaded

    def _verified(self, loaded: LoadedModel, role: str, field: str) -> LoadedModel:
        """``loaded`` verified as a ``role`` once (the profile kept in the pool)."""
        if role in loaded.roles:
            return loaded
        key = next((k for k, m in self._models.items() if m is loaded), None)
        try:  # UnsupportedModelError (a ValueError) names the reason
            if role == "draft":
                profile = self._profile(loaded.model)
                verified = replace(loaded, profile=profile, roles=loaded.roles | {role},
                                   fingerprint=self._fingerprint(profile, loaded.identity, self.block_size))
            else:
                verified = replace(loaded, target_profile=self._target_profile(loaded.model),
                                   roles=loaded.roles | {role})
        except ValueError as exc:
            if not loaded.roles and key is not None:
                del self._models[key]  # refused in its only role: do not hold its memory
                release_cached_buffers()
            raise ValueError(f"{field}: {loaded.name[:200]!r}: {scrub(str(exc), key or '')}") from None
        if key is not None:
            self._models[key] = verified
        return verified

    def prompt_tools(self, name: str, field: str = "draft_model",
                     on_download: Callable[[], None] | None = None) -> tuple[Any, int | None]:
        """``name``'s tokenizer and vocabulary size, without loading its weights if it is not
        loaded (admission decides whether a job needs the model at all)."""
        loaded = next((m for m in self._models.values() if m.name == name), None)
        if loaded is not None:
            return loaded.tokenizer, loaded.vocab_size
        if name not in self._tokenizers:
            source = self._catalog().source(name)
            try:
                where = self._locate(name, on_download)
            except ValueError as exc:
                raise UnknownModelError(f"{field}: {name[:200]!r}: {scrub(str(exc), source)}") from None
            try:
                self._tokenizers[name] = self._prompt_tools(where.path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{field}: {name[:200]!r}: {scrub(str(exc), source)}") from None
            while len(self._tokenizers) > 4 * self.capacity:
                self._tokenizers.popitem(last=False)
        return self._tokenizers[name]

    def _evict(self) -> None:
        _, loaded = self._models.popitem(last=False)
        log.info("model %s evicted from the LRU", loaded.name)
        release_cached_buffers()
