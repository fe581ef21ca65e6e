"""A job's prompt as token ids, and its protected prefix (the chat system block).

Text and tokens are taken as they are; chat messages are rendered with the model's chat
template, with the job's tools and template arguments (e.g. ``enable_thinking``). The
protected prefix is the rendered leading system/developer block (and the tools the template
puts there), found as omlx does: render the template twice with two different throwaway
user turns after the leading system messages; their common prefix is the system block,
whatever the template adds. A probe render that fails protects nothing (boundary 0, with
the reason); only the leading block is ever protected, never a later system message.
A job renders its prompt once (:func:`tokenize_prompt`) and keeps the tokens with their
boundary (:class:`PromptTokens`): its plan, the draft's selection and the result take them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from jobs.contract.spec import JobSpec, JobSpecError
from jobs.settings import Settings
from worker.models import LoadedModel

CHAT_PROBES = ("probe-A: 17 apples?", "probe-Z: what is 42")  # two throwaway user turns
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class PromptTokens:
    """A tokenized prompt: its ids, the protected prefix, and why that prefix is 0 if it is."""

    tokens: list[int]
    protected_prefix: int = 0
    boundary_reason: str | None = None


@dataclass(frozen=True)
class Template:
    """What the chat template renders besides the messages."""

    tools: tuple[Any, ...] = ()
    args: Any = None  # template keyword arguments (a mapping) or None

    @classmethod
    def of(cls, spec: JobSpec) -> "Template":
        return cls(tuple(spec.tools), dict(spec.template_args) or None)


def _common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: Template = Template(), *,
            generation_prompt: bool = True) -> tuple[str, list[dict[str, Any]]]:
    """``messages`` rendered by the chat template, and the messages as it rendered them."""
    if not getattr(tokenizer, "chat_template", None):
        raise JobSpecError("messages: the model's tokenizer has no chat template; "
                           "send text or tokens instead")
    kwargs = dict(template.args or {})
    if template.tools:
        kwargs["tools"] = [dict(t) for t in template.tools]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)
    if not _drops_developer(messages, text):
        return text, messages
    # OpenAI's developer role is the system role (as OpenAI's models read it); a template with
    # no such turn (Qwen3's) drops the message silently, so it is rendered as system instead.
    as_system = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    return tokenizer.apply_chat_template(as_system, tokenize=False, add_generation_prompt=generation_prompt,
                                         **kwargs), as_system


def _drops_developer(messages: list[dict[str, Any]], text: str) -> bool:
    """Whether the render ``text`` left out a developer message's text."""
    return any(m["role"] == "developer" and m.get("content") and m["content"] not in text for m in messages)


def render_tokens(tokenizer: Any, messages: list[dict[str, Any]], template: Template = Template(), *,
                  generation_prompt: bool = True) -> list[int]:
    """``messages`` rendered by the chat template and tokenized as a job's prompt is."""
    return _encode(tokenizer, _render(tokenizer, messages, template, generation_prompt=generation_prompt)[0],
                   special=False)


def chat_messages(spec: JobSpec) -> list[dict[str, Any]]:
    """A chat job's messages as the chat template takes them."""
    return [dict(m) for m in spec.messages or ()]


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def _leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    head = []
    for m in messages:
        if m["role"] not in SYSTEM_ROLES:
            break
        head.append(m)
    return head


def system_boundary(tokenizer: Any, messages: list[dict[str, Any]], tokens: list[int],
                    template: Template = Template()) -> tuple[int, str | None]:
    """Tokens of the rendered leading system block at the start of ``tokens``, and the reason
    when that is 0. With tools the block exists without a system message (the template renders
    the tools there)."""
    head = _leading_system(messages)
    if not head and not template.tools:
        return 0, "no leading system or developer message"
    try:
        renders = [_render(tokenizer, head + [{"role": "user", "content": p}], template)[0]
                   for p in CHAT_PROBES]
    except Exception as exc:  # templates raise anything (jinja errors, their own exceptions)
        return 0, f"the chat template failed on the system block: {type(exc).__name__}: {exc}"[:500]
    prefix_text = renders[0][:_common_prefix_len(*renders)]
    n = _common_prefix_len(_encode(tokenizer, prefix_text, special=False), tokens)
    return n, None if n else "the system block renders to nothing the prompt starts with"


def tokenize_prompt(spec: JobSpec, tokenizer: Any) -> PromptTokens:
    """Prompt token ids, the protected prefix and its reason for ``spec``'s input: the one render
    of a job's prompt (the job keeps the result; nothing renders the prompt again). The probes of
    the system block render the messages as the prompt's render took them (a developer message
    the template drops already as system: decided once)."""
    if spec.tokens is not None:
        return PromptTokens(list(spec.tokens), 0, "token input has no system block")
    if spec.text is not None:
        return PromptTokens(_encode(tokenizer, spec.text, special=True), 0, "text input has no system block")
    messages = chat_messages(spec)
    template = Template.of(spec)
    try:
        text, messages = _render(tokenizer, messages, template)
    except JobSpecError:
        raise
    except Exception as exc:
        raise JobSpecError(f"messages: the chat template failed: {type(exc).__name__}: {exc}"[:500]) from None
    tokens = _encode(tokenizer, text, special=False)
    return PromptTokens(tokens, *system_boundary(tokenizer, messages, tokens, template))


def check_prompt(tokens: list[int], loaded: LoadedModel | int | None, settings: Settings) -> None:
    """Refuse an empty or too long prompt, or ids outside ``loaded``'s vocabulary (a model, or
    its vocabulary size)."""
    vocab_size = loaded if loaded is None or isinstance(loaded, int) else loaded.vocab_size
    if not tokens:
        raise JobSpecError("input: tokenizes to 0 tokens")
    if len(tokens) > settings.max_prompt_tokens:
        raise JobSpecError(f"input: {len(tokens)} tokens, the limit is "
                           f"{settings.max_prompt_tokens} (max_prompt_tokens)")
    if vocab_size is not None and max(tokens) >= vocab_size:
        raise JobSpecError(f"tokens: id {max(tokens)} is outside the model's vocabulary "
                           f"[0, {vocab_size - 1}]")


def check_positions(tokens: list[int], max_tokens: int, target: LoadedModel) -> None:
    """Refuse a generate job that would run past the target's learned position embeddings (gpt2's
    wpe): past its last row a table reads undefined memory, in a plain prefill as in a sparse one."""
    profile = getattr(target, "target_profile", None)
    limit = getattr(profile, "max_positions", None)
    if limit is not None and len(tokens) + max_tokens > limit:
        raise JobSpecError(f"max_tokens: the prompt's {len(tokens)} tokens plus max_tokens {max_tokens} are "
                           f"more than the {limit} positions the target embeds (learned position embeddings)")


UNKNOWN_TOKEN_SHARE = 0.01  # more of the prompt than this as the unknown token: warn


def unknown_token_warning(tokens: list[int], tokenizer: Any) -> str | None:
    """A warning when more than 1 % of ``tokens`` are the tokenizer's unknown token (the
    model then reads a prompt it cannot see; byte-level tokenizers have none)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(unk, int) or not tokens:
        return None
    n = tokens.count(unk)
    if n <= UNKNOWN_TOKEN_SHARE * len(tokens):
        return None
    return (f"input: {n} of {len(tokens)} tokens ({100 * n / len(tokens):.1f}%) are the "
            f"tokenizer's unknown token (id {unk}): the model cannot read that text")
