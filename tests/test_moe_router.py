"""The mixture's routers beside Mixtral's (Qwen3-MoE's, DeepSeek-V2's and V3's) and DeepSeek's
shared experts: each layer equal to a per-token reference written from the definitions
(float64 numpy, one token at a time), on one device and on expert meshes, where the tokens
travel to their experts; the router's bias has no gradient and no weight decay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import nnxscale
from model_testing import rules_for
from nnxscale.layers.moe import MoE, Router
from nnxscale.sharding.rules import LOGICAL_KEY, batch_spec
from nnxscale.training.optimizer import decays

C, F, E, K, SHARED = 16, 8, 16, 3, 12  # 4 groups of 4 experts where grouped
B, T = 8, 6  # a batch every mesh of 8 devices splits

VARIANTS = {  # name: (router, shared width, mesh)
    "mixtral": (Router(), 0, "data=2,expert=4"),
    "qwen3-moe-unnormalized": (Router(norm_topk_prob=False), 0, "data=4,expert=2"),
    "deepseek-v3": (Router("sigmoid", True, n_group=4, topk_group=2, routed_scaling_factor=2.5, score_bias=True),
                    SHARED, "data=2,expert=4"),  # fmt: skip
    "sigmoid-unnormalized": (Router("sigmoid", False, routed_scaling_factor=1.5, score_bias=True), 0,
                             "data=4,expert=2"),  # fmt: skip
    "deepseek-v2-group-limited": (Router(norm_topk_prob=False, n_group=4, topk_group=2, routed_scaling_factor=2.0,
                                         group_top=1), 0, "data=2,expert=4"),  # fmt: skip
    "shared-experts": (Router(), SHARED, "data=4,expert=2"),
}


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def _swiglu(x, gate, up, down):
    a = x @ gate
    return (a * _sigmoid(a) * (x @ up)) @ down


def _chosen(scores, bias, router: Router, k: int):
    """The experts one token chooses, from the definition: scores plus bias, the best
    ``topk_group`` groups (a group scored by the sum of its ``group_top`` best), the best
    ``k`` experts of those groups."""
    choice = scores + (0.0 if bias is None else bias)
    per = len(scores) // router.n_group
    group_scores = [np.sort(choice[g * per : (g + 1) * per])[-router.group_top :].sum() for g in range(router.n_group)]
    groups = set(np.argsort(group_scores)[-router.topk_group :])
    eligible = [e for e in range(len(scores)) if e // per in groups]
    return sorted(eligible, key=lambda e: -choice[e])[:k]


def reference(x, p, router: Router, k: int = K):
    """The layer's output for tokens ``x (N, C)``, one token at a time, in float64."""
    out = np.zeros_like(x)
    for n, token in enumerate(x):
        logits = token @ p["gate"]
        scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() if router.scoring == "softmax" \
            else _sigmoid(logits)  # fmt: skip
        experts = _chosen(scores, p.get("bias"), router, k)
        weights = scores[experts]  # the unbiased scores
        if router.norm_topk_prob:
            weights = weights / (weights.sum() + (1e-20 if router.scoring == "sigmoid" else 0.0))
        weights = weights * router.routed_scaling_factor
        for e, w in zip(experts, weights):
            out[n] += w * _swiglu(token, p["w1"][e], p["w3"][e], p["w2"][e])
        if "shared" in p:
            out[n] += _swiglu(token, *p["shared"])
    return out


def build(router: Router, shared: int, seed: int = 0):
    """A float32 MoE with every weight random, big enough for the choices to differ (the
    router's logits of spread about 2, its bias about 0.2), and the same weights in float64:
    ``{"gate", "w1", "w3", "w2"[, "bias"][, "shared": (gate, up, down)]}``."""
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    layer = MoE(C, F, E, K, router=router, shared=shared, **kw)
    rng = np.random.default_rng(seed)
    state = nnx.state(layer, nnx.Param)
    values = nnx.to_pure_dict(state)
    scale = {"gate": 0.5, "router_bias": 0.2}  # by the first key of the path; 0.3 for the rest
    draw = lambda path, v: rng.normal(size=v.shape) * scale.get(path[0].key, 0.3)  # noqa: E731
    values = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), values))
    nnx.update(layer, state)
    p = {"gate": values["gate"]["kernel"], "w1": values["w1"], "w3": values["w3"], "w2": values["w2"]}
    if router.score_bias:
        p["bias"] = values["router_bias"]
    if shared:
        p["shared"] = tuple(values["shared_experts"][m]["kernel"] for m in ("gate_proj", "up_proj", "down_proj"))
    return layer, p


def _inputs(seed=1):
    return np.random.default_rng(seed).normal(size=(B, T, C))


_forward = jax.jit(lambda graphdef, state, x: nnx.merge(graphdef, state)(x), static_argnums=0)


def on_mesh(layer, x, spec):
    """The layer's output on ``spec``, traced with the rules in force as the trainer runs it."""
    mesh = nnxscale.make_mesh(spec)
    rules = rules_for(mesh)
    graphdef, state = nnx.split(nnxscale.place(layer, mesh, rules))
    x = jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, batch_spec(None, mesh, 3)))

    def forward(state, x):
        with nnxscale.use_rules(rules):
            return nnx.merge(graphdef, state)(x)

    assert "all_to_all" in str(jax.make_jaxpr(forward)(state, x))  # the tokens travel to their experts
    return jax.jit(forward)(state, x)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_router_equals_its_definition_on_one_device_and_on_an_expert_mesh(name):
    router, shared, spec = VARIANTS[name]
    layer, p = build(router, shared)
    x = _inputs()
    y, stats = _forward(*nnx.split(layer), jnp.asarray(x, jnp.float32))
    want = reference(x.reshape(-1, C), p, router).reshape(B, T, C)
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=1e-5)
    assert stats.fraction.shape == (E,) and float(jnp.sum(stats.fraction)) == pytest.approx(K)
    y_mesh, stats_mesh = on_mesh(layer, x, spec)
    np.testing.assert_allclose(np.asarray(y_mesh), np.asarray(y), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats_mesh.fraction), np.asarray(stats.fraction), atol=1e-6)


def test_the_bias_and_the_groups_change_the_choice():
    """The variants test something: DeepSeek-V3's reference without its bias, or without its
    groups, chooses other experts for some tokens (so the layer's match is not luck)."""
    router, shared, _ = VARIANTS["deepseek-v3"]
    _, p = build(router, shared)
    x = _inputs().reshape(-1, C)
    want = reference(x, p, router)
    unbiased = reference(x, {**p, "bias": np.zeros(E)}, router)
    ungrouped = reference(x, p, Router("sigmoid", True, routed_scaling_factor=2.5, score_bias=True))
    for other in (unbiased, ungrouped):
        differs = np.abs(other - want).max(axis=1) > 1e-3
        assert 0 < differs.sum() < len(x)


def test_the_router_bias_is_replicated_never_decayed_and_gets_no_gradient():
    router, shared, _ = VARIANTS["deepseek-v3"]
    layer, _ = build(router, shared)
    bias = layer.router_bias
    assert bias[...].dtype == jnp.float32 and bias[...].shape == (E,)
    assert bias.get_metadata()[LOGICAL_KEY] == (None,) and not decays(bias)
    assert layer.shared_experts.down_proj.kernel.get_metadata()[LOGICAL_KEY] == ("mlp", "embed")
    graphdef, state = nnx.split(layer)
    x = jnp.asarray(_inputs(), jnp.float32)
    grads = jax.jit(jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x)[0] ** 2)))(state)
    assert not np.asarray(grads["router_bias"][...]).any()
    assert np.abs(np.asarray(grads["gate"]["kernel"][...])).max() > 0  # the weights' gradient reaches the router


def test_mixtrals_layer_holds_what_it_held():
    """By default the layer is Mixtral's: the same parameters, no bias, no shared experts."""
    layer = MoE(C, F, E, K, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    assert shapes == {"gate": {"kernel": (C, E)}, "w1": (E, C, F), "w3": (E, C, F), "w2": (E, F, C)}


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(scoring="relu"), ["scoring", "relu"]),
        (dict(n_group=4, topk_group=5), ["topk_group=5", "n_group=4"]),
    ],
)
def test_an_impossible_router_is_one_clear_error(kw, words):
    with pytest.raises(ValueError) as e:
        Router(**kw)
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ValueError, match="top_k=5 is more than the 4 experts"):
        MoE(C, F, E, 5, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), router=Router(n_group=4))
