"""The HTTP front door: OpenAI's chat completions, completions, Responses and Batch APIs and
Anthropic's Messages API (``apis/<api>/``, ``batch/``), Prometheus metrics and a web page
(``web/``), turning requests into jobs through the Python client (``jobs.client``).
``specprefill serve`` runs it; :func:`create_app` builds it."""
from specprefill_server.app import create_app

__all__ = ["create_app"]
