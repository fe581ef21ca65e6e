"""``specprefill serve``: the OpenAI-compatible HTTP server, metrics and web page (package ``specprefill_server``)."""
from __future__ import annotations

from typing import Any

from specprefill_cli.options import SharedOptions


def register(sub: Any, shared: SharedOptions) -> None:
    from specprefill_server.cli import register as register_serve

    register_serve(sub, shared.url)
