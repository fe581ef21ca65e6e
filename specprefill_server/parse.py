"""One parser for every API's request body: a JSON object validated strictly into a pydantic
model, the first problem a 400 naming its field (``messages[0].content``) with OpenAI's
error code (the Anthropic paths reshape it: :meth:`errors.APIError.response`)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from specprefill_server.errors import APIError


class Unsupported(ValueError):
    """A field whose value this service cannot honour (code ``unsupported_value``)."""

    code = "unsupported_value"


class UnsupportedParameter(Unsupported):
    """A field this service cannot honour at all (code ``unsupported_parameter``)."""

    code = "unsupported_parameter"


def refuse_given(request: BaseModel, reasons: dict[str, str]) -> None:
    """Refuse the first field of ``reasons`` the request gives (not null), naming why: a field
    of the official API that this service cannot honour (docs/http.md says each one's why)."""
    for name, why in reasons.items():
        if getattr(request, name, None) is not None:
            raise UnsupportedParameter(f"{name}: not supported here ({why})")


# Names pydantic puts in an error's location for the member of a union it tried.
_UNION_TAGS = ("str", "int", "float", "bool", "none")
_UNION_TAG_PREFIXES = ("list[", "dict[", "tuple[", "function-")


def _loc(loc: tuple) -> str:
    """A field path as a request names it: ``messages[0].content``."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i == 0 or not (part in _UNION_TAGS or str(part).startswith(_UNION_TAG_PREFIXES)):
            out += ("." if out else "") + str(part)
    return out


def _code(kind: str) -> str:
    """OpenAI's error code for a pydantic error type."""
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith(("_type", "_parsing")):
        return "invalid_type"
    return "invalid_value"


def validation_error(exc: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming its field."""
    err = exc.errors()[0]
    field = _loc(tuple(err.get("loc", ())))
    msg, kind = err.get("msg", "invalid"), err.get("type", "")
    if kind == "extra_forbidden":
        return APIError(400, f"{field}: unknown field", param=field, code=_code(kind))
    if kind == "value_error":  # our own checks say "field: reason"
        error = err.get("ctx", {}).get("error", msg)
        text = str(error)
        name = text.split(":", 1)[0] if ":" in text else field or None
        return APIError(400, text, param=name, code=getattr(error, "code", "invalid_value"))
    if kind.endswith("_type") and "input" in err:  # say what came, as JSON spells it
        msg = f"{msg}, got {_json_type(err['input'])}"
    return APIError(400, f"{field or 'body'}: {msg}", param=field or None, code=_code(kind))


def _json_type(value: Any) -> str:
    """The JSON type of a parsed JSON value, as an error message names it."""
    if value is None:
        return "null"
    for kinds, name in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
                        (list, "an array"), (dict, "an object")):
        if isinstance(value, kinds):
            return name
    return type(value).__name__


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body into ``model`` or raise a 400 :class:`APIError`.

    Strict: a value of the wrong JSON type is refused, never converted (lax parsing took
    ``max_tokens: true`` as 1 and ``stream: "yes"`` as true); an integer is still a number."""
    if not isinstance(body, dict):
        raise APIError(400, "body: expected a JSON object", code="invalid_type")
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None
