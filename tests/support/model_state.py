"""Test helper: a snapshot of everything scoring must leave untouched on a model."""
from __future__ import annotations

import mlx.nn as nn
from mlx.utils import tree_flatten


def model_state(model: nn.Module) -> list:
    """Module tree (names, identities, member order, plain attributes) and parameter identities."""
    state = []
    for name, module in model.named_modules():
        plain = {k: id(v) for k, v in vars(module).items()}
        state.append((name, type(module), id(module), tuple(module.keys()), tuple(sorted(plain.items()))))
    state.append(tuple((k, id(v)) for k, v in tree_flatten(model.parameters())))
    return state
