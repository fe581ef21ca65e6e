"""The shipped target ends its turns (issue 40 item 7): a short instruction at the end of a long
agent-like prompt (system rules, an environment block, tool definitions, as
tools/instruction_task.py builds them) gets a short reply and ``<|end|>`` within 64 tokens,
greedy, through a KV cache as the worker decodes. The weights before this training looped to
the token limit on such prompts. The reply's words are right for only some instructions (the
model card's "exact reply" column): what is pinned is that the turn ends, shortly."""
from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from tools import recall_task, train_tiny
from tools.instruction_task import InstructionTask

TARGET = Path(__file__).resolve().parents[2] / "models" / "target-tiny"
task = recall_task.load()


SYSTEM_TOKENS = (1500, 6000)
INSTRUCTIONS = ("Say hello.", "What is 2+2?")
STEP = 1024  # greedy_reply's prefill pieces


@pytest.fixture(scope="module")
def target():
    return load(str(TARGET))[0]


def agent_prompt(system_tokens: int, instruction: str) -> list[int]:
    messages, tools = InstructionTask(task).messages(random.Random(system_tokens), system_tokens, instruction)
    messages[-1]["content"] = instruction  # as Qwen Code and Codex send it: no reminder before it
    return InstructionTask(task).render(messages, tools)


@pytest.fixture(scope="module")
def shared_pieces(target):
    """Per system prompt size, the KV state of the whole prefill pieces that every instruction's
    prompt shares (its system prompt and tools): prefilled once, as the worker restores a prefix;
    the same pieces, so the same numbers, as each prompt's own prefill."""
    from mlx_lm.models.cache import make_prompt_cache

    out = {}
    for system_tokens in SYSTEM_TOKENS:
        prompts = [agent_prompt(system_tokens, instruction) for instruction in INSTRUCTIONS]
        common = next(i for i, tokens in enumerate(zip(*prompts)) if len(set(tokens)) > 1)
        cache = make_prompt_cache(target)
        for start in range(0, common // STEP * STEP, STEP):
            target(mx.array([prompts[0][start:start + STEP]]), cache=cache)
        mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])
        out[system_tokens] = [c.state for c in cache]
    return out


@pytest.mark.parametrize("system_tokens", SYSTEM_TOKENS)
@pytest.mark.parametrize("instruction", INSTRUCTIONS)
def test_a_short_instruction_in_an_agent_prompt_gets_a_short_reply_and_its_end(target, shared_pieces, instruction,
                                                                              system_tokens):
    from mlx_lm.models.cache import make_prompt_cache

    prompt = agent_prompt(system_tokens, instruction)
    cache = make_prompt_cache(target)
    for layer, (keys, values, offset) in zip(cache, shared_pieces[system_tokens]):
        if keys is not None:  # copies: the prefill writes into its cache
            layer.state = (mx.array(keys), mx.array(values), offset)
    out = train_tiny.greedy_reply(target, prompt, task.end, max_tokens=64, step=STEP, cache=cache)
    assert out[-1:] == [task.end] and 1 < len(out) <= 16, (len(prompt), task.decode(out))
