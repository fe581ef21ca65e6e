"""Agent conversations through the worker (issue 24 items 1-2): the prompt rendered by the model's
own template equals ``apply_chat_template``'s on two real template styles (Qwen3's ``<tool_call>``
and Mistral-Nemo's ``[TOOL_CALLS]``), and the target's generated tokens come back split into
reasoning, content and tool calls by mlx-lm's own markers and tool parsers, streamed as events.

The targets are real random-weight llamas with the styles' byte-level tokenizers; the answers
are scripted (tests/support/scripted_target.py) so the text to parse is real generated tokens."""
from __future__ import annotations

import fakeredis
import pytest

from jobs.client.answer_stream import ToolCallArguments, ToolCallStart, answer_events
from jobs.contract.keys import stream_key
from jobs.contract.results import GenerateResult
from jobs.contract.spec import build_spec
from jobs.progress import ProgressPublisher, parse_stream_events
from jobs.settings import Settings
from tests.support.chat_folders import load_tokenizer, save_chat_model
from tests.support.fake_worker import fake_backend
from tests.support.scripted_target import scripted_loader
from worker.job.answer_split import AnswerSplitter
from worker.job.context import JobContext
from worker.job.prompt import tokenize_prompt
from worker.job.tasks import execute
from worker.models import ModelPool
from worker.runtime import WorkerRuntime

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


def call(id_, key):
    return {"id": id_, "type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}


def agent_conversation(reasoning: bool) -> list[dict]:
    """Two turns of an agent loop: parallel calls, their results, an answer, a new question."""
    first = {"role": "assistant", "content": None, "tool_calls": [call("a1b2c3d4e", "alpha"), call("f5g6h7i8j", "beta")]}
    if reasoning:
        first["reasoning_content"] = "Two keys: look both up."
    return [{"role": "system", "content": "You answer from lookups."},
            {"role": "user", "content": "What are alpha and beta?"}, first,
            {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "A=1"},
            {"role": "tool", "tool_call_id": "f5g6h7i8j", "content": "B=2"},
            {"role": "assistant", "content": "alpha is 1 and beta is 2."},
            {"role": "user", "content": "And gamma?"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-models")
    return {style: save_chat_model(root / style, style) for style in ("qwen3", "mistral")}


@pytest.mark.parametrize("style, forms", [
    ("qwen3", ['<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call>\n<tool_call>',
               "<|im_start|>user\n<tool_response>\nA=1\n</tool_response>\n<tool_response>\nB=2\n</tool_response><|im_end|>",
               "# Tools", "<think>\nTwo keys: look both up.\n</think>"]),
    ("mistral", ['[TOOL_CALLS][{"name": "lookup", "arguments": {"key": "alpha"}, "id": "a1b2c3d4e"}, ',
                 '[TOOL_RESULTS]{"content": A=1, "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]', "[AVAILABLE_TOOLS]"]),
])
@pytest.mark.parametrize("turn", ["in_flight", "next_question"])
def test_rendered_prompt_equals_apply_chat_template(folders, style, forms, turn):
    """The conversation mid-turn (after the tool results) and at the next question."""
    tokenizer = load_tokenizer(folders[style])
    messages = agent_conversation(reasoning=style == "qwen3")
    if turn == "in_flight":
        messages = messages[:5]
    spec = build_spec(Settings(draft_model="d"), kind="generate", target_model="t", messages=messages, tools=TOOLS)
    prompt = tokenize_prompt(spec, tokenizer)
    expected = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    assert prompt.tokens == list(expected)
    text = tokenizer.decode(prompt.tokens)
    for form in forms:  # the template's own tool-call, tool-result and reasoning forms
        # Qwen3 renders reasoning only in the turn after the last question (it drops older)
        assert (form in text) == (turn == "in_flight" or "<think>" not in form)
    if style == "qwen3":  # the tools are in the system block, which stays protected
        head = tokenizer.apply_chat_template(messages[:1] + [{"role": "user", "content": "x"}], tools=TOOLS,
                                             add_generation_prompt=False, tokenize=False)
        block = head[:head.index("<|im_start|>user")]
        # (and the next turn's header, which every probe render shares)
        assert tokenizer.decode(prompt.tokens[:prompt.protected_prefix]) == block + "<|im_start|>user\n"


def test_tools_without_a_system_message_are_a_protected_block(folders):
    """Qwen3 renders the tools as a system block of their own: it is protected too."""
    tokenizer = load_tokenizer(folders["qwen3"])
    messages = agent_conversation(reasoning=True)[1:5]
    prompt = tokenize_prompt(build_spec(Settings(draft_model="d"), messages=messages, tools=TOOLS), tokenizer)
    head = tokenizer.decode(prompt.tokens[:prompt.protected_prefix])
    assert head.startswith("<|im_start|>system\n# Tools") and head.endswith("</tool_call><|im_end|>\n<|im_start|>user\n")
    bare = tokenize_prompt(build_spec(Settings(draft_model="d"), messages=messages), tokenizer)
    assert bare.protected_prefix == 0 and bare.boundary_reason == "no leading system or developer message"


def test_text_parts_render_as_their_joined_string(folders):
    tokenizer = load_tokenizer(folders["qwen3"])
    parts = [{"role": "user", "content": [{"type": "text", "text": "What are "}, {"type": "text", "text": "alpha?"}]}]
    spec = build_spec(Settings(draft_model="d"), messages=parts)
    assert tokenize_prompt(spec, tokenizer).tokens == list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What are alpha?"}], add_generation_prompt=True))


QWEN_CALLS = ('Let me check.</think>\n\nChecking.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"key": "beta"}}\n</tool_call>')
MISTRAL_CALLS = '[TOOL_CALLS][{"name": "lookup", "arguments": {"key": "alpha"}}, {"name": "lookup", "arguments": {"key": "beta"}}]'


def scripted_runtime(tmp_path, style, say):
    folder = str(save_chat_model(tmp_path / style, style, script={"rules": [{"say": say}]}))
    settings = Settings().replace(draft_model="fake-draft", target_model=folder, threshold=100_000,
                                  target_prefix_cache=False)
    pool = ModelPool(2, block_size=16, loader=scripted_loader, warm=lambda m: None)
    be = fake_backend()
    return WorkerRuntime(settings, fakeredis.FakeRedis(), None, pool, backend_factory=lambda: be), folder


def run(rt, folder, messages, tools=TOOLS, job_id="g", **options):
    spec = build_spec(rt.settings, kind="generate", target_model=folder, messages=messages, tools=tools,
                      greedy=True, **options)
    pub = ProgressPublisher(rt.connection, job_id, min_interval_s=0.0)
    return GenerateResult.from_json(execute(spec.to_payload(), JobContext(job_id, rt, pub)))


def events(rt, job_id="g"):
    return parse_stream_events(rt.connection.xrange(stream_key("specprefill", job_id)))


QUESTION = [{"role": "user", "content": "What are alpha and beta?"}]


def test_qwen_answer_splits_into_reasoning_content_and_parallel_calls(tmp_path):
    rt, folder = scripted_runtime(tmp_path, "qwen3", QWEN_CALLS)
    res = run(rt, folder, QUESTION)
    assert res.reasoning == "Let me check."  # the prompt ends in <think>: mlx-lm starts in reasoning
    assert res.text == "\n\nChecking.\n\n"
    assert [(c["name"], c["arguments"]) for c in res.tool_calls] == [("lookup", {"key": "alpha"}),
                                                                       ("lookup", {"key": "beta"})]
    assert res.finish_reason == "tool_calls" and all(len(c["id"]) == 9 and c["id"].isalnum() for c in res.tool_calls)
    kinds = [(e.kind, e.data.get("index")) for e in events(rt) if e.kind in ("text", "reasoning", "tool_call")]
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert runs == [("reasoning", None), ("text", None), ("tool_call", 0), ("text", None), ("tool_call", 1)]
    # the first call went out before the second was generated: it streamed, not at the end
    decode_between = [e for e in events(rt) if e.kind in ("decode", "tool_call")]
    at = [e.kind for e in decode_between].index("tool_call")
    assert "decode" in [e.kind for e in decode_between[at + 1:]]
    # the same answer again, from the calls: the next turn renders what this one returned
    nxt = QUESTION + [{"role": "assistant", "content": res.text.strip(), "reasoning_content": res.reasoning,
                       "tool_calls": [{"id": c["id"], "type": "function",
                                       "function": {"name": c["name"], "arguments": c["arguments"]}}
                                      for c in res.tool_calls]},
                      {"role": "tool", "tool_call_id": res.tool_calls[0]["id"], "content": "A=1"}]
    assert run(rt, folder, nxt, job_id="g2").tool_calls  # accepted and rendered


def test_mistral_calls_without_an_end_marker_are_parsed_at_the_end(tmp_path):
    rt, folder = scripted_runtime(tmp_path, "mistral", MISTRAL_CALLS)
    res = run(rt, folder, QUESTION)
    assert res.text == "" and res.reasoning == "" and res.finish_reason == "tool_calls"
    assert [c["arguments"]["key"] for c in res.tool_calls] == ["alpha", "beta"]


def test_no_tools_offered_leaves_the_markup_as_text(tmp_path):
    rt, folder = scripted_runtime(tmp_path, "qwen3", QWEN_CALLS)
    res = run(rt, folder, QUESTION, tools=None)
    assert res.tool_calls == [] and res.finish_reason == "eos" and "<tool_call>" in res.text


def test_a_call_cut_short_stays_in_the_content_with_a_warning(tmp_path):
    rt, folder = scripted_runtime(tmp_path, "qwen3", QWEN_CALLS)
    res = run(rt, folder, QUESTION, max_tokens=40)  # ends inside the first call
    assert res.finish_reason == "length" and res.tool_calls == []
    assert res.text == '\n\nChecking.\n<tool_call>\n{"name": "lo'  # as generated: no end marker
    assert any("tool parser could not read" in w for w in res.warnings)


def test_splitter_streams_events_the_contract_rebuilds(tmp_path):
    """What the worker published, followed as the HTTP formatters follow it."""
    rt, folder = scripted_runtime(tmp_path, "qwen3", QWEN_CALLS)
    res = run(rt, folder, QUESTION)
    from jobs.client import Client

    handle = Client(rt.connection, rt.settings).handle("g")
    handle.status = lambda: "finished"
    handle.result = lambda timeout=None, poll_s=0.05: res
    got = list(answer_events(handle))
    starts = [e for e in got if isinstance(e, ToolCallStart)]
    args = [e for e in got if isinstance(e, ToolCallArguments)]
    assert [(s.index, s.id, s.name) for s in starts] == [(i, c["id"], "lookup") for i, c in enumerate(res.tool_calls)]
    assert [a.delta for a in args] == ['{"key": "alpha"}', '{"key": "beta"}']
    assert got[-1].reason == "tool_calls" and got[-1].usage.completion_tokens == res.generated_tokens


def test_splitter_holds_back_a_partial_marker(folders):
    tokenizer = load_tokenizer(folders["qwen3"])
    split = AnswerSplitter(tokenizer, tools=TOOLS, prompt=[], job_id="j")
    pieces = split.feed("Hi <tool") + split.feed('_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>')
    assert pieces == [("text", "Hi "), ("tool_call", {"id": pieces[1][1]["id"], "name": "lookup", "arguments": {}})]


def test_a_developer_message_is_the_system_message_of_a_template_without_that_role(folders):
    """Codex-style clients send ``developer``; Qwen3's template has no such turn and would drop it."""
    tokenizer = load_tokenizer(folders["qwen3"])
    asked = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello?"}]
    prompt = tokenize_prompt(build_spec(Settings(draft_model="d"), messages=asked), tokenizer)
    as_system = [{"role": "system", "content": "Answer in French."}, asked[1]]
    assert prompt.tokens == list(tokenizer.apply_chat_template(as_system, add_generation_prompt=True))
    assert "Answer in French." in tokenizer.decode(prompt.tokens) and prompt.protected_prefix > 0
