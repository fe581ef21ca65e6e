"""The job contract, the client library and the settings (imports nothing from ``worker``).

- :mod:`jobs.contract`: what a client and a worker agree on: the job spec and its conversation,
  the heal spec, model names, results and their layout, the Redis keys of the queue's side.
- :mod:`jobs.client`: submit, follow and cancel jobs (``Client`` and its handles), who holds a
  shared job, prefix routing and node queues, read-only views for operators, a generate job's
  answer stream, a batch's smoothed rate.
- :mod:`jobs.progress`: progress events over Redis, both ends (the worker publishes, watchers follow).
- :mod:`jobs.settings`: the one configuration object, read from ``SPECPREFILL_*`` and ``.env``.
- :mod:`jobs.connection`: Redis clients and their one retry layer; :mod:`jobs.epoch`: which
  incarnation of Redis a reader sees; :mod:`jobs.deadline`: the one deadline of a timeout;
  :mod:`jobs.log_format`: the logs of workers and the server.

The names a user imports live here (``from jobs import Client, Settings``), loaded on first use:
importing one part (``jobs.contract.spec``) does not load the client, RQ or Redis.
"""
from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, Callable


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]
                 ) -> tuple[dict[str, str], Callable[[str], Any], Callable[[], list[str]]]:
    """A package's names loaded on first use, from ``exports`` (module -> the public names it
    defines): (name -> its module, the package's ``__getattr__``, its ``__dir__``)."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        # Looked up on every use, never cached in the package: a name patched on its module (a
        # test's monkeypatch of jobs.client.client.Client) is what ``from PACKAGE import NAME`` gets.
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *module_of})

    return module_of, __getattr__, __dir__


# module -> the public names it defines (what ``from jobs import NAME`` finds), loaded on first use
_MODULE_OF, __getattr__, __dir__ = lazy_exports(__name__, {
    "jobs.client.client": ("Client", "JobHandle", "BatchHandle", "JobFailed", "JobLost", "StreamDiverged"),
    "jobs.client.answer_stream": ("answer_events",),
    "jobs.contract.spec": ("JobSpec", "JobSpecError", "ContextLengthError", "build_spec"),
    "jobs.contract.results": ("PrefillResult", "GenerateResult"),
    "jobs.contract.model_names": ("UnknownModelError",),
    "jobs.progress.events": ("ProgressEvent",),
    "jobs.progress.batch": ("BatchProgress",),
    "jobs.settings": ("Settings", "SettingsError"),
    "specprefill.options": ("ScoringOptions", "SelectionOptions", "GenerateOptions"),
})
__all__ = sorted(_MODULE_OF)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from jobs.client.client import Client, JobHandle, BatchHandle, JobFailed, JobLost, StreamDiverged
    from jobs.client.answer_stream import answer_events
    from jobs.contract.spec import JobSpec, JobSpecError, ContextLengthError, build_spec
    from jobs.contract.results import PrefillResult, GenerateResult
    from jobs.contract.model_names import UnknownModelError
    from jobs.progress.events import ProgressEvent
    from jobs.progress.batch import BatchProgress
    from jobs.settings import Settings, SettingsError
    from specprefill.options import ScoringOptions, SelectionOptions, GenerateOptions

