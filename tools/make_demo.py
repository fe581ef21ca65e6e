"""Write the shipped demo data: recall haystacks and two rounds of questions per document.

Seeded, so re-running it reproduces ``models/demo/`` byte for byte::

    python tools/make_demo.py --out models/demo

``documents.jsonl``: ``{"id", "text", "n_tokens", "needles": [{"key", "value", "start"}]}``
(``start`` is the key's word/token index in the document).
``questions.jsonl``: ``{"doc_id", "round", "question", "answer"}``; round 2 asks another key
of the same document, so its prompt shares the document prefix with round 1.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import recall_task as task  # noqa: E402


def make_demo(seed: int, n_docs: int, min_tokens: int, max_tokens: int, n_needles: int) -> tuple[list[dict], list[dict]]:
    """The demo documents and their questions (two rounds per document)."""
    if n_needles < 2:
        raise ValueError(f"n_needles must be >= 2 (two rounds ask different keys), got {n_needles}")
    rng = random.Random(seed)
    documents, questions = [], []
    for i in range(n_docs):
        doc = task.make_document(rng, rng.randint(min_tokens, max_tokens), n_needles)
        doc_id = f"doc-{i:02d}"
        documents.append({
            "id": doc_id,
            "text": doc.text,
            "n_tokens": len(doc.words),
            "needles": [{"key": n.key, "value": " ".join(n.value), "start": n.start} for n in doc.needles],
        })
        for round_no, needle in enumerate(rng.sample(doc.needles, 2), start=1):
            questions.append({"doc_id": doc_id, "round": round_no, "question": f"{task.QUERY_MARK} {needle.key}",
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
    args = p.parse_args(argv)
    documents, questions = make_demo(args.seed, args.docs, args.min_tokens, args.max_tokens, args.needles)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "documents.jsonl", documents)
    write_jsonl(out / "questions.jsonl", questions)
    print(f"wrote {len(documents)} documents and {len(questions)} questions to {out}")


if __name__ == "__main__":
    main()
