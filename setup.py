"""Packaging beyond what pyproject.toml can say: the shipped models (``models/``) go into
the wheel as the data-only package ``specprefill_models`` (``jobs.settings`` finds them
there when no source checkout is around), so ``pip install`` + ``specprefill demo`` works
from any directory. Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

CODE = ["specprefill*", "cache_store*", "jobs*", "worker*", "cli*", "server*"]

setup(
    packages=find_packages(include=CODE) + ["specprefill_models"],
    package_dir={"specprefill_models": "models"},
    package_data={"server": ["static/*"], "specprefill_models": ["*", "*/*"]},
)
