"""The HTTP front door: an OpenAI-compatible API (chat completions, completions, the Batch
API), Prometheus metrics and a web page, turning requests into jobs through the Python
client (``jobs.client``). ``specprefill serve`` runs it; :func:`create_app` builds it."""
from specprefill_server.app import create_app

__all__ = ["create_app"]
