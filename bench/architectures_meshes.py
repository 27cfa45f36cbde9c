"""The mini presets of every decoder family on every mesh that applies: the same losses.

    python bench/architectures_meshes.py [--steps 10] [--presets qwen3-mini,gemma3-mini] [--meshes data=2,fsdp=2,model=2]

By hand, not in the suite. On 8 simulated CPU devices, each byte-level mini preset trains
``--steps`` steps through the CLI (``nnxscale train``, in this process: ``main(argv)``) on
``data=8`` and then on each mesh below; a table gives, per (preset, mesh), the largest
relative difference of the logged loss to ``data=8``'s over the steps, and the ratio of the
last step's loss to data=8's. A mesh the model cannot run must be refused by the CLI in one
line (exit code 2): the table records that line; anything else (a traceback, or a one-line
refusal that is not one line) is marked ``TRACEBACK`` / ``BAD-ERROR``.

Meshes: fsdp=8; data=2,fsdp=2,model=2; context=2,data=4 and context=4,data=2 (ring
attention; ``--seq-len`` per preset is chosen so that a sliding window is shorter than a
device's share of the sequence on context=2 and longer on context=4: gemma3-mini window 32,
seq 96 -> shares 48 and 24; mistral-mini window 64, seq 192 -> shares 96 and 48);
stage=2,data=4 with GPipe and with ``--pipeline-schedule 1f1b`` (2 microbatches); for the
mixtures also expert=2,fsdp=2,model=2 and expert=4,data=2.

Every run: seed 0, batch 8, ``--min-shard-bytes 0`` (so FSDP meshes split the small
tensors), warmup 2 then a constant peak, LLVM at -O0 (as the suite: compiling dominates).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
for _f in _FLAGS:
    if _f.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _f).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from nnxscale.cli.commands import main  # noqa: E402
from nnxscale.training.rundir import read_metrics  # noqa: E402

PRESETS = ["qwen3-mini", "qwen3-moe-mini", "mistral-mini", "gemma3-mini", "gemma2-mini", "deepseek-mini"]
MIXTURES = {"qwen3-moe-mini", "deepseek-mini"}
SEQ = {"gemma3-mini": 96, "mistral-mini": 192}  # windows 32 and 64: see the docstring
DEFAULT_SEQ = 64
BATCH = 8
PIPE = ["--microbatches", "2"]


def meshes(preset: str) -> list[tuple[str, list[str]]]:
    """(label, extra argv) per mesh, data=8 first."""
    out = [("data=8", []), ("fsdp=8", []), ("data=2,fsdp=2,model=2", []), ("context=2,data=4", []),
           ("context=4,data=2", []), ("stage=2,data=4", PIPE),
           ("stage=2,data=4 1f1b", PIPE + ["--pipeline-schedule", "1f1b"])]  # fmt: skip
    if preset in MIXTURES:
        out += [("expert=2,fsdp=2,model=2", []), ("expert=4,data=2", [])]
    return out


def corpus(root: Path) -> Path:
    """~280 KB of real text (as the suite's ``text_data``): a few standard-library modules' source."""
    import argparse as a
    import dataclasses
    import inspect
    import typing

    path = root / "corpus.txt"
    path.write_text("\n".join(inspect.getsource(m) for m in (a, dataclasses, inspect, typing)))
    return path


def run(preset: str, label: str, extra: list[str], steps: int, data: Path, root: Path) -> dict:
    """One CLI run: ``{"losses": [...]}`` or ``{"error": line, "kind": ...}``."""
    run_dir = root / f"{preset}-{label.replace(',', '_').replace('=', '').replace(' ', '-')}"
    argv = ["train", "--model", preset, "--mesh", label.split()[0], "--steps", str(steps), "--seed", "0",
            "--log-every", "1", "--eval-every", "0", "--save-every", "0", "--run-dir", str(run_dir), "--no-progress",
            "--data", str(data), "--seq-len", str(SEQ.get(preset, DEFAULT_SEQ)), "--batch-size", str(BATCH),
            "--min-shard-bytes", "0", "--warmup-steps", "2", "--min-lr-ratio", "1.0", *extra]  # fmt: skip
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as e:
        code = e.code
    except Exception as e:  # noqa: BLE001  (a traceback: what a user must never see)
        tb = traceback.format_exc().strip().splitlines()
        return {"kind": "TRACEBACK", "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "tail": tb[-6:], "seconds": time.perf_counter() - t0}  # fmt: skip
    seconds = time.perf_counter() - t0
    text = err.getvalue().strip()
    if code != 0:
        lines = [l for l in text.splitlines() if l.strip()]
        kind = "ERROR" if code == 2 and len(lines) == 1 else "BAD-ERROR"
        return {"kind": kind, "error": lines[-1] if lines else f"exit {code}, nothing on stderr", "lines": len(lines),
                "seconds": seconds}  # fmt: skip
    records = read_metrics(run_dir)
    return {"kind": "OK", "losses": [r["loss"] for r in records if "loss" in r], "seconds": seconds}


def main_(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--meshes", default=None, help="only these mesh labels (';'-separated), besides data=8")
    args = p.parse_args(argv)
    only = None if args.meshes is None else set(args.meshes.split(";"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = corpus(root)
        header = f"{'preset':<15} {'mesh':<26} {'max rel diff':>12} {'last/data=8':>12} {'s':>6}  note"
        print(header)
        print("-" * len(header), flush=True)
        for preset in args.presets.split(","):
            ref = None
            for label, extra in meshes(preset):
                if label != "data=8" and only is not None and label not in only:
                    continue
                r = run(preset, label, extra, args.steps, data, root)
                row = {"preset": preset, "mesh": label, **r}
                if r["kind"] == "OK" and label == "data=8":
                    ref = r["losses"]
                    diff, ratio, note = 0.0, 1.0, f"losses {ref[0]:.4f} -> {ref[-1]:.4f}"
                elif r["kind"] == "OK" and ref is not None and len(r["losses"]) == len(ref):
                    diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
                    ratio = r["losses"][-1] / ref[-1]
                    note = "" if diff <= 1e-5 else "DIFFERS (> 1e-5)"
                elif r["kind"] == "OK":
                    diff, ratio, note = math.nan, math.nan, f"no reference or {len(r['losses'])} steps logged"
                else:
                    diff, ratio, note = math.nan, math.nan, f"{r['kind']}: {r['error']}"
                row.update(max_rel_diff=diff, last_ratio=ratio)
                rows.append(row)
                print(f"{preset:<15} {label:<26} {diff:>12.2e} {ratio:>12.6f} {r['seconds']:>6.1f}  {note}", flush=True)
                if r["kind"] == "TRACEBACK":
                    for line in r["tail"]:
                        print(f"{'':<43}| {line}", flush=True)
    print(json.dumps([{k: v for k, v in r.items() if k != "losses"} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main_())
