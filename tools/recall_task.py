"""The English recall task the shipped tiny models are trained on.

A document is a run of consecutive paragraphs from Jane Austen's novels (``tools/corpus``,
public domain) with facts planted in its prose: sentences such as "On the card she found the
words Orion cobalt falcon quartz." (a needle: a name, then three value words). The prompt ends
with a question about one name, "Which words came after Orion"; the answer is the three value
words, then ``<|end|>``. Names and value words never occur in the novels and are single
tokens, so the name marks its needle uniquely. The same content can be wrapped in a chat turn.

Everything here is plain Python on a caller-owned ``random.Random``, so the training script,
the demo generator, the tests and the quality benchmark build identical documents from the
same seed and tokenizer (the shipped draft's, unless another is given).
"""
from __future__ import annotations

import functools
import lzma
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools import english_tokenizer
from tools.english_tokenizer import END, SPECIAL_TOKENS, VOCAB_SIZE  # noqa: F401 - re-exported

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tools" / "corpus" / "austen.txt.xz"
SHIPPED_TOKENIZER = ROOT / "models" / "draft-tiny" / "tokenizer.json"

KEYS = ("Orion Zephyr Caspian Thaddeus Ignatius Leopold Barnaby Percival Cornelius Octavia Seraphina "
        "Lucius Evander Rosalind Ambrose Cassius Desmond Florian Gideon Horatio Jasper Lysander Magnus "
        "Nestor Oberon Quentin Rupert Silas Tobias Ulysses Valentin Xavier Yorick Zachary Alaric "
        "Benedict Dorian Emrys Fabian Griselda Hector Isolde Juno Kasimir Leander Marius Ophelia "
        "Phineas Quincy Roderick Sylvester Tristan Ursula Viola Winifred Xenia Yvette Zenobia Aurelia "
        "Balthazar Cordelia Dmitri Ferdinand Felix").split()
VALUES = ("cobalt quartz falcon walrus lynx tundra kayak radar laser cactus banjo igloo tulip mango lemur "
          "yak jaguar zebra panda koala bison cobra gecko hyena llama moose otter puma raven squid toucan "
          "viper wombat basalt granite magnet nickel zinc copper neon argon cello tuba guitar bamboo "
          "willow orchid lotus ginger tofu pizza taco sushi bagel waffle pretzel comet nebula galaxy "
          "rocket planet meteor canyon glacier volcano lagoon prairie oasis atlas pixel robot").split()
VALUE_LEN = 3
NEEDLE_LEN = 1 + VALUE_LEN  # the span that must be kept: the name and its value words
NEEDLE_TEMPLATES = (
    "On the card she found the words {}.",
    "The old sign by the gate read {}.",
    "Someone had written {} on the window.",
    "The password, he said, was {}.",
    "Under the portrait was a note that said {}.",
    "Her brother's letter ended with {}.",
)
ABBREVIATIONS = {"Mr", "Mrs", "Dr", "St", "Col", "Capt", "Rev", "Sir"}
QUESTION = "\n\nWhich words came after {}"


@dataclass
class Needle:
    key: str
    value: list[str]
    start: int  # token index of the name in the document

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.start + NEEDLE_LEN


@dataclass
class Document:
    tokens: list[int]
    needles: list[Needle]
    text: str

    def needle(self, key: str) -> Needle:
        for n in self.needles:
            if n.key == key:
                return n
        raise KeyError(key)


@dataclass
class Example:
    tokens: list[int]          # the prompt followed by the answer and <|end|>
    prompt_len: int            # tokens[:prompt_len] is the prompt of the final query
    answer: list[int]          # value token ids of the final query
    needle_span: tuple[int, int]  # token positions [start, end) of the finally queried needle
    document: Document
    key: str
    answer_positions: list[int]  # positions of every answer token (values and <|end|>) in tokens


@functools.lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    """The novels' paragraphs (lines joined), without headings and very short lines."""
    text = lzma.open(CORPUS, "rt", encoding="utf-8").read()
    out = []
    for block in re.split(r"\n\s*\n", text):
        p = " ".join(block.split())
        if len(p) >= 60 and not p.isupper():
            out.append(p)
    return tuple(out)


class RecallTask:
    """Documents, needles and prompts in the token ids of one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.id = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        self.end = self.id[END]
        self.key_id = {k: self._single(k) for k in KEYS}
        self.value_id = {v: self._single(v) for v in VALUES}
        paras = paragraphs()
        self.para_tokens = [e.ids for e in tokenizer.encode_batch(list(paras))]
        self.sep = tokenizer.encode("a\n\nb").ids[1:-1]
        vocab = tokenizer.get_vocab_size()
        strings = [tokenizer.id_to_token(i) or "" for i in range(vocab)]
        self.ends_sentence = np.array([s.rstrip("\"'") [-1:] in ".!?" and s.rstrip("\"'") != "" for s in strings])
        self.starts_space = np.array([s.startswith("Ġ") and len(s) > 1 and s[1].isalpha() for s in strings])
        # "Mr." and friends end no sentence.
        self.abbrev = np.array([s.lstrip("Ġ") in ABBREVIATIONS for s in strings] + [False])

    def _single(self, word: str) -> int:
        ids = self.tok.encode(" " + word).ids
        if len(ids) != 1:
            raise ValueError(f"{word!r} is not a single token of this tokenizer")
        return ids[0]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def haystack(self, rng: random.Random, n_tokens: int) -> list[int]:
        """At least ``n_tokens`` tokens of consecutive paragraphs from a random start."""
        i = rng.randrange(len(self.para_tokens))
        out: list[int] = []
        while len(out) < n_tokens:
            if out:
                out += self.sep
            out += self.para_tokens[i % len(self.para_tokens)]
            i += 1
        return out

    def needle_tokens(self, rng: random.Random, key: str, value: list[str]) -> tuple[list[int], int]:
        """A needle sentence (leading space) and the index of the name in it."""
        sentence = " " + rng.choice(NEEDLE_TEMPLATES).format(" ".join([key, *value]))
        ids = self.encode(sentence)
        return ids, ids.index(self.key_id[key])

    def insertion_points(self, tokens: list[int]) -> list[int]:
        """Positions between a sentence end and a space-led word (the needle keeps the text's tokens)."""
        t = np.asarray(tokens)
        before = np.concatenate([[len(self.abbrev) - 1], t[:-2]])  # the token before the full stop
        ok = self.ends_sentence[t[:-1]] & self.starts_space[t[1:]] & ~self.abbrev[before]
        return list(np.nonzero(ok)[0] + 1)

    def make_document(self, rng: random.Random, n_tokens: int, n_needles: int, *, exact: bool = True,
                      spread: bool = False) -> Document:
        """A document of ``n_tokens`` tokens (``exact=False``: at most, ending at a sentence end)
        holding ``n_needles`` needles with distinct names and distinct value words; with
        ``spread`` the i-th needle is planted in the i-th of ``n_needles`` equal parts of the
        document (3 needles: one each at its start, middle and end)."""
        max_needles = min(len(KEYS), len(VALUES) // VALUE_LEN)
        if not 1 <= n_needles <= max_needles:
            raise ValueError(f"n_needles must be in [1, {max_needles}], got {n_needles}")
        keys = rng.sample(KEYS, n_needles)
        values = rng.sample(VALUES, VALUE_LEN * n_needles)
        planted = [self.needle_tokens(rng, k, values[i * VALUE_LEN:(i + 1) * VALUE_LEN]) for i, k in enumerate(keys)]
        room = n_tokens - sum(len(ids) for ids, _ in planted)
        if room < 16 * n_needles:
            raise ValueError(f"n_tokens={n_tokens} is too short for {n_needles} needles")
        hay = self.haystack(rng, room + 1)
        points = [p for p in self.insertion_points(hay) if p < room]
        if not exact:
            room = max(points) if points else room
            points = [p for p in points if p < room]
        hay = hay[:room]
        if len(points) < n_needles:
            points = sorted(set(points) | set(rng.sample(range(1, room), n_needles)))
        slots = sorted(rng.sample(points, n_needles)) if not spread else self._spread_slots(rng, points, room, n_needles)
        tokens: list[int] = []
        needles: list[Needle] = []
        prev = 0
        for i, ((ids, at), slot) in enumerate(zip(planted, slots)):
            tokens += hay[prev:slot]
            needles.append(Needle(keys[i], values[i * VALUE_LEN:(i + 1) * VALUE_LEN], len(tokens) + at))
            tokens += ids
            prev = slot
        tokens += hay[prev:]
        return Document(tokens, needles, self.decode(tokens))

    @staticmethod
    def _spread_slots(rng: random.Random, points: list[int], room: int, n: int) -> list[int]:
        """One insertion point in each of ``n`` equal parts of ``[0, room)`` (the part's middle
        when it has no sentence end)."""
        slots = []
        for i in range(n):
            lo, hi = i * room // n, (i + 1) * room // n
            inside = [p for p in points if lo <= p < hi and p > (slots[-1] if slots else 0)]
            slots.append(rng.choice(inside) if inside else max((lo + hi) // 2, (slots[-1] + 1) if slots else 1))
        return slots

    def question(self, key: str) -> list[int]:
        ids = self.encode(QUESTION.format(key))
        assert ids[-1] == self.key_id[key], "the question must end in the name's token"
        return ids

    def answer_ids(self, needle: Needle) -> list[int]:
        return [self.value_id[v] for v in needle.value]

    def make_example(self, rng: random.Random, length: int, n_needles: int, *, chat: bool = False,
                     system_tokens: int = 0, n_queries: int = 1) -> Example:
        """An example of exactly ``length`` tokens (prompt + answer + end).

        With ``n_queries`` > 1 (plain form only) the document is followed by that many
        question/answer pairs about distinct needles; the last pair is the example's query.
        """
        if n_queries < 1 or n_queries > n_needles or (chat and n_queries > 1):
            raise ValueError(f"n_queries must be in [1, n_needles={n_needles}] (1 in chat form), got {n_queries}")
        system = self.haystack(rng, system_tokens)[:system_tokens] if chat and system_tokens else []
        head = ([self.id["<|system|>"], *system, self.end] if system else []) + ([self.id["<|user|>"]] if chat else [])
        # Question lengths depend on the names only; draw the document's needles first.
        state = rng.getstate()
        keys = rng.sample(KEYS, n_needles)
        rng.setstate(state)
        q_len = max(len(self.question(k)) for k in keys)
        overhead = len(head) + n_queries * (q_len + VALUE_LEN + 1) + (2 if chat else 0)
        doc = self.make_document(rng, length - overhead, n_needles)
        asked = rng.sample(doc.needles, n_queries)
        tokens = head + doc.tokens
        answer_positions: list[int] = []
        for i, needle in enumerate(asked):
            tokens += self.question(needle.key)
            if chat:
                tokens += [self.end, self.id["<|assistant|>"]]
            prompt_len = len(tokens)
            answer_positions += range(len(tokens), len(tokens) + VALUE_LEN + 1)
            tokens += self.answer_ids(needle) + [self.end]
        pad = length - len(tokens)  # shorter questions than the longest: pad the document's start
        if pad < 0:
            raise AssertionError("example longer than asked")
        filler = self.haystack(rng, pad)[:pad]
        if head:
            tokens = head + filler + tokens[len(head):]
        else:
            tokens = filler + tokens
        shift = pad
        s, e = asked[-1].span
        out = Example(tokens, prompt_len + shift, self.answer_ids(asked[-1]),
                      (s + len(head) + shift, e + len(head) + shift), doc, asked[-1].key,
                      [p + shift for p in answer_positions])
        assert len(out.tokens) == length
        return out


@functools.lru_cache(maxsize=4)
def load(tokenizer_path: str | None = None) -> RecallTask:
    """The task in the tokens of ``tokenizer_path`` (default: the shipped draft's tokenizer)."""
    from tokenizers import Tokenizer

    return RecallTask(Tokenizer.from_file(str(tokenizer_path or SHIPPED_TOKENIZER)))


@dataclass
class ChatExample:
    """A chat turn for training: a prompt rendered by the shipped template, then the reply."""

    tokens: list[int]            # the prompt followed by the assistant's reply
    prompt_len: int              # tokens[:prompt_len] is the prompt (ends in <|assistant|>)

    @property
    def answer_positions(self) -> list[int]:
        return list(range(self.prompt_len, len(self.tokens)))


class ChatTask:
    """Chat turns in the tokens of a recall task, rendered by the shipped chat template."""

    def __init__(self, task: RecallTask) -> None:
        self.task = task
        self.template = english_tokenizer.wrap(task.tok)


VERBATIM_QUESTION = "\n\nQuote the {} lines after {}"


@dataclass
class VerbatimExample:
    tokens: list[int]            # the prompt: the document, then the question
    span: tuple[int, int]        # token positions [start, end) of the lines to quote
    quote: list[int]             # the lines' tokens (the exact answer)
    key: str


def make_verbatim(task: RecallTask, rng: random.Random, length: int, n_lines: int) -> VerbatimExample:
    """A ``length``-token prompt (at most) asking to quote the ``n_lines`` lines after a marker.

    The marker is a name on a line of its own ("Orion:"), planted at a sentence end of the
    prose; the lines after it are sentences of another part of the novels, one per line. The
    question ends in the name, as the recall questions do, so the draft's attention peaks at
    the block's start; the quote is every token of the lines, the failure users report when the
    selection keeps the peak but not the lines that follow it.
    """
    key = rng.choice(KEYS)
    source = task.decode(task.haystack(rng, 40 * n_lines))
    sentences = [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", source) if len(s.strip()) > 20]
    sentences = sentences[1:n_lines + 1]  # the first may start mid-sentence
    block_text = f" {key}:\n" + "\n".join(sentences) + "\n"
    block = task.encode(block_text)
    question = task.encode(VERBATIM_QUESTION.format(n_lines, key))
    room = length - len(block) - len(question)
    hay = task.haystack(rng, room + 1)[:room]
    points = [p for p in task.insertion_points(hay) if p < room] or [room // 2]
    at = rng.choice(points)
    tokens = hay[:at] + block + hay[at:] + question
    marker = task.encode(f" {key}:\n")
    if block[:len(marker)] != marker:
        raise AssertionError("the marker line does not tokenize on its own")
    start, end = at + len(marker), at + len(block)   # the lines (with their newlines)
    return VerbatimExample(tokens, (start, end), tokens[start:end], key)
