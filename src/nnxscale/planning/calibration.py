"""XLA:CPU as a step-time target: this machine's figures, measured (``steptime`` needs a chip's).

A CPU has no datasheet the prediction can read, so a few microbenchmarks measure what
XLA:CPU reaches here, with every local CPU device working at once as the devices of a
training step do (XLA's simulated devices share the host's cores): an MLP's matrix products'
FLOP/s, an elementwise update's bytes/s (with a tanh: XLA:CPU's elementwise fusions are bound
by their arithmetic as much as by memory), the cost of one more op (a tiny product: the
runtime's dispatch of an op), the rate at which a run's newly mapped buffers are first
written (XLA:CPU maps a program's temporary buffer and new outputs afresh each run, and the
kernel faults in and zeroes every page: a fifth to a third of a small model's step), and an
all-reduce's bandwidth and latency between the devices. Each figure is per
device, for the number of devices measured with; :func:`cpu_hardware` rescales them to another
count (the host's throughput shared out). About 2 seconds on an idle 2-core machine.

The figures are cached per machine under the user's cache directory
(``$XDG_CACHE_HOME/nnxscale/cpu-calibration.json``, else ``~/.cache/...``), keyed by the
jaxlib version and the cores this process may use: a new jaxlib or another core count
measures again. ``bench/steptime.py`` measures and predicts with them (nine steps within 30%
of the measured time, docs/steptime.md); nothing else does on its own: ``nnxscale plan``
without ``--target`` and the trainer predict no XLA:CPU step time, as measuring takes seconds
and the figures move with the host's load. From
Python, :func:`register_cpu` makes them the ``"cpu"`` hardware of
:func:`nnxscale.planning.steptime.hardware_for`, and :func:`nnxscale.planning.plan` then
predicts a step time for this machine's XLA:CPU.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.planning import steptime
from nnxscale.planning.hardware import Hardware, Link
from nnxscale.sharding.devices import device_kind

#: Bump when what is measured changes: older cache entries are measured again.
CALIBRATION_VERSION = 5

#: Sizes of the microbenchmarks, per device: an MLP's two float32 products of this many rows
#: and this width (x 4 inside: the shapes of a small model's step per device), a streaming
#: update of this many bytes, a chain of this many tiny dependent products, an all-reduce of
#: this many bytes; buffers mapped anew of this many bytes over all the devices.
MATMUL_ROWS, MATMUL_WIDTH = 512, 128
STREAM_BYTES = 8 << 20
FRESH_BYTES = 256 << 20
CHAIN_OPS = 64
ALLREDUCE_BYTES = 2 << 20


def cache_path() -> Path:
    """Where the figures are kept: ``$XDG_CACHE_HOME/nnxscale/cpu-calibration.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "nnxscale" / "cpu-calibration.json"


def machine_key() -> dict[str, Any]:
    """What the figures hold for: this jaxlib and the cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"jaxlib": jaxlib.__version__, "cores": cores, "version": CALIBRATION_VERSION}


def host_figures(*, refresh: bool = False, path: Optional[Path] = None, measure: Optional[Callable[[], dict]] = None) -> dict:
    """This machine's XLA:CPU figures (:func:`measure_host`'s), from the cache where it holds
    them for :func:`machine_key`, else measured now and cached. ``refresh``: measure again."""
    path = cache_path() if path is None else Path(path)
    key = machine_key()
    cached = None if refresh else cached_figures(path)
    if cached is not None:
        return cached
    figures = (measure or measure_host)()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "figures": figures}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:  # a read-only home: measured each time, still right
        pass
    return figures


def cached_figures(path: Optional[Path] = None) -> Optional[dict]:
    """The cached figures where they hold for this machine (:func:`machine_key`), else ``None``."""
    try:
        cached = json.loads((cache_path() if path is None else Path(path)).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(cached, dict) and cached.get("key") == machine_key() and isinstance(cached.get("figures"), dict):
        return cached["figures"]
    return None


def _median_in_place(fn: Callable, x, repeat: int = 5) -> float:
    """:func:`_median_seconds` of ``x = fn(x)``, ``fn`` donating ``x``: no buffer is mapped anew."""
    box = [x]

    def again():
        box[0] = fn(box[0])
        return box[0]

    return _median_seconds(again, repeat=repeat)


def _median_seconds(fn: Callable, *args, repeat: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


_REPEATS, _AR_LOOPS, _SMALL_LOOPS = 8, 4, 32


@functools.cache
def _programs(devices: tuple) -> dict:
    """The microbenchmarks' jitted programs and inputs over ``devices`` (one shard each), built
    once per process: measuring again (``bench/steptime.py`` does before each configuration)
    runs them without compiling."""
    n, rows, width = len(devices), MATMUL_ROWS, MATMUL_WIDTH
    mesh = Mesh(np.array(devices), ("d",))

    def mlp(c, w1, w2):
        return jnp.einsum("dij,djk->dik", jnp.einsum("dij,djk->dik", c, w1), w2) / width

    def put(*shape):
        return jax.device_put(jnp.full((n, *shape), 0.5, jnp.float32), NamedSharding(mesh, P("d")))

    def chain(x, w):
        for _ in range(CHAIN_OPS):
            x = jnp.einsum("dij,djk->dik", x, w)
        return x

    def allreduce(loops):
        def body(x):
            return jax.lax.fori_loop(0, loops, lambda _, c: c * 0.5 + jax.lax.psum(c, "d") * (0.5 / n), x)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def after_product(with_allreduce: bool):
        # A product, then (or not) an all-reduce of a few bytes: the devices, sharing the
        # cores, reach it at different times, as they reach a step's collectives.
        def body(x, h, w):
            def one(_, carry):
                c, h = carry
                h = jnp.einsum("dij,djk->dik", h, w) / width
                return (c * 0.5 + jax.lax.psum(c, "d") * (0.5 / n) if with_allreduce else c), h

            return jax.lax.fori_loop(0, _SMALL_LOOPS, one, (x, h))

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    return {
        "mesh": mesh,
        "products": jax.jit(lambda a, w1, w2: jax.lax.fori_loop(0, _REPEATS, lambda _, c: mlp(c, w1, w2), a)),
        # a layer's elementwise work: GELU's tanh, a norm's scale and shift (XLA:CPU's elementwise
        # fusions are bound by their arithmetic, a third of a plain copy's rate, as much as by memory)
        "stream": jax.jit(lambda x: jax.lax.fori_loop(0, _REPEATS, lambda _, c: jnp.tanh(c) * 0.9 + 0.01, x)),
        "chain": jax.jit(chain),
        # the same update writing a new output each run (mapped anew) or its donated input
        "fresh": jax.jit(lambda x: x * 0.5 + 1.0),
        "in_place": jax.jit(lambda x: x * 0.5 + 1.0, donate_argnums=0),
        "allreduce": allreduce(_AR_LOOPS),
        "product": after_product(False),
        "product_allreduce": after_product(True),
        "square": put(width, width),
        "rows": put(rows, width), "w1": put(width, 4 * width), "w2": put(4 * width, width),
        "long": put(STREAM_BYTES // 4), "tiny": put(8, 8), "shard": put(ALLREDUCE_BYTES // 4), "few": put(8),
        "big": put(_fresh_elements(n)),
    }  # fmt: skip


def _fresh_elements(n: int) -> int:
    """float32 elements per device of the fresh-buffer benchmark: :data:`FRESH_BYTES` shared
    out, at least 4 MiB each."""
    return max(FRESH_BYTES // n, 4 << 20) // 4


def measure_host() -> dict:
    """Measure XLA:CPU here, every local CPU device at once (one shard each): per device,
    ``matmul_flops`` (FLOP/s of an MLP's float32 products), ``stream_bytes`` (bytes/s read and written
    by an elementwise update with a tanh, a layer's kind of elementwise work), ``op_seconds``
    (one more op in a chain of dependent tiny products), ``allreduce_bytes`` (an all-reduce's ring bandwidth between all of them, in a
    loop of all-reduces) and ``allreduce_latency`` (what one of a few bytes adds after a
    product: the devices, sharing the cores, reach it at different times and wait for the
    last, as at a step's collectives); ``devices``: how many."""
    devices = tuple(d for d in jax.local_devices() if d.platform == "cpu") or tuple(jax.devices("cpu"))
    n = len(devices)
    p = _programs(devices)
    with jax.set_mesh(p["mesh"]):  # the calibration's own mesh, whatever mesh the caller is under
        mlp = (p["rows"], p["w1"], p["w2"])
        t_mm = _median_seconds(p["products"], *mlp)
        t_stream = _median_seconds(p["stream"], p["long"])
        t_chain = _median_seconds(p["chain"], p["tiny"], p["tiny"])
        t_fresh = _median_seconds(p["fresh"], p["big"])
        t_in_place = _median_in_place(p["in_place"], p["fresh"](p["big"]))
        t_ar = _median_seconds(p["allreduce"], p["shard"]) / _AR_LOOPS
        one = (p["few"], p["rows"], p["square"])
        t_small = (_median_seconds(p["product_allreduce"], *one) - _median_seconds(p["product"], *one)) / _SMALL_LOOPS
    flops = 2 * 2 * MATMUL_ROWS * MATMUL_WIDTH * 4 * MATMUL_WIDTH * _REPEATS
    ring = 2 * (n - 1) / n if n > 1 else 1.0
    return {
        "devices": n,
        "matmul_flops": flops / t_mm,
        "stream_bytes": 2 * STREAM_BYTES * _REPEATS / t_stream,
        "op_seconds": t_chain / CHAIN_OPS,
        "fresh_bytes": 4 * _fresh_elements(n) / max(t_fresh - t_in_place, 1e-9),
        "allreduce_bytes": ring * ALLREDUCE_BYTES / t_ar,
        "allreduce_latency": max(t_small, 0.0),
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def cpu_hardware(n_devices: int, figures: Optional[dict] = None):
    """The :class:`~nnxscale.planning.hardware.Hardware` of one of ``n_devices`` simulated CPU
    devices: the measured per-device figures (``figures``, default :func:`host_figures`)
    rescaled from the count they were measured with (the host's throughput shared out)."""
    f = host_figures() if figures is None else figures
    share = f["devices"] / max(n_devices, 1)
    flops = f["matmul_flops"] * share
    source = f"measured on this machine ({machine_key()['cores']} cores, {f['devices']} devices, {f['measured']})"
    return Hardware(
        name=f"XLA:CPU ({n_devices} devices on {machine_key()['cores']} cores)",
        peak_flops={"float32": flops, "bfloat16": flops},  # XLA:CPU computes a bfloat16 product in float32
        hbm_bandwidth=f["stream_bytes"] * share,
        links={"cpu": Link("cpu", f["allreduce_bytes"] * share, f["allreduce_latency"] / share, 1.0, {"bandwidth": source})},
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        op_overhead=f["op_seconds"] / share,
        fresh_memory_bandwidth=f["fresh_bytes"] * share if f.get("fresh_bytes") else None,
        sources={k: source for k in ("peak_flops", "hbm_bandwidth", "op_overhead", "fresh_memory_bandwidth")},
    )  # fmt: skip


def register_cpu(n_devices: int, *, refresh: bool = False):
    """Measure (or read) this machine's figures and register them as ``"cpu"`` for ``n_devices``
    devices (:func:`nnxscale.planning.steptime.register_hardware`); returns the hardware."""
    hw = cpu_hardware(n_devices, host_figures(refresh=refresh))
    steptime.register_hardware("cpu", hw)
    return hw


def local_hardware(mesh):
    """The figures of the devices a run's ``mesh`` holds, where the prediction has them: a GPU
    or TPU nnxscale knows by its ``device_kind`` (:data:`nnxscale.sharding.devices.DEVICE_KINDS`);
    else ``None``.

    Never XLA:CPU's, calibrated or not: its figures are measured on the machine (seconds) and
    move with the host's load, 2-4x under other jobs (docs/steptime.md), so a CPU prediction
    beside a run's measured step would say as much about the load as about the step. XLA:CPU
    predictions are ``bench/steptime.py``'s, asked for explicitly, its figures measured around
    the timed steps."""
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        return None
    row = device_kind(getattr(device, "device_kind", ""))
    return None if row is None or row.chip is None else steptime.hardware_for(row.chip)
