"""How close is the planner's analytical estimate to the compiler? (And refit it.)

Compiles nnxscale's real train step ahead of time on 8 simulated CPU devices for a grid of
models, meshes, remat policies and batch shapes, and compares ``nnxscale.planning.estimate.estimate``
(the baseline being the compiler's own memory analysis and collectives) config by config.
The grid has two parts: the configs the coefficients are fitted to (gpt2-mini at two batch
shapes and with gradient accumulation, gpt2, gpt2-medium; six meshes; four remat
policies), and held-out ones (gpt2-large, other batch shapes, gpt2 with gradient
accumulation, bfloat16) that test the fit.

    python bench/plan_accuracy.py                    # compile the grid, report the errors
    python bench/plan_accuracy.py --cache grid.jsonl # keep/reuse compiled results
    python bench/plan_accuracy.py --fit              # refit: prints COEFFICIENTS for nnxscale/planning/estimate.py
    python bench/plan_accuracy.py --fit --remat none # one policy's configs; refit its row on the running jaxlib
                                                     # (the shared coefficients kept): a LATER_COEFFICIENTS entry

Last line, JSON: the largest and mean relative error of the estimated peak memory per
device and of the collective bytes per step, on the fitted and on the held-out configs.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from nnxscale.planning import compiler, estimate, layout  # noqa: E402
from nnxscale.training.config import TrainConfig  # noqa: E402

MESHES = ["data=8", "fsdp=8", "data=2,model=4", "data=4,model=2", "fsdp=4,model=2", "model=8"]
REMATS = ["none", "full", "dots", "dots-except-mlp-in"]


def grid() -> list[tuple[dict, bool]]:
    """``(config fields, held_out)`` pairs."""
    out = []
    for mesh, remat in itertools.product(MESHES, REMATS):
        out.append((dict(model="gpt2-mini", mesh=mesh, remat=remat, B=32, T=256), False))
        out.append((dict(model="gpt2-mini", mesh=mesh, remat=remat, B=64, T=128), False))
        out.append((dict(model="gpt2", mesh=mesh, remat=remat, B=8, T=1024), False))
        out.append((dict(model="gpt2-medium", mesh=mesh, remat=remat, B=8, T=1024), False))
    for mesh in MESHES:
        out.append((dict(model="gpt2-mini", mesh=mesh, remat="full", B=64, T=256, accum=2), False))
    for remat in REMATS:
        out.append((dict(model="gpt2-large", mesh="fsdp=8", remat=remat, B=8, T=1024), True))
    for mesh in ("data=8", "fsdp=8", "data=2,model=4"):
        out.append((dict(model="gpt2", mesh=mesh, remat="none", B=16, T=512), True))
        out.append((dict(model="gpt2", mesh=mesh, remat="full", B=16, T=1024, accum=2), True))
        out.append((dict(model="gpt2-mini", mesh=mesh, remat="dots", B=128, T=64), True))
        out.append((dict(model="gpt2", mesh=mesh, remat="full", B=8, T=1024, dtype="bfloat16"), True))
    return out


def config(g: dict) -> TrainConfig:
    return TrainConfig.from_flags(model=g["model"], mesh=g["mesh"], remat=g["remat"], dtype=g.get("dtype", "float32"),
                                  batch_size=g["B"], seq_len=g["T"], grad_accum=g.get("accum", 1))  # fmt: skip


def compiled(g: dict, cache: dict) -> dict:
    key = json.dumps(g, sort_keys=True)
    if key not in cache:
        t = time.perf_counter()
        _, c = compiler.compile_step(config(g))
        m = compiler.measure(c)
        cache[key] = {"g": g, "peak": m["peak_bytes"], "temp": m["temp_bytes"],
                      "coll": sum(m["collective_bytes"].values()), "seconds": time.perf_counter() - t}  # fmt: skip
    return cache[key]


def nnls(A: np.ndarray, b: np.ndarray, iters: int = 50000) -> np.ndarray:
    """Non-negative least squares by projected gradient (columns scaled to 1 first)."""
    scale = np.abs(A).max(axis=0) + 1e-30
    A = A / scale
    AtA, Atb = A.T @ A, A.T @ b
    step = 1.0 / np.linalg.norm(AtA, 2)
    x = np.zeros(A.shape[1])
    for _ in range(iters):
        x = np.maximum(0.0, x - step * (AtA @ x - Atb))
    return x / scale


def fit(rows) -> dict:
    """Fit COEFFICIENTS to ``rows`` of (features, compiled, remat), minimizing relative error."""
    shared, saved = list(estimate.SHARED_FEATURES), list(estimate.SAVED_FEATURES)
    columns = shared + [f"{r}:{k}" for r in REMATS for k in saved]
    A = np.array([[f[k] if ":" not in k else (f[k.split(":")[1]] if k.startswith(remat + ":") else 0.0) for k in columns]
                  for f, c, remat in rows]) / np.array([[c["temp"]] for f, c, _ in rows])  # fmt: skip
    x = nnls(A, np.ones(len(rows)))
    coef = {"shared": {k: float(v) for k, v in zip(columns, x) if ":" not in k and v}}
    for r in REMATS:
        coef[r] = {k.split(":")[1]: float(v) for k, v in zip(columns, x) if k.startswith(r + ":") and v}
    cols = list(estimate.COLLECTIVE_FEATURES)
    rows_c = [(f, c) for f, c, _ in rows if c["coll"]]
    A = np.array([[f[k] for k in cols] for f, c in rows_c]) / np.array([[c["coll"]] for f, c in rows_c])
    coef["collectives"] = {k: float(v) for k, v in zip(cols, nnls(A, np.ones(len(rows_c)))) if v}
    return coef


def fit_policy(rows, remat: str) -> dict:
    """Refit ``remat``'s saved coefficients to ``rows`` of (features, compiled), the shared ones
    (of the running jaxlib's table) kept, minimizing relative error."""
    table = estimate.coefficients()
    saved = list(estimate.SAVED_FEATURES)
    shared = [sum(table["shared"].get(k, 0.0) * f[k] for k in estimate.SHARED_FEATURES) for f, _ in rows]
    A = np.array([[f[k] for k in saved] for f, _ in rows]) / np.array([[c["temp"]] for _, c in rows])
    b = np.array([1 - s / c["temp"] for s, (_, c) in zip(shared, rows)])
    return {k: float(v) for k, v in zip(saved, nnls(A, b)) if v}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", help="JSONL of compiled results to reuse and extend")
    ap.add_argument("--fit", action="store_true", help="refit the coefficients and print them")
    ap.add_argument("--remat", choices=REMATS, help="only the configs of this remat policy (with --fit: refit its "
                    "row alone, for the running jaxlib)")  # fmt: skip
    args = ap.parse_args()
    cache = {}
    if args.cache and os.path.exists(args.cache):
        for line in open(args.cache):
            rec = json.loads(line)
            cache[json.dumps(rec["g"], sort_keys=True)] = rec
    rows = []
    for g, held_out in grid():
        if args.remat and g["remat"] != args.remat:
            continue
        c = compiled(g, cache)
        cfg = config(g)
        lay = layout.layout_figures(cfg, layout.mesh_sizes(cfg.parallel.mesh))
        rows.append((g, held_out, c, lay, estimate.features(cfg, lay)))
        if args.cache:
            with open(args.cache, "w") as f:
                f.writelines(json.dumps(v) + "\n" for v in cache.values())
    if args.fit and args.remat:
        row = fit_policy([(f, c) for g, held, c, _, f in rows if not held], args.remat)
        version = estimate.jaxlib_version()
        estimate.LATER_COEFFICIENTS[version] = {**estimate.LATER_COEFFICIENTS.get(version, {}), args.remat: row}
        print(f"LATER_COEFFICIENTS[{version}][{args.remat!r}] = " + json.dumps(row, indent=4))
    elif args.fit:
        estimate.COEFFICIENTS.clear()
        estimate.COEFFICIENTS.update(fit([(f, c, g["remat"]) for g, held, c, _, f in rows if not held]))
        estimate.LATER_COEFFICIENTS.clear()  # this jaxlib's fit is the whole table
        print("COEFFICIENTS = " + json.dumps(estimate.COEFFICIENTS, indent=4))

    print(f"{'model':<12}{'mesh':<16}{'remat':<6}{'batch':>9} {'extra':<10}{'peak (compiler)':>16}{'estimate':>10}{'collectives':>13}{'estimate':>10}")
    errs = {False: ([], []), True: ([], [])}
    for g, held, c, lay, f in rows:
        est = estimate.estimate(config(g), lay)
        e_peak = est["peak_bytes_per_device"] / c["peak"] - 1
        e_coll = est["collective_bytes_per_step"] / c["coll"] - 1 if c["coll"] else 0.0
        errs[held][0].append(abs(e_peak))
        errs[held][1].append(abs(e_coll))
        extra = ("held-out " if held else "") + (g.get("dtype", "")[:4] if g.get("dtype") else "") + (f"acc{g['accum']}" if g.get("accum") else "")
        print(f"{g['model']:<12}{g['mesh']:<16}{g['remat']:<6}{g['B']:>4}x{g['T']:<4} {extra:<10}{c['peak'] / 2**20:>12.0f} MiB"
              f"{e_peak:>+10.1%}{c['coll'] / 2**20:>9.0f} MiB{e_coll:>+10.1%}")  # fmt: skip
    summary = {}
    for held, name in ((False, "fitted"), (True, "held_out")):
        peak, coll = errs[held]
        if not peak:
            continue
        summary[f"{name}_peak_max_err"] = round(max(peak), 4)
        summary[f"{name}_peak_mean_err"] = round(float(np.mean(peak)), 4)
        summary[f"{name}_collectives_max_err"] = round(max(coll), 4)
        summary[f"{name}_configs"] = len(peak)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
