"""Low-rank adapters (LoRA) beside a model's linear layers, laid out like the layers they adapt.

A weight ``W`` of ``in`` x ``out`` dimensions gets two trainable matrices beside it, ``A (in...,
r)`` and ``B (r, out...)``, and the layer computes ``x W + (alpha / r) * (x A) B`` (Hu et al.,
2021). ``B`` starts at zero, so a fresh adapter changes nothing: the first step's logits are
the base model's, bit for bit. ``A`` starts as PEFT's does (Kaiming-uniform, bound
``1 / sqrt(fan_in)``).

Adapters attach to a built model (:func:`attach`), found by the path of the weight they adapt:

- ``nnx.Linear`` and ``nnx.Einsum`` layers, called as layers: the layer becomes its
  LoRA-aware subclass (:class:`LoRALinear`, :class:`LoRAEinsum`: same state, same path, one
  child ``lora_kernel`` more) whose call adds the adapter's output (``lora_dropout`` applies
  to the adapter's input here, under :func:`dropout_key`);
- a weight a module multiplies itself (a chunked MLP, a mixture's stacked experts): the
  module reads it through :func:`weight` (``W + (alpha / r) A B``, folded at use) or
  :func:`adapter`, and declares it in a class attribute ``lora_weights = {"w1": (n_in,
  n_out)}``: its last ``n_in + n_out`` dimensions are the input and output, every dimension
  before them (stacked layers, experts) gets an adapter of its own. That is the hook for a
  module of your own (docs/own-model.md).

Layout: ``A`` carries the logical names of the weight's input dimensions, ``B`` those of its
output dimensions, the rank none (whole on every device), and both the weight's leading
names (``layers``, ``expert``), so the rules shard an adapter like its layer on every mesh:
``fsdp``, ``model``, ``context``, ``expert`` and ``stage`` alike. Adapters are
``nnx.LoRAParam`` (an ``nnx.Param``), float32 whatever the base's dtype.

Why not ``nnx.LoRA``/``nnx.LoRALinear``: they hold two-dimensional ``(in, r)``/``(r, out)``
matrices only and have no ``alpha`` scale or dropout; an attention projection here is a
three-dimensional ``nnx.Einsum`` kernel and a mixture's experts a stacked ``(E, in, out)``
weight, both adapted in their own layout (no reshapes that would lose the logical names).
The variable type is flax's own ``nnx.LoRAParam``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscale.errors import ConfigError
from nnxscale.layers.stack import STACKED_AXES
from nnxscale.sharding.rules import LOGICAL_KEY

#: The attribute prefix of an adapter: the adapter of weight ``kernel`` is the child ``lora_kernel``.
PREFIX = "lora_"

_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("nnxscale_lora_off", default=False)
_KEY: contextvars.ContextVar[Optional[jax.Array]] = contextvars.ContextVar("nnxscale_lora_key", default=None)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how: ``rank`` r, ``alpha`` (the output is scaled ``alpha / rank``),
    ``dropout`` on the adapters' inputs in training, and ``targets``: weight paths or their
    dotted suffixes (``"q_proj"``, ``"mlp.c_proj"``, ``"block_sparse_moe.w1"``); a target
    matches every weight whose path is it or ends with ``"." + target``."""

    rank: int
    alpha: float
    targets: Optional[tuple[str, ...]]  # None: every adaptable weight of the stacked layers
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


@contextlib.contextmanager
def disabled():
    """Within the block every adapter adds nothing: the model computes its base's outputs
    (no second copy of the weights; a DPO reference under LoRA). Decided when a function is
    traced: enter it inside the traced function (or around the whole ``jit`` call)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


@contextlib.contextmanager
def dropout_key(key: Optional[jax.Array]):
    """Within the block adapters with ``dropout > 0`` drop their inputs with keys from ``key``
    (``None``: no dropout, as in evaluation). Each adapter folds in its own index."""
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


class Adapter(nnx.Module):
    """``A`` and ``B`` of one weight: ``a (lead..., in..., r)``, ``b (lead..., r, out...)``.

    ``delta(x)`` is ``scale * (x A) B`` for a layer's input (``eq_a``/``eq_b``: the einsums of
    the two products); ``merged_delta()`` is ``scale * A B`` in the weight's own shape."""

    def __init__(self, a: nnx.LoRAParam, b: nnx.LoRAParam, *, scale: float, n_in: int, n_out: int, eq_a: str = "",
                 eq_b: str = "", dropout: float = 0.0, index: int = 0):  # fmt: skip
        self.a, self.b = a, b
        self.scale, self.n_in, self.n_out = scale, n_in, n_out
        self.eq_a, self.eq_b = eq_a, eq_b
        self.dropout, self.index = dropout, index

    def delta(self, x, dtype=None, *, a=None, b=None):
        """``scale * (x A) B`` in ``dtype`` (default ``x``'s); ``a``/``b`` replace the
        adapter's own matrices (a slice of them, in a chunked MLP)."""
        dtype = dtype or x.dtype
        a = (self.a[...] if a is None else a).astype(dtype)
        b = (self.b[...] if b is None else b).astype(dtype)
        x = x.astype(dtype)
        key = _KEY.get()
        if self.dropout > 0 and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.index), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(dtype)
        return (jnp.einsum(self.eq_b, jnp.einsum(self.eq_a, x, a), b) * self.scale).astype(dtype)

    def merged_delta(self):
        """``scale * A B`` float32, shaped like the weight (leading dimensions included)."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        lead = a.ndim - self.n_in - 1
        letters = "abcdefghijklmnopqstuvwxyz"
        L, I, O = letters[:lead], letters[lead : lead + self.n_in], letters[lead + self.n_in : lead + self.n_in + self.n_out]
        return jnp.einsum(f"{L}{I}r,{L}r{O}->{L}{I}{O}", a, b) * self.scale


def adapter(module: nnx.Module, name: str = "kernel") -> Optional[Adapter]:
    """The adapter of ``module``'s weight ``name``, or ``None`` (none attached, or within :func:`disabled`)."""
    if _OFF.get():
        return None
    return getattr(module, PREFIX + name, None)


def weight(module: nnx.Module, name: str = "kernel"):
    """``module``'s weight ``name`` with its adapter folded in (``W + scale * A B``, in the
    weight's dtype), or the weight itself when it has no adapter."""
    w = getattr(module, name)[...]
    a = adapter(module, name)
    if a is None:
        return w
    return (w.astype(jnp.float32) + a.merged_delta()).astype(w.dtype)


class LoRALinear(nnx.Linear):
    """``nnx.Linear`` with an adapter (child ``lora_kernel``): ``y = x W + b + scale (x A) B``."""

    def __call__(self, inputs):
        y = super().__call__(inputs)
        a = adapter(self)
        return y if a is None else y + a.delta(inputs, y.dtype)


class LoRAEinsum(nnx.Einsum):
    """``nnx.Einsum`` with an adapter (child ``lora_kernel``)."""

    def __call__(self, inputs, einsum_str=None):
        y = super().__call__(inputs, einsum_str)
        a = adapter(self)
        return y if a is None else y + a.delta(inputs, y.dtype)


_LAYERS = {nnx.Linear: LoRALinear, nnx.Einsum: LoRAEinsum}


def _einsum_geometry(einsum_str: str) -> Optional[tuple[int, int, str, str]]:
    """``(n_in, n_out, eq_a, eq_b)`` of an ``nnx.Einsum`` whose kernel is its input
    dimensions then its output dimensions (``"btc,cnh->btnh"``), else ``None``."""
    s = einsum_str.replace(" ", "")
    if "..." in s or s.count(",") != 1 or "->" not in s:
        return None
    lhs, out = s.split("->")
    inp, ker = lhs.split(",")
    ins = "".join(c for c in ker if c in inp and c not in out)
    outs = "".join(c for c in ker if c in out and c not in inp)
    if ker != ins + outs or not ins or not outs:
        return None
    r = next(c for c in "rzyxwvuqponmlkjihgfedcba" if c not in s)
    batch = "".join(c for c in inp if c not in ker)
    return len(ins), len(outs), f"{inp},{ins}{r}->{batch}{r}", f"{batch}{r},{r}{outs}->{out}"


def _geometry(module: nnx.Module, name: str) -> Optional[tuple[int, int, str, str]]:
    """``(n_in, n_out, eq_a, eq_b)`` of ``module``'s weight ``name``, or ``None`` if not adaptable."""
    declared = getattr(type(module), "lora_weights", {}) or {}
    if name in declared:
        n_in, n_out = declared[name]
        return int(n_in), int(n_out), "", ""
    if name != "kernel":
        return None
    if type(module) in (nnx.Linear, LoRALinear):
        return 1, 1, "...i,ir->...r", "...r,ro->...o"
    if type(module) in (nnx.Einsum, LoRAEinsum):
        return _einsum_geometry(module.einsum_str)
    return None


def adaptable(model: nnx.Module) -> dict[str, tuple[nnx.Module, str]]:
    """``{dotted path: (module, weight name)}`` of every weight :func:`attach` can adapt."""
    found = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or isinstance(node, Adapter):
            continue
        prefix = ".".join(str(p) for p in path)
        names = ["kernel"] + list(getattr(type(node), "lora_weights", {}) or {})
        for name in dict.fromkeys(names):
            if isinstance(getattr(node, name, None), nnx.Variable) and _geometry(node, name) is not None:
                where = prefix if name == "kernel" and type(node) in (*_LAYERS, *_LAYERS.values()) else f"{prefix}.{name}"
                found[where.lstrip(".")] = (node, name)
    return found


def stacked_weights(model: nnx.Module) -> dict[tuple, tuple[int, int]]:
    """``{state path: (n_in, n_out)}`` of every adaptable weight of ``model``'s stacked layers
    (what adapters attach to by default, and what ``--quantize-base`` stores quantized): the
    path of the weight's value in ``nnx.state(model)``, its input and output dimension counts."""
    paths = {id(node): tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)}
    out = {}
    for module, name in adaptable(model).values():
        var = getattr(module, name)
        if _stacked(var) and id(var) in paths:
            n_in, n_out, _, _ = _geometry(module, name)
            out[paths[id(var)]] = (n_in, n_out)
    return out


def stacked_layers(model: nnx.Module) -> list[nnx.Module]:
    """The ``nnx.Linear`` and ``nnx.Einsum`` layers (adapted ones included) of ``model``'s
    stacked layers, or every one of them where no layer is stacked (``--fp8`` runs their products)."""
    layers = [m for m, name in adaptable(model).values() if name == "kernel" and isinstance(m, (nnx.Linear, nnx.Einsum))]
    stacked = [m for m in layers if _stacked(m.kernel)]
    return stacked or layers


def matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def _kaiming_uniform(key, shape, fan_in: int, dtype):
    bound = 1.0 / math.sqrt(fan_in)  # PEFT's default: kaiming_uniform_(a=sqrt(5)) on (r, in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _stacked(v: nnx.Variable) -> bool:
    return (v.get_metadata().get(LOGICAL_KEY) or (None,))[0] in STACKED_AXES


def attach(model: nnx.Module, spec: LoraSpec, *, key: jax.Array) -> nnx.Module:
    """Add an adapter beside every weight of ``model`` that ``spec.targets`` names; returns
    ``model`` (changed in place). ``key`` draws the ``A`` matrices.

    Raises ConfigError naming a target that matches no adaptable weight, with the paths there are.
    """
    found = adaptable(model)
    if spec.targets is None:  # every adaptable weight of the stacked layers (all of them, when none is stacked)
        stacked = [p for p, (m, n) in found.items() if _stacked(getattr(m, n))]
        chosen = stacked or list(found)
    else:
        chosen = [p for p in found if any(matches(p, t) for t in spec.targets)]
    for t in spec.targets or ():
        if not any(matches(p, t) for p in found):
            raise ConfigError(f"--lora-targets {t!r} names no linear layer of the model; it has: {', '.join(found) or 'none'}")
    for index, path in enumerate(chosen):
        module, name = found[path]
        n_in, n_out, eq_a, eq_b = _geometry(module, name)
        w = getattr(module, name)
        value = w.get_value()
        shape = tuple(value.shape)
        lead = len(shape) - n_in - n_out
        if lead < 0:
            raise ConfigError(f"{path}: weight of shape {shape} has fewer than the {n_in} + {n_out} dimensions declared")
        names = tuple(w.get_metadata().get(LOGICAL_KEY) or (None,) * len(shape))
        L, I, O = slice(0, lead), slice(lead, lead + n_in), slice(lead + n_in, None)
        a_shape = shape[L] + shape[I] + (spec.rank,)
        b_shape = shape[L] + (spec.rank,) + shape[O]
        a = _kaiming_uniform(jax.random.fold_in(key, index), a_shape, math.prod(shape[I]), jnp.float32)
        meta = dict(weight_decay=True)
        a_var = nnx.LoRAParam(a, **{LOGICAL_KEY: names[L] + names[I] + (None,)}, **meta)
        b_var = nnx.LoRAParam(jnp.zeros(b_shape, jnp.float32), **{LOGICAL_KEY: names[L] + (None,) + names[O]}, **meta)
        if type(module) in _LAYERS and name == "kernel":
            module.__class__ = _LAYERS[type(module)]
        setattr(module, PREFIX + name, Adapter(a_var, b_var, scale=spec.scale, n_in=n_in, n_out=n_out, eq_a=eq_a, eq_b=eq_b,
                                               dropout=spec.dropout, index=index))  # fmt: skip
    model.lora_dropout = float(spec.dropout)  # static: the model asks for dropout keys when positive (dropout_rate)
    return model


def adapted(model: nnx.Module) -> list[tuple[str, nnx.Module, str, Adapter]]:
    """``(path of the adapted module, module, weight name, adapter)`` of every adapter of ``model``."""
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and not isinstance(node, Adapter):
            for attr, child in list(vars(node).items()):
                if isinstance(child, Adapter) and attr.startswith(PREFIX):
                    out.append((".".join(str(p) for p in path), node, attr[len(PREFIX) :], child))
    return out


def merge_into_base(model: nnx.Module) -> None:
    """Fold every adapter into its weight (``W + scale A B``, in the weight's dtype) and
    remove the adapters: ``model`` becomes a plain model of its family (in place)."""
    for _, module, name, a in adapted(model):
        w = getattr(module, name)
        w.set_value((w.get_value().astype(jnp.float32) + a.merged_delta()).astype(w.get_value().dtype))
        delattr(module, PREFIX + name)
        for base, lora_type in _LAYERS.items():
            if type(module) is lora_type:
                module.__class__ = base


def merge_params(base: dict, adapters: dict) -> dict:
    """The union of two nested dicts of disjoint leaves: the model's parameters again, from a
    LoRA run's frozen base and its adapters (:func:`nnxscale.training.adapters.split_params`
    splits them)."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = merge_params(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dropout_rate(model: nnx.Module) -> float:
    """The adapters' dropout rate of a model :func:`attach` adapted (0 otherwise): a model
    asks for per-layer keys when it is positive, and runs each layer under :func:`dropout_key`."""
    return float(getattr(model, "lora_dropout", 0.0) or 0.0)
