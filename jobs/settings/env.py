"""Where settings come from: the process's ``SPECPREFILL_*`` variables over a ``.env`` file, each
parsed to its field's type; a ``SPECPREFILL_*`` variable that is no setting is logged with the
closest valid name (a typo such as ``SPECPREFILL_KEPP`` is otherwise silently ignored).
"""
from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from jobs.settings.check import ENV_PREFIX, SettingsError, variable

log = logging.getLogger("jobs.settings")

# SPECPREFILL_* variables read elsewhere (not settings): never warned about.
OTHER_VARIABLES = frozenset({"ENV_FILE", "REDIS_SERVER", "HARNESS_FORBID_PICKLE", "CHROMIUM"})
_warned: set[str] = set()


def warn_unknown(environ: Mapping[str, str], known: list[str], sources: Mapping[str, str]) -> None:
    """Log once per name each ``SPECPREFILL_*`` variable that is no setting, with the closest
    valid name."""
    valid = [variable(k) for k in known]
    for var in environ:
        if not var.startswith(ENV_PREFIX) or var in valid or var[len(ENV_PREFIX):] in OTHER_VARIABLES:
            continue
        if var in _warned:
            continue
        _warned.add(var)
        close = difflib.get_close_matches(var, valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "it is ignored"
        log.warning("%s (in %s): unknown setting; %s", var, sources.get(var, "the environment"), hint)


def env_file_path(environ: Mapping[str, str]) -> Path | None:
    """``SPECPREFILL_ENV_FILE`` (empty: none), else ``.env`` in the working directory."""
    named = environ.get("SPECPREFILL_ENV_FILE")
    if named is not None:
        return Path(named) if named else None
    return Path(".env")


def read_env_file(path: Path | None) -> dict[str, str]:
    """The ``SPECPREFILL_*`` and ``REDIS_URL`` entries of a ``.env`` file ({} if absent)."""
    if path is None or not path.is_file():
        return {}
    from dotenv import dotenv_values

    values = dotenv_values(path)
    return {k: v for k, v in values.items()
            if v is not None and (k.startswith(ENV_PREFIX) or k == "REDIS_URL")}


def merged_environ(environ: Mapping[str, str] | None) -> tuple[Mapping[str, str], dict[str, str]]:
    """The variables to read (the process's, over its ``.env``) and each one's source."""
    if environ is not None:
        return environ, {k: "the given environment" for k in environ}
    path = env_file_path(os.environ)
    from_file = read_env_file(path)
    sources = {k: str(path) for k in from_file}
    sources.update({k: "the environment" for k in os.environ})
    return {**from_file, **os.environ}, sources


def parse(name: str, raw: str, type_name: str) -> Any:
    """The value of variable ``SPECPREFILL_<NAME>=raw`` for a field of type ``type_name``."""
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
        raise SettingsError(f"{variable(name)}={raw!r}: expected a {type_name} value", name) from None
