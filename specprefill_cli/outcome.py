"""How a command ends: the exit statuses, and how a failed job's error is told to the user.

One table for every command (printed by ``--help`` and in docs/cli.md):
0 done; 1 a job failed or was stopped; 2 bad input, wherever it was caught (the CLI, the
client or the worker; the message names the field or document); 3 Redis unreachable, at
the start or later; 4 ``--timeout`` ran out (the jobs go on); 130 interrupted (Ctrl-C; the
message says what still runs and how to resume or cancel it).
"""
from __future__ import annotations

import re
from typing import Any, Iterator

from jobs.contract.conversation import ConversationError
from jobs.contract.model_names import UnknownModelError
from jobs.contract.spec import JobSpecError
from specprefill.errors import UnsupportedModelError
from specprefill.options import OptionError

DONE, JOB_FAILED, BAD_INPUT, REDIS_UNREACHABLE, TIMED_OUT, INTERRUPTED = 0, 1, 2, 3, 4, 130

EXIT_STATUS_HELP = """exit status (every command):
  0    done
  1    a job failed or was stopped
  2    bad input, wherever it was caught (the message names the option, field or document)
  3    Redis unreachable (at the start or later)
  4    --timeout ran out (the jobs keep running)
  130  interrupted (Ctrl-C): the message says what still runs and how to resume or cancel it"""

# "pkg.mod.ClassName: message" (an RQ traceback's last line) or "ClassName: message" (an event)
_CLASS_PREFIX = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Z][\w]*(?:Error|Exception)): (.*)$", re.S)
# Errors the worker raises for input it refuses (their message names the field), and their
# subclasses (ContextLengthError is a JobSpecError): a failed job names its error's class.
BAD_INPUT_ERRORS = (JobSpecError, ConversationError, OptionError, UnknownModelError, UnsupportedModelError)


def _with_subclasses(classes: tuple[type, ...]) -> Iterator[type]:
    for cls in classes:
        yield cls
        yield from _with_subclasses(tuple(cls.__subclasses__()))


_BAD_INPUT_CLASSES = frozenset(cls.__name__ for cls in _with_subclasses(BAD_INPUT_ERRORS))
_MODEL_FIELDS = ("draft_model:", "target_model:")


class Interrupted(Exception):
    """Ctrl-C, with what still runs and how to resume or cancel it (exit status 130)."""


def split_error(error: str) -> tuple[str | None, str]:
    """``(class name, message)`` of a worker's error string (class None if it names none)."""
    m = _CLASS_PREFIX.match((error or "").strip())
    return (m.group(1), m.group(2)) if m else (None, (error or "").strip())


def is_bad_input(error: str) -> bool:
    """Whether a failed job's error is the worker refusing its input (not a crash)."""
    cls, message = split_error(error)
    return cls in _BAD_INPUT_CLASSES or (cls == "ValueError" and message.startswith(_MODEL_FIELDS))


def failure(job_id: str, status: str, error: str) -> tuple[int, str]:
    """Exit status and message for a job that ended ``failed`` or ``stopped``.

    Bad input is exit status 2 with the worker's message alone (no class name); any other
    failure is 1 and keeps the class name, which tells a crash from a refusal.
    """
    if status == "failed" and is_bad_input(error):
        return BAD_INPUT, f"job {job_id} failed: {split_error(error)[1]}"
    return JOB_FAILED, f"job {job_id} {status}: {error}"


def exc_failure(exc: Any) -> tuple[int, str]:
    """:func:`failure` for a :class:`jobs.client.JobFailed`."""
    return failure(exc.job_id, exc.status, exc.error)
