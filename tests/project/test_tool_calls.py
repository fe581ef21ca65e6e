"""The shipped chat template's tools, the lookup-tool training turns, the RoPE re-base tool,
and the demo agent's tool helpers."""
from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from specprefill_cli import agent
from specprefill_cli.demo import load_demo
from tools import english_tokenizer, recall_task, rope_rebase, tool_task

REPO = Path(__file__).resolve().parents[2]
DRAFT = REPO / "models" / "draft-tiny"
TARGET = REPO / "models" / "target-tiny"
OLD_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
task = recall_task.load()


@pytest.fixture(scope="module")
def target():
    return load(str(TARGET))


def greedy(model, prompt: list[int], max_tokens: int, end: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits, out = model(mx.array([prompt]), cache=cache), []
    for _ in range(max_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token == end:
            break
        logits = model(mx.array([[token]]), cache=cache)
    return out


@pytest.mark.parametrize("folder", [DRAFT, TARGET], ids=["draft", "target"])
def test_template_offers_tools_to_mlx_lms_json_parser(folder):
    _, tokenizer = load(str(folder))
    assert tokenizer.has_tool_calling and tokenizer.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Look up the words after Orion"}],
                                             tools=[tool_task.LOOKUP_TOOL], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.startswith("<|system|># Tools") and json.dumps(tool_task.LOOKUP_TOOL) in rendered
    assert rendered.endswith("<|user|>Look up the words after Orion<|end|><|assistant|>")


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_template_without_tools_renders_as_before(generation_prompt):
    _, tokenizer = load(str(DRAFT))
    old = english_tokenizer.wrap(task.tok)
    old.chat_template = OLD_TEMPLATE
    for messages in ([{"role": "user", "content": "Which words came after Orion"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Which"}]):
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt) == \
            old.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def test_tool_call_and_result_render_and_parse_back():
    """The call the model is taught is what the template renders from an OpenAI client's
    ``tool_calls`` (arguments as a JSON string or an object), and mlx-lm's parser reads it."""
    _, tokenizer = load(str(DRAFT))
    tools = tool_task.ToolTask(task)
    ex = tools.example(random.Random(3), "call")
    reply = task.decode(ex.tokens[ex.prompt_len:])
    start, end = reply.index(tokenizer.tool_call_start), reply.index(tokenizer.tool_call_end)
    call = tokenizer.tool_parser(reply[start + len(tokenizer.tool_call_start):end], [tool_task.LOOKUP_TOOL])
    assert call == {"name": "lookup", "arguments": {"query": f"the words after {ex.key}"}}
    message = tool_task.call_message(ex.key)
    as_object = json.loads(json.dumps(message))
    as_object["tool_calls"][0]["function"]["arguments"] = call["arguments"]
    user = [{"role": "user", "content": tool_task.ASK.format(ex.key)}]
    for m in (message, as_object):
        text = tokenizer.apply_chat_template(user + [m], tools=[tool_task.LOOKUP_TOOL], tokenize=False)
        assert text.endswith(reply)
    after = tokenizer.apply_chat_template(user + [message, {"role": "tool", "content": "x"}],
                                          tools=[tool_task.LOOKUP_TOOL], tokenize=False, add_generation_prompt=True)
    assert after.endswith("<|tool|>x<|end|><|user|>Look up the words after " + ex.key + "<|end|><|assistant|>")


def test_tool_examples_hold_the_fact_and_its_answer():
    tools = tool_task.ToolTask(task)
    rng = random.Random(0)
    for _ in range(10):
        ex = tools.example(rng, "answer")
        prompt = task.decode(ex.tokens[:ex.prompt_len])
        assert " ".join([ex.key, *ex.value]) in prompt and prompt.endswith("<|assistant|>")
        assert ex.tokens[ex.prompt_len:] == [task.value_id[v] for v in ex.value] + [task.end]
    with pytest.raises(ValueError, match="turn"):
        tools.example(rng, "other")


def test_target_calls_lookup_then_answers_from_the_result(target):
    """The shipped target's greedy text for a lookup question parses (mlx-lm's own parser)
    into the lookup call for the name asked about, in at least 5 of 8 conversations (its card
    gives the measured rate: the name it copies is sometimes another word); given the tool's
    result it answers the fact's words in all 8."""
    model, tokenizer = target
    tools = tool_task.ToolTask(task)
    rng = random.Random(7)
    calls, texts = 0, []
    for _ in range(8):
        call = tools.example(rng, "call")
        text = task.decode(greedy(model, call.tokens[:call.prompt_len], 64, task.end))
        texts.append(text)
        if tokenizer.tool_call_end not in text:  # e.g. a value word repeated: no call at all
            continue
        start, end = text.index(tokenizer.tool_call_start), text.index(tokenizer.tool_call_end)
        parsed = tokenizer.tool_parser(text[start + len(tokenizer.tool_call_start):end], [tool_task.LOOKUP_TOOL])
        calls += parsed == {"name": "lookup", "arguments": {"query": f"the words after {call.key}"}}
        answer = tools.example(rng, "answer")
        got = greedy(model, answer.tokens[:answer.prompt_len], 6, task.end)
        assert got == answer.tokens[answer.prompt_len:], task.decode(got)
    assert calls >= 5, texts


@pytest.mark.slow  # builds the circuit once (as test_induction_init_answers_recall_before_any_training)
@pytest.mark.xdist_group("induction-codes")  # beside the tests that build the same circuit
def test_rope_rebase_at_the_same_base_reproduces_the_folder(tmp_path):
    """Rebuilding the circuit at the folder's own base changes no weight (so the frozen circuit
    of the shipped folder is exactly the builder's; rebase refuses a folder where it is not)."""
    config = json.loads((DRAFT / "config.json").read_text())
    rope_rebase.rebase(DRAFT, tmp_path / "same", config["rope_theta"], config["max_position_embeddings"])
    a, b = mx.load(str(DRAFT / "model.safetensors")), mx.load(str(tmp_path / "same" / "model.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_agent_tool_is_the_trained_one_and_looks_up_demo_facts():
    assert agent.LOOKUP_TOOL == tool_task.LOOKUP_TOOL and agent.ASK == tool_task.ASK
    docs = load_demo()
    name, words = next(iter(docs[0].questions.values())).split()[-1], next(iter(docs[0].answers.values()))
    result = agent.lookup(docs, tool_task.lookup_query(name))
    assert f"{name} {words}" in result and len(result) < 200
    call = {"id": "c", "function": {"name": "lookup", "arguments": json.dumps({"query": f"after {name}"})}}
    assert agent.run_tool(call, docs) == result
    assert agent.run_tool({"function": {"name": "other", "arguments": "{}"}}, docs).startswith("error")
    assert agent.run_tool({"function": {"name": "lookup", "arguments": "{"}}, docs).startswith("error")


def test_streamed_tool_call_deltas_merge_by_index():
    reply = agent.Reply()
    for delta in ({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "lookup", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "{\"query\": "}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "\"after Orion\"}"}}]}):
        agent.merge_delta(reply, delta)
    assert reply.tool_calls == [{"id": "c1", "type": "function",
                                 "function": {"name": "lookup", "arguments": "{\"query\": \"after Orion\"}"}}]


def test_verbatim_prompts_ask_for_the_lines_after_their_marker():
    rng = random.Random(2)
    for length in (1024, 2048):
        ex = recall_task.make_verbatim(task, rng, length, 3)
        text = task.decode(ex.tokens)
        lines = task.decode(ex.quote)
        assert len(ex.tokens) <= length and text.endswith(f"Quote the 3 lines after {ex.key}")
        assert f" {ex.key}:\n{lines}" in text and lines.count("\n") == 3
        assert ex.quote == ex.tokens[ex.span[0]:ex.span[1]]
