"""Soak: kill a random worker of a 2-process job at a random step, resume, compare; N times.

    python bench/soak.py [--runs 20] [--steps 30] [--seed 0] [--dir DIR]

Each run launches ``nnxscale launch -n 2 --cpu-devices 4 -- train`` (gpt2-tiny, batch
16 x 32, ``--save-every 1``, an evaluation every 5 steps, ``--hang-timeout 120``), waits
for a random step, sends ``kill -9`` to a random worker, waits for the launcher to end the
job, then runs the same command again to resume to the end. A launch that has not ended
within its limit counts as a hang (and is killed). The losses of every resumed run are
compared with one uninterrupted launch of the same command, to the tolerance the
multi-process tests use (loss 1e-5 relative, gradient norm 5e-4).

The last line is JSON: ``{"runs", "hangs", "resumed", "identical_to_uninterrupted"}``.
Not part of the test suite: 20 runs take about 30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import numpy as np

ENV = {k: v for k, v in os.environ.items() if not k.startswith("NNXSCALE_") and not k.startswith("JAX_COORDINATOR")}
KILL_LIMIT_S = 120  # a killed job must end within this
RUN_LIMIT_S = 600  # a whole launch must end within this


def command(run_dir: Path, data: Path, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "nnxscale", "launch", "-n", "2", "--cpu-devices", "4", "--",
        "train", "--model", "gpt2-tiny", "--batch-size", "16", "--seq-len", "32", "--mesh", "data=8",
        "--steps", str(steps), "--save-every", "1", "--eval-every", "5", "--log-every", "1",
        "--warmup-steps", "2", "--no-progress", "--hang-timeout", "120",
        "--data", str(data), "--run-dir", str(run_dir),
    ]  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the last line may be half written
            pass
    return out


def workers(launcher_pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                        pids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return pids


def finish(proc: subprocess.Popen, limit: float) -> bool:
    """Wait for ``proc``; ``False`` (and kill its group) if it is still running after ``limit``."""
    try:
        proc.wait(timeout=limit)
        return True
    except subprocess.TimeoutExpired:
        for pid in workers(proc.pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()
        return False


def same(got: list[dict], want: list[dict]) -> bool:
    want = {r["step"]: r for r in want}
    if [r["step"] for r in got] != sorted(want):
        return False
    return all(
        np.isclose(r["loss"], want[r["step"]]["loss"], rtol=1e-5, atol=0)
        and np.isclose(r["grad_norm"], want[r["step"]]["grad_norm"], rtol=5e-4, atol=0)
        for r in got
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(args.dir or tempfile.mkdtemp(prefix="nnxscale_soak_"))
    root.mkdir(parents=True, exist_ok=True)
    data = root / "corpus.txt"  # the tests' corpus: a few standard-library modules' source
    data.write_text("\n".join(inspect.getsource(m) for m in (argparse, dataclasses, inspect, typing)))

    t0 = time.monotonic()
    ref_dir = root / "uninterrupted"
    ref = subprocess.Popen(command(ref_dir, data, args.steps), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not finish(ref, RUN_LIMIT_S) or ref.returncode != 0:
        sys.exit(f"the uninterrupted reference run failed or hung (exit {ref.returncode})")
    want = metrics(ref_dir)
    print(f"uninterrupted: {len(want)} steps in {time.monotonic() - t0:.0f} s", flush=True)

    hangs = resumed = identical = 0
    for n in range(args.runs):
        run_dir = root / f"run_{n}"
        kill_at, victim = rng.randint(2, args.steps - 3), rng.randint(0, 1)
        job = subprocess.Popen(command(run_dir, data, args.steps), env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        started = time.monotonic()
        while (not metrics(run_dir) or metrics(run_dir)[-1]["step"] < kill_at) and job.poll() is None:
            if time.monotonic() - started > RUN_LIMIT_S:
                break
            time.sleep(0.05)
        pids = sorted(workers(job.pid))
        killed_at = metrics(run_dir)[-1]["step"] if metrics(run_dir) else 0
        if job.poll() is None and len(pids) == 2:
            os.kill(pids[victim], signal.SIGKILL)
        t_kill = time.monotonic()
        ended = finish(job, KILL_LIMIT_S)
        end_s = time.monotonic() - t_kill
        hangs += not ended
        again = subprocess.Popen(command(run_dir, data, args.steps), env=ENV, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
        done = finish(again, RUN_LIMIT_S)
        hangs += not done
        ok = done and again.returncode == 0
        resumed += ok
        match = ok and same(metrics(run_dir), want)
        identical += match
        print(f"run {n + 1}/{args.runs}: killed process {victim} at step {killed_at}, job ended in {end_s:.1f} s"
              f"{'' if ended else ' (HUNG)'}; resume {'ok' if ok else f'FAILED (exit {again.returncode})'}"
              f"{', identical' if match else ', DIFFERENT' if ok else ''}", flush=True)  # fmt: skip
        if match:
            shutil.rmtree(run_dir, ignore_errors=True)
    if args.dir is None and hangs == 0 and identical == args.runs:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"runs": args.runs, "hangs": hangs, "resumed": resumed, "identical_to_uninterrupted": identical}))


if __name__ == "__main__":
    main()
