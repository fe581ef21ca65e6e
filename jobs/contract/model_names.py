"""Model names: what a job calls a model, and what a worker loads for that name.

A job names its models; the worker resolves the names with its own settings, so nothing
a client sends depends on the client's machine:

- ``draft`` / ``target`` (what a client sends when the user names no model): the
  worker's ``draft_model`` / ``target_model`` settings;
- an alias from the worker's ``models`` setting (``NAME=PATH_OR_HUB_ID,...``);
- anything else as it is: a hub id (``org/name``), or a folder on the worker when the
  user passes a path on purpose.

Messages about a name show the name, never what the worker resolved it to (its paths).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from jobs.settings import Settings

class UnknownModelError(ValueError):
    """A job named a model the worker cannot find: not a name it knows, no such folder, a
    hub id not in its cache. Bad input (the front door's ``model_not_found``), never a
    failure of the draft to fall back from. The message starts with the job's field."""


DEFAULT_DRAFT = "draft"
DEFAULT_TARGET = "target"
ALIAS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # no '/': never a hub id


def job_default(settings: Settings, role: str) -> str:
    """The model name a job gets when it names none: the client's own ``draft_model`` /
    ``target_model`` setting when it was configured (a name, a hub id, or a path the user
    chose), else ``draft`` / ``target``, which each worker resolves to its own default."""
    configured = getattr(settings, f"{role}_model")
    shipped = Settings.__dataclass_fields__[f"{role}_model"].default_factory()
    if configured == shipped:
        return DEFAULT_DRAFT if role == "draft" else DEFAULT_TARGET
    return configured


def parse_aliases(entries: tuple[str, ...]) -> dict[str, str]:
    """``("qwen-draft=/srv/models/qwen",...)`` as a dict; errors name the ``models`` setting."""
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, source = entry.partition("=")
        name, source = name.strip(), source.strip()
        if not sep or not source:
            raise ValueError(f"models: {entry!r:.80} is not NAME=PATH_OR_HUB_ID")
        if not ALIAS_NAME.match(name) or name in (DEFAULT_DRAFT, DEFAULT_TARGET):
            raise ValueError(f"models: alias {name!r:.80} must be 1-128 letters, digits, '.', '_' "
                             f"or '-' and not {DEFAULT_DRAFT!r} or {DEFAULT_TARGET!r}")
        out[name] = source
    return out


def looks_like_path(name: str) -> bool:
    """A name meant as a folder (``/``, ``~``, ``.`` first, or a Windows-style separator)."""
    return name.startswith(("/", "~", ".")) or "\\" in name or os.path.isabs(name)


@dataclass(frozen=True)
class ModelCatalog:
    """The names a worker answers to and what each one loads (its ``source``)."""

    draft: str
    target: str
    aliases: Mapping[str, str]

    @classmethod
    def from_settings(cls, settings: Settings) -> "ModelCatalog":
        return cls(settings.draft_model, settings.target_model, parse_aliases(settings.models))

    def source(self, name: str) -> str:
        """The folder or hub id that ``name`` loads (a default may itself be an alias)."""
        if name == DEFAULT_DRAFT:
            name = self.draft
        elif name == DEFAULT_TARGET:
            name = self.target
        return self.aliases.get(name, name)

    def kind(self, name: str) -> str:
        """How ``name`` is known here: ``default``, ``alias`` or ``given`` (taken as it is)."""
        if name in (DEFAULT_DRAFT, DEFAULT_TARGET):
            return "default"
        return "alias" if name in self.aliases else "given"

    def names(self) -> list[str]:
        """The names this worker serves under: the defaults, then the aliases."""
        return [DEFAULT_DRAFT, DEFAULT_TARGET, *self.aliases]

    def sources(self) -> list[str]:
        return [self.source(n) for n in self.names()]


def public_name(name: str) -> str:
    """``name`` fit to show another machine: a path is shortened to its last part."""
    if not looks_like_path(name):
        return name
    return f"<folder {os.path.basename(os.path.normpath(os.path.expanduser(name)))}>"
