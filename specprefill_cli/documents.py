"""The documents of ``specprefill batch``: plain files and JSONL lines, with their questions.

A document that cannot be read (not a file, not UTF-8 text, empty, a line that is not a
JSON object) is still yielded, with its ``error`` set: the batch reports and skips it and
runs the rest. A JSONL line's fields that are not job spec fields (``n_tokens``,
``needles``, ...) are kept as the document's metadata and echoed in its output line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from jobs.contract.spec import CLI_SPELLINGS, SPEC_KEYWORDS

INPUT_FIELDS = ("text", "tokens", "messages")
# What a JSONL line may set besides its input (what jobs.contract.spec.build_spec takes, and its
# question); anything else is metadata.
SPEC_FIELDS = SPEC_KEYWORDS - {"v", *CLI_SPELLINGS} | {"question"}


@dataclass(frozen=True)
class Document:
    """One document of a batch: its id, its job spec fields, its metadata, or why it is unusable."""

    id: str
    fields: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # Which document this is whatever path named it: a file's resolved path (a JSONL line
    # without an id: ``<resolved path>:<line>``); a JSONL line's own id is its identity.
    source: str | None = None

    @property
    def identity(self) -> str:
        return self.source or self.id


def iter_documents(paths: Sequence[str]) -> Iterator[Document]:
    """Documents from plain files (id = the path as given) and JSONL files.

    A JSONL line holds ``id`` (else ``<path>:<line>``) and one of ``text``, ``tokens``,
    ``messages``; spec fields on the line apply to that document.
    """
    for path in paths:
        p = Path(path)
        if not p.is_file():
            yield Document(path, {}, error=f"{path}: no such file")
            continue
        source = str(p.resolve())
        try:
            content = p.read_text()
        except UnicodeDecodeError as exc:
            yield Document(path, {}, source=source,
                           error=f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); is it a binary file?")
            continue
        except OSError as exc:
            yield Document(path, {}, source=source, error=f"{path}: cannot read it: {exc.strerror or exc}")
            continue
        if p.suffix == ".jsonl":
            yield from _jsonl_documents(path, content, source)
        elif "\x00" in content:
            yield Document(path, {}, source=source, error=f"{path}: holds NUL bytes; is it a binary file?")
        elif not content.strip():
            yield Document(path, {}, source=source, error=f"{path}: empty document (nothing but whitespace)")
        else:
            yield Document(str(p), {"text": content}, source=source)


def _jsonl_documents(path: str, content: str, resolved: str) -> Iterator[Document]:
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            yield Document(where, {}, source=f"{resolved}:{n}", error=f"{where}: not valid JSON: {exc}")
            continue
        if not isinstance(doc, dict):
            yield Document(where, {}, source=f"{resolved}:{n}", error=f"{where}: expected a JSON object")
            continue
        given = doc.pop("id", None)
        doc_id = where if given is None else str(given)
        fields = {k: v for k, v in doc.items() if k in SPEC_FIELDS}
        meta = {k: v for k, v in doc.items() if k not in SPEC_FIELDS}
        error = None
        if not any(fields.get(k) is not None for k in INPUT_FIELDS):
            extra = f" (its other fields: {', '.join(sorted(meta))})" if meta else ""
            error = f"document {doc_id}: no text, tokens or messages{extra}"
        elif isinstance(fields.get("text"), str) and not fields["text"].strip():
            error = f"document {doc_id}: empty text (nothing but whitespace)"
        yield Document(doc_id, fields, meta, error, source=None if given is not None else f"{resolved}:{n}")


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
    for doc in docs:
        if doc.error is not None:
            out.append(doc)
            continue
        fields = dict(doc.fields)
        q = fields.pop("question", None)
        try:
            fields = with_question(fields, q if q is not None else question)
        except ValueError as exc:
            out.append(replace(doc, error=f"document {doc.id}: {exc}"))
            continue
        if options is not None:  # the line's own generate options win over the command's
            fields = {**options, **fields, "kind": "generate"}
        out.append(replace(doc, fields=fields))
    return out
