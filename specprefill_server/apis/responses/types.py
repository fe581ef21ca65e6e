"""The OpenAI Responses request body this server accepts (``POST /v1/responses``), as a
pydantic model; a validation error is a 400 naming the field.

Fields that change nothing here (``metadata``, ``user``, ``safety_identifier``,
``prompt_cache_key``, ``prompt_cache_retention``, ``service_tier``, ``include``,
``parallel_tool_calls``, ``text.verbosity``, ``reasoning.summary``) are accepted and ignored;
fields that would change the answer and are not supported (``background``, a forced
``tool_choice``, built-in tools, structured ``text.format``, ``truncation: "auto"``,
``conversation``) are refused by name (docs/http.md, the field table).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specprefill_server.extension import SpecPrefillOptions
from specprefill_server.parse import Unsupported


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
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # reasoning is not summarised here
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool | None = None  # no obfuscation padding is sent


class ResponsesRequest(SpecPrefillOptions):
    """``POST /v1/responses``."""

    model: str = Field(min_length=1, max_length=1024)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=200)
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
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None  # bounds built-in tool calls, which this server has none of
    # Sent unasked by clients; they change nothing here (docs/http.md).
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    include: list[str] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _supported_only(self) -> "ResponsesRequest":
        if self.background:
            raise Unsupported("background: not supported (stream, or wait for the answer)")
        if self.truncation == "auto":
            raise Unsupported("truncation: only \"disabled\" is supported (a conversation over the "
                              "context is refused, never cut)")
        if self.top_logprobs:
            raise Unsupported("top_logprobs: not supported")
        if self.tool_choice is not None and self.tool_choice not in ("auto", "none"):
            raise Unsupported("tool_choice: only \"auto\" and \"none\" are supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true")
        return self
