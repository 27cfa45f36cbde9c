"""Pipeline parallelism on 8 CPU devices: memory, permutes and bubble compiled, step time measured.

Three parts, one run (``python bench/pipeline.py``, about 10 minutes on 2 cores; part 3 alone:
``python bench/pipeline.py --schedules``):

1. **Compiled ahead of time, nothing allocated**: nnxscale's real train step for gpt2
   (124M, float32, no remat), global batch 64 x 256 tokens, on ``data=8`` (the baseline)
   and pipelined: GPipe on ``stage=2,data=4`` at M = 4, 8, 16 microbatches and on
   ``stage=4,data=2`` at M = 8; circular (R = 2 repeats) on ``stage=2,data=4`` at M = 4, 8.
   Per device: the compiler's temporaries and peak (``memory_analysis()``), the
   ``collective-permute`` bytes of a step counted in the compiled HLO beside
   :func:`nnxscale.layers.pipeline.pipeline_cost`'s figure, every collective's bytes, and the
   theoretical bubble ``(S-1)/(R*M+S-1)``.
2. **Measured**: the step time of ``gpt2-mini`` (4 layers, width 128), global batch 32 x 128,
   on ``data=8`` and on ``stage=2,data=4`` with GPipe (M=4) and circular (R=2, M=4), the same
   global batch; median of 15 steps after 3 of warm-up, the three configs timed in turns
   (so that a shared machine's load falls on each alike), as a ratio to ``data=8``.

3. **The schedules**: GPipe against 1F1B (``--pipeline-schedule 1f1b``). Compiled: gpt2 on
   ``stage=4,data=2`` at M = 8, 16, 32 with 2 rows x 256 tokens per microbatch and data
   shard (the batch grows with M), temporaries per device. Measured: gpt2-mini on
   ``stage=2,data=4`` at M=8, global batch 32 x 128, both schedules with remat none and
   full, timed in turns.

4. **Interleaved and experts** (``--interleaved``, not part of the full run): the same
   memory table for R=2 on ``stage=2,data=4`` (circular against interleaved 1F1B), and step
   times of gpt2-mini (M=8, R=2) and of mixtral-mini on ``stage=2,expert=4`` (M=4), whose
   1F1B step runs a forward pass for the router statistics first, timed in turns.

5. **LoRA** (``--lora``, not part of the full run): gpt2 with ``--remat full`` on
   ``stage=2,data=4`` at M = 8 and 32 (2 rows x 256 tokens per microbatch and data shard),
   LoRA rank 16 on every linear layer of the blocks with GPipe, 1F1B and interleaved
   1F1B (R=2), and the full fine-tune with 1F1B: compiled temporaries per device. The 1F1B
   ring keeps each layer's input under remat full; a schedule that kept the frozen base in
   it would grow past the full fine-tune's. Last line, JSON: the ratios.

Last line, JSON: ``{"gpipe_bubble", "circular_bubble", "pp_over_dp_step_time", ...}``: the
bubbles of gpt2 on ``stage=2,data=4`` at M=8 (GPipe, and circular with R=2), the
measured GPipe step time over the ``data=8`` one, and part 3's ratios: temporaries at M=32
over M=8 for each schedule, 1F1B's over GPipe's at M=16, and 1F1B's step time over GPipe's.

**What the CPU ratio predicts, and what it does not.** The 8 devices are threads of one
2-core process, so the measured ratio is the compute the pipeline adds over data
parallelism, and not what it saves in communication. It includes the bubble as real idle
(or rather, wasted) compute: every stage computes all ``R*M + S - 1`` iterations, the
bubble's on stale data, so at M=4 on 2 stages 25% more layer work than the useful work, and
the microbatch bookkeeping of the scan (buffer updates, selects). It includes collectives
only as memory copies: a ``ppermute`` between two simulated devices is a memcpy in shared
memory, and the gradient all-reduce over 8 devices that data parallelism needs (and the
pipeline shrinks, each stage reducing only its own layers over 4 devices) is nearly free.
So on real accelerators joined by slow links (between nodes), where data parallelism's
all-reduce of every parameter is what limits the step, the pipeline does better than this
ratio says; within a node with fast links, this ratio is close to an upper bound of the
bubble's cost: expect ``1 + bubble`` or so when the pipeline's permutes overlap compute.
Small microbatches also use an accelerator less well (a few rows per matmul), which 2 CPU
cores cannot show.

Measured (2 cores shared with another test run, load average about 5.8): GPipe M=4 1.51x
``data=8``, circular R=2 M=4 1.07x. The bubble alone predicts about 1.25x and 1.125x (the
share of wasted iterations): the circular step is close to it; the GPipe step costs more
than its bubble on this machine, not investigated further (noise on a loaded machine, or
XLA:CPU scheduling of the two-layer stage body). Bytes and bubbles are exact; times are not.
The full output of one run is in ``bench/pipeline.out.txt``.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from nnxscale.training.config import TrainConfig  # noqa: E402
from nnxscale.sharding.layout import format_bytes  # noqa: E402
from nnxscale.planning.compiler import measure  # noqa: E402
from nnxscale.training.state import setup  # noqa: E402
from nnxscale.training.step import make_train_step  # noqa: E402
from _step import prepared_step  # noqa: E402  (bench/_step.py)
from nnxscale.layers.pipeline import pipeline_cost  # noqa: E402

BATCH, SEQ = 64, 256  # compiled part: gpt2
COMPILED = [  # (mesh, microbatches, repeats)
    ("data=8", None, 1),
    ("stage=2,data=4", 4, 1),
    ("stage=2,data=4", 8, 1),
    ("stage=2,data=4", 16, 1),
    ("stage=4,data=2", 8, 1),
    ("stage=2,data=4", 4, 2),
    ("stage=2,data=4", 8, 2),
]
TIMED_BATCH, TIMED_SEQ = 32, 128  # measured part: gpt2-mini
TIMED = [("data=8", None, 1), ("stage=2,data=4", 4, 1), ("stage=2,data=4", 4, 2)]
WARMUP, STEPS = 3, 15
# Part 3: memory against M for both schedules (gpt2 on stage=4,data=2, 2 rows x 256 tokens per
# microbatch and data shard, so the batch grows with M), and the step time of 1F1B against
# GPipe for gpt2-mini on stage=2,data=4 at M=8 (global batch 32 x 128), with and without remat.
SCHEDULE_MESH, SCHEDULE_MS, SCHEDULE_ROWS, SCHEDULE_SEQ = "stage=4,data=2", (8, 16, 32), 2, 256
SCHEDULE_TIMED = [("none", "gpipe"), ("none", "1f1b"), ("full", "gpipe"), ("full", "1f1b")]
# Part 4 (--interleaved): the same for R=2 (circular against interleaved 1F1B) on stage=2,data=4
# (gpt2's 12 layers in 4 groups of 3), and step times: gpt2-mini at M=8 with R=2, and a mixture
# of experts (mixtral-mini on stage=2,expert=4, M=4), whose 1F1B step runs a forward pass first.
INTERLEAVED_MESH, INTERLEAVED_MS = "stage=2,data=4", (8, 16, 32)
MORE_TIMED = [  # (model, mesh, microbatches, repeats, schedule)
    ("gpt2-mini", "stage=2,data=4", 8, 2, "gpipe"),
    ("gpt2-mini", "stage=2,data=4", 8, 2, "1f1b"),
    ("mixtral-mini", "stage=2,expert=4", 4, 1, "gpipe"),
    ("mixtral-mini", "stage=2,expert=4", 4, 1, "1f1b"),
]


# Part 5 (--lora): LoRA rank 16 against the full fine-tune, remat full, on stage=2,data=4.
LORA_MS, LORA_RANK = (8, 32), 16
LORA_ROWS = [("gpipe", 1, LORA_RANK), ("1f1b", 1, None), ("1f1b", 1, LORA_RANK), ("1f1b", 2, LORA_RANK)]  # (schedule, R, rank)


def config(model: str, mesh: str, microbatches, repeats: int, batch: int, seq: int, schedule: str = "gpipe",
           remat: str = "none", lora=None) -> TrainConfig:  # fmt: skip
    return TrainConfig.from_flags(model=model, mesh=mesh, microbatches=microbatches, pipeline_repeats=repeats,
                                  batch_size=batch, seq_len=seq, pipeline_schedule=schedule, remat=remat,
                                  **({"lora_rank": lora} if lora else {}))  # fmt: skip


def name(mesh: str, microbatches, repeats: int) -> str:
    if microbatches is None:
        return mesh
    return f"{mesh} {'GPipe' if repeats == 1 else f'circ R={repeats}'} M={microbatches}"


def schedule_memory(mesh: str = SCHEDULE_MESH, ms: tuple = SCHEDULE_MS, repeats: int = 1) -> dict:
    """Compiled temporaries per device of gpt2's step on ``mesh`` at each M, both schedules."""
    stages = int(mesh.split("stage=")[1].split(",")[0])
    shards = 8 // stages
    print(f"gpt2 (124M) train step on {mesh}, R={repeats}, {SCHEDULE_ROWS} rows x {SCHEDULE_SEQ} tokens per microbatch "
          f"and data shard, float32, no remat (compiled, not run)")  # fmt: skip
    header = f"{'schedule':<10}{'M':>4}{'batch':>7}{'temp/dev':>11}{'peak/dev':>11}{'permute/dev':>13}{'all-reduce/dev':>16}"
    print(header)
    print("-" * len(header))
    rows = {}
    for schedule in ("gpipe", "1f1b"):
        for m in ms:
            batch = SCHEDULE_ROWS * m * shards
            s = setup(config("gpt2", mesh, m, repeats, batch, SCHEDULE_SEQ, schedule))
            with jax.set_mesh(s.mesh):
                fig = measure(make_train_step(s).lower(s.abstract, s.abstract_batch).compile())
            coll = fig["collective_bytes"]
            rows[(schedule, m)] = fig["temp_bytes"]
            print(f"{schedule:<10}{m:>4}{batch:>7}{format_bytes(fig['temp_bytes']):>11}{format_bytes(fig['peak_bytes']):>11}"
                  f"{format_bytes(coll.get('collective-permute', 0)):>13}{format_bytes(coll.get('all-reduce', 0)):>16}",
                  flush=True)  # fmt: skip
    lo, mid, hi = ms
    print(f"temp at M={hi} over M={lo}: GPipe {rows[('gpipe', hi)] / rows[('gpipe', lo)]:.2f}x, "
          f"1F1B {rows[('1f1b', hi)] / rows[('1f1b', lo)]:.2f}x; at M={mid} 1F1B over GPipe "
          f"{rows[('1f1b', mid)] / rows[('gpipe', mid)]:.2f}x")  # fmt: skip
    return rows


def schedule_times() -> dict:
    """Median seconds per step of gpt2-mini on stage=2,data=4, M=8, each (remat, schedule), timed in turns."""
    runs = {c: prepared_step(config("gpt2-mini", "stage=2,data=4", 8, 1, TIMED_BATCH, TIMED_SEQ, c[1], c[0]))
            for c in SCHEDULE_TIMED}  # fmt: skip
    return timed_in_turns(runs)


def more_times() -> dict:
    """Median seconds per step of each MORE_TIMED config (global batch 32 x 128), timed in turns."""
    runs = {c: prepared_step(TrainConfig.from_flags(model=c[0], mesh=c[1], microbatches=c[2], pipeline_repeats=c[3],
                                                    pipeline_schedule=c[4], batch_size=TIMED_BATCH, seq_len=TIMED_SEQ))
            for c in MORE_TIMED}  # fmt: skip
    return timed_in_turns(runs)


def interleaved() -> dict:
    """Part 4: memory against M for R=2 (circular and interleaved 1F1B), and MORE_TIMED's step times."""
    memory = schedule_memory(INTERLEAVED_MESH, INTERLEAVED_MS, repeats=2)
    print()
    print(f"train step, global batch {TIMED_BATCH} x {TIMED_SEQ}, measured (median of {STEPS} steps, timed in turns)")
    times = more_times()
    for (model, mesh, m, r, schedule), seconds in times.items():
        base = times[(model, mesh, m, r, "gpipe")]
        label = f"{model} {mesh} M={m} R={r} {schedule}"
        print(f"  {label:<45}{seconds * 1e3:>9.1f} ms  {seconds / base:5.2f}x {'circular' if r > 1 else 'GPipe'}")
    lo, mid, hi = INTERLEAVED_MS
    gpt2, moe = MORE_TIMED[0][:4], MORE_TIMED[2][:4]
    result = {
        "circular_temp_growth": round(memory[("gpipe", hi)] / memory[("gpipe", lo)], 3),
        "interleaved_1f1b_temp_growth": round(memory[("1f1b", hi)] / memory[("1f1b", lo)], 3),
        "interleaved_1f1b_over_circular_temp": round(memory[("1f1b", mid)] / memory[("gpipe", mid)], 3),
        "interleaved_1f1b_over_circular_step_time": round(times[(*gpt2, "1f1b")] / times[(*gpt2, "gpipe")], 3),
        "moe_1f1b_over_gpipe_step_time": round(times[(*moe, "1f1b")] / times[(*moe, "gpipe")], 3),
    }
    print(json.dumps(result))
    return result


def compiled_rows() -> dict:
    print(f"gpt2 (124M) train step, global batch {BATCH} x {SEQ}, float32, no remat, 8 CPU devices (compiled, not run)")
    header = (f"{'config':<30}{'temp/dev':>11}{'peak/dev':>11}{'permute/dev':>13}{'pipeline_cost':>15}"
              f"{'all coll/dev':>14}{'bubble':>8}{'compile s':>11}")  # fmt: skip
    print(header)
    print("-" * len(header))
    rows = {}
    for mesh, m, r in COMPILED:
        cfg = config("gpt2", mesh, m, r, BATCH, SEQ)
        s = setup(cfg)
        t = time.perf_counter()
        with jax.set_mesh(s.mesh):
            compiled = make_train_step(s).lower(s.abstract, s.abstract_batch).compile()
        seconds = time.perf_counter() - t
        fig = measure(compiled)
        permute = fig["collective_bytes"].get("collective-permute", 0)
        expected, bubble = 0, 0.0
        if s.pipeline is not None:
            cost = pipeline_cost(s.pipeline, s.stacked_layers, (BATCH, SEQ, 768), batch_shards=s.rules.batch_shard_count)
            expected, bubble = cost.permute_bytes, cost.bubble
        key = name(mesh, m, r)
        rows[key] = dict(temp=fig["temp_bytes"], peak=fig["peak_bytes"], permute=permute, expected=expected,
                         collectives=sum(fig["collective_bytes"].values()), bubble=bubble, compile_s=seconds)  # fmt: skip
        print(
            f"{key:<30}{format_bytes(fig['temp_bytes']):>11}{format_bytes(fig['peak_bytes']):>11}{format_bytes(permute):>13}"
            f"{format_bytes(expected):>15}{format_bytes(rows[key]['collectives']):>14}{bubble:>8.1%}{seconds:>11.1f}",
            flush=True,
        )
    return rows


def step_times() -> dict:
    """Median seconds per step of each TIMED config, timed in turns (round-robin), so that
    the load of a shared machine falls on every config alike."""
    return timed_in_turns({name(*c): prepared_step(config("gpt2-mini", *c, TIMED_BATCH, TIMED_SEQ)) for c in TIMED})


def timed_in_turns(runs: dict) -> dict:
    """``{key: median seconds of run()}``: WARMUP calls each, then STEPS rounds of one call each."""
    for run in runs.values():
        for _ in range(WARMUP):
            run()
    times = {key: [] for key in runs}
    for _ in range(STEPS):
        for key, run in runs.items():
            t = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - t)
    return {key: statistics.median(ts) for key, ts in times.items()}


def lora_memory() -> dict:
    """Part 5: compiled temporaries per device of gpt2's step with LoRA and without, remat full."""
    mesh, shards = INTERLEAVED_MESH, 4
    print(f"gpt2 (124M) train step on {mesh}, {SCHEDULE_ROWS} rows x {SCHEDULE_SEQ} tokens per microbatch and data "
          f"shard, float32, remat full; LoRA rank {LORA_RANK} on every linear layer of the blocks (compiled, not run)")
    header = f"{'schedule':<10}{'R':>3}{'trains':>8}{'M':>4}{'batch':>7}{'temp/dev':>11}{'peak/dev':>11}"
    print(header)
    print("-" * len(header))
    rows = {}
    for schedule, repeats, lora in LORA_ROWS:
        for m in LORA_MS:
            batch = SCHEDULE_ROWS * m * shards
            s = setup(config("gpt2", mesh, m, repeats, batch, SCHEDULE_SEQ, schedule, "full", lora))
            with jax.set_mesh(s.mesh):
                fig = measure(make_train_step(s).lower(s.abstract, s.abstract_batch).compile())
            rows[(schedule, repeats, lora, m)] = fig["temp_bytes"]
            trains = "LoRA" if lora else "all"
            print(f"{schedule:<10}{repeats:>3}{trains:>8}{m:>4}{batch:>7}{format_bytes(fig['temp_bytes']):>11}"
                  f"{format_bytes(fig['peak_bytes']):>11}", flush=True)  # fmt: skip
    lo, hi = LORA_MS
    result = {
        "lora_1f1b_temp_growth": round(rows[("1f1b", 1, LORA_RANK, hi)] / rows[("1f1b", 1, LORA_RANK, lo)], 3),
        "lora_interleaved_1f1b_temp_growth": round(rows[("1f1b", 2, LORA_RANK, hi)] / rows[("1f1b", 2, LORA_RANK, lo)], 3),
        "lora_gpipe_temp_growth": round(rows[("gpipe", 1, LORA_RANK, hi)] / rows[("gpipe", 1, LORA_RANK, lo)], 3),
        "lora_over_full_1f1b_temp": {m: round(rows[("1f1b", 1, LORA_RANK, m)] / rows[("1f1b", 1, None, m)], 3)
                                     for m in LORA_MS},  # fmt: skip
    }
    print(f"temp at M={hi} over M={lo} with LoRA: 1F1B {result['lora_1f1b_temp_growth']:.2f}x, interleaved 1F1B "
          f"{result['lora_interleaved_1f1b_temp_growth']:.2f}x, GPipe {result['lora_gpipe_temp_growth']:.2f}x")  # fmt: skip
    print(json.dumps(result))
    return result


def print_schedule_times(sched: dict) -> None:
    for (remat, schedule), seconds in sched.items():
        print(f"  remat {remat:<5} {schedule:<6}{seconds * 1e3:>9.1f} ms  {seconds / sched[(remat, 'gpipe')]:5.2f}x GPipe")


def schedule_result(memory: dict, sched: dict) -> dict:
    """Part 3's figures: ``schedule_memory``'s growth and ratio, ``schedule_times``'s ratios."""
    lo, mid, hi = SCHEDULE_MS
    return {
        "gpipe_temp_growth": round(memory[("gpipe", hi)] / memory[("gpipe", lo)], 3),
        "1f1b_temp_growth": round(memory[("1f1b", hi)] / memory[("1f1b", lo)], 3),
        "1f1b_over_gpipe_temp": round(memory[("1f1b", mid)] / memory[("gpipe", mid)], 3),
        "1f1b_over_gpipe_step_time": round(sched[("none", "1f1b")] / sched[("none", "gpipe")], 3),
        "1f1b_over_gpipe_step_time_remat_full": round(sched[("full", "1f1b")] / sched[("full", "gpipe")], 3),
    }


def main() -> None:
    if "--lora" in os.sys.argv:  # part 5 alone
        lora_memory()
        return
    if "--interleaved" in os.sys.argv:  # part 4 alone
        interleaved()
        return
    if "--schedules" in os.sys.argv:  # part 3 alone (about 2 minutes on 2 idle cores)
        memory = schedule_memory()
        print()
        sched = schedule_times()
        print_schedule_times(sched)
        print(json.dumps(schedule_result(memory, sched)))
        return
    rows = compiled_rows()
    print("permute/dev: collective-permute bytes per device per step in the compiled HLO; pipeline_cost: the")
    print("analytical figure (one microbatch of activations per iteration, forward and backward); all coll/dev:")
    print("every collective's bytes per device per step; bubble (S-1)/(R*M+S-1)")
    print()
    print(f"gpt2-mini train step, global batch {TIMED_BATCH} x {TIMED_SEQ}, measured (median of {STEPS} steps, timed in turns)")
    times = step_times()
    base = times[name(*TIMED[0])]
    for key, seconds in times.items():
        print(f"  {key:<30}{seconds * 1e3:>9.1f} ms  {seconds / base:5.2f}x data=8")
    gpipe = times[name(*TIMED[1])] / times[name(*TIMED[0])]
    print()
    memory = schedule_memory()
    print()
    print(f"gpt2-mini train step on stage=2,data=4, M=8, global batch {TIMED_BATCH} x {TIMED_SEQ}, measured (median of "
          f"{STEPS} steps, timed in turns)")  # fmt: skip
    sched = schedule_times()
    print_schedule_times(sched)
    result = {
        "gpipe_bubble": round(rows[name("stage=2,data=4", 8, 1)]["bubble"], 4),
        "circular_bubble": round(rows[name("stage=2,data=4", 8, 2)]["bubble"], 4),
        "pp_over_dp_step_time": round(gpipe, 3),
        **schedule_result(memory, sched),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
