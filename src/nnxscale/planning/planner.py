"""Plan a training step before anything is allocated: memory per device, traffic per step.

``nnxscale plan`` answers "will this run fit, and what will it cost?". Each figure says
where it comes from:

- ``layout``: exact arithmetic on the sharded layout (parameters, optimizer state and
  gradients per device; the gradients are constrained to the parameters' layout).
- ``compiler``: the real train step compiled ahead of time for the mesh, nothing
  allocated (``make_train_step(setup(cfg)).lower(s.abstract, s.abstract_batch).compile()``):
  peak and temporary memory from ``memory_analysis()``, collectives counted in the
  compiled HLO (:func:`nnxscale.collective_bytes`). A mesh larger than this machine is compiled in a
  child process with that many simulated CPU devices, up to ``max_compile_devices``.
  These are XLA:CPU's figures; a GPU's compiler fuses differently, so treat them as close,
  not exact.
- ``estimate``: an analytical model of the step (:func:`estimate`) whose coefficients are
  fitted to the compiler's figures for GPT-2 (``python bench/plan_accuracy.py`` measures
  its error and refits it); for another family a plan says it is a rough guide. Used
  beyond ``max_compile_devices``, for ``--sweep`` unless asked to compile, and printed
  beside the compiler's peak otherwise.

Peak per device = arguments + outputs - donated (aliased) buffers + temporaries: the train
state (parameters and optimizer state, updated in place) and the batch, plus what the step
allocates while it runs (gradients, activations kept for the backward pass, gathered FSDP
weights, logits).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Optional

from nnxscale.sharding.axes import EXPERT, STAGE, entry_axes
from nnxscale.sharding.devices import MEMORY
from nnxscale.sharding.layout import format_bytes, full_bytes
from nnxscale.sharding.mesh import format_mesh, resolve_mesh_shape
from nnxscale.training.config import ConfigError, TrainConfig, with_overrides

#: Memory of one device, by name (``--device``), in bytes.
KNOWN_DEVICES = MEMORY

#: Meshes up to this many devices are compiled (in a child process when larger than this
#: machine); larger ones are estimated. Measured on 2 CPU cores: gpt2's step for 64, 256
#: and 1024 simulated devices compiles in 8.6, 8.9 and 7.2 s.
MAX_COMPILE_DEVICES = 1024

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


def parse_bytes(text) -> int:
    """``"80GiB"``, ``"16 GB"``, ``"1.5TiB"`` or a number of bytes -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"cannot read {text!r} as a size: write e.g. 80GiB, 16GB or 1073741824")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"a device memory must be positive, got {text!r}")
    return value


def device_memory(memory=None, device: Optional[str] = None) -> Optional[int]:
    """Bytes from a size (``--device-memory``) or a known device name (``--device``)."""
    if memory is not None and device is not None:
        raise ConfigError("give --device-memory or --device, not both")
    if device is not None:
        key = device.lower()
        if key not in KNOWN_DEVICES:
            raise ConfigError(f"unknown device {device!r}: choose one of {', '.join(KNOWN_DEVICES)}, or give --device-memory")
        return KNOWN_DEVICES[key]
    return None if memory is None else parse_bytes(memory)


# --------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepPlan:
    """What one training step needs per device and moves per step.

    Bytes are per device; collective bytes per device and per step, by kind (see
    :func:`nnxscale.collective_bytes` for the convention). ``sources`` says, per figure, ``layout``,
    ``compiler ...`` or ``estimate``.
    """

    model: str
    mesh: dict[str, int]
    rules: str
    remat: str
    dtype: str
    batch_size: int
    seq_len: int
    grad_accum: int
    num_params: int
    full_param_bytes: int
    param_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    batch_bytes: int
    temp_bytes: int
    peak_bytes: int
    collective_bytes: dict[str, int]
    textbook: list  # (what, multiple of the parameter bytes)
    source: str  # where temp, peak and collectives come from
    compile_seconds: Optional[float] = None
    device_memory: Optional[int] = None
    estimated: Optional[dict] = None  # the analytical estimate, beside compiled figures
    activations: list = dataclasses.field(default_factory=list)  # {names, shape, spec, dropped} per constrained activation
    notes: list = dataclasses.field(default_factory=list)
    pipeline: Optional[dict] = None  # the pipeline's layout and costs (see pipeline_figures); None without one
    context: Optional[dict] = None  # the ring over a context axis (see context_figures); None without one
    attention: Optional[str] = None  # the attention implementation in use (a family's model; None: your own)
    attention_line: Optional[str] = None  # the run's line about it (nnxscale.layers.attention.describe)
    #: :func:`layout_figures` of the plan (the abstract model, resolved rules, rows): reused by
    #: callers (``nnxscale plan``'s table and lint) instead of being built again.
    layout: Optional[dict] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def activation_bytes(self) -> int:
        """Temporaries other than the gradients: activations kept for the backward pass,
        gathered weights, logits, the update's intermediates."""
        return max(self.temp_bytes - self.gradient_bytes, 0)

    @property
    def collective_total(self) -> int:
        return sum(self.collective_bytes.values())

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_memory is None else self.peak_bytes <= self.device_memory

    @property
    def sources(self) -> dict[str, str]:
        return {
            "param_bytes": "layout",
            "optimizer_bytes": "layout",
            "gradient_bytes": "layout",
            "temp_bytes": self.source,
            "peak_bytes": self.source,
            "collective_bytes": self.source,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mesh": format_mesh(self.mesh),
            "rules": self.rules,
            "remat": self.remat,
            "dtype": self.dtype,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "grad_accum": self.grad_accum,
            "num_params": self.num_params,
            "param_bytes_per_device": self.param_bytes,
            "optimizer_bytes_per_device": self.optimizer_bytes,
            "gradient_bytes_per_device": self.gradient_bytes,
            "activation_bytes_per_device": self.activation_bytes,
            "temp_bytes_per_device": self.temp_bytes,
            "peak_bytes_per_device": self.peak_bytes,
            "collective_bytes_per_step": self.collective_total,
            "collective_bytes_by_kind": dict(self.collective_bytes),
            "collectives_over_params": round(self.collective_total / max(self.full_param_bytes, 1), 4),
            "textbook_collectives_over_params": round(sum(x for _, x in self.textbook), 4),
            "source": self.source,
            "sources": self.sources,
            "compile_seconds": self.compile_seconds,
            "device_memory": self.device_memory,
            "fits": self.fits,
            "estimate": self.estimated,
            "pipeline": self.pipeline,
            "context": self.context,
            "attention": self.attention,
        }

    def __str__(self) -> str:
        lines = [
            f"plan: {self.model} ({self.num_params:,} parameters) on mesh {format_mesh(self.mesh)}, rules {self.rules}, "
            f"remat {self.remat}, {self.dtype} compute, global batch {self.batch_size} x {self.seq_len}"
            + (f" in {self.grad_accum} micro-batches" if self.grad_accum > 1 else ""),
            *([self.attention_line] if self.attention_line else []),
            "",
            f"{'per device':<36}{'bytes':>11}  source",
        ]
        rows = [
            ("parameters", self.param_bytes, "layout"),
            ("optimizer state (AdamW)", self.optimizer_bytes, "layout"),
            ("gradients", self.gradient_bytes, "layout"),
            ("activations and other temporaries", self.activation_bytes, self.source),
            ("peak", self.peak_bytes, self.source),
        ]
        for name, value, source in rows:
            lines.append(f"  {name:<34}{format_bytes(value):>11}  {source}")
        if self.estimated and self.source != "estimate":
            est = self.estimated["peak_bytes_per_device"]
            lines.append(f"  {'peak, analytical estimate':<34}{format_bytes(est):>11}  estimate ({est / max(self.peak_bytes, 1) - 1:+.0%})")
        params = max(self.full_param_bytes, 1)
        lines += ["", f"collectives per step, per device ({self.source}; x = multiples of the {format_bytes(self.full_param_bytes)} of parameters)"]
        for kind, value in self.collective_bytes.items():
            if value:
                lines.append(f"  {kind:<34}{format_bytes(value):>11}  {value / params:5.2f}x")
        lines.append(f"  {'total':<34}{format_bytes(self.collective_total):>11}  {self.collective_total / params:5.2f}x")
        if self.textbook:
            parts = "; ".join(f"{what} {x:.2f}x" for what, x in self.textbook)
            lines.append(f"  {'textbook for this layout':<34}{'':>11}  {sum(x for _, x in self.textbook):5.2f}x ({parts})")
        if self.compile_seconds is not None:
            lines.append(f"  compiled in {self.compile_seconds:.1f} s")
        if self.pipeline:
            lines += [""] + pipeline_lines(self.pipeline, self.source)
        if self.context:
            lines += [""] + context_lines(self.context, self.source)
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.device_memory is not None:
            spare = self.device_memory - self.peak_bytes
            if spare >= 0:
                verdict = (
                    f"fits: peak {format_bytes(self.peak_bytes)} of {format_bytes(self.device_memory)} per device, "
                    f"{format_bytes(spare)} to spare"
                )
            else:
                verdict = (
                    f"does not fit: peak {format_bytes(self.peak_bytes)} per device is {format_bytes(-spare)} more than "
                    f"{format_bytes(self.device_memory)}; try --remat full, a larger fsdp axis, --grad-accum or a smaller batch"
                )
            lines += ["", f"verdict: {verdict}"]
        return "\n".join(lines)


def plan(
    cfg: TrainConfig,
    *,
    devices: Optional[int] = None,
    device_memory: Optional[int] = None,
    compile: str = "auto",
    max_compile_devices: int = MAX_COMPILE_DEVICES,
) -> StepPlan:
    """Plan one training step of ``cfg`` (model, mesh, rules, batch, remat, dtype, accum).

    Args:
      devices: resolves a ``-1`` mesh axis; default: the devices of this job.
      device_memory: bytes per device for the verdict (see :func:`device_memory`).
      compile: ``"auto"`` compiles meshes up to ``max_compile_devices`` and estimates
        beyond; ``"never"`` estimates only; ``"always"`` compiles whatever the size.

    Nothing is allocated on any device.
    """
    if compile not in ("auto", "never", "always"):
        raise ConfigError(f"compile must be auto, never or always, got {compile!r}")
    cfg.validate()
    sizes = mesh_sizes(cfg.parallel.mesh, devices)
    cfg = with_overrides(cfg, {"parallel.mesh": format_mesh(sizes)})
    lay = layout_figures(cfg, sizes)
    n = math.prod(sizes.values())
    est = estimate(cfg, lay)
    common = dict(
        model=cfg.model.name, mesh=sizes, rules=cfg.parallel.rules, remat=cfg.model.remat, dtype=cfg.model.dtype,
        batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, grad_accum=cfg.optim.grad_accum,
        num_params=lay["num_params"], full_param_bytes=lay["full_param_bytes"], param_bytes=lay["param_bytes"],
        optimizer_bytes=lay["optimizer_bytes"], gradient_bytes=lay["gradient_bytes"], batch_bytes=lay["batch_bytes"],
        textbook=textbook_collectives(cfg, lay), device_memory=device_memory, layout=lay,
        **attention_figures(cfg, lay["model"], lay["rules"]),
    )  # fmt: skip
    family = lay["model"].family.name
    calibration = [] if family == ESTIMATE_FAMILY else [
        f"the analytical estimate is fitted to {ESTIMATE_FAMILY}'s step (bench/plan_accuracy.py): for a {family} model "
        "it is a rough guide; the compiled figures hold for any model"
    ]  # fmt: skip
    pipe = lay["pipeline"]
    if pipe is not None:
        from nnxscale.training.state import pipeline_notes

        calibration.append(
            "the analytical estimate does not model the pipeline (fitted without one: no microbatch buffer, bubble or "
            "permutes, and every layer's activations on every device): trust the compiled figures"
        )
        calibration += pipeline_notes(pipe, lay["rules"], [r.spec for r in lay["rows"] if r.is_param], routed=lay["model"].routed)
    if compile == "never" or (compile == "auto" and n > max_compile_devices):
        notes = [] if compile == "never" else [f"{n} devices is more than --max-compile-devices {max_compile_devices}: estimated"]
        notes += calibration
        return StepPlan(**common, temp_bytes=est["temp_bytes_per_device"], peak_bytes=est["peak_bytes_per_device"],
                        collective_bytes=est["collective_bytes_by_kind"], source="estimate", notes=notes,
                        pipeline=pipeline_figures(cfg, lay), context=context_figures(cfg, lay))  # fmt: skip
    compiled = compiled_figures(cfg, n)
    notes = list(calibration) + compiled_notes(cfg, lay, compiled)
    return StepPlan(
        **common,
        temp_bytes=compiled["temp_bytes"],
        peak_bytes=compiled["peak_bytes"],
        collective_bytes=compiled["collective_bytes"],
        source=compiled["source"],
        compile_seconds=compiled["compile_seconds"],
        estimated={k: est[k] for k in ("temp_bytes_per_device", "peak_bytes_per_device", "collective_bytes_per_step")},
        activations=compiled["activations"],
        notes=notes,
        pipeline=pipeline_figures(cfg, lay, compiled["collective_bytes"]),
        context=context_figures(cfg, lay, compiled["collective_bytes"]),
    )


def compiled_notes(cfg: TrainConfig, lay: dict, compiled: dict) -> list[str]:
    """What to know when reading a compiled step's figures against the layout's."""
    import jax

    notes = []
    if compiled["argument_bytes"] > lay["param_bytes"] + lay["optimizer_bytes"] + lay["batch_bytes"] + (64 << 10):
        notes.append("the compiled step's arguments exceed the layout's state and batch bytes")
    if _split(lay["rows"], lay["rules"])["experts"]:
        e = lay["rules"].sizes[EXPERT]
        wide = "; with bfloat16 compute XLA:CPU sends them as float32, 2x more" if cfg.model.dtype == "bfloat16" else ""
        factor = getattr(lay["model"].config, "capacity_factor", None)
        if factor:
            notes.append(f"the compiled all-to-all sends slots the capacity sizes: each of the {e} peers' holds what capacity "
                         f"factor {factor:g} lets a device send it, {slot_factor(cfg, lay):.3g}x the textbook's{wide}")  # fmt: skip
        else:
            notes.append(f"the compiled all-to-all is dropless on CPU: each of the {e} peers' slots holds all of a device's "
                         f"(token, expert) assignments, {e}x the textbook's (XLA:CPU has no ragged_all_to_all){wide}")  # fmt: skip
    on_cpu = jax.default_backend() == "cpu" or "CPU devices" in compiled["source"]
    if lay["pipeline"] is not None and cfg.model.dtype == "bfloat16" and on_cpu:
        notes.append("with bfloat16 compute XLA:CPU sends the pipeline's permutes as float32 (the lowered program's are "
                     "bfloat16): the compiled permutes are 2x the expected")  # fmt: skip
    return notes


def pipeline_figures(cfg: TrainConfig, lay: dict, compiled_collectives: Optional[dict] = None) -> Optional[dict]:
    """The pipeline of a plan: its layout (schedule, stages, layers per stage, repeats,
    microbatches and their rows per batch shard), its bubble, and per device and step the
    ``collective-permute`` bytes, from :func:`nnxscale.layers.pipeline.pipeline_cost` and, when
    compiled, from the compiled step; ``None`` without a pipeline."""
    pipe, n = lay["pipeline"], lay["stacked_layers"]
    if pipe is None:
        return None
    from nnxscale.layers.pipeline import pipeline_cost

    d, dims, rules = cfg.data, lay["model"].dims, lay["rules"]
    # Beside a context axis, each device holds and passes on its T / context tokens.
    activation = (d.batch_size, d.seq_len // rules.length_shard_count, dims.width)
    cost = pipeline_cost(pipe, n, activation, cfg.model.dtype, batch_shards=rules.batch_shard_count, remat=cfg.model.remat)
    return {
        "schedule": cost.schedule,
        "stages": cost.stages,
        "repeats": cost.repeats,
        "layers": n,
        "layers_per_stage": cost.layers_per_stage,
        "microbatches": cost.microbatches,
        "microbatch_rows": cost.microbatch_rows,
        "iterations": cost.iterations,
        "bubble": cost.bubble,
        "permute_bytes_per_step": None if compiled_collectives is None else compiled_collectives.get("collective-permute", 0),
        "permute_bytes_expected": cost.permute_bytes,
        "boundary_bytes": cost.boundary_bytes,
        "in_flight": cost.in_flight,
        "held_bytes": cost.held_bytes,
        "with_ring": rules.length_shard_count > 1,  # the compiled permutes are the ring's too
    }


def pipeline_lines(p: dict, source: str = "compiler") -> list[str]:
    """The plan's pipeline section, in lines."""
    groups = p["layers"] // (p["stages"] * p["repeats"])
    layout = f"{p['layers_per_stage']} of {p['layers']} layers per stage"
    if p["repeats"] > 1:
        layout += f", as {p['repeats']} groups of {groups} (stage s holds groups s, s+{p['stages']}, ...)"
    formula = "(S-1)/(M+S-1)" if p["repeats"] == 1 else "(S-1)/(R*M+S-1)"
    title = {"gpipe": "GPipe", "circular": "circular", "1f1b": "1F1B"}[p["schedule"]]
    lines = [
        f"pipeline: {title}, {p['stages']} stages x {p['repeats']} repeats; {layout}",
        f"  microbatches {p['microbatches']} of {p['microbatch_rows']} rows per batch shard, "
        f"{p['iterations']} iterations per pass",
        f"  bubble {p['bubble']:.1%} of each stage's iterations idle {formula}",
    ]
    expected = format_bytes(p["permute_bytes_expected"])
    if p["permute_bytes_per_step"] is None:
        lines.append(f"  collective-permute per device per step: {expected} (pipeline_cost; not compiled)")
    else:
        both = ", the pipeline's and the context ring's together" if p.get("with_ring") else ""
        lines.append(
            f"  collective-permute per device per step: {format_bytes(p['permute_bytes_per_step'])} ({source}{both}), "
            f"{expected} expected (pipeline_cost: one microbatch per iteration, forward and backward)"
        )
    if p["schedule"] == "1f1b":
        lines += [
            f"  in flight: at most {p['in_flight']} microbatches per stage (2S-1, whatever M): a ring of "
            f"{format_bytes(p['held_bytes'])} per device",
            "  boundary: none (embedding and head run inside the schedule; their gradients are summed over stage once "
            "per step)",
        ]
        return lines
    lines.append(
        f"  boundary (embedding and head outside the pipeline): {format_bytes(p['boundary_bytes'])} of stage all-reduces "
        "per device per step"
    )
    return lines


def context_figures(cfg: TrainConfig, lay: dict, compiled_collectives: Optional[dict] = None) -> Optional[dict]:
    """The ring of a plan whose mesh splits the sequence (``context``): devices, tokens per
    device, and the ring's permutes per device and step, by :func:`ring_permute_bytes`
    and, compiled, the step's collective-permutes. None without a context axis."""
    n = lay["rules"].length_shard_count
    if n <= 1:
        return None
    return {
        "devices": n,
        "tokens_per_device": cfg.data.seq_len // n,
        "permute_bytes_expected": ring_permute_bytes(cfg, lay),
        "permute_bytes_per_step": None if compiled_collectives is None else compiled_collectives.get("collective-permute", 0),
        "with_pipeline": lay["pipeline"] is not None,  # the compiled permutes are the pipeline's too
    }


def context_lines(c: dict, source: str = "compiler") -> list[str]:
    """The plan's context section, in lines."""
    expected = format_bytes(c["permute_bytes_expected"])
    formula = "L x (2 (n-1) x keys and values + n x their float32 gradients)"
    head = f"context: the sequence split {c['devices']} ways, {c['tokens_per_device']:,} tokens per device; ring attention"
    if c["permute_bytes_per_step"] is None:
        return [head, f"  collective-permute per device per step: {expected} (ring_permute_bytes: {formula}; not compiled)"]
    if c.get("with_pipeline"):
        formula += ", in each stage's share of the pipeline's iterations"
        source += ", the pipeline's and the context ring's together"
    return [
        head,
        f"  collective-permute per device per step: {format_bytes(c['permute_bytes_per_step'])} ({source}), "
        f"{expected} expected ({formula})",
    ]


def mesh_sizes(spec, devices: Optional[int] = None) -> dict[str, int]:
    """``{axis: size}`` of a mesh spec; ``-1`` takes ``devices`` (default: this job's)."""
    from nnxscale.sharding.mesh import parse_mesh_spec

    axes = parse_mesh_spec(spec)
    if -1 in axes.values():
        if devices is None:
            import jax

            devices = jax.device_count()
        return resolve_mesh_shape(axes, devices)
    if devices is not None:
        return resolve_mesh_shape(axes, devices)
    return axes


# --------------------------------------------------------------------------------------
# layout: exact arithmetic
# --------------------------------------------------------------------------------------


def layout_figures(cfg: TrainConfig, sizes: dict[str, int]) -> dict[str, Any]:
    """Parameters, optimizer state, gradients and batch per device, from the layout alone.

    The run is built by :func:`nnxscale.training.setup`, the trainer's own, on an abstract
    mesh of ``sizes`` (no devices needed); the figures are the shard sizes of its abstract
    state, the arrays a run would allocate. Also ``model`` (the run's
    :class:`~nnxscale.training.model.RunModel`), ``abstract`` (the model's state, nothing
    allocated), ``rules`` (resolved against ``sizes``) and ``setup`` itself.
    """
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from nnxscale.sharding.state import layouts
    from nnxscale.training.state import setup

    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))
    s = setup(cfg, mesh, separator=_separator(cfg))
    rows = layouts(s.model_state, sizes, s.rules)

    def per_device(tree) -> int:
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))

    param_bytes = per_device(s.abstract["params"])
    return {
        "model": s.model,
        "abstract": s.model_state,
        "rules": s.rules,
        "rows": rows,
        "setup": s,
        "num_params": sum(math.prod(r.shape) for r in rows if r.is_param),
        "full_param_bytes": sum(full_bytes(r.shape, r.dtype) for r in rows),
        "param_bytes": param_bytes,
        "optimizer_bytes": per_device(s.abstract["opt_state"]),
        "gradient_bytes": param_bytes,  # float32, constrained to the parameters' layout
        "batch_bytes": per_device(s.abstract_batch),
        "pipeline": s.pipeline,
        "stacked_layers": s.stacked_layers,
    }


def _split(rows, rules) -> dict[str, float]:
    """Full bytes of the parameters, by how the batch axes treat them, divided by the
    other (tensor-parallel) axes: ``fsdp`` (split over a batch axis: gathered every step),
    ``replicated`` (whole on every batch shard: its gradient is all-reduced) and ``expert``
    (a mixture's experts split over the expert axis alone: each device keeps its own, never
    gathered; this is one device's share, its gradient all-reduced over the other batch axes).
    Experts split over the expert axis and FSDP's count as FSDP's, one device's experts'
    worth (they are gathered only among the devices holding the same experts);
    ``experts``: whether any parameter is split over the expert axis."""
    batch = {a for a in (*rules.batch_axes, *rules.length_axes) if rules.sizes[a] > 1}  # context: FSDP-like
    out = {"fsdp": 0.0, "replicated": 0.0, "expert": 0.0, "experts": 0.0}
    for row in rows:
        axes = {a for e in row.spec for a in entry_axes(e)}
        share = full_bytes(row.shape, row.dtype) / math.prod(rules.sizes[a] for a in axes - batch)
        if EXPERT in axes & batch:
            share /= rules.sizes[EXPERT]
            out["experts"] += share
            out["expert" if axes & batch == {EXPERT} else "fsdp"] += share
        else:
            out["fsdp" if axes & batch else "replicated"] += share
    return out


def textbook_collectives(cfg: TrainConfig, lay: dict) -> list[tuple[str, float]]:
    """What a textbook layout moves per step, as multiples of the parameter bytes.

    Data parallel: one all-reduce of the gradients of the parameters replicated across the
    batch axes. FSDP: all-gather the parameters in the forward pass and again in the
    backward pass, reduce-scatter the gradients: 3x what FSDP splits. Tensor parallel
    (Megatron): two all-reduces of the ``(B, T, C)`` activations per layer forward and two
    backward (two more with rematerialization); in a pipeline, a stage's layers in every
    iteration, bubble included. Pipeline: :func:`nnxscale.layers.pipeline.pipeline_cost`'s
    permutes and stage-boundary all-reduces.
    """
    rules, dims, full = lay["rules"], lay["model"].dims, max(lay["full_param_bytes"], 1)
    if rules.num_devices == 1:
        return []
    split = _split(lay["rows"], rules)
    out = []
    if split["replicated"] / full >= 0.005 and rules.batch_shard_count > 1:  # not just LayerNorms kept whole
        out.append(("data-parallel gradient all-reduce", split["replicated"] / full))
    if split["fsdp"]:
        out.append(("FSDP 2 gathers + reduce-scatter", 3 * split["fsdp"] / full))
    if split["expert"] and rules.batch_shard_count > rules.sizes[EXPERT]:
        out.append(("experts' gradient all-reduce", split["expert"] / full))
    if split["experts"]:
        out.append(("expert all-to-all", expert_all_to_all_bytes(cfg, lay) / full))
    tensor = math.prod(s for a, s in rules.sizes.items() if a not in (*rules.batch_axes, *rules.length_axes, STAGE))
    pipe = lay.get("pipeline")
    layers = _layers_run(dims.layers, pipe)
    if tensor > 1:
        d = cfg.data
        tokens = d.batch_size / rules.batch_shard_count * d.seq_len / rules.length_shard_count
        act = tokens * dims.width * (2 if cfg.model.dtype == "bfloat16" else 4)
        per_layer = 4 + (2 if cfg.model.remat != "none" else 0)
        out.append(("tensor-parallel activation all-reduces", per_layer * layers * act / full))
    if pipe is not None:
        p = pipeline_figures(cfg, lay)
        out.append(("pipeline permutes and stage boundary", (p["permute_bytes_expected"] + p["boundary_bytes"]) / full))
    if rules.length_shard_count > 1:
        out.append(("context ring permutes", ring_permute_bytes(cfg, lay) / full))
    return out


def expert_all_to_all_bytes(cfg: TrainConfig, lay: dict) -> int:
    """What a mixture's tokens move per device and step over an ``expert`` axis, sent only
    as they are: ``tokens per device x k x width x bytes x 2 (there and back) x 2 (forward
    and backward) x layers``, x 3 instead of x 2 when rematerialization repeats the forward
    pass's exchanges, times the accumulation steps; in a pipeline the layers are a stage's
    share of the iterations, bubble included (:func:`_layers_run`). Dropless on CPU, where there is no
    ``ragged_all_to_all``, each peer's slot holds all of a device's assignments: the
    compiled step moves ``expert`` times this (mixtral-mini on ``expert=8``: 8.02x,
    ``bench/moe.py``, 2026-11-24), and with bfloat16 compute XLA:CPU sends them as float32
    (the lowered program's all-to-all is bfloat16, the compiled one float32): 2x more."""
    rules, dims, d = lay["rules"], lay["model"].dims, cfg.data
    k = getattr(lay["model"].config, "num_experts_per_tok", 1)
    tokens = d.batch_size / rules.batch_shard_count * d.seq_len / rules.length_shard_count
    itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
    passes = 3 if cfg.model.remat != "none" else 2
    return int(tokens * k * dims.width * itemsize * 2 * passes * _layers_run(dims.layers, lay.get("pipeline")))


def slot_factor(cfg: TrainConfig, lay: dict) -> float:
    """The exchange's buffers over what its assignments need (:func:`expert_all_to_all_bytes`).
    Dropless, each of the ``expert`` peers' slots holds all of a device's assignments (no
    ``ragged_all_to_all``): ``expert`` times. With a capacity factor a slot holds what the
    capacity lets a device send one peer, ``E / expert`` experts' capacity per sequence:
    ``E cap / (T k)`` times, about the factor (:func:`nnxscale.layers.moe.capacity`)."""
    from nnxscale.layers.moe import capacity, slot_rows

    c, size = lay["model"].config, lay["rules"].sizes[EXPERT]
    k, E, T = c.num_experts_per_tok, c.num_local_experts, cfg.data.seq_len
    cap = capacity(getattr(c, "capacity_factor", None), T, k, E)
    return size * slot_rows(T, T, k, E, size, cap) / (T * k)  # a sequence's assignments and the slots they fill


def compiled_all_to_all_bytes(cfg: TrainConfig, lay: dict) -> int:
    """What the exchange of :mod:`nnxscale.layers.moe` sends over the ``expert`` axis, as XLA:CPU
    compiles it: :func:`slot_factor` times :func:`expert_all_to_all_bytes`, and bfloat16 is
    sent as float32 (2x). Within 1% of the compiled step (the experts' ids travel too:
    mixtral-mini on ``expert=8``, 8.02x the formula dropless)."""
    wide = 2 if cfg.model.dtype == "bfloat16" else 1
    return int(expert_all_to_all_bytes(cfg, lay) * slot_factor(cfg, lay) * wide)


def exchange_temp_bytes(cfg: TrainConfig, lay: dict) -> int:
    """The temporary memory of the experts' exchange on an ``expert`` axis, per device, which
    the fitted estimate (a dense model's) lacks. Its buffers have ``R`` rows, :func:`slot_factor`
    times a device's ``N k`` assignments; the working set of one layer holds about 8 of them
    ``F / tp`` wide (the experts' gate, up and hidden activations and their gradients) and
    half of one ``C`` wide, and without rematerialization every layer keeps ``2 (F / tp + C)``
    per row for the backward pass. In a pipeline a layer works on one microbatch at a
    time, and a stage keeps its share of the iterations (:func:`_layers_run`). Counted in
    the compute dtype (the exchange's buffers are bfloat16 under bfloat16 compute, unlike
    most of XLA:CPU's). Calibrated on 2026-11-25
    against the compiled steps of mixtral-tiny and mixtral-mini on ``expert=8``,
    ``fsdp=2,expert=4`` and ``data=2,expert=4`` (each remat policy) and mixtral-8x7b on
    ``fsdp=8,expert=8``."""
    rules, dims, d = lay["rules"], lay["model"].dims, cfg.data
    c = lay["model"].config
    tokens = d.batch_size / rules.batch_shard_count / cfg.optim.grad_accum * d.seq_len / rules.length_shard_count
    rows = tokens * c.num_experts_per_tok * slot_factor(cfg, lay)
    F = c.intermediate_size / rules.activation_split("mlp", c.intermediate_size)
    itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
    pipe = lay.get("pipeline")
    working = rows / (pipe.microbatches if pipe is not None else 1) * (8 * F + dims.width / 2)
    kept = rows * _layers_run(dims.layers, pipe) * 2 * (F + dims.width) if cfg.model.remat == "none" else 0.0
    return int(itemsize * (working + kept))


def ring_permute_bytes(cfg: TrainConfig, lay: dict) -> int:
    """What ring attention sends per device and step over a ``context`` axis of ``n`` devices.

    Per layer, with ``kv`` one device's keys and values (``2 b (T/n) K H`` elements in the
    compute dtype): the forward passes them on ``n - 1`` times; the backward passes them
    round again (``n - 1``) with their float32 gradients (``n`` times, home after the last):
    ``L x (2 (n - 1) kv + n kv gradients)``, times the accumulation steps. Compiled
    (llama-tiny, 2 layers, 2026-11-24) the ring's permutes are exactly this, with
    ``--remat`` none or full (the ring's residuals are kept, not recomputed) and with
    ``--document-mask``; the step also moves a few tensors of the zigzag layout outside the
    layers (0.1% more on ``context=4,fsdp=2``, 13% on ``context=2,fsdp=2,model=2``).

    Beside a ``stage`` axis each device runs its stage's ``L / (S R)`` layers on one
    microbatch per iteration, bubble included: ``L`` becomes ``L (R M + S - 1) / (S R M)``.
    """
    rules, dims, d = lay["rules"], lay["model"].dims, cfg.data
    n = rules.length_shard_count
    layers = _layers_run(dims.layers, lay["pipeline"])
    tokens = d.batch_size / rules.batch_shard_count / cfg.optim.grad_accum * d.seq_len / n
    kv_heads = dims.kv_heads / rules.activation_split("kv_heads", dims.kv_heads)
    itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
    kv = 2 * tokens * kv_heads * dims.head_width
    per_layer = 2 * (n - 1) * kv * itemsize + n * kv * 4
    return int(layers * per_layer * cfg.optim.grad_accum)


def _layers_run(layers: int, pipe) -> float:
    """How many layers' worth of one device's full batch a device runs per pass: all of them,
    or in a pipeline ``L / S`` layers over ``R*M + S - 1`` iterations of ``R*M`` microbatches'
    worth (the bubble included)."""
    if pipe is None:
        return layers
    return layers / pipe.stages * pipe.iterations / (pipe.repeats * pipe.microbatches)


# --------------------------------------------------------------------------------------
# the analytical estimate
# --------------------------------------------------------------------------------------

#: The model family :data:`COEFFICIENTS` are fitted to; a plan of another says so.
ESTIMATE_FAMILY = "gpt2"

#: Coefficients of :func:`estimate`, fitted to the compiler's figures on 8 simulated CPU
#: devices (gpt2-mini, gpt2 and gpt2-medium on data, fsdp and tensor-parallel meshes, each
#: remat policy) by ``python bench/plan_accuracy.py --fit``. Each multiplies a feature of
#: :func:`features`, in bytes; ``shared`` applies under every remat policy. The features
#: come from any family's dimensions (:class:`~nnxscale.models.ModelDims`).
COEFFICIENTS: dict[str, dict[str, float]] = {
    "shared": {
        "work_res": 12.46,
        "work_tp": 9.896,
        "work_att": 2.189,
        "logits": 1.621,
        "grads": 2.257,
        "grads_sum": 0.8634,
        "gathered": 1.205,
    },
    "none": {
        "saved_res": 7.546,
        "saved_tp": 24.0,
        "saved_att": 2.158,
    },
    "full": {
        "saved_res": 1.154,
    },
    "dots": {
        "saved_res": 1.971,
        "saved_tp": 5.435,
        "saved_att": 0.09378,
    },
    "collectives": {
        "coll_replicated": 1.129,
        "coll_fsdp": 2.816,
        "coll_tp": 1.053,
        "coll_vocab": 0.5313,
    },
}

#: Features kept for the backward pass, one coefficient each per remat policy.
SAVED_FEATURES = ("saved_res", "saved_tp", "saved_att")
#: Features of the working set, the logits, the gradients and gathered weights (shared).
SHARED_FEATURES = ("work_res", "work_tp", "work_att", "logits", "grads", "grads_sum", "gathered", "one")
#: Collective features: what data parallelism, FSDP and tensor parallelism move.
COLLECTIVE_FEATURES = ("coll_replicated", "coll_fsdp", "coll_tp", "coll_vocab")


def features(cfg: TrainConfig, lay: dict) -> dict[str, float]:
    """The quantities, in bytes per device, that the estimate combines.

    With ``b`` the micro-batch per device, ``T`` the sequence, ``C`` the width, ``L`` the
    depth, ``N`` the heads and ``V`` the vocabulary, and ``tp``, ``tph``, ``tpv`` the
    splits of the MLP, the heads and the vocabulary:

    - kept for the backward pass, all layers: ``saved_res`` (L b T C: residual-stream
      sized), ``saved_tp`` (L b T C / tp: head and MLP sized), ``saved_att`` (L b N T^2 /
      tph: attention scores); ``work_*`` the same for the one layer being recomputed or
      differentiated;
    - ``logits`` (b T V / tpv, float32), ``grads`` (the gradients), ``grads_sum`` (with
      gradient accumulation: the running sum, the gradients' size again), ``gathered`` (the
      weights FSDP gathers for one layer, plus the embedding);
    - collectives: the gradients of parameters replicated over the batch axes and of those
      FSDP splits, the tensor-parallel all-reduces of ``(b, T, C)`` activations (after
      attention and after the MLP, forward and backward, and the attention's again when
      full remat recomputes it), and the embedding's when the vocabulary is split. XLA reduces gradients once per
      micro-batch, so all of them scale with the accumulation steps.

    Activations count 4 bytes an element whatever the compute dtype: the coefficients are
    fitted to XLA:CPU, which computes bfloat16 in float32 (and keeps slightly more).
    """
    rules, dims = lay["rules"], lay["model"].dims
    d = cfg.data
    accum = cfg.optim.grad_accum
    b = d.batch_size / rules.batch_shard_count / accum
    T, C, L, N, V = d.seq_len / rules.length_shard_count, dims.width, dims.layers, dims.heads, dims.vocab_size
    s = 4
    split = rules.activation_split
    tp, tph, tpv = split("mlp", dims.mlp_width), split("heads", N), split("vocab", V)
    # Scores per query: every key (xla), or one tile of keys at a time (blockwise, the
    # ring, the accelerators' fused kernels), which the kernel's backward recomputes instead of keeping.
    from nnxscale.layers.attention import BLOCK
    from nnxscale.layers.loss import chunk_count

    tiled = attention_figures(cfg, lay["model"], rules)["attention"] not in ("xla", None)
    keys = min(BLOCK, T) if tiled else d.seq_len
    shards = rules.batch_shard_count * rules.length_shard_count  # as the families' chunked loss counts them
    logit_chunks = chunk_count(d.batch_size // accum, d.seq_len, V, shards) if lay["model"].family is not None else 1
    parts = _split(lay["rows"], rules)
    replicated = parts["replicated"] if rules.batch_shard_count > 1 else 0.0
    act = b * T * C * s
    # All-reduces of (b, T, C) per layer: after attention (heads split) and after the MLP,
    # forward and backward; full remat recomputes the attention's, whose output the MLP needs.
    tp_reductions = 2 * ((tph > 1) + (tp > 1)) + (cfg.model.remat == "full" and tph > 1)
    return {
        "saved_res": L * act,
        "saved_tp": L * act / tp,
        "saved_att": 0.0 if tiled else L * b * N * T * keys * s / tph,
        "work_res": act,
        "work_tp": act / tp,
        "work_att": b * N * T * keys * s / tph,
        "logits": b * T * V * 4 / tpv / logit_chunks,
        "grads": lay["gradient_bytes"],
        "grads_sum": lay["gradient_bytes"] if accum > 1 else 0.0,
        "gathered": (parts["fsdp"] / max(L, 1) + V * C * 4 / tpv) if parts["fsdp"] else 0.0,
        "one": 1.0,
        "coll_replicated": replicated * accum,
        "coll_fsdp": parts["fsdp"] * accum,
        "coll_tp": L * act * tp_reductions * accum,
        "coll_vocab": 2 * act * accum if tpv > 1 else 0.0,
    }


def estimate(cfg: TrainConfig, lay: Optional[dict] = None) -> dict[str, Any]:
    """The analytical estimate of a step's temporaries, peak and collectives per device."""
    if lay is None:
        lay = layout_figures(cfg, mesh_sizes(cfg.parallel.mesh))
    f = features(cfg, lay)
    shared, saved = COEFFICIENTS.get("shared", {}), COEFFICIENTS.get(cfg.model.remat, {})
    temp = sum(shared.get(k, 0.0) * f[k] for k in SHARED_FEATURES) + sum(saved.get(k, 0.0) * f[k] for k in SAVED_FEATURES)
    temp = int(max(temp, f["grads"] + f["grads_sum"]))
    experts = _split(lay["rows"], lay["rules"])["experts"]
    if experts:  # the experts' exchange: counted, not fitted
        temp += exchange_temp_bytes(cfg, lay)
    coll_coef = COEFFICIENTS.get("collectives", {})
    coll = int(sum(coll_coef.get(k, 0.0) * f[k] for k in COLLECTIVE_FEATURES))
    by_kind = {"all (estimate)": coll}
    if lay["rules"].length_shard_count > 1:  # the ring's permutes: counted, not fitted
        by_kind["collective-permute (ring)"] = ring_permute_bytes(cfg, lay)
    if experts:
        by_kind["all-to-all (experts)"] = compiled_all_to_all_bytes(cfg, lay)
    return {
        "temp_bytes_per_device": temp,
        "peak_bytes_per_device": int(lay["param_bytes"] + lay["optimizer_bytes"] + lay["batch_bytes"] + temp),
        "collective_bytes_per_step": sum(by_kind.values()),
        "collective_bytes_by_kind": by_kind,
    }


def attention_figures(cfg: TrainConfig, model, rules) -> dict[str, Optional[str]]:
    """The attention implementation a family's model uses at ``cfg``'s length, and its line."""
    if not getattr(model.config, "attention", None):  # your own module picks its own
        return {"attention": None, "attention_line": None}
    from nnxscale.layers import attention

    c, head, context = model.config, model.dims.head_width, rules.length_shard_count
    platform = attention.platform_of(rules.mesh)  # the target's, for a mesh of its devices
    return {
        "attention": "ring" if context > 1 else attention.resolve(c.attention, cfg.data.seq_len, c.dtype, head, cfg.data.document_mask, platform),
        "attention_line": attention.describe(c.attention, cfg.data.seq_len, c.dtype, head, context, cfg.data.document_mask, platform),
    }


# --------------------------------------------------------------------------------------
# the compiler
# --------------------------------------------------------------------------------------


def compile_step(cfg: TrainConfig, mesh=None):
    """``(setup, compiled step)``: the real train step of ``cfg`` compiled, nothing allocated.

    The program is compiled to be measured, never run: on XLA:CPU its machine code is
    generated without LLVM's optimizations (:data:`MEASURE_ONLY`). The memory figures and
    the collectives come from the HLO passes and the buffer assignment before that, and
    are the same (checked on 2026-11-24 for gpt2 on fsdp=8 with and without remat,
    gpt2-tiny on data=2,model=4, llama-tiny on context=2,fsdp=2,model=2, mixtral-tiny on
    expert=4,data=2 and gpt2-mini on stage=2,data=4: every figure equal), in 35-70% of the
    time (gpt2 on fsdp=8, 8 x 1024: 3.1 s instead of 5.5 s).
    """
    import jax

    from nnxscale.training.state import setup
    from nnxscale.training.step import make_train_step

    s = setup(cfg, mesh, separator=_separator(cfg))
    with jax.set_mesh(s.mesh):
        lowered = make_train_step(s).lower(s.abstract, s.abstract_batch)
        compiled = lowered.compile(compiler_options=MEASURE_ONLY if jax.default_backend() == "cpu" else None)
    return s, compiled


#: XLA:CPU options for a program compiled only to be measured (:func:`compile_step`).
MEASURE_ONLY = {"xla_backend_optimization_level": 0}


def _separator(cfg: TrainConfig):
    """A plan's document separator under ``--document-mask``: the plan reads no data, and the
    compiled step is the same program whichever token ends a document (the trainer's
    separator: :func:`nnxscale.training.inputs.document_separator`)."""
    return 0 if cfg.data.document_mask else None


def measure(compiled) -> dict[str, Any]:
    """The compiler's own figures for a compiled step, per device."""
    from nnxscale.planning import hlo as hlo

    ma = compiled.memory_analysis()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    return {
        "argument_bytes": ma.argument_size_in_bytes,
        "temp_bytes": ma.temp_size_in_bytes,
        "peak_bytes": peak,
        "collective_bytes": hlo.collective_bytes(compiled.as_text()),
    }


def compiled_figures(cfg: TrainConfig, n: int) -> dict[str, Any]:
    """Compile ``cfg``'s step for its ``n``-device mesh: here, or in a child process."""
    import jax

    if n <= jax.device_count():
        return _compile_here(cfg, n)
    return _compile_in_child(cfg, n)  # with XLA:CPU, also on an accelerator machine


def _compile_here(cfg: TrainConfig, n: int) -> dict[str, Any]:
    import jax

    from nnxscale.sharding.activations import record_activations
    from nnxscale.sharding.mesh import make_mesh

    mesh = make_mesh(cfg.parallel.mesh, devices=jax.devices()[:n])
    t = time.perf_counter()
    with record_activations() as records:
        _, compiled = compile_step(cfg, mesh)
    out = measure(compiled)
    out["compile_seconds"] = time.perf_counter() - t
    out["source"] = "compiler" if n == jax.device_count() or jax.default_backend() != "cpu" else f"compiler ({n} of {jax.device_count()} devices)"
    out["activations"] = [
        {"names": [str(n) for n in r.names], "shape": list(r.shape), "spec": str(r.layout.spec), "dropped": [str(d) for d in r.layout.dropped],
         "manual": list(r.manual)}
        for r in records
    ]
    return out


def _compile_in_child(cfg: TrainConfig, n: int) -> dict[str, Any]:
    """Compile in a fresh process with ``n`` simulated CPU devices; read its JSON answer."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["NNXSCALE_PLAN_CHILD"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "nnxscale.planning.planner"],
        input=json.dumps(cfg.to_dict()),
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"compiling the step on {n} simulated CPU devices failed: {tail}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["source"] = f"compiler (child process, {n} CPU devices)"
    return out


def _child_main() -> None:
    """Entry of the child process: a TrainConfig as JSON on stdin, the figures as JSON."""
    import jax

    cfg = TrainConfig.from_dict(json.loads(sys.stdin.read()))
    out = _compile_here(cfg, jax.device_count())
    out.pop("source")
    print(json.dumps(out))


# --------------------------------------------------------------------------------------
# sweep
# --------------------------------------------------------------------------------------


#: From this many tokens per sequence a sweep also proposes meshes that split the sequence.
SWEEP_CONTEXT_FROM = 8192


def candidate_meshes(n: int, heads: int, seq_len: int = 0, experts: int = 0) -> list[str]:
    """Meshes of ``n`` devices worth comparing: data, fsdp, and either with a model axis
    that divides ``heads`` (query and key/value heads alike: tensor parallelism within at
    most 8 devices); for sequences of :data:`SWEEP_CONTEXT_FROM` tokens or more, a
    ``context`` axis alone and beside ``fsdp`` (where it divides the sequence in ``2 x
    context`` head-tail chunks); for a mixture of ``experts``, an ``expert`` axis of the
    three largest sizes dividing both, alone or beside ``data`` and ``fsdp``."""
    out = [f"data={n}", f"fsdp={n}"]
    sizes = [e for e in range(min(n, experts), 1, -1) if experts % e == 0 and n % e == 0][:3]
    for e in sizes:
        out += [f"expert={n}"] if e == n else [f"data={n // e},expert={e}", f"fsdp={n // e},expert={e}"]
    if seq_len >= SWEEP_CONTEXT_FROM:
        for c in (n, 8, 4, 2):
            if 1 < c <= n and n % c == 0 and seq_len % (2 * c) == 0:
                out.append(f"context={n}" if c == n else f"context={c},fsdp={n // c}")
    for tp in (2, 4, 8):
        if n % tp or heads % tp or tp >= n:
            continue
        rest = n // tp
        out += [f"data={rest},model={tp}", f"fsdp={rest},model={tp}"]
    if n >= 4:
        out.append(f"data=2,fsdp={n // 2}")
    return list(dict.fromkeys(out))


def sweep(
    cfg: TrainConfig,
    devices: int,
    *,
    remats=("none", "dots", "full"),
    device_memory: Optional[int] = None,
    compile: str = "never",
    max_compile_devices: int = MAX_COMPILE_DEVICES,
) -> tuple[list[StepPlan], dict[str, str]]:
    """Plan every candidate mesh (with the ``auto`` rules) x remat policy for ``devices``.

    Returns the plans sorted by peak memory per device, and the candidates that cannot run
    this configuration (e.g. a batch the mesh cannot split): ``{mesh: the reason}``.
    ``compile="never"`` (the default) uses the estimate: quick, and each plan says so;
    ``"auto"`` compiles each.
    """
    from nnxscale.training.model import run_model

    if cfg.parallel.microbatches is not None:
        raise ConfigError("--sweep plans meshes without a stage axis: plan a pipeline without --sweep (drop --microbatches)")
    model = run_model(cfg, separator=_separator(cfg))
    dims, experts = model.dims, getattr(model.config, "num_local_experts", 0) if model.routed else 0
    plans, skipped = [], {}
    for mesh in candidate_meshes(devices, math.gcd(dims.heads, dims.kv_heads), cfg.data.seq_len, experts):
        for remat in remats:
            c = with_overrides(cfg, {"parallel.mesh": mesh, "model.remat": remat})
            try:
                plans.append(plan(c, device_memory=device_memory, compile=compile, max_compile_devices=max_compile_devices))
            except ConfigError as e:  # e.g. a batch the mesh cannot split: the same for every remat
                skipped.setdefault(mesh, str(e))
    return sorted(plans, key=lambda p: p.peak_bytes), skipped


def sweep_table(plans: list[StepPlan], skipped: Optional[dict[str, str]] = None) -> str:
    """One line per plan, fitting ones marked; then one line per candidate mesh that cannot run."""
    header = f"{'mesh':<22}{'remat':<7}{'peak/device':>12}{'collectives':>13}  {'source':<10} fits"
    lines = [header, "-" * len(header)]
    for p in plans:
        fits = "-" if p.fits is None else "yes" if p.fits else "no"
        lines.append(
            f"{format_mesh(p.mesh):<22}{p.remat:<7}{format_bytes(p.peak_bytes):>12}"
            f"{p.collective_total / max(p.full_param_bytes, 1):>12.2f}x  {p.source.split(' ')[0]:<10} {fits}"
        )
    for mesh, reason in (skipped or {}).items():
        lines.append(f"not planned: {mesh}: {reason}")
    return "\n".join(lines)


if __name__ == "__main__":
    _child_main()
