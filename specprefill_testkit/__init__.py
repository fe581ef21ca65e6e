"""What the tests and the benchmarks share: tiny models of every family, their independent
references (float64 attention oracle, true-position logits), random model folders, and the
Redis servers (cluster, sentinel) they start on free ports.

A package of the source checkout, like ``bench`` and ``tests``: setup.py leaves it out of the
wheel (a service install has no use for random models or throwaway Redis servers); its prefixed
name shadows nothing on the path.
"""
