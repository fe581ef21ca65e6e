"""A chat answer's text split into content, reasoning and tool calls with mlx-lm's own pieces.

The markers are the tokenizer's (``has_thinking`` / ``think_start`` / ``think_end``,
``has_tool_calling`` / ``tool_call_start`` / ``tool_call_end``), matched on the decoded text by
mlx-lm's ``TextStateMachine`` as its server builds it (``make_text_state_machine``), and each
call's text is parsed by the tokenizer's ``tool_parser`` (``mlx_lm/tool_parsers``). The answer
starts in reasoning when the prompt leaves a think block open (a Qwen3 generation prompt ends
with ``<think>``), as in mlx-lm's server. Tool calls are parsed only when the job offered
tools; a call text the parser refuses (e.g. cut short by ``max_tokens``) stays in the content,
markers included, with a warning, never dropped.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable

SPLIT_KINDS = ("text", "reasoning", "tool_call")
CALL_ID_CHARS = 9  # Mistral's templates accept only 9 letters and digits


class _WithoutTools:
    """A tokenizer seen as one without tool calling (no tools offered: calls stay text)."""

    has_tool_calling = False

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def splits_answer(tokenizer: Any, tools: bool) -> bool:
    """Whether a chat answer of this tokenizer has anything to split."""
    return bool(getattr(tokenizer, "has_thinking", False)
                or (tools and getattr(tokenizer, "has_tool_calling", False)))


def initial_state(tokenizer: Any, prompt: list[int]) -> str:
    """``"reasoning"`` when the prompt ends inside a think block, else ``"normal"`` (mlx-lm's rule)."""
    state = "normal"
    if getattr(tokenizer, "has_thinking", False):
        if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            state = "reasoning"
    return getattr(tokenizer, "response_initial_state", None) or state


def call_id(job_id: str, index: int) -> str:
    """A tool call's id: stable for the job (a retry makes the same), 9 letters and digits."""
    digest = hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()
    return "c" + digest[:CALL_ID_CHARS - 1]


class AnswerSplitter:
    """Feed text deltas; get ``(kind, value)`` pieces: ``("text", str)``, ``("reasoning", str)``,
    ``("tool_call", {"id", "name", "arguments"})``, in the order they were generated."""

    def __init__(self, tokenizer: Any, *, tools: Iterable[Any], prompt: list[int], job_id: str) -> None:
        from mlx_lm.generate import make_text_state_machine

        self.tools = [dict(t) for t in tools] or None
        self.tokenizer = tokenizer
        machine = make_text_state_machine(tokenizer if self.tools else _WithoutTools(tokenizer))
        self.state = machine.make_state(initial_state(tokenizer, prompt))
        self.job_id = job_id
        self.tool_text = ""
        self.in_tool = False
        self.content, self.reasoning = "", ""
        self.tool_calls: list[dict[str, Any]] = []
        self.warnings: list[str] = []

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        from mlx_lm.generate import TextStateMachine

        self.state, segments = TextStateMachine.split(self.state, delta)
        return self._pieces(segments)

    def finish(self) -> list[tuple[str, Any]]:
        """No more text: the held-back tail, and a call still open (no end marker, as
        Mistral's, or cut short) parsed now."""
        from mlx_lm.generate import TextStateMachine

        self.state, flushed, current = TextStateMachine.flush(self.state)
        pieces = self._pieces([(current, flushed)])
        if self.in_tool:
            pieces += self._close_call(ended=False)
        return pieces

    def _pieces(self, segments: list[tuple[str | None, str]]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for state, text in segments:
            if state != "tool" and self.in_tool:
                out += self._close_call()
            if state == "tool":
                self.in_tool = True
                self.tool_text += text
            elif state == "reasoning" and text:
                self.reasoning += text
                out.append(("reasoning", text))
            elif text:
                self.content += text
                out.append(("text", text))
        return out

    def _close_call(self, ended: bool = True) -> list[tuple[str, Any]]:
        """Parse the call text gathered since the start marker (``ended``: its end marker came)."""
        text, self.tool_text, self.in_tool = self.tool_text, "", False
        try:
            parsed = self.tokenizer.tool_parser(text, self.tools)
        except Exception as exc:  # parsers raise ValueError, JSONDecodeError, KeyError, ...
            raw = self.tokenizer.tool_call_start + text + ((self.tokenizer.tool_call_end or "") if ended else "")
            self.warnings.append(f"a tool call the model's tool parser could not read ({type(exc).__name__}: "
                                 f"{exc}"[:300] + "); its text is in the content")
            self.content += raw
            return [("text", raw)]
        out = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            index = len(self.tool_calls)
            given = call.get("id")
            clean = {"id": given if isinstance(given, str) and given else call_id(self.job_id, index),
                     "name": str(call.get("name", "")), "arguments": call.get("arguments") or {}}
            self.tool_calls.append(clean)
            out.append(("tool_call", clean))
        return out
