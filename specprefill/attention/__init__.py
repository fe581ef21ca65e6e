"""Attention capture at the kernel, for every mlx-lm family: exact importance or a refusal.

The serving path of drafts (through :mod:`specprefill.profile` and :mod:`specprefill.scoring`)
and targets (through :mod:`specprefill.sparse`). Modules:

* :mod:`.kernel` records each attention computation where the probabilities are made (the
  ``scaled_dot_product_attention`` name in a family's module, or the ``softmax`` of a family that
  writes attention by hand), attributed to its decoder layer;
* :mod:`.probe` verifies a model once at load and returns its :class:`~.probe.AttentionProfile`
  (which layers vote, which are recurrent) or refuses it naming the variant;
* :mod:`.importance` turns recorded calls into importance (sinks, masks, quantized keys);
* :mod:`.caches` snapshots, restores and converts every mlx-lm cache type (hybrid caches);
* :mod:`.lookahead` is the scorer built from the above (prefill, the captured lookahead steps,
  importance; :mod:`specprefill.scoring` is its validated front door);
* :mod:`.target` is what sparse prefill needs per family (positions, query scales, windows).
"""
