"""A target whose answers a test chooses: a real mlx-lm llama (real cache, real profile, real
prefill and decode), its logits replaced by a one-hot on the next token of a scripted answer.

``script.json`` in the model folder (tests/support/chat_folders.py) holds rules,
``{"rules": [{"when": "alpha?", "say": "<tool_call>..."}, {"when": "A=1", "say": "alpha is 1."}]}``:
the rule whose ``when`` text's tokens occur latest in what the model was fed wins (a rule
without ``when`` is the fallback), so each turn of an agent loop gets its own answer. The
answer is the rule's ``say`` encoded by the model's own tokenizer, then EOS, so what the worker detokenizes and parses (markers, tool calls) is real generated token text.

``"prefill_delay_s": X`` beside the rules makes every call that feeds more than one token for
a matching rule (a prefill) sleep X seconds first: a prefill as long as a test needs (warm-up
and profiling match no rule, so they do not wait).

The model tracks what its cache holds and forces the token after the longest tail of that
which is a prefix of the answer, so it is right whatever the prefill's chunking. A restored
cache (the target's prefix store: another job's blocks and tail) holds tokens this call never
sees; the loader has the worker's prompt tokenization tell the model each job's prompt
(:func:`_see_prompts`), so what a restore put before the fed tokens is read from the prompt.
A sparse prefill still feeds only the kept tokens: a test keeps the ``when`` text in the part
of the prompt the target prefills (the tail, or a plain prefill).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


_PROMPT: list[list[int]] = [[]]  # the prompt of the job this process runs (set by _see_prompts)


def _ends_with(seq: list[int], tail: list[int]) -> bool:
    return len(tail) <= len(seq) and seq[len(seq) - len(tail):] == tail


def _last_at(seq: list[int], part: list[int]) -> int:
    """Where ``part`` last occurs in ``seq`` (-1: nowhere; an empty part: -1 too)."""
    n = len(part)
    return next((i for i in range(len(seq) - n, -1, -1) if n and seq[i:i + n] == part), -1)


class Script:
    """The rules as token ids: which answer a prompt gets, and the next token of it."""

    def __init__(self, rules: list[dict[str, str]], tokenizer: Any) -> None:
        eos = min(tokenizer.eos_token_ids)
        enc = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        self.rules = [(enc(r["when"]) if r.get("when") else [], enc(r["say"]) + [eos]) for r in rules]

    def answer(self, seen: list[int]) -> list[int] | None:
        """The answer of the rule whose ``when`` occurs latest (no ``when``: the fallback);
        None when no rule matches (the model's own logits then: warm-up, profiling)."""
        at = [(_last_at(seen, when) if when else -1, -i) for i, (when, _) in enumerate(self.rules)]
        best = max(range(len(self.rules)), key=lambda i: at[i])
        if at[best][0] < 0 and self.rules[best][0]:
            return None
        return self.rules[best][1]

    def next_token(self, seen: list[int]) -> int | None:
        say = self.answer(seen)
        if say is None:
            return None
        k = next(k for k in range(min(len(say) - 1, len(seen)), -1, -1) if _ends_with(seen, say[:k]))
        return say[k]


def scripted(model: Any, script: Script, prefill_delay_s: float = 0.0) -> Any:
    """``model`` (an mlx-lm model) answering by ``script``; its weights and layers unchanged.
    A prefill for a matching rule first sleeps ``prefill_delay_s``."""
    import time

    import mlx.core as mx

    base = type(model)

    class ScriptedModel(base):  # type: ignore[misc, valid-type]
        def __call__(self, inputs, cache=None, **kwargs):
            logits = base.__call__(self, inputs, cache=cache, **kwargs)
            offsets = [int(c.offset) for c in cache or () if hasattr(c, "offset")]
            fed = inputs.reshape(-1).tolist()
            fresh = not offsets or min(offsets) <= len(fed)  # this call filled the cache from 0
            before, prompt, seen = (min(offsets) - len(fed) if offsets else 0), _PROMPT[0], getattr(self, "_seen", [])
            if fresh:
                self._seen = fed
            elif len(seen) != before and prompt[before:before + len(fed)] == fed:
                self._seen = prompt[:before] + fed  # a restored cache: it holds the prompt's start
            else:  # the next step of what it saw (a prefill's, a decode's, a sparse prefill's kept tokens)
                self._seen = seen + fed
            forced = script.next_token(self._seen)
            if forced is None:
                return logits
            if prefill_delay_s and len(fed) > 1:
                time.sleep(prefill_delay_s)
            row = mx.where(mx.arange(logits.shape[-1]) == forced, 0.0, -1e9).astype(logits.dtype)
            return mx.broadcast_to(row, logits.shape)

    model.__class__ = ScriptedModel
    return model


def scripted_loader(name: str) -> tuple[Any, Any]:
    """``mlx_lm.load``, with a folder's ``script.json`` (if any) making its model scripted."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(name)
    path = Path(name) / "script.json"
    if path.is_file():
        _see_prompts()
        script = json.loads(path.read_text())
        model = scripted(model, Script(script["rules"], tokenizer), script.get("prefill_delay_s", 0.0))
    return model, tokenizer


def _see_prompts() -> None:
    """Have the worker's prompt tokenization (``worker.job.generate_pipeline.tokenize_prompt``) tell
    :data:`_PROMPT` each job's prompt (once per process)."""
    import worker.job.generate_pipeline as pipeline

    tokenize = pipeline.tokenize_prompt
    if getattr(tokenize, "tells_script", False):
        return

    def telling(spec, tokenizer):
        prompt = tokenize(spec, tokenizer)
        _PROMPT[0] = [int(t) for t in prompt.tokens]
        return prompt

    telling.tells_script = True
    pipeline.tokenize_prompt = telling
