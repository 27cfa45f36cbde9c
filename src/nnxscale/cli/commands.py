"""The ``nnxscale`` command. Thin: it parses arguments and calls the library.

On a machine without an accelerator JAX's CPU platform is split into 8 simulated devices
(``--cpu-devices N`` or ``NNXSCALE_CPU_DEVICES=N`` change it), so every mesh example works
out of the box; GPUs and TPUs are used as they are. The setting must reach XLA before jax
is imported, which is why this module imports nothing from jax at the top.

Every command that uses devices joins a job of several processes when asked (flags,
environment or a detected cluster: :mod:`nnxscale.jobs.distributed`); in such a job only
process 0 writes to standard output, and every process writes its errors to standard
error. ``nnxscale launch`` starts the processes of a job on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import traceback
import typing
from pathlib import Path
from typing import Optional

from nnxscale.errors import ConfigError, NnxscaleError
from nnxscale.jobs import distributed, jax_private
from nnxscale.jobs.launch import COMMANDS, launch
from nnxscale.jobs.process import owned_by_command
from nnxscale.sharding.devices import MEMORY
from nnxscale.training.config import (
    FIELD_TYPES,
    TrainConfig,
    fields_of,
    flatten,
    load_config_file,
    upgrade,
    with_overrides,
)
from nnxscale.training.observe import TENSORBOARD_DIR

# Every other nnxscale module the commands use imports jax, which must start only after
# configure_cpu_devices: each is imported inside the command that needs it.

DEFAULT_CPU_DEVICES = 8
#: Most simulated CPU devices: XLA's start-up grows faster than linearly with them
#: (measured: 1024 devices 0.9 s and 0.3 GB before any array, 4096 3 s and 0.6 GB,
#: 16384 more than a minute), and every replicated array is held once per device.
MAX_CPU_DEVICES = 1024


def configure_cpu_devices(n: Optional[int]) -> None:
    """Ask XLA for ``n`` CPU devices (default: $NNXSCALE_CPU_DEVICES or 8). Call before jax.

    Raises ConfigError for a count outside [1, MAX_CPU_DEVICES], from the flag or the
    environment variable, even when jax is already running. Then the count cannot be
    applied: a count asked for that differs from the running CPU backend's is one line on
    stderr, not silence.
    """
    asked = n is not None or "NNXSCALE_CPU_DEVICES" in os.environ
    source = "--cpu-devices"
    if n is None and "NNXSCALE_CPU_DEVICES" in os.environ:
        source, text = "NNXSCALE_CPU_DEVICES", os.environ["NNXSCALE_CPU_DEVICES"]
        try:
            n = int(text)
        except ValueError:
            raise ConfigError(f"NNXSCALE_CPU_DEVICES={text!r} is not a whole number of devices") from None
    n = DEFAULT_CPU_DEVICES if n is None else n
    if not 1 <= n <= MAX_CPU_DEVICES:
        raise ConfigError(f"{source} must be in [1, {MAX_CPU_DEVICES}] (simulated CPU devices), got {n}")
    if "jax" in sys.modules:
        _note_devices_already_set(n, source, asked)
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


#: The settings each command takes, as dotted TrainConfig paths: their flags, types, help and
#: defaults are generated from the config dataclasses (nnxscale.training.config), so `train`,
#: `plan` and `init` describe the same run with the same flags and defaults.
PLAN_SETTINGS = (
    "model.name", "parallel.mesh", "parallel.rules", "data.batch_size", "data.seq_len", "model.remat", "model.dtype",
    "model.attention", "data.document_mask", "model.dropout", "optim.grad_accum", "parallel.microbatches", "parallel.pipeline_repeats", "parallel.pipeline_schedule", "parallel.min_shard_bytes",
    "model.capacity_factor", "lora.rank", "lora.alpha", "lora.targets", "lora.quantize_base", "model.fp8",
)  # fmt: skip
INIT_SETTINGS = ("model.name", "parallel.mesh", "parallel.rules", "parallel.min_shard_bytes", "seed", "run_dir")


def _note_devices_already_set(n: int, source: str, asked: bool) -> None:
    """jax is imported: XLA read its device count when its CPU backend started. Say so when
    ``n`` was asked for and the running backend has another count (a backend not started
    yet is left alone: asking would start it, before a job of several processes is joined)."""
    import jax  # running already: this only reads it

    if not asked or not jax_private.backends_are_initialized() or jax.default_backend() != "cpu":
        return
    have = jax.local_device_count()
    if have != n:
        print(f"nnxscale: note: {source} {n} has no effect here: jax is already running in this process with {have} "
              "CPU devices (set it before jax starts: the command line, or NNXSCALE_CPU_DEVICES)", file=sys.stderr)  # fmt: skip


def _add_settings(p: argparse.ArgumentParser, paths=None, *, required=()) -> None:
    """One flag per setting in ``paths`` (default: every one), from its field's metadata."""
    settings, defaults = fields_of(), flatten(TrainConfig().to_dict())
    for path in paths or settings:
        meta = settings[path].metadata
        kind = next((a for a in typing.get_args(FIELD_TYPES[path]) if a is not type(None)), FIELD_TYPES[path])
        if path in required:
            options = {"required": True, "help": meta["help"]}
        else:
            options = {"default": None, "help": f"{meta['help']} (default: {defaults[path]})"}
        if kind is bool:  # --document-mask / --no-document-mask
            options |= {"action": argparse.BooleanOptionalAction}
        elif meta.get("append"):  # --reward A --reward B
            options |= {"action": "append", "metavar": meta["flag"][2:].upper().replace("-", "_")}
        elif "const" in meta:  # a bare flag means `const`: --remat is --remat full
            options |= {"nargs": "?", "const": meta["const"], "choices": meta["choices"], "metavar": "POLICY"}
        elif "choices" in meta:
            options |= {"choices": meta["choices"], "metavar": meta["flag"][2:].upper().replace("-", "_")}
        else:
            options |= {"type": kind, "metavar": meta["flag"][2:].upper().replace("-", "_")}
        p.add_argument(meta["flag"], dest=path, **options)
    p.add_argument("--config", help="TOML or JSON file of config fields (sections, e.g. [parallel] mesh = ...); flags override it")


def _config(args):
    """The run's config: defaults < --config file < flags (only the flags given)."""
    cfg = TrainConfig()
    if getattr(args, "config", None):
        source = f"config file {args.config}"
        warn = lambda line: print(f"nnxscale: {line}", file=sys.stderr)  # noqa: E731
        from_file = upgrade(load_config_file(args.config), warn, source)
        cfg = TrainConfig.from_dict(_merge(cfg.to_dict(), from_file), source=source)
    given = {path: getattr(args, path) for path in fields_of() if getattr(args, path, None) is not None}
    return with_overrides(cfg, given)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help=f"simulated CPU devices when there is no accelerator, per process (default: $NNXSCALE_CPU_DEVICES or {DEFAULT_CPU_DEVICES})",
    )
    _add_job(p)


def _add_job(p: argparse.ArgumentParser) -> None:
    d = distributed
    g = p.add_argument_group(
        "multi-process job",
        "Join a job of several processes (jax.distributed): all three of --coordinator, --num-processes and "
        "--process-id, or a cluster environment JAX detects (SLURM, Open MPI, Cloud TPU, Kubernetes). "
        "nnxscale launch sets them for the processes it starts.",
    )
    g.add_argument("--coordinator", metavar="HOST:PORT", help=f"process 0's address and a free port (${d.ENV_COORDINATOR})")
    g.add_argument("--num-processes", type=int, metavar="N", help=f"processes in the job (${d.ENV_NUM_PROCESSES})")
    g.add_argument("--process-id", type=int, metavar="I", help=f"this process, 0 to N-1 (${d.ENV_PROCESS_ID})")
    spec = d.JobSpec()
    for flag, var, default, what in (
        ("--heartbeat-timeout", d.ENV_HEARTBEAT_TIMEOUT, spec.heartbeat_timeout, "a process silent this long is dead and the job ends"),
        ("--init-timeout", d.ENV_INIT_TIMEOUT, spec.init_timeout, "how long the processes wait for each other to join"),
        ("--shutdown-timeout", d.ENV_SHUTDOWN_TIMEOUT, spec.shutdown_timeout, "how long a finished process waits for the others at exit"),
    ):
        g.add_argument(flag, type=int, metavar="S", help=f"seconds: {what} (${var}, default {default})")


class _Parser(argparse.ArgumentParser):
    """argparse with nnxscale's one-line errors (``--steps ten``: no usage block)."""

    def error(self, message: str):
        self.exit(2, f"nnxscale: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nnxscale",
        description="Sharded training with JAX and Flax NNX: plan, create, train, save and restore models in their sharded layout.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _train_parser(sub)
    _sample_parser(sub)
    _init_parser(sub)
    _plan_parser(sub)
    _tokenize_parser(sub)
    _launch_parser(sub)
    _export_parser(sub)
    return parser


def _train_parser(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train a model on a mesh (no arguments: the quick start)",
        description="Train a model preset of any family in its sharded layout. Re-running the same command on the "
        "same --run-dir resumes from its latest checkpoint (on any mesh). Defaults: the quick start, a small "
        "byte-level GPT-2 on Python's standard library source, on 8 simulated CPU devices as a data x model mesh.",
    )
    _add_settings(t)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_common(t)


def _sample_parser(sub) -> None:
    s = sub.add_parser(
        "sample",
        help="generate text from a run's latest checkpoint",
        description="Continue prompts with a run's model, restored onto the run's mesh (or --mesh) in its layout. "
        "GPT-2 and Llama decode with a KV cache: each new token costs one position's work. Several prompts "
        "(--prompt repeated, or --prompts-file) are decoded together as a batch; each stops at the end-of-text token "
        "or after --max-new-tokens.",
    )
    s.add_argument("--run-dir", required=True, help="run directory written by nnxscale train")
    s.add_argument("--prompt", action="append", help="text to continue; repeat for a batch (default: one empty prompt, a new document)")
    s.add_argument("--prompts-file", help="a file of prompts, one per line (a batch)")
    s.add_argument("--max-new-tokens", type=int, default=200, help="at most this many new tokens per prompt (default: 200)")
    s.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default: 0.8)")
    s.add_argument("--top-k", type=int, default=40, help="draw from the K most likely tokens; 0: all (default: 40)")
    s.add_argument("--top-p", type=float, default=1.0, help="draw from the smallest set of probability P (default: 1, all)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--mesh", help="mesh to sample on (default: the run's, its stage and context axes as data)")
    s.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token (the baseline)")
    s.add_argument("--tokenizer", help="tokenizer.json to decode with (default: the run's own, or bytes)")
    s.add_argument("--chat", action="store_true", help="each prompt is a user's message: rendered by the run's chat "
                   "template with the assistant's turn opened; prints the reply alone")  # fmt: skip
    _add_common(s)


def _init_parser(sub) -> None:
    i = sub.add_parser(
        "init",
        help="create a model directly in its sharded layout and save it (a seed checkpoint)",
        description="Create a model in its sharded layout (no device ever holds a full tensor) and save it as a "
        "checkpoint that nnxscale train --init-from can start from.",
    )
    _add_settings(i, INIT_SETTINGS, required=("run_dir",))
    _add_common(i)


def _plan_parser(sub) -> None:
    pl = sub.add_parser(
        "plan",
        help="will a run fit, and what will it cost? Memory per device and collectives per step, nothing allocated",
        description="Plan one training step before anything is allocated: per device, the parameters, optimizer "
        "state and gradients (exact, from the layout), activations and temporaries and the peak (from the real "
        "step compiled ahead of time, or an analytical estimate), and the collectives per step by kind next to the "
        "textbook figure for the layout. The mesh may be larger than this machine (e.g. --mesh fsdp=64): it is "
        "compiled in a child process with that many simulated CPU devices, or estimated beyond "
        "--max-compile-devices. --table prints the per-Variable sharding table.",
    )
    _add_settings(pl, PLAN_SETTINGS)
    memory = pl.add_mutually_exclusive_group()
    memory.add_argument("--device-memory", help="memory of one device for the verdict, e.g. 16GiB or 80GB")
    memory.add_argument("--device", help="a known device for the verdict: " + ", ".join(_known_devices()))
    memory.add_argument("--target", help="compile the step for these accelerators by their own compiler, deviceless, "
                        "e.g. h100x8, h100x64, v5p-128, v6e-256, 2xv6e-256 (needs nnxscale[cuda12] or nnxscale[tpu]; "
                        "--list-targets lists them); the verdict uses its memory per chip")  # fmt: skip
    pl.add_argument("--list-targets", action="store_true", help="list the --target names: chips, memory per chip, interconnect")
    pl.add_argument("--sweep", action="store_true", help="plan every mesh x remat policy for the mesh's device count, sorted by peak; with --target compiled "
                    "for it (--compile auto) and ranked by predicted step time")
    pl.add_argument("--compile", choices=("auto", "never", "always"), default=None,
                    help="auto: compile up to --max-compile-devices, estimate beyond (default; --sweep: never)")  # fmt: skip
    pl.add_argument("--max-compile-devices", type=int, default=None, help="largest mesh to compile; larger ones are estimated (default: 1024)")
    pl.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="where the predicted step waits on collectives for a fifth of its time or more, also plan the mesh "
                         "that moves them (inside a node, or another kind of axis: one more compile) and say in the "
                         "bottleneck line how much faster or slower it is predicted")  # fmt: skip
    pl.add_argument("--table", action="store_true", help="also print the per-Variable sharding table")
    pl.add_argument("--dump-hlo", metavar="DIR", help="write the compiled step's program as its compiler optimized, "
                    "partitioned and scheduled it (HLO text) to DIR/step.hlo.txt: what the plan's figures are read from")  # fmt: skip
    pl.add_argument("--json", action="store_true", help="end with one JSON line: the plan (with --sweep: the plans, and the meshes not planned with the reason)")
    _add_common(pl)


def _export_parser(sub) -> None:
    ex = sub.add_parser(
        "export",
        help="write a LoRA run's adapters as a Hugging Face PEFT adapter, or merged into a whole HF model",
        description="Export the newest intact checkpoint of a run trained with --lora-rank: --peft DIR writes "
        "adapter_config.json and adapter_model.safetensors, which Hugging Face PEFT loads onto the base model "
        "(PeftModel.from_pretrained); --merged DIR folds the adapters into the base weights and writes a whole "
        "Hugging Face model directory (config.json, safetensors, the base's tokenizer files).",
    )
    ex.add_argument("--run-dir", required=True, help="run directory written by nnxscale train --lora-rank R")
    ex.add_argument("--peft", metavar="DIR", help="write the adapters as a PEFT LoRA adapter into DIR")
    ex.add_argument("--merged", metavar="DIR", help="write the base with the adapters folded in, as a Hugging Face directory")
    _add_common(ex)


def _tokenize_parser(sub) -> None:
    tk = sub.add_parser(
        "tokenize",
        help="encode a text corpus once into a token file train reads (.bin uint16 or .npy)",
        description="Encode a text corpus (a file, a directory of text files, or stdlib) with a tokenizer.json into "
        "a token file that nnxscale train --data reads: FILE.bin (uint16, vocabularies up to 65,536) or FILE.npy "
        "(uint16, or int32 for larger vocabularies). Each file is one document (each row of a JSON Lines or Parquet "
        "file), documents joined by the "
        "tokenizer's end-of-text token; groups of files are encoded in parallel on every core.",
    )
    tk.add_argument("--tokenizer", required=True, help="tokenizer.json, or a directory holding one (read locally)")
    tk.add_argument("--data", default="stdlib", help="text, JSON Lines (.jsonl, .jsonl.gz, .json) or Parquet file, or a "
                    "directory of them (default: Python's stdlib source)")  # fmt: skip
    tk.add_argument("--text-field", default="text", help="the field of each JSON Lines or Parquet row holding its text (default: text)")
    tk.add_argument("--skip-bad-rows", action="store_true", help="skip and count rows without text in --text-field "
                    "(default: stop at the first, naming its file and row)")  # fmt: skip
    tk.add_argument("--out", required=True, help="token file to write: FILE.bin or FILE.npy")
    tk.add_argument("--no-progress", action="store_true", help="no progress bar")


def _launch_parser(sub) -> None:
    la = sub.add_parser(
        "launch",
        help="start the processes of a multi-process job on this machine: nnxscale launch -n 2 -- train ...",
        description="Start N processes of an nnxscale command on this machine as one job (jax.distributed over "
        "a free loopback port), each line of their output prefixed with its process id and kept in a log per "
        "process. SIGINT and SIGTERM are forwarded to every process; when one process fails, the others are "
        "stopped (SIGTERM, then SIGKILL after --grace seconds) and the launcher exits non-zero. With --nnodes, "
        "--node-rank and --coordinator it starts the processes of one node of a job over several machines.",
    )
    la.add_argument("-n", "--nproc", type=int, required=True, metavar="N", help="processes to start on this machine")
    la.add_argument("--cpu-devices", type=int, default=None, metavar="D",
                    help=f"simulated CPU devices per process (default: {DEFAULT_CPU_DEVICES} / N, at least 1)")  # fmt: skip
    la.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    la.add_argument("--nnodes", type=int, default=1, help="machines in the job, each running nnxscale launch (default 1)")
    la.add_argument("--node-rank", type=int, default=0, help="this machine, 0 to --nnodes - 1; node 0 hosts process 0")
    la.add_argument("--coordinator", metavar="HOST:PORT", help="with --nnodes > 1: node 0's address and a free port")
    la.add_argument("--grace", type=float, default=3.0, metavar="S",
                    help="seconds between SIGTERM and SIGKILL when stopping the processes (default 3)")  # fmt: skip
    la.add_argument("--log-dir", default=None, help="where the per-process logs go (default: RUN_DIR/logs)")
    la.add_argument("child", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the nnxscale command, e.g. -- train --mesh data=8")


def _train(args) -> int:
    from nnxscale.planning.trainer import train  # imports jax; the trainer with its step-time prediction

    result = train(_config(args), progress=not args.no_progress)
    if result.interrupted_by is not None:
        name = signal.Signals(result.interrupted_by).name
        if result.final_step == result.start_step:
            print(f"stopped by {name} before training step {result.start_step + 1}; nothing new to save.")
        else:
            print(
                f"stopped by {name} at step {result.final_step}; checkpoint saved in {result.run_dir}. "
                "Re-run the same command to resume."
            )
        return 128 + result.interrupted_by
    if result.final_step == result.start_step:
        print(
            f"{result.run_dir} is already at step {result.final_step} of --steps {result.final_step}: "
            "nothing to do (give a larger --steps to continue training)"
        )
        return 0
    val = f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    tps = f", {result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s else ""
    skipped = f", {result.skipped_steps} steps skipped (non-finite loss or gradient)" if result.skipped_steps else ""
    board = os.path.isdir(os.path.join(result.run_dir, TENSORBOARD_DIR))
    written = "metrics.jsonl, loss.png, checkpoints/" + (f", {TENSORBOARD_DIR}/" if board else "")
    print(
        f"done: step {result.final_step}, loss {result.final_loss:.4f}{val}{tps}{skipped}, {result.wall_s:.0f} s. "
        f"Run directory: {result.run_dir} ({written})"
    )
    return 0


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _sample(args) -> int:
    from nnxscale.training.sampling import sample  # imports jax

    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            lines = Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts-file {args.prompts_file}: cannot read it as UTF-8 text ({e})") from None
        prompts += [line for line in lines if line.strip()]
        if not lines or not any(line.strip() for line in lines):
            raise ConfigError(f"--prompts-file {args.prompts_file} has no prompt (one per line)")
    texts = sample(
        args.run_dir,
        prompts or [""],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        tokenizer=args.tokenizer,
        mesh=args.mesh,
        cache=False if args.no_cache else None,
        chat=args.chat,
        warn=lambda line: print(line, file=sys.stderr),  # stdout is the text alone
    )
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- {i + 1} of {len(texts)} ---")
        print(text)
    return 0


def _export(args) -> int:
    # these import jax
    from nnxscale.sharding.layout import format_bytes
    from nnxscale.training.export import export

    info = export(args.run_dir, peft=args.peft, merged=args.merged, warn=lambda line: print(line, file=sys.stderr))
    if "peft" in info:
        print(f"{args.peft}: PEFT LoRA adapter, {info['peft']} tensors, {format_bytes(info['peft_bytes'])} "
              "(adapter_config.json, adapter_model.safetensors)")  # fmt: skip
    if "merged" in info:
        print(f"{args.merged}: the base with the adapters folded in, {info['merged_params']:,} parameters (Hugging Face directory)")
    return 0


def _tokenize(args) -> int:
    from nnxscale.data.text import Records, tokenize  # tokenizers: slow to import
    from nnxscale.sharding.layout import format_bytes  # imports jax

    records = Records(args.text_field, args.skip_bad_rows)
    info = tokenize(args.tokenizer, args.data, args.out, progress=not args.no_progress, records=records)
    skipped = f" ({info['skipped']} empty or binary files skipped)" if info["skipped"] else ""
    if info["bad_rows"]:
        skipped += f" ({info['bad_rows']} bad rows skipped)"
    print(
        f"{info['path']}: {info['tokens']:,} tokens ({info['dtype']}, vocab {info['vocab_size']:,}) from "
        f"{info['documents']:,} documents{skipped}, {format_bytes(info['bytes'])} of text in {info['seconds']:.1f} s; "
        f"train on it with --data {info['path']}"
    )
    return 0


def _init(args) -> int:
    # these import jax
    from nnxscale.sharding.layout import format_bytes
    from nnxscale.training.seed import init_run

    cfg = _config(args)
    p = cfg.parallel
    info = init_run(cfg.model.name, p.mesh, cfg.run_dir, rules=p.rules, seed=cfg.seed, min_shard_bytes=p.min_shard_bytes)
    print(
        f"{cfg.model.name}: {info['num_params']:,} parameters, {format_bytes(info['total_bytes'])} in full, "
        f"{format_bytes(info['per_device_bytes'])} per device on mesh {info['mesh']}; "
        f"seed checkpoint saved in {info['path']}"
    )
    return 0


def _known_devices() -> list[str]:
    return list(MEMORY)


def _plan(args) -> int:
    # these import jax
    from nnxscale.planning import compiler, meshes, report, targets
    from nnxscale.planning.layout import mesh_sizes
    from nnxscale.sharding.state import group_findings, lint, sharding_table

    if args.list_targets:
        print("\n".join(targets.list_lines()))
        return 0
    cfg = _config(args)
    memory = report.device_memory(args.device_memory, args.device)
    max_devices = args.max_compile_devices or compiler.MAX_COMPILE_DEVICES
    target = None if args.target is None else targets.get(args.target)
    if target is not None:
        compiler.check_fp8(cfg, target)  # --fp8 on a chip without FP8: one line, before anything is built
        target.check_installed()  # before anything is built: one line naming the extra
    if args.dump_hlo and args.sweep:
        raise ConfigError("--dump-hlo writes one compiled program: plan one mesh (without --sweep)")
    if args.sweep:
        devices = target.chips if target is not None else math.prod(mesh_sizes(cfg.parallel.mesh).values())
        # For a target each candidate is compiled by its compiler: the step time is predicted from that program.
        compile_ = args.compile or ("auto" if target is not None else "never")
        plans, skipped = meshes.sweep(cfg, devices, device_memory=memory, compile=compile_,
                                       max_compile_devices=max_devices, target=target)  # fmt: skip
        on = f"{target.name} ({target.describe()})" if target else f"{devices} devices"
        order = "fastest first by predicted step time" if any(p.step_time for p in plans) else "sorted by peak memory per device"
        print(f"sweep: {cfg.model.name}, {on}, global batch {cfg.data.batch_size} x {cfg.data.seq_len}, "
              f"{cfg.model.dtype} compute, {order}")  # fmt: skip
        print(meshes.sweep_table(plans, skipped))
        if args.json:
            not_planned = [{"mesh": mesh, "reason": reason} for mesh, reason in skipped.items()]
            print(json.dumps({"plans": [p.to_dict() for p in plans], "not_planned": not_planned}))
        return 0
    sizes = mesh_sizes(cfg.parallel.mesh) if target is None else targets.mesh_sizes(cfg.parallel.mesh, target)
    step = report.plan(cfg, device_memory=memory, compile=args.compile or "auto", max_compile_devices=max_devices, target=target,
                       compare=args.compare)  # fmt: skip
    print(step)
    if args.dump_hlo:
        _dump_hlo(step, Path(args.dump_hlo))
    if step.activations:
        print("\nactivations (logical names -> the activation rules' layout, per call):")
        for a in step.activations:
            inside = f" (per shard inside the pipeline, manual over {', '.join(a['manual'])})" if a.get("manual") else ""
            print(f"  ({', '.join(a['names'])}) {tuple(a['shape'])}: {a['spec']}{inside}")
    model, rules = step.layout["abstract"], step.layout["rules"]
    if args.table:
        print()
        print(sharding_table(model, sizes, rules))
    findings = group_findings(lint(model, sizes, rules))
    findings += [f"[activation] ({', '.join(a['names'])}) {tuple(a['shape'])}: {note}" for a in step.activations for note in a["dropped"]]
    print(f"\nlint: {len(findings)} finding(s)")
    for line in findings:
        print(f"  {line}")
    if args.json:
        print(json.dumps(step.to_dict()))
    return 0


def _dump_hlo(step, where: Path) -> None:
    """``plan --dump-hlo DIR``: the compiled program's text to ``DIR/step.hlo.txt``."""
    if step.hlo_text is None:
        raise ConfigError(f"--dump-hlo: this plan was estimated, not compiled ({step.source}); compile it with "
                          "--compile always (or a mesh within --max-compile-devices)")  # fmt: skip
    where.mkdir(parents=True, exist_ok=True)
    path = where / "step.hlo.txt"
    path.write_text(step.hlo_text)
    print(f"wrote the compiled step's program ({len(step.hlo_text.splitlines()):,} lines of HLO) to {path}")


def _launch(args) -> int:
    command = args.child[1:] if args.child[:1] == ["--"] else args.child
    log_dir = args.log_dir
    if log_dir is None and command[:1] and command[0] in COMMANDS:
        run_dir = _run_dir(build_parser().parse_args(command))
        log_dir = os.path.join(run_dir, "logs") if run_dir else None
    return launch(
        command,
        nproc=args.nproc,
        cpu_devices=args.cpu_devices,
        port=args.port,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        coordinator=args.coordinator,
        grace=args.grace,
        log_dir=log_dir,
    )


def _run_dir(args) -> Optional[str]:
    """The run directory a parsed device command writes to (``None`` for plan)."""
    if getattr(args, "run_dir", None) is not None or args.command != "train":
        return getattr(args, "run_dir", None)
    from_file = load_config_file(args.config).get("run_dir") if getattr(args, "config", None) else None
    return from_file or TrainConfig().run_dir


def _join(args):
    """Join the job the flags, environment or cluster describe (a no-op for a single process)."""
    fields = [f.name for f in dataclasses.fields(distributed.JobSpec)]  # the flags of _add_job
    job = distributed.join(distributed.JobSpec.from_flags(**{f: getattr(args, f) for f in fields}))
    if job.process_id != 0:  # results and progress come from process 0 only
        # At the descriptor, not only sys.stdout: native libraries write to fd 1 too (a CI
        # run once caught bare numbers from one); stderr keeps going to the process's log.
        sys.stdout.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    return job


def _start_jax_quietly(start, forced_cpu: bool) -> Optional[str]:
    """``start()``, then JAX's backends, with stderr (the descriptor: the plugins write from
    C++) held back.

    Where an accelerator started, everything they wrote is passed on. Where only the CPU did,
    it is what the installed accelerator plugins said while failing to find their hardware on
    this machine (the CUDA plugin's "Could not find cuda drivers" and its traceback, libtpu's
    warnings about TPU worker hostnames): ``plan`` compiles for a ``--target`` in a child
    process of its own and needs none of it here, so it is dropped (``forced_cpu``: this
    process was told to use the CPU), or, without a target, replaced by the line returned, for
    after the command's output (``NNXSCALE_DEBUG=1`` shows it all)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        backend, failed = None, None
        try:
            start()
            import jax  # started by now: this only reads it

            backend = jax.default_backend()
        except NnxscaleError:  # bad input: its one line says it all
            raise
        except BaseException as e:
            failed = e
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode(errors="replace")
            if failed is not None:  # jax did not start: what was said is the error's story
                sys.stderr.write(text)
    if backend != "cpu":
        sys.stderr.write(text)
    elif text.strip() and not forced_cpu:
        return ("nnxscale: note: no GPU or TPU started here (the installed accelerator plugins' start-up messages are "
                "hidden; NNXSCALE_DEBUG=1 shows them): planned with XLA:CPU")  # fmt: skip
    return None


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in ("launch", "tokenize"):  # never touch devices (launch starts processes that do)
        try:
            return {"launch": _launch, "tokenize": _tokenize}[args.command](args)
        except NnxscaleError as e:
            print(f"nnxscale: error: {e}", file=sys.stderr)
            return 2
    handler = {"train": _train, "sample": _sample, "init": _init, "plan": _plan, "export": _export}[args.command]
    # In a job of several processes a failure must reach the others (distributed.leave): they
    # may be waiting for this process in a collective.
    quiet = args.command == "plan" and "jax" not in sys.modules and not os.environ.get("NNXSCALE_DEBUG")
    if getattr(args, "target", None) and "jax" not in sys.modules:
        # The target's compiler runs in a child process: this one needs no accelerator, and on a
        # machine without one the CUDA plugin and libtpu would only fail loudly while starting.
        os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        def start():
            configure_cpu_devices(args.cpu_devices)  # before jax starts; a bad value is one line
            _join(args)

        note = _start_jax_quietly(start, forced_cpu=bool(getattr(args, "target", None))) if quiet else start()
        with owned_by_command():  # the command owns its process (nnxscale.jobs.process)
            code = handler(args)
        if note and code == 0:
            print(note, file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("nnxscale: interrupted", file=sys.stderr)
        return distributed.leave(130, "interrupted by SIGINT")
    except NnxscaleError as e:  # bad input: one line; anything else is a bug and keeps its traceback
        if os.environ.get("NNXSCALE_DEBUG"):
            raise
        print(f"nnxscale: error: {e}", file=sys.stderr)
        return distributed.leave(2, str(e))
    except Exception as e:
        if distributed.current().is_multiprocess:  # the traceback now: leave() exits without returning
            traceback.print_exc()
            distributed.leave(1, f"{type(e).__name__}: {e}")
        raise


def run() -> None:
    """Console-script entry point: ``main()``, then exit with its code.

    After a failure has been reported in its one line, libraries' background threads
    (Orbax/TensorStore reads cancelled by the error) may still print tracebacks while the
    interpreter shuts down; those go to /dev/null so the user sees only the error.
    """
    code = main()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    raise SystemExit(code)


if __name__ == "__main__":
    run()
