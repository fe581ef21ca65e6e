"""Command-line options shared by ``specprefill submit`` and ``specprefill generate``, and
the deadline of their ``--timeout``.

Each command adds the same prompt and selection options and reads them back into the
keyword arguments of :meth:`jobs.client.Client.submit`; errors are ``ValueError`` naming
the option, which the CLI prints with exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

SELECTION_OPTIONS = ("keep", "chunk_size", "tail_tokens", "threshold", "n_lookahead", "seed")


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    """The prompt, given exactly one way."""
    p.add_argument("--text")
    p.add_argument("--file", help="a text file")
    p.add_argument("--tokens", help="token ids as a JSON list")
    p.add_argument("--messages", "--chat", dest="messages",
                   help="chat messages [{role, content}, ...] as JSON, or a file holding them")


def add_selection_options(p: argparse.ArgumentParser, *, seed_help: str | None = None) -> None:
    """The draft model and the SpecPrefill knobs (unset ones come from the settings)."""
    p.add_argument("--model", help="draft model: local folder or hub id (default: settings)")
    p.add_argument("--keep", type=float)
    p.add_argument("--chunk-size", dest="chunk_size", type=int)
    p.add_argument("--tail-tokens", dest="tail_tokens", type=int)
    p.add_argument("--threshold", type=int)
    p.add_argument("--n-lookahead", dest="n_lookahead", type=int)
    p.add_argument("--seed", type=int, help=seed_help)


def prompt_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``{"text"|"tokens"|"messages": ...}`` from the prompt options."""
    given = [k for k in ("text", "file", "tokens", "messages") if getattr(args, k)]
    if len(given) != 1:
        raise ValueError("input: give exactly one of --text, --file, --tokens or --messages")
    if args.text:
        return {"text": args.text}
    if args.file:
        return {"text": _read(args.file, "--file")}
    if args.tokens:
        return {"tokens": _json(args.tokens, "--tokens")}
    source = args.messages
    messages = _json(_read(source, "--messages") if os.path.exists(source) else source, "--messages")
    if isinstance(messages, dict) and "messages" in messages:  # {"messages": [...]} too
        messages = messages["messages"]
    return {"messages": messages}


def selection_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The selection options that were given, as job spec fields."""
    fields = {k: getattr(args, k) for k in SELECTION_OPTIONS if getattr(args, k, None) is not None}
    if getattr(args, "model", None):
        fields["draft_model"] = args.model
    return fields


def _read(path: str, option: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{option}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _json(text: str, option: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option}: not valid JSON: {exc}") from None


class Deadline:
    """The time left of one ``--timeout`` (None: no limit) spent across several waits."""

    def __init__(self, timeout: float | None) -> None:
        self.end = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())
