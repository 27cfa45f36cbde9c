"""Jobs of several processes on this machine: the loss gap of 2 x 4 devices against 1 x 8,
and how long a job takes to end when one of its processes dies or raises.

    python bench/multiprocess.py [--steps 6] [--out DIR]

Every run is ``nnxscale train`` on ``gpt2-tiny`` (batch 16 x 32 tokens, ~280 KB of
standard-library source, a learning-rate schedule that ignores ``--steps``), as in the tests.

1. ``loss_gap``: per mesh (``data=8``, ``fsdp=8``, ``data=4,model=2``), one run in 1 process
   x 8 devices and one under ``nnxscale launch -n 2 --cpu-devices 4``; the largest relative
   difference of the per-step losses.
2. ``death_to_exit_s``: a 2-process job trains; once it has logged step 3, process 1 gets
   ``kill -9``; seconds from the kill until the job has ended: under ``nnxscale launch``
   (the launcher's exit) and with the processes started by hand with ``--coordinator``
   etc. (the survivor's exit: JAX's heartbeat, ``--heartbeat-timeout`` 10 s).
3. ``raise_to_exit_s``: process 1 raises at its third step (started by hand); seconds from
   the exception until process 0 has exited (nnxscale's failure key and watchdog).

The last line is JSON with these figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

MESHES = ("data=8", "fsdp=8", "data=4,model=2")
TINY = [
    "--model", "gpt2-tiny", "--batch-size", "16", "--seq-len", "32", "--log-every", "1", "--eval-every", "0",
    "--save-every", "0", "--warmup-steps", "2", "--min-lr-ratio", "1.0", "--no-progress",
]  # fmt: skip
ENV = {k: v for k, v in os.environ.items() if not k.startswith("NNXSCALE_")}

# Process 1 raises at its third step and prints when.
RAISES = """
import os, sys, time
import nnxscale.training.loop as t
if os.environ["NNXSCALE_PROCESS_ID"] == "1":
    real = t.make_train_step
    def make(s, **options):
        step, calls = real(s, **options), []
        def maybe_raise(state, batch, *votes):
            calls.append(1)
            if len(calls) == 3:
                print(f"RAISED_AT {time.time()}", file=sys.stderr, flush=True)
                raise RuntimeError("boom")
            return step(state, batch, *votes)
        return maybe_raise
    t.make_train_step = make
from nnxscale.cli.commands import run
sys.argv[0] = "nnxscale"
run()
"""


def nnxscale(*args) -> list[str]:
    return [sys.executable, "-m", "nnxscale", *args]


def train_args(data, run_dir, mesh, steps) -> list[str]:
    return ["train", *TINY, "--data", str(data), "--run-dir", str(run_dir), "--mesh", mesh, "--steps", str(steps)]


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_step(run_dir, step: int) -> None:
    path = Path(run_dir) / "metrics.jsonl"
    while not path.exists() or len(path.read_text().splitlines()) <= step:
        time.sleep(0.05)


def by_hand(command: list[str], processes: int, **popen) -> list[subprocess.Popen]:
    """The processes of a job started without the launcher (explicit coordinator, count, id)."""
    port = free_port()
    return [
        subprocess.Popen(
            command, env=dict(ENV, NNXSCALE_COORDINATOR=f"127.0.0.1:{port}", NNXSCALE_NUM_PROCESSES=str(processes),
                              NNXSCALE_PROCESS_ID=str(i), NNXSCALE_CPU_DEVICES="4",
                              XLA_FLAGS="--xla_force_host_platform_device_count=4"),  # fmt: skip
            stdout=subprocess.DEVNULL, **popen,
        )  # fmt: skip
        for i in range(processes)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="nnxscale-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / "corpus.txt"  # the tests' corpus: ~280 KB of standard-library source
    data.write_text("\n".join(inspect.getsource(m) for m in (argparse, dataclasses, inspect, typing)))
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, check=True)

    gaps = {}
    for mesh in MESHES:
        one, two = out / f"1x8-{mesh}", out / f"2x4-{mesh}"
        subprocess.run(nnxscale(*train_args(data, one, mesh, args.steps)), **quiet)
        subprocess.run(nnxscale("launch", "-n", "2", "--cpu-devices", "4", "--", *train_args(data, two, mesh, args.steps)), **quiet)
        gaps[mesh] = max(abs(a - b) / abs(a) for a, b in zip(losses(one), losses(two)))
        print(f"{mesh:16s} 2x4 vs 1x8: largest relative loss difference over {args.steps} steps {gaps[mesh]:.2e}")

    death = {}
    run_dir = out / "killed-launch"
    job = subprocess.Popen(nnxscale("launch", "-n", "2", "--cpu-devices", "4", "--", *train_args(data, run_dir, "data=8", 10_000)),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)  # fmt: skip
    wait_for_step(run_dir, 3)
    child = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == job.pid and _job_id(int(p)) == "1")
    os.kill(child, signal.SIGKILL)
    killed = time.monotonic()
    job.wait()
    death["launch"] = time.monotonic() - killed
    run_dir = out / "killed-by-hand"
    procs = by_hand(nnxscale(*train_args(data, run_dir, "data=8", 10_000)), 2, stderr=subprocess.DEVNULL)
    wait_for_step(run_dir, 3)
    procs[1].kill()
    killed = time.monotonic()
    procs[0].wait()
    death["no_launcher"] = time.monotonic() - killed
    print(f"kill -9 of process 1 -> job ended: {death['launch']:.1f} s under nnxscale launch, "
          f"{death['no_launcher']:.1f} s without it (exit {procs[0].returncode})")  # fmt: skip

    procs = by_hand([sys.executable, "-c", RAISES, *train_args(data, out / "raised", "data=8", 10_000)], 2,
                    stderr=subprocess.PIPE, text=True)  # fmt: skip
    err1 = procs[1].communicate()[1]
    procs[0].communicate()
    ended = time.time()
    raised = float(next(line.split()[1] for line in err1.splitlines() if line.startswith("RAISED_AT")))
    print(f"process 1 raised -> process 0 exited {ended - raised:.1f} s later (exit {procs[0].returncode})")
    print(json.dumps({"loss_gap": gaps, "death_to_exit_s": {k: round(v, 1) for k, v in death.items()},
                      "raise_to_exit_s": round(ended - raised, 1)}))  # fmt: skip


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _job_id(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return ""
    return env.get(b"NNXSCALE_PROCESS_ID", b"").decode()


if __name__ == "__main__":
    main()
