"""The job spec: what a client asks a worker to do, validated on both sides of the queue.

A spec is the input, the model names, what to return, and one options object per group:
``scoring`` (:class:`ScoringOptions`), ``selection`` (:class:`SelectionOptions`) and, for a
generate job, ``generate`` (:class:`GenerateOptions`), all from ``specprefill.options``,
which checks every option's range when the object is built. Users spell options flat
(``keep=``, ``lookahead_temperature=``, ``max_tokens=``: :func:`option_names`); a spec
travels as a nested JSON payload (``JobSpec.to_payload``, version 3), and every older
spelling (payload versions 1 and 2, renamed fields) goes through :func:`_upgrade`.

Each side of the queue validates once, with the same function (:func:`_validate`): the
client when it builds the spec (:func:`build_spec`), the worker when it reads the payload
(:func:`spec_from_payload`), because anything read off a queue may be stale, hand-written or
hostile. What it validated travels validated: the options objects, and the conversation as
``jobs.contract.conversation.ChatMessages``; nothing after the spec checks them again. Every rejection
is a :class:`JobSpecError` naming the field as the user spelled it and its allowed range.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import os
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from cache_store.keys import MAX_TOKEN_ID
from jobs.contract.conversation import (CHAT_ROLES, MAX_CHAT_MESSAGES, ChatMessages, ConversationError,  # noqa: F401
                                        check_messages, check_size)
from jobs.contract.model_names import ModelCatalog, job_default, looks_like_path, public_name
from jobs.settings import Settings
from specprefill.options import (GenerateOptions, OptionError, Sampling, ScoringOptions,
                                 SelectionOptions, check_flag)

# 3: nested: {"v": 3, "scoring": {...}, "selection": {...}, "generate": {...}, ...}.
# 2: flat, the draft's lookahead sampling fields named lookahead_temperature / _top_p / _seed.
# 1: flat, those named temperature / top_p / seed. A payload without "v" is read as flat.
PAYLOAD_VERSION = 3
SUPPORTED_PAYLOAD_VERSIONS = (1, 2, 3)
JOB_KINDS = ("prefill", "generate")
INPUT_FIELDS = ("tokens", "text", "messages")
# Spec fields that are not options (the payload's top level besides "v" and the groups).
SPEC_FIELDS = ("draft_model", "target_model", *INPUT_FIELDS, "tools", "template_args",
               "return_importance", "return_spans")

# The option groups of a job (JobSpec field -> options class). A user spells each option
# by its field name, except the lookahead's sampling (spelled_option): a generate job's
# own sampling has the plain names.
OPTION_GROUPS = {"scoring": ScoringOptions, "selection": SelectionOptions, "generate": GenerateOptions}
LOOKAHEAD = "lookahead_"
# Older spellings still accepted (payload version 1 and older clients; the CLI's option
# names from Python): old name -> name.
RENAMED_FIELDS = {"temperature": "lookahead_temperature", "top_p": "lookahead_top_p",
                  "seed": "lookahead_seed"}
CLI_SPELLINGS = {"model": "draft_model", "spans": "return_spans", "importance": "return_importance"}

MAX_MODEL_NAME_CHARS = 1024
# Text is checked in characters at enqueue (tokens are only known to the worker, which
# checks max_prompt_tokens again after tokenizing); no tokenizer emits fewer than one
# token per this many characters on real text.
CHARS_PER_TOKEN_BOUND = 32
MAX_TOOLS = 128
MAX_TEMPLATE_ARGS = 32
# apply_chat_template's own parameters: a job's template arguments may not set them.
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                                    "add_generation_prompt", "continue_final_message", "chat_template",
                                    "return_dict", "return_tensors", "padding", "truncation",
                                    "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class JobSpecError(ValueError):
    """A job spec field is missing, of the wrong type, or out of its allowed range."""


class ContextLengthError(JobSpecError):
    """A prompt (plus what a job adds to it) is longer than a model's context window; the
    HTTP API answers it as 400 ``context_length_exceeded``."""


@dataclass(frozen=True)
class Limits:
    """What a spec must respect, derived from :class:`Settings` (:meth:`from_settings`):
    sizes, and the models it may name (``allowed_models`` None: any)."""

    max_prompt_tokens: int = Settings.max_prompt_tokens
    max_batch_documents: int = Settings.max_batch_documents
    max_generate_tokens: int = Settings.max_generate_tokens
    allowed_models: frozenset[str] | None = None
    shown_models: tuple[str, ...] = ()  # the allowed names a refusal lists (no worker paths)

    @classmethod
    def from_settings(cls, settings: Settings) -> "Limits":
        allowed, shown = None, ()
        if settings.allowed_models:
            catalog = ModelCatalog.from_settings(settings)
            sources = set(catalog.sources())
            allowed = frozenset((*settings.allowed_models, *catalog.names(), *sources,
                                 *settings.preload_models))
            shown = tuple(sorted(n for n in allowed if n not in sources and not looks_like_path(n)
                                 and not os.path.isdir(n)))
        return cls(settings.max_prompt_tokens, settings.max_batch_documents,
                   settings.max_generate_tokens, allowed, shown)

    def check_model(self, name: str, field_name: str) -> None:
        """Refuse a model outside ``allowed_models`` (a local path matches its resolved form).

        The refusal lists the allowed names, never a folder of the worker's."""
        if self.allowed_models is None or name in self.allowed_models:
            return
        if os.path.isdir(name):
            real = os.path.realpath(name)
            if any(os.path.isdir(a) and os.path.realpath(a) == real for a in self.allowed_models):
                return
        shown = ", ".join(self.shown_models) or "only folders of the worker's"
        raise JobSpecError(f"{field_name}: {public_name(name)!r:.200} is not an allowed model "
                           f"(allowed: {shown:.1000})")


def spelled_option(group: str, name: str) -> str:
    """How a user spells option ``name`` of ``group``: the lookahead's sampling fields are
    ``lookahead_temperature`` / ``_top_p`` / ``_seed`` / ``_greedy``, every other its own name."""
    return LOOKAHEAD + name if group == "scoring" and name in Sampling.__dataclass_fields__ else name


def _names_of(kind: str) -> Mapping[str, tuple[str, str]]:
    groups = ("scoring", "selection", "generate") if kind == "generate" else ("scoring", "selection")
    return MappingProxyType({spelled_option(g, name): (g, name) for g in groups
                             for name in OPTION_GROUPS[g].__dataclass_fields__})


_OPTION_NAMES = {kind: _names_of(kind) for kind in JOB_KINDS}


def option_names(kind: str = "prefill") -> Mapping[str, tuple[str, str]]:
    """Every option a ``kind`` job takes: its spelling -> ``(group, field)`` (the one map
    between the flat names of the client, CLI, HTTP API and JSONL lines and the objects)."""
    return _OPTION_NAMES[kind]


# Every keyword build_spec takes: the spec fields, each option's spelling (of either kind),
# the option groups themselves (objects or mappings), and the older spellings.
SPEC_KEYWORDS = frozenset((*SPEC_FIELDS, *option_names("generate"), *option_names("prefill"),
                           *OPTION_GROUPS, *RENAMED_FIELDS, *CLI_SPELLINGS, "kind", "extra", "v"))


@dataclass(frozen=True)
class JobSpec:
    """One SpecPrefill job. Exactly one of ``tokens``, ``text`` and ``messages`` is set.

    ``scoring`` samples the draft's lookahead tokens and scores the prompt, ``selection``
    picks the chunks the target prefills; a job with ``generate`` options (and a
    ``target_model``) is a generate job: the target answers, with its own sampling.
    """

    draft_model: str
    tokens: tuple[int, ...] | None = None
    text: str | None = None
    # The conversation (jobs.contract.conversation): Hugging Face chat-template message dicts, checked
    # once, when the spec was built (ChatMessages: nothing after that checks them again).
    messages: ChatMessages | None = None
    # Rendered by the chat template with the messages (and so part of the system block):
    # OpenAI-style tool definitions and template keyword arguments (e.g. enable_thinking).
    tools: tuple[Mapping[str, Any], ...] = ()
    template_args: Mapping[str, Any] = field(default_factory=dict)
    scoring: ScoringOptions = field(default_factory=ScoringOptions)
    selection: SelectionOptions = field(default_factory=SelectionOptions)
    generate: GenerateOptions | None = None
    target_model: str | None = None  # a generate job's target
    return_importance: bool = False
    return_spans: bool = False

    def __post_init__(self) -> None:
        if self.messages is not None and not isinstance(self.messages, ChatMessages):
            raise TypeError("JobSpec.messages: build the spec with build_spec or spec_from_payload, "
                            "which check the conversation (jobs.contract.conversation.check_messages)")

    @property
    def kind(self) -> str:
        """``"generate"`` with generate options, else ``"prefill"``."""
        return "generate" if self.generate is not None else "prefill"

    @property
    def input_kind(self) -> str:
        return "tokens" if self.tokens is not None else "text" if self.text is not None else "chat"

    def options(self) -> dict[str, Any]:
        """Everything but the input that decides the result, under the names users give it
        (``kind``, the models, ``keep``, ``lookahead_seed``, ``max_tokens``, ...)."""
        d: dict[str, Any] = {"kind": self.kind, "draft_model": self.draft_model}
        if self.generate is not None:
            d["target_model"] = self.target_model
        for spelling, (group, name) in option_names(self.kind).items():
            d[spelling] = getattr(getattr(self, group), name)
        d.update(return_importance=self.return_importance, return_spans=self.return_spans)
        return d

    def to_payload(self) -> dict[str, Any]:
        """The JSON-ready dict put on the queue (version 3, nested)."""
        d: dict[str, Any] = {"v": PAYLOAD_VERSION, "draft_model": self.draft_model,
                             "scoring": _fields_of(self.scoring), "selection": _fields_of(self.selection),
                             "return_importance": self.return_importance, "return_spans": self.return_spans}
        if self.tokens is not None:
            d["tokens"] = list(self.tokens)
        elif self.text is not None:
            d["text"] = self.text
        else:
            d["messages"] = [dict(m) for m in self.messages or ()]
        if self.tools:
            d["tools"] = [dict(t) for t in self.tools]
        if self.template_args:
            d["template_args"] = dict(self.template_args)
        if self.generate is not None:
            d["generate"] = {**_fields_of(self.generate), "stop": list(self.generate.stop)}
            d["target_model"] = self.target_model
        return d

    def job_id(self, namespace: str = "specprefill") -> str:
        """Deterministic RQ job id (letters, digits, '-'): SHA-256 of the deployment's
        namespace and the canonical payload, so deployments sharing a Redis never share a job."""
        canonical = json.dumps({"namespace": namespace, "payload": self.to_payload()},
                               sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return f"{self.kind}-{hashlib.sha256(canonical.encode()).hexdigest()[:40]}"


def _fields_of(options: Any) -> dict[str, Any]:
    """An options object's fields as a dict (shallow: they are plain values)."""
    return {name: getattr(options, name) for name in options.__dataclass_fields__}


# ---- field checks: each returns the clean value or raises JobSpecError ----

def _flag(name: str, value: Any) -> bool:
    try:
        return check_flag(name, value)
    except OptionError as exc:
        raise JobSpecError(str(exc)) from None


def _model_name(value: Any, limits: Limits, name: str = "draft_model") -> str:
    if not isinstance(value, str) or not value.strip():
        raise JobSpecError(f"{name}: expected a model name, hub id or worker folder "
                           f"(string of 1..{MAX_MODEL_NAME_CHARS} characters)")
    if len(value) > MAX_MODEL_NAME_CHARS:
        raise JobSpecError(f"{name}: {len(value)} characters, the limit is {MAX_MODEL_NAME_CHARS}")
    if any(ord(ch) < 32 for ch in value):
        raise JobSpecError(f"{name}: control characters are not allowed")
    limits.check_model(value, name)
    return value


def _tokens(value: Any, limits: Limits) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        if not (hasattr(value, "tolist") and hasattr(value, "ndim")):  # numpy / mlx arrays
            raise JobSpecError("tokens: expected a list of token ids")
        if value.ndim != 1:
            raise JobSpecError(f"tokens: expected a 1-D list of token ids, got {value.ndim}-D")
        value = value.tolist()
    n = len(value)
    if not 1 <= n <= limits.max_prompt_tokens:
        raise JobSpecError(f"tokens: {n} tokens, allowed 1..{limits.max_prompt_tokens} "
                           "(max_prompt_tokens)")
    if all(type(t) is int for t in value) and 0 <= min(value) and max(value) <= MAX_TOKEN_ID:
        return tuple(value)  # the common case, checked in C-speed builtins
    out = []
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t <= MAX_TOKEN_ID:
            raise JobSpecError(f"tokens[{i}]: expected a token id in [0, {MAX_TOKEN_ID}], got {t!r:.40}")
        out.append(int(t))
    return tuple(out)


def _text(value: Any, limits: Limits) -> str:
    if not isinstance(value, str):
        raise JobSpecError(f"text: expected a string, got {type(value).__name__}")
    max_chars = limits.max_prompt_tokens * CHARS_PER_TOKEN_BOUND
    if not 1 <= len(value) <= max_chars:
        raise JobSpecError(f"text: {len(value)} characters, allowed 1..{max_chars} "
                           f"(max_prompt_tokens={limits.max_prompt_tokens})")
    if not value.strip():  # a byte-level tokenizer would prefill the blanks as tokens
        raise JobSpecError(f"text: only whitespace ({len(value)} characters): nothing to prefill")
    return value


def _messages(value: Any, limits: Limits) -> ChatMessages:
    """The conversation, checked here once (a :class:`ChatMessages` was: only its size is
    held against this spec's limit)."""
    max_chars = limits.max_prompt_tokens * CHARS_PER_TOKEN_BOUND
    try:
        if isinstance(value, ChatMessages):
            check_size(value.chars, max_chars)
            return value
        return check_messages(value, max_chars)
    except ConversationError as exc:
        limit = f" (max_prompt_tokens={limits.max_prompt_tokens})" if "characters in total" in str(exc) else ""
        raise JobSpecError(f"{exc}{limit}") from None


def _tools(value: Any) -> tuple[Mapping[str, Any], ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise JobSpecError("tools: expected a list of tool objects")
    if len(value) > MAX_TOOLS:
        raise JobSpecError(f"tools: {len(value)} tools, allowed 0..{MAX_TOOLS}")
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise JobSpecError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"parameters\": ...}}")
    try:  # rendered by the worker's template and carried on the JSON queue
        json.dumps(list(value), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise JobSpecError("tools: must be plain JSON (no NaN, no custom objects)") from None
    return tuple(dict(t) for t in value)


def _template_args(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise JobSpecError("template_args: expected an object of chat-template keyword arguments")
    if len(value) > MAX_TEMPLATE_ARGS:
        raise JobSpecError(f"template_args: {len(value)} arguments, allowed 0..{MAX_TEMPLATE_ARGS}")
    for k, v in value.items():
        if not isinstance(k, str) or not k.isidentifier():
            raise JobSpecError(f"template_args: {k!r:.60} is not a keyword name")
        if k in RESERVED_TEMPLATE_ARGS:
            raise JobSpecError(f"template_args.{k}: set by the worker itself, not a template argument")
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise JobSpecError(f"template_args.{k}: expected a string, number, boolean or null, "
                               f"got {type(v).__name__}")
    return dict(value)


def _renamed(fields_: Mapping[str, Any]) -> dict[str, Any]:
    """``fields_`` with old spellings under their new names (giving both is an error)."""
    out = dict(fields_)
    for old, new in {**RENAMED_FIELDS, **CLI_SPELLINGS}.items():
        if old in out:
            if new in out:
                which = "the CLI's" if old in CLI_SPELLINGS else "the old"
                raise JobSpecError(f"{old}: {which} name of {new}; give only {new}")
            out[new] = out.pop(old)
    return out


def _version(fields_: dict[str, Any]) -> int:
    version = fields_.pop("v", 2)
    if isinstance(version, bool) or version not in SUPPORTED_PAYLOAD_VERSIONS:
        raise JobSpecError(f"v: payload version {version!r:.20} is not supported "
                           f"(expected one of {', '.join(map(str, SUPPORTED_PAYLOAD_VERSIONS))})")
    return version


def _upgrade(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``payload`` as a version-3 payload (nested), whatever older spelling it uses.

    Flat fields (payload versions 1 and 2, and :func:`build_spec`'s keywords) are the
    options by their spellings (:func:`option_names`), ``kind``, and the old names
    (``temperature`` / ``top_p`` / ``seed`` of the lookahead, the CLI's ``model`` /
    ``spans`` / ``importance``). A generate job's own options come in ``extra`` (versions 1
    and 2, with ``target_model`` and, before they were a spec field, ``tools``) or by name;
    given by name, ``seed`` also seeds the lookahead unless ``lookahead_seed`` is given.
    Unset (None) fields take their defaults.
    """
    fields_ = {k: v for k, v in payload.items() if v is not None}
    if _version(fields_) == 3:
        return fields_
    kind = fields_.pop("kind", "generate" if "generate" in fields_ else "prefill")
    if kind not in JOB_KINDS:
        raise JobSpecError(f"kind: {kind!r:.40} is not one of {', '.join(JOB_KINDS)}")
    if kind == "prefill" and "generate" in fields_:
        raise JobSpecError("generate: only a generate job has generate options (kind generate)")
    own = _generate_fields(fields_, kind)
    fields_ = _renamed(fields_)
    names = option_names("prefill")
    unknown = sorted(str(k) for k in fields_ if k not in names and k not in SPEC_FIELDS
                     and k not in OPTION_GROUPS)
    if unknown:
        allowed = {*SPEC_FIELDS, *option_names(kind)} - ({"target_model"} if kind == "prefill" else set())
        raise JobSpecError(f"{unknown[0]:.60}: unknown field (allowed: {', '.join(sorted(allowed))})")
    nested = {k: v for k, v in fields_.items() if k not in names}
    for group, given in (("scoring", {}), ("selection", {}), ("generate", own)):
        flat = {name: fields_[s] for s, (g, name) in names.items() if g == group and s in fields_}
        if kind == "generate" or group != "generate":
            nested[group] = _merged(group, nested.get(group), {**given, **flat})
    return nested


def _generate_fields(fields_: dict[str, Any], kind: str) -> dict[str, Any]:
    """Take a generate job's own options out of ``fields_`` (from ``extra`` or by name)."""
    extra = fields_.pop("extra", None)
    if extra is None and kind != "generate":
        return {}
    if extra is None:
        own = {k: fields_.pop(k) for k in GenerateOptions.__dataclass_fields__ if k in fields_}
        if "seed" in own:
            fields_.setdefault("lookahead_seed", own["seed"])
        return own
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise JobSpecError("extra: expected an object with string keys")
    if kind != "generate":
        if extra:
            raise JobSpecError("extra: only a generate job has options (kind generate)")
        return {}
    by_name = sorted(set(fields_) & (GenerateOptions.__dataclass_fields__.keys() - RENAMED_FIELDS.keys()))
    if by_name:
        raise JobSpecError(f"extra: give a generate job's options by name ({by_name[0]}=...) or in "
                           "extra (the older spelling), not both")
    own = dict(extra)
    for name in ("target_model", "tools"):  # tools: their home before they were a spec field
        if name in own:
            if fields_.get(name):
                raise JobSpecError(f"{name}: given twice (as a spec field and in extra); give it once")
            fields_[name] = own.pop(name)
    return own


def _merged(group: str, given: Any, flat: dict[str, Any]) -> Any:
    """A group's fields from an options object or mapping, with the flat ones on top (an
    options object alone stays itself: it was checked when it was built)."""
    if given is None:
        return flat
    if isinstance(given, OPTION_GROUPS[group]):
        if not flat:
            return given
        given = _fields_of(given)
    if not isinstance(given, Mapping):
        raise JobSpecError(f"{group}: expected {OPTION_GROUPS[group].__name__} or an object of its fields")
    twice = sorted(set(given) & set(flat))
    if twice:
        raise JobSpecError(f"{spelled_option(group, twice[0])}: given twice (by name and in {group})")
    return {**given, **flat}


def payload_kind(payload: Mapping[str, Any]) -> str:
    """The kind of job a payload of any version asks for, without validating it:
    ``"prefill"``, ``"generate"``, ``"heal"`` (``jobs.contract.heal``) or ``"invalid"``."""
    if payload.get("kind") == "heal":
        return "heal"
    if payload.get("v") == 3:
        return "prefill" if payload.get("generate") is None else "generate"
    kind = payload.get("kind", "prefill")
    return kind if isinstance(kind, str) and kind in JOB_KINDS else "invalid"


def build_spec(settings: Settings | None = None, *, limits: Limits | None = None,
               **fields_: Any) -> JobSpec:
    """Build a validated spec from keyword fields; unset ones take ``settings``' defaults.

    Pass exactly one of ``tokens=``, ``text=`` or ``messages=``; options by their names
    (``keep=0.3``, ``lookahead_temperature=0.5``; ``kind="generate"`` with ``max_tokens=``,
    ``temperature=``, ...) or as objects (``selection=SelectionOptions(...)``). Raises
    :class:`JobSpecError` naming the offending field.
    """
    settings = settings or Settings()
    nested = _upgrade(fields_)
    nested.setdefault("draft_model", job_default(settings, "draft"))
    if nested.get("generate") is not None:
        nested.setdefault("target_model", job_default(settings, "target"))
    return _validate(nested, settings, limits or Limits.from_settings(settings))


def spec_from_payload(payload: Any, settings: Settings | None = None, *,
                      limits: Limits | None = None) -> JobSpec:
    """Validate a payload read off the queue (never trusted, any version) into a :class:`JobSpec`.
    Options it does not set take the worker's ``settings``' defaults."""
    settings = settings or Settings()
    if not isinstance(payload, Mapping):
        raise JobSpecError(f"payload: expected an object, got {type(payload).__name__}")
    nested = _upgrade(payload)
    for name in ("draft_model", "target_model"):
        if name not in nested and (name == "draft_model" or nested.get("generate") is not None):
            raise JobSpecError(f"{name}: missing")
    return _validate(nested, settings, limits or Limits.from_settings(settings))


def _group(group: str, given: Any, default: Any) -> Any:
    """The ``group`` options object: ``default`` with the ``given`` fields (a mapping), or the
    given object itself. The object checks its ranges when it is built, once: its error names
    the field as users spell it."""
    if isinstance(given, OPTION_GROUPS[group]):
        return given  # checked when it was built
    if not isinstance(given, Mapping):
        raise JobSpecError(f"{group}: expected an object of {group} options")
    known = OPTION_GROUPS[group].__dataclass_fields__
    unknown = sorted(str(k) for k in given if k not in known)
    if unknown:
        raise JobSpecError(f"{spelled_option(group, unknown[0]):.60}: unknown {group} option "
                           f"(allowed: {', '.join(spelled_option(group, k) for k in known)})")
    changes = {k: v for k, v in given.items() if v is not None}
    if not changes:
        return default  # checked when it was built
    try:
        return dataclasses.replace(default, **changes)
    except OptionError as exc:
        raise JobSpecError(f"{spelled_option(group, exc.field)}: {exc.problem}") from None


def _generate(given: Any, limits: Limits) -> GenerateOptions:
    """A generate job's options, within the deployment's ``max_generate_tokens`` (with
    ``fit_context``, a larger ``max_tokens`` is a ceiling lowered to it, as to the window's room)."""
    limit = limits.max_generate_tokens
    options = _group("generate", given, GenerateOptions(max_tokens=min(GenerateOptions.max_tokens, limit)))
    if options.fit_context and options.max_tokens > limit:
        return dataclasses.replace(options, max_tokens=limit)
    if options.max_tokens > limit:
        raise JobSpecError(f"max_tokens: {options.max_tokens} is outside the allowed range "
                           f"[1, {limit}] (max_generate_tokens)")
    return options


def _validate(v: Mapping[str, Any], settings: Settings, limits: Limits) -> JobSpec:
    """A :class:`JobSpec` from a version-3 payload (every field checked)."""
    unknown = sorted(str(k) for k in v if k not in SPEC_FIELDS and k not in OPTION_GROUPS)
    if unknown:
        raise JobSpecError(f"{unknown[0]:.60}: unknown field")
    inputs = [k for k in INPUT_FIELDS if v.get(k) is not None]
    if len(inputs) != 1:
        raise JobSpecError("input: give exactly one of tokens, text or messages "
                           f"(got {', '.join(inputs) or 'none'})")
    for name in ("tools", "template_args"):
        if v.get(name) and "messages" not in inputs:
            raise JobSpecError(f"{name}: only for chat input (messages); the chat template renders them")
    generate = None if v.get("generate") is None else _generate(v["generate"], limits)
    if generate is None and v.get("target_model") is not None:
        raise JobSpecError("target_model: only a generate job has a target model")
    return JobSpec(
        draft_model=_model_name(v.get("draft_model"), limits),
        tokens=_tokens(v["tokens"], limits) if "tokens" in inputs else None,
        text=_text(v["text"], limits) if "text" in inputs else None,
        messages=_messages(v["messages"], limits) if "messages" in inputs else None,
        tools=_tools(v.get("tools") or ()),
        template_args=_template_args(v.get("template_args") or {}),
        scoring=_group("scoring", v.get("scoring", {}), settings.scoring),
        selection=_group("selection", v.get("selection", {}), settings.selection),
        generate=generate,
        target_model=_model_name(v.get("target_model"), limits, "target_model") if generate else None,
        return_importance=_flag("return_importance", v.get("return_importance", False)),
        return_spans=_flag("return_spans", v.get("return_spans", False)),
    )


def check_batch_size(n_documents: int, limits: Limits) -> None:
    """Raise :class:`JobSpecError` if a batch has more documents than allowed."""
    if n_documents > limits.max_batch_documents:
        raise JobSpecError(f"documents: {n_documents} in one batch, the limit is "
                           f"{limits.max_batch_documents} (max_batch_documents)")
