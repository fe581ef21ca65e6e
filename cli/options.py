"""The options commands share, and how they are read back into client calls.

Each command adds the same prompt, selection and generate options and reads them back into
the keyword arguments of :meth:`jobs.client.Client.submit`; errors are ``ValueError``
naming the option, which the CLI prints with exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from jobs.connection import checked_connection
from jobs.settings import Settings
from jobs.spec import GENERATE_OPTIONS

# CLI option (argparse dest) -> job spec field
SELECTION_OPTIONS = {"keep": "keep", "chunk_size": "chunk_size", "tail_tokens": "tail_tokens",
                     "threshold": "threshold", "n_lookahead": "n_lookahead", "seed": "lookahead_seed"}
REDIS_URL_HELP = "redis://[:password@]host:port/db or rediss:// (default: REDIS_URL)"


class CliError(ValueError):
    """A user-facing error: printed without a traceback, exit status 2."""


@dataclass(frozen=True)
class SharedOptions:
    """Parent parsers: ``common`` every command takes, ``spec`` the job spec options."""

    common: argparse.ArgumentParser
    spec: argparse.ArgumentParser


def shared_options() -> SharedOptions:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    spec = argparse.ArgumentParser(add_help=False)
    add_selection_options(spec)
    spec.add_argument("--importance", action="store_true", help="return the importance vector")
    spec.add_argument("--spans", action="store_true", help="return the kept text spans")
    return SharedOptions(common, spec)


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    """The prompt, given exactly one way."""
    p.add_argument("--text")
    p.add_argument("--file", help="a text file")
    p.add_argument("--tokens", help="token ids as a JSON list")
    p.add_argument("--messages", "--chat", dest="messages",
                   help="chat messages [{role, content}, ...] as JSON, or a file holding them")
    p.add_argument("--tools", metavar="FILE.json",
                   help="tool definitions (a JSON list, OpenAI style) the chat template renders")
    p.add_argument("--template-arg", dest="template_args", action="append", metavar="KEY=VALUE",
                   help="a chat-template keyword argument, e.g. enable_thinking=false (repeatable; "
                        "VALUE is read as JSON when it parses, else as a string)")


def add_selection_options(p: argparse.ArgumentParser, *, seed_help: str | None = None) -> None:
    """The draft model and the SpecPrefill knobs (unset ones come from the settings)."""
    p.add_argument("--model", help="draft model: local folder or hub id (default: settings)")
    p.add_argument("--keep", type=float)
    p.add_argument("--chunk-size", dest="chunk_size", type=int)
    p.add_argument("--tail-tokens", dest="tail_tokens", type=int)
    p.add_argument("--threshold", type=int)
    p.add_argument("--n-lookahead", dest="n_lookahead", type=int)
    p.add_argument("--seed", type=int, help=seed_help or "seeds the draft's lookahead sampling")


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


def prompt_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``{"text"|"tokens"|"messages": ...}`` from the prompt options."""
    given = [k for k in ("text", "file", "tokens", "messages") if getattr(args, k)]
    if len(given) != 1:
        raise ValueError("input: give exactly one of --text, --file, --tokens or --messages")
    if not args.messages and (getattr(args, "tools", None) or getattr(args, "template_args", None)):
        raise ValueError("--tools / --template-arg: only with --messages (the chat template renders them)")
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
    return {"messages": messages, **template_fields(args)}


def template_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``tools`` and ``template_args`` from ``--tools`` and ``--template-arg``."""
    fields: dict[str, Any] = {}
    if getattr(args, "tools", None):
        tools = _json(_read(args.tools, "--tools"), "--tools")
        fields["tools"] = tools["tools"] if isinstance(tools, dict) and "tools" in tools else tools
    for item in getattr(args, "template_args", None) or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--template-arg: expected KEY=VALUE, got {item!r:.80}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        fields.setdefault("template_args", {})[key.strip()] = value
    return fields


def selection_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The selection options that were given, as job spec fields."""
    fields = {field: getattr(args, dest) for dest, field in SELECTION_OPTIONS.items()
              if getattr(args, dest, None) is not None}
    if getattr(args, "model", None):
        fields["draft_model"] = args.model
    return fields


def spec_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The selection options plus what to return (``--importance``, ``--spans``)."""
    fields = selection_fields(args)
    if getattr(args, "importance", False):
        fields["return_importance"] = True
    if getattr(args, "spans", False):
        fields["return_spans"] = True
    return fields


def generate_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generate options given on the command line (the spec's ``extra``)."""
    opts = {k: getattr(args, k, None) for k in GENERATE_OPTIONS if k != "target_model"}
    opts["target_model"] = getattr(args, "target", None)
    return {k: v for k, v in opts.items() if v is not None}


def connect(args: argparse.Namespace, settings: Settings) -> redis.Redis:
    """The queue's Redis from ``--redis-url`` (else the settings), checked with a PING."""
    return checked_connection(args.redis_url, settings)


def result_json(res: Any) -> dict[str, Any]:
    return res.to_json() if hasattr(res, "to_json") else dict(res)


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
