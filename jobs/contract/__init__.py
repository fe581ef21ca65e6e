"""The job contract: what a client and a worker agree on, as data (no Redis calls here).

- :mod:`jobs.contract.spec`: the job spec and its validation (``Limits`` from the settings),
  the same on both sides of the queue; :mod:`jobs.contract.conversation`: a chat job's messages.
- :mod:`jobs.contract.heal`: the heal job's spec; :mod:`jobs.contract.model_names`: what a job
  calls a model and what a worker loads for that name.
- :mod:`jobs.contract.results`: what jobs return; :mod:`jobs.contract.layout`: a finished job's
  prompt as regions of token positions.
- :mod:`jobs.contract.keys`: every Redis key and channel the queue's side writes.
"""
