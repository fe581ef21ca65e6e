"""Every error class the worker's side defines, against the exit-status table: each one that
means bad input is exit status 2 (the message alone), every other one 1 (issue 41, item 1)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

from specprefill_cli.outcome import BAD_INPUT, JOB_FAILED, failure

# The packages a job runs in: an error a job fails with is defined in one of them.
PACKAGES = ("worker", "jobs", "specprefill", "cache_store")
# Bad input: the worker refuses what the job asked for; the message names the field.
BAD_INPUT_ERRORS = {"JobSpecError", "ContextLengthError", "OptionError", "ConversationError",
                    "UnknownModelError", "UnsupportedModelError"}
# Not bad input, each with why: a job failing with one of them is exit status 1.
OTHER_ERRORS = {
    "JobStopped": "a cancel or a stop request",
    "DraftStopped": "the draft's time budget (the job falls back)",
    "ClaimLost": "another worker owns the job",
    "CorruptBlockError": "a damaged block-store value (a miss)",
    "OldFormatError": "a block written by an older version (a miss)",
    "SettingsError": "the worker's own settings, refused at its start",
    "RedisUnreachable": "Redis, not the input",
    "RetriesStopped": "a stop request ended the Redis retries",
    "TaskCancelled": "the engine ended a job it held (a stop, a cancel, the worker closing)",
    "EnqueueConflict": "a client-side race",
    "StreamDiverged": "a client-side stream check",
    "JobFailed": "the client's wrapper of a failure",
    "JobLost": "Redis lost the job",
    "ProgressTimeout": "a client-side wait",
    "_PlaceFailed": "the block store's internal retry",
}


def defined_error_classes() -> dict[str, type]:
    """Every exception class defined in a module of ``PACKAGES`` (imported to find them)."""
    found: dict[str, type] = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (isinstance(obj, type) and issubclass(obj, BaseException)
                        and obj.__module__ == info.name):
                    found[obj.__name__] = obj
    return found


def test_every_error_class_a_job_can_fail_with_has_its_exit_status():
    classes = defined_error_classes()
    unclassified = set(classes) - BAD_INPUT_ERRORS - set(OTHER_ERRORS)
    assert not unclassified, f"say whether these mean bad input: {sorted(unclassified)}"
    assert BAD_INPUT_ERRORS <= set(classes), sorted(BAD_INPUT_ERRORS - set(classes))
    for name, cls in sorted(classes.items()):
        expected = BAD_INPUT if name in BAD_INPUT_ERRORS else JOB_FAILED
        # As the worker's failed event says it, and as RQ's traceback's last line does.
        for error in (f"{name}: field: the problem", f"{cls.__module__}.{name}: field: the problem"):
            status, message = failure("job-1", "failed", error)
            assert status == expected, (error, status)
            if expected == BAD_INPUT:
                assert message == "job job-1 failed: field: the problem", message


@pytest.mark.parametrize("name", sorted(BAD_INPUT_ERRORS))
def test_a_stopped_job_is_1_whatever_its_error(name):
    assert failure("job-1", "stopped", f"{name}: x")[0] == JOB_FAILED
