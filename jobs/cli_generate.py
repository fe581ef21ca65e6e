"""``specprefill generate`` and the generate side of ``specprefill batch``.

Registered on the parser by :mod:`jobs.cli`; the Redis connection and error handling are
the CLI's. ``--seed`` of a generate job seeds both the draft's lookahead and the sampling.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterable

from jobs.cli_args import (Deadline, add_prompt_options, add_selection_options, prompt_fields,
                           selection_fields)
from jobs.settings import Settings
from jobs.spec import GENERATE_OPTIONS


def add_generate_options(p: argparse.ArgumentParser) -> None:
    """The sampling / target options shared by ``generate`` and ``batch --generate``."""
    p.add_argument("--target", help="target model: local folder or hub id (default: settings)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", dest="top_p", type=float)
    p.add_argument("--greedy", action="store_true", default=None, help="always take the argmax")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--full-prefill", dest="full_prefill", action="store_true", default=None,
                   help="prefill the target with every token (no draft, for comparison)")


def generate_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generate options given on the command line (the spec's ``extra``)."""
    opts = {k: getattr(args, k, None) for k in GENERATE_OPTIONS if k != "target_model"}
    opts["target_model"] = getattr(args, "target", None)
    return {k: v for k, v in opts.items() if v is not None}


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


def generate_documents(docs: Iterable[tuple[str, dict[str, Any]]], *, question: str | None,
                       options: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
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


def _summary(data: dict[str, Any]) -> str:
    rate = data.get("tokens_per_s", {}).get("decode")
    return (f"{data['job_id']}: {data['generated_tokens']} tokens ({data['finish_reason']}), "
            f"TTFT {data['ttft_s']:.3f}s, kept {data['kept']}/{data['total']} "
            f"({100 * data['ratio']:.1f}%)" + (" [full prefill]" if data.get("full_prefill") else "")
            + (f", decode {rate:.1f} tok/s" if rate else ""))


def cmd_generate(args: argparse.Namespace, settings: Settings) -> int:
    from jobs.cli import _connect
    from jobs.client import Client, JobFailed, StreamDiverged

    client = Client(_connect(args, settings), settings)
    fields = {**selection_fields(args), **prompt_fields(args), **generate_options(args)}
    handle = client.submit(client.generate_spec(**fields))
    if not (args.wait or args.stream):
        info = {"job_id": handle.id, "status": handle.status(), "created": handle.created}
        print(json.dumps(info) if args.json else f"{handle.id} {info['status']}"
              + ("" if handle.created else " (already submitted)"))
        return 0
    deadline = Deadline(args.timeout)  # one --timeout for the stream and the result together
    try:
        if args.stream:
            out = sys.stderr if args.json else sys.stdout
            try:
                for delta in handle.stream_text(timeout=deadline.left()):
                    print(delta, end="", file=out, flush=True)
                diverged = False
            except StreamDiverged as exc:  # a retry sampled other text: show the final one
                print(file=out, flush=True)
                print(f"[{exc}]", file=sys.stderr, flush=True)
                diverged = True
        data = handle.result(timeout=deadline.left()).to_json()
        if args.stream:
            print(data["text"] if diverged else "", file=out, flush=True)
    except JobFailed as exc:
        print(json.dumps({"job_id": handle.id, "status": exc.status, "error": exc.error})
              if args.json else str(exc))
        return 1
    if args.json:
        print(json.dumps(data))
        return 0
    if not args.stream:
        print(data["text"])
    print(_summary(data), file=sys.stderr)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``generate`` command to the CLI's subparsers."""
    g = sub.add_parser("generate", parents=[common], help="generate text (SpecPrefill TTFT)")
    add_prompt_options(g)
    add_selection_options(g, seed_help="seeds the draft's lookahead and the sampling")
    add_generate_options(g)
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    g.add_argument("--wait", action="store_true", help="block until the job ends, print the text")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.add_argument("--timeout", type=float)
    g.set_defaults(func=cmd_generate)
