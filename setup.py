"""Packaging beyond what pyproject.toml can say: the shipped models (``models/``) go into
the wheel as the data-only package ``specprefill_models`` (``jobs.settings`` finds them
there when no source checkout is around), so ``pip install`` + ``specprefill demo`` works
from any directory. Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

CODE = ["specprefill*", "cache_store*", "jobs*", "worker*", "cli*", "server*"]

# Data-only folders are listed as packages of their own (setuptools warns about importable
# folders left out of ``packages``); the model folders' names are not importable, so they
# travel as the data of ``specprefill_models``.
DATA_PACKAGES = ["specprefill_models", "specprefill_models.demo", "server.static"]

setup(
    packages=find_packages(include=CODE) + DATA_PACKAGES,
    package_dir={"specprefill_models": "models"},
    package_data={"server.static": ["*"], "specprefill_models": ["*/*"], "specprefill_models.demo": ["*"]},
)
