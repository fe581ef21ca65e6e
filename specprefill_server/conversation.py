"""The conversation an API request carries, in the one internal format both the Anthropic
Messages and the OpenAI Responses bodies are converted into: Hugging Face chat-template
messages (``role``; ``content`` a string or None; assistant ``tool_calls`` as
``{"id", "type": "function", "function": {"name", "arguments": dict}}``; a tool result's
``tool_call_id`` and ``name``; ``reasoning_content``), and tools as OpenAI function tools.

:func:`spec_messages` is the one place that hands such a conversation to the job spec.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jobs.contract.conversation import FromRequest
from specprefill_server.errors import bad_request


@dataclass
class Conversation:
    """Messages in the internal format, each with the request field it came from."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)

    def add(self, message: dict[str, Any], where: str) -> None:
        self.messages.append(message)
        self.origins.append(where)

    def last_assistant(self) -> dict[str, Any] | None:
        """The last message, if it is the assistant's (tool calls join its turn)."""
        return self.messages[-1] if self.messages and self.messages[-1]["role"] == "assistant" else None


def refuse_unknown(obj: Any, known: set[str], where: str) -> None:
    """400 naming the first key of ``obj`` outside ``known`` (``where.key: unknown field``)."""
    extra = sorted(set(obj) - known)
    if extra:
        raise bad_request(f"{where}.{extra[0]}: unknown field", f"{where}.{extra[0]}", code="unknown_parameter")


def tool_call(call_id: str, name: str, arguments: Any, where: str) -> dict[str, Any]:
    """One assistant tool call; ``arguments`` a JSON object or its text."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise bad_request(f"{where}: not valid JSON ({exc})", where) from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}: expected a JSON object", where, code="invalid_type")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """An OpenAI function tool (what chat templates take as ``tools``)."""
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name: expected a non-empty string", f"{where}.name")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def spec_messages(conversation: Conversation) -> FromRequest:
    """The conversation as the job spec takes it: the messages and the request field each came
    from, so that the spec's one check of the conversation (``jobs.contract.conversation.check_messages``,
    when the spec is built, within the deployment's limits) names the request's own field
    (``messages[2].content[0]`` of an Anthropic request, ``input[3]`` of a Responses one), not a
    place in the converted list. Nothing is checked here."""
    return FromRequest(conversation.messages, conversation.origins)
