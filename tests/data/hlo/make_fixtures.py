"""Regenerate the compiled-HLO fixtures of ``tests/test_hlo.py`` (run by hand, not by the suite).

Each fixture is ``compiled.as_text()`` of one small training step, compiled by one backend's
own compiler on a machine with no accelerator (deviceless, ahead of time), gzipped:

- ``cpu``: XLA:CPU, 8 simulated host devices;
- ``h100``: the CUDA plugin's compiler for one node of 8 NVIDIA H100s (topology ``1x1x8``),
  from the planner's H100 description (`nnxscale.planning.targets`, published H100 SXM figures);
- ``tpu``: libtpu's compiler for a TPU v5e-8 (topology ``v5e:2x4``, 8 chips).

The steps (:data:`STEPS`) are written by hand so that the bytes each one must move follow
from its shapes and mesh (the tests compute them from these dicts), plus nnxscale's own
training step of ``llama-tiny`` (``compile_step``), checked against an independent count.

    pip install "jax[tpu]==0.10.2" jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2
    python tests/data/hlo/make_fixtures.py              # every backend, one child process each
    python tests/data/hlo/make_fixtures.py --backend h100 --step fsdp_scan
    python tests/data/hlo/make_fixtures.py --table    # expected vs counted (docs/planning.md)

TPU compiles take tens of seconds each and GBs of memory; on a shared machine run it under
``flock`` with ``nice``. The ``FileNames``/``StackFrames`` tables (local source paths) are
dropped from the saved text; every computation is kept verbatim.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "collective-broadcast")
BACKENDS = ("cpu", "h100", "tpu")

#: The hand-written steps: their meshes and shapes (per whole array, before sharding).
#: ``dtype`` is what the step computes in; parameters are float32.
STEPS = {
    # grad of a scan over `layers` weights (width x width), FSDP-sharded, each layer
    # rematerialized: every layer's weight is gathered in the forward loop and again in the
    # backward loop, and its gradient reduce-scattered once.
    "fsdp_scan": dict(mesh={"fsdp": 8}, layers=4, width=512, batch=64, dtype="bfloat16"),
    # the same step over `micro` microbatches (a fori_loop around the scan: nested loops), with
    # each microbatch's gradient constrained to the parameters' FSDP layout as it is added:
    # micro x (2 gathers + 1 reduce-scatter) per layer.
    "fsdp_accum": dict(mesh={"fsdp": 8}, layers=4, width=512, batch=64, micro=2, dtype="float32"),
    # Megatron MLP blocks scanned over layers on data=2 x model=4: the block's output is
    # all-reduced over `model` once in the forward and its input gradient once in the
    # backward per layer; the weight gradients are all-reduced over `data` once.
    "tp_mlp": dict(mesh={"data": 2, "model": 4}, layers=2, width=512, hidden=2048, batch=64, dtype="float32"),
    # a ring over `context` (shard_map): the key and value blocks travel one hop per step,
    # `context` steps, in a fori_loop; forward only.
    "context_ring": dict(mesh={"context": 8}, batch=2, seq=1024, heads=4, head_dim=64, dtype="float32"),
    # a mixture-of-experts layer on `expert` (shard_map): tokens to their experts and back,
    # two all-to-alls in the forward and two in the backward.
    "expert_a2a": dict(mesh={"expert": 8}, tokens=1024, width=256, hidden=512, dtype="float32"),
}

#: nnxscale's own training step, compiled with ``planning.compiler.compile_step``.
NNXSCALE_STEPS = {
    "llama_fsdp": dict(model="llama-tiny", mesh="fsdp=8", batch_size=16, seq_len=128, dtype="bfloat16", remat="full",
                       grad_accum=2, min_shard_bytes=0),
}  # fmt: skip

def devices(backend: str):
    import jax

    if backend == "cpu":
        return jax.devices("cpu")[:8]
    from nnxscale.planning import targets  # the planner's catalog: published H100 figures, TPU topologies

    return targets.get("h100x8" if backend == "h100" else "v5e-8").devices()


def _mesh(devs, axes: dict):
    import numpy as np
    from jax.sharding import Mesh

    shape = tuple(axes.values())
    return Mesh(np.asarray(devs[: int(np.prod(shape))]).reshape(shape), tuple(axes))


def _scan_loss(dtype):
    """Loss of a rematerialized scan of tanh(h @ w) layers, computing in ``dtype``."""
    import jax
    import jax.numpy as jnp

    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w.astype(dtype)), None

    def loss(w, x):
        h, _ = jax.lax.scan(layer, x.astype(dtype), w)
        return h.astype(jnp.float32).sum()

    return loss


def fsdp_scan(mesh, c):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    wspec = NamedSharding(mesh, P(None, "fsdp", None))
    w = jax.ShapeDtypeStruct((c["layers"], c["width"], c["width"]), jnp.float32, sharding=wspec)
    x = jax.ShapeDtypeStruct((c["batch"], c["width"]), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
    return jax.jit(jax.grad(_scan_loss(jnp.dtype(c["dtype"]))), out_shardings=wspec), (w, x)


def fsdp_accum(mesh, c):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    wspec = NamedSharding(mesh, P(None, "fsdp", None))
    grad = jax.grad(_scan_loss(jnp.dtype(c["dtype"])))
    micro = c["micro"]

    def step(w, x):
        def one(i, acc):
            g = jax.lax.with_sharding_constraint(grad(w, x[i]), wspec)
            return acc + g

        return jax.lax.fori_loop(0, micro, one, jnp.zeros_like(w))

    w = jax.ShapeDtypeStruct((c["layers"], c["width"], c["width"]), jnp.float32, sharding=wspec)
    x = jax.ShapeDtypeStruct((micro, c["batch"], c["width"]), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp", None)))
    return jax.jit(step, out_shardings=wspec), (w, x)


def tp_mlp(mesh, c):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    dtype = jnp.dtype(c["dtype"])
    act = P("data", None)

    def block(h, ws):
        w1, w2 = ws
        y = jax.nn.gelu(h @ w1.astype(dtype)) @ w2.astype(dtype)
        return h + jax.lax.with_sharding_constraint(y, NamedSharding(mesh, act)), None

    def loss(ws, x):
        h, _ = jax.lax.scan(block, x.astype(dtype), ws)
        return h.astype(jnp.float32).sum()

    L, D, F = c["layers"], c["width"], c["hidden"]
    specs = (NamedSharding(mesh, P(None, None, "model")), NamedSharding(mesh, P(None, "model", None)))
    ws = (jax.ShapeDtypeStruct((L, D, F), jnp.float32, sharding=specs[0]),
          jax.ShapeDtypeStruct((L, F, D), jnp.float32, sharding=specs[1]))  # fmt: skip
    x = jax.ShapeDtypeStruct((c["batch"], D), jnp.float32, sharding=NamedSharding(mesh, act))
    return jax.jit(jax.grad(loss), out_shardings=specs), (ws, x)


def context_ring(mesh, c):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.shape["context"]
    perm = [(i, (i + 1) % n) for i in range(n)]
    spec = P(None, "context", None, None)

    def ring(q, k, v):  # unnormalised attention against every block, one hop per step
        def hop(_, carry):
            out, k, v = carry
            out = out + jnp.einsum("bqhd,bkhd,bkhe->bqhe", q, k, v)
            return out, jax.lax.ppermute(k, "context", perm), jax.lax.ppermute(v, "context", perm)

        out, _, _ = jax.lax.fori_loop(0, n, hop, (jnp.zeros_like(q), k, v))
        return out

    f = jax.shard_map(ring, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    shape = (c["batch"], c["seq"], c["heads"], c["head_dim"])
    arg = jax.ShapeDtypeStruct(shape, jnp.dtype(c["dtype"]), sharding=NamedSharding(mesh, spec))
    return jax.jit(f), (arg, arg, arg)


def expert_a2a(mesh, c):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = mesh.shape["expert"]

    def moe(x, w1, w2):  # x: this device's tokens, (n, tokens/n/n, width) grouped by expert
        x = jax.lax.all_to_all(x, "expert", 0, 0, tiled=True)  # every device's tokens for my expert
        y = jax.nn.gelu(x @ w1[0]) @ w2[0]
        return jax.lax.all_to_all(y, "expert", 0, 0, tiled=True)

    f = jax.shard_map(moe, mesh=mesh, in_specs=(P("expert"), P("expert"), P("expert")), out_specs=P("expert"))

    def loss(x, w1, w2):
        return (f(x, w1, w2) ** 2).sum()

    T, D, F = c["tokens"], c["width"], c["hidden"]
    dt = jnp.dtype(c["dtype"])
    x = jax.ShapeDtypeStruct((T, D), dt, sharding=NamedSharding(mesh, P("expert")))
    w1 = jax.ShapeDtypeStruct((n, D, F), dt, sharding=NamedSharding(mesh, P("expert")))
    w2 = jax.ShapeDtypeStruct((n, F, D), dt, sharding=NamedSharding(mesh, P("expert")))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (x, w1, w2)


def arithmetic(name: str) -> list[tuple[str, int, int, int, str]]:
    """What step ``name`` must move per device per run, from its shapes and mesh alone:
    ``[(kind, group, elements per tensor, tensors per run, what)]`` (see :data:`STEPS`)."""
    c = STEPS[name]
    if name in ("fsdp_scan", "fsdp_accum"):
        n, layer, runs = c["mesh"]["fsdp"], c["width"] ** 2, c["layers"] * c.get("micro", 1)
        return [("all-gather", n, layer, 2 * runs, "each layer's weight, forward and backward"),
                ("reduce-scatter", n, layer, runs, "each layer's weight gradient")]  # fmt: skip
    if name == "tp_mlp":
        data, model = c["mesh"]["data"], c["mesh"]["model"]
        return [("all-reduce", model, c["batch"] // data * c["width"], 2 * c["layers"], "block output and input gradient over model"),
                ("all-reduce", data, c["width"] * c["hidden"] // model, 2 * c["layers"], "two weight gradients over data")]  # fmt: skip
    if name == "context_ring":
        n = c["mesh"]["context"]
        return [("collective-permute", 1, c["batch"] * c["seq"] // n * c["heads"] * c["head_dim"], 2 * n, "key and value blocks, a hop per step")]
    n = c["mesh"]["expert"]
    return [("all-to-all", n, c["tokens"] // n * c["width"], 4, "tokens to experts and back, forward and backward")]


def table() -> str:
    """Markdown: each step's arithmetic beside what the counter finds in each backend's program.

    An op is the arithmetic's when it is of its kind and group and moves a whole number of
    the arithmetic's tensors (compilers combine, flatten and split them); XLA:CPU
    reduces gradients with an all-reduce where the others reduce-scatter.
    """
    from nnxscale.planning import hlo

    rows = ["| step (mesh) | collective: what the arithmetic moves | backend | expected elements | counted elements | counted bytes (dtype) | other collectives in the program |",
            "| --- | --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for name, c in STEPS.items():
        mesh = ",".join(f"{k}={v}" for k, v in c["mesh"].items())
        for backend in BACKENDS:
            with gzip.open(fixture_path(backend, name), "rt") as f:
                ops = hlo.collectives(f.read())
            left = list(ops)
            entries = arithmetic(name)
            for k, (kind, group, each, times, what) in enumerate(entries):
                kinds = (kind, "all-reduce") if kind == "reduce-scatter" else (kind,)
                mine = [op for op in left if op.kind in kinds and op.group == group and sum(map(math.prod, op.shapes)) % each == 0]
                left = [op for op in left if op not in mine]
                counted = sum(math.prod(s) * op.executions for op in mine for s in op.shapes)
                nbytes = sum(op.total_bytes for op in mine)
                dtypes = "+".join(sorted({op.dtype for op in mine}))
                kinds_seen = "/".join(sorted({op.kind for op in mine}))
                other = "; ".join(f"{op.kind} {op.dtype}{list(op.shapes[0])} x{op.executions}" for op in left) if k == len(entries) - 1 else ""
                rows.append(f"| {name} ({mesh}) | {kind}: {what} | {backend} | {each * times:,} | {counted:,} | "
                            f"{nbytes / 1e6:.2f} MB ({kinds_seen}, {dtypes}) | {other or '-'} |")  # fmt: skip
    return "\n".join(rows)


def count_by_results(text: str) -> dict[str, int]:
    """An op-by-op count of a module's collectives, written apart from ``nnxscale.planning.hlo``, from what each device ends up with.

    Asynchronous ops are counted at their ``-done`` (whose type is the result alone), TPU's
    async collective fusions at the copy flagged ``flag_start -1``, loops by their recorded
    trip count or else as :func:`_read_trips` reads the text; a
    reduce-scatter's result is scaled back to its input by the group size.
    """
    comps, lines, entry = {}, {}, None
    for line in text.splitlines():
        if line.startswith(("%", "ENTRY")) and line.endswith("{"):
            name = line.split("%", 1)[1].split(" ", 1)[0]
            comps[name], entry = [], name if line.startswith("ENTRY") else entry
        elif m := re.match(r"  (?:ROOT )?%([\w.\-]+) = ", line):
            comps[name].append(line)
            lines[m.group(1)] = line
    edges = {}  # caller: [(callee, times)]
    for comp, body in comps.items():
        for line in body:
            if re.search(r"-done\(", line):
                continue
            trips = 1
            if " while(" in line:
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                cond = re.search(r"condition=%([\w.\-]+)", line).group(1)
                trips = int(known.group(1)) if known else _read_trips(comps, lines, cond, re.search(r"body=%([\w.\-]+)", line).group(1))
            for callee in re.findall(r"\b(?:calls|to_apply|body)=%([\w.\-]+)", line):
                edges.setdefault(comp, []).append((callee, trips))
    runs = {}

    def visit(comp, times):
        runs[comp] = runs.get(comp, 0) + times
        for callee, trips in edges.get(comp, []):
            visit(callee, times * trips)

    visit(entry, 1)
    totals = dict.fromkeys(KINDS, 0)
    size = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4}
    for comp, times in runs.items():
        for line in comps[comp]:
            m = re.search(r"= (.*?) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(-start|-done)?\(", line)
            if not m or m.group(3) == "-start" or ('async_collective_fusion_config' in line and '"flag_start":"-1"' not in line):
                continue
            kind, where = m.group(2), line
            if m.group(3) == "-done":  # its start says who takes part
                where = lines[re.search(r"-done\(%([\w.\-]+)", line).group(1)]
            nbytes = sum(math.prod(int(d) for d in dims.split(",") if d) * size[dt]
                         for dt, dims in re.findall(r"\b(f32|bf16|s32|u32)\[([\d,]*)\]", m.group(1)))  # fmt: skip
            if kind == "reduce-scatter":
                nbytes *= group_of(where)
            if kind == "all-reduce" and comp.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"
            totals[kind] += nbytes * times
    return totals


def _read_trips(comps, lines, cond: str, body: str) -> int:
    """A loop without a recorded trip count, read as the text says: the integer constant its
    condition compares with, over the constant its body adds to the compared element
    (tuple index ``k``); the counter starts at 0 in every loop of the fixtures."""
    text = "\n".join(comps[cond])
    bound = int(re.search(r"[su]32\[\]\S* constant\((\d+)\)", text).group(1))
    k = int(re.search(r"get-tuple-element\(%[\w.\-]+\), index=(\d+)", text).group(1))
    root = next(ln for ln in comps[body] if ln.lstrip().startswith("ROOT"))
    element = re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[1])[k]
    step = 1
    while element in lines and " add(" not in lines[element] and re.search(r" copy\(%([\w.\-]+)", lines[element]):
        element = re.search(r" copy\(%([\w.\-]+)", lines[element]).group(1)
    if element in lines and " add(" in lines[element]:
        for operand in re.findall(r"%([\w.\-]+)", lines[element].split(" add(", 1)[1].split(")", 1)[0]):
            step = int(m.group(1)) if (m := re.search(r" constant\((\d+)\)", lines.get(operand, ""))) else step
    return -(-bound // step)


def group_of(line: str) -> int:
    """Devices in the first replica group of ``line``, in the three ways the fixtures write them."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    if m := re.search(r"replica_groups=\{\{([\d,]+)\}", line):
        return m.group(1).count(",") + 1
    return int(re.search(r"replica_groups=\[\d+,(\d+)\]<=", line).group(1))


def _nnxscale_step(devs, c):
    import jax

    import nnxscale
    from nnxscale.planning.compiler import compile_step

    cfg = nnxscale.TrainConfig.from_flags(**c)
    mesh = nnxscale.make_mesh(c["mesh"], devices=list(devs)[:8])
    _, compiled = compile_step(cfg, mesh)
    del jax
    return compiled


_TABLES = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$")


def strip_tables(text: str) -> str:
    """``compiled.as_text()`` less its source-location tables (local paths, no computations)."""
    out, skipping = [], False
    for line in text.splitlines():
        if _TABLES.match(line):
            skipping = True
            continue
        if skipping and (line.startswith("%") or line.startswith("ENTRY") or line.startswith("HloModule")):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


def compile_one(backend: str, name: str):
    """The compiled executable of step ``name`` for ``backend`` (in this process)."""
    devs = devices(backend)
    if name in NNXSCALE_STEPS:
        return _nnxscale_step(devs, NNXSCALE_STEPS[name])
    c = STEPS[name]
    fn, args = globals()[name](_mesh(devs, c["mesh"]), c)
    return fn.lower(*args).compile()


def fixture_path(backend: str, name: str) -> Path:
    return HERE / f"{backend}_{name}.hlo.gz"


def run_backend(backend: str, names) -> None:
    import jax

    if backend != "cpu":
        jax.config.update("jax_platforms", "cpu")
    for name in names:
        t = time.perf_counter()
        compiled = compile_one(backend, name)
        text = strip_tables(compiled.as_text())
        with gzip.open(fixture_path(backend, name), "wt", compresslevel=9) as f:
            f.write(text)
        size = fixture_path(backend, name).stat().st_size
        print(f"{backend} {name}: {len(text):,} chars, {size:,} bytes gzipped, {time.perf_counter() - t:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=(*BACKENDS, "all"), default="all")
    ap.add_argument("--step", action="append", choices=(*STEPS, *NNXSCALE_STEPS), help="default: every step")
    ap.add_argument("--table", action="store_true", help="print the expected-vs-counted table of the saved fixtures")
    args = ap.parse_args()
    if args.table:
        print(table())
        return
    names = args.step or [*STEPS, *NNXSCALE_STEPS]
    if args.backend != "all":
        run_backend(args.backend, names)
        return
    for backend in BACKENDS:  # each in a fresh process: the platform is chosen once per process
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        if backend == "cpu":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        cmd = [sys.executable, __file__, "--backend", backend] + [a for n in names for a in ("--step", n)]
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
