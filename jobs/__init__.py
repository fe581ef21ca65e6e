"""The job contract and the client library (imports nothing from ``worker``).

- :mod:`jobs.settings`: the one configuration object; :mod:`jobs.spec`: job specs and their
  validation (``Limits`` from the settings); :mod:`jobs.results`: what jobs return.
- :mod:`jobs.keys`: every Redis key and channel the queue's side writes.
- :mod:`jobs.progress`: progress events (publisher, subscriber, batch view).
- :mod:`jobs.settings_check`: start-up checks of the settings, unknown variables, ``.env``.
- :mod:`jobs.holders`: who holds a shared job, and when a cancel stops it;
  :mod:`jobs.rate`: a batch's smoothed tokens/s.
- :mod:`jobs.client`: submit, follow and cancel jobs; :mod:`jobs.connection`: Redis clients
  and their one retry layer; :mod:`jobs.deadline`: the one deadline of a timeout.
"""
