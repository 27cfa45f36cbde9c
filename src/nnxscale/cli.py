"""The ``nnxscale`` command. Thin: it parses arguments and calls the library.

On a machine without an accelerator JAX's CPU platform is split into 8 simulated devices
(``--cpu-devices N`` or ``NNXSCALE_CPU_DEVICES=N`` change it), so every mesh example works
out of the box; GPUs and TPUs are used as they are. The setting must reach XLA before jax
is imported, which is why this module imports nothing from jax at the top.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional

DEFAULT_CPU_DEVICES = 8
#: Most simulated CPU devices: XLA's start-up grows faster than linearly with them
#: (measured: 1024 devices 0.9 s and 0.3 GB before any array, 4096 3 s and 0.6 GB,
#: 16384 more than a minute), and every replicated array is held once per device.
MAX_CPU_DEVICES = 1024


def configure_cpu_devices(n: Optional[int]) -> None:
    """Ask XLA for ``n`` CPU devices (default: $NNXSCALE_CPU_DEVICES or 8). Call before jax.

    Raises ConfigError for a count outside [1, MAX_CPU_DEVICES], from the flag or the
    environment variable, even when jax is already running (then the count is not applied).
    """
    from nnxscale.errors import ConfigError

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
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


# field in TrainConfig (dotted) -> (flag, type, help)
_TRAIN_FLAGS = [
    ("model", "--model", str, "model preset: gpt2-tiny, gpt2-mini (byte-level), gpt2, gpt2-medium, gpt2-large, gpt2-xl"),
    ("mesh", "--mesh", str, "device mesh, e.g. data=8, fsdp=-1, data=2,model=4"),
    ("rules", "--rules", str, "logical axis rules: auto, dp, fsdp, tp, fsdp_tp, or 'batch=data,mlp=model,...'"),
    ("steps", "--steps", int, "total number of optimizer steps (a resumed run continues up to it)"),
    ("data.batch_size", "--batch-size", int, "global batch size in sequences, over all devices and processes"),
    ("data.seq_len", "--seq-len", int, "tokens per sequence (at most the model's context)"),
    ("data.data", "--data", str, "text file or directory, .bin (uint16) or .npy token file; default: Python's stdlib source"),
    ("data.val_fraction", "--val-fraction", float, "fraction of the tokens held out for validation (the tail)"),
    ("data.eval_batches", "--eval-batches", int, "validation batches per evaluation"),
    ("run_dir", "--run-dir", str, "run directory: config, metrics.jsonl, loss.png, checkpoints"),
    ("seed", "--seed", int, "seed for initialization, data order and dropout"),
    ("save_every", "--save-every", int, "save a checkpoint every N steps (also at the end and on SIGTERM/Ctrl-C)"),
    ("log_every", "--log-every", int, "log metrics every N steps (metrics.jsonl holds that step's own loss)"),
    ("eval_every", "--eval-every", int, "validation loss every N steps (0: never)"),
    ("keep", "--keep", int, "checkpoints to keep"),
    ("max_bad_steps", "--max-bad-steps", int,
     "stop after this many steps in a row with a non-finite loss or gradient norm (each one is skipped)"),
    ("optim.lr", "--lr", float, "peak learning rate"),
    ("optim.min_lr_ratio", "--min-lr-ratio", float, "final learning rate as a fraction of the peak (cosine decay)"),
    ("optim.warmup_steps", "--warmup-steps", int, "linear warmup steps"),
    ("optim.weight_decay", "--weight-decay", float, "AdamW weight decay (kernels and embeddings only)"),
    ("optim.beta1", "--beta1", float, "AdamW first-moment decay"),
    ("optim.beta2", "--beta2", float, "AdamW second-moment decay"),
    ("optim.grad_clip", "--grad-clip", float, "global gradient-norm clip (0: off)"),
    ("optim.grad_accum", "--grad-accum", int, "gradient accumulation micro-batches per step"),
    ("optim.decay_steps", "--decay-steps", int, "length of the warmup+cosine schedule (default: --steps of the run's first command)"),
    ("dropout", "--dropout", float, "dropout rate"),
    ("dtype", "--dtype", str, "compute dtype: float32 or bfloat16 (parameters stay float32)"),
    ("init_from", "--init-from", str, "start from a seed checkpoint (nnxscale init) or a Hugging Face GPT-2 directory"),
]


def _defaults():
    from nnxscale.config import TrainConfig, flatten

    return flatten(TrainConfig().to_dict())


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help=f"simulated CPU devices when there is no accelerator (default: $NNXSCALE_CPU_DEVICES or {DEFAULT_CPU_DEVICES})",
    )


class _Parser(argparse.ArgumentParser):
    """argparse with nnxscale's one-line errors (``--steps ten``: no usage block)."""

    def error(self, message: str):
        self.exit(2, f"nnxscale: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    defaults = _defaults()
    parser = _Parser(
        prog="nnxscale",
        description="Sharded training with JAX and Flax NNX: plan, create, train, save and restore models in their sharded layout.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    t = sub.add_parser(
        "train",
        help="train GPT-2 on a mesh (no arguments: the quick start)",
        description="Train GPT-2 in its sharded layout. Re-running the same command on the same --run-dir resumes "
        "from its latest checkpoint (on any mesh). Defaults: the quick start, a small byte-level GPT-2 on "
        "Python's standard library source, on 8 simulated CPU devices as a data x model mesh.",
    )
    for field, flag, typ, help_text in _TRAIN_FLAGS:
        t.add_argument(flag, dest=field, type=typ, default=None, help=f"{help_text} (default: {defaults[field]})")
    t.add_argument("--remat", dest="remat", action="store_true", default=None, help="rematerialize each block (less memory)")
    t.add_argument("--config", help="TOML or JSON file with config fields; flags override it")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_common(t)

    s = sub.add_parser("sample", help="generate text from a run's latest checkpoint")
    s.add_argument("--run-dir", required=True, help="run directory written by nnxscale train")
    s.add_argument("--prompt", default="", help="text to continue")
    s.add_argument("--max-new-tokens", type=int, default=200)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=40)
    s.add_argument("--seed", type=int, default=0)
    _add_common(s)

    i = sub.add_parser(
        "init",
        help="create a model directly in its sharded layout and save it (a seed checkpoint)",
        description="Create a model in its sharded layout (no device ever holds a full tensor) and save it as a "
        "checkpoint that nnxscale train --init-from can start from.",
    )
    i.add_argument("--model", required=True)
    i.add_argument("--mesh", required=True)
    i.add_argument("--rules", default="auto")
    i.add_argument("--run-dir", required=True)
    i.add_argument("--seed", type=int, default=0)
    _add_common(i)

    pl = sub.add_parser(
        "plan",
        help="print a model's sharding table and lint for a mesh, without allocating it",
        description="Print one row per Variable (path, shape, dtype, logical axes, PartitionSpec, shard shape, "
        "bytes per device) and the lint findings. The mesh may be larger than this machine "
        "(e.g. --mesh data=64,model=16): nothing is allocated.",
    )
    pl.add_argument("--model", default="gpt2")
    pl.add_argument("--mesh", default="data=2,model=4")
    pl.add_argument("--rules", default="auto")
    _add_common(pl)
    return parser


def _train(args) -> int:
    from nnxscale.config import TrainConfig, load_config_file, with_overrides
    from nnxscale.train import train

    cfg = TrainConfig()
    if args.config:
        cfg = TrainConfig.from_dict(_merge(cfg.to_dict(), load_config_file(args.config)), source=f"config file {args.config}")
    overrides = {f: getattr(args, f) for f, *_ in _TRAIN_FLAGS if getattr(args, f) is not None}
    if args.remat:
        overrides["remat"] = True
    cfg = with_overrides(cfg, overrides)
    result = train(cfg, progress=not args.no_progress)
    if result.interrupted_by is not None:
        import signal

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
    print(
        f"done: step {result.final_step}, loss {result.final_loss:.4f}{val}{tps}{skipped}, {result.wall_s:.0f} s. "
        f"Run directory: {result.run_dir} (metrics.jsonl, loss.png, checkpoints/)"
    )
    return 0


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _sample(args) -> int:
    from nnxscale.generate import sample

    text = sample(
        args.run_dir,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        warn=lambda line: print(line, file=sys.stderr),  # stdout is the text alone
    )
    print(text)
    return 0


def _init(args) -> int:
    from nnxscale.layout import format_bytes
    from nnxscale.train import init_run

    info = init_run(args.model, args.mesh, args.run_dir, rules=args.rules, seed=args.seed)
    print(
        f"{args.model}: {info['num_params']:,} parameters, {format_bytes(info['total_bytes'])} in full, "
        f"{format_bytes(info['per_device_bytes'])} per device on mesh {info['mesh']}; "
        f"seed checkpoint saved in {info['path']}"
    )
    return 0


def _plan(args) -> int:
    from flax import nnx

    from nnxscale.mesh import parse_mesh_spec, resolve_mesh_shape
    from nnxscale.models import gpt2
    from nnxscale.rules import get_rules
    from nnxscale.sharding import lint, sharding_table

    axes = parse_mesh_spec(args.mesh)
    if -1 in axes.values():
        import jax

        axes = resolve_mesh_shape(axes, jax.device_count())
    rules = get_rules(args.rules)
    cfg = gpt2.preset(args.model)
    model = nnx.eval_shape(lambda: gpt2.GPT2(cfg, rngs=nnx.Rngs(0)))
    table = sharding_table(model, axes, rules)
    print(table)
    findings = lint(model, axes, rules)
    print(f"lint: {len(findings)} finding(s)")
    for line in group_findings(findings):
        print(f"  {line}")
    return 0


def group_findings(findings) -> list[str]:
    """One line per distinct finding; the same finding on every layer (h.0 ... h.47) once."""
    import re

    groups: dict[tuple, list] = {}
    for f in findings:
        key = (f.kind, re.sub(r"\.\d+\.", ".N.", f.path), f.message)
        groups.setdefault(key, []).append(f)
    lines = []
    for (kind, path, message), members in groups.items():
        where = members[0].path if len(members) == 1 else f"{path} ({len(members)} layers)"
        lines.append(f"[{kind}] {where + ': ' if where else ''}{message}")
    return lines


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"train": _train, "sample": _sample, "init": _init, "plan": _plan}[args.command]
    from nnxscale.errors import NnxscaleError

    try:
        configure_cpu_devices(args.cpu_devices)
        return handler(args)
    except KeyboardInterrupt:
        print("nnxscale: interrupted", file=sys.stderr)
        return 130
    except NnxscaleError as e:  # bad input: one line; anything else is a bug and keeps its traceback
        if os.environ.get("NNXSCALE_DEBUG"):
            raise
        print(f"nnxscale: error: {e}", file=sys.stderr)
        return 2


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
