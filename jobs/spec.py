"""The job spec: what a client asks a worker to do, validated on both sides of the queue.

A spec travels as a JSON payload (``JobSpec.to_payload``). The client validates it before
enqueueing and the worker validates the payload again with :func:`spec_from_payload`,
because anything read off a queue may be stale, hand-written or hostile. Every rejection
is a :class:`JobSpecError` naming the field and its allowed range.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from cache_store.keys import MAX_TOKEN_ID
from jobs.model_names import ModelCatalog, job_default, looks_like_path, public_name
from jobs.settings import Settings

# 2: the draft's lookahead sampling fields are lookahead_temperature / _top_p / _seed.
PAYLOAD_VERSION = 2
SUPPORTED_PAYLOAD_VERSIONS = (1, 2)
JOB_KINDS = ("prefill", "generate")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

MAX_MODEL_NAME_CHARS = 1024
MAX_CHAT_MESSAGES = 10_000
# Text is checked in characters at enqueue (tokens are only known to the worker, which
# checks max_prompt_tokens again after tokenizing); no tokenizer emits fewer than one
# token per this many characters on real text.
CHARS_PER_TOKEN_BOUND = 32
# Generate jobs carry their options in ``extra`` (see :class:`GenerateOptions`).
GENERATE_OPTIONS = ("target_model", "max_tokens", "temperature", "top_p", "seed", "greedy",
                    "stop", "full_prefill")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOOLS = 128
MAX_TEMPLATE_ARGS = 32
# apply_chat_template's own parameters: a job's template arguments may not set them.
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                                    "add_generation_prompt", "continue_final_message", "chat_template",
                                    "return_dict", "return_tensors", "padding", "truncation",
                                    "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"})
# Spec fields left out of the payload (and so of the job id) while empty: jobs without them
# keep the ids they had before the fields existed.
OMITTED_WHEN_EMPTY = ("tools", "template_args")


class JobSpecError(ValueError):
    """A job spec field is missing, of the wrong type, or out of its allowed range."""


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


@dataclass(frozen=True)
class GenerateOptions:
    """What a generate job does after selection (validated from the spec's ``extra``).

    Sampling: ``greedy`` or ``temperature`` 0 takes the argmax; otherwise top-p sampling
    seeded by ``seed`` (reproducible). Generation ends at EOS, after ``max_tokens`` tokens,
    or before the first occurrence of any ``stop`` string. ``full_prefill`` prefills the
    target with every prompt token (no draft scoring) for comparison.
    """

    target_model: str
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    greedy: bool = False
    stop: tuple[str, ...] = ()
    full_prefill: bool = False

    def to_extra(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in GENERATE_OPTIONS}
        d["stop"] = list(self.stop)
        return d


@dataclass(frozen=True)
class JobSpec:
    """One SpecPrefill job. Exactly one of ``tokens``, ``text`` and ``messages`` is set.

    ``lookahead_*`` sample the draft's lookahead tokens (scoring); a generate job's own
    sampling of the target's text is in :class:`GenerateOptions`.
    """

    draft_model: str
    tokens: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs
    # Rendered by the chat template with the messages (and so part of the system block):
    # OpenAI-style tool definitions and template keyword arguments (e.g. enable_thinking).
    tools: tuple[Mapping[str, Any], ...] = ()
    template_args: Mapping[str, Any] = field(default_factory=dict)
    # Defaults are the settings' defaults; the client fills in the deployment's own values.
    keep: float = Settings.keep
    chunk_size: int = Settings.chunk_size
    tail_tokens: int = Settings.tail_tokens
    threshold: int = Settings.threshold
    n_lookahead: int = Settings.n_lookahead
    lookahead_temperature: float = Settings.temperature
    lookahead_top_p: float = Settings.top_p
    pool_kernel: int = Settings.pool_kernel
    lookahead_seed: int = 0
    include_last_query: bool = Settings.include_last_query
    return_importance: bool = False
    return_spans: bool = False
    kind: str = "prefill"
    extra: Mapping[str, Any] = field(default_factory=dict)  # kind-specific options (JSON)

    @property
    def generate(self) -> GenerateOptions:
        """The generate options of a validated ``kind="generate"`` spec."""
        if self.kind != "generate":
            raise ValueError(f"kind: {self.kind!r} job has no generate options")
        return GenerateOptions(**{**self.extra, "stop": tuple(self.extra.get("stop", ()))})

    @property
    def input_kind(self) -> str:
        return "tokens" if self.tokens is not None else "text" if self.text is not None else "chat"

    def scoring_options(self) -> dict[str, Any]:
        """Options for ``score_tokens`` that come from the spec (its own parameter names)."""
        return dict(n_lookahead=self.n_lookahead, temperature=self.lookahead_temperature,
                    top_p=self.lookahead_top_p, seed=self.lookahead_seed,
                    pool_kernel=self.pool_kernel, include_last_query=self.include_last_query)

    def selection_options(self) -> dict[str, Any]:
        """Everything besides the tokens that decides the selection (the memo key)."""
        return dict(self.scoring_options(), keep=self.keep, chunk_size=self.chunk_size,
                    tail_tokens=self.tail_tokens, threshold=self.threshold)

    def to_payload(self) -> dict[str, Any]:
        """The JSON-ready dict put on the queue."""
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}  # shallow: fast
        d["tokens"] = list(self.tokens) if self.tokens is not None else None
        d["messages"] = ([{"role": r, "content": c} for r, c in self.messages]
                         if self.messages is not None else None)
        d["extra"] = dict(self.extra)
        d["tools"] = [dict(t) for t in self.tools]
        d["template_args"] = dict(self.template_args)
        for name in OMITTED_WHEN_EMPTY:
            if not d[name]:
                del d[name]
        d["v"] = PAYLOAD_VERSION
        return d

    def job_id(self, namespace: str = "specprefill") -> str:
        """Deterministic RQ job id (letters, digits, '-'): SHA-256 of the deployment's
        namespace and the canonical payload, so deployments sharing a Redis never share a job."""
        canonical = json.dumps({"namespace": namespace, "payload": self.to_payload()},
                               sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return f"{self.kind}-{hashlib.sha256(canonical.encode()).hexdigest()[:40]}"


# ---- field checks: each returns the clean value or raises JobSpecError ----

def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise JobSpecError(f"{name}: expected an integer in [{lo}, {hi}], got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise JobSpecError(f"{name}: {value} is outside the allowed range [{lo}, {hi}]")
    return value


def _float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise JobSpecError(f"{name}: expected a number in {'(' if lo_open else '['}{lo}, {hi}], "
                           f"got {type(value).__name__}")
    try:
        value = float(value)
    except (OverflowError, ValueError):
        raise JobSpecError(f"{name}: not representable as a float") from None
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not math.isfinite(value) or not ok:
        raise JobSpecError(f"{name}: {value!r} is outside the allowed range "
                           f"{'(' if lo_open else '['}{lo}, {hi}]")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise JobSpecError(f"{name}: expected true or false, got {type(value).__name__}")
    return value


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


def _messages(value: Any, limits: Limits) -> tuple[tuple[str, str], ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise JobSpecError("messages: expected a list of {role, content} objects")
    if not 1 <= len(value) <= MAX_CHAT_MESSAGES:
        raise JobSpecError(f"messages: {len(value)} messages, allowed 1..{MAX_CHAT_MESSAGES}")
    out, total = [], 0
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or set(m) != {"role", "content"}:
            raise JobSpecError(f"messages[{i}]: expected an object with exactly 'role' and 'content'")
        role, content = m["role"], m["content"]
        if role not in CHAT_ROLES:
            raise JobSpecError(f"messages[{i}].role: {role!r:.40} is not one of {', '.join(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise JobSpecError(f"messages[{i}].content: expected a string, got {type(content).__name__}")
        total += len(content)
        out.append((role, content))
    max_chars = limits.max_prompt_tokens * CHARS_PER_TOKEN_BOUND
    if total > max_chars:
        raise JobSpecError(f"messages: {total} characters in total, the limit is {max_chars} "
                           f"(max_prompt_tokens={limits.max_prompt_tokens})")
    if not any(r != "system" and r != "developer" for r, _ in out):
        raise JobSpecError("messages: needs at least one user/assistant/tool message")
    return tuple(out)


def _extra(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise JobSpecError("extra: expected an object with string keys")
    try:  # must survive the JSON queue unchanged
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise JobSpecError("extra: must be plain JSON (no NaN, no custom objects)") from None
    return dict(value)


def _stop_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Sequence):
        raise JobSpecError("stop: expected a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise JobSpecError(f"stop: {len(value)} strings, allowed 0..{MAX_STOP_STRINGS}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise JobSpecError(f"stop[{i}]: expected a string of 1..{MAX_STOP_CHARS} characters")
    return tuple(value)


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


def _moved_tools(v: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """``extra`` without a generate job's ``tools`` (their old home), and the tools given."""
    extra, tools = v.get("extra", {}), v.get("tools")
    if v.get("kind") == "generate" and isinstance(extra, Mapping) and "tools" in extra:
        if tools:
            raise JobSpecError("tools: given twice (as a spec field and in extra); give it once")
        extra = {k: x for k, x in extra.items() if k != "tools"}
        tools = v["extra"]["tools"]
    return extra, tools


def _generate_options(extra: Mapping[str, Any], limits: Limits) -> GenerateOptions:
    unknown = sorted(set(extra) - set(GENERATE_OPTIONS))
    if unknown:
        raise JobSpecError(f"{unknown[0]:.60}: unknown generate option "
                           f"(allowed: {', '.join(GENERATE_OPTIONS)})")
    if "target_model" not in extra:
        raise JobSpecError("target_model: missing")
    d = GenerateOptions(target_model="-")  # defaults
    limit = limits.max_generate_tokens
    try:
        max_tokens = _int("max_tokens", extra.get("max_tokens", min(d.max_tokens, limit)), 1, limit)
    except JobSpecError as exc:
        raise JobSpecError(f"{exc} (max_generate_tokens)") from None
    return GenerateOptions(
        target_model=_model_name(extra["target_model"], limits, "target_model"),
        max_tokens=max_tokens,
        temperature=_float("temperature", extra.get("temperature", d.temperature), 0.0, 100.0),
        top_p=_float("top_p", extra.get("top_p", d.top_p), 0.0, 1.0, lo_open=True),
        seed=_int("seed", extra.get("seed", d.seed), 0, 2**32 - 1),
        greedy=_bool("greedy", extra.get("greedy", d.greedy)),
        stop=_stop_strings(extra.get("stop", d.stop)),
        full_prefill=_bool("full_prefill", extra.get("full_prefill", d.full_prefill)),
    )


_FIELDS = {f for f in JobSpec.__dataclass_fields__}
# Spec fields whose default is a deployment setting: spec field -> settings field. Models
# are named (jobs.model_names.job_default): "draft" / "target", which the worker resolves,
# unless the client configured a model itself.
_FROM_SETTINGS = {name: name for name in ("keep", "chunk_size", "tail_tokens",
                                          "threshold", "n_lookahead", "pool_kernel",
                                          "include_last_query")}
_FROM_SETTINGS.update(lookahead_temperature="temperature", lookahead_top_p="top_p")
# Spellings of payload version 1 (and of older clients), still accepted.
RENAMED_FIELDS = {"temperature": "lookahead_temperature", "top_p": "lookahead_top_p",
                  "seed": "lookahead_seed"}
# The CLI's option names (--model, --spans, --importance), accepted from Python too.
CLI_SPELLINGS = {"model": "draft_model", "spans": "return_spans", "importance": "return_importance"}


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


def build_spec(settings: Settings | None = None, *, limits: Limits | None = None,
               **fields_: Any) -> JobSpec:
    """Build a validated spec; unset fields take their defaults from ``settings``.

    Pass exactly one of ``tokens=``, ``text=`` or ``messages=``. Raises
    :class:`JobSpecError` naming the offending field.
    """
    settings = settings or Settings()
    limits = limits or Limits.from_settings(settings)
    fields_ = _renamed(fields_)
    unknown = sorted(set(fields_) - _FIELDS)
    if unknown:
        raise JobSpecError(f"{unknown[0]}: unknown field (allowed: {', '.join(sorted(_FIELDS))})")
    defaults = {name: getattr(settings, source) for name, source in _FROM_SETTINGS.items()}
    values = {"draft_model": job_default(settings, "draft"), **defaults,
              **{k: v for k, v in fields_.items() if v is not None}}
    if values.get("kind") == "generate" and isinstance(values.get("extra", {}), Mapping):
        extra = dict(values.get("extra", {}))
        if extra.get("target_model") is None:
            extra["target_model"] = job_default(settings, "target")
        values["extra"] = extra
    return _validate(values, limits)


def spec_from_payload(payload: Any, settings: Settings | None = None, *,
                      limits: Limits | None = None) -> JobSpec:
    """Validate a payload read off the queue (never trusted) into a :class:`JobSpec`."""
    settings = settings or Settings()
    limits = limits or Limits.from_settings(settings)
    if not isinstance(payload, Mapping):
        raise JobSpecError(f"payload: expected an object, got {type(payload).__name__}")
    payload = dict(payload)
    version = payload.pop("v", PAYLOAD_VERSION)
    if isinstance(version, bool) or version not in SUPPORTED_PAYLOAD_VERSIONS:
        raise JobSpecError(f"v: payload version {version!r:.20} is not supported "
                           f"(expected one of {', '.join(map(str, SUPPORTED_PAYLOAD_VERSIONS))})")
    payload = _renamed(payload)
    unknown = sorted(k if isinstance(k, str) else repr(k) for k in set(payload) - _FIELDS)
    if unknown:
        raise JobSpecError(f"{unknown[0]:.60}: unknown field")
    if "draft_model" not in payload:
        raise JobSpecError("draft_model: missing")
    return build_spec(settings, limits=limits, **payload)


def _validate(v: Mapping[str, Any], limits: Limits) -> JobSpec:
    inputs = [k for k in ("tokens", "text", "messages") if v.get(k) is not None]
    if len(inputs) != 1:
        raise JobSpecError("input: give exactly one of tokens, text or messages "
                           f"(got {', '.join(inputs) or 'none'})")
    kind = v.get("kind", "prefill")
    if kind not in JOB_KINDS:
        raise JobSpecError(f"kind: {kind!r:.40} is not one of {', '.join(JOB_KINDS)}")
    extra, tools = _moved_tools(v)
    extra = _extra(extra)
    for name, given in (("tools", tools), ("template_args", v.get("template_args"))):
        if given and "messages" not in inputs:
            raise JobSpecError(f"{name}: only for chat input (messages); the chat template renders them")
    if kind == "generate":  # stored normalised, so equal requests get equal job ids
        extra = _generate_options(extra, limits).to_extra()
    n_lookahead = _int("n_lookahead", v.get("n_lookahead"), 0, 256)
    include_last_query = _bool("include_last_query", v.get("include_last_query"))
    if n_lookahead == 0 and not include_last_query:
        raise JobSpecError("n_lookahead: 0 needs include_last_query=true (no query would score the prompt)")
    return JobSpec(
        kind=kind,
        draft_model=_model_name(v.get("draft_model"), limits),
        tokens=_tokens(v["tokens"], limits) if "tokens" in inputs else None,
        text=_text(v["text"], limits) if "text" in inputs else None,
        messages=_messages(v["messages"], limits) if "messages" in inputs else None,
        tools=_tools(tools if tools is not None else ()),
        template_args=_template_args(v.get("template_args") or {}),
        keep=_float("keep", v.get("keep"), 0.0, 1.0, lo_open=True),
        chunk_size=_int("chunk_size", v.get("chunk_size"), 1, 8192),
        tail_tokens=_int("tail_tokens", v.get("tail_tokens"), 0, MAX_TOKEN_ID),
        threshold=_int("threshold", v.get("threshold"), 0, MAX_TOKEN_ID),
        n_lookahead=n_lookahead,
        lookahead_temperature=_float("lookahead_temperature", v.get("lookahead_temperature"), 0.0, 100.0),
        lookahead_top_p=_float("lookahead_top_p", v.get("lookahead_top_p"), 0.0, 1.0, lo_open=True),
        pool_kernel=_int("pool_kernel", v.get("pool_kernel"), 1, 1023),
        lookahead_seed=_int("lookahead_seed", v.get("lookahead_seed", 0), 0, 2**32 - 1),
        include_last_query=include_last_query,
        return_importance=_bool("return_importance", v.get("return_importance", False)),
        return_spans=_bool("return_spans", v.get("return_spans", False)),
        extra=extra,
    )


def check_batch_size(n_documents: int, limits: Limits) -> None:
    """Raise :class:`JobSpecError` if a batch has more documents than allowed."""
    if n_documents > limits.max_batch_documents:
        raise JobSpecError(f"documents: {n_documents} in one batch, the limit is "
                           f"{limits.max_batch_documents} (max_batch_documents)")
