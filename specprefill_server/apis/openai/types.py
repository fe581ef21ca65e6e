"""The OpenAI request bodies this server accepts (chat completions, completions, batches), as
pydantic models (parsed by :func:`specprefill_server.parse.parse`).

Every field of the SDK's ``CompletionCreateParams`` (chat and text) is a field here
(tests/server/test_sdk_fields.py walks them). Fields OpenAI has but this service cannot
honour are accepted only at their neutral value (``n`` 1, no logprobs, no penalties) or
refused by name with the reason (:data:`REFUSED`), so a request is answered as asked or
refused. Fields clients send unasked that change nothing here (``user``, ``metadata``,
``service_tier``, ``verbosity``, ``prediction``, ...) are accepted and ignored (docs/http.md,
the field table); ``prompt_cache_key`` routes the job with ``routing=prefix``
(jobs/client/routing.py); ``web_search_options`` asks for a search this server cannot run (a note
in the answer's warnings). SpecPrefill options are extra body fields
(``extra_body={"keep": 0.2}`` in the SDK); any other unknown field is refused by name.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specprefill_server.extension import SpecPrefillOptions
from specprefill_server.parse import Unsupported, refuse_given

# Chat completion fields this server refuses when given, and why.
REFUSED = {"functions": "deprecated in favour of tools: send them as tools",
           "function_call": "deprecated in favour of tool_choice",
           "audio": "no audio is generated here",
           "moderation": "no moderation model runs here"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding against length side channels: none sent


class _Sampling(SpecPrefillOptions):
    model: str = Field(min_length=1, max_length=1024)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Sent unasked by clients; identify the end user or route the request, ignored here.
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)  # routes the job (routing=prefix)

    @model_validator(mode="after")
    def _neutral_only(self) -> "_Sampling":
        for name, neutral in (("n", 1), ("presence_penalty", 0), ("frequency_penalty", 0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise Unsupported(f"{name}: only {neutral} is supported")
        if self.logit_bias:
            raise Unsupported("logit_bias: not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true")
        return self


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    # Keyword arguments of the chat template (vLLM's and SGLang's name), e.g. enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None  # no search runs here: a note in the warnings
    # Sent unasked by clients and agents; they change nothing here (docs/http.md).
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None  # predicted output speeds decoding up, the answer is the same
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Given to the chat template as ``reasoning_effort`` (a template without it ignores it).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="after")
    def _chat_neutral_only(self) -> "ChatCompletionRequest":
        refuse_given(self, REFUSED)
        if self.logprobs or self.top_logprobs:
            raise Unsupported("logprobs: not supported")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise Unsupported("response_format: only {\"type\": \"text\"} is supported")
        if self.store:
            raise Unsupported("store: stored completions are not supported")
        if self.modalities is not None and self.modalities != ["text"]:
            raise Unsupported("modalities: only [\"text\"] is supported")
        if self.tool_choice is not None and self.tool_choice not in ("auto", "none"):
            # forcing a call would change the answer; the model chooses for itself here
            raise Unsupported("tool_choice: only \"auto\" and \"none\" are supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_completion_tokens: differs from max_tokens (give one)")
        return self


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (one prompt: a string, or token ids)."""

    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_neutral_only(self) -> "CompletionRequest":
        if self.echo:
            raise Unsupported("echo: not supported")
        if self.logprobs:
            raise Unsupported("logprobs: not supported")
        if self.best_of not in (None, 1):
            raise Unsupported("best_of: only 1 is supported")
        if self.suffix:
            raise Unsupported("suffix: not supported")
        return self


class BatchCreateRequest(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


