"""One field list: every option field of specprefill/options.py reaches every place a user
or a worker meets it (job spec, payload, memo key, settings, HTTP fields, JSONL lines), so
adding an option is one field in one dataclass (docs/architecture.md, "Adding an option")."""
from __future__ import annotations

from dataclasses import fields

import fakeredis

from cache_store import SelectionMemo
from jobs.contract.spec import OPTION_GROUPS, build_spec, option_names, spelled_option
from jobs.settings import OPTION_SETTINGS, Settings
from specprefill_cli.documents import SPEC_FIELDS
from specprefill_server.extension import OPENAI_OPTIONS, SPECPREFILL_FIELDS


def test_every_option_field_is_everywhere():
    spec = build_spec(Settings(target_model="t"), tokens=[1, 2], kind="generate")
    payload, options = spec.to_payload(), spec.options()
    for group, cls in OPTION_GROUPS.items():
        for f in fields(cls):
            spelling = spelled_option(group, f.name)
            assert option_names("generate")[spelling] == (group, f.name)
            assert f.name in payload[group] and spelling in options and spelling in SPEC_FIELDS
            assert spelling in SPECPREFILL_FIELDS or spelling in OPENAI_OPTIONS
            if group != "generate":  # a deployment's defaults are scoring and selection options
                assert OPTION_SETTINGS[f.name] == (group, f.name)
    # an option setting never shadows a plain setting of the same name
    assert not OPTION_SETTINGS.keys() & {f.name for f in fields(Settings)}


def test_the_memo_key_changes_with_every_scoring_and_selection_field():
    memo = SelectionMemo(fakeredis.FakeRedis(), "3c" * 32)
    spec = build_spec(Settings(), tokens=[1, 2])
    base = {"scoring": spec.scoring, "selection": spec.selection}
    keys = {memo.key([1, 2], base)}
    for group in base:
        for f in fields(OPTION_GROUPS[group]):
            value = getattr(base[group], f.name)
            other = not value if isinstance(value, bool) else value / 2 if isinstance(value, float) else value + 1
            changed = build_spec(Settings(), tokens=[1, 2], **{spelled_option(group, f.name): other})
            keys.add(memo.key([1, 2], {"scoring": changed.scoring, "selection": changed.selection}))
    assert len(keys) == 1 + sum(len(fields(OPTION_GROUPS[g])) for g in base)
