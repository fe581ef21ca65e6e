"""The requests of ``bench/load.py``, the same for every server: English text from the project's
corpus (``tools/recall_task.py``, Austen), sized in the shipped target's tokens.

- decode-bound: ~35-token prompts (a 30-token passage in the chat template) that the shipped
  target answers to the full 256 tokens, greedy (checked here with mlx-lm's own generation,
  batched: a prompt whose answer ends earlier is skipped);
- prefill-bound: ~4K-token passages, 32 tokens each;
- mixed: two ~16K-token passages, then short prompts 1.5 s later (prompts the target answers to
  the full 32 tokens, checked as the decode-bound ones are);
- agent: conversations sharing a system prompt (and the agent CLI's ``lookup`` tool), each turn a
  tool result of 1-2K tokens with a question about it, answers of up to 100 tokens.

Every measurement draws its own prompts (a seed per workload and level), so no server answers a
request it has seen before (each server's prompt cache still serves what a workload shares: the
agent trace's system prompt and histories).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from jobs.settings import SHIPPED_MODELS
from specprefill_cli.agent import LOOKUP_TOOL
from tools import recall_task

TARGET = SHIPPED_MODELS / "target-tiny"
SHORT_TOKENS, DECODE_TOKENS = 30, 256
SYSTEM = "You answer questions about the documents the tools return. Reply with the words asked for.\n\n"


@dataclass(frozen=True)
class Request:
    """One chat completion, the same for every server (each adds its model and options)."""

    key: str
    messages: list[dict[str, Any]]
    max_tokens: int
    tools: list[dict[str, Any]] | None = None


@dataclass
class Sizes:
    """A run's sizes (``--quick`` shrinks them; the defaults are the issue's)."""

    min_requests: int = 4  # decode: max(this, 2 x clients) requests; prefill: max(this, clients)
    short_tokens: int = SHORT_TOKENS
    decode_tokens: int = DECODE_TOKENS
    prefill_tokens: int = 4096
    prefill_answer: int = 32
    long_tokens: int = 16384
    mixed_short: int = 6
    mixed_delay_s: float = 1.5
    mixed_answer: int = 32
    system_tokens: int = 1024
    tool_tokens: tuple[int, int] = (1024, 2048)
    turns: int = 3
    answer_tokens: int = 100
    think_s: tuple[float, float] = (0.5, 2.0)


@dataclass
class Texts:
    """Passages in the shipped target's tokens, and its chat template for checking answers."""

    sizes: Sizes = field(default_factory=Sizes)

    @cached_property
    def task(self) -> recall_task.RecallTask:
        return recall_task.load()

    def passage(self, rng: random.Random, n_tokens: int) -> str:
        return self.task.decode(self.task.haystack(rng, n_tokens)[:n_tokens]).strip()

    def user(self, key: str, text: str, max_tokens: int) -> Request:
        return Request(key, [{"role": "user", "content": text}], max_tokens)

    def decode_bound(self, seed: int, n: int) -> list[Request]:
        """``n`` short prompts that the target answers to ``decode_tokens`` tokens, greedy."""
        return self.answered(seed, n, self.sizes.decode_tokens, "decode")

    def answered(self, seed: int, n: int, max_tokens: int, prefix: str) -> list[Request]:
        """``n`` short prompts (keys ``prefix-seed-i``) that the target answers to ``max_tokens``, greedy."""
        rng, out, drawn = random.Random(seed), [], 0
        while len(out) < n:
            batch = [self.user(f"{prefix}-{seed}-{drawn + i}", self.passage(rng, self.sizes.short_tokens),
                               max_tokens) for i in range(2 * (n - len(out)))]
            drawn += len(batch)  # keys name candidates, never two prompts alike
            out += [r for r, full in zip(batch, self.answered_in_full(batch)) if full][:n - len(out)]
        return out

    @cached_property
    def target(self) -> tuple[Any, Any]:
        from mlx_lm import load

        return load(str(TARGET))

    def answered_in_full(self, requests: list[Request]) -> list[bool]:
        """Whether the shipped target answers each request to its ``max_tokens``, greedy (mlx-lm)."""
        from mlx_lm import batch_generate

        model, tokenizer = self.target
        prompts = [tokenizer.apply_chat_template(r.messages, add_generation_prompt=True) for r in requests]
        answers = batch_generate(model, tokenizer, prompts, max_tokens=[r.max_tokens for r in requests],
                                 return_token_ids=True)
        return [len(ids) >= r.max_tokens for ids, r in zip(answers.token_ids, requests)]

    def prefill_bound(self, seed: int, n: int) -> list[Request]:
        rng = random.Random(seed)
        return [self.user(f"prefill-{seed}-{i}", self.passage(rng, self.sizes.prefill_tokens),
                          self.sizes.prefill_answer) for i in range(n)]

    def mixed(self, seed: int) -> tuple[list[Request], list[Request]]:
        """(the two long prompts, the short ones that arrive ``mixed_delay_s`` later)."""
        rng = random.Random(seed)
        long = [self.user(f"long-{seed}-{i}", self.passage(rng, self.sizes.long_tokens), self.sizes.mixed_answer)
                for i in range(2)]
        # Their own seed: drawn from the long passages' rng, a short one could open like a long one.
        return long, self.answered(seed + 1, self.sizes.mixed_short, self.sizes.mixed_answer, "short")

    def system_prompt(self, seed: int) -> str:
        return SYSTEM + self.passage(random.Random(seed), self.sizes.system_tokens)

    def tool_turn(self, rng: random.Random) -> str:
        """A tool result of 1-2K tokens holding one fact, and the question about it."""
        doc = self.task.make_document(rng, rng.randint(*self.sizes.tool_tokens), 1)
        return "Tool result:\n" + doc.text + recall_task.QUESTION.format(doc.needles[0].key)


@dataclass
class Conversation:
    """One agent conversation of the trace: its turns' user texts and its think times."""

    key: str
    system: str
    turns: list[str]
    think_s: list[float]
    start_s: float

    def request(self, history: list[dict[str, Any]], turn: int, max_tokens: int) -> Request:
        messages = [{"role": "system", "content": self.system}, *history,
                    {"role": "user", "content": self.turns[turn]}]
        return Request(f"{self.key}-t{turn}", messages, max_tokens, [LOOKUP_TOOL])


def agent_trace(texts: Texts, seed: int, n_conversations: int) -> list[Conversation]:
    """``n_conversations`` conversations sharing one system prompt, starting within 2 s of each other."""
    system, rng, sizes = texts.system_prompt(seed), random.Random(seed + 1), texts.sizes
    return [Conversation(f"agent-{seed}-{i}", system, [texts.tool_turn(rng) for _ in range(sizes.turns)],
                         [rng.uniform(*sizes.think_s) for _ in range(sizes.turns)], rng.uniform(0.0, 2.0))
            for i in range(n_conversations)]
