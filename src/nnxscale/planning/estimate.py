"""What a step moves and needs by arithmetic: the textbook collectives, the pipeline's and
the ring's costs, and the analytical estimate of temporaries and peak fitted to the compiler.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import jaxlib

from nnxscale.layers.attention import BLOCK, platform_of
from nnxscale.layers.attention import describe as describe_attention
from nnxscale.layers.attention import resolve as resolve_attention
from nnxscale.layers.loss import KEEP_BYTES, chunk_count
from nnxscale.layers.moe import capacity, slot_rows
from nnxscale.layers.pipeline import pipeline_cost
from nnxscale.planning.layout import layout_figures, mesh_sizes, split_params, trained_rows
from nnxscale.sharding.axes import EXPERT, STAGE
from nnxscale.training.config import TrainConfig
from nnxscale.training.step import replica_axes, sums_unreduced


def textbook_collectives(cfg: TrainConfig, lay: dict, platform: str = "cpu") -> list[tuple[str, float]]:
    """What a textbook layout moves per step, as multiples of the parameter bytes.

    Data parallel: one all-reduce of the gradients of the parameters replicated across the
    batch axes. FSDP: all-gather the parameters in the forward pass and again in the
    backward pass, reduce-scatter the gradients: 3x what FSDP splits in the parameters'
    dtype. Tensor parallel (Megatron): two all-reduces of the ``(B, T, C)`` activations per
    layer forward and two backward (two more with rematerialization); in a pipeline, a
    stage's layers in every iteration, bubble included. Pipeline:
    :func:`nnxscale.layers.pipeline.pipeline_cost`'s permutes and stage-boundary all-reduces.

    In the dtype each collective moves (:func:`collective_itemsizes`): with bfloat16 compute
    over float32 weights an FSDP step gathers bfloat16 and reduces bfloat16 gradients (the
    embedding table's in float32), about 1.6x where float32 would be 3x; ``platform`` is the
    compiler's (``"cpu"``: XLA:CPU moves bfloat16 collectives as float32). With gradient
    accumulation FSDP's three move once per micro-batch, the data-parallel all-reduce once
    per step (what the compiled step does is :func:`accumulation_note`'s). Only the trained
    parameters' gradients move: under LoRA the adapters' (:func:`trained_rows`).
    """
    rules, dims, full = lay["rules"], lay["model"].dims, max(lay["full_param_bytes"], 1)
    if rules.num_devices == 1:
        return []
    gather, reduce = collective_itemsizes(cfg, platform)
    accum = cfg.optim.grad_accum

    def elements(rows) -> dict[str, float]:  # split_params's shares in elements, whatever each row's dtype
        out = dict.fromkeys(split_params([], rules), 0.0)
        for size in {r.dtype.itemsize for r in rows}:
            for k, v in split_params([r for r in rows if r.dtype.itemsize == size], rules).items():
                out[k] += v / size
        return out

    def is_table(r) -> bool:  # the embedding: its gradient is reduced in float32
        return bool(r.logical and "vocab" in r.logical)

    weights = elements(lay["rows"])  # every weight is gathered where FSDP splits it, in the compute dtype
    trained = trained_rows(lay)  # only these have gradients (LoRA: the adapters)
    split, split_table = elements([r for r in trained if not is_table(r)]), elements([r for r in trained if is_table(r)])
    moved = {k: split[k] * reduce + split_table[k] * 4.0 for k in split}  # gradients' bytes as reduced
    grads = split_params(trained, rules)
    out = []
    if grads["replicated"] / full >= 0.005 and rules.batch_shard_count > 1:  # not just LayerNorms kept whole
        out.append(("data-parallel gradient all-reduce", moved["replicated"] / full))
    if weights["fsdp"]:  # per micro-batch: the accumulator is sharded like the weights (see accumulation_note)
        fsdp = (2 * weights["fsdp"] * gather + moved["fsdp"]) / full
        what = "FSDP 2 gathers + reduce-scatter" if grads["fsdp"] else "FSDP 2 gathers (a frozen base: no gradient)"
        out.append((what + (f" x {accum} micro-batches" if accum > 1 else ""), accum * fsdp))
    if grads["expert"] and rules.batch_shard_count > rules.sizes[EXPERT]:
        out.append(("experts' gradient all-reduce", moved["expert"] / full))
    if weights["experts"]:
        out.append(("expert all-to-all", expert_all_to_all_bytes(cfg, lay) / full))
    tensor = math.prod(s for a, s in rules.sizes.items() if a not in (*rules.batch_axes, *rules.length_axes, STAGE))
    pipe = lay.get("pipeline")
    layers = layers_run(dims.layers, pipe)
    if tensor > 1:
        d = cfg.data
        tokens = d.batch_size / rules.batch_shard_count * d.seq_len / rules.length_shard_count
        act = tokens * dims.width * (2 if cfg.model.dtype == "bfloat16" else 4)
        per_layer = 6  # every policy recomputes the attention's core, whose backward reduces again
        out.append(("tensor-parallel activation all-reduces", per_layer * layers * act / full))
    if pipe is not None:
        p = pipeline_figures(cfg, lay)
        out.append(("pipeline permutes and stage boundary", (p["permute_bytes_expected"] + p["boundary_bytes"]) / full))
    if rules.length_shard_count > 1:
        out.append(("context ring permutes", ring_permute_bytes(cfg, lay) / full))
    return out


def accumulation_note(cfg: TrainConfig, lay: dict) -> Optional[str]:
    """What gradient accumulation does to the collectives of the compiled step, for the plan's
    notes. Measured on XLA:CPU, llama-mini, 8 devices, batch 32 x 128, collectives per step
    over the parameter bytes with 1 and 4 micro-batches: data=8 all-reduce 1.03x and 1.00x,
    the replicas summing their gradients unreduced and reducing once per step
    (:func:`nnxscale.training.step.replica_axes`; reduced in each micro-batch instead, 4.12x);
    fsdp=8 all-gather 2.00x and 7.79x, all-reduce 1.03x and 4.00x (per micro-batch, as the
    sharded accumulator needs). A pipeline accumulates its microbatches itself: gpt2-tiny on
    stage=2,data=4 all-reduces 1.78x with 2 and with 8 microbatches, once per step."""
    accum = cfg.optim.grad_accum
    if accum == 1 or lay["rules"].batch_shard_count == 1:
        return None
    split = split_params(lay["rows"], lay["rules"])
    parts = []
    if split["fsdp"]:
        parts.append(f"FSDP gathers the weights and reduce-scatters their gradients in each of the {accum} micro-batches "
                     "(inherent: the accumulator is sharded like the weights, as in MaxText's gradient accumulation)")
    if split["replicated"] / max(lay["full_param_bytes"], 1) >= 0.005 and not sums_unreduced(lay["model"], lay.get("pipeline")):
        parts.append(f"the replicated weights' gradients are all-reduced in each micro-batch, {accum}x the textbook's "
                     "once per step (a mixture's router losses or your own loss couple a batch's tokens: a replica's "
                     "gradient is not its share of the sum)")
    return f"--grad-accum {accum}: " + "; ".join(parts) if parts else None


def collective_itemsizes(cfg: TrainConfig, platform: str = "cpu") -> tuple[float, float]:
    """``(gathered weights, reduced gradients)``: bytes per element the collectives of a step
    move. The model casts the float32 weights to the compute dtype where it uses them and the
    compiler gathers the cast ones; their gradients come back in the compute dtype and are
    reduced in it (measured on the H100 compiler, llama-3.2-1b on fsdp=8 with bfloat16: every
    layer weight gathered and reduce-scattered in bf16, the embedding table's gradient in
    f32). XLA:CPU moves bfloat16 collectives as float32 (the same step there: 2.00x gathers,
    1.00x reductions of the float32 parameter bytes)."""
    compute = float(jnp.dtype(cfg.model.dtype).itemsize)
    if platform == "cpu":
        compute = max(compute, 4.0)
    return compute, compute


def formula_flops(cfg: TrainConfig, lay: dict, n: int) -> dict[str, Optional[float]]:
    """Training FLOPs per device per step by the model's formula (``6N + attention`` per
    token, :meth:`~nnxscale.training.Setup.flops_per_token`): ``expected``; ``recompute``: that
    plus what rematerialization runs again in the backward pass (with ``remat full`` each
    layer's forward, a third of the formula less the output head's ``6 x vocab x width``;
    with ``remat dots`` and ``none`` the attention's products, a third of its term; with ``remat
    dots-except-mlp-in`` those and the MLP's input projections' forward); ``attention``: the
    attention term with its share of the recompute (what a fused kernel does). ``None`` where
    the model's shape is not known (your own module). Under LoRA
    (``frozen``) the base's weights take ``4N`` (no weight gradients) and the adapters ``6N``."""
    tokens = cfg.data.batch_size * cfg.data.seq_len / n
    per_token = lay["setup"].flops_per_token()
    dims, remat = lay["model"].dims, cfg.model.remat
    if dims is None:
        return {"expected": per_token * tokens, "recompute": None, "attention": None, "frozen": False}
    attention = 12 * dims.layers * dims.heads * dims.head_width * cfg.data.seq_len
    mlp_in = 2 * dims.layers * dims.mlp_inputs * dims.width * dims.mlp_width  # the MLP's input projections, forward
    again = {"none": attention / 3, "full": (per_token - 6 * dims.vocab_size * dims.width) / 3, "dots": attention / 3,
             "dots-except-mlp-in": attention / 3 + mlp_in}[remat]  # fmt: skip
    frozen = lay["model"].lora is not None
    if frozen:  # a frozen weight has no gradient: its products run forward and for the input's gradient, 4N not 6N
        adapters = sum(a.size for a in jax.tree.leaves(lay["setup"].abstract["params"]))  # the trainable ones: 6N
        per_token = (per_token - attention) * 2 / 3 + attention + 6 * adapters
    return {
        "expected": per_token * tokens,
        "recompute": None if again is None else (per_token + again) * tokens,
        "attention": attention * 4 / 3 * tokens,
        "frozen": frozen,
    }


def pipeline_figures(cfg: TrainConfig, lay: dict, compiled_collectives: Optional[dict] = None) -> Optional[dict]:
    """The pipeline of a plan: its layout (schedule, stages, layers per stage, repeats,
    microbatches and their rows per batch shard), its bubble, and per device and step the
    ``collective-permute`` bytes, from :func:`nnxscale.layers.pipeline.pipeline_cost` and, when
    compiled, from the compiled step; ``None`` without a pipeline."""
    pipe, n = lay["pipeline"], lay["stacked_layers"]
    if pipe is None:
        return None
    d, dims, rules = cfg.data, lay["model"].dims, lay["rules"]
    # Beside a context axis, each device holds and passes on its T / context tokens.
    activation = (d.batch_size, d.seq_len // rules.length_shard_count, dims.width)
    cost = pipeline_cost(pipe, n, activation, cfg.model.dtype, batch_shards=rules.batch_shard_count, remat=cfg.model.remat,
                         routed=lay["model"].routed)  # fmt: skip
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


def expert_all_to_all_bytes(cfg: TrainConfig, lay: dict) -> int:
    """What a mixture's tokens move per device and step over an ``expert`` axis, sent only
    as they are: ``tokens per device x k x width x bytes x 2 (there and back) x 2 (forward
    and backward) x layers``, x 3 instead of x 2 when rematerialization repeats the forward
    pass's exchanges, times the accumulation steps; in a pipeline the layers are a stage's
    share of the iterations, bubble included (:func:`layers_run`). Dropless on CPU, where there is no
    ``ragged_all_to_all``, each peer's slot holds all of a device's assignments: the
    compiled step moves ``expert`` times this (mixtral-mini on ``expert=8``: 8.02x,
    ``bench/moe.py``), and with bfloat16 compute XLA:CPU sends them as float32
    (the lowered program's all-to-all is bfloat16, the compiled one float32): 2x more."""
    rules, dims, d = lay["rules"], lay["model"].dims, cfg.data
    k = getattr(lay["model"].config, "num_experts_per_tok", 1)
    tokens = d.batch_size / rules.batch_shard_count * d.seq_len / rules.length_shard_count
    itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
    passes = 3 if cfg.model.remat != "none" else 2
    return int(tokens * k * dims.width * itemsize * 2 * passes * layers_run(dims.layers, lay.get("pipeline")))


def slot_factor(cfg: TrainConfig, lay: dict) -> float:
    """The exchange's buffers over what its assignments need (:func:`expert_all_to_all_bytes`).
    Dropless, each of the ``expert`` peers' slots holds all of a device's assignments (no
    ``ragged_all_to_all``): ``expert`` times. With a capacity factor a slot holds what the
    capacity lets a device send one peer, ``E / expert`` experts' capacity per sequence:
    ``E cap / (T k)`` times, about the factor (:func:`nnxscale.layers.moe.capacity`)."""
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
    half of one ``C`` wide, and under ``--remat none`` every layer keeps about ``1.5 C`` per row
    for the backward pass: the exchange's results, which it does not exchange again (the
    compiled steps of mixtral-tiny and mixtral-mini on the three meshes below keep 0.0-1.6 C
    more per row and layer than under ``dots``). In a pipeline a layer works on one microbatch at a
    time, and a stage keeps its share of the iterations (:func:`layers_run`). Counted in
    the compute dtype (the exchange's buffers are bfloat16 under bfloat16 compute, unlike
    most of XLA:CPU's). Calibrated against the compiled steps of mixtral-tiny and mixtral-mini
    on ``expert=8``, ``fsdp=2,expert=4`` and ``data=2,expert=4`` (each remat policy) and
    mixtral-8x7b on ``fsdp=8,expert=8``."""
    rules, dims, d = lay["rules"], lay["model"].dims, cfg.data
    c = lay["model"].config
    tokens = d.batch_size / rules.batch_shard_count / cfg.optim.grad_accum * d.seq_len / rules.length_shard_count
    rows = tokens * c.num_experts_per_tok * slot_factor(cfg, lay)
    F = c.intermediate_size / rules.activation_split("mlp", c.intermediate_size)
    itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
    pipe = lay.get("pipeline")
    working = rows / (pipe.microbatches if pipe is not None else 1) * (8 * F + dims.width / 2)
    kept = rows * layers_run(dims.layers, pipe) * 1.5 * dims.width if cfg.model.remat == "none" else 0.0
    return int(itemsize * (working + kept))


def ring_permute_bytes(cfg: TrainConfig, lay: dict) -> int:
    """What ring attention sends per device and step over a ``context`` axis of ``n`` devices.

    Per layer, with ``kv`` one device's keys and values (``2 b (T/n) K H`` elements in the
    compute dtype): the forward passes them on ``n - 1`` times; the backward passes them
    round again (``n - 1``) with their float32 gradients (``n`` times, home after the last):
    ``L x (2 (n - 1) kv + n kv gradients)``, times the accumulation steps. Compiled
    (llama-tiny, 2 layers) the ring's permutes are exactly this, with
    ``--remat`` none or full (the ring's residuals are kept, not recomputed) and with
    ``--document-mask``; the step also moves a few tensors of the zigzag layout outside the
    layers (0.1% more on ``context=4,fsdp=2``, 13% on ``context=2,fsdp=2,model=2``).

    Beside a ``stage`` axis each device runs its stage's ``L / (S R)`` layers on one
    microbatch per iteration, bubble included: ``L`` becomes ``L (R M + S - 1) / (S R M)``.
    """
    rules, dims, d = lay["rules"], lay["model"].dims, cfg.data
    n = rules.length_shard_count
    layers = layers_run(dims.layers, lay["pipeline"])
    tokens = d.batch_size / rules.batch_shard_count / cfg.optim.grad_accum * d.seq_len / n
    kv_heads = dims.kv_heads / rules.activation_split("kv_heads", dims.kv_heads)
    itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
    kv = 2 * tokens * kv_heads * dims.head_width
    per_layer = 2 * (n - 1) * kv * itemsize + n * kv * 4
    return int(layers * per_layer * cfg.optim.grad_accum)


def layers_run(layers: int, pipe) -> float:
    """How many layers' worth of one device's full batch a device runs per pass: all of them,
    or in a pipeline ``L / S`` layers over ``R*M + S - 1`` iterations of ``R*M`` microbatches'
    worth (the bubble included)."""
    if pipe is None:
        return layers
    return layers / pipe.stages * pipe.iterations / (pipe.repeats * pipe.microbatches)


#: The model family :data:`COEFFICIENTS` are fitted to; a plan of another says so.
ESTIMATE_FAMILY = "gpt2"


#: Coefficients of :func:`estimate`, fitted to the compiler's figures on 8 simulated CPU
#: devices (gpt2-mini, gpt2 and gpt2-medium on data, fsdp and tensor-parallel meshes, each
#: remat policy, ``dots-except-mlp-in`` included) by ``python bench/plan_accuracy.py --fit``:
#: steps whose chunked loss keeps its logits and whose accumulation reduces once per step; no
#: constant term, which a fit to the mini models takes up and the tiny ones then overshoot.
#: Each multiplies a feature of :func:`features`, in bytes; ``shared`` applies under every
#: remat policy. The features come from any family's dimensions (:class:`~nnxscale.models.ModelDims`).
COEFFICIENTS: dict[str, dict[str, float]] = {
    "shared": {
        "work_res": 12.2,
        "work_tp": 9.959,
        "work_att": 2.285,
        "logits": 2.451,
        "grads": 2.155,
        "grads_sum": 0.5034,
    },
    "none": {
        "saved_res": 2.14,
        "saved_tp": 4.151,
        "saved_att": 0.1474,
    },
    "full": {
        "saved_res": 1.122,
    },
    "dots": {
        "saved_res": 2.14,
        "saved_tp": 4.153,
        "saved_att": 0.1474,
    },
    "dots-except-mlp-in": {
        "saved_res": 2.425,
        "saved_tp": 1.838,
        "saved_att": 0.08599,
    },
    "collectives": {
        "coll_replicated": 1.128,
        "coll_fsdp": 2.814,
        "coll_tp": 1.054,
        "coll_vocab": 0.533,
    },
}


#: Coefficients refitted to a later XLA:CPU, by the first jaxlib they fit, each replacing its
#: policy's row of :data:`COEFFICIENTS` from that jaxlib on (``python bench/plan_accuracy.py
#: --fit --remat POLICY`` on that jaxlib prints one, the shared coefficients kept). None is
#: needed today: jaxlib 0.10.2's rows fit 0.12.1's compiled steps within 11% of their peak.
LATER_COEFFICIENTS: dict[tuple[int, ...], dict[str, dict[str, float]]] = {}


def jaxlib_version() -> tuple[int, ...]:
    """The running jaxlib's version, e.g. ``(0, 12, 1)``."""
    return tuple(int(part) for part in re.findall(r"\d+", jaxlib.__version__)[:3])


def coefficients(version: Optional[tuple[int, ...]] = None) -> dict[str, dict[str, float]]:
    """:data:`COEFFICIENTS` with the rows of :data:`LATER_COEFFICIENTS` that ``version`` (the
    running jaxlib's by default) has reached."""
    version = jaxlib_version() if version is None else version
    table = dict(COEFFICIENTS)
    for since, rows in sorted(LATER_COEFFICIENTS.items()):
        if version >= since:
            table.update(rows)
    return table


#: Features kept for the backward pass, one coefficient each per remat policy.
SAVED_FEATURES = ("saved_res", "saved_tp", "saved_att")


#: Features of the working set, the logits, the gradients and gathered weights (shared).
SHARED_FEATURES = ("work_res", "work_tp", "work_att", "logits", "grads", "grads_sum", "gathered")


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
    - ``logits`` (b T V / tpv: one slice of the chunked loss in float32, or every slice in the
      compute dtype where the loss keeps them), ``grads`` (the gradients), ``grads_sum`` (with
      gradient accumulation: the running sum, the gradients' size again), ``gathered`` (the
      weights FSDP gathers for one layer, plus the embedding);
    - collectives: the gradients of parameters replicated over the batch axes and of those
      FSDP splits, the tensor-parallel all-reduces of ``(b, T, C)`` activations (after
      attention and after the MLP, forward and backward, and the attention's again when
      full remat recomputes it), and the embedding's when the vocabulary is split. With
      gradient accumulation they move once per micro-batch, but for the replicated weights'
      gradients where the replicas sum them unreduced and all-reduce them once per step
      (:func:`nnxscale.training.step.replica_axes`: a family's own loss, no pipeline).

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
    tiled = attention_figures(cfg, lay["model"], rules)["attention"] not in ("xla", None)
    keys = min(BLOCK, T) if tiled else d.seq_len
    shards = rules.batch_shard_count * rules.length_shard_count  # as the families' chunked loss counts them
    # As the families' chunked loss decides (layers.loss): slices of the vocabulary, and all of
    # them kept for the backward where they fit KEEP_BYTES per device in the compute dtype.
    rows_micro = d.batch_size // accum
    logit_chunks = chunk_count(rows_micro, d.seq_len, V, shards * tpv) if lay["model"].family is not None else 1
    compute_itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
    kept = logit_chunks > 1 and rows_micro * d.seq_len * V * compute_itemsize / (shards * tpv) <= KEEP_BYTES
    logit_bytes = b * T * V / tpv * (compute_itemsize if kept else 4 / logit_chunks)  # all slices kept, or one in float32
    parts = split_params(lay["rows"], rules)
    replicated = parts["replicated"] if rules.batch_shard_count > 1 else 0.0
    # The replicated weights' gradients: summed unreduced over the replica axes and reduced
    # once per step where the step does so, else once per micro-batch.
    reductions = 1 if accum > 1 and replica_axes(lay["setup"]) else accum
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
        "logits": logit_bytes,
        "grads": lay["gradient_bytes"],
        "grads_sum": lay["gradient_bytes"] if accum > 1 else 0.0,
        "gathered": (parts["fsdp"] / max(L, 1) + V * C * 4 / tpv) if parts["fsdp"] else 0.0,
        "coll_replicated": replicated * reductions,
        "coll_fsdp": parts["fsdp"] * accum,
        "coll_tp": L * act * tp_reductions * accum,
        "coll_vocab": 2 * act * accum if tpv > 1 else 0.0,
    }


def estimate(cfg: TrainConfig, lay: Optional[dict] = None) -> dict[str, Any]:
    """The analytical estimate of a step's temporaries, peak and collectives per device."""
    if lay is None:
        lay = layout_figures(cfg, mesh_sizes(cfg.parallel.mesh))
    f = features(cfg, lay)
    table = coefficients()
    shared, saved = table.get("shared", {}), table.get(cfg.model.remat, {})
    temp = sum(shared.get(k, 0.0) * f[k] for k in SHARED_FEATURES) + sum(saved.get(k, 0.0) * f[k] for k in SAVED_FEATURES)
    temp = int(max(temp, f["grads"] + f["grads_sum"]))
    experts = split_params(lay["rows"], lay["rules"])["experts"]
    if experts:  # the experts' exchange: counted, not fitted
        temp += exchange_temp_bytes(cfg, lay)
    coll_coef = table.get("collectives", {})
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


def attention_figures(cfg: TrainConfig, model, rules, platform: Optional[str] = None) -> dict[str, Optional[str]]:
    """The attention implementation a family's model uses at ``cfg``'s length, and its line.
    ``platform``: whose devices run it (:func:`nnxscale.layers.attention.platform_of`);
    default: the devices of ``rules``' mesh (this process's for an abstract mesh)."""
    if not getattr(model.config, "attention", None):  # your own module picks its own
        return {"attention": None, "attention_line": None}
    c, head, context = model.config, model.dims.head_width, rules.length_shard_count
    platform = platform or platform_of(rules.mesh)  # the target's, for a mesh of its devices
    staged = rules.sizes.get(STAGE, 1) > 1  # the layers run in a pipeline's stages
    return {
        "attention": "ring" if context > 1 else resolve_attention(c.attention, cfg.data.seq_len, c.dtype, head, cfg.data.document_mask, platform, staged),
        "attention_line": describe_attention(c.attention, cfg.data.seq_len, c.dtype, head, context, cfg.data.document_mask, platform, staged),
    }

