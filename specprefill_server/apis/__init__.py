"""The HTTP APIs, one package each with the same files: ``types`` (the request bodies),
``convert`` (a request to the job spec's fields), ``reply`` (a result as the API's answer and
its stream of events) and ``routes`` (the endpoints). What they share sits beside them:
``parse``, ``extension``, ``conversation``, ``answering``, ``errors``, ``stream_events``."""
