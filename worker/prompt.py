"""A job's prompt as token ids, and its protected prefix (the chat system block).

Text and tokens are taken as they are; chat messages are rendered with the draft's chat
template. The protected prefix is the rendered system/developer block, found as omlx does:
render the template twice with two different throwaway user turns after the leading
system messages; their common prefix is the system block, whatever the template adds.
"""
from __future__ import annotations

from typing import Any, Sequence

from jobs.settings import Settings
from jobs.spec import JobSpec, JobSpecError
from worker.models import LoadedModel

CHAT_PROBES = ("probe-A: 17 apples?", "probe-Z: what is 42")  # two throwaway user turns
SYSTEM_ROLES = ("system", "developer")


def _common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise JobSpecError("messages: the draft model's tokenizer has no chat template; "
                           "send text or tokens instead")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def protected_prefix_length(tokenizer: Any, messages: list[dict[str, str]], tokens: list[int]) -> int:
    """Tokens of the rendered system/developer block at the start of ``tokens`` (0 if none)."""
    head = []
    for m in messages:
        if m["role"] not in SYSTEM_ROLES:
            break
        head.append(m)
    if not head:
        return 0
    renders = [_render(tokenizer, head + [{"role": "user", "content": p}]) for p in CHAT_PROBES]
    prefix_text = renders[0][:_common_prefix_len(*renders)]
    return _common_prefix_len(_encode(tokenizer, prefix_text, special=False), tokens)


def tokenize(spec: JobSpec, tokenizer: Any) -> tuple[list[int], int]:
    """Prompt token ids and the protected prefix length for ``spec``'s input."""
    if spec.tokens is not None:
        return list(spec.tokens), 0
    if spec.text is not None:
        return _encode(tokenizer, spec.text, special=True), 0
    messages = [{"role": r, "content": c} for r, c in spec.messages or ()]
    tokens = _encode(tokenizer, _render(tokenizer, messages), special=False)
    return tokens, protected_prefix_length(tokenizer, messages, tokens)


def check_prompt(tokens: list[int], loaded: LoadedModel, settings: Settings) -> None:
    """Refuse an empty or too long prompt, or ids outside ``loaded``'s vocabulary."""
    if not tokens:
        raise JobSpecError("input: tokenizes to 0 tokens")
    if len(tokens) > settings.max_prompt_tokens:
        raise JobSpecError(f"input: {len(tokens)} tokens, the limit is "
                           f"{settings.max_prompt_tokens} (max_prompt_tokens)")
    if loaded.vocab_size is not None and max(tokens) >= loaded.vocab_size:
        raise JobSpecError(f"tokens: id {max(tokens)} is outside the model's vocabulary "
                           f"[0, {loaded.vocab_size - 1}]")


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
