"""What checkpoint checksums cost: save and restore of gpt2 (124M) with and without them.

    python bench/checkpoint_integrity.py [--model gpt2] [--mesh fsdp=8] [--rounds 3] [--dir DIR]

The state is the one ``nnxscale train`` saves: parameters, AdamW moments, step and key
(``setup`` + ``init_state``; for gpt2 float32, 373M numbers, 1.49 GB), laid out on the mesh
of simulated CPU devices. Each round saves it with :class:`nnxscale.Checkpointer`
and restores it onto the same layout, once with checksums (as shipped) and once without
(no checksum programs at save, no verification at restore: how a checkpoint saved before
checksums restores). The two are interleaved and each figure is the median over
rounds, so a noisy neighbour on a shared machine does not decide the result.

  save      ``save()`` then ``wait()``: from the call until the step is final on disk
  blocks    the part of ``save()`` the training loop waits for (the rest is background)
  restore   ``restore()`` of the latest step, verification included
  checksum  the checksum of the whole state alone (what ``save`` and ``restore`` each add)

The last line is JSON: ``{"save": ratio, "restore": ratio, "blocks": ratio}``, each the
median time with checksums over the median without.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from unittest import mock

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from nnxscale.checkpoint import integrity as integrity  # noqa: E402
from nnxscale.checkpoint.checkpointer import Checkpointer, _PendingChecksums  # noqa: E402
from nnxscale.training.config import TrainConfig  # noqa: E402
from nnxscale.training.state import init_state, setup  # noqa: E402


def one_round(state, target, directory: str, checksums: bool) -> dict[str, float]:
    """Save ``state`` as step 1 in a fresh ``directory``, restore it; seconds per phase."""
    shutil.rmtree(directory, ignore_errors=True)
    fake = contextlib.ExitStack()
    fake.enter_context(mock.patch.object(integrity, "partial_sums", lambda leaves, algorithm=None: []))
    fake.enter_context(mock.patch.object(_PendingChecksums, "resolve", lambda self: {
        "algorithm": integrity.ALGORITHM, "process": 0, "processes": 1, "arrays": {}}))
    fake.enter_context(mock.patch.object(Checkpointer, "_verify", lambda *args: None))
    with contextlib.nullcontext() if checksums else fake:
        with Checkpointer(directory, keep=1) as ckpt:
            t0 = time.perf_counter()
            ckpt.save(1, state, {"bench": True})
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            restored, _ = ckpt.restore(target)
            jax.block_until_ready(restored)
            t3 = time.perf_counter()
    del restored
    return {"save": t2 - t0, "blocks": t1 - t0, "restore": t3 - t2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--mesh", default="fsdp=8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()

    s = setup(TrainConfig.from_flags(model=args.model, mesh=args.mesh))
    state = jax.block_until_ready(init_state(s))
    leaves = jax.tree.leaves(state)
    numbers = sum(x.size for x in leaves)
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
    print(f"{args.model} train state (params + AdamW moments), float32: {numbers:,} numbers, "
          f"{nbytes / 1e9:.2f} GB on mesh {args.mesh} ({jax.device_count()} {jax.devices()[0].platform} devices); "
          f"{args.rounds} rounds, median")  # fmt: skip

    t = time.perf_counter()
    integrity.checksums(leaves)
    first = time.perf_counter() - t
    alone = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        integrity.checksums(leaves)
        alone.append(time.perf_counter() - t)
    checksum_s = statistics.median(alone)
    print(f"checksum of the whole state: {checksum_s:.2f} s ({nbytes / checksum_s / 1e9:.1f} GB/s; "
          f"first call {first:.2f} s, with compilation)")  # fmt: skip

    root = args.dir or tempfile.mkdtemp(prefix="nnxscale_bench_")
    directory = os.path.join(root, "checkpoints")
    times = {True: [], False: []}
    try:
        one_round(state, s.abstract, directory, True)  # warm-up: first-call costs of orbax and jax
        for _ in range(args.rounds):
            for checksums in (True, False):
                times[checksums].append(one_round(state, s.abstract, directory, checksums))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    median = {c: {k: statistics.median(r[k] for r in rounds) for k in ("save", "blocks", "restore")}
              for c, rounds in times.items()}  # fmt: skip
    print(f"{'':18}{'save s':>10}{'blocks s':>10}{'restore s':>11}")
    for checksums, label in ((False, "without checksums"), (True, "with checksums")):
        m = median[checksums]
        print(f"{label:18}{m['save']:10.2f}{m['blocks']:10.2f}{m['restore']:11.2f}")
    ratios = {k: round(median[True][k] / median[False][k], 2) for k in ("save", "restore", "blocks")}
    print(f"{'ratio':18}{ratios['save']:10.2f}{ratios['blocks']:10.2f}{ratios['restore']:11.2f}")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
