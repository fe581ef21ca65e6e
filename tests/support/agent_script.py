"""The scripted agent of the HTTP agent-loop tests (chat completions, Messages, Responses):
the model's name, its one tool, and the rules its scripted target answers by (which turn
says what: a tool call, the answer from its result, parallel calls, the answer from theirs)."""
from __future__ import annotations

import json

MODEL = "agent"
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


def calls(*keys):
    return "\n".join(f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{k}"}}}}\n</tool_call>' for k in keys)


RULES = [{"when": "What is alpha?", "say": "I need alpha.</think>\n\n" + calls("alpha")},
         {"when": "A=1", "say": "It came back.</think>\n\nalpha is 1."},
         {"when": "And beta and gamma?", "say": "Two more.</think>\n\n" + calls("beta", "gamma")},
         {"when": "C=3", "say": "Both back.</think>\n\nbeta is 2, gamma is 3."}]


def answer(client, messages, **kw):
    """One turn, as a dict: content, reasoning, tool calls (id, name, arguments), finish, usage."""
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **kw)
    m = r.choices[0].message
    return {"content": m.content, "reasoning": (m.model_extra or {}).get("reasoning_content"),
            "calls": [(c.id, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or ()],
            "finish": r.choices[0].finish_reason, "usage": (r.usage.prompt_tokens, r.usage.completion_tokens)}, m


def counts(tokenizer, messages, say):
    """(prompt, completion) tokens the answer must report: the template's render, the script's answer."""
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    return len(prompt), len(tokenizer.encode(say, add_special_tokens=False))
