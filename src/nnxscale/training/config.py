"""Typed run configuration: one frozen dataclass per concern, composed in :class:`TrainConfig`.

Precedence: defaults < config file (``--config run.toml`` or ``.json``) < command-line
flags. The resolved config is written to ``RUN_DIR/config.json``; re-running on the same
run directory must not change any field that would make the resumed run a different
experiment (see :data:`RESUMABLE_FIELDS` for the ones that may change).

Every field is checked, from flags and files alike: its type when a config is read from a
dict (:meth:`TrainConfig.from_dict`: ``steps = "ten"`` or ``steps = 10.5`` are refused,
naming the field; a whole float such as ``1e3`` is taken as an integer), and its range in
:meth:`TrainConfig.validate`. Field ``optim.min_lr_ratio`` has the flag ``--min-lr-ratio``:
the last part of its name, with dashes (:func:`flag`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from nnxscale.errors import ConfigError
from nnxscale.layers.attention_names import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from nnxscale.layers.quantize_names import SCHEMES as QUANTIZE_SCHEMES
from nnxscale.layers.remat import REMAT_NAMES, remat_name
from nnxscale.training.observe import parse_profile_steps

#: Most steps a run can have: the train state counts steps in an int32.
MAX_STEPS = 2**31 - 1
#: Largest seed: ``jax.random.key`` takes 32 bits (``key(2**32)`` is ``key(0)`` again).
MAX_SEED = 2**32 - 1


def setting(default, flag: str, help: str, **extra):
    """A config field and its command-line flag: the CLI's flags are generated from these
    (``nnxscale.cli``), so a field's name, type, default and help live only here."""
    return dataclasses.field(default=default, metadata={"flag": flag, "help": help, **extra})


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The model a run trains and the options a family's model takes."""

    name: str = setting("gpt2-mini", "--model", "model preset of any family, e.g. gpt2-tiny, gpt2-mini, llama-tiny "
                        "(byte-level), gpt2, llama-3.2-1b; an unknown name lists them all; or a Hugging Face directory: "
                        "its architecture, weights and tokenizer")  # fmt: skip
    dtype: str = setting("float32", "--dtype", "compute dtype: float32 or bfloat16 (parameters stay float32)")
    dropout: float = setting(0.0, "--dropout", "dropout rate")
    remat: str = setting("none", "--remat", "rematerialize in the backward pass: none (recompute no matmul: keep every matmul's "
                         "output, recompute the elementwise work); full (keep only each block's "
                         "input; a bare --remat); dots (keep the weight matmuls' outputs); dots-except-mlp-in (those but the "
                         "MLP's input projections, the widest)", const="full", choices=REMAT_NAMES)  # fmt: skip
    attention: str = setting("auto", "--attention", "attention implementation: auto (by the mesh's devices: splash on "
                             "TPUs; cudnn on NVIDIA GPUs in bfloat16 without --document-mask, else pallas-gpu (neither "
                             "Pallas kernel in a pipeline's stages); elsewhere "
                             "xla up to 2,047 tokens, blockwise from 2,048); xla (jax.nn.dot_product_attention: the full "
                             "T x T scores); blockwise (flash-attention recurrence in plain JAX: memory linear in T); "
                             "cudnn; splash (TPU Pallas kernel); pallas-gpu (NVIDIA Pallas flash kernel)",
                             choices=ATTENTION_IMPLEMENTATIONS)  # fmt: skip
    capacity_factor: Optional[float] = setting(None, "--capacity-factor", "a mixture of experts (mixtral): each expert "
                                               "takes at most this factor x its even share of a sequence's assignments "
                                               "in training, the rest are dropped and counted (router_dropped); "
                                               "default: dropless")  # fmt: skip
    fp8: bool = setting(False, "--fp8", "run the stacked layers' linear products in FP8 (e4m3 operands forward, e5m2 "
                        "gradients, each tensor scaled by its own absolute maximum; float32 accumulation); master "
                        "weights, optimizer state, embeddings and the head as without it; emulated on CPU; on a --target "
                        "its chip needs FP8 matrix units (H100, H200, B200)")  # fmt: skip
    init_from: Optional[str] = setting(None, "--init-from", "start from a seed checkpoint (nnxscale init) or a Hugging "
                                       "Face directory of the model's family")  # fmt: skip

    def __post_init__(self):
        if isinstance(self.remat, bool) or self.remat is None:  # remat=True: full remat
            object.__setattr__(self, "remat", remat_name(self.remat))


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """Low-rank adapters (LoRA, :mod:`nnxscale.layers.lora`): with ``rank`` set, the base
    weights are frozen (no gradient, no optimizer state, stored in the compute dtype) and only
    the adapters beside the ``targets`` train, in float32."""

    rank: Optional[int] = setting(None, "--lora-rank", "train low-rank adapters of this rank beside the target layers "
                                  "and freeze the base weights (in the compute --dtype); default: off, every weight trains")  # fmt: skip
    alpha: Optional[float] = setting(None, "--lora-alpha", "the adapters' output is scaled alpha / rank (default: alpha = "
                                     "rank, a scale of 1)")  # fmt: skip
    dropout: float = setting(0.0, "--lora-dropout", "dropout on the adapters' inputs in training (layers called as "
                             "layers; adapters folded into a weight, Mixtral's experts, have none)")  # fmt: skip
    targets: Optional[str] = setting(None, "--lora-targets", "comma-separated layers to adapt, by the family's names: "
                                     "llama q,k,v,o,gate,up,down; mixtral q,k,v,o,w1,w2,w3 (every expert); gpt2 "
                                     "c_attn,c_proj,c_fc (or attn.c_proj, mlp.c_proj); or any module path suffix of "
                                     "your own module; default: all of these (every linear layer of the blocks)")  # fmt: skip
    quantize_base: Optional[str] = setting(None, "--quantize-base", "store the frozen base's linear layers quantized "
                                           "(QLoRA): nf4 (4-bit NormalFloat) or int8, in blocks of 64 with their "
                                           "scales, dequantized per layer in the compute --dtype; needs --lora-rank; "
                                           "embeddings, norms and the head stay as they are", choices=QUANTIZE_SCHEMES)  # fmt: skip


#: ``--loss-norm`` of ``--objective grpo`` (nnxscale.training.grpo): the first is the default.
GRPO_LOSS_NORMS = ("token", "sequence", "constant")


@dataclasses.dataclass(frozen=True)
class GrpoSettings:
    """``--objective grpo``: rollouts of ``num_generations`` completions per prompt, rewards,
    the clipped objective (:mod:`nnxscale.training.grpo`, :mod:`nnxscale.training.rollout`)."""

    reward: tuple[str, ...] = setting((), "--reward", "--objective grpo: a reward function, FILE.py:FUNCTION, "
                                      "package.module:FUNCTION, exact-answer or regex:PATTERN; repeat for several "
                                      "(summed)", append=True)  # fmt: skip
    reward_weights: Optional[str] = setting(None, "--reward-weights", "--objective grpo: comma-separated weights of the "
                                            "--reward functions, in order (default: 1 each)")  # fmt: skip
    num_generations: int = setting(8, "--num-generations", "--objective grpo: completions sampled per prompt (a group); "
                                   "--batch-size counts completions, a multiple of it")  # fmt: skip
    max_new_tokens: int = setting(256, "--max-new-tokens", "--objective grpo: longest completion sampled")
    temperature: float = setting(1.0, "--temperature", "--objective grpo: sampling temperature of the rollouts")
    top_p: float = setting(1.0, "--top-p", "--objective grpo: nucleus sampling of the rollouts (1: all tokens)")
    kl_beta: float = setting(0.04, "--kl-beta", "--objective grpo: weight of the KL penalty to the reference (k3 "
                             "estimator; 0: none, and no reference is kept)")  # fmt: skip
    clip_eps: float = setting(0.2, "--clip-eps", "--objective grpo: the policy ratio is clipped to [1 - eps, 1 + eps]")
    loss_norm: str = setting("token", "--loss-norm", "--objective grpo: token (DAPO: over the batch's completion "
                             "tokens), sequence (GRPO: each completion's mean) or constant (Dr. GRPO: over rows x "
                             "--max-new-tokens)", choices=GRPO_LOSS_NORMS)  # fmt: skip
    iterations: int = setting(1, "--grpo-iterations", "--objective grpo: optimizer steps per rollout batch, its old "
                              "log-probabilities kept")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the run is split over devices: the mesh, the rules, and the pipeline."""

    mesh: str = setting("data=4,model=2", "--mesh", "device mesh, e.g. data=8, fsdp=-1, data=2,model=4")
    rules: str = setting("auto", "--rules", "logical axis rules: auto, dp, fsdp, tp, fsdp_tp, or 'batch=data,mlp=model,...'")
    min_shard_bytes: int = setting(1 << 20, "--min-shard-bytes", "parameters smaller than this are not split over FSDP axes")
    microbatches: Optional[int] = setting(None, "--microbatches", "pipeline microbatches, needed by (and only with) a "
                                          "stage mesh axis, e.g. --mesh stage=2,data=4 --microbatches 8: at least the "
                                          "stages, dividing each batch shard's rows")  # fmt: skip
    pipeline_repeats: int = setting(1, "--pipeline-repeats", "groups of layers per pipeline stage: 1 is GPipe, R > 1 the "
                                    "circular schedule (bubble (S-1)/(R*M+S-1); layers must divide by stages x R)")  # fmt: skip
    pipeline_schedule: str = setting("gpipe", "--pipeline-schedule", "gpipe: a forward scan differentiated by JAX "
                                     "(memory grows with the microbatches); 1f1b: each stage runs a microbatch's backward "
                                     "as soon as it can, holding at most 2S-1 microbatches' stage inputs whatever the "
                                     "microbatches (with --pipeline-repeats R, interleaved: 2SR-1 groups' inputs, M a "
                                     "multiple of S)", choices=("gpipe", "1f1b"))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``."""

    lr: float = setting(3e-3, "--lr", "peak learning rate")
    min_lr_ratio: float = setting(0.1, "--min-lr-ratio", "final learning rate as a fraction of the peak (cosine decay)")
    warmup_steps: int = setting(20, "--warmup-steps", "linear warmup steps")
    weight_decay: float = setting(0.1, "--weight-decay", "AdamW weight decay (kernels and embeddings only)")
    beta1: float = setting(0.9, "--beta1", "AdamW first-moment decay")
    beta2: float = setting(0.95, "--beta2", "AdamW second-moment decay")
    grad_clip: float = setting(1.0, "--grad-clip", "global gradient-norm clip (0: off)")
    grad_accum: int = setting(1, "--grad-accum", "gradient accumulation micro-batches per step")
    decay_steps: Optional[int] = setting(None, "--decay-steps", "length of the warmup+cosine schedule (default: --steps "
                                         "of the run's first command)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are batched (sizes are global, all processes)."""

    data: Optional[str] = setting(None, "--data", "text file or directory, .bin (uint16) or .npy token file; default: "
                                  "Python's stdlib source")  # fmt: skip
    text_field: str = setting("text", "--text-field", "the field of each JSON Lines or Parquet row that holds its text")
    skip_bad_rows: bool = setting(False, "--skip-bad-rows", "skip (and count) JSON Lines or Parquet rows without text in "
                                  "--text-field (or a conversation, prompt/completion or pair that cannot be trained), "
                                  "instead of stopping at the first with its file and row")  # fmt: skip
    tokenizer: Optional[str] = setting(None, "--tokenizer", "tokenizer.json (or a directory holding one) for text data; "
                                       "default: bytes, or the one in an --init-from Hugging Face directory")  # fmt: skip
    seq_len: int = setting(128, "--seq-len", "tokens per sequence (at most the model's context)")
    document_mask: bool = setting(False, "--document-mask", "keep the packed documents of a sequence apart: attention "
                                  "stops at the separator between documents (byte 0, or the tokenizer's end-of-text "
                                  "token), positions restart at each, no token is trained to predict across one")  # fmt: skip
    batch_size: int = setting(32, "--batch-size", "global batch size in sequences, over all devices and processes")
    loss_on: Optional[str] = setting(None, "--loss-on", "which tokens the loss trains: completion (the assistant's "
                                     "messages and completions only; the default for JSON Lines of messages, "
                                     "prompt/completion or prompt/chosen/rejected) or all (the default for text)",
                                     choices=("completion", "all"))  # fmt: skip
    val_fraction: float = setting(0.005, "--val-fraction", "fraction of the tokens held out for validation (the tail)")
    eval_batches: int = setting(4, "--eval-batches", "validation batches per evaluation")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """How often a run saves, and how many checkpoints it keeps."""

    save_every: int = setting(100, "--save-every", "save a checkpoint every N steps (also at the end and on SIGTERM/Ctrl-C)")
    keep: int = setting(3, "--keep", "checkpoints to keep")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """How often a run logs and evaluates."""

    log_every: int = setting(10, "--log-every", "log metrics every N steps (metrics.jsonl holds that step's own loss)")
    eval_every: int = setting(100, "--eval-every", "validation loss every N steps (0: never)")
    tensorboard: bool = setting(True, "--tensorboard", "write every logged metric as a TensorBoard scalar into "
                                "RUN_DIR/tensorboard (--no-tensorboard: only metrics.jsonl)")  # fmt: skip
    wandb: Optional[str] = setting(None, "--wandb", "also log every metric to Weights & Biases, in this project "
                                   "(needs the wandb package installed and logged in; never installed by nnxscale)")  # fmt: skip
    profile_steps: Optional[str] = setting(None, "--profile-steps", "record a jax.profiler trace of steps A:B "
                                           "(inclusive) into RUN_DIR/profile, for TensorBoard's profiler or Perfetto")  # fmt: skip


#: Flat field names of releases up to 0.1 -> their place in the sections. Accepted in config
#: files (with one deprecation line each), in ``TrainConfig(...)``, ``with_overrides`` and as
#: attributes (with a DeprecationWarning), and silently in run directories written before.
FLAT_NAMES = {
    "model": "model.name", "dtype": "model.dtype", "dropout": "model.dropout", "remat": "model.remat",
    "init_from": "model.init_from", "mesh": "parallel.mesh", "rules": "parallel.rules",
    "min_shard_bytes": "parallel.min_shard_bytes", "microbatches": "parallel.microbatches",
    "pipeline_repeats": "parallel.pipeline_repeats", "save_every": "checkpoint.save_every", "keep": "checkpoint.keep",
    "log_every": "logging.log_every", "eval_every": "logging.eval_every",
}  # fmt: skip


@dataclasses.dataclass(frozen=True, init=False)
class TrainConfig:
    """Everything one training run needs, in sections; ``nnxscale train --help`` documents each field.

    ``TrainConfig.from_flags(model="gpt2-tiny", mesh="fsdp=8", steps=10)`` (the command line's
    names), ``TrainConfig(steps=10, model=ModelSettings(name="gpt2-tiny"),
    parallel=ParallelConfig(mesh="fsdp=8"))``, or dotted names: ``with_overrides(TrainConfig(),
    {"model.name": "gpt2-tiny"})``.
    """

    steps: int = setting(300, "--steps", "total number of optimizer steps (a resumed run continues up to it)")
    seed: int = setting(0, "--seed", "seed for initialization, data order and dropout")
    run_dir: str = setting("runs/quickstart", "--run-dir", "run directory: config, metrics.jsonl, loss.png, checkpoints")
    objective: str = setting("lm", "--objective", "lm: next-token cross-entropy; dpo: direct preference optimization on "
                             "JSON Lines of prompt, chosen, rejected against the frozen starting model (--beta); "
                             "grpo: group relative policy optimization from --reward functions over JSON Lines of prompts",
                             choices=("lm", "dpo", "grpo"))  # fmt: skip
    dpo_beta: float = setting(0.1, "--beta", "--objective dpo: how far the model may move from the reference (DPO's beta)")
    max_bad_steps: int = setting(5, "--max-bad-steps", "stop after this many steps in a row with a non-finite loss or "
                                 "gradient norm (each one is skipped)")  # fmt: skip
    hang_timeout: Optional[float] = setting(None, "--hang-timeout", "end the job when no step, save or evaluation "
                                            "completes for this many seconds, with every thread's stacks in "
                                            "RUN_DIR/logs (env NNXSCALE_HANG_TIMEOUT; 0: off; default: 50 step times, "
                                            "at least 300 s, 900 s for a save, 1800 s until the first step; from "
                                            "Python: off unless set, or in a job of several processes)")  # fmt: skip
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    grpo: GrpoSettings = dataclasses.field(default_factory=GrpoSettings)

    def __init__(self, **fields):
        sections = {f.name: f for f in dataclasses.fields(self)}
        flat = {k: fields.pop(k) for k in list(fields) if k in FLAT_NAMES and not (k == "model" and _is_section(fields[k]))}
        unknown = sorted(set(fields) - set(sections))
        if unknown:
            raise TypeError(f"TrainConfig got unknown fields {unknown}; fields: {sorted(sections)}")
        for name, f in sections.items():
            value = fields[name] if name in fields else (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
            object.__setattr__(self, name, value)
        if flat:
            _deprecated(f"TrainConfig({', '.join(sorted(flat))}=...)", {k: FLAT_NAMES[k] for k in flat})
            d = _replace_paths(self.to_dict(), {FLAT_NAMES[k]: v for k, v in flat.items()})
            for name in sections:
                object.__setattr__(self, name, getattr(_build(TrainConfig, d, ""), name))

    @classmethod
    def from_flags(cls, **flags) -> "TrainConfig":
        """A config from the command line's names: ``TrainConfig.from_flags(model="gpt2",
        mesh="fsdp=8", seq_len=1024, lr=1e-3)`` is ``nnxscale train --model gpt2 --mesh fsdp=8
        --seq-len 1024 --lr 1e-3`` (each keyword a flag without dashes, ``-`` as ``_``)."""
        unknown = sorted(set(flags) - set(_BY_FLAG))
        if unknown:
            raise ConfigError(f"unknown flags {unknown}; the flags are {sorted(_BY_FLAG)}")
        return with_overrides(cls(), {_BY_FLAG[name]: value for name, value in flags.items()})

    def __getattr__(self, name: str):  # only for names that are not fields: the flat names of 0.1
        path = FLAT_NAMES.get(name)
        if path is None:
            raise AttributeError(f"'TrainConfig' object has no attribute {name!r}")
        _deprecated(f"TrainConfig.{name}", {name: path})
        section, field = path.split(".")
        return getattr(getattr(self, section), field)

    def to_dict(self) -> dict[str, Any]:
        """Every field, by section, as JSON writes it (a tuple of strings as a list)."""
        return dataclasses.asdict(self, dict_factory=lambda items: {k: list(v) if isinstance(v, tuple) else v for k, v in items})

    def validate(self) -> None:
        """Check every field's type and range (no devices, data or model needed); raise ConfigError."""
        fields = flatten(self.to_dict())
        for path, value in fields.items():
            _typed(path, value, FIELD_TYPES[path], strict=True)
        at_least = lambda low: (lambda v: v >= low, f"at least {low}")  # noqa: E731
        below_one = (lambda v: 0 <= v < 1, "in [0, 1)")
        steps = (lambda v: 1 <= v <= MAX_STEPS, f"in [1, {MAX_STEPS}]")
        ranges = {
            "steps": steps,
            "seed": (lambda v: 0 <= v <= MAX_SEED, f"in [0, {MAX_SEED}]"),
            "model.dropout": below_one,
            "model.capacity_factor": (lambda v: v is None or v > 0, "positive (or unset: dropless)"),
            "logging.log_every": at_least(1),
            "logging.eval_every": (lambda v: v >= 0, "0 (never) or positive"),
            "checkpoint.save_every": (lambda v: v >= 0, "0 (only at the end) or positive"),
            "checkpoint.keep": at_least(1),
            "max_bad_steps": at_least(1),
            "hang_timeout": (lambda v: v is None or v >= 0, "0 (off) or a positive number of seconds"),
            "optim.lr": (lambda v: v > 0, "positive"),
            "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
            "optim.warmup_steps": at_least(0),
            "optim.weight_decay": at_least(0),
            "optim.beta1": below_one,
            "optim.beta2": below_one,
            "optim.grad_clip": (lambda v: v >= 0, "0 (off) or positive"),
            "optim.grad_accum": at_least(1),
            "dpo_beta": (lambda v: v > 0, "positive"),
            "optim.decay_steps": (lambda v: v is None or steps[0](v), steps[1]),
            "data.seq_len": at_least(1),
            "data.batch_size": at_least(1),
            "data.val_fraction": below_one,
            "data.eval_batches": at_least(1),
            "parallel.min_shard_bytes": at_least(0),
            "parallel.microbatches": (lambda v: v is None or v >= 1, "at least 1 (or unset: no pipeline)"),
            "parallel.pipeline_repeats": at_least(1),
            "lora.rank": (lambda v: v is None or v >= 1, "at least 1 (or unset: no adapters)"),
            "lora.alpha": (lambda v: v is None or v > 0, "positive (or unset: the rank)"),
            "lora.dropout": below_one,
        }
        for path, (ok, wanted) in ranges.items():
            if not ok(fields[path]):
                raise ConfigError(f"{_label(path)} must be {wanted}, got {fields[path]}")
        for path in ("model.name", "parallel.mesh", "parallel.rules", "run_dir", "data.data", "data.tokenizer", "model.init_from"):
            if fields[path] is not None and not fields[path].strip():
                raise ConfigError(f"{_label(path)} is empty")
        if self.model.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"{_label('model.dtype')} must be float32 or bfloat16, got {self.model.dtype!r}")
        if self.parallel.pipeline_schedule not in ("gpipe", "1f1b"):
            raise ConfigError(
                f"{_label('parallel.pipeline_schedule')} must be gpipe or 1f1b, got {self.parallel.pipeline_schedule!r}"
            )
        if self.objective not in ("lm", "dpo", "grpo"):
            raise ConfigError(f"{_label('objective')} must be lm, dpo or grpo, got {self.objective!r}")
        self._validate_grpo()
        if self.data.loss_on not in (None, "completion", "all"):
            raise ConfigError(f"{_label('data.loss_on')} must be completion or all, got {self.data.loss_on!r}")
        if self.objective == "dpo" and (self.optim.grad_accum > 1 or self.parallel.microbatches is not None):
            split = f"--grad-accum {self.optim.grad_accum}" if self.optim.grad_accum > 1 else "--microbatches (a pipeline)"
            raise ConfigError(f"--objective dpo with {split} is not implemented yet: micro-batches would split the "
                              "preference pairs; use a larger mesh or a smaller --batch-size")  # fmt: skip
        if self.model.remat not in REMAT_NAMES:
            raise ConfigError(f"{_label('model.remat')} must be one of {', '.join(REMAT_NAMES)}, got {self.model.remat!r}")
        if self.model.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ConfigError(
                f"{_label('model.attention')} must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, got {self.model.attention!r}"
            )
        lora = self.lora
        if lora.rank is None and (lora.alpha is not None or lora.dropout or lora.targets is not None):
            given = [f for f, v in (("--lora-alpha", lora.alpha), ("--lora-dropout", lora.dropout or None),
                                    ("--lora-targets", lora.targets)) if v is not None]  # fmt: skip
            raise ConfigError(f"{', '.join(given)} set(s) LoRA adapters, which need --lora-rank R (e.g. --lora-rank 16)")
        if lora.quantize_base is not None and lora.rank is None:
            raise ConfigError(f"--quantize-base {lora.quantize_base} stores the frozen base of LoRA adapters quantized, "
                              "which needs --lora-rank R (e.g. --lora-rank 16): a base that trains cannot be quantized")  # fmt: skip
        if lora.quantize_base not in (None, *QUANTIZE_SCHEMES):
            raise ConfigError(f"--quantize-base must be one of {', '.join(QUANTIZE_SCHEMES)}, got {lora.quantize_base!r}")
        if lora.targets is not None and not [t for t in lora.targets.split(",") if t.strip()]:
            raise ConfigError("--lora-targets is empty: name the layers to adapt (e.g. q,k,v,o) or leave it unset")

        parse_profile_steps(self.logging.profile_steps)
        self._validate_pipeline()

    def _validate_pipeline(self) -> None:
        """What a pipeline needs that no mesh is required to check (the mesh: ``setup``)."""
        par = self.parallel
        if par.pipeline_repeats > 1 and par.microbatches is None:
            raise ConfigError(
                f"--pipeline-repeats {par.pipeline_repeats} sets the circular pipeline schedule, which needs "
                "--microbatches (and a stage mesh axis, e.g. --mesh stage=2,data=4 --microbatches 8)"
            )
        if par.pipeline_schedule != "gpipe" and par.microbatches is None:
            raise ConfigError(
                f"--pipeline-schedule {par.pipeline_schedule} is a pipeline schedule, which needs --microbatches "
                "(and a stage mesh axis, e.g. --mesh stage=2,data=4 --microbatches 8)"
            )
        if par.microbatches is not None and self.optim.grad_accum > 1 and par.pipeline_schedule == "gpipe":
            raise ConfigError(
                f"--grad-accum {self.optim.grad_accum} and --microbatches {par.microbatches} both split the batch: "
                "a pipeline already accumulates its microbatches' gradients, and each accumulation step would fill and "
                "drain the pipeline again (a bubble each time): use --microbatches alone "
                f"(e.g. --microbatches {par.microbatches * self.optim.grad_accum} for the same micro-batch size), "
                "or --pipeline-schedule 1f1b, which runs beside --grad-accum"
            )

    def _validate_grpo(self) -> None:
        g = self.grpo
        if self.objective != "grpo":
            return
        if g.num_generations < 2:
            raise ConfigError(f"--num-generations must be at least 2 (a group's advantages compare its completions), got {g.num_generations}")
        if self.data.batch_size % g.num_generations:
            raise ConfigError(f"--batch-size {self.data.batch_size} counts completions: a multiple of --num-generations "
                              f"{g.num_generations}")  # fmt: skip
        if not 1 <= g.max_new_tokens < self.data.seq_len:
            raise ConfigError(f"--max-new-tokens must be at least 1 and leave room for the prompt in --seq-len "
                              f"{self.data.seq_len}, got {g.max_new_tokens}")  # fmt: skip
        if not (0 < g.temperature and 0 < g.top_p <= 1 and 0 < g.clip_eps < 1 and g.kl_beta >= 0 and g.iterations >= 1):
            raise ConfigError("--temperature must be positive, --top-p in (0, 1], --clip-eps in (0, 1), --kl-beta at "
                              "least 0 and --grpo-iterations at least 1")  # fmt: skip
        if g.loss_norm not in GRPO_LOSS_NORMS:
            raise ConfigError(f"--loss-norm must be one of {', '.join(GRPO_LOSS_NORMS)}, got {g.loss_norm!r}")
        if self.optim.grad_accum > 1 or self.parallel.microbatches is not None:
            raise ConfigError("--objective grpo with --grad-accum or a pipeline (--microbatches) is not implemented: "
                              "sampling needs the whole model on each data shard")  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: Optional[str] = None, flat_names: Optional[Callable] = None) -> "TrainConfig":
        """A config from a nested dict (a config file, ``config.json``), each field type-checked.

        ``source`` (e.g. ``"config file run.toml"``) starts every error message. The flat
        names of 0.1 (:data:`FLAT_NAMES`) are moved into their sections; ``flat_names(line)``
        is told about each (the CLI prints a deprecation line for a config file).
        """
        try:
            return _build(cls, upgrade(d, flat_names, source), "")
        except ConfigError as e:
            if source is None:
                raise
            raise ConfigError(f"{source}: {e}") from None


def _walk(cls, prefix: str = ""):
    """``(dotted path, field, type)`` of every setting of ``cls``, sections walked."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _walk(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, hints[f.name]


def fields_of(cls=None) -> dict[str, dataclasses.Field]:
    """Every setting of ``cls`` (default :class:`TrainConfig`), by dotted path, sections walked."""
    return {path: f for path, f, _ in _walk(TrainConfig if cls is None else cls)}


def flag(path: str) -> str:
    """The command-line flag of a field: ``"optim.min_lr_ratio"`` -> ``"--min-lr-ratio"``,
    ``"model.name"`` -> ``"--model"`` (old flat names are accepted too)."""
    path = FLAT_NAMES.get(path, path)
    return _SETTINGS[path].metadata["flag"]


def _label(path: str) -> str:
    """How errors name a field: ``--steps``, ``--min-lr-ratio (optim.min_lr_ratio)``."""
    return flag(path) if "." not in path else f"{flag(path)} ({path})"


def _is_section(value) -> bool:
    return dataclasses.is_dataclass(value) or isinstance(value, dict)


def _deprecated(what: str, moved: dict[str, str]) -> None:
    names = ", ".join(f"{old} -> {new}" for old, new in moved.items())
    warnings.warn(f"{what}: flat config names are deprecated, use the sections ({names}) or "
                  "TrainConfig.from_flags(...); accepted until 0.3",
                  DeprecationWarning, stacklevel=3)  # fmt: skip


def _replace_paths(d: dict, values: dict[str, Any]) -> dict:
    """A copy of nested ``d`` with ``values`` (by dotted path) set."""
    d = json.loads(json.dumps(d)) if values else d
    for key, value in values.items():
        node = d
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return d


def upgrade(d, flat_names: Optional[Callable[[str], None]] = None, source: Optional[str] = None):
    """``d`` with the flat names of 0.1 moved into their sections (see :data:`FLAT_NAMES`).

    ``model`` is flat when it is a string (the model's name), a section when a table.
    ``flat_names(line)`` is called once per name moved; a name given both ways is an error.
    """
    if not isinstance(d, dict):
        return d
    flat = {k: v for k, v in d.items() if k in FLAT_NAMES and not (k == "model" and _is_section(v))}
    if not flat:
        return d
    rest = {k: v for k, v in d.items() if k not in flat}
    for old in flat:
        section, field = FLAT_NAMES[old].split(".")
        if isinstance(rest.get(section), dict) and field in rest[section]:
            raise ConfigError(f"{old!r} and {FLAT_NAMES[old]!r} both set; keep {FLAT_NAMES[old]!r}")
    if flat_names is not None:
        where = f"{source}: " if source else ""
        flat_names(f"{where}flat names are deprecated (accepted until 0.3): "
                   + ", ".join(f"{k} -> [{FLAT_NAMES[k].split('.')[0]}] {FLAT_NAMES[k].split('.')[1]}" for k in flat))  # fmt: skip
    return _replace_paths(rest, {FLAT_NAMES[k]: v for k, v in flat.items()})


def _build(cls, d, prefix: str):
    """``cls`` (a config dataclass) from a dict, recursively, each field type-checked."""
    if isinstance(d, cls):
        return d
    where = f"[{prefix[:-1]}]" if prefix else "the config"
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a table of fields, got {d!r}")
    hints = typing.get_type_hints(cls)
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"unknown fields {unknown} in {where}; valid fields are {known}")
    values = {}
    for name, value in d.items():
        hint = hints[name]
        if prefix + name == "model.remat" and isinstance(value, bool):  # remat = true: full rematerialization
            value = remat_name(value)
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _typed(prefix + name, value, hint, strict=False)
    return cls(**values)


def _typed(path: str, value, hint, *, strict: bool):
    """``value`` as the field's type (``int``, ``float``, ``str``, ``bool``, ``Optional[...]``).

    Not ``strict`` (values read from a file): a whole float (``1e3``) becomes an ``int``
    and an ``int`` in a float field a ``float``. Floats must be finite. Raises ConfigError
    naming the field and what it got.
    """
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        if value is None:
            return None
        (hint,) = (a for a in args if a is not type(None))
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if not strict and isinstance(value, float) and value.is_integer():
            return int(value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{_label(path)} must be a finite number, got {value}")
        return value if strict else float(value)
    if hint is str and isinstance(value, str):
        return value
    if typing.get_origin(hint) is tuple and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if typing.get_origin(hint) is tuple:
        raise ConfigError(f"{_label(path)} must be a list of strings, got {value!r} ({type(value).__name__})")
    wanted = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}[hint]
    raise ConfigError(
        f"{_label(path)} must be {wanted}{' or unset' if optional else ''}, got {value!r} ({type(value).__name__})"
    )


#: Fields that may differ between a run directory's config and a resuming command:
#: how long to run, where (mesh, rules), how (remat, attention: the same function computed
#: another way), and how often to log/save. Anything else would
#: silently turn the resumed run into a different experiment. The pipeline settings go
#: with the mesh (a ``stage`` axis needs them) and give the same numbers without dropout.
#: ``optim.decay_steps`` (the LR schedule's length) is fixed by a run's first command; a command that leaves it unset
#: takes the run's own, so growing ``--steps`` does not restart warmup.
RESUMABLE_FIELDS = frozenset(
    {"steps", "parallel.mesh", "parallel.rules", "run_dir", "logging.log_every", "logging.eval_every",
     "checkpoint.save_every", "checkpoint.keep", "model.remat", "model.attention", "model.init_from", "parallel.min_shard_bytes",
     "max_bad_steps", "hang_timeout", "data.eval_batches", "parallel.microbatches", "parallel.pipeline_repeats",
     "parallel.pipeline_schedule", "logging.tensorboard", "logging.profile_steps", "logging.wandb"}
)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def with_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Apply dotted overrides ``{"optim.lr": 1e-3, "steps": 10}``."""
    d = cfg.to_dict()
    flat = {k: FLAT_NAMES[k] for k in overrides if k in FLAT_NAMES}
    if flat:
        _deprecated("with_overrides", flat)
        overrides = {FLAT_NAMES.get(k, k): v for k, v in overrides.items()}
    for key, value in overrides.items():
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ConfigError(f"unknown config field {key!r}")
        node[leaf] = value
    return TrainConfig.from_dict(d)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON config file into a nested dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        if p.suffix == ".toml":
            return tomllib.loads(p.read_text())
        return json.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None


def config_conflicts(saved: dict, new: dict) -> list[str]:
    """Fields outside :data:`RESUMABLE_FIELDS` whose values differ, as readable lines
    (a run directory written with the flat names of 0.1 compares by their new places).

    A field that a run directory's config lacks (written before nnxscale had it) has its
    default there: what the older version did. Without this, every run directory written
    before ``--document-mask`` (and two data fields) was refused as a different run."""
    listed = lambda d: {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}  # noqa: E731  (JSON keeps lists)
    a, b = listed(flatten(upgrade(saved))), listed(flatten(upgrade(new)))
    defaults = listed(flatten(TrainConfig().to_dict()))
    out = []
    for key in sorted(set(a) | set(b)):
        if key in RESUMABLE_FIELDS:
            continue
        was, now = a.get(key, defaults.get(key)), b.get(key, defaults.get(key))
        if was != now:
            out.append(f"{key}: run directory has {was!r}, this command has {now!r}")
    return out


#: Dotted path -> its dataclass field (with the flag and help in its metadata).
_SETTINGS = fields_of(TrainConfig)
#: Dotted field name -> its type, for every field of :class:`TrainConfig`.
FIELD_TYPES = {path: hint for path, _, hint in _walk(TrainConfig)}
#: A flag's name as a keyword (``seq_len`` for ``--seq-len``) -> the dotted field it sets.
_BY_FLAG = {f.metadata["flag"][2:].replace("-", "_"): path for path, f in _SETTINGS.items()}
