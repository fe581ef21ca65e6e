"""The Anthropic Messages request bodies this server accepts (``POST /v1/messages`` and
``/v1/messages/count_tokens``), as pydantic models; a validation error is a 400 naming the
field (:func:`specprefill_server.parse.parse`, in Anthropic's error shape on these paths).

Fields that change nothing here (``metadata``, ``service_tier``, ``cache_control`` on any
block: the block store reuses every shared prefix by itself) are accepted and ignored;
fields that would change the answer and are not supported (``top_k``, a forced
``tool_choice``, server tools, images) are refused by name (docs/http.md, the field table).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specprefill_server.extension import SpecPrefillOptions
from specprefill_server.parse import Unsupported


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)  # max_tokens bounds all the output here
    display: Literal["summarized", "omitted"] | None = None  # reasoning text is not summarised here


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _no_format(self) -> "OutputConfig":
        if self.format is not None:  # structured output would change the answer
            raise Unsupported("output_config.format: structured outputs are not supported")
        return self


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _model_chooses(self) -> "ToolChoice":
        if self.type in ("any", "tool"):  # forcing a call would change the answer
            raise Unsupported(f"tool_choice: only \"auto\" and \"none\" are supported, not {self.type!r}")
        return self


class _Conversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=1024)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(_Conversation, SpecPrefillOptions):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Older SDKs' sampling fields (the current SDK sends them as extra_body).
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    # Given to the chat template as ``reasoning_effort`` (a template without it ignores it).
    output_config: OutputConfig | None = None
    # Sent unasked by clients; they change nothing here (docs/http.md).
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None  # the block store reuses every shared prefix
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _supported_only(self) -> "MessagesRequest":
        if self.top_k is not None:
            raise Unsupported("top_k: not supported (the target samples with top_p)")
        if self.stop_sequences is not None and len(self.stop_sequences) > 1:
            # the answer's stop_sequence must name the one that matched, which workers do not report
            raise Unsupported(f"stop_sequences: at most one is supported here, got {len(self.stop_sequences)}")
        return self
