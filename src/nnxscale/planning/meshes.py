"""Plan every candidate mesh x remat policy for a device count."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from nnxscale.errors import MeshError
from nnxscale.planning.compiler import MAX_COMPILE_DEVICES
from nnxscale.planning.estimate import SAVED_FEATURES, coefficients, features
from nnxscale.planning.layout import plan_separator
from nnxscale.planning.report import StepPlan, compiles, plan
from nnxscale.planning.steptime import format_seconds, rank_by_time
from nnxscale.planning.targets import split_over_domains
from nnxscale.sharding.layout import format_bytes
from nnxscale.sharding.mesh import format_mesh, parse_mesh_spec
from nnxscale.sharding.state import shared_abstract_models
from nnxscale.training.config import ConfigError, TrainConfig, with_overrides
from nnxscale.training.model import run_model


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
    target=None,
) -> tuple[list[StepPlan], dict[str, str]]:
    """Plan every candidate mesh (with the ``auto`` rules) x remat policy for ``devices``.

    Returns the plans sorted by predicted step time where the plans have one (compiled, on a
    target or on registered CPU figures; :func:`nnxscale.planning.steptime.rank_by_time`), else
    by peak memory per device, and the candidates that cannot run this configuration (e.g. a
    batch the mesh cannot split): ``{mesh: the reason}``.
    ``compile="never"`` (the default) uses the estimate: quick, and each plan says so;
    ``"auto"`` compiles each (of the pipelined ones, only the microbatch counts with the least
    proxy time: :func:`pipeline_plans`). With a ``target`` (:mod:`nnxscale.planning.targets`)
    the candidates are laid out for it (:func:`for_target`) and compiled by its compiler.
    """
    if cfg.parallel.microbatches is not None:
        raise ConfigError("--sweep chooses the microbatches of the pipelines it plans: drop --microbatches")
    model = run_model(cfg, separator=plan_separator(cfg))
    dims, experts = model.dims, getattr(model.config, "num_local_experts", 0) if model.routed else 0
    with shared_abstract_models():  # each remat policy's model traced once, not once per mesh
        plans, skipped = pipeline_plans(cfg, devices, dims.layers, remats=remats, device_memory=device_memory,
                                        compile=compile, max_compile_devices=max_compile_devices, target=target)  # fmt: skip
        candidates = candidate_meshes(devices, math.gcd(dims.heads, dims.kv_heads), cfg.data.seq_len, experts)
        if target is not None:
            candidates = for_target(candidates, target)
        for mesh in candidates:
            for remat in remats:
                c = with_overrides(cfg, {"parallel.mesh": mesh, "model.remat": remat})
                try:
                    plans.append(plan(c, device_memory=device_memory, compile=compile, max_compile_devices=max_compile_devices,
                                      target=target, compare=False))  # fmt: skip  (the sweep compares them all)
                except ConfigError as e:  # e.g. a batch the mesh cannot split: the same for every remat
                    skipped.setdefault(mesh, str(e))
    return rank_by_time(sorted(plans, key=lambda p: p.peak_bytes)), skipped


#: Axes whose collectives run every layer: on a target they stay inside a node or slice, innermost.
INNER_AXES = ("expert", "context", "model")


def for_target(candidates: list[str], target) -> list[str]:
    """The candidate meshes laid out for ``target``: data and fsdp outermost (across nodes
    or slices), then expert, context and model (innermost); those whose context or model
    axis would cross a node or slice dropped."""
    out = []
    for spec in candidates:
        axes = parse_mesh_spec(spec)
        ordered = {a: axes[a] for a in sorted(axes, key=lambda a: INNER_AXES.index(a) if a in INNER_AXES else -1)}
        try:
            spans = split_over_domains(ordered, target)
        except MeshError:
            continue
        if all(spans.get(a, 1) == 1 for a in ("context", "model")):
            out.append(format_mesh(ordered))
    return list(dict.fromkeys(out))


def sweep_table(plans: list[StepPlan], skipped: Optional[dict[str, str]] = None) -> str:
    """One line per plan, fitting ones marked; then one line per candidate mesh that cannot run."""
    timed = any(p.step_time is not None for p in plans)
    header = f"{'mesh':<22}{'remat':<7}{'peak/device':>12}{'collectives':>13}  {'source':<10} fits" + (
        f"{'step':>10}{'tokens/s/dev':>14}{'MFU':>7}" if timed else "")
    lines = [header, "-" * len(header)]
    for p in plans:
        fits = "-" if p.fits is None else "yes" if p.fits else "no"
        st = p.step_time
        time = "" if not timed else f"{'-':>10}{'-':>14}{'-':>7}" if st is None else (
            f"{format_seconds(st.seconds):>10}{st.tokens_per_s_per_device:>14,.0f}{'-' if st.mfu is None else f'{st.mfu:.1%}':>7}")
        lines.append(
            f"{format_mesh(p.mesh):<22}{p.remat:<7}{format_bytes(p.peak_bytes):>12}"
            f"{p.collective_total / max(p.full_param_bytes, 1):>12.2f}x  {p.source.split(' ')[0]:<10} {f'{fits:<4}' if timed else fits}{time}"
        )
    for mesh, reason in (skipped or {}).items():
        lines.append(f"not planned: {mesh}: {reason}")
    lines += pipeline_lines(plans)
    return "\n".join(lines)


# --- Pipelines in the sweep: stage meshes x schedule (gpipe, 1f1b) x microbatch count ---

#: Pipeline stage counts a sweep tries (each must divide the devices and the layers).
SWEEP_STAGES = (2, 4, 8)
#: Microbatch counts a sweep tries per stage count ``S``: ``S``, ``2S``, ``4S``, ``8S`` (those
#: that divide each batch shard's rows). Fewer than ``S`` is mostly bubble.
SWEEP_MICROBATCHES_PER_STAGE = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")


def pipeline_candidates(n: int, layers: int, batch_size: int, grad_accum: int = 1) -> list[tuple[str, str, int]]:
    """``(mesh, schedule, microbatches)`` worth comparing on ``n`` devices: a ``stage`` axis of
    :data:`SWEEP_STAGES` that divides ``n`` and ``layers`` (below ``n``: the rest of the devices
    split the batch, as ``data`` or ``fsdp``), each schedule, and the microbatch counts of
    :data:`SWEEP_MICROBATCHES_PER_STAGE` that divide a batch shard's rows (of one
    accumulation step)."""
    out = []
    for stages in SWEEP_STAGES:
        if n % stages or layers % stages or stages > n:
            continue
        rest = n // stages
        meshes = [f"stage={stages}"] if rest == 1 else [f"stage={stages},data={rest}", f"stage={stages},fsdp={rest}"]
        rows = batch_size // grad_accum // rest if batch_size % (grad_accum * rest) == 0 else 0
        counts = [stages * k for k in SWEEP_MICROBATCHES_PER_STAGE if rows and rows % (stages * k) == 0]
        out += [(mesh, schedule, m) for mesh in meshes for schedule in SCHEDULES for m in counts]
    return out


#: The proxy's figures (:func:`pipeline_proxy_seconds`): a device's sustained FLOP/s, and the
#: fixed cost of one pipeline iteration (the stage's kernels launched, the permute's latency).
PROXY_FLOPS_PER_SECOND = 1e14
PROXY_SECONDS_PER_ITERATION = 50e-6


def pipeline_proxy_seconds(flops: float, pipeline: dict, remat: str) -> float:
    """A transparent stand-in for a pipelined step's time where no prediction ranks the sweep
    (estimated plans; XLA:CPU without registered figures), and what chooses the microbatch
    counts a compiling sweep compiles (:func:`pipeline_plans`): the step's compute (``flops``
    per device at :data:`PROXY_FLOPS_PER_SECOND`) times ``(R M + S - 1) / (R M)`` (the bubble), 1F1B without remat one forward more per
    microbatch (its backward recomputes the stage from its input: 4/3 of the compute), plus
    :data:`PROXY_SECONDS_PER_ITERATION` per iteration (``R M + S - 1`` of them): more
    microbatches shrink the bubble and add iterations. ``pipeline``: a plan's figures
    (:func:`nnxscale.planning.estimate.pipeline_figures`)."""
    work = pipeline["repeats"] * pipeline["microbatches"]
    iterations = work + pipeline["stages"] - 1
    compute = flops / PROXY_FLOPS_PER_SECOND
    if pipeline["schedule"] == "1f1b" and remat == "none":
        compute *= 4 / 3
    return compute * iterations / work + iterations * PROXY_SECONDS_PER_ITERATION


def _step_flops(p: StepPlan) -> float:
    """FLOPs per device of a plan's step: compiled where it was, else the formula's."""
    return next((f for f in (p.flops, p.flops_recompute, p.flops_expected) if f), 0.0)


#: With compiles (``--target``, or ``--compile auto`` within the devices it compiles), the
#: microbatch counts compiled per mesh, schedule and remat policy: the best by proxy time.
PIPELINE_COMPILES_PER_GROUP = 2


def pipeline_plans(
    cfg: TrainConfig,
    devices: int,
    layers: int,
    *,
    remats,
    device_memory=None,
    compile="never",
    max_compile_devices=MAX_COMPILE_DEVICES,
    target=None,
) -> tuple[list[StepPlan], dict[str, str]]:
    """The sweep's pipelines: for each candidate stage mesh, schedule and remat policy, the
    plan at the microbatch count (:func:`pipeline_candidates`) ranked first by
    :func:`_pipeline_rank` among those that fit ``device_memory`` (all of them when it is not
    known or none fits); each plan's figures gain ``proxy_seconds``
    (:func:`pipeline_proxy_seconds`). Also the candidates that cannot run: ``{mesh: the reason}``.

    Every candidate is estimated first (no compile) and given its proxy time. Where the sweep
    compiles (a ``target``, or ``compile`` other than ``"never"`` within
    ``max_compile_devices``), only the :data:`PIPELINE_COMPILES_PER_GROUP` microbatch counts
    of each mesh, schedule and remat policy ranked first on the estimate (fitting, then proxy
    time) are compiled, and the compiled plans, which carry a predicted step time where the
    compiler's chip has figures, are ranked by it."""
    groups: dict[tuple, list[tuple[StepPlan, TrainConfig]]] = {}
    skipped: dict[str, str] = {}
    for mesh, schedule, m in pipeline_candidates(devices, layers, cfg.data.batch_size, cfg.optim.grad_accum):
        if target is not None:  # laid out for the target's nodes or slices, or dropped
            laid = for_target([mesh], target)
            if not laid:
                continue
            mesh = laid[0]
        for remat in remats:
            c = with_overrides(cfg, {"parallel.mesh": mesh, "model.remat": remat, "parallel.microbatches": m,
                                     "parallel.pipeline_schedule": schedule})  # fmt: skip
            try:
                p = _pipeline_plan(c, device_memory=device_memory, compile="never", target=target)
            except ConfigError as e:
                skipped.setdefault(f"{mesh} ({schedule})", str(e))
                break
            groups.setdefault((mesh, schedule, remat), []).append((p, c))
    best = []
    kw = {"device_memory": device_memory, "compile": compile, "max_compile_devices": max_compile_devices, "target": target}
    for group in groups.values():
        group.sort(key=lambda pc: _fits_then_rank(pc[0]))
        if compiles(compile, devices, max_compile_devices, target):
            group = [(_pipeline_plan(c, **kw), c) for _, c in group[:PIPELINE_COMPILES_PER_GROUP]]
        best.append(min((p for p, _ in group), key=_fits_then_rank))
    return best, skipped


def _pipeline_plan(c: TrainConfig, **kw) -> StepPlan:
    """The plan of pipelined configuration ``c`` as :func:`nnxscale.planning.plan` gives it
    (``kw``): compiled where it compiles, else estimated with its schedule's activations
    (:func:`scheduled_estimate`); with its proxy time."""
    p = plan(c, compare=False, **kw)
    if p.source == "estimate":
        p = scheduled_estimate(c, p)
    p.pipeline["proxy_seconds"] = pipeline_proxy_seconds(_step_flops(p), p.pipeline, c.model.remat)
    return p


def scheduled_estimate(cfg: TrainConfig, p: StepPlan) -> StepPlan:
    """An estimated pipelined plan with the activations its schedule keeps in place of the
    unpipelined estimate's (which every layer of the device's whole batch keeps: the
    estimate is fitted without pipelines). ``K`` the bytes the estimate keeps for the
    backward pass under the remat policy: GPipe keeps its stage's ``L/S`` layers of every
    microbatch and bubble iteration, ``K (R M + S - 1) / (S R M)``; 1F1B a ring of ``2SR-1``
    work items, each one group's ``L/(S R)`` layers of one microbatch (``K (2SR-1) / (S R
    M)``) or, without remat, each one stage input (``held_bytes``) and one item's layers
    while it is differentiated (``K / (S R M)``). Not calibrated against compiled pipelines:
    ``--compile auto`` gives the compiler's figures."""
    f = features(cfg, p.layout)
    kept = sum(coefficients().get(cfg.model.remat, {}).get(k, 0.0) * f[k] for k in SAVED_FEATURES)
    pipe = p.pipeline
    S, R, M = pipe["stages"], pipe["repeats"], pipe["microbatches"]
    if pipe["schedule"] != "1f1b":
        scheduled = kept * (R * M + S - 1) / (S * R * M)
    elif cfg.model.remat == "none":
        scheduled = kept / (S * R * M) + pipe["held_bytes"]
    else:
        scheduled = kept * pipe["in_flight"] / (S * R * M)
    change = int(scheduled - kept)
    note = (f"pipeline: the estimate keeps the {pipe['schedule']} schedule's activations "
            f"({format_bytes(int(scheduled))} per device instead of the unpipelined {format_bytes(int(kept))})")  # fmt: skip
    return dataclasses.replace(p, temp_bytes=max(p.temp_bytes + change, 0), peak_bytes=max(p.peak_bytes + change, 0),
                               notes=[*p.notes, note], pipeline=dict(pipe))  # fmt: skip


def _pipeline_rank(p: StepPlan) -> tuple:
    """How pipelined plans are ordered, as :func:`nnxscale.planning.steptime.rank_by_time`
    orders the others: those with a predicted step time first, by it; then the others by
    proxy time (:func:`pipeline_proxy_seconds`); the lesser peak between equal times."""
    st = p.step_time
    return st is None, p.pipeline["proxy_seconds"] if st is None else st.seconds, p.peak_bytes


def _fits_then_rank(p: StepPlan) -> tuple:
    """One that fits before one that does not, then :func:`_pipeline_rank`."""
    return p.fits is False, *_pipeline_rank(p)


def proposed_pipeline(plans: list[StepPlan]) -> Optional[StepPlan]:
    """Of a sweep's pipelined plans, the one to propose: the first by :func:`_pipeline_rank`
    (predicted step time where the plans have one, else proxy time) among those that fit
    (any, when memory is not known); ``None`` without a fitting pipeline."""
    fitting = [p for p in plans if p.pipeline is not None and "proxy_seconds" in p.pipeline and p.fits is not False]
    return min(fitting, key=_pipeline_rank, default=None)


def pipeline_lines(plans: list[StepPlan]) -> list[str]:
    """The sweep table's pipelines: per plan its schedule, microbatches, bubble, work items
    held per stage, peak, whether it fits, proxy time and predicted step time where it has
    one, in :func:`_pipeline_rank`'s order; the proposed one marked."""
    piped = sorted((p for p in plans if p.pipeline is not None and "proxy_seconds" in p.pipeline), key=_pipeline_rank)
    if not piped:
        return []
    chosen = proposed_pipeline(plans)
    timed = any(p.step_time is not None for p in piped)
    lines = ["", f"pipelines (ranked by predicted step time; per mesh, schedule and remat the {PIPELINE_COMPILES_PER_GROUP} "
             "microbatch counts with the least proxy time compiled):" if timed else
             "pipelines (microbatches chosen by a proxy time: compute x (R*M+S-1)/(R*M) + a cost per iteration):"]  # fmt: skip
    for p in piped:
        f = p.pipeline
        held = f"{f['in_flight']} items held" if f["schedule"] == "1f1b" else "every microbatch held"
        step = "" if not timed else f"  step {'-' if p.step_time is None else format_seconds(p.step_time.seconds):>9}"
        lines.append(
            f"  {format_mesh(p.mesh):<22}{p.remat:<7}{f['schedule']:<6} M={f['microbatches']:<4} bubble {f['bubble']:6.1%}"
            f"  {held:<22} peak {format_bytes(p.peak_bytes):>10} fits {'-' if p.fits is None else 'yes' if p.fits else 'no':<3}"
            f"  proxy {f['proxy_seconds'] * 1e3:9.3f} ms{step}"
            + ("  <- proposed" if p is chosen else "")
        )
    return lines
