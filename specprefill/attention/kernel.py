"""Record every attention computation of a model at its kernel, attributed to a decoder layer.

Every mlx-lm 0.32 family but one computes attention probabilities inside
``mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask,
sinks)``, which each family module imports into its own namespace. Replacing that name in the
family's module for the duration of a capture hands over the queries exactly as the kernel
gets them (after every projection, norm, rotary, gate split or position-dependent scale the
family applies, whatever they are), the keys the kernel attends over (the cache's, another
layer's for shared-KV layers, MLA's latents), the scale, the mask (MLA passes its rope scores
there) and the sinks. Nothing upstream needs to be modelled, so nothing upstream can be
modelled wrongly.

Families that write attention by hand are listed in :data:`HAND_WRITTEN` with the op that
makes their probabilities; gemma2 calls ``mx.softmax`` on logits its own code scaled and
soft-capped, so its module gets a stand-in ``mx`` whose ``softmax`` records those logits.

Each decoder layer is wrapped for the capture so a record knows its layer (and the cache the
layer was given), which also tells attention layers from recurrent ones.

mlx-lm's quantized attention multiplies ``queries`` in place (``queries *= scale``), which
rebinds the caller's array object: the tap records a distinct array object made before the
call, so a recorded query is never scaled twice.
"""
from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from specprefill.wrapping import Wrapper, unwrap_rope

KERNEL_NAME = "scaled_dot_product_attention"
# Family modules whose attention probabilities come from an op of their own, by op name.
HAND_WRITTEN: dict[str, str] = {"mlx_lm.models.gemma2": "softmax"}


@dataclass
class KernelCall:
    """One attention computation, as the kernel received it."""

    layer: int
    kind: str                       # "sdpa" or "softmax"
    queries: mx.array | None        # (B, Hq, L, D) before the kernel ran (sdpa)
    n_keys: int                     # keys the computation attends over
    scale: float = 1.0
    mask: Any = None                # None, "causal", a bool array or an additive array
    sinks: mx.array | None = None   # (Hq,) logits that join every softmax denominator
    quantized: tuple[int, int] | None = None  # (group_size, bits) of a quantized cache
    keys: Any = None                # the keys, kept only when asked (``keep_keys``)
    logits: mx.array | None = None  # softmax calls: (..., L, S) logits the layer computed
    values: Any = None              # probe only
    output: mx.array | None = None  # probe only
    kernel: Callable | None = None  # probe only: the family's genuine kernel function

    def arrays(self) -> list[mx.array]:
        """Arrays to evaluate with the step that made them (so they let go of their inputs)."""
        found = [self.queries, self.sinks, self.logits, self.output]
        if isinstance(self.mask, mx.array):
            found.append(self.mask)
        return [a for a in found if isinstance(a, mx.array)]


@dataclass
class KernelCapture:
    """What a capture recorded, and the switches the caller flips between forward passes."""

    recording: bool = False
    keep_keys: bool = False         # keep the kernel's keys (the last scored step needs them)
    probe: bool = False             # also keep values and the kernel's output
    calls: list[KernelCall] = field(default_factory=list)
    layer_caches: dict[int, Any] = field(default_factory=dict)  # layer -> cache it was last given
    layer_calls: dict[int, int] = field(default_factory=dict)   # layer -> forward passes seen
    softmax_outside: list[tuple[int, tuple]] = field(default_factory=list)  # probe: stray softmaxes
    unattributed: int = 0           # kernel calls while recording, outside every decoder layer's call
    current_layer: int | None = None
    in_kernel: bool = False

    def record(self, call: KernelCall) -> None:
        self.calls.append(call)

    def pending_arrays(self, since: int = 0) -> list[mx.array]:
        return [a for c in self.calls[since:] for a in c.arrays()]


class _LayerTap(Wrapper):
    """A decoder layer that tells the capture which layer is running, and with what cache."""

    def __init__(self, genuine: nn.Module, index: int, capture: KernelCapture):
        super().__init__(genuine)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_capture", capture)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        capture, index = self._capture, self._index
        if capture.recording:
            capture.layer_calls[index] = capture.layer_calls.get(index, 0) + 1
            capture.layer_caches[index] = kwargs.get("cache", _positional_cache(args))
        previous, capture.current_layer = capture.current_layer, index
        try:
            return self.genuine(*args, **kwargs)
        finally:
            capture.current_layer = previous


def _positional_cache(args: tuple) -> Any:
    """The cache a layer got positionally: mlx-lm layers take (x, mask, cache) or (x, cache, ...)."""
    for a in args[1:]:
        if hasattr(a, "update_and_fetch") or hasattr(a, "caches") or hasattr(a, "cache"):
            return a
    return None


def _key_count(keys: Any) -> int:
    first = keys[0] if isinstance(keys, (tuple, list)) else keys
    return int(first.shape[-2])


def _distinct(arrays: Any) -> Any:
    """Distinct array objects: a full rotating cache overwrites its buffer in place on the next step."""
    if isinstance(arrays, (tuple, list)):
        return tuple(mx.array(a) for a in arrays)
    return mx.array(arrays)


# Caches that only append: the keys they hand the kernel are a view of their buffer that no
# later step overwrites, so the capture keeps that view instead of a copy of every layer's keys.
APPEND_ONLY_CACHES = ("KVCache", "QuantizedKVCache")


def _kept_keys(keys: Any, cache: Any) -> Any:
    return keys if type(cache).__name__ in APPEND_ONLY_CACHES else _distinct(keys)


def _sdpa_tap(genuine: Callable, capture: KernelCapture) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        layer = capture.current_layer
        if capture.recording and layer is None and not capture.in_kernel:
            capture.unattributed += 1  # a forward that runs its layers' parts itself (iquestloopcoder)
        if not capture.recording or layer is None or capture.in_kernel:
            return genuine(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        recorded = mx.array(queries)  # a distinct object: the quantized kernel scales `queries` in place
        quantized = (int(cache.group_size), int(cache.bits)) if hasattr(cache, "bits") else None
        capture.in_kernel = True
        try:
            out = genuine(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        finally:
            capture.in_kernel = False
        capture.record(KernelCall(
            layer, "sdpa", recorded, _key_count(keys), float(scale), mask, sinks, quantized,
            keys=_kept_keys(keys, cache) if capture.keep_keys else None,
            values=_distinct(values) if capture.probe else None, output=out if capture.probe else None,
            kernel=genuine if capture.probe else None))
        return out

    scaled_dot_product_attention.genuine = genuine
    return scaled_dot_product_attention


class _MxWithRecordingSoftmax:
    """Stands in for ``mlx.core`` in a hand-written family's module: records attention softmaxes."""

    def __init__(self, capture: KernelCapture, record_as_kernel: bool):
        self._capture = capture
        self._record_as_kernel = record_as_kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def softmax(self, x, *args, **kwargs):
        out = mx.softmax(x, *args, **kwargs)
        capture, layer = self._capture, self._capture.current_layer
        axis = kwargs.get("axis", args[0] if args else -1)
        if not capture.recording or layer is None or capture.in_kernel or x.ndim < 4 or axis not in (-1, x.ndim - 1):
            return out
        if self._record_as_kernel:
            capture.record(KernelCall(layer, "softmax", None, int(x.shape[-1]), logits=x,
                                      output=out if capture.probe else None))
        else:
            capture.softmax_outside.append((layer, tuple(x.shape)))
        return out


def decoder_layers(model: nn.Module) -> tuple[list, int]:
    """The list that holds the model's decoder layers, and where ``model.layers[0]`` sits in it.

    ``model.layers`` is often a fresh slice (``pipeline_layers``), so replacing its items would
    change nothing: this finds the list the model iterates, by identity of its items.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise ValueError("model has no non-empty `layers` list of decoder layers")
    first = unwrap_rope(layers[0])
    for _, module in model.named_modules():
        for value in module.values():
            if isinstance(value, list) and any(unwrap_rope(x) is first for x in value):
                start = next(i for i, x in enumerate(value) if unwrap_rope(x) is first)
                if all(unwrap_rope(a) is unwrap_rope(b) for a, b in zip(value[start:], layers)):
                    return value, start
    raise ValueError("model: the list holding its decoder layers was not found")


def family_modules(model: nn.Module) -> list[ModuleType]:
    """The Python modules defining the model's classes (where its attention code lives)."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules]


@contextmanager
def _patched(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    original = module.__dict__[name]
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _genuine_kernel(value: Any) -> Any:
    while hasattr(value, "genuine"):  # a tap left by an aborted capture: never wrap it again
        value = value.genuine
    return value


@contextmanager
def kernel_capture(model: nn.Module, *, watch_softmax: bool = False) -> Iterator[KernelCapture]:
    """Install kernel taps and layer taps on ``model`` for the block; always removes them.

    ``watch_softmax`` (the load-time probe) also notes ≥4-D softmaxes that run in a layer
    outside any recognised kernel, which would be attention the capture cannot see.
    """
    capture = KernelCapture()
    holder, start = decoder_layers(model)
    genuine = [unwrap_rope(layer) for layer in holder[start:start + len(model.layers)]]
    modules = family_modules(model)
    try:
        for index, layer in enumerate(genuine):
            holder[start + index] = _LayerTap(layer, index, capture)
        with _install_kernels(modules, capture, watch_softmax):
            yield capture
    finally:
        holder[start:start + len(genuine)] = genuine


@contextmanager
def _install_kernels(modules: list[ModuleType], capture: KernelCapture, watch_softmax: bool) -> Iterator[None]:
    with ExitStack() as stack:
        for module in modules:
            kernel = module.__dict__.get(KERNEL_NAME)
            if callable(kernel):
                stack.enter_context(_patched(module, KERNEL_NAME, _sdpa_tap(_genuine_kernel(kernel), capture)))
            hand_written = module.__name__ in HAND_WRITTEN
            if module.__dict__.get("mx") is mx and (hand_written or watch_softmax):
                stack.enter_context(_patched(module, "mx", _MxWithRecordingSoftmax(capture, hand_written)))
        yield
