"""The tool-calling turns the shipped target is trained on (the recall task, looked up).

A user asks "Look up the words after Orion" with a ``lookup`` tool offered; the assistant calls
it in the shipped template's Qwen-style format::

    <tool_call>
    {"name": "lookup", "arguments": {"query": "the words after Orion"}}
    </tool_call><|end|>

The tool answers with a short passage of prose holding the fact ("... a note that said Orion
cobalt falcon quartz. ..."), and on the next turn the assistant answers "cobalt falcon quartz"
then ``<|end|>``. Prompts are rendered by the shipped chat template itself
(``tools/english_tokenizer.py``), so training sees exactly what ``apply_chat_template`` gives a
client. The query ends in "after Orion", as the question does: the recall circuit copies the
name from the question (the token after "after"); no prose is in a tool-call prompt, so "after"
is there only once before the call.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from specprefill_cli.agent import ASK, LOOKUP_TOOL  # the tool the demo's agent offers: one definition
from tools.recall_task import ChatExample, ChatTask

SYSTEMS = ("", "You are a helpful assistant.", "Answer briefly.", "Use the tools when asked to look something up.")


def lookup_query(key: str) -> str:
    """The ``query`` argument the model is taught to send for ``key``."""
    return f"the words after {key}"


def call_message(key: str, call_id: str = "call_0") -> dict:
    """The assistant's tool-call message, as an OpenAI client sends it back."""
    arguments = json.dumps({"query": lookup_query(key)})
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}]}


@dataclass
class ToolExample(ChatExample):
    key: str
    value: list[str]
    turn: str                    # "call" or "answer"


class ToolTask(ChatTask):
    """Tool-call and tool-answer examples in the tokens (and template) of a recall task."""

    def render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.template.apply_chat_template(messages, tools=[LOOKUP_TOOL], tokenize=False,
                                                 add_generation_prompt=generation_prompt)

    def passage(self, rng: random.Random, n_tokens: int, n_needles: int):
        """A short document whose text is the tool's result, and the needle asked about."""
        doc = self.task.make_document(rng, n_tokens, n_needles, exact=False)
        return doc.text.strip(), rng.choice(doc.needles)

    def example(self, rng: random.Random, turn: str) -> ToolExample:
        """A ``turn`` ("call" or "answer") example with a random system message and passage."""
        n_needles = rng.randint(1, 3)
        text, needle = self.passage(rng, rng.randint(48 * n_needles, 48 * n_needles + 64), n_needles)
        system = rng.choice(SYSTEMS)
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": ASK.format(needle.key)}]
        if turn == "call":
            reply_messages = messages + [call_message(needle.key)]
        elif turn == "answer":
            messages = messages + [call_message(needle.key), {"role": "tool", "tool_call_id": "call_0",
                                                              "content": text}]
            reply_messages = None
        else:
            raise ValueError(f"turn must be 'call' or 'answer', got {turn!r}")
        prompt = self.task.encode(self.render(messages, generation_prompt=True))
        if reply_messages is None:
            reply = self.task.answer_ids(needle) + [self.task.end]
        else:
            full = self.task.encode(self.render(reply_messages, generation_prompt=False))
            if full[:len(prompt)] != prompt:
                raise AssertionError("the call's rendering does not extend the prompt's")
            reply = full[len(prompt):]
        return ToolExample(prompt + reply, len(prompt), needle.key, needle.value, turn)
