"""CPU seconds spent tracing, lowering and XLA:CPU-compiling the test suite's kind of programs,
under one setting of JAX/XLA options, from a cold compilation cache (issue 30).

    python bench/compile_settings.py                      # every setting, 2 runs each, one child each
    python bench/compile_settings.py --one NAME           # (internal) one setting in this process

Each run is a fresh child process (XLA_FLAGS are read once per process) with the suite's flags
(tests/conftest.py: 8 CPU devices, LLVM -O0, fusion emitters off where the jaxlib knows them) plus
the setting's. Figures are CPU seconds (getrusage), not wall: the machine is shared.
"""

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile

BASE = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
SETTINGS = {  # name -> (extra XLA flags, extra env)
    "base": ("", {}),
    "tb_limit0": ("", {"JAX_TRACEBACK_IN_LOCATIONS_LIMIT": "0"}),
    "no_full_tb": ("", {"JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS": "false"}),
    "llvm_cheap": ("--xla_llvm_disable_expensive_passes=true", {}),
    "split1": ("--xla_cpu_parallel_codegen_split_count=1", {}),
    "shardy_off": ("", {"JAX_USE_SHARDY_PARTITIONER": "false"}),
    "shardy_on": ("", {"JAX_USE_SHARDY_PARTITIONER": "true"}),
    "no_conc_sched": ("--xla_cpu_enable_concurrency_optimized_scheduler=false", {}),
    "tb0": ("", {"JAX_TRACEBACK_IN_LOCATIONS_LIMIT": "0", "JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS": "false"}),
    "xla_combo": ("--xla_llvm_disable_expensive_passes=true --xla_cpu_parallel_codegen_split_count=1"
                  " --xla_cpu_enable_concurrency_optimized_scheduler=false", {}),
    "all": ("--xla_llvm_disable_expensive_passes=true --xla_cpu_parallel_codegen_split_count=1"
            " --xla_cpu_enable_concurrency_optimized_scheduler=false",
            {"JAX_TRACEBACK_IN_LOCATIONS_LIMIT": "0", "JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS": "false"}),
}
EVENTS = {"trace": "jaxpr_trace_duration", "lower": "jaxpr_to_mlir_module_duration", "compile": "backend_compile_duration"}
PROGRAMS = {
    "gpt2-mini data=8": {"model": "gpt2-mini", "mesh": "data=8"},
    "llama-mini fsdp=2,model=4": {"model": "llama-mini", "mesh": "fsdp=2,model=4"},
    "mixtral-tiny expert=2,data=4": {"model": "mixtral-tiny", "mesh": "expert=2,data=4"},
    "gpt2-mini stage=2,data=4": {"model": "gpt2-mini", "mesh": "stage=2,data=4", "microbatches": 4},
}


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one(programs) -> dict:
    import argparse as a, dataclasses as d, typing as t  # the suite's corpus
    import jax
    from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides
    from nnxscale.planning.trainer import train  # nnxscale.train

    sums = {k: 0.0 for k in EVENTS}

    def listen(event, duration, **_):
        for k, name in EVENTS.items():
            if event.endswith(name):
                sums[k] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.devices()
    tmp = tempfile.mkdtemp()
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("\n".join(inspect.getsource(m) for m in (a, d, inspect, t)))
    out = {}
    for name in programs:
        fields = {"steps": 3, "log_every": 1, "eval_every": 0, "save_every": 0, "min_shard_bytes": 0,
                  "run_dir": os.path.join(tmp, name.replace(" ", "_")), "data.data": corpus,
                  "data.seq_len": 32, "data.batch_size": 16, **PROGRAMS[name]}
        cfg = with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in fields.items()})
        before, c0 = dict(sums), cpu()
        train(cfg, progress=False, log=lambda _: None)
        out[name] = {"cpu": cpu() - c0, **{k: sums[k] - before[k] for k in EVENTS}}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--one")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--programs", default=";".join(PROGRAMS), help="names joined by ;")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    programs = args.programs.split(";")
    if args.one:
        print("RESULT " + json.dumps(one(programs)))
        return
    for rep in range(args.repeat):
        for name in args.settings.split(","):
            flags, env = SETTINGS[name]
            with tempfile.TemporaryDirectory() as cache:
                e = dict(os.environ, XLA_FLAGS=f"{BASE} {FUSION} {flags}".strip(), JAX_PLATFORMS="cpu",
                         JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env)
                r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                proc = subprocess.run([sys.executable, __file__, "--one", name, "--programs", args.programs],
                                      env=e, capture_output=True, text=True)
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            total = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(json.dumps({"setting": name, "rep": rep, "error": proc.stderr.strip()[-300:]}), flush=True)
                continue
            res = json.loads(lines[-1][7:])
            agg = {k: round(sum(v[k] for v in res.values()), 2) for k in ("cpu", *EVENTS)}
            print(json.dumps({"setting": name, "rep": rep, "process_cpu": round(total, 1), **agg,
                              "per_program": res}), flush=True)


import jax  # noqa: E402  (only to know which jaxlib: 0.12 dropped the fusion-emitter flag)
FUSION = "--xla_cpu_use_fusion_emitters=false" if jax.__version__.startswith("0.10") else ""

if __name__ == "__main__":
    main()
