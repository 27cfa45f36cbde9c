"""Plan a training step before anything is allocated: memory per device, traffic per step.

``nnxscale plan`` answers "will this run fit, and what will it cost?". Each figure says
where it comes from:

- ``layout``: exact arithmetic on the sharded layout (parameters, optimizer state and
  gradients per device; the gradients are constrained to the parameters' layout):
  :mod:`nnxscale.planning.layout`.
- ``compiler``: the real train step compiled ahead of time for the mesh, nothing
  allocated (``make_train_step(setup(cfg)).lower(s.abstract, s.abstract_batch).compile()``):
  peak and temporary memory from ``memory_analysis()``, collectives counted in the
  compiled HLO (:func:`nnxscale.collective_bytes`): :mod:`nnxscale.planning.compiler`. A mesh
  larger than this machine is compiled in a child process with that many simulated CPU
  devices, up to ``max_compile_devices``. These are XLA:CPU's figures; a GPU's compiler
  fuses differently, so treat them as close, not exact.
- ``estimate``: an analytical model of the step (:func:`nnxscale.planning.estimate.estimate`)
  whose coefficients are fitted to the compiler's figures for GPT-2 (``python
  bench/plan_accuracy.py`` measures its error and refits it); for another family a plan
  says it is a rough guide. Used beyond ``max_compile_devices``, for ``--sweep`` unless
  asked to compile, and printed beside the compiler's peak otherwise.

Peak per device = arguments + outputs - donated (aliased) buffers + temporaries: the train
state (parameters and optimizer state, updated in place) and the batch, plus what the step
allocates while it runs (gradients, activations kept for the backward pass, gathered FSDP
weights, logits).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

import jax

from nnxscale.errors import NnxscaleError
from nnxscale.planning import steptime, targets
from nnxscale.planning.compiler import MAX_COMPILE_DEVICES, compile_for_target, compiled_figures, local_device_count, local_mesh
from nnxscale.planning.estimate import (
    ESTIMATE_FAMILY,
    accumulation_note,
    attention_figures,
    context_figures,
    estimate,
    formula_flops,
    pipeline_figures,
    slot_factor,
    textbook_collectives,
)
from nnxscale.planning.layout import layout_figures, mesh_sizes, plan_separator, split_params
from nnxscale.sharding.axes import EXPERT
from nnxscale.sharding.devices import MEMORY
from nnxscale.sharding.layout import format_bytes
from nnxscale.sharding.mesh import format_mesh
from nnxscale.training.config import ConfigError, TrainConfig, with_overrides
from nnxscale.training.state import pipeline_notes, setup


#: Memory of one device, by name (``--device``), in bytes.
KNOWN_DEVICES = MEMORY


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
    target: Optional[str] = None  # the accelerators compiled for (--target): their name; None: this machine's devices
    target_line: Optional[str] = None  # the target's chips, memory and interconnect, in a line
    flops: Optional[float] = None  # FLOPs per device per step, as the compiled program does them
    flops_expected: Optional[float] = None  # the model's formula (6N + attention per token) per device per step
    flops_recompute: Optional[float] = None  # the formula plus what remat runs again (estimate.formula_flops); None without
    flops_attention: Optional[float] = None  # the formula's attention term, with its recompute
    flops_frozen: bool = False  # the formula counts frozen weights (LoRA's base) at 4N: no weight gradients
    flops_uncounted: list = dataclasses.field(default_factory=list)  # custom-call kernels whose FLOPs the count cannot see
    refused: Optional[dict] = None  # the target's compiler refused the program: what it needs (see compiler.refusal)
    step_time: Optional[Any] = None  # the predicted step time (steptime.StepTime); None where not compiled or no hardware figures
    #: Where the step waits on collectives: the mesh compared with it (:func:`compare_alternative`):
    #: ``mesh``, ``why``, and its ``seconds``, ``speedup``, ``fits`` and ``peak_bytes``, or ``error``.
    alternative: Optional[dict] = None
    #: :func:`layout_figures` of the plan (the abstract model, resolved rules, rows): reused by
    #: callers (``nnxscale plan``'s table and lint) instead of being built again.
    layout: Optional[dict] = dataclasses.field(default=None, repr=False, compare=False)
    #: The compiled step's optimized program as text (``compiled.as_text()``: partitioned and
    #: scheduled by the compiler it was compiled for); None where the plan was estimated.
    hlo_text: Optional[str] = dataclasses.field(default=None, repr=False, compare=False)

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
        if self.refused is not None:
            return False
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
            "peak_bytes_per_device": None if self.refused is not None and not self.refused.get("needs") else self.peak_bytes,
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
            "target": self.target,
            "flops_per_device": self.flops,
            "flops_per_device_formula": self.flops_expected,
            "flops_per_device_formula_with_recompute": self.flops_recompute,
            "flops_per_device_attention": self.flops_attention,
            "flops_formula_frozen_base": self.flops_frozen,
            "flops_uncounted_kernels": self.flops_uncounted,
            "refused": self.refused,
            "step_time": None if self.step_time is None else self.step_time.to_json(),
            "alternative": self.alternative,
        }

    def _versus(self, expected: float) -> str:
        return f" ({self.flops / expected - 1:+.0%} compiled)" if self.flops and expected else ""

    def __str__(self) -> str:
        lines = self._title_lines() + self._memory_lines() + self._collective_lines() + self._flops_lines()
        if self.compile_seconds is not None:
            lines.append(f"  compiled in {self.compile_seconds:.1f} s")
        if self.step_time is not None:
            lines += [""] + steptime.format_lines(self.step_time, self.target or "")
        if self.pipeline:
            lines += [""] + pipeline_lines(self.pipeline, self.source)
        if self.context:
            lines += [""] + context_lines(self.context, self.source)
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines + self._verdict_lines())

    def _title_lines(self) -> list[str]:
        """What was planned: the model, mesh, rules, batch; the attention; the target."""
        return [
            f"plan: {self.model} ({self.num_params:,} parameters) on mesh {format_mesh(self.mesh)}, rules {self.rules}, "
            f"remat {self.remat}, {self.dtype} compute, global batch {self.batch_size} x {self.seq_len}"
            + (f" in {self.grad_accum} micro-batches" if self.grad_accum > 1 else ""),
            *([self.attention_line] if self.attention_line else []),
            *([f"target: {self.target_line}"] if self.target_line else []),
        ]

    def _memory_lines(self) -> list[str]:
        """The bytes per device, each with its source; where the compiler refused the program,
        what it said it needs instead of what was not measured."""
        lines = ["", f"{'per device':<36}{'bytes':>11}  source"]
        rows = [
            ("parameters", self.param_bytes, "layout"),
            ("optimizer state (AdamW)", self.optimizer_bytes, "layout"),
            ("gradients", self.gradient_bytes, "layout"),
            ("activations and other temporaries", self.activation_bytes, self.source),
            ("peak", self.peak_bytes, self.source),
        ]
        refused = self.refused
        if refused is not None:  # nothing was measured: what the compiler said it needs, if it said
            rows = rows[:3] + ([("needs, as the compiler refused it", refused["needs"],
                                 f"{self.source}: of {format_bytes(refused['available'])} per chip")] if refused.get("needs") else [])  # fmt: skip
        for name, value, source in rows:
            lines.append(f"  {name:<34}{format_bytes(value):>11}  {source}")
        if self.estimated and self.source != "estimate":
            est = self.estimated["peak_bytes_per_device"]
            lines.append(f"  {'peak, analytical estimate':<34}{format_bytes(est):>11}  estimate ({est / max(self.peak_bytes, 1) - 1:+.0%})")
        return lines

    def _collective_lines(self) -> list[str]:
        """The collectives per step by kind, as multiples of the parameter bytes, and the textbook's."""
        params = max(self.full_param_bytes, 1)
        if self.refused is None:
            lines = ["", f"collectives per step, per device ({self.source}; x = multiples of the {format_bytes(self.full_param_bytes)} of parameters)"]
            for kind, value in self.collective_bytes.items():
                if value:
                    lines.append(f"  {kind:<34}{format_bytes(value):>11}  {value / params:5.2f}x")
            lines.append(f"  {'total':<34}{format_bytes(self.collective_total):>11}  {self.collective_total / params:5.2f}x")
        else:
            lines = ["", "collectives per step, per device: not counted (the target's compiler refused the program)"]
        if self.textbook:
            parts = "; ".join(f"{what} {x:.2f}x" for what, x in self.textbook)
            lines.append(f"  {'textbook for this layout':<34}{'':>11}  {sum(x for _, x in self.textbook):5.2f}x ({parts})")
        return lines

    def _flops_lines(self) -> list[str]:
        """The compiled program's FLOPs beside the model's formula and its recompute; none where not compiled."""
        if self.flops is None:
            return []
        lines = ["", "FLOPs per device per step (matrix products, loop bodies once per trip)"]
        lines.append(f"  {'compiled program':<34}{self.flops:>11.3g}  {self.source}")
        if self.flops_expected is not None:
            label = "model formula (4N frozen + attn)" if self.flops_frozen else "model formula (6N + attention)"
            lines.append(f"  {label:<34}{self.flops_expected:>11.3g}  per token x tokens / devices"
                         f"{self._versus(self.flops_expected) if self.flops_recompute is None else ''}")  # fmt: skip
        if self.flops_recompute is not None:
            again = {"full": "each layer's forward again, less its last matmul (an output the backward does not need)",
                     "dots-except-mlp-in": "attention's products and the MLP's input projections again"}.get(
                         self.remat, "attention's products again")  # fmt: skip
            versus = "" if self.flops_uncounted and self.flops_attention else self._versus(self.flops_recompute)
            lines.append(f"  {'formula + remat ' + self.remat + ' recompute':<34}{self.flops_recompute:>11.3g}  {again}{versus}")
        if self.flops_uncounted:
            line = f"  not counted: the matmuls inside {', '.join(self.flops_uncounted)} (kernels: attention)"
            if self.flops_attention:
                line += (f"; the formula less its attention ({self.flops_attention:.3g} with its recompute): "
                         f"{self._versus((self.flops_recompute or self.flops_expected) - self.flops_attention).strip(' ()')}")  # fmt: skip
            lines.append(line)
        return lines

    def _verdict_lines(self) -> list[str]:
        """Whether the step fits the device's memory (what the compiler refused), and what to try where not."""
        if self.refused is not None:
            r = self.refused
            needs = (f"needs {format_bytes(r['needs'])} of {format_bytes(r['available'])} per chip" if r.get("needs")
                     else r["first_line"])  # fmt: skip
            return ["", f"verdict: does not fit: {needs} (the target's compiler refused the program); "
                        f"try {self._what_to_try()}"] + [f"  {b}" for b in r.get("buffers", [])]  # fmt: skip
        if self.device_memory is None:
            return []
        spare = self.device_memory - self.peak_bytes
        if spare >= 0:
            verdict = (
                f"fits: peak {format_bytes(self.peak_bytes)} of {format_bytes(self.device_memory)} per device, "
                f"{format_bytes(spare)} to spare"
            )
        else:
            verdict = (
                f"does not fit: peak {format_bytes(self.peak_bytes)} per device is {format_bytes(-spare)} more than "
                f"{format_bytes(self.device_memory)}; try {self._what_to_try()}"
            )
        return ["", f"verdict: {verdict}"]

    def _what_to_try(self) -> str:
        """What lowers the peak, less what the plan already does (``--remat full`` when it is set)."""
        tries = ["a larger fsdp axis", "--grad-accum", "a smaller batch"]
        return ", ".join((["--remat full"] if self.remat != "full" else []) + tries[:-1]) + " or " + tries[-1]


def compiles(compile: str, n: int, max_compile_devices: int, target=None) -> bool:
    """Whether :func:`plan` compiles the step of ``n`` devices under ``compile`` (``"never"``,
    ``"auto"``: within ``max_compile_devices`` or for a ``target``, ``"always"``), or estimates it."""
    return compile != "never" and (compile == "always" or n <= max_compile_devices or target is not None)


def plan(
    cfg: TrainConfig,
    *,
    devices: Optional[int] = None,
    device_memory: Optional[int] = None,
    compile: str = "auto",
    max_compile_devices: int = MAX_COMPILE_DEVICES,
    target=None,
    compare: bool = True,
) -> StepPlan:
    """Plan one training step of ``cfg`` (model, mesh, rules, batch, remat, dtype, accum).

    Args:
      devices: resolves a ``-1`` mesh axis; default: the devices of this job (the target's chips).
      device_memory: bytes per device for the verdict (see :func:`device_memory`); default
        with a target: its memory per chip.
      compile: ``"auto"`` compiles meshes up to ``max_compile_devices`` and estimates
        beyond (for a target, whatever the size); ``"never"`` estimates only; ``"always"``
        compiles whatever the size.
      target: accelerators to compile for by their own compiler, deviceless: a name
        (``"h100x8"``, ``"v5p-128"``; :mod:`nnxscale.planning.targets`) or a
        :class:`~nnxscale.planning.targets.Target`. ``None``: this machine's devices (XLA:CPU
        simulating the mesh where it has fewer).
      compare: where the predicted step waits on collectives for a fifth of its time or more,
        also plan the mesh that moves them (:func:`compare_alternative`: one more compile) and
        name it, with how much faster or slower it is predicted, in the bottleneck line.

    Nothing is allocated on any device.
    """
    if compile not in ("auto", "never", "always"):
        raise ConfigError(f"compile must be auto, never or always, got {compile!r}")
    cfg.validate()
    if isinstance(target, str):
        target = targets.get(target)
    sizes = mesh_sizes(cfg.parallel.mesh, devices) if target is None else targets.mesh_sizes(cfg.parallel.mesh, target)
    placement = [] if target is None else targets.placement_notes(sizes, target)
    if target is not None and device_memory is None:
        device_memory = target.memory
    cfg = with_overrides(cfg, {"parallel.mesh": format_mesh(sizes)})
    n = math.prod(sizes.values())
    estimated_only = not compiles(compile, n, max_compile_devices, target)
    # Compiled here: one setup on this machine's devices serves the layout and the compile
    # (the run's rules resolved once); otherwise the layout's on an abstract mesh.
    here = not estimated_only and target is None and n <= local_device_count()
    s = setup(cfg, local_mesh(cfg, n), separator=plan_separator(cfg)) if here else None
    lay = layout_figures(cfg, sizes, s)
    est = estimate(cfg, lay)
    common = run_fields(cfg, lay, sizes, target, device_memory)
    calibration = estimate_notes(cfg, lay)
    if estimated_only:
        notes = [] if compile == "never" else [f"{n} devices is more than --max-compile-devices {max_compile_devices}: estimated"]
        notes += placement + calibration
        return StepPlan(**common, temp_bytes=est["temp_bytes_per_device"], peak_bytes=est["peak_bytes_per_device"],
                        collective_bytes=est["collective_bytes_by_kind"], source="estimate", notes=notes,
                        pipeline=pipeline_figures(cfg, lay), context=context_figures(cfg, lay))  # fmt: skip
    compiled = compiled_figures(cfg, n, s) if target is None else compile_for_target(cfg, target)
    if compiled.get("refused"):  # XLA:TPU would not fit it: what it needs, nothing else measured
        needs = compiled["refused"]["needs"] or 0
        state = lay["param_bytes"] + lay["optimizer_bytes"] + lay["batch_bytes"]
        return StepPlan(**common, temp_bytes=max(needs - state, 0), peak_bytes=needs, collective_bytes={},
                        source=compiled["source"], compile_seconds=compiled["compile_seconds"], notes=placement + calibration,
                        refused=compiled["refused"])  # fmt: skip
    notes = placement + list(calibration) + compiled_notes(cfg, lay, compiled)
    result = compiled_plan(cfg, lay, est, compiled, common, notes, target)
    if compare:
        compare_alternative(result, cfg, target=target, devices=devices, device_memory=device_memory, compile=compile,
                            max_compile_devices=max_compile_devices)  # fmt: skip
    return result


def run_fields(cfg: TrainConfig, lay: dict, sizes: dict[str, int], target, device_memory: Optional[int]) -> dict[str, Any]:
    """The :class:`StepPlan` fields of the run itself, whichever figures give its temporaries,
    peak and collectives: its settings, the layout's bytes, the textbook collectives, the FLOPs
    formula, the attention it runs and the target."""
    return dict(
        model=cfg.model.name, mesh=sizes, rules=cfg.parallel.rules, remat=cfg.model.remat, dtype=cfg.model.dtype,
        batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, grad_accum=cfg.optim.grad_accum,
        num_params=lay["num_params"], full_param_bytes=lay["full_param_bytes"], param_bytes=lay["param_bytes"],
        optimizer_bytes=lay["optimizer_bytes"], gradient_bytes=lay["gradient_bytes"], batch_bytes=lay["batch_bytes"],
        textbook=textbook_collectives(cfg, lay, compiler_platform(target)), device_memory=device_memory, layout=lay,
        target=None if target is None else target.name, target_line=None if target is None else target.describe(),
        **{f"flops_{k}": v for k, v in formula_flops(cfg, lay, math.prod(sizes.values())).items()},
        # A target's layout is on an abstract mesh: the attention is the one its devices run.
        **attention_figures(cfg, lay["model"], lay["rules"], None if target is None else {"gpu": "nvidia", "tpu": "tpu"}[target.family]),
    )  # fmt: skip


def estimate_notes(cfg: TrainConfig, lay: dict) -> list[str]:
    """How far to trust the analytical estimate for this run: fitted to one family, without
    pipelines; what accumulation and a pipeline do to the step."""
    family = lay["model"].family.name
    notes = [] if family == ESTIMATE_FAMILY else [
        f"the analytical estimate is fitted to {ESTIMATE_FAMILY}'s step (bench/plan_accuracy.py): for a {family} model "
        "it is a rough guide; the compiled figures hold for any model"
    ]  # fmt: skip
    notes += [note for note in (accumulation_note(cfg, lay),) if note]
    pipe = lay["pipeline"]
    if pipe is not None:
        notes.append(
            "the analytical estimate does not model the pipeline (fitted without one: no microbatch buffer, bubble or "
            "permutes, and every layer's activations on every device): trust the compiled figures"
        )
        notes += pipeline_notes(pipe, lay["rules"], [r.spec for r in lay["rows"] if r.is_param], routed=lay["model"].routed)
    return notes


def compiled_plan(cfg: TrainConfig, lay: dict, est: dict, compiled: dict, common: dict, notes: list, target) -> StepPlan:
    """The plan of a compiled step: the compiler's figures (:func:`compiled_figures`,
    :func:`compile_for_target`), the estimate's beside them, and the step's predicted time."""
    hlo_text, where = compiled.pop("hlo_text", None), compiled.pop("placement", None)
    return StepPlan(
        **common,
        temp_bytes=compiled["temp_bytes"],
        peak_bytes=compiled["peak_bytes"],
        collective_bytes=compiled["collective_bytes"],
        source=compiled["source"],
        compile_seconds=compiled["compile_seconds"],
        estimated={k: est[k] for k in ("temp_bytes_per_device", "peak_bytes_per_device", "collective_bytes_per_step")},
        activations=compiled["activations"],
        flops=compiled.get("flops"),
        flops_uncounted=compiled.get("flops_uncounted", []),
        notes=notes,
        pipeline=pipeline_figures(cfg, lay, compiled["collective_bytes"]),
        context=context_figures(cfg, lay, compiled["collective_bytes"]),
        step_time=predict_step(cfg, lay, common["mesh"], target, hlo_text, where, compiled.get("fresh_bytes", 0.0)),
        hlo_text=hlo_text,
    )


#: The share of a predicted step its exposed collectives take from which :func:`plan` compares another mesh.
COMPARE_FROM = 0.2


def compare_alternative(p: StepPlan, cfg: TrainConfig, *, target=None, **kw) -> Optional[StepPlan]:
    """Where ``p``'s predicted step waits on collectives for :data:`COMPARE_FROM` of its
    time or more: plan the mesh
    :func:`nnxscale.planning.targets.alternative_mesh` proposes for the collectives that expose
    the most (their axes kept inside a node, or another kind of axis), record it in
    ``p.alternative`` and end the bottleneck line with it ("...; data=2,fsdp=8 (fsdp inside
    each node, data across nodes) is predicted 1.70x faster: 21.4 ms per step"). Returns the
    alternative's plan; None where nothing was compared (collectives exposed less, no axes to
    move, or a mesh that cannot run this batch: then ``p.alternative`` holds its ``error``)."""
    st = p.step_time
    if st is None or st.exposed_collective_s < COMPARE_FROM * st.seconds:
        return None
    worst = steptime.worst_collective(st)
    across = worst.link in ("network", "dcn")
    found = targets.alternative_mesh(p.mesh, worst.axes.split(",") if worst.axes else [], across, target)
    if found is None:
        return None
    sizes, why = found
    mesh = format_mesh(sizes)
    try:
        alt = plan(with_overrides(cfg, {"parallel.mesh": mesh}), target=target, compare=False, **kw)
    except NnxscaleError as e:  # a mesh this batch or these rules cannot run, a compile that failed: the plan stands
        p.alternative = {"mesh": mesh, "why": why, "error": str(e)}
        return None
    p.alternative = {"mesh": mesh, "why": why, "fits": alt.fits, "peak_bytes": alt.peak_bytes,
                     "seconds": None if alt.step_time is None else alt.step_time.seconds}  # fmt: skip
    # The line names the collectives already where the step is communication-bound.
    lead = "; " if st.bottleneck.startswith("communication-bound") else (
        f"; the {worst.axes} {worst.kind}s expose {steptime.format_seconds(worst.exposed)}: ")  # fmt: skip
    if alt.fits is False:
        refused_unsized = alt.refused is not None and not alt.refused.get("needs")
        need = ("the compiler refuses it" if refused_unsized
                else f"needs {format_bytes(alt.peak_bytes)} of {format_bytes(alt.device_memory)} per device")  # fmt: skip
        st.bottleneck += f"{lead}{mesh} ({why}) does not fit: {need}"
    elif alt.step_time is not None:
        ratio = st.seconds / alt.step_time.seconds
        p.alternative["speedup"] = ratio
        faster = "as fast" if round(ratio, 2) == 1 else f"{ratio:.2f}x faster" if ratio > 1 else f"{1 / ratio:.2f}x slower"
        st.bottleneck += f"{lead}{mesh} ({why}) is predicted {faster}: {steptime.format_seconds(alt.step_time.seconds)} per step"
    return alt


def predict_step(cfg: TrainConfig, lay: dict, sizes: dict, target, hlo_text: Optional[str], where: Optional[dict] = None,
                 fresh_bytes: float = 0.0):  # fmt: skip
    """The step time of the compiled program on the target's chips (:func:`nnxscale.planning.steptime.predict`;
    ``where``: the child compile's :func:`~nnxscale.planning.targets.placement` of the devices), or on this
    machine's XLA:CPU where its figures are registered (``register_hardware("cpu", ...)``); ``None``
    without a program or figures. ``fresh_bytes``: what the program maps anew each run, per device
    (:func:`nnxscale.planning.compiler.measure`'s)."""
    if not hlo_text:
        return None
    try:
        hw = steptime.hardware_for(target if target is not None else "cpu")
    except KeyError:
        return None
    n = math.prod(sizes.values())
    tokens = cfg.data.batch_size * cfg.data.seq_len
    model_flops = lay["setup"].flops_per_token() * tokens
    links = steptime.axis_links_for(sizes, target) if target is not None else None
    placement = None if where is None else steptime.Placement.from_json(where)
    return steptime.predict(hlo_text, hw, axis_links=links, mesh=sizes, placement=placement, n_devices=n,
                            tokens_per_step=tokens, model_flops_per_step=model_flops, compute_dtype=cfg.model.dtype,
                            fresh_bytes=fresh_bytes)  # fmt: skip


def compiler_platform(target=None) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: whose compiler builds the planned step (the target's,
    else this machine's)."""
    return target.family if target is not None else jax.default_backend()


def compiled_notes(cfg: TrainConfig, lay: dict, compiled: dict) -> list[str]:
    """What to know when reading a compiled step's figures against the layout's."""
    notes = []
    if compiled["argument_bytes"] > lay["param_bytes"] + lay["optimizer_bytes"] + lay["batch_bytes"] + (64 << 10):
        notes.append("the compiled step's arguments exceed the layout's state and batch bytes")
    if split_params(lay["rows"], lay["rules"])["experts"]:
        e = lay["rules"].sizes[EXPERT]
        on_cpu = compiled.get("platform", jax.default_backend()) == "cpu"
        wide = "; with bfloat16 compute XLA:CPU sends them as float32, 2x more" if cfg.model.dtype == "bfloat16" and on_cpu else ""
        factor = getattr(lay["model"].config, "capacity_factor", None)
        if factor:
            notes.append(f"the compiled all-to-all sends slots the capacity sizes: each of the {e} peers' holds what capacity "
                         f"factor {factor:g} lets a device send it, {slot_factor(cfg, lay):.3g}x the textbook's{wide}")  # fmt: skip
        else:
            notes.append(f"the compiled all-to-all is dropless: each of the {e} peers' slots holds all of a device's "
                         f"(token, expert) assignments, {e}x the textbook's (fixed slots: XLA:CPU has no "
                         f"ragged_all_to_all, and one program serves every platform){wide}")  # fmt: skip
    on_cpu = compiled.get("platform", jax.default_backend()) == "cpu"
    if lay["pipeline"] is not None and cfg.model.dtype == "bfloat16" and on_cpu:
        notes.append("with bfloat16 compute XLA:CPU sends the pipeline's permutes as float32 (the lowered program's are "
                     "bfloat16): the compiled permutes are 2x the expected")  # fmt: skip
    return notes


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
            f"  in flight: at most {p['in_flight']} work items per stage (2SR-1, whatever M): a ring of "
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

