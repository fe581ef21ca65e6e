"""The tools a request offers, as the prompt gets them (every API's ``convert`` fills one).

* offered: function tools the target's chat template renders (into the system block);
* deferred (``defer_loading``): kept out of the prompt until a tool reference in the
  conversation loads one, and then rendered there, where it was loaded (as Anthropic's tool
  search does: the prompt's start, and so the KV a worker restores for it, does not change
  when a tool loads);
* left out: tools this server cannot run or render (a provider's built-in web search, code
  execution, MCP connectors, ...), each with a note the answer's warnings carry (and the log),
  never a 400: the rest of the request is answered as asked.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specprefill_server.errors import bad_request


@dataclass
class ToolSet:
    """A request's tools: offered, deferred by name, and notes on the ones left out."""

    offered: list[dict[str, Any]] = field(default_factory=list)
    deferred: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, tool: dict[str, Any], *, deferred: bool = False) -> None:
        """A function tool (``{"type": "function", "function": {...}}``), offered or deferred."""
        if deferred:
            self.deferred[tool["function"]["name"]] = tool
        else:
            self.offered.append(tool)

    def leave_out(self, where: str, kind: Any, why: str) -> None:
        self.notes.append(f"{where} ({str(kind)[:80]}): {why}; left out of the prompt")

    def definition(self, name: Any, where: str) -> str:
        """The text a tool reference loads: the tool's definition as the template's tools
        list shows one (its JSON); 400 naming ``where`` when the request has no such tool."""
        known = {t["function"]["name"]: t for t in self.offered} | self.deferred
        if not isinstance(name, str) or name not in known:
            raise bad_request(f"{where}: no tool {str(name)[:80]!r} in the request's tools", where)
        return json.dumps(known[name], ensure_ascii=False)
