"""How many tokens a model can attend to, read from its config, and the guard that refuses more.

The window is what the config declares, never guessed from the weights:

* the positions it was trained on: ``max_position_embeddings`` (``n_positions``, ``n_ctx``,
  ``max_seq_len``, ``seq_length`` in families that name it so), from ``text_config`` when
  the top level has none;
* extended by its RoPE scaling (``rope_scaling``, or transformers 5's ``rope_parameters``) to
  the length that scaling declares, the larger of the two:

  - ``yarn``, ``dynamic``, ``llama3``, ``longrope``: ``original_max_position_embeddings × factor``
    (without an original length, ``max_position_embeddings`` is the original, as transformers
    reads it for yarn and dynamic NTK);
  - ``linear``: ``original_max_position_embeddings × factor`` only when the original is declared
    (configs such as gemma3's already count the interpolation in ``max_position_embeddings``);
  - any other type (``default``, per-layer-type tables): no extension.

Sliding-window layers do not shorten the window: a windowed layer reads any length at its
positions (its window is the draft's own check when it scores, see
:mod:`specprefill.attention.lookahead`), so windowed models are judged by the positions
their config declares like every other. A config that declares no length has no window
here, and nothing is refused. Pure Python: no mlx.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from jobs.contract.spec import ContextLengthError

LENGTH_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")
EXTENDING_ROPES = ("yarn", "dynamic", "llama3", "longrope", "su")


@dataclass(frozen=True)
class ContextWindow:
    """A model's context window in tokens and how the config declares it."""

    tokens: int
    source: str  # e.g. "max_position_embeddings 8192" or "yarn: 32768 × factor 4.0"


def _length(config: Mapping[str, Any]) -> tuple[int, str] | None:
    for key in LENGTH_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None


def _rope(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if isinstance(rope, Mapping) and (rope.get("rope_type") or rope.get("type")):
            return rope
    return None


def _extended(config: Mapping[str, Any], base: int) -> tuple[int, str] | None:
    """The length the RoPE scaling declares, if it declares one."""
    rope = _rope(config)
    if rope is None:
        return None
    kind = str(rope.get("rope_type") or rope.get("type"))
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        return None
    if kind in EXTENDING_ROPES or (kind == "linear" and original):
        start = int(original) if isinstance(original, (int, float)) and original > 0 else base
        return int(start * factor), f"{kind} rope scaling: {start} × factor {factor:g}"
    return None


def context_window(config: Mapping[str, Any]) -> ContextWindow | None:
    """The window ``config`` declares (see the module docstring), or None if it declares none."""
    text = config.get("text_config")
    if _length(config) is None and isinstance(text, Mapping):
        config = text
    found = _length(config)
    if found is None:
        return None
    base, key = found
    extended = _extended(config, base)
    if extended is not None and extended[0] > base:
        return ContextWindow(extended[0], f"{extended[1]}; {key} {base}")
    return ContextWindow(base, f"{key} {base}")


def model_config(folder: str | Path | None, model: Any) -> Mapping[str, Any]:
    """The config a model was loaded from: ``config.json`` in its folder, else its ``args``."""
    path = Path(folder) / "config.json" if folder is not None else None
    if path is not None and path.is_file():
        try:
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                return loaded
        except (OSError, ValueError):
            pass
    args = getattr(model, "args", None)
    if args is None:
        return {}
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    try:
        return {k: v for k, v in vars(args).items() if not k.startswith("_")}
    except TypeError:  # an object without a __dict__: no config to read
        return {}


def fit_max_tokens(n_prompt: int, max_tokens: int, window: ContextWindow | None,
                   max_positions: int | None = None, *, beyond_window: bool = False) -> int:
    """``max_tokens`` lowered to the room ``n_prompt`` tokens leave in the target: its window
    (unless ``beyond_window``: allow_beyond_context) and its learned positions, whichever is
    less. With no room at all it is returned as it is, and the checks refuse the prompt."""
    limits = [n for n in (None if beyond_window or window is None else window.tokens, max_positions)
              if n is not None]
    room = min(limits) - n_prompt if limits else max_tokens
    return min(max_tokens, room) if room >= 1 else max_tokens


def check_context(n_prompt: int, extra: int, extra_name: str, window: ContextWindow | None,
                  role: str, *, allowed: bool) -> None:
    """Refuse ``n_prompt`` tokens plus ``extra`` (``extra_name``: max_tokens, the lookahead)
    beyond the ``role`` model's window, naming both numbers, unless ``allowed``."""
    if window is None or allowed or n_prompt + extra <= window.tokens:
        return
    field = "input" if n_prompt > window.tokens else extra_name
    plus = f" plus {extra_name} {extra}" if extra else ""
    raise ContextLengthError(
        f"{field}: the prompt's {n_prompt} tokens{plus} ({n_prompt + extra}) are more than the "
        f"{window.tokens} tokens the {role} model can attend to ({window.source}); shorten the prompt, "
        f"or set allow_beyond_context to run past the window the model was trained for")
