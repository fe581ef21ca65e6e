"""Test-only views of ``worker.job.prompt``: a spec's tokens and protected prefix as a pair, and
the protected prefix alone (the worker itself uses ``tokenize_prompt`` / ``system_boundary``)."""
from __future__ import annotations

from typing import Any

from jobs.contract.spec import JobSpec
from worker.job.prompt import Template, system_boundary, tokenize_prompt


def tokenize(spec: JobSpec, tokenizer: Any) -> tuple[list[int], int]:
    """Prompt token ids and the protected prefix length for ``spec``'s input."""
    p = tokenize_prompt(spec, tokenizer)
    return p.tokens, p.protected_prefix


def protected_prefix_length(tokenizer: Any, messages: list[dict[str, str]], tokens: list[int],
                            template: Template = Template()) -> int:
    """Tokens of the rendered system/developer block at the start of ``tokens`` (0 if none)."""
    return system_boundary(tokenizer, messages, tokens, template)[0]
