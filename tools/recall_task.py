"""The synthetic associative-recall task the shipped tiny models are trained on.

A document is a stream of made-up filler words with planted needles
``kXX vA vB vC`` (a key and a 3-token value); some filler segments repeat
earlier ones, which teaches the copy (induction) circuit recall relies on.
The document ends in the query ``? kXX``; the answer is the key's value,
followed by ``<|end|>``. The same content can also be wrapped in a chat turn.

Everything here is plain Python on a caller-owned ``random.Random``, so the
training script, the demo generator, the tests and the quality benchmark all
build identical documents from the same seed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
QUERY_MARK = "?"
N_KEYS = 100
N_VALUES = 100
KEYS = [f"k{i:02d}" for i in range(N_KEYS)]
VALUES = [f"v{i:02d}" for i in range(N_VALUES)]
VALUE_LEN = 3
NEEDLE_LEN = 1 + VALUE_LEN
END = "<|end|>"

_CONSONANTS = "bdfghlmnprstvz"
_VOWELS = "aeiou"


def _filler_words(n: int) -> list[str]:
    # Two-syllable pseudo-words with no digits, so they never collide with kXX/vXX.
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = sorted({a + b for a in syllables for b in syllables})
    return random.Random(1234).sample(words, n)


N_FILLER = VOCAB_SIZE - len(SPECIAL_TOKENS) - 1 - N_KEYS - N_VALUES
FILLER = _filler_words(N_FILLER)
VOCAB: list[str] = SPECIAL_TOKENS + [QUERY_MARK] + KEYS + VALUES + FILLER
TOKEN_ID = {w: i for i, w in enumerate(VOCAB)}
assert len(VOCAB) == VOCAB_SIZE and len(TOKEN_ID) == VOCAB_SIZE

# Chat template rendered by transformers' Jinja; markers are single vocabulary tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class Needle:
    key: str
    value: list[str]
    start: int  # index of the key word in the document's word list

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.start + NEEDLE_LEN


@dataclass
class Document:
    words: list[str]
    needles: list[Needle]

    def needle(self, key: str) -> Needle:
        for n in self.needles:
            if n.key == key:
                return n
        raise KeyError(key)

    @property
    def text(self) -> str:
        return " ".join(self.words)


def make_document(rng: random.Random, n_words: int, n_needles: int, *, repeat_prob: float = 0.03) -> Document:
    """A haystack of exactly ``n_words`` words holding ``n_needles`` needles (distinct keys and value tokens)."""
    max_needles = min(N_KEYS, N_VALUES // VALUE_LEN)
    if n_needles < 1 or n_needles > max_needles:
        raise ValueError(f"n_needles must be in [1, {max_needles}], got {n_needles}")
    n_filler = n_words - n_needles * NEEDLE_LEN
    if n_filler < n_needles + 1:
        raise ValueError(f"n_words={n_words} is too short for {n_needles} needles")
    filler: list[str] = []
    while len(filler) < n_filler:
        if len(filler) >= 16 and rng.random() < repeat_prob:
            seg = rng.randint(4, 16)
            start = rng.randint(0, len(filler) - seg)
            filler.extend(filler[start:start + seg])
        else:
            filler.append(rng.choice(FILLER))
    filler = filler[:n_filler]
    keys = rng.sample(KEYS, n_needles)
    # Distinct value tokens across the document, so "the token after vA" is unambiguous.
    value_tokens = rng.sample(VALUES, VALUE_LEN * n_needles)
    slots = sorted(rng.sample(range(n_filler + 1), n_needles))
    words: list[str] = []
    needles: list[Needle] = []
    prev = 0
    for i, (key, slot) in enumerate(zip(keys, slots)):
        words.extend(filler[prev:slot])
        value = value_tokens[i * VALUE_LEN:(i + 1) * VALUE_LEN]
        needles.append(Needle(key, value, len(words)))
        words.append(key)
        words.extend(value)
        prev = slot
    words.extend(filler[prev:])
    return Document(words, needles)


@dataclass
class Example:
    tokens: list[int]          # the prompt followed by the answer and <|end|>
    prompt_len: int            # tokens[:prompt_len] is the prompt of the final query
    answer: list[int]          # value token ids of the final query
    needle_span: tuple[int, int]  # token positions [start, end) of the finally queried needle
    document: Document
    key: str
    answer_positions: list[int]  # positions of every answer token (values and <|end|>) in tokens


def encode(words: list[str]) -> list[int]:
    return [TOKEN_ID[w] for w in words]


def prompt_words(doc: Document, key: str, *, chat: bool, system: list[str] | None = None) -> tuple[list[str], int]:
    """The prompt words for asking ``key`` about ``doc`` and the offset of the document in them."""
    if not chat:
        return doc.words + [QUERY_MARK, key], 0
    head = ["<|system|>", *system, END] if system else []
    head.append("<|user|>")
    return head + doc.words + [QUERY_MARK, key, END, "<|assistant|>"], len(head)


def make_example(rng: random.Random, length: int, n_needles: int, *, chat: bool = False,
                 system_words: int = 0, repeat_prob: float = 0.03, n_queries: int = 1) -> Example:
    """An example of exactly ``length`` tokens (prompt + answer + end).

    With ``n_queries`` > 1 (plain form only) the document is followed by that many
    question/answer pairs about distinct needles, ``? kXX vA vB vC <|end|>`` each: more
    supervised recalls per sequence for training; the last pair is the example's query.
    """
    if n_queries < 1 or n_queries > n_needles or (chat and n_queries > 1):
        raise ValueError(f"n_queries must be in [1, n_needles={n_needles}] (1 in chat form), got {n_queries}")
    system = [rng.choice(FILLER) for _ in range(system_words)] if chat and system_words else None
    qa_len = 2 + VALUE_LEN + 1  # query mark + key, answer, end
    overhead = qa_len * n_queries
    if chat:
        overhead += 3 + (len(system) + 2 if system else 0)  # user, end, assistant (+ system turn)
    doc = make_document(rng, length - overhead, n_needles, repeat_prob=repeat_prob)
    asked = rng.sample(doc.needles, n_queries)
    words, offset = prompt_words(doc, asked[0].key, chat=chat, system=system)
    answer_positions = []
    for i, needle in enumerate(asked):
        if i:
            words += [QUERY_MARK, needle.key]
        answer_positions += range(len(words), len(words) + VALUE_LEN + 1)
        if i < n_queries - 1:
            words += needle.value + [END]
    needle = asked[-1]
    answer = encode(needle.value)
    tokens = encode(words) + answer + [TOKEN_ID[END]]
    assert len(tokens) == length
    s, e = needle.span
    return Example(tokens, len(words), answer, (s + offset, e + offset), doc, needle.key, answer_positions)
