"""The Anthropic Messages request bodies this server accepts (``POST /v1/messages`` and
``/v1/messages/count_tokens``), as pydantic models; a validation error is a 400 naming the
field (:func:`specprefill_server.parse.parse`, in Anthropic's error shape on these paths).

Every field of the SDK's ``MessageCreateParams`` and its beta ``MessageCreateParams`` (and of
``MessageCountTokensParams``) is a field here (tests/server/test_sdk_fields.py walks them): the
ones that change the answer are honoured or refused by name with the reason (:data:`REFUSED`,
``top_k``, a forced ``tool_choice``, structured ``output_config.format``), the rest accepted and
ignored, each with its reason in docs/http.md's field table.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specprefill_server.extension import SpecPrefillOptions
from specprefill_server.parse import Unsupported, refuse_given

# Fields of the API this server refuses when given, and why.
REFUSED = {"thread": "server-side threads are not kept; send the whole conversation in messages",
           "top_k": "the target samples with top_p only"}


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)  # max_tokens bounds all the output here
    # summarized, updates: the reasoning as generated (it is not summarised here); omitted: none sent
    display: Literal["summarized", "omitted", "updates"] | None = None
    block_binding: dict[str, Any] | None = None  # no thinking signatures are checked here


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None
    task_budget: dict[str, Any] | None = None  # a budget the model is told about: no template takes one

    @model_validator(mode="after")
    def _no_format(self) -> "OutputConfig":
        if self.format is not None:  # structured output would change the answer
            raise Unsupported("output_config.format: structured outputs are not supported (the "
                              "target's output is not constrained to a schema here)")
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
    """What a Messages request and a count_tokens request share."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=1024)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # ``effort`` given to the chat template as ``reasoning_effort`` (a template without it ignores it).
    output_config: OutputConfig | None = None
    # Tools this server cannot run (left out of the prompt with a warning: convert.py).
    mcp_servers: list[dict[str, Any]] | None = None
    # Sent unasked by clients; they change nothing here (docs/http.md says why for each).
    cache_control: dict[str, Any] | None = None  # the block store reuses every shared prefix
    context_management: dict[str, Any] | None = None  # no edits: the whole conversation is kept
    compaction: dict[str, Any] | None = None  # no server-side compaction: past the window, refused
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    billing_policy: dict[str, Any] | None = None
    betas: list[str] | None = None  # the SDK sends them as the anthropic-beta header


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(_Conversation, SpecPrefillOptions):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)  # a ceiling: see extension.job_fields
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Older SDKs' sampling fields (the current SDK sends them as extra_body).
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    thread: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None  # code execution's sandbox: no server tool runs here
    # Sent unasked by clients; they change nothing here (docs/http.md says why for each).
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    fallbacks: list[dict[str, Any]] | Literal["default"] | None = None  # the request runs on model, or is refused
    fallback_credit_token: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported_only(self) -> "MessagesRequest":
        refuse_given(self, REFUSED)
        if self.stop_sequences is not None and len(self.stop_sequences) > 1:
            # the answer's stop_sequence must name the one that matched, which workers do not report
            raise Unsupported(f"stop_sequences: at most one is supported here, got {len(self.stop_sequences)}")
        return self
