"""The service's configuration: one object, read from ``SPECPREFILL_*`` environment variables.

Its fields are declared by role, one module each, so what a process reads is found in one place:

- :mod:`jobs.settings.deployment`: every process (Redis, namespace, queues, routing, logs);
- :mod:`jobs.settings.job`: a job's defaults (the SpecPrefill options), limits and lifetimes,
  read where it is built and again where it runs;
- :mod:`jobs.settings.client`: a submitter; :mod:`jobs.settings.worker`: a worker;
  :mod:`jobs.settings.server`: the HTTP server.

:class:`Settings` is them combined: one flat object (``settings.heal_ttl_s``), each field a
``SPECPREFILL_<FIELD>`` variable. :mod:`jobs.settings.check` checks every field when it is built
(each role module declares its fields' ranges and choices); :mod:`jobs.settings.env` reads the
environment and ``.env``. Library code (``specprefill``, ``cache_store``) takes explicit
arguments; only the service layers read settings, and they pass values down.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Mapping

from jobs.settings import client, deployment, env, job, server, worker
from jobs.settings.check import ENV_PREFIX, SettingsError, field_type, validate, variable
from jobs.settings.client import ClientSettings
from jobs.settings.deployment import DeploymentSettings, heal_queue_name, is_heal_queue
from jobs.settings.job import OPTION_GROUPS, OPTION_SETTINGS, JobSettings
from jobs.settings.server import ServerSettings
from jobs.settings.worker import REPO_ROOT, SHIPPED_MODELS, WorkerSettings
from specprefill.options import OptionError

__all__ = ["ENV_PREFIX", "OPTION_GROUPS", "OPTION_SETTINGS", "REPO_ROOT", "ROLES", "SHIPPED_MODELS",
           "Settings", "SettingsError", "heal_queue_name", "is_heal_queue"]

# role -> the class declaring its fields (the order of the fields in Settings)
ROLES = {"deployment": DeploymentSettings, "job": JobSettings, "client": ClientSettings,
         "worker": WorkerSettings, "server": ServerSettings}
RANGES = {**deployment.RANGES, **job.RANGES, **client.RANGES, **worker.RANGES, **server.RANGES}
CHOICES = {**deployment.CHOICES, **worker.CHOICES}
CHECKS = (job.check, deployment.check, worker.check)  # rules beyond one field's range


@dataclass(frozen=True)
class Settings(ServerSettings, WorkerSettings, ClientSettings, JobSettings, DeploymentSettings):
    """Every tunable of the service, the roles' fields in one object (:data:`ROLES`). Override
    any field with ``SPECPREFILL_<FIELD>``."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Build settings from ``SPECPREFILL_*`` variables, then explicit overrides.

        Without ``environ``: the process environment over a ``.env`` file (the working
        directory's, or ``SPECPREFILL_ENV_FILE``). Every field is checked here (type and
        range, :class:`SettingsError` naming the field, variable and source); unknown
        ``SPECPREFILL_*`` variables are logged with the closest valid name.
        """
        environ, sources = env.merged_environ(environ)
        settable = _settable_fields()
        env.warn_unknown(environ, list(settable), sources)
        # REDIS_URL names the queue's Redis unless SPECPREFILL_REDIS_URL does.
        values: dict[str, Any] = {"redis_url": environ["REDIS_URL"]} if environ.get("REDIS_URL") else {}
        try:
            for name, f in settable.items():
                raw = environ.get(variable(name))
                if raw is not None:
                    values[name] = env.parse(name, raw, field_type(f))
            values.update({k: v for k, v in overrides.items() if v is not None})
            return cls(**_grouped(values, {g: c() for g, c in OPTION_GROUPS.items()}))
        except SettingsError as exc:
            var = variable(exc.field or "")
            if exc.field and var in environ and exc.field not in overrides:
                source = sources.get(var, "the environment")
                raise SettingsError(f"{exc} (from {source})", exc.field) from None
            raise

    def __post_init__(self) -> None:
        validate(self, RANGES, CHOICES)
        for check in CHECKS:
            check(self)

    def replace(self, **changes: Any) -> "Settings":
        """These settings with ``changes``: fields, or option settings by name (``keep=0.3``)."""
        return dataclasses.replace(self, **_grouped(changes, {g: getattr(self, g) for g in OPTION_GROUPS}))


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
            raise SettingsError(f"setting {exc.field} ({variable(exc.field)}): {exc.problem}",
                                exc.field) from None
    return out
