"""What the next turn of a conversation will render before its new part: the prompt, this turn's
answer and the template's end of turn, as far as every next turn renders it the same.

Chat templates re-render history: Qwen3-style templates drop the reasoning (``<think>``) of
assistant turns before the last user message, others strip whitespace or count the messages.
So the heal's tokens are not this turn's prompt plus the generated ids but the conversation
with the answer appended, rendered as a next turn would render it: the template renders it
followed by several throwaway next turns (a user message, a tool result, a longer exchange)
and the heal takes their longest common prefix. When the conversation rendered alone is a
prefix of that, the heal is exactly prompt + answer + end of turn; otherwise the template
rewrites this turn once another follows, and the heal stops at the longest stable prefix and
says so (``NextTurn.note``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from jobs.contract.spec import JobSpec
from worker.job.prompt import Template, _common_prefix_len, chat_messages, render_tokens

# Throwaway next turns: different roles, lengths and first characters, so their renders share
# only what every next turn starts with.
NEXT_TURN_PROBES = (
    ({"role": "user", "content": "probe-A: 17 apples?"},),
    ({"role": "tool", "content": "{\"probe\": \"Z\", \"value\": 42}"},),
    ({"role": "user", "content": "Quick probe"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "and again?"}),
)

# An answer with tool calls is followed by their results (the chat APIs require them, before
# any user message): its throwaway next turns are results of its own calls, so a template that
# keeps the reasoning of a turn still in flight (Qwen3's) keeps it in the heal too.
TOOL_RESULT_PROBES = ("probe-A: 17 apples?", "{\"probe\": \"Z\", \"value\": 42}", "Quick probe")


def next_turn_probes(reply: Mapping[str, Any]) -> tuple[tuple[dict[str, Any], ...], ...]:
    """The throwaway next turns of an answer (``reply``: the assistant message)."""
    calls = reply.get("tool_calls") or []
    if not calls:
        return NEXT_TURN_PROBES
    return tuple(tuple({"role": "tool", "tool_call_id": c.get("id"), "name": c.get("function", {}).get("name"),
                        "content": content} for c in calls) for content in TOOL_RESULT_PROBES)


@dataclass(frozen=True)
class NextTurn:
    """The tokens every next turn starts with, how many the conversation renders alone, and why
    the first stop short of the conversation rendered alone (None: they do not)."""

    tokens: list[int]
    rendered: int
    note: str | None = None


def next_turn(spec: JobSpec, tokenizer: Any, prompt_tokens: Sequence[int], answer: str | Mapping[str, Any],
              answer_ids: Sequence[int]) -> NextTurn:
    """The stable start of the next turn after ``spec``'s prompt answered with ``answer`` (its
    text, or the assistant message with its tool calls and reasoning, as the next request
    carries it)."""
    if spec.messages is None:  # tokens or text: the next prompt continues this one's tokens
        tokens = list(prompt_tokens) + list(answer_ids)
        return NextTurn(tokens, len(tokens))
    reply = {"role": "assistant", "content": answer} if isinstance(answer, str) else dict(answer)
    history = chat_messages(spec) + [reply]
    template = Template.of(spec)
    try:
        alone = render_tokens(tokenizer, history, template, generation_prompt=False)
    except Exception as exc:  # templates raise anything
        return NextTurn([], 0, f"the chat template cannot render the answered conversation: "
                               f"{type(exc).__name__}: {exc}"[:400])
    renders = []
    for probe in next_turn_probes(reply):
        try:
            renders.append(render_tokens(tokenizer, history + list(probe), template))
        except Exception:  # a template refusing one role or shape: the other probes decide
            continue
    if len(renders) < 2:
        return NextTurn([], len(alone), "the chat template renders fewer than two next turns")
    stable = renders[0]
    for other in renders[1:]:
        stable = stable[:_common_prefix_len(stable, other)]
    if _common_prefix_len(alone, stable) == len(alone):
        return NextTurn(list(alone), len(alone))
    return NextTurn(list(stable), len(alone),
                    f"the chat template renders this turn differently once another turn follows "
                    f"(the answered conversation renders to {len(alone)} tokens alone, every next "
                    f"turn starts with the same {len(stable)}); the heal stops at those {len(stable)}")
