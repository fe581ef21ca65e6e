"""Packaging beyond what pyproject.toml can say: the shipped models (``models/``) go into
the wheel as the data-only package ``specprefill_models`` (``jobs.settings`` finds them
there when no source checkout is around), so ``pip install`` + ``specprefill demo`` works
from any directory. Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

# "specprefill*" also takes the command line (specprefill_cli) and the HTTP server (specprefill_server):
# prefixed names, so installing the wheel never shadows another project's ``cli`` or ``server``.
CODE = ["specprefill*", "cache_store*", "jobs*", "worker*"]
# What the tests and benchmarks share (tiny random models, throwaway Redis servers) stays in the
# source checkout beside tests/ and bench/: a service install has no use for it.
NOT_SHIPPED = ["specprefill_testkit", "specprefill_testkit.*"]

# Data-only folders are listed as packages of their own (setuptools warns about importable
# folders left out of ``packages``); the model folders' names are not importable, so they
# travel as the data of ``specprefill_models``.
DATA_PACKAGES = ["specprefill_models", "specprefill_models.demo", "specprefill_server.web.static"]

setup(
    packages=find_packages(include=CODE, exclude=NOT_SHIPPED) + DATA_PACKAGES,
    package_dir={"specprefill_models": "models"},
    package_data={"specprefill_server.web.static": ["*"], "specprefill_models": ["*/*"], "specprefill_models.demo": ["*"]},
)
