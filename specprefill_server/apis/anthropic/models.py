"""``GET /v1/models`` and ``/v1/models/{id}`` in Anthropic's format, for a request that carries
the ``anthropic-version`` header (``errors.speaks_anthropic``; every Anthropic SDK sends it): a
page ``{"data", "has_more", "first_id", "last_id"}`` of ``{"type": "model", "id", "display_name",
"created_at", ...}`` entries, with Anthropic's cursors (``after_id``, ``before_id``) and
``limit`` (1-1000, 20 by default). The entries are the OpenAI listing's (the models a live
worker serves), in its order, with the window as Anthropic's ModelInfo says it:
``max_input_tokens`` (the context window the model's config declares) and ``max_tokens`` (the
most one answer may generate: ``max_generate_tokens``, within that window).
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

from specprefill_server.errors import APIError

LIMIT_DEFAULT, LIMIT_MAX = 20, 1000  # Anthropic's


def model_info(entry: dict[str, Any], max_generate_tokens: int) -> dict[str, Any]:
    """One OpenAI model entry (``web.data.models_list``) as an Anthropic ModelInfo."""
    created = datetime.fromtimestamp(entry["created"], tz=timezone.utc)
    info = {"type": "model", "id": entry["id"], "display_name": entry["id"],
            "created_at": created.isoformat().replace("+00:00", "Z"), "lifecycle": "active",
            "specprefill": entry["specprefill"]}
    if window := entry.get("context_window"):
        info.update(max_input_tokens=window, max_tokens=min(max_generate_tokens, window))
    return info


def _limit(query: Mapping[str, str]) -> int:
    raw = query.get("limit")
    if raw is None:
        return LIMIT_DEFAULT
    if not raw.isdigit() or not 1 <= int(raw) <= LIMIT_MAX:
        raise APIError(400, f"limit: expected an integer from 1 to {LIMIT_MAX}, got {raw[:40]!r}", param="limit")
    return int(raw)


def _cursor(ids: list[str], query: Mapping[str, str], name: str) -> int | None:
    """The index of the model a cursor names (None without one); a 400 naming it if unknown."""
    value = query.get(name)
    if value is None:
        return None
    if value not in ids:
        raise APIError(400, f"{name}: no model {value[:200]!r} in the list", param=name)
    return ids.index(value)


def models_page(listing: dict[str, Any], query: Mapping[str, str], max_generate_tokens: int) -> dict[str, Any]:
    """The page of Anthropic ModelInfo entries that ``query``'s cursors and limit select."""
    entries = [model_info(e, max_generate_tokens) for e in listing["data"]]
    ids = [e["id"] for e in entries]
    limit = _limit(query)
    after, before = _cursor(ids, query, "after_id"), _cursor(ids, query, "before_id")
    if after is not None and before is not None:
        raise APIError(400, "before_id: give after_id or before_id, not both", param="before_id")
    if before is not None:  # the page just before that model: more lie further back
        start = max(0, before - limit)
        page, has_more = entries[start:before], start > 0
    else:
        start = 0 if after is None else after + 1
        page, has_more = entries[start:start + limit], start + limit < len(entries)
    return {"data": page, "has_more": has_more, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}
