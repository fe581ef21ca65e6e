"""The shipped target ends its turns (issue 40 item 7): a short instruction at the end of a long
agent-like prompt (system rules, an environment block, tool definitions, as
tools/instruction_task.py builds them) gets a short reply and ``<|end|>`` within 64 tokens,
greedy, through a KV cache as the worker decodes. The weights before this training looped to
the token limit on such prompts. The reply's words are right for only some instructions (the
model card's "exact reply" column): what is pinned is that the turn ends, shortly."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from mlx_lm import load

from tools import recall_task, train_tiny
from tools.instruction_task import InstructionTask

TARGET = Path(__file__).resolve().parents[2] / "models" / "target-tiny"
task = recall_task.load()


@pytest.fixture(scope="module")
def target():
    return load(str(TARGET))[0]


@pytest.mark.parametrize("system_tokens", [1500, 6000])
@pytest.mark.parametrize("instruction", ["Say hello.", "What is 2+2?"])
def test_a_short_instruction_in_an_agent_prompt_gets_a_short_reply_and_its_end(target, instruction, system_tokens):
    messages, tools = InstructionTask(task).messages(random.Random(system_tokens), system_tokens, instruction)
    messages[-1]["content"] = instruction  # as Qwen Code and Codex send it: no reminder before it
    prompt = InstructionTask(task).render(messages, tools)
    out = train_tiny.greedy_reply(target, prompt, task.end, max_tokens=64)
    assert out[-1:] == [task.end] and 1 < len(out) <= 16, (len(prompt), task.decode(out))
