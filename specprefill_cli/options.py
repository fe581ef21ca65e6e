"""The options commands share, and how they are read back into client calls.

Each command adds the same prompt, selection and generate options and reads them back into
the keyword arguments of :meth:`jobs.client.Client.submit`; errors are ``ValueError``
naming the option, which the CLI prints with exit status 2. A job option's flag stores
under the option's own name (``--chunk-size`` -> ``chunk_size``), so it is read back
without a table; only the CLI's own spellings are mapped (``CLI_FIELDS``). The ranges are
the option objects' (specprefill/options.py), checked when the spec is built.
"""
from __future__ import annotations

import argparse
import getpass
import socket
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from jobs.connection import checked_connection
from jobs.contract.model_names import job_default
from jobs.contract.spec import option_names
from jobs.settings import Settings
from specprefill.options import GenerateOptions

# The CLI's own spellings: argparse dest -> job spec field (every other option's dest is
# its spelling in jobs.contract.spec.option_names). --seed seeds the lookahead of a prefill job; a
# generate job takes it as its own seed, which seeds the lookahead too.
CLI_FIELDS = {"model": "draft_model", "seed": "lookahead_seed"}
REDIS_URL_HELP = ("the queue's Redis: redis://[user:password@]host:port/db, rediss:// (TLS) or "
                  "unix:///path.sock (default: $REDIS_URL or SPECPREFILL_REDIS_URL)")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(value: str) -> str:
    """A logging level in any case (``debug``, ``Info``, ...)."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r}: choose one of {', '.join(LOG_LEVELS)} (any case)")
    return level


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the exit-status table as written and shows every option's default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0 and action.const is True:  # a flag
            return f"{text} (default: off)"
        if action.default is not None:
            return f"{text} (default: %(default)s)"
        return text


class CliError(ValueError):
    """A user-facing error: printed without a traceback, exit status 2."""


@dataclass(frozen=True)
class SharedOptions:
    """Parent parsers: ``common`` every command takes, ``spec`` the job spec options."""

    common: argparse.ArgumentParser
    spec: argparse.ArgumentParser
    settings: Settings  # the defaults help texts show
    url: argparse.ArgumentParser  # --redis-url alone, for commands with their own --log-level


def cli_holder() -> str:
    """The hold every command of this user on this host takes on the jobs it submits, so a
    later ``specprefill cancel`` by the same user releases it, while a job another submitter
    shares (a Python client, an HTTP request, another user) runs on for them."""
    return f"cli:{getpass.getuser()}@{socket.gethostname()}"


def shared_options(settings: Settings | None = None) -> SharedOptions:
    """The parent parsers; help texts show ``settings``' defaults."""
    settings = settings or Settings()
    url = argparse.ArgumentParser(add_help=False)
    url.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    common = argparse.ArgumentParser(add_help=False, parents=[url])
    common.add_argument("--log-level", type=log_level, default="WARNING",
                        help="how much this process logs: debug, info, warning, error (any case)")
    spec = argparse.ArgumentParser(add_help=False)
    add_selection_options(spec, settings)
    spec.add_argument("--importance", "--return-importance", action="store_true",
                      help="return the importance score of every prompt token (Python: "
                           "return_importance= or importance=)")
    spec.add_argument("--spans", "--return-spans", action="store_true",
                      help="return the text of every kept span (Python: return_spans= or spans=)")
    return SharedOptions(common, spec, settings, url)


def add_queue_option(p: argparse.ArgumentParser, settings: Settings) -> None:
    p.add_argument("--queue", help=f"the RQ queue to submit to (default: {settings.queues[0]})")


def add_timeout_option(p: argparse.ArgumentParser, what: str = "the job", *, with_flags: str = "") -> None:
    p.add_argument("--timeout", type=float,
                   help=f"seconds to wait for {what}{f' (with {with_flags})' if with_flags else ''}; then "
                        "exit status 4 and the jobs go on (default: wait as long as it takes)")


def add_wait_options(p: argparse.ArgumentParser, wait_help: str, *, also_waiting: tuple[str, ...] = ()) -> None:
    """``--wait`` and the ``--timeout`` that bounds it. ``--timeout`` without a flag that waits
    (``--wait`` or one of ``also_waiting``) is refused by :func:`check_timeout_waits`: it would
    bound a wait that never happens."""
    p.add_argument("--wait", action="store_true", help=wait_help)
    flags = ("--wait", *also_waiting)
    add_timeout_option(p, with_flags=" or ".join(flags))
    p.set_defaults(timeout_waits_with=flags)


def check_timeout_waits(args: argparse.Namespace) -> None:
    """Refuse ``--timeout`` given to a command that takes ``--wait`` without a flag that waits."""
    flags = getattr(args, "timeout_waits_with", ())
    if not flags or args.timeout is None:
        return
    if not any(getattr(args, flag.lstrip("-").replace("-", "_")) for flag in flags):
        raise CliError(f"--timeout bounds a wait: give it with {' or '.join(flags)} "
                       f"(e.g. --wait --timeout {args.timeout:g}), or leave it out")


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    """The prompt, given exactly one way."""
    p.add_argument("--text", help="the prompt as text (give exactly one of these four; default: none)")
    p.add_argument("--file", help="the prompt from a UTF-8 text file (default: none)")
    p.add_argument("--tokens", help="the prompt as token ids, a JSON list (default: none)")
    p.add_argument("--messages", "--chat", dest="messages",
                   help="chat messages [{role, content}, ...] as JSON, or a file holding them "
                        "(default: none)")
    p.add_argument("--tools", metavar="FILE.json",
                   help="tool definitions (a JSON list, OpenAI style) the chat template renders (default: none)")
    p.add_argument("--template-arg", dest="template_args", action="append", metavar="KEY=VALUE",
                   help="a chat-template keyword argument, e.g. enable_thinking=false (repeatable; "
                        "VALUE is read as JSON when it parses, else as a string; default: none)")


def add_selection_options(p: argparse.ArgumentParser, settings: Settings | None = None, *,
                          seed_help: str | None = None) -> None:
    """The draft model and the SpecPrefill knobs (unset ones come from the settings)."""
    s = settings or Settings()
    sel, sc = s.selection, s.scoring
    p.add_argument("--model", "--draft-model", dest="model",
                   help="draft model by name: 'draft', an alias or hub id the workers know, or a folder "
                        f"on the worker (default: {job_default(s, 'draft')}, the name jobs send, which "
                        "each worker resolves with its own SPECPREFILL_DRAFT_MODEL; Python: "
                        "draft_model= or model=)")
    p.add_argument("--keep", type=float,
                   help="share of the prompt's chunks the target prefills, in (0, 1]; it applies "
                        f"only to prompts longer than --threshold, and the --tail-tokens come out "
                        f"of it first (default: {sel.keep}, SPECPREFILL_KEEP)")
    p.add_argument("--chunk-size", dest="chunk_size", type=int,
                   help=f"tokens per chunk, the unit kept or dropped (default: {sel.chunk_size})")
    p.add_argument("--tail-tokens", dest="tail_tokens", type=int,
                   help="the prompt's last tokens, always kept (they hold the chat template's "
                        f"closing tokens) (default: {sel.tail_tokens}, SPECPREFILL_TAIL_TOKENS)")
    p.add_argument("--follow-chunks", dest="follow_chunks", type=int,
                   help="with each chunk the draft ranks high, keep the N chunks after it (the lines "
                        "after a marker, which a verbatim quote needs); they count against --keep "
                        f"(default: {sel.follow_chunks}, SPECPREFILL_FOLLOW_CHUNKS)")
    p.add_argument("--threshold", type=int,
                   help="prompts of at most this many tokens are kept whole (--keep has no effect) "
                        f"(default: {sel.threshold}, SPECPREFILL_THRESHOLD)")
    p.add_argument("--n-lookahead", dest="n_lookahead", type=int,
                   help=f"lookahead tokens the draft decodes to score the prompt (default: {sc.n_lookahead})")
    p.add_argument("--seed", type=int, help=(seed_help or "seeds the draft's lookahead sampling")
                   + " (default: 0)")
    p.add_argument("--allow-beyond-context", dest="allow_beyond_context", action="store_true", default=None,
                   help="run prompts longer than the draft's or the target's context window (the "
                        "one its config declares; refused otherwise) (default: off, "
                        "SPECPREFILL_ALLOW_BEYOND_CONTEXT)")


def add_generate_options(p: argparse.ArgumentParser) -> None:
    """The sampling / target options shared by ``generate`` and ``batch --generate``."""
    g = GenerateOptions
    p.add_argument("--target", help="target model: a local mlx-lm folder or a hub id "
                                    "(default: SPECPREFILL_TARGET_MODEL, the shipped target-tiny)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int,
                   help=f"tokens to generate at most (default: {g.max_tokens})")
    p.add_argument("--temperature", type=float,
                   help=f"sampling temperature, 0 takes the argmax (default: {g.temperature})")
    p.add_argument("--top-p", dest="top_p", type=float,
                   help=f"nucleus sampling: sample from this top share of probability (default: {g.top_p})")
    p.add_argument("--greedy", action="store_true", default=None,
                   help="always take the most likely token (default: off)")
    p.add_argument("--stop", action="append",
                   help="stop before this string; repeatable (default: none)")
    p.add_argument("--full-prefill", dest="full_prefill", action="store_true", default=None,
                   help="prefill the target with every token, no draft, for comparison (default: off)")
    p.add_argument("--no-heal", dest="heal", action="store_false", default=None,
                   help="queue no heal job after a sparse prefill (default: heal, when the worker heals)")
    p.add_argument("--fit-context", dest="fit_context", action="store_true", default=None,
                   help="lower --max-tokens to the room the prompt leaves in the target's context "
                        "window instead of refusing the job (default: off; the HTTP APIs turn it on)")


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
    """The draft model and the scoring and selection options that were given, as job spec fields."""
    given = {name: name for name in option_names("prefill")}
    given.update(CLI_FIELDS)
    return {field: getattr(args, dest) for dest, field in given.items()
            if getattr(args, dest, None) is not None}


def spec_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The selection options plus what to return (``--importance``, ``--spans``)."""
    fields = selection_fields(args)
    if getattr(args, "importance", False):
        fields["return_importance"] = True
    if getattr(args, "spans", False):
        fields["return_spans"] = True
    return fields


def generate_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generate options given on the command line, and the target (``--target``)."""
    opts = {k: getattr(args, k, None) for k in GenerateOptions.__dataclass_fields__}
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
