"""The settings by role: every field of ``Settings`` is declared by exactly one role module, with a
docstring and, beside it, its range and choices; every field is still read from
``SPECPREFILL_<FIELD>``; the docs show the settings by role in a table generated from the code.

A changed setting changes the table: ``UPDATE_DOCS=1 pytest tests/jobs/test_settings_roles.py``
writes it (then review the diff).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
from itertools import combinations
from pathlib import Path

import pytest

from jobs.settings import CHOICES, OPTION_GROUPS, RANGES, ROLES, SHIPPED_MODELS, Settings
from jobs.settings.check import field_type, span, variable

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- settings by role: generated from jobs/settings/ by tests/jobs/test_settings_roles.py -->"
END = "<!-- end of settings by role -->"


def own_fields(role_class: type) -> list[str]:
    return [f.name for f in dataclasses.fields(role_class)]


def field_docs(role_class: type) -> dict[str, str]:
    """Each field's docstring (the string right after its declaration), as one line."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(role_class)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == role_class.__name__).body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split()).replace("``", "`")
    return docs


def test_every_field_belongs_to_exactly_one_role():
    declared = {role: own_fields(cls) for role, cls in ROLES.items()}
    assert all(declared.values())
    for (a, fa), (b, fb) in combinations(declared.items(), 2):
        assert not set(fa) & set(fb), f"{sorted(set(fa) & set(fb))} declared by both {a} and {b}"
    everything = [name for names in declared.values() for name in names]
    assert sorted(everything) == sorted(f.name for f in dataclasses.fields(Settings))
    # Settings declares no field of its own and takes the roles in order
    assert [f.name for f in dataclasses.fields(Settings)] == everything


def test_a_fields_docstring_range_and_choices_sit_in_its_roles_module():
    for role, cls in ROLES.items():
        names, module = set(own_fields(cls)), inspect.getmodule(cls)
        missing = names - set(field_docs(cls))
        assert not missing, f"{role}: fields without a docstring: {sorted(missing)}"
        assert set(module.RANGES) <= names, f"{role}: ranges of another role's fields"
        assert set(getattr(module, "CHOICES", {})) <= names, f"{role}: choices of another role's fields"
    assert set(RANGES) | set(CHOICES) <= {f.name for f in dataclasses.fields(Settings)}


def another_value(field: dataclasses.Field, default):
    """A valid value of ``field`` other than its default, and how its variable spells it."""
    if field.name in CHOICES:
        value = next(c for c in CHOICES[field.name] if c != default)
        return value, str(value)
    kind = field_type(field)
    if kind == "bool":
        return (not default), ("0" if default else "1")
    if kind.startswith("tuple"):
        return ("a", "b"), "a, b"
    if kind == "str":
        return ("other-" + default.rsplit("/", 1)[-1]), "other-" + default.rsplit("/", 1)[-1]
    lo, hi = RANGES.get(field.name, (None, None))
    for value in (default + 1, default * 2, lo, hi, (default + (hi or default)) / 2):
        if value is not None and value != default and (lo is None or value >= lo) and (hi is None or value <= hi):
            value = int(value) if kind == "int" else float(value)
            return value, str(value)
    raise AssertionError(f"no other value for {field.name}")


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Settings) if f.name not in OPTION_GROUPS])
def test_every_field_is_read_from_its_variable(name):
    field, default = Settings.__dataclass_fields__[name], getattr(Settings(), name)
    value, raw = another_value(field, default)
    assert variable(name) == "SPECPREFILL_" + name.upper()
    assert getattr(Settings.from_env({variable(name): raw}), name) == value


def shown_default(value) -> str:
    if isinstance(value, str) and value.startswith(str(SHIPPED_MODELS)):
        return f"the shipped `{Path(value).name}`"
    if value in ("", ()):
        return "(empty)"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value}`" if isinstance(value, str) else str(value)


def shown_range(name: str) -> str:
    if name in CHOICES:
        return "one of " + ", ".join(f"`{c}`" for c in CHOICES[name])
    return span(RANGES[name]) if name in RANGES else ""


def option_rows(group: str) -> list[str]:
    cls, defaults = OPTION_GROUPS[group], getattr(Settings(), group)
    return [f"| `{variable(f.name)}` | {shown_default(getattr(defaults, f.name))} | checked by `{cls.__name__}` "
            f"| the job default of the {group} option `{f.name}` |" for f in dataclasses.fields(cls)]


def settings_table() -> str:
    """The settings by role, as Markdown: a table per role."""
    out, defaults = [], Settings()
    for role, cls in ROLES.items():
        docs = field_docs(cls)
        out += [f"### {role}", "", " ".join(cls.__doc__.split()), "",
                "| variable | default | range | what |", "|---|---|---|---|"]
        for name in own_fields(cls):
            if name in OPTION_GROUPS:
                out += option_rows(name)
                continue
            out.append(f"| `{variable(name)}` | {shown_default(getattr(defaults, name))} | {shown_range(name)} "
                       f"| {docs[name]} |")
        out.append("")
    return "\n".join(out)


def settings_doc() -> Path:
    """Where the table lives: docs/configuration.md when the docs have it, else docs/deploy.md."""
    configuration = ROOT / "docs" / "configuration.md"
    return configuration if configuration.is_file() else ROOT / "docs" / "deploy.md"


def test_the_docs_show_the_settings_by_role():
    doc = settings_doc()
    text = doc.read_text()
    assert BEGIN in text and END in text, f"{doc.name} has no generated settings table ({BEGIN})"
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    want = "\n" + settings_table() + "\n"
    if block != want and os.environ.get("UPDATE_DOCS") == "1":
        doc.write_text(head + BEGIN + want + END + tail)
        return
    assert block == want, (f"{doc.relative_to(ROOT)}'s settings table differs from jobs/settings/: "
                           f"UPDATE_DOCS=1 pytest {Path(__file__).relative_to(ROOT)}")
