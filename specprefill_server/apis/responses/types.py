"""The OpenAI Responses request body this server accepts (``POST /v1/responses``), as a
pydantic model; a validation error is a 400 naming the field.

Every field of the SDK's ``ResponseCreateParams`` is a field here (tests/server/test_sdk_fields.py
walks them, and the objects ``reasoning``, ``text``, ``stream_options``): honoured, refused by name
with the reason when given (:data:`REFUSED`, ``background``, a forced ``tool_choice``, structured
``text.format``, ``top_logprobs``), or accepted and ignored where it cannot change the answer,
each with its reason in docs/http.md's field table. ``client_metadata`` (Codex sends it; not
in the SDK) is accepted and ignored too.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specprefill_server.extension import SpecPrefillOptions
from specprefill_server.parse import Unsupported, refuse_given

# Fields of the API this server refuses when given, and why.
REFUSED = {"conversation": "no Conversations API here; previous_response_id continues a stored response",
           "prompt": "no stored prompt templates here; send the instructions and input",
           "moderation": "no moderation model runs here"}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # the model has no such switch

    @model_validator(mode="after")
    def _text_only(self) -> "TextConfig":
        if self.format is not None and self.format.get("type") != "text":
            raise Unsupported("text.format: only {\"type\": \"text\"} is supported")
        return self


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Given to the chat template as ``reasoning_effort`` (a template without it ignores it).
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # reasoning is not summarised here
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: str | None = None  # which past reasoning is shown: the chat template decides that
    mode: str | None = None  # the model runs one way here


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool | None = None  # no obfuscation padding is sent


class ResponsesRequest(SpecPrefillOptions):
    """``POST /v1/responses``."""

    model: str = Field(min_length=1, max_length=1024)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=200)
    # a ceiling (extension.job_fields); none: the room in the window, within max_generate_tokens
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # auto: a conversation past the window would be cut from the start; here it is refused
    # (context_length_exceeded), never cut, so both values answer the same within the window
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None  # bounds built-in tool calls, which this server has none of
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # Sent unasked by clients; they change nothing here (docs/http.md says why for each).
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's; not in the SDK
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    parallel_tool_calls: bool | None = None
    context_management: list[dict[str, Any]] | None = None  # no server-side compaction: past the window, refused
    background_options: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None  # image inputs are refused by their part

    @model_validator(mode="after")
    def _supported_only(self) -> "ResponsesRequest":
        refuse_given(self, REFUSED)
        if self.background:
            raise Unsupported("background: not supported (stream, or wait for the answer)")
        if self.top_logprobs:
            raise Unsupported("top_logprobs: not supported")
        if self.tool_choice is not None and self.tool_choice not in ("auto", "none"):
            raise Unsupported("tool_choice: only \"auto\" and \"none\" are supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true")
        return self
