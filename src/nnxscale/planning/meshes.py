"""Plan every candidate mesh x remat policy for a device count."""

from __future__ import annotations

import math
from typing import Optional

from nnxscale.planning.compiler import MAX_COMPILE_DEVICES
from nnxscale.planning.layout import plan_separator
from nnxscale.planning.report import StepPlan, plan
from nnxscale.sharding.layout import format_bytes
from nnxscale.sharding.mesh import format_mesh
from nnxscale.training.config import ConfigError, TrainConfig, with_overrides


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
    ``"auto"`` compiles each. With a ``target`` (:mod:`nnxscale.planning.targets`) the
    candidates are laid out for it (:func:`for_target`) and compiled by its compiler.
    """
    from nnxscale.training.model import run_model

    if cfg.parallel.microbatches is not None:
        raise ConfigError("--sweep plans meshes without a stage axis: plan a pipeline without --sweep (drop --microbatches)")
    model = run_model(cfg, separator=plan_separator(cfg))
    dims, experts = model.dims, getattr(model.config, "num_local_experts", 0) if model.routed else 0
    plans, skipped = [], {}
    candidates = candidate_meshes(devices, math.gcd(dims.heads, dims.kv_heads), cfg.data.seq_len, experts)
    if target is not None:
        candidates = for_target(candidates, target)
    for mesh in candidates:
        for remat in remats:
            c = with_overrides(cfg, {"parallel.mesh": mesh, "model.remat": remat})
            try:
                plans.append(plan(c, device_memory=device_memory, compile=compile, max_compile_devices=max_compile_devices,
                                  target=target))  # fmt: skip
            except ConfigError as e:  # e.g. a batch the mesh cannot split: the same for every remat
                skipped.setdefault(mesh, str(e))
    from nnxscale.planning.steptime import rank_by_time

    return rank_by_time(sorted(plans, key=lambda p: p.peak_bytes)), skipped


#: Axes whose collectives run every layer: on a target they stay inside a node or slice, innermost.
INNER_AXES = ("expert", "context", "model")


def for_target(candidates: list[str], target) -> list[str]:
    """The candidate meshes laid out for ``target``: data and fsdp outermost (across nodes
    or slices), then expert, context and model (innermost); those whose context or model
    axis would cross a node or slice dropped."""
    from nnxscale.errors import MeshError
    from nnxscale.planning.targets import split_over_domains
    from nnxscale.sharding.mesh import parse_mesh_spec

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
            f"{st.seconds:>9.3f}s{st.tokens_per_s_per_device:>14,.0f}{'-' if st.mfu is None else f'{st.mfu:.1%}':>7}")
        lines.append(
            f"{format_mesh(p.mesh):<22}{p.remat:<7}{format_bytes(p.peak_bytes):>12}"
            f"{p.collective_total / max(p.full_param_bytes, 1):>12.2f}x  {p.source.split(' ')[0]:<10} {f'{fits:<4}' if timed else fits}{time}"
        )
    for mesh, reason in (skipped or {}).items():
        lines.append(f"not planned: {mesh}: {reason}")
    return "\n".join(lines)

