"""Write the shipped demo data: English documents with planted facts and two questions each.

Seeded, so re-running it reproduces ``models/demo/`` byte for byte::

    python tools/make_demo.py --out models/demo

``documents.jsonl``: ``{"id", "text", "n_tokens", "needles": [{"key", "value", "char_span",
"token_span"}]}``; ``char_span`` is ``[start, end)`` of "Name value value value" in ``text``,
``token_span`` the same in the shipped tokenizer's tokens of ``text``.
``questions.jsonl``: ``{"doc_id", "round", "question", "answer"}``; round 2 asks another name
of the same document, so its prompt shares the document prefix with round 1. A prompt is
``text + "\\n\\n" + question`` (or that string as one chat user message).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import recall_task  # noqa: E402

SEPARATOR = "\n\n"  # between a document and its question


def document_record(task: recall_task.RecallTask, doc_id: str, doc: recall_task.Document) -> dict:
    """The JSON record of one document, with its needles' character and token spans."""
    enc = task.tok.encode(doc.text)
    if enc.ids != doc.tokens:
        raise AssertionError(f"{doc_id}: the text does not tokenize back to the document's tokens")
    needles = []
    for n in doc.needles:
        s, e = n.span
        start = enc.offsets[s][0]
        start += len(doc.text[start:]) - len(doc.text[start:].lstrip())  # the name's leading space
        char_span = [start, enc.offsets[e - 1][1]]
        expected = " ".join([n.key, *n.value])
        if doc.text[char_span[0]:char_span[1]] != expected:
            raise AssertionError(f"{doc_id}: needle {n.key} not at its span")
        needles.append({"key": n.key, "value": " ".join(n.value), "char_span": char_span,
                        "token_span": [s, e]})
    return {"id": doc_id, "text": doc.text, "n_tokens": len(doc.tokens), "needles": needles}


def make_demo(seed: int, n_docs: int, min_tokens: int, max_tokens: int, n_needles: int,
              task: recall_task.RecallTask | None = None) -> tuple[list[dict], list[dict]]:
    """The demo documents and their questions (two rounds per document)."""
    if n_needles < 2:
        raise ValueError(f"n_needles must be >= 2 (two rounds ask different names), got {n_needles}")
    task = task or recall_task.load()
    rng = random.Random(seed)
    documents, questions = [], []
    for i in range(n_docs):
        doc = task.make_document(rng, rng.randint(min_tokens, max_tokens), n_needles, exact=False)
        doc_id = f"doc-{i:02d}"
        documents.append(document_record(task, doc_id, doc))
        for round_no, needle in enumerate(rng.sample(doc.needles, 2), start=1):
            question = recall_task.QUESTION.format(needle.key).lstrip()
            questions.append({"doc_id": doc_id, "round": round_no, "question": question,
                              "answer": " ".join(needle.value)})
    return documents, questions


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="models/demo")
    p.add_argument("--seed", type=int, default=2025)
    p.add_argument("--docs", type=int, default=12)
    p.add_argument("--min-tokens", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--needles", type=int, default=6)
    p.add_argument("--tokenizer", help="tokenizer.json (default: the shipped draft's)")
    args = p.parse_args(argv)
    task = recall_task.load(args.tokenizer)
    documents, questions = make_demo(args.seed, args.docs, args.min_tokens, args.max_tokens, args.needles, task)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "documents.jsonl", documents)
    write_jsonl(out / "questions.jsonl", questions)
    print(f"wrote {len(documents)} documents and {len(questions)} questions to {out}")


if __name__ == "__main__":
    main()
