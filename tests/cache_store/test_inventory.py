"""The store's counters as metrics read them: summed per model name and role (fakeredis)."""
import json

import fakeredis

from cache_store.inventory import counters_by_name
from cache_store.keys import models_key, stats_key


def test_counters_add_up_per_model_name_and_role():
    r = fakeredis.FakeRedis()
    # one draft under two fingerprints (two block formats), the same weights as a target,
    # a model named by a worker's folder, and a fingerprint no worker recorded
    labels = {"fp-a": {"model": "local:1", "name": "draft", "role": "draft"},
              "fp-b": {"model": "local:1", "name": "draft", "role": "draft"},
              "fp-c": {"model": "local:1", "name": "draft", "role": "target"},
              "fp-d": {"model": "local:2", "name": "/srv/secret/qwen", "role": "draft"}}
    for fp, label in labels.items():
        r.hset(models_key("ns"), fp, json.dumps(label))
        r.hset(stats_key("ns", fp), mapping={"lookups": 2, "hit_blocks": 1})
    r.hset(stats_key("ns", "f" * 64), mapping={"lookups": 5})
    got = counters_by_name(r, "ns", show=lambda name: name.rsplit("/", 1)[-1])
    assert got == {("draft", "draft"): {"lookups": 4, "hit_blocks": 2},
                   ("draft", "target"): {"lookups": 2, "hit_blocks": 1},
                   ("qwen", "draft"): {"lookups": 2, "hit_blocks": 1},
                   ("fingerprint:" + "f" * 16, "unknown"): {"lookups": 5}}
