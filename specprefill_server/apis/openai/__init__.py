"""OpenAI's chat completions and completions (``/v1/chat/completions``, ``/v1/completions``)."""
