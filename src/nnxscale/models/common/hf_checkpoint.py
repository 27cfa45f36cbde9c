"""Hugging Face safetensors checkpoints, for every model family: read each device's slice
straight from the files, write HF's layout.

A family describes each of its parameters as the HF tensor(s) that hold it
(:class:`HFParam`) and how the two layouts relate (:class:`HFLayout`: HF's tensor with
some dimensions split, then transposed, is ours). This module does the file work: one
``model.safetensors`` or a sharded set named by ``model.safetensors.index.json``, names
checked against the model (missing, extra, wrong shape), and every array built with
``jax.make_array_from_callback``, so each device reads only its own slice and each process
only what its devices hold.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

from nnxscale.errors import ModelError, ModelFileNotFoundError
from nnxscale.sharding.state import is_variable
from nnxscale.sharding.state import state_shardings as shardings

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: safetensors dtype codes -> the parameter dtypes a checkpoint keeps (others load as float32).
PARAM_DTYPES = {"F32": "float32", "BF16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """HF's tensor reshaped so that dimension ``d`` becomes the sizes ``groups[d]``, then
    transposed by ``perm`` (``np.transpose`` order), is our tensor.

    E.g. Llama's ``q_proj.weight`` (N*H, C) is our (C, N, H): ``groups ((N, H), (C,))``,
    ``perm (2, 0, 1)``.
    """

    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @classmethod
    def same(cls, shape) -> "HFLayout":
        return cls(tuple((int(d),) for d in shape), tuple(range(len(shape))))

    @classmethod
    def transposed(cls, shape) -> "HFLayout":
        """A Linear kernel: ours (in, out), HF's (out, in)."""
        return cls(((int(shape[1]),), (int(shape[0]),)), (1, 0))

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.transpose(x, np.argsort(self.perm)).reshape(self.hf_shape))

    def read(self, sliced, index: tuple[slice, ...]) -> np.ndarray:
        """``ours[index]`` from a safetensors slice of the HF tensor, reading only the rows
        (and columns) that hold it."""
        view_index = [slice(None)] * len(self.perm)
        for ours, view in enumerate(self.perm):
            view_index[view] = index[ours]
        file_index, view_shape, inner, d = [], [], [], 0
        for group in self.groups:
            start, stop, step = view_index[d].indices(group[0])
            if step != 1:
                raise ModelError(f"cannot read a strided slice {view_index[d]} from a checkpoint")
            rest = math.prod(group[1:])
            file_index.append(slice(start * rest, stop * rest))
            view_shape += [stop - start, *group[1:]]
            inner += [slice(None), *view_index[d + 1 : d + len(group)]]
            d += len(group)
        block = np.asarray(sliced[tuple(file_index)]).reshape(view_shape)[tuple(inner)]
        return np.transpose(block, self.perm)


@dataclasses.dataclass(frozen=True)
class HFParam:
    """The HF tensor(s) of one parameter: one name, or for stacked layers one per layer
    (our leading ``layers`` axis), or with ``depth`` 2 one per layer and expert (leading
    ``(layers, experts)`` axes, keys in that order, row-major); ``layout`` relates each of
    them to ours."""

    keys: tuple[str, ...]
    layout: HFLayout
    stacked: bool = False
    depth: int = 1  # how many leading axes are stacked, when stacked


def key_part(k) -> str:
    """One element of a ``jax.tree_util`` key path as text (``'h'``, ``'kernel'``)."""
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def _short(names: list[str], most: int = 8) -> str:
    if len(names) <= most:
        return str(names)
    return f"{names[:most]} ... ({len(names)} in all)"


def read_config(path: Path, family: str) -> dict[str, Any]:
    """``path/config.json`` of an HF checkpoint directory, as a dict."""
    if not path.is_dir():
        raise ModelFileNotFoundError(f"no checkpoint directory at {path}")
    file = path / "config.json"
    if not file.is_file():
        raise ModelFileNotFoundError(
            f"{file} does not exist: an HF {family} directory holds config.json and {SINGLE} "
            f"(or {INDEX} and the files it names)"
        )
    try:
        config = json.loads(file.read_text())
    except ValueError as e:
        raise ModelError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{file} holds {type(config).__name__}, not an HF config (a JSON object)")
    return config


class SafetensorsFiles(contextlib.ExitStack):
    """The weights of an HF directory, opened for slicing: ``model.safetensors``, or the
    files that ``model.safetensors.index.json`` names. Use as a context manager."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)
        single, index = self.path / SINGLE, self.path / INDEX
        if single.is_file() and index.is_file():
            raise ModelError(f"{self.path} holds both {SINGLE} and {INDEX}: remove the stale one")
        if index.is_file():
            self.where = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ModelError(f"{index} is not a safetensors index (a JSON object with 'weight_map'): {e}") from None
            self._file_of = {str(k): self.path / str(v) for k, v in weight_map.items()}
            for file in sorted(set(self._file_of.values())):
                if not file.is_file():
                    raise ModelFileNotFoundError(f"{file} does not exist, but {index} names it")
        elif single.is_file():
            self.where = single
            self._file_of = None
        else:
            raise ModelFileNotFoundError(f"{self.path} holds neither {SINGLE} nor {INDEX}")
        self._open: dict[Path, Any] = {}

    def _handle(self, file: Path):
        if file not in self._open:
            self._open[file] = self.enter_context(safe_open(str(file), framework="numpy"))
        return self._open[file]

    def keys(self) -> list[str]:
        if self._file_of is None:
            return list(self._handle(self.where).keys())
        return list(self._file_of)

    def slice(self, key: str):
        file = self.where if self._file_of is None else self._file_of[key]
        handle = self._handle(file)
        if self._file_of is not None and key not in handle.keys():
            raise ModelError(f"{file} lacks the tensor {key!r} that {self.where} places there")
        return handle.get_slice(key)

    def tensor(self, key: str) -> np.ndarray:
        return np.asarray(self.slice(key)[:])

    def param_dtype(self, key: str) -> str:
        """The dtype a parameter stored as ``key`` keeps: float32 or bfloat16 (others: float32)."""
        return PARAM_DTYPES.get(self.slice(key).get_dtype(), "float32")


_LOADED: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar("nnxscale_loaded", default=None)


@contextlib.contextmanager
def transform_loaded(fn: Callable[[tuple, jax.Array], Any]):
    """Within it, every parameter :func:`load_state` reads passes through ``fn(path, array)``
    as soon as it is on its devices, before the next is read (``path``: the parameter's state
    path as text): ``--quantize-base`` quantizes each weight there, so the base is never on the
    devices whole in full precision."""
    token = _LOADED.set(fn)
    try:
        yield
    finally:
        _LOADED.reset(token)


def load_state(
    files: SafetensorsFiles,
    abstract,
    shardings,
    hf_param: Callable[[tuple, tuple[int, ...]], HFParam],
    names: Mapping[str, str],
    *,
    model_name: str,
):
    """The state ``abstract`` (from ``nnx.eval_shape``) filled from ``files``, placed by ``shardings``.

    ``hf_param(path, shape)`` names the HF tensors of each parameter; ``names`` maps every
    HF name the model may use to the key in the files (prefixes removed, buffers left out):
    it must hold exactly the names the model needs. Each device reads only its own slice
    (replicas read it once).
    """
    flat = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_variable)[0]
    params = {tuple(p): hf_param(p, tuple(v.get_value().shape)) for p, v in flat}
    expected = {k for param in params.values() for k in param.keys}
    if missing := sorted(expected - set(names), key=_natural):
        raise ModelError(f"{files.where} lacks the tensors {_short(missing)}")
    if extra := sorted(set(names) - expected, key=_natural):
        raise ModelError(f"{files.where} has tensors this {model_name} does not use: {_short(extra)}")

    def reader(key: str, layout: HFLayout, dtype):
        sliced = files.slice(names[key])
        stored = tuple(sliced.get_shape())
        if stored != layout.hf_shape:
            raise ModelError(
                f"{files.where}: tensor {names[key]!r} has shape {stored}, but this {model_name} expects "
                f"{layout.hf_shape}: does config.json describe these weights?"
            )
        return lambda index: layout.read(sliced, index).astype(dtype)

    def load(path, v, sharding):
        shape, dtype = v.get_value().shape, v.get_value().dtype
        param = params[tuple(path)]
        readers = [reader(k, param.layout, dtype) for k in param.keys]
        if param.stacked:  # this device's layers (and experts), each read in its own slice
            read = functools.partial(_read_stacked, readers, shape[: param.depth])
        else:
            read = readers[0]
        cache: dict = {}

        def callback(index):
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in cache:  # devices holding the same slice read it once
                cache[key] = read(index)
            return cache[key]

        transform, where = _LOADED.get(), tuple(key_part(k) for k in path)
        if transform is not None and param.stacked and getattr(transform, "layer_by_layer", lambda _: False)(where):
            return v.replace(_transformed_layers(transform, where, read, shape, sharding))
        array = jax.make_array_from_callback(shape, sharding, callback)
        if transform is not None:
            array = transform(where, array)
        return v.replace(array)

    return jax.tree_util.tree_map_with_path(load, abstract, shardings, is_leaf=is_variable)


def _transformed_layers(transform, path: tuple, read: Callable, shape: tuple[int, ...], sharding):
    """A stacked parameter read one layer at a time, each layer transformed as soon as it is
    on its devices (``transform(path, layer)``), joined by ``transform.stack(path, layers,
    sharding)``: only one layer is ever on the devices as read."""
    spec = tuple(sharding.spec)
    layer_sharding = NamedSharding(sharding.mesh, P(*spec[1:]))
    layers = []
    for i in range(shape[0]):
        def layer(index, i=i):  # this device's slice of layer i
            return read((slice(i, i + 1),) + tuple(index))[0]

        layers.append(transform(path, jax.make_array_from_callback(shape[1:], layer_sharding, layer)))
    return transform.stack(path, layers, sharding)


def _read_stacked(readers: list, stack: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """``ours[index]`` of a parameter stacked over the leading axes ``stack``, one HF tensor each."""
    d = len(stack)
    ranges = [range(n)[i] for n, i in zip(stack, index[:d])]
    blocks = [readers[int(np.ravel_multi_index(ix, stack))](index[d:]) for ix in itertools.product(*ranges)]
    return np.stack(blocks).reshape([len(r) for r in ranges] + list(blocks[0].shape))


def load_module(files: SafetensorsFiles, factory: Callable[[], nnx.Module], hf_param, names, *, mesh, rules, model_name: str):
    """The module ``factory()`` builds, its parameters read from ``files`` straight into the
    layout ``rules`` give on ``mesh`` (one device without a mesh); see :func:`load_state`."""
    graphdef, abstract = nnx.split(nnx.eval_shape(factory))
    shardings = state_shardings(abstract, mesh, rules)
    return nnx.merge(graphdef, load_state(files, abstract, shardings, hf_param, names, model_name=model_name))


def state_shardings(abstract, mesh, rules):
    """One device for ``mesh=None``; else the layout ``rules`` give on ``mesh``."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda v: device, abstract, is_leaf=is_variable)

    return shardings(abstract, mesh, rules)


def hf_tensors(model, hf_param: Callable[[tuple, tuple[int, ...]], HFParam]) -> Iterable[tuple[str, Callable[[], np.ndarray], int]]:
    """``(HF name, fetch, bytes)`` for every tensor of ``model``'s parameters; ``fetch()``
    copies one tensor (one layer of a stacked parameter) to the host in HF's layout."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=is_variable)[0]
    for p, v in flat:
        value = v.get_value()
        param = hf_param(p, tuple(value.shape))
        nbytes = math.prod(param.layout.hf_shape) * value.dtype.itemsize
        for i, key in enumerate(param.keys):
            at = np.unravel_index(i, value.shape[: param.depth]) if param.stacked else ()
            layer = lambda value=value, at=tuple(int(j) for j in at): value[at]  # noqa: E731
            yield key, (lambda layer=layer, layout=param.layout: layout.to_hf(np.asarray(jax.device_get(layer())))), nbytes


def save_safetensors(tensors: Iterable[tuple[str, Callable[[], np.ndarray], int]], path, *, max_shard_bytes: Optional[int]) -> None:
    """Write ``tensors`` (``(name, fetch, bytes)``) to ``path`` as HF does, layer by layer.

    One ``model.safetensors``, or, when they exceed ``max_shard_bytes``, files
    ``model-0000i-of-0000n.safetensors`` of at most that many bytes each (a larger tensor
    gets a file of its own) and ``model.safetensors.index.json``. Only one file's tensors
    are on the host at a time. Weight files of an earlier save in ``path`` are removed.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = sorted(tensors, key=lambda t: _natural(t[0]))  # layer by layer, as HF writes them
    shards: list[list] = [[]]
    size = 0
    for t in tensors:
        if max_shard_bytes is not None and shards[-1] and size + t[2] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t[2]
    for old in path.iterdir():
        if old.name in (SINGLE, INDEX) or _SHARD.fullmatch(old.name):
            old.unlink()
    n = len(shards)
    files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for file, shard in zip(files, shards):
        save_file({name: fetch() for name, fetch, _ in shard}, str(path / file), metadata={"format": "pt"})
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t[2] for t in tensors)},
            "weight_map": {name: file for file, shard in zip(files, shards) for name, _, _ in shard},
        }
        (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _natural(name: str):
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]
