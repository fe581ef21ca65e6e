"""What a heal prefills (issue 25 item 3): the conversation as the NEXT turn renders it, for
templates that rewrite history (Qwen3-style reasoning dropped from earlier turns, whitespace
stripped) and one that makes a stable prefix impossible (the heal stops there and says so).
Real Jinja templates (as ``apply_chat_template`` renders them) over a character tokenizer."""
from __future__ import annotations

import jinja2

from jobs.contract.spec import build_spec
from jobs.settings import Settings
from tests.support.fake_worker import FakeTokenizer
from worker.job.next_turn import next_turn
from worker.job.prompt import chat_messages, render_tokens, tokenize_prompt

# Qwen3's rule: an assistant turn before the last user query loses its <think> block (Qwen3
# keeps it before a tool result: QUERY_ROLES ("user",); a variant drops it there too).
QWEN3_STYLE = """
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role in QUERY_ROLES -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set reasoning = '' -%}{%- set content = m.content -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query and reasoning -%}
<|im_start|>assistant\n<think>{{ reasoning }}</think>\n\n{{ content }}<|im_end|>\n
{%- else -%}<|im_start|>assistant\n{{ content }}<|im_end|>\n{%- endif -%}
{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}
"""
STRIPPING = """{%- for m in messages -%}[{{ m.role }}]{{ m.content | trim }}[/{{ m.role }}]{%- endfor -%}
{%- if add_generation_prompt -%}[assistant]{%- endif -%}"""
# Counts the messages in its header: every turn renders a different first line.
COUNTING = """<n={{ messages | length }}>{%- for m in messages -%}[{{ m.role }}]{{ m.content }}{%- endfor -%}
{%- if add_generation_prompt -%}[assistant]{%- endif -%}"""


class JinjaTokenizer(FakeTokenizer):
    def __init__(self, source: str, **constants) -> None:
        self.chat_template = source
        self._template = jinja2.Environment().from_string(source)
        self.constants = constants

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.constants, **kwargs)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 6 x 7?"}]


def turn(tokenizer, answer, then=({"role": "user", "content": "Why?"},)):
    spec = build_spec(Settings(), kind="generate", draft_model="d", target_model="t", messages=MESSAGES)
    prompt = tokenize_prompt(spec, tokenizer).tokens
    healed = next_turn(spec, tokenizer, prompt, answer, tokenizer.encode(answer, add_special_tokens=False))
    nexts = [render_tokens(tokenizer, chat_messages(spec) + [{"role": "assistant", "content": answer}, m])
             for m in then]
    return prompt, healed, nexts[0] if len(then) == 1 else nexts


ANSWER = "<think>six sevens, carry the four</think>\n\nIt is 42."
NEXT_KINDS = ({"role": "user", "content": "Why?"}, {"role": "tool", "content": "{\"result\": 42}"})


def test_qwen3_style_reasoning_dropped_before_any_next_turn_is_healed_without_it():
    tok = JinjaTokenizer(QWEN3_STYLE, QUERY_ROLES=("user", "tool"))
    prompt, healed, nexts = turn(tok, ANSWER, NEXT_KINDS)
    for next_prompt in nexts:  # turn N+1 starts with the heal, whichever message comes next
        assert next_prompt[:len(healed.tokens)] == healed.tokens
    # The heal holds the prompt, the answer without its reasoning and the end of turn.
    without = render_tokens(tok, MESSAGES + [{"role": "assistant", "content": "It is 42."}], generation_prompt=False)
    assert healed.tokens[:len(prompt)] == prompt and healed.tokens[:len(without)] == without
    assert healed.note and "differently once another turn follows" in healed.note
    naive = prompt + tok.encode(ANSWER, add_special_tokens=False)  # prompt + generated ids
    assert nexts[0][:len(naive)] != naive


def test_qwen3_reasoning_kept_before_a_tool_result_stops_the_heal_at_the_stable_prefix():
    """Qwen3 drops the reasoning before a new user message and keeps it before a tool result:
    the next turn's render depends on what comes next, so the heal ends where they part."""
    tok = JinjaTokenizer(QWEN3_STYLE, QUERY_ROLES=("user",))
    prompt, healed, nexts = turn(tok, ANSWER, NEXT_KINDS)
    for next_prompt in nexts:
        assert next_prompt[:len(healed.tokens)] == healed.tokens
    assert healed.tokens[:len(prompt)] == prompt and len(healed.tokens) < healed.rendered
    assert nexts[0][len(healed.tokens)] != nexts[1][len(healed.tokens)]  # the longest stable prefix
    assert f"stops at those {len(healed.tokens)}" in healed.note


def test_a_whitespace_stripping_template_heals_the_stripped_answer():
    tok = JinjaTokenizer(STRIPPING)
    answer = "  It is 42. \n\n"
    prompt, healed, next_prompt = turn(tok, answer)
    assert healed.note is None and healed.rendered == len(healed.tokens)
    assert next_prompt[:len(healed.tokens)] == healed.tokens
    assert healed.tokens[-len("It is 42.[/assistant]"):] == \
        tok.encode("It is 42.[/assistant]", add_special_tokens=False)
    naive = prompt + tok.encode(answer, add_special_tokens=False)
    assert next_prompt[:len(naive)] != naive


def test_a_template_with_no_stable_prefix_stops_there_and_says_so():
    tok = JinjaTokenizer(COUNTING)
    prompt, healed, next_prompt = turn(tok, "42")
    assert healed.tokens == tok.encode("<n=", add_special_tokens=False)  # all that every next turn shares
    assert next_prompt[:len(healed.tokens)] == healed.tokens
    assert healed.note and f"stops at those {len(healed.tokens)}" in healed.note


def test_token_input_continues_with_the_generated_ids():
    spec = build_spec(Settings(), kind="generate", draft_model="d", target_model="t", tokens=[5, 6, 7])
    healed = next_turn(spec, FakeTokenizer(), [5, 6, 7], "xy", [9, 10])
    assert healed.tokens == [5, 6, 7, 9, 10] and healed.note is None
