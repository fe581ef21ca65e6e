"""The demo's agent loop: questions answered through a ``lookup`` tool over the HTTP API.

Each question is one conversation in the OpenAI chat-completions tool format: the user asks
"Look up the words after Orion" with the ``lookup`` tool offered; the model answers with a
tool call (``tool_calls``); the loop runs the tool on the shipped demo documents and sends the
result back as a ``tool`` message; the model answers from it. Every reply is streamed, so the
call's deltas and the answer show as they come. Plain HTTP (``urllib``): the loop is a client
like any other, it knows nothing of the queue behind the server.
"""
from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TextIO

# The tool the shipped target was trained to call (tools/tool_task.py trains on this one).
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Find the words that follow a name in the stored documents.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "the words wanted, ending in the name"}},
            "required": ["query"],
        },
    },
}
ASK = "Look up the words after {}"
MAX_STEPS = 4  # model turns per conversation: a call, then the answer, with room for one retry


def lookup(documents: list[Any], query: str) -> str:
    """The sentence of the demo documents that holds the fact about the query's last word."""
    words = re.findall(r"[A-Za-z]+", query)
    name = words[-1] if words else ""
    for doc in documents:
        at = doc.text.find(f" {name} ")
        if name and at >= 0:
            start = max(doc.text.rfind(". ", 0, at), doc.text.rfind("\n", 0, at)) + 1
            end = doc.text.find(".", at)
            return doc.text[start:end + 1 if end >= 0 else len(doc.text)].strip()
    return f"nothing is stored about {name or query!r}"


@dataclass
class Reply:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_s: float | None = None


def sse_events(response: Any) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``[DONE]``."""
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def merge_delta(reply: Reply, delta: dict[str, Any]) -> None:
    """Fold one streamed ``delta`` into ``reply`` (tool calls arrive in pieces, by index)."""
    reply.content += delta.get("content") or ""
    for piece in delta.get("tool_calls") or []:
        index = piece.get("index", len(reply.tool_calls))
        while len(reply.tool_calls) <= index:
            reply.tool_calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = reply.tool_calls[index]
        call["id"] = piece.get("id") or call["id"]
        function = piece.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def stream_chat(base_url: str, body: dict[str, Any], on_text: Callable[[str], None],
                timeout: float = 300.0) -> Reply:
    """POST a streamed chat completion; ``on_text`` sees every piece of content and call."""
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", method="POST",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    reply, started = Reply(), time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for event in sse_events(response):
            for choice in event.get("choices", []):
                delta = choice.get("delta") or {}
                if reply.first_token_s is None and (delta.get("content") or delta.get("tool_calls")):
                    reply.first_token_s = time.perf_counter() - started
                merge_delta(reply, delta)
                on_text((delta.get("content") or "") + "".join(
                    (p.get("function") or {}).get("arguments") or "" for p in delta.get("tool_calls") or []))
                reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    return reply


def converse(base_url: str, model: str, name: str, documents: list[Any], out: TextIO,
             options: dict[str, Any] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """One conversation about ``name``: the final answer text and the messages exchanged."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK.format(name)}]
    print(f"  user: {messages[0]['content']}", file=out, flush=True)
    for _ in range(MAX_STEPS):
        print("  assistant: ", end="", file=out, flush=True)
        reply = stream_chat(base_url, {"model": model, "messages": messages, "tools": [LOOKUP_TOOL],
                                       "max_tokens": 64, "temperature": 0, **(options or {})},
                            lambda text: print(text, end="", file=out, flush=True))
        print(file=out, flush=True)
        if not reply.tool_calls:
            messages.append({"role": "assistant", "content": reply.content})
            return reply.content, messages
        messages.append({"role": "assistant", "content": reply.content or None, "tool_calls": reply.tool_calls})
        for call in reply.tool_calls:
            result = run_tool(call, documents)
            print(f"  tool {call['function']['name']}: {result}", file=out, flush=True)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return "", messages


def run_tool(call: dict[str, Any], documents: list[Any]) -> str:
    """The result of one tool call (an error text for an unknown tool or bad arguments)."""
    function = call.get("function") or {}
    if function.get("name") != "lookup":
        return f"error: no tool named {function.get('name')!r}"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as exc:
        return f"error: arguments are not JSON ({exc})"
    if not isinstance(arguments, dict) or not isinstance(arguments.get("query"), str):
        return "error: lookup takes {\"query\": string}"
    return lookup(documents, arguments["query"])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m specprefill_server`` on a free local port, in its own session."""

    def __init__(self, redis_url: str, env: dict[str, str], log_path: Any, cwd: Any) -> None:
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specprefill_server", "--redis-url", redis_url, "--port", str(self.port),
                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the HTTP server exited at start:\n{open(self.log_path).read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the HTTP server did not answer /healthz within {timeout}s")

    def stop(self) -> None:
        from specprefill_cli.embedded_redis import stop_process

        stop_process(self.proc, 10)


def run_agent_round(base_url: str, model: str, documents: list[Any], out: TextIO) -> dict[str, int]:
    """One conversation per document (its round-1 name): calls made and answers right."""
    print(f"\nagent round: {len(documents)} conversations over {base_url}/v1/chat/completions "
          "(tool call, tool result, answer)", file=out, flush=True)
    counts = {"conversations": 0, "tool_calls": 0, "right": 0, "failed": 0}
    for doc in documents:
        round_no = min(doc.questions)
        name = doc.questions[round_no].split()[-1]
        try:
            answer, messages = converse(base_url, model, name, documents, out)
        except OSError as exc:  # urllib's HTTPError and URLError: the server said no
            detail = exc.read().decode(errors="replace")[:300] if hasattr(exc, "read") else ""
            print(f"  failed: {exc} {detail}", file=out, flush=True)
            counts["failed"] += 1
            continue
        counts["conversations"] += 1
        counts["tool_calls"] += sum(len(m.get("tool_calls") or []) for m in messages)
        counts["right"] += doc.answered(round_no, answer)
    print(f"agent round: {counts['right']}/{len(documents)} answers right, {counts['tool_calls']} tool calls, "
          f"{counts['failed']} failed requests", file=out, flush=True)
    return counts
