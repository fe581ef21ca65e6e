"""The conversation format of a chat job: what every front door converts its messages into.

A conversation is a list of Hugging Face chat-template message dicts, exactly what
``tokenizer.apply_chat_template(messages, tools=...)`` takes, so the worker renders it with
the model's own template and nothing in between reinterprets it::

    {"role": "system" | "developer" | "user" | "assistant" | "tool",
     "content": str | [{"type": "text", "text": str}, ...] | None,
     "tool_calls": [{"id": str, "type": "function",
                     "function": {"name": str, "arguments": {...}}}],   # assistant only
     "tool_call_id": str,                                              # tool only (required)
     "name": str,
     "reasoning_content": str}                                         # assistant only

Only the keys a message needs are present. ``arguments`` is the parsed JSON object (HF
templates render it with ``tojson``; a front door parses OpenAI's JSON string first).
``content`` may be None (or absent) only on an assistant message with ``tool_calls``. A tool
message answers a call of an earlier assistant message (its ``tool_call_id``). Every field is
checked with an error naming it (``messages[2].tool_calls[0].function.arguments: ...``), and
every size is bounded. :func:`check_messages` is the one validator: it returns the canonical
form (text parts joined into one string, ``type`` filled in, copies of the caller's objects) as
:class:`ChatMessages`, which is what the job spec carries, the template renders and the job id
is derived from; nothing after it checks the conversation again. A front door that converted
its API's messages passes them as :class:`FromRequest`, so that the one check names the
request's own field (``messages[2].content[0]`` of an Anthropic request, ``input[3]`` of a
Responses one).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SYSTEM_ROLES = ("system", "developer")
MAX_CHAT_MESSAGES = 10_000
MAX_CONTENT_PARTS = 1_000
MAX_TOOL_CALLS = 128  # per assistant message
MAX_ID_CHARS = 256  # a tool call's id, a tool message's tool_call_id, a name
# Keys each role may carry besides "role" and "content".
ROLE_KEYS = {"system": ("name",), "developer": ("name",), "user": ("name",),
             "assistant": ("name", "tool_calls", "reasoning_content"),
             "tool": ("name", "tool_call_id")}


class ConversationError(ValueError):
    """A message field is missing, of the wrong type, or out of its allowed range."""


class ChatMessages(tuple):
    """A conversation :func:`check_messages` accepted: its canonical messages (read-only by
    contract: the spec, the template and the job id share them) and their size in characters
    (``chars``: contents, reasoning and arguments). Only :func:`check_messages` makes one."""

    chars: int

    def __new__(cls, *args: Any, **kwargs: Any) -> "ChatMessages":
        raise TypeError("ChatMessages are made by jobs.contract.conversation.check_messages only")

    @classmethod
    def _checked(cls, messages: list[dict[str, Any]], chars: int) -> "ChatMessages":
        out = tuple.__new__(cls, messages)
        out.chars = chars
        return out

    def __reduce__(self) -> Any:  # copies and pickles stay ChatMessages
        return ChatMessages._checked, (list(self), self.chars)


@dataclass(frozen=True)
class FromRequest:
    """Messages an HTTP front door converted from its API's request, not yet checked, and the
    request field each came from (``origins[i]`` for ``messages[i]``)."""

    messages: Sequence[Any]
    origins: Sequence[str]


def _short_string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_CHARS:
        raise ConversationError(f"{where}: expected a string of 1..{MAX_ID_CHARS} characters")
    if any(ord(ch) < 32 for ch in value):
        raise ConversationError(f"{where}: control characters are not allowed")
    return value


def _content(value: Any, where: str) -> tuple[str | None, int]:
    """The content as one string (text parts joined, as mlx-lm's server joins them: many
    templates render only string content) or None, and its size in characters."""
    if value is None or isinstance(value, str):
        return value, len(value or "")
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConversationError(f"{where}: expected a string, a list of text parts or null")
    if not 1 <= len(value) <= MAX_CONTENT_PARTS:
        raise ConversationError(f"{where}: {len(value)} parts, allowed 1..{MAX_CONTENT_PARTS}")
    parts = []
    for j, part in enumerate(value):
        if not isinstance(part, Mapping) or set(part) != {"type", "text"} or part["type"] != "text":
            raise ConversationError(f"{where}[{j}]: expected {{\"type\": \"text\", \"text\": ...}} "
                                    "(only text parts)")
        if not isinstance(part["text"], str):
            raise ConversationError(f"{where}[{j}].text: expected a string, got {type(part['text']).__name__}")
        parts.append(part["text"])
    text = "".join(parts)
    return text, len(text)


def _arguments(value: Any, where: str) -> tuple[dict[str, Any], int]:
    if not isinstance(value, Mapping):
        hint = " (parse the JSON string into an object first)" if isinstance(value, str) else ""
        raise ConversationError(f"{where}: expected an object of the call's arguments, got "
                                f"{type(value).__name__}{hint}")
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise ConversationError(f"{where}: must be plain JSON (no NaN, no custom objects)") from None
    return json.loads(text), len(text)


def _tool_call(call: Any, where: str) -> tuple[dict[str, Any], int]:
    if not isinstance(call, Mapping) or not set(call) <= {"id", "type", "function"}:
        raise ConversationError(f"{where}: expected {{\"id\": ..., \"type\": \"function\", "
                                "\"function\": {\"name\": ..., \"arguments\": {...}}}")
    if call.get("type", "function") != "function":
        raise ConversationError(f"{where}.type: {call['type']!r:.40} is not \"function\"")
    call_id = _short_string(call.get("id"), f"{where}.id")
    fn = call.get("function")
    if not isinstance(fn, Mapping) or set(fn) != {"name", "arguments"}:
        raise ConversationError(f"{where}.function: expected exactly \"name\" and \"arguments\"")
    name = _short_string(fn["name"], f"{where}.function.name")
    arguments, size = _arguments(fn["arguments"], f"{where}.function.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}, size


def _tool_calls(value: Any, where: str) -> tuple[list[dict[str, Any]], int]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConversationError(f"{where}: expected a list of tool calls")
    if not 1 <= len(value) <= MAX_TOOL_CALLS:
        raise ConversationError(f"{where}: {len(value)} calls, allowed 1..{MAX_TOOL_CALLS}")
    calls, total = [], 0
    for k, call in enumerate(value):
        clean, size = _tool_call(call, f"{where}[{k}]")
        calls.append(clean)
        total += size
    return calls, total


def _message(m: Any, where: str, call_ids: set[str]) -> tuple[dict[str, Any], int]:
    """One message in canonical form and its size; ``call_ids`` gathers the assistant's calls."""
    if not isinstance(m, Mapping):
        raise ConversationError(f"{where}: expected an object with 'role' and 'content'")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise ConversationError(f"{where}.role: {role!r:.40} is not one of {', '.join(CHAT_ROLES)}")
    extra = sorted(str(k) for k in m if k not in ("role", "content", *ROLE_KEYS[role]))
    if extra:
        allowed = ", ".join(("role", "content", *ROLE_KEYS[role]))
        raise ConversationError(f"{where}.{extra[0]:.60}: not a field of a {role} message (allowed: {allowed})")
    out: dict[str, Any] = {"role": role}
    size = 0
    if m.get("tool_calls") is not None:
        out["tool_calls"], size = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        call_ids.update(c["id"] for c in out["tool_calls"])
    if m.get("content") is None and "tool_calls" not in out:
        raise ConversationError(f"{where}.content: missing (only an assistant message with "
                                "tool_calls may have no content)")
    out["content"], n = _content(m.get("content"), f"{where}.content")
    size += n
    if role == "tool":
        call_id = _short_string(m.get("tool_call_id"), f"{where}.tool_call_id")
        if call_id not in call_ids:
            raise ConversationError(f"{where}.tool_call_id: {call_id!r:.80} answers no tool call of an "
                                    "earlier assistant message")
        out["tool_call_id"] = call_id
    if m.get("name") is not None:
        out["name"] = _short_string(m["name"], f"{where}.name")
    if m.get("reasoning_content") is not None:
        if not isinstance(m["reasoning_content"], str):
            raise ConversationError(f"{where}.reasoning_content: expected a string")
        out["reasoning_content"] = m["reasoning_content"]
        size += len(out["reasoning_content"])
    return out, size


def check_messages(value: Any, max_chars: int) -> ChatMessages:
    """``value`` (a list of messages, or :class:`FromRequest`) as a canonical conversation, or
    :class:`ConversationError` naming the field (the request's own for :class:`FromRequest`).

    ``max_chars`` bounds the characters of every content, reasoning and arguments together."""
    origins = None
    if isinstance(value, FromRequest):
        value, origins = value.messages, value.origins
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConversationError("messages: expected a list of message objects ({role, content, ...})")
    if not 1 <= len(value) <= MAX_CHAT_MESSAGES:
        raise ConversationError(f"messages: {len(value)} messages, allowed 1..{MAX_CHAT_MESSAGES}")
    out, total, call_ids = [], 0, set()
    for i, m in enumerate(value):
        try:
            clean, size = _message(m, f"messages[{i}]", call_ids)
        except ConversationError as exc:
            if origins is None:
                raise
            raise ConversationError(_named(str(exc), origins[i])) from None
        out.append(clean)
        total += size
    check_size(total, max_chars)
    if all(m["role"] in SYSTEM_ROLES for m in out):
        raise ConversationError("messages: needs at least one user/assistant/tool message")
    return ChatMessages._checked(out, total)


def check_size(chars: int, max_chars: int) -> None:
    """Refuse a conversation of more than ``max_chars`` characters (:attr:`ChatMessages.chars`)."""
    if chars > max_chars:
        raise ConversationError(f"messages: {chars} characters in total, the limit is {max_chars}")


_INDEX = re.compile(r"^messages\[\d+\]\.?")


def _named(message: str, origin: str) -> str:
    """An error about ``messages[i]`` (``messages[i].content: ...``) named by the request field
    the message came from (``origin: content: ...``): the rest says which part of it."""
    m = _INDEX.match(message)
    return f"{origin}: {message[m.end():].lstrip(': ') if m else message}"
