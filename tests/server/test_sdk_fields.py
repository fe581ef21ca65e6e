"""Every field the official SDKs' request types define is accepted here, and docs/http.md says
what becomes of it (honoured, ignored and why, refused and why): walked from the installed
``openai`` and ``anthropic`` packages' own parameter TypedDicts, so a field a new SDK adds fails
here, not a user. Unknown fields outside those lists stay refused (as the real APIs refuse them).
"""
from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import typing_extensions
from pydantic import BaseModel

from specprefill_server.apis.anthropic import types as anthropic_types
from specprefill_server.apis.openai import types as openai_types
from specprefill_server.apis.responses import types as responses_types
from specprefill_server.errors import APIError
from specprefill_server.parse import parse

ROOT = Path(__file__).resolve().parents[2]
DISPOSITIONS = ("honoured", "ignored", "refused")


def _sdk(module: str, *names: str) -> list[type]:
    import importlib

    mod = importlib.import_module(module)
    return [getattr(mod, n) for n in names]


# api -> (docs/http.md section, our request model, the SDK's TypedDicts for it)
APIS = {
    "chat": ("### Every chat-completions field", openai_types.ChatCompletionRequest,
             _sdk("openai.types.chat.completion_create_params", "CompletionCreateParamsNonStreaming",
                  "CompletionCreateParamsStreaming")),
    "completions": ("### Every completions field", openai_types.CompletionRequest,
                    _sdk("openai.types.completion_create_params", "CompletionCreateParamsNonStreaming",
                         "CompletionCreateParamsStreaming")),
    "messages": ("### Every Messages field", anthropic_types.MessagesRequest,
                 _sdk("anthropic.types.message_create_params", "MessageCreateParamsNonStreaming",
                      "MessageCreateParamsStreaming")
                 + _sdk("anthropic.types.beta.message_create_params", "MessageCreateParamsNonStreaming",
                        "MessageCreateParamsStreaming")),
    "count_tokens": ("### Every Messages field", anthropic_types.CountTokensRequest,
                     _sdk("anthropic.types.message_count_tokens_params", "MessageCountTokensParams")
                     + _sdk("anthropic.types.beta.message_count_tokens_params", "MessageCountTokensParams")),
    "responses": ("### Every Responses field", responses_types.ResponsesRequest,
                  _sdk("openai.types.responses.response_create_params", "ResponseCreateParamsNonStreaming",
                       "ResponseCreateParamsStreaming")),
}
MINIMAL = {"chat": {"model": "m", "messages": []}, "completions": {"model": "m", "prompt": "p"},
           "messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
           "count_tokens": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
           "responses": {"model": "m", "input": "x"}}
# A value of each field the server refuses (every one of the REFUSED tables must be here).
REFUSED_SAMPLES = {"functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "alloy", "format": "mp3"},
                   "moderation": {"model": "omni-moderation-latest"}, "thread": {"type": "create"}, "top_k": 5,
                   "conversation": "conv_1", "prompt": {"id": "pmpt_1"}}
REFUSED = {"chat": openai_types.REFUSED, "messages": anthropic_types.REFUSED, "responses": responses_types.REFUSED}


def sdk_fields(typeds: list[type]) -> dict[str, list[typing.Any]]:
    """Every field the TypedDicts define -> its type hints (one per TypedDict that has it)."""
    out: dict[str, list[typing.Any]] = {}
    for typed in typeds:
        for name, hint in typing.get_type_hints(typed).items():
            out.setdefault(name, []).append(hint)
    return out


def typed_dicts(hint: typing.Any) -> list[type]:
    """The TypedDicts a type hint holds (through Optional, Union, Iterable, ...)."""
    if typing_extensions.is_typeddict(hint):
        return [hint]
    return [t for arg in typing.get_args(hint) for t in typed_dicts(arg)]


def submodels(annotation: typing.Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in submodels(arg)]


@pytest.mark.parametrize("api", APIS)
def test_every_sdk_field_is_a_field_here(api):
    _, model, typeds = APIS[api]
    fields = sdk_fields(typeds)
    assert len(fields) >= 10  # the walk found the SDK's fields
    missing = sorted(set(fields) - set(model.model_fields))
    assert not missing, f"{api}: the SDK has fields this server does not know: {missing}"


@pytest.mark.parametrize("api", APIS)
def test_every_sdk_field_of_an_object_the_server_reads_is_known(api):
    """Objects parsed into models of their own (``thinking``, ``output_config``, ``reasoning``,
    ``text``, ``stream_options``, ``tool_choice``): every key any of the SDK's variants has."""
    _, model, typeds = APIS[api]
    walked = 0
    for name, hints in sdk_fields(typeds).items():
        ours = submodels(model.model_fields[name].annotation)
        sdk = {key for hint in hints for typed in typed_dicts(hint) for key in typing.get_type_hints(typed)}
        if ours and sdk:
            walked += 1
            known = set().union(*(m.model_fields for m in ours))
            assert sdk <= known, f"{api}.{name}: the SDK has keys this server does not know: {sorted(sdk - known)}"
    assert walked >= 1


def doc_rows(section: str) -> dict[str, str]:
    """The field table under ``section`` of docs/http.md: each backticked field of a row's first
    cell -> the row's second cell."""
    text = (ROOT / "docs" / "http.md").read_text()
    assert section in text, f"docs/http.md has no section {section!r}"
    body = text.split(section, 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2:
            for name in re.findall(r"`([A-Za-z_][\w.]*)`", cells[0]):
                rows[name] = cells[1]
    return rows


@pytest.mark.parametrize("api", APIS)
def test_docs_say_what_becomes_of_every_sdk_field(api):
    section, _, typeds = APIS[api]
    rows = doc_rows(section)
    undocumented = sorted(set(sdk_fields(typeds)) - set(rows))
    assert not undocumented, f"{section}: no row for {undocumented}"
    vague = {f: rows[f][:40] for f in sdk_fields(typeds) if not rows[f].startswith(DISPOSITIONS)}
    assert not vague, f"{section}: a row must start with honoured / ignored / refused: {vague}"
    for field, row in rows.items():  # an ignored or refused field says why
        if row.startswith(("ignored", "refused")):
            assert len(row.split(":", 1)[-1].strip()) > 10 or "(" in row, (field, row)


@pytest.mark.parametrize("api", REFUSED)
def test_a_refused_field_is_refused_by_name_with_the_reason(api):
    assert set(REFUSED[api]) <= set(REFUSED_SAMPLES)
    model = APIS[api][1]
    for field, why in REFUSED[api].items():
        with pytest.raises(APIError) as err:
            parse(model, {**MINIMAL[api], field: REFUSED_SAMPLES[field]})
        assert (err.value.param, err.value.code) == (field, "unsupported_parameter")
        assert why in err.value.message
        assert doc_rows(APIS[api][0])[field].startswith("refused")


@pytest.mark.parametrize("api", APIS)
def test_an_unknown_field_is_still_refused_by_name(api):
    with pytest.raises(APIError) as err:
        parse(APIS[api][1], {**MINIMAL[api], "kepp": 0.2})
    assert (err.value.param, err.value.code) == ("kepp", "unknown_parameter")
