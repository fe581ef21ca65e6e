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

The model reads what each sequence's cache holds, as a real model does, so it is right whatever
the prefill's chunking, however many jobs run at once, whether a sequence decodes alone or as a
row of a decode batch (mlx-lm's ``BatchKVCache``: left-padded rows, a RoPE offset per row), and
after a restore (the target's prefix store puts another job's blocks and tail before the fed
tokens). It reads the token ids off its first layer's values: a llama's value vector there is
``v_proj(input_layernorm(embedding))`` of one token, the same at every position (no RoPE), so
each cached position is the vocabulary entry whose vector it equals (:class:`CacheReader`). A
sparse prefill's cache holds only the kept tokens: a test keeps the ``when`` text in the part of
the prompt the target prefills (the tail, or a plain prefill).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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


class CacheReader:
    """The token ids a scripted llama's caches hold, one list per sequence, read off layer 0's values."""

    def __init__(self, model: Any) -> None:
        import mlx.core as mx
        import numpy as np

        inner = model.model
        layer = inner.layers[0]
        vocab = inner.embed_tokens.weight.shape[0]
        values = layer.self_attn.v_proj(layer.input_layernorm(inner.embed_tokens(mx.arange(vocab))))
        self.table = np.array(values.astype(mx.float32)).astype(np.float64)  # one row per token id
        self.norms = (self.table ** 2).sum(axis=1)

    def sequences(self, first: Any) -> list[list[int]]:
        """Per sequence of ``first`` (layer 0's cache: a ``KVCache`` or a ``BatchKVCache``) its tokens."""
        from mlx_lm.models.cache import BatchKVCache, KVCache

        if isinstance(first, BatchKVCache):
            pads = first.left_padding.tolist()
            return [self._tokens(first.values[i, :, pad:first._idx]) for i, pad in enumerate(pads)]
        if isinstance(first, KVCache):
            return [self._tokens(first.values[0, :, :first.offset]) if first.values is not None else []]
        raise TypeError(f"scripted target: no rule to read a {type(first).__name__} (a llama's KV caches only)")

    def _tokens(self, values: Any) -> list[int]:
        """The token of each position of ``values`` (kv heads, positions, head dim)."""
        import mlx.core as mx
        import numpy as np

        if values.shape[1] == 0:
            return []
        rows = np.array(values.astype(mx.float32)).astype(np.float64).transpose(1, 0, 2).reshape(values.shape[1], -1)
        dist = self.norms[None, :] - 2 * rows @ self.table.T + (rows ** 2).sum(axis=1, keepdims=True)
        tokens = dist.argmin(axis=1)
        worst = float((dist[np.arange(len(tokens)), tokens] / np.maximum(self.norms[tokens], 1e-12)).max())
        if worst > 1e-6:  # a position holding no token's value: the reader's premise broke
            raise AssertionError(f"scripted target: a cached value is no token's (relative distance {worst:.2g})")
        return tokens.tolist()


def scripted(model: Any, script: Script, prefill_delay_s: float = 0.0) -> Any:
    """``model`` (an mlx-lm llama) answering by ``script``; its weights and layers unchanged.
    A prefill for a matching rule first sleeps ``prefill_delay_s``."""
    import time

    import mlx.core as mx

    base = type(model)
    reader = CacheReader(model)

    class ScriptedModel(base):  # type: ignore[misc, valid-type]
        def __call__(self, inputs, cache=None, **kwargs):
            logits = base.__call__(self, inputs, cache=cache, **kwargs)
            held = reader.sequences(cache[0]) if cache else inputs.tolist()
            forced = [script.next_token(seen) for seen in held]
            if all(f is None for f in forced):
                return logits
            if prefill_delay_s and inputs.shape[1] > 1:
                time.sleep(prefill_delay_s)
            vocab = mx.arange(logits.shape[-1])
            rows = [logits[i] if f is None else mx.broadcast_to(
                mx.where(vocab == f, 0.0, -1e9).astype(logits.dtype), logits.shape[1:])
                for i, f in enumerate(forced)]
            return mx.stack(rows)

    model.__class__ = ScriptedModel
    return model


def scripted_loader(name: str) -> tuple[Any, Any]:
    """``mlx_lm.load``, with a folder's ``script.json`` (if any) making its model scripted."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(name)
    path = Path(name) / "script.json"
    if path.is_file():
        script = json.loads(path.read_text())
        model = scripted(model, Script(script["rules"], tokenizer), script.get("prefill_delay_s", 0.0))
    return model, tokenizer
