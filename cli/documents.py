"""The documents of ``specprefill batch``: plain files and JSONL lines, with their questions."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from cli.options import CliError
from jobs.spec import GENERATE_OPTIONS

Document = tuple[str, dict[str, Any]]  # (document id, job spec fields)


def iter_documents(paths: Sequence[str]) -> Iterator[Document]:
    """(document id, spec fields) from plain files (id = path) and JSONL files.

    A JSONL line holds ``id`` (else ``<path>:<line>``) and one of ``text``, ``tokens``,
    ``messages``; any other spec fields on the line apply to that document.
    """
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise CliError(f"{path}: no such file")
        try:
            content = p.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"{path}: cannot read it as UTF-8 text: {exc}") from None
        if p.suffix == ".jsonl":
            yield from _jsonl_documents(path, content)
        else:
            yield str(p), {"text": content}


def _jsonl_documents(path: str, content: str) -> Iterator[Document]:
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{n}: not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise CliError(f"{path}:{n}: expected a JSON object")
        yield str(doc.pop("id", f"{path}:{n}")), doc


def with_question(fields: dict[str, Any], question: str | None) -> dict[str, Any]:
    """A document's spec fields with ``question`` appended (after the text, or to the
    last user message). The document comes first so its draft KV blocks are shared by
    every question about it."""
    fields = dict(fields)
    if question is None:
        return fields
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question: expected a non-empty string")
    if fields.get("text") is not None:
        fields["text"] = f"{fields['text']}\n\n{question}"
    elif fields.get("messages") is not None:
        messages = [dict(m) for m in fields["messages"]]
        if messages and messages[-1].get("role") == "user":
            messages[-1]["content"] = f"{messages[-1].get('content', '')}\n\n{question}"
        else:
            messages.append({"role": "user", "content": question})
        fields["messages"] = messages
    else:
        raise ValueError("question: needs a document given as text or messages (not tokens)")
    return fields


def generate_documents(docs: Iterable[Document], *, question: str | None,
                       options: dict[str, Any] | None) -> list[Document]:
    """Batch documents as generate jobs (``options`` given) or with the question only.

    A JSONL line may carry its own ``question`` (it wins over ``--question``) and, for
    generate jobs, its own generate options (``max_tokens``, ``temperature``, ``stop``, ...).
    """
    out = []
    for doc_id, fields in docs:
        fields = dict(fields)
        q = fields.pop("question", None)
        try:
            fields = with_question(fields, q if q is not None else question)
        except ValueError as exc:
            raise ValueError(f"document {doc_id}: {exc}") from None
        if options is not None:
            own = {k: fields.pop(k) for k in GENERATE_OPTIONS if k in fields}
            extra = {**options, **dict(fields.pop("extra", None) or {}), **own}
            fields.update(kind="generate", extra=extra)
        out.append((doc_id, fields))
    return out
