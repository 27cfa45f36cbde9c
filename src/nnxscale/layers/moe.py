"""A mixture of SwiGLU experts with a top-k router, dropless: every token reaches its experts.

Routing as Mixtral's (Hugging Face's ``MixtralSparseMoeBlock``): the router's logits over the
``E`` experts go through a softmax, each token takes its ``k`` most likely experts, and their
weights are renormalized over the ``k``. Nothing is dropped, however uneven the load.

The experts' work is grouped, not dense: the ``N * k`` (token, expert) assignments are sorted
by expert and each expert multiplies exactly its own tokens (a grouped matmul:
``jax.lax.ragged_dot``, or on CPU, where XLA runs that densely, tiles in a loop), so a step
costs ``k`` experts' FLOPs per token, not ``E`` (a one-hot einsum over every expert costs
``E / k`` times more).

Optionally (``capacity_factor``) each expert takes at most that factor times its even share
of a sequence's assignments (:func:`capacity`, :func:`within_capacity`): the rest are
dropped, add nothing and cost nothing, and on an expert axis each peer's slot of the
exchange holds only what the capacity allows instead of all of a device's assignments.

Other routers (:class:`Router`), as Hugging Face computes them: Qwen3-MoE's (softmax, the
``k`` weights renormalized or not, ``norm_topk_prob``), DeepSeek-V2's (softmax, not
renormalized, scaled by ``routed_scaling_factor``; optionally group-limited, a group scored by
its best expert) and DeepSeek-V3's (sigmoid scores; a per-expert bias ``router_bias``, HF's
``e_score_correction_bias``, added to them only to choose the experts; group-limited, a group
scored by the sum of its best two; the chosen unbiased scores renormalized and scaled). With
``shared``, DeepSeek's shared experts: one SwiGLU MLP (:class:`SharedExperts`) that every
token goes through, its output added to the routed experts'.

Besides its output, :class:`MoE` returns what training needs to keep the router balanced,
per layer (:class:`RouterStats`): the Switch Transformer's load-balancing loss, the router
z-loss (ST-MoE), and each expert's share of the assignments.

Parameters carry logical names: the experts' leading axis is ``expert`` (the rules place it
on an ``expert`` mesh axis, or FSDP's), their widths ``embed`` and ``mlp`` as a dense MLP's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nnxscale.errors import ModelError
from nnxscale.layers import lora
from nnxscale.layers.attention import platform_here
from nnxscale.layers.trips import expected_trips
from nnxscale.sharding.activations import constrain, current_rules
from nnxscale.sharding.axes import EXPERT
from nnxscale.sharding.mesh import sum_to_type, varying_like
from nnxscale.sharding.rules import LOGICAL_KEY, logical, resolve_name

_normal = nnx.initializers.normal(0.02)


class RouterStats(NamedTuple):
    """What one MoE layer's routing did, for the objective and the metrics (with a leading
    layers axis when stacked). The fields are means over tokens, so the statistics of equal
    parts of a batch (a pipeline's microbatches, its batch shards) average to the batch's;
    the load-balancing loss is formed from them afterwards."""

    fraction: jax.Array  # (E,) the fraction of tokens sending one of their k assignments to e (sums to k)
    probability: jax.Array  # (E,) the mean router probability of e
    z_loss: jax.Array  # mean over tokens of logsumexp(router logits)^2
    dropped: jax.Array  # the share of the N * k assignments over their expert's capacity (0: dropless)

    @property
    def aux_loss(self) -> jax.Array:
        """The Switch Transformer's load-balancing loss: ``E * sum_e fraction_e * probability_e``."""
        return self.fraction.shape[-1] * jnp.sum(self.fraction * self.probability, axis=-1)

    @property
    def load(self) -> jax.Array:
        """``(E,)`` each expert's share of the ``N * k`` assignments (sums to 1)."""
        return self.fraction / jnp.sum(self.fraction, axis=-1, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Router:
    """How a token's experts are chosen and weighed from its router logits (static: it is
    hashed into the compiled program). The default is Mixtral's: softmax, the ``k`` most
    likely experts, their probabilities renormalized over the ``k``.

    Hugging Face's routers in these terms (``cfg``: the model's config):

    - Mixtral: ``Router()``;
    - Qwen3-MoE (``Qwen3MoeTopKRouter``): ``Router(norm_topk_prob=cfg.norm_topk_prob)``;
    - DeepSeek-V2 (``DeepseekV2TopkRouter``): ``Router(norm_topk_prob=False,
      routed_scaling_factor=cfg.routed_scaling_factor)``, and for ``topk_method
      "group_limited_greedy"`` also ``n_group``, ``topk_group`` and ``group_top=1``;
    - DeepSeek-V3 (``DeepseekV3TopkRouter``): ``Router("sigmoid", cfg.norm_topk_prob,
      cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, score_bias=True)``.
    """

    #: "softmax" (Mixtral, Qwen3-MoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3): each expert's score.
    scoring: str = "softmax"
    #: Divide the chosen ``k`` scores by their sum (with sigmoid scores by ``sum + 1e-20``, as DeepSeek-V3).
    norm_topk_prob: bool = True
    #: Group-limited routing: the experts split into ``n_group`` groups of consecutive experts and
    #: only those of a token's ``topk_group`` best groups may be chosen.
    n_group: int = 1
    topk_group: int = 1
    #: The chosen weights multiplied by this, after the renormalization (DeepSeek).
    routed_scaling_factor: float = 1.0
    #: DeepSeek-V3's ``e_score_correction_bias``: the MoE holds a bias ``router_bias (E,)`` that
    #: is added to the scores to choose the experts (and groups), not to weigh them.
    score_bias: bool = False
    #: A group's score is the sum of its ``group_top`` best scores: 2 in DeepSeek-V3; DeepSeek-V2's
    #: group-limited greedy routing takes each group's best (1).
    group_top: int = 2

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ModelError(f"the router's scoring {self.scoring!r} is not 'softmax' or 'sigmoid'")
        if not 1 <= self.topk_group <= self.n_group:
            raise ModelError(f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}")
        if self.group_top < 1:
            raise ModelError(f"group_top={self.group_top} must be at least 1")

    def check(self, num_experts: int, k: int) -> None:
        """Raise ModelError unless this router can choose ``k`` of ``num_experts`` experts."""
        if num_experts % self.n_group:
            raise ModelError(f"n_group={self.n_group} does not divide the {num_experts} experts")
        per = num_experts // self.n_group
        if self.n_group > 1 and self.group_top > per:
            raise ModelError(f"group_top={self.group_top} is more than a group's {per} experts")
        if k > self.topk_group * per:  # more than may be chosen: HF would pick excluded experts
            raise ModelError(f"top_k={k} is more than the {self.topk_group * per} experts of "
                             f"topk_group={self.topk_group} groups of {per}")  # fmt: skip


def route(logits, k: int, router: Router = Router(), bias=None):
    """``(weights (N, k) float32, experts (N, k) int32)`` of router ``logits (N, E)``: the
    ``k`` experts of each token with the best scores (softmax probabilities or sigmoids,
    ``router.scoring``), ``bias (E,)`` added to them and groups limited for the choice only,
    weighed by their scores, renormalized over the ``k`` and scaled as ``router`` says.

    Hugging Face's ``DeepseekV3TopkRouter.forward`` step by step: scores, ``scores + bias``
    for the choice, groups, ``topk``, the unbiased scores gathered, ``/ (sum + 1e-20)``,
    ``* routed_scaling_factor``. The bias reaches the choice only, which is discrete: it has
    no gradient (zero)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if router.scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias).astype(jnp.float32)
    if router.topk_group < router.n_group:
        choice = _limit_groups(choice, router)
    if choice is scores:  # Mixtral, Qwen3-MoE, DeepSeek-V2's greedy: chosen and weighed by the same scores
        weights, experts = jax.lax.top_k(scores, k)
    else:
        experts = jax.lax.top_k(choice, k)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if router.norm_topk_prob:
        total = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / (total if router.scoring == "softmax" else total + 1e-20)  # each as HF divides
    if router.routed_scaling_factor != 1.0:
        weights = weights * router.routed_scaling_factor
    return weights, experts.astype(jnp.int32)


def _limit_groups(choice, router: Router):
    """``choice (N, E)`` with every expert outside each token's ``router.topk_group`` best
    groups set to ``-inf``, so that it is not chosen; a group's score is the sum of its
    ``router.group_top`` best (DeepSeek-V3's two; V2's group-limited greedy, one: the max)."""
    N, E = choice.shape
    G = router.n_group
    grouped = choice.reshape(N, G, E // G)
    group_scores = jnp.sum(jax.lax.top_k(grouped, router.group_top)[0], axis=-1)  # (N, G)
    best = jax.lax.top_k(group_scores, router.topk_group)[1]  # (N, topk_group)
    eligible = jnp.any(best[:, :, None] == jnp.arange(G), axis=1)  # (N, G); a comparison, not a scatter
    # -inf where HF's V2 puts 0 (its scores are positive): the same choice whenever k experts are eligible
    return jnp.where(eligible[:, :, None], grouped, -jnp.inf).reshape(N, E)


def route_stats(logits, experts, num_experts: int, kept=None) -> RouterStats:
    """The balance of one layer's routing. ``aux_loss`` is Hugging Face Mixtral's
    ``load_balancing_loss_func`` for one layer: ``E * sum_e f_e * P_e`` with ``f_e`` the
    fraction of tokens sending one of their ``k`` assignments to ``e`` (summing to ``k``)
    and ``P_e`` the mean router probability of ``e``; ``k`` for a perfectly even router.
    ``f_e`` counts the router's choices, dropped ones too (``kept``: which were not).

    ``P_e`` and the z-loss are of the softmax of the logits whatever :class:`Router` scores
    with: for sigmoid scores (DeepSeek-V3) that is the Switch loss over the softmax, not what
    DeepSeek-V3 trains with. V3 balances its experts without an auxiliary loss, by nudging
    ``router_bias`` after each step towards the underloaded experts; nnxscale does not do
    that update (the bias stays as loaded)."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    dropped = jnp.zeros((), jnp.float32) if kept is None else 1.0 - jnp.mean(kept.astype(jnp.float32))
    return RouterStats(counts / logits.shape[0], jnp.mean(probs, axis=0), z, dropped)


def capacity(factor: Optional[float], length: int, k: int, num_experts: int) -> Optional[int]:
    """How many of a sequence's ``length * k`` assignments one expert takes: ``factor``
    times its even share, rounded up (GShard's expert capacity, per sequence); ``None``
    (dropless) without a factor."""
    return None if not factor else max(1, math.ceil(factor * length * k / num_experts))


def within_capacity(experts, num_experts: int, length: int, cap: int, positions=None):
    """``(N, k)`` which assignments fit their expert's capacity ``cap`` in their sequence
    (rows of ``length`` tokens). Within a (sequence, expert), every token's first choice
    comes before any second choice, and earlier tokens before later ones (GShard's
    priority). ``positions`` (``(N,)`` ints): each token's place in its sequence, when the
    sequence is stored out of order (the zigzag layout of a ``context`` axis), so that the
    same assignments are dropped whatever the layout; by default the order stored."""
    N, k = experts.shape
    row = (jnp.arange(N) // length)[None, :]
    key = (row * num_experts + experts.T).reshape(-1)  # choice-major: all first choices, then all second choices
    order = jnp.arange(N * k)
    if positions is not None:  # earlier positions first, then (stable) the choices, then the keys
        order = jnp.argsort(jnp.tile(positions, k), stable=True)
        order = order[jnp.argsort(order // N, stable=True)]
    order = order[jnp.argsort(key[order], stable=True)]
    ranked = key[order]
    first = jnp.concatenate([jnp.ones((1,), bool), ranked[1:] != ranked[:-1]])
    starts = jax.lax.cummax(jnp.where(first, jnp.arange(N * k), 0))
    rank = jnp.zeros((N * k,), jnp.int32).at[order].set(jnp.arange(N * k) - starts)
    return (rank < cap).reshape(k, N).T


def _run_groups(xs, sizes, w_gate, w_up, w_down, rows: Optional[int] = None):
    """Rows ``xs (M, C)`` grouped by expert (``sizes (E,)`` rows each, in order; rows past
    their sum are left as zeros) through their experts: ``(M, C)``. ``rows``: how many rows
    are expected to be real (``M`` unless the buffer is mostly padding), for the tile size.

    XLA:CPU runs ``jax.lax.ragged_dot`` as a dense product over every group, masked (E times
    the work: 5.6 ms for 1,024 rows over 8 experts where one dense matmul of them takes 0.46;
    jaxlib 0.10, 2 cores); there each expert's rows run in tiles instead (:func:`_tiled_swiglu`),
    in loops of as many turns as tiles in use, whose expected count is left for the step-time
    prediction (:func:`nnxscale.layers.trips.expected_trips`).
    """
    if _native_grouped_matmul():
        h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, sizes)) * jax.lax.ragged_dot(xs, w_up, sizes)  # (M, F)
        return jax.lax.ragged_dot(h.astype(xs.dtype), w_down, sizes)
    M, E = xs.shape[0], sizes.shape[0]
    tile = 1 << max(3, min(8, (max(rows or M, 1) // (2 * E)).bit_length() - 1))  # about half a group: 8 to 256 rows
    tiles = -(-M // tile) + E  # each group's last tile may be partial
    per = (sizes + tile - 1) // tile  # tiles of each group
    ends, cum = jnp.cumsum(per), jnp.cumsum(sizes)
    starts = cum - sizes
    i = jnp.arange(M)
    g = _groups_before(cum, i)  # each row's group; E: past the groups
    gc = jnp.minimum(g, E - 1)
    pos = jnp.where(g < E, (ends[gc] - per[gc]) * tile + i - starts[gc], tiles * tile)  # its row in the tiles
    group = jnp.minimum(_groups_before(ends, jnp.arange(tiles)), E - 1).astype(jnp.int32)
    padded = jnp.zeros((tiles * tile, xs.shape[1]), xs.dtype).at[pos].set(xs, mode="drop")
    # The loops run the tiles in use, which the routing decides: about the expected rows' and
    # half a tile more per group (each group's last tile is partial); the prediction counts that.
    with expected_trips(-(-min(rows or M, M) // tile) + -(-E // 2)):
        out = _tiled_swiglu(padded.reshape(tiles, tile, -1), group, ends[-1], w_gate, w_up, w_down)
    return out.reshape(tiles * tile, -1).at[pos].get(mode="fill", fill_value=0)


def _groups_before(ends, i):
    """How many of the ascending ``ends (E,)`` are at most each ``i``: the group of row ``i``
    (``jnp.searchsorted(ends, i, side="right")``, which fails to trace in a pipeline stage
    beside automatic axes, jax 0.10; ``E`` is small, so one comparison per row and group)."""
    return jnp.sum(i[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _native_grouped_matmul() -> bool:
    """Whether ``jax.lax.ragged_dot`` runs grouped for the platform compiled for (the mesh of
    the rules in force: a deviceless target's too, so a plan compiles what a run would): on
    TPUs. XLA:CPU has no grouped kernel, and XLA:GPU lowers it to a dense product masked per
    group, every token through every expert (E times the work, seen on the H100 compiler)."""
    return platform_here() == "tpu"


@jax.custom_vjp
def _tiled_swiglu(x, group, used, w_gate, w_up, w_down):
    """``x (tiles, tile, C)``, each tile of one expert's rows (``group (tiles,)``): the tiles
    before ``used`` through their expert, one tile at a time (a loop, so the work is the rows'
    own, not every expert's); the others are zeros. The backward is a loop too, adding each
    tile's weight gradients into its expert's."""
    return _tiled_forward(x, group, used, w_gate, w_up, w_down)[0]


def _tiled_forward(x, group, used, w_gate, w_up, w_down):
    F = w_gate.shape[-1]

    def body(t, carry):
        y, a, b = carry
        e = group[t]
        a_t, b_t = x[t] @ w_gate[e], x[t] @ w_up[e]
        y_t = (jax.nn.silu(a_t) * b_t).astype(x.dtype) @ w_down[e]
        put = lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v.astype(buf.dtype), t, 0)  # noqa: E731
        return put(y, y_t), put(a, a_t), put(b, b_t)

    zeros = lambda width: jnp.zeros(x.shape[:2] + (width,), x.dtype)  # noqa: E731
    carry = varying_like((zeros(x.shape[-1]), zeros(F), zeros(F)), x, group, w_gate, w_up, w_down)
    return jax.lax.fori_loop(0, used, body, carry)


def _tiled_fwd(x, group, used, w_gate, w_up, w_down):
    y, a, b = _tiled_forward(x, group, used, w_gate, w_up, w_down)
    return y, (x, group, used, w_gate, w_up, w_down, a, b)


def _tiled_bwd(res, dy):
    x, group, used, w_gate, w_up, w_down, a, b = res

    def body(t, carry):
        dx, d_gate, d_up, d_down = carry
        e = group[t]
        a_t, b_t, x_t, dy_t = a[t], b[t], x[t], dy[t]
        sig = jax.nn.sigmoid(a_t)
        s = a_t * sig  # silu(a)
        h = (s * b_t).astype(x.dtype)
        dh = dy_t @ w_down[e].T
        da = (dh * b_t * (sig * (1 + a_t * (1 - sig)))).astype(x.dtype)
        db = (dh * s).astype(x.dtype)
        dx = jax.lax.dynamic_update_index_in_dim(dx, (da @ w_gate[e].T + db @ w_up[e].T).astype(dx.dtype), t, 0)
        return dx, d_gate.at[e].add(x_t.T @ da), d_up.at[e].add(x_t.T @ db), d_down.at[e].add(h.T @ dy_t)

    zero = (jnp.zeros_like(x), jnp.zeros_like(w_gate), jnp.zeros_like(w_up), jnp.zeros_like(w_down))
    zero = varying_like(zero, *res, dy)
    dx, d_gate, d_up, d_down = jax.lax.fori_loop(0, used, body, zero)
    # Inside a shard_map each gradient is summed over the axes its operand is the same on.
    grads = [sum_to_type(g, primal) for g, primal in zip((dx, d_gate, d_up, d_down), (x, w_gate, w_up, w_down))]
    return grads[0], None, None, *grads[1:]


_tiled_swiglu.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_swiglu(x, experts, weights, w_gate, w_up, w_down, kept=None):
    """``sum_j weights[:, j] * expert_{experts[:, j]}(x)`` for ``x (N, C)``, dropless, or
    over the assignments ``kept`` (``(N, k)`` bool: the others add nothing, and cost nothing).

    ``w_gate, w_up (E, C, F)`` and ``w_down (E, F, C)``: each expert is
    ``down(silu(x @ gate) * (x @ up))``. The assignments are sorted by expert and each
    group is multiplied by its own expert's weights (:func:`_run_groups`)."""
    N, k = experts.shape
    E = w_gate.shape[0]
    flat = experts.reshape(-1) if kept is None else jnp.where(kept, experts, E).reshape(-1)  # (N * k,); E: dropped, last
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((E,), jnp.int32).at[flat].add(1, mode="drop")
    out = _run_groups(x[order // k], sizes, w_gate, w_up, w_down)  # each assignment's token, grouped by expert
    out = jnp.zeros_like(out).at[order].set(out)  # back to (token, choice) order
    return jnp.einsum("nkc,nk->nc", out.reshape(N, k, -1).astype(jnp.float32), weights).astype(x.dtype)


class _Split(NamedTuple):
    """How the tokens and experts of a MoE layer are split over the mesh in force."""

    mesh: object
    batch: tuple[str, ...]  # the mesh axes the tokens are split over (manual in the shard_map)
    expert: Optional[str]  # the one of them that also splits the experts, or None
    size: int  # its size
    inside: bool = False  # in a pipeline stage's shard_map, which is manual over the expert axis already


def _split(num_experts: int) -> Optional[_Split]:
    """The split of the rules in force, or None (one device, or no axis splits the batch).
    The experts are split over the ``expert`` axis when the rules put them there, it splits
    the tokens too, and it divides the experts (the trainer checks that it does).

    Inside a pipeline stage (a ``shard_map``, :mod:`nnxscale.layers.pipeline`) the stage
    is manual over the expert axis when the experts are split over it, and the layer runs
    its part there; with no such axis (None) the experts run like any layer of the stage."""
    rules = current_rules()
    if rules is None:
        return None
    batch = tuple(a for a in rules.batch_axes if rules.sizes[a] > 1)
    axes, _ = resolve_name("expert", rules.rules.params, rules.sizes)
    size = rules.sizes.get(EXPERT, 1)
    expert = EXPERT if tuple(axes or ()) == (EXPERT,) and EXPERT in batch and num_experts % size == 0 else None
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return _Split(context, (), expert, size, inside=True) if expert in context.manual_axes else None
    if not batch:
        return None
    return _Split(rules.mesh if isinstance(rules.mesh, Mesh) else context, batch, expert, size if expert else 1)


def _exchange(x, experts, weights, w_gate, w_up, w_down, *, axis: str, size: int, kept=None, slot_rows=None):
    """One device's part of expert parallelism (inside a shard_map manual over ``axis``):
    its tokens ``x (N, C)`` and their ``experts``/``weights (N, k)``, its ``E / size`` experts.

    Each (token, expert) assignment goes to the device holding that expert (``all_to_all``),
    which runs its experts on what it received (grouped matmuls) and sends the results back
    (``all_to_all``). Dropless: a device may send all of its assignments to one peer, so each
    peer's slot holds ``N * k`` rows (``ragged_all_to_all``, which sends only what is there,
    is not implemented by XLA:CPU). With a capacity only the assignments ``kept`` travel,
    and each slot holds ``slot_rows``, what the capacity lets a device send one peer.
    """
    per = w_gate.shape[0]  # this device's experts
    N, k = experts.shape
    A = N * k  # assignments
    cap = A if slot_rows is None else slot_rows  # rows of a peer's slot
    flat = experts.reshape(-1)
    key = flat if kept is None else jnp.where(kept.reshape(-1), flat, size * per)  # dropped: past every destination
    dest = key // per
    order = jnp.argsort(key, stable=True)  # grouped by destination, then expert; the dropped last
    counts = jnp.zeros((size + 1,), jnp.int32).at[dest].add(1)
    starts = jnp.cumsum(counts) - counts
    slot = (dest[order], jnp.arange(A) - starts[dest[order]])  # (destination, row in its slot); dropped: none
    send = jnp.zeros((size, cap, x.shape[-1]), x.dtype).at[slot].set(x[order // k], mode="drop")
    ids = jnp.full((size, cap), per, jnp.int32).at[slot].set(flat[order] % per, mode="drop")  # per: an empty row
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True).reshape(size * cap, -1)
    rids = jax.lax.all_to_all(ids, axis, 0, 0, tiled=True).reshape(-1)
    group = jnp.argsort(rids, stable=True)  # by local expert; empty rows last
    sizes = jnp.zeros((per + 1,), jnp.int32).at[rids].add(1)[:per]
    out = _run_groups(recv[group], sizes, w_gate, w_up, w_down, rows=cap)
    out = jnp.zeros_like(out).at[group].set(out).reshape(size, cap, -1)
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # each assignment's result, in its slot
    mine = jnp.zeros((A, x.shape[-1]), back.dtype).at[order].set(back.at[slot].get(mode="fill", fill_value=0))
    return jnp.einsum("nkc,nk->nc", mine.reshape(N, k, -1).astype(jnp.float32), weights).astype(x.dtype)


def slot_rows(tokens: int, length: int, k: int, num_experts: int, size: int, cap: Optional[int]) -> int:
    """Rows of one peer's slot in the exchange over an expert axis of ``size`` devices, for a
    device's ``tokens`` (sequences of ``length``): all of its ``tokens * k`` assignments
    (dropless), or what a capacity ``cap`` lets it send one peer, its ``E / size`` experts'
    capacity in each sequence."""
    return tokens * k if cap is None else min(tokens * k, tokens // length * (num_experts // size) * cap)


def route_and_run(x, logits, k: int, w_gate, w_up, w_down, *, length: int, cap: Optional[int] = None, positions=None,
                  exchange: Optional[tuple[str, int]] = None, router: Router = Router(), bias=None):  # fmt: skip
    """``(y (N, C), experts (N, k), kept (N, k) or None)``: tokens ``x`` routed by their
    ``logits (N, E)`` to ``k`` experts each (as ``router`` chooses and weighs them, with its
    ``bias (E,)``: :func:`route`) and run through them, on one device or one shard.
    ``cap``: each expert takes at most ``cap`` assignments of a sequence (rows of ``length``
    tokens at ``positions``, :func:`within_capacity`); the others are dropped (``kept``
    False: they add nothing). ``exchange``: ``(axis, size)``, the experts are
    split over that manual axis and the assignments travel to them (:func:`_exchange`)."""
    weights, experts = route(logits, k, router, bias)
    N, E = logits.shape
    kept = None if cap is None else within_capacity(experts, E, length, cap, positions)
    if kept is not None:
        weights = jnp.where(kept, weights, 0.0)
    if exchange is None:
        return grouped_swiglu(x, experts, weights, w_gate, w_up, w_down, kept), experts, kept
    axis, size = exchange
    slot = None if cap is None else slot_rows(N, length, k, E, size, cap)
    return _exchange(x, experts, weights, w_gate, w_up, w_down, axis=axis, size=size, kept=kept, slot_rows=slot), experts, kept


def sharded_moe(x, logits, k: int, w_gate, w_up, w_down, split: _Split, *, length: int, cap: Optional[int] = None,
                positions=None, router: Router = Router(), bias=None):  # fmt: skip
    """:func:`route_and_run` on a mesh. Each batch shard routes and sorts its own tokens
    (``jax.shard_map`` manual over the batch axes; tensor-parallel axes stay with the
    compiler), so no device ever sorts, or holds, every token (left to the compiler, even
    the top-k of the router gathered every token's probabilities). With an expert axis the
    tokens travel to their experts' devices and back (:func:`_exchange`); otherwise every
    shard runs the experts, gathered like any weight of the layout (FSDP), on its tokens.
    A shard holds whole sequences, so a capacity drops the same assignments on any mesh.
    The router's ``bias (E,)`` is whole on every device (it is tiny, and every token needs it)."""
    exchange = None if split.expert is None else (split.expert, split.size)

    def local(x, logits, w_gate, w_up, w_down, positions, bias):
        y, experts, kept = route_and_run(x, logits, k, w_gate, w_up, w_down, length=length, cap=cap, positions=positions,
                                         exchange=exchange, router=router, bias=bias)  # fmt: skip
        return (y, experts) if kept is None else (y, experts, kept)

    operands = (x, logits, w_gate, w_up, w_down, positions, bias)
    if split.inside:  # a pipeline stage's shard_map is manual over the expert axis already
        out = local(*operands)
    else:
        tokens = P(split.batch if len(split.batch) > 1 else split.batch[0])
        # the experts split over the expert axis, or whole; the router's bias whole
        specs = (tokens, tokens) + (P(split.expert),) * 3 + (tokens, P())
        out = jax.shard_map(local, mesh=split.mesh, in_specs=specs, out_specs=(tokens,) * (2 if cap is None else 3),
                            axis_names=frozenset(split.batch), check_vma=False)(*operands)  # fmt: skip
    return out if cap is not None else (*out, None)


class SharedExperts(nnx.Module):
    """DeepSeek's shared experts (Hugging Face's ``shared_experts``, a ``DeepseekV3MLP`` of
    width ``n_shared_experts * moe_intermediate_size``): one SwiGLU MLP that every token goes
    through, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, laid out as a dense MLP's."""

    def __init__(self, hidden: int, width: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(hidden, width, kernel_init=logical(_normal, "embed", "mlp"), **kw)
        self.up_proj = nnx.Linear(hidden, width, kernel_init=logical(_normal, "embed", "mlp"), **kw)
        self.down_proj = nnx.Linear(width, hidden, kernel_init=logical(_normal, "mlp", "embed"), **kw)

    def __call__(self, x):  # (B, T, C); called as layers, so LoRA adapts them as any nnx.Linear
        h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(constrain(h, "batch", "length", "mlp"))


class MoE(nnx.Module):
    """``num_experts`` SwiGLU experts of width ``intermediate`` and a router choosing ``top_k``
    per token. Names follow Hugging Face's Mixtral: ``gate`` is the router; the experts are
    held stacked, ``w1`` (gate projection), ``w3`` (up) ``(E, C, F)`` and ``w2`` (down)
    ``(E, F, C)``.

    ``router`` (:class:`Router`): how the experts are chosen and weighed, Mixtral's by
    default; with ``router.score_bias`` the layer holds ``router_bias (E,)``, float32,
    replicated and never decayed (DeepSeek-V3's ``e_score_correction_bias``: zeros until
    loaded; it only decides the choice, so it gets no gradient). ``shared``: the width of
    DeepSeek's shared experts (``n_shared_experts * moe_intermediate_size``), held as
    ``shared_experts`` (:class:`SharedExperts`), whose output is added to the routed one; 0:
    none.

    ``__call__(x (B, T, C))`` returns ``(y (B, T, C), RouterStats)``.
    """

    #: LoRA (nnxscale.layers.lora): each expert's weight is (in, out), an adapter per expert, folded in at use.
    lora_weights = {"w1": (1, 1), "w3": (1, 1), "w2": (1, 1)}

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *, dtype, param_dtype,
                 rngs: nnx.Rngs, capacity_factor: Optional[float] = None, router: Router = Router(),
                 shared: int = 0):  # fmt: skip
        C, F, E = hidden, intermediate, num_experts
        router.check(E, top_k)
        self.top_k = top_k
        self.dtype = dtype
        self.capacity_factor = capacity_factor
        self.router = router
        self.gate = nnx.Linear(C, E, use_bias=False, dtype=jnp.float32, param_dtype=param_dtype,
                               kernel_init=logical(_normal, "embed", None), rngs=rngs)  # fmt: skip
        init = lambda names, shape: nnx.Param(_normal(rngs.params(), shape, param_dtype), **{LOGICAL_KEY: names})  # noqa: E731
        self.w1 = init(("expert", "embed", "mlp"), (E, C, F))
        self.w3 = init(("expert", "embed", "mlp"), (E, C, F))
        self.w2 = init(("expert", "mlp", "embed"), (E, F, C))
        if router.score_bias:  # float32 as HF's buffer; whole on every device (tiny); not a matrix, so no decay
            self.router_bias = nnx.Param(jnp.zeros((E,), jnp.float32), weight_decay=False, **{LOGICAL_KEY: (None,)})
        if shared:
            self.shared_experts = SharedExperts(C, shared, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, *, dropless: bool = False, positions=None):
        """``dropless``: every assignment reaches its expert whatever ``capacity_factor``
        (decoding with a cache does so: a prompt's tokens are not dropped). ``positions``
        (``(T,)`` or ``(B, T)`` ints): each token's place in its sequence when it is stored
        out of order, for the capacity's priority (:func:`within_capacity`)."""
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)
        logits = self.gate(tokens.astype(jnp.float32))  # (N, E), float32 as HF's router
        E = logits.shape[-1]
        cast = lambda name: lora.weight(self, name).astype(self.dtype)  # noqa: E731  (a LoRA adapter folded in)
        experts_w = (cast("w1"), cast("w3"), cast("w2"))
        cap = None if dropless else capacity(self.capacity_factor, T, self.top_k, E)
        where = None  # the tokens' places in their sequences: for the capacity's priority
        if cap is not None:
            where = jnp.broadcast_to(jnp.arange(T) if positions is None else positions, (B, T)).reshape(B * T).astype(jnp.int32)
        split = _split(E)
        bias = self.router_bias[...] if self.router.score_bias else None
        kw = dict(length=T, cap=cap, positions=where, router=self.router, bias=bias)
        if split is None:
            y, experts, kept = route_and_run(tokens.astype(self.dtype), logits, self.top_k, *experts_w, **kw)
        else:
            y, experts, kept = sharded_moe(tokens.astype(self.dtype), logits, self.top_k, *experts_w, split, **kw)
        stats = route_stats(logits, experts, E, kept)
        y = y.reshape(B, T, C)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return constrain(y, "batch", "length", "embed"), stats
