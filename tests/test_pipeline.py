"""Pipeline parallelism on 8 CPU devices: the schedules give what ``scan_layers`` gives.

Every pipelined program here is compiled once and checked three ways: its outputs and
gradients against the unpipelined scan (float32, 1e-6 relative), its stacked parameters
held one stage per device, and its collective-permutes against the analytical
:func:`nnxscale.layers.pipeline.pipeline_cost`. Then: how dropout keys are drawn, GPT-2 pipelined
without a change to its code, stage order and what moving into it costs, memory that
does not grow with iterations, and bad input. A checkpoint moving into a circular
pipeline and out again is test_pipeline_train's (with the trainer's Adam state).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import nnxscale
from nnxscale.planning import hlo as hlo
from nnxscale.errors import ConfigError, NnxscaleError
from nnxscale.models import gpt2
from nnxscale.layers.pipeline import (
    Pipeline,
    bubble_fraction,
    pipeline_cost,
    pipeline_layers,
    stage_order_bytes,
    to_layer_order,
    to_stage_order,
    use_pipeline,
)
from nnxscale.sharding.rules import logical
from nnxscale.layers.stack import scan_layers, stack_layers

L, D, B, T = 8, 32, 16, 4  # layers, width, batch, length
SCALE = jnp.linspace(0.5, 1.5, D)  # an argument every layer gets unchanged
_ones, _zeros = nnx.initializers.ones_init(), nnx.initializers.zeros_init()


class Block(nnx.Module):
    """A residual MLP block with logical names, dropout when given a key, and an argument."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d, scale_init=logical(_ones, "embed"), bias_init=logical(_zeros, "embed"), rngs=rngs)
        init = nnx.initializers.normal(0.1)
        self.up = nnx.Linear(d, 4 * d, kernel_init=logical(init, "embed", "mlp"), bias_init=logical(_zeros, "mlp"), rngs=rngs)
        self.down = nnx.Linear(4 * d, d, kernel_init=logical(init, "mlp", "embed"), bias_init=logical(_zeros, "embed"), rngs=rngs)

    def __call__(self, x, scale, key=None):  # (B, T, D)
        x = nnxscale.constrain(x, "batch", "length", "embed")
        h = self.down(jax.nn.gelu(self.up(self.ln(x)))) * scale
        if key is not None:
            h = jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0)
        return nnxscale.constrain(x + h, "batch", "length", "embed")


def _stack(mesh, rules):
    return nnxscale.place(stack_layers(lambda r: Block(D, r), L, rngs=nnx.Rngs(0)), mesh, rules)


class _DrawingBlock(nnx.Module):
    """Draws from two streams, and keeps a forked dropout stream as state."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.down = nnx.Linear(8, 4, kernel_init=nnx.initializers.truncated_normal(0.5), rngs=rngs)


def test_stacked_layers_hold_the_numbers_of_layers_made_one_after_another():
    """stack_layers creates the layers at once (vectorized), yet every array is the one a
    Python list of layers made in a row holds, and the streams are left where the list
    leaves them; the creation draws each parameter once, not once per layer."""
    rngs, again = nnx.Rngs(params=3, dropout=5), nnx.Rngs(params=3, dropout=5)
    stacked = nnx.state(stack_layers(_DrawingBlock, 5, rngs=rngs))
    one_by_one = [dict(nnx.to_flat_state(nnx.state(_DrawingBlock(again)))) for _ in range(5)]
    data = lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a  # noqa: E731
    for path, var in nnx.to_flat_state(stacked):
        want = jnp.stack([data(layer[path].get_value()) for layer in one_by_one])
        np.testing.assert_array_equal(data(var.get_value()), want, err_msg=str(path))
    for name in ("params", "dropout"):
        np.testing.assert_array_equal(jax.random.key_data(rngs[name]()), jax.random.key_data(again[name]()))

    def draws(n):
        jaxpr = jax.make_jaxpr(lambda: nnx.state(stack_layers(_DrawingBlock, n, rngs=nnx.Rngs(params=0, dropout=1))))()
        return sum(str(e).count("random_bits") for e in jaxpr.jaxpr.eqns)

    assert draws(1) == draws(6) > 0


def _vjp_program(graphdef, rules, pipeline, remat="none"):
    """``(state, x, cotangent) -> (out, (d state, d x))`` of the stack, pipelined or not."""

    def run(state, x):
        with nnxscale.use_rules(rules), use_pipeline(pipeline):
            return scan_layers(nnx.merge(graphdef, state), x, SCALE, remat=remat)

    def program(state, x, ct):
        out, vjp = jax.vjp(run, state, x)
        return out, vjp(ct)

    return jax.jit(program)


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _max_rel(tree, reference) -> float:
    return max(jax.tree.leaves(jax.tree.map(_rel, tree, reference)))


MESHES = {
    # mesh: [(repeats, microbatches, remat)]; per-shard batch 4, 8 and 8 rows
    "stage=2,data=4": [(1, 4, "full"), (2, 2, "none"), (2, 4, "dots")],
    "stage=2,fsdp=2,model=2": [(1, 2, "none"), (2, 4, "dots")],
    "stage=4,data=2": [(1, 4, "none"), (2, 8, "full")],
}


@pytest.mark.parametrize("spec", [s if s == "stage=2,data=4" else pytest.param(s, marks=pytest.mark.extended) for s in MESHES])
def test_pipelined_equals_scan_layers(spec):
    mesh = nnxscale.make_mesh(spec)
    rules = nnxscale.resolve("auto", mesh, min_shard_bytes=0)
    S = mesh.shape["stage"]
    layers = _stack(mesh, rules)
    graphdef, state = nnx.split(layers)
    for v in jax.tree.leaves(state):  # each device holds only its stage's layers
        assert v.sharding.spec[0] == "stage"
        assert {s.data.shape[0] for s in v.addressable_shards} == {L // S}
    if "model" in spec:  # and the other axes keep their layout beside the stage axis
        assert state["up"]["kernel"].addressable_shards[0].data.shape == (L // S, D // 2, 4 * D // 2)
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    ct = jax.random.normal(jax.random.key(2), (B, T, D))
    out_ref, grads_ref = _vjp_program(graphdef, rules, None)(state, x, ct)

    for repeats, microbatches, remat in MESHES[spec]:
        pipe = Pipeline.for_mesh(mesh, microbatches, repeats)
        staged = to_stage_order(state, pipe)
        compiled = _vjp_program(graphdef, rules, pipe, remat).lower(staged, x, ct).compile()
        out, (d_state, d_x) = compiled(staged, x, ct)
        d_state = to_layer_order(d_state, pipe, jax.tree.map(lambda v: v.sharding, state))
        what = f"{spec} {pipe.schedule} R={repeats} M={microbatches} remat={remat}"
        assert _rel(out, out_ref) < 1e-6, what
        assert _max_rel((d_state, d_x), grads_ref) < 1e-6, what

        ops = hlo.collectives(compiled.as_text())
        cost = pipeline_cost(pipe, L, x.shape, x.dtype, batch_shards=rules.batch_shard_count)
        assert hlo.collective_bytes(ops)["collective-permute"] == cost.permute_bytes, what
        permutes = [op for op in ops if op.kind == "collective-permute"]
        assert sorted(op.executions for op in permutes) == [pipe.iterations] * 2, what  # forward, backward
        if "data" in spec:  # the stage all-reduces are the only ones of that group size here
            boundary = sum(op.total_bytes for op in ops if op.kind == "all-reduce" and op.group == S)
            assert boundary == cost.boundary_bytes, what


class _Sandwich(nnx.Module):
    """Two layers outside the pipeline (``pipelined=False``), the pipelined stack, one more
    outside: DeepSeek's dense first layers and Gemma 3's last layers, in miniature."""

    def __init__(self, rngs):
        self.first = stack_layers(lambda r: Block(D, r), 2, rngs=rngs, pipelined=False)
        self.body = stack_layers(lambda r: Block(D, r), 4, rngs=rngs)
        self.last = stack_layers(lambda r: Block(D, r), 1, rngs=rngs, pipelined=False)

    def __call__(self, x):
        for stack in (self.first, self.body, self.last):
            x = scan_layers(stack, x, SCALE)
        return x


def test_stacks_outside_the_pipeline_run_whole_on_every_stage():
    """GPipe splits the pipelined stack; the others, whose depths (2 and 1) no 4 stages divide,
    stay whole on every device and run as a scan: output and gradients are the unpipelined ones."""
    mesh = nnxscale.make_mesh("stage=4,data=2")
    rules = nnxscale.resolve("auto", mesh, min_shard_bytes=0)
    graphdef, state = nnx.split(nnxscale.place(_Sandwich(nnx.Rngs(0)), mesh, rules))
    for name, held in (("first", 2), ("body", 1), ("last", 1)):
        for v in jax.tree.leaves(state[name]):
            assert {s.data.shape[0] for s in v.addressable_shards} == {held}, name
    x = jax.random.normal(jax.random.key(1), (B, T, D))

    def loss(state, x, pipe):
        with nnxscale.use_rules(rules), use_pipeline(pipe):
            return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    want = jax.jit(jax.value_and_grad(functools.partial(loss, pipe=None), argnums=(0, 1)))(state, x)
    got = jax.jit(jax.value_and_grad(functools.partial(loss, pipe=Pipeline(stages=4, microbatches=4)), argnums=(0, 1)))(state, x)
    assert _max_rel(got, want) < 1e-6
    assert float(jnp.max(jnp.abs(want[1][0]["first"]["up"]["kernel"]))) > 0  # the outer stacks have gradients


class _CountingBlock(Block):
    """Block that also returns means over its tokens (as a mixture's router statistics)."""

    def __call__(self, x, scale, key=None):
        y = super().__call__(x, scale, key)
        return y, {"mean": jnp.mean(y, axis=(0, 1)), "square": jnp.mean(jnp.square(x))}


@pytest.mark.parametrize("spec,repeats,microbatches", [("stage=2,data=4", 2, 2), pytest.param("stage=4,data=2", 1, 4, marks=pytest.mark.extended)])
def test_statistics_of_pipelined_layers_are_the_whole_batchs(spec, repeats, microbatches):
    """Layers that return means over their tokens (``aux``): pipelined, each layer's are
    averaged over the microbatches and batch shards and come out in layer order, equal to
    the unpipelined scan's over the whole batch; so are the gradients through them."""
    mesh = nnxscale.make_mesh(spec)
    rules = nnxscale.resolve("auto", mesh, min_shard_bytes=0)
    layers = nnxscale.place(stack_layers(lambda r: _CountingBlock(D, r), L, rngs=nnx.Rngs(0)), mesh, rules)
    graphdef, state = nnx.split(layers)
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    pipe = Pipeline.for_mesh(mesh, microbatches, repeats)

    def loss(state, x, pipeline):
        with nnxscale.use_rules(rules), use_pipeline(pipeline):
            out, stats = scan_layers(nnx.merge(graphdef, state), x, SCALE, aux=True)
        weights = jnp.arange(1.0, L + 1)[:, None]  # every layer's statistics count differently
        return jnp.sum(out**2) + jnp.sum(weights * stats["mean"]) + jnp.sum(stats["square"]), stats

    (_, want), grads_want = jax.jit(jax.value_and_grad(lambda s, x: loss(s, x, None), argnums=(0, 1), has_aux=True))(state, x)
    staged = to_stage_order(state, pipe)
    (_, got), (d_state, d_x) = jax.jit(jax.value_and_grad(lambda s, x: loss(s, x, pipe), argnums=(0, 1), has_aux=True))(staged, x)
    assert got["mean"].shape == (L, D) and got["square"].shape == (L,)
    assert _max_rel(got, want) < 1e-6
    d_state = to_layer_order(d_state, pipe, jax.tree.map(lambda v: v.sharding, state))
    assert _max_rel((d_state, d_x), grads_want) < 1e-5


def test_dropout_keys_are_folded_per_microbatch_and_shard():
    """Layer ``l`` on microbatch ``m`` in data shard ``j`` of ``J`` draws from
    ``fold_in(keys[l], m * J + j)``: the pipeline equals that, computed piece by piece."""
    mesh = nnxscale.make_mesh("stage=2,data=4")
    rules = nnxscale.resolve("auto", mesh, min_shard_bytes=0)
    pipe = Pipeline.for_mesh(mesh, microbatches=2, repeats=2)
    layers = _stack(mesh, rules)
    graphdef, state = nnx.split(layers)
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    keys = jax.random.split(jax.random.key(7), L)

    @jax.jit
    def pipelined(state, x, keys):
        with nnxscale.use_rules(rules), use_pipeline(pipe):
            return scan_layers(nnx.merge(graphdef, state), x, SCALE, keys=keys, remat="full")

    out = pipelined(to_stage_order(state, pipe), x, keys)

    M, J = 2, 4
    rows = B // (M * J)
    piece = jax.jit(lambda x, n: scan_layers(layers, x, SCALE, keys=jax.vmap(jax.random.fold_in, (0, None))(keys, n)))
    expected = np.zeros((B, T, D), np.float32)
    for m in range(M):
        for j in range(J):
            index = np.arange(m, B, M)[j * rows : (j + 1) * rows]  # microbatch m's rows on shard j
            expected[index] = piece(x[index], m * J + j)
    assert _rel(out, expected) < 1e-6
    unpipelined = scan_layers(layers, x, SCALE, keys=keys)
    assert _rel(out, unpipelined) > 0.01  # other masks: dropout runs are not bitwise comparable


def test_gpt2_runs_pipelined_without_changing_the_model():
    """GPT-2 calls scan_layers as always; under use_pipeline its blocks run circularly on
    stage=2,data=4 and give what the same model gives on data=8."""
    cfg = gpt2.GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=4, n_head=4)
    model = gpt2.GPT2(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (8, 8), 0, cfg.vocab_size)

    def program(mesh, pipeline):
        rules = nnxscale.resolve("auto", mesh)
        graphdef, params = nnx.split(nnxscale.place(model, mesh, rules))

        def loss(params):
            with nnxscale.use_rules(rules), use_pipeline(pipeline):
                logits = nnx.merge(graphdef, params)(tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True)), params

    reference, params = program(nnxscale.make_mesh("data=8"), None)
    (loss_ref, logits_ref), grads_ref = reference(params)

    mesh = nnxscale.make_mesh("stage=2,data=4")
    pipe = Pipeline.for_mesh(mesh, microbatches=2, repeats=2)
    pipelined, params = program(mesh, pipe)
    assert params["h"]["mlp"]["c_fc"]["kernel"].addressable_shards[0].data.shape == (2, 32, 128)
    (loss, logits), grads = pipelined(to_stage_order(params, pipe))
    grads = to_layer_order(grads, pipe, jax.tree.map(lambda v: v.sharding, params))
    assert _rel(logits, logits_ref) < 1e-6 and _rel(loss, loss_ref) < 1e-6
    assert _max_rel(grads, grads_ref) < 1e-6


def test_stage_order_holds_each_stages_circular_groups():
    mesh = nnxscale.make_mesh("stage=4,data=2")
    pipe = Pipeline.for_mesh(mesh, microbatches=4, repeats=3)
    n = 24  # 12 groups of 2 layers; stage s holds groups s, s+4, s+8
    assert pipe.layer_order(n)[:6].tolist() == [0, 8, 16, 1, 9, 17]
    stacked = jax.device_put(
        jnp.arange(n * 6, dtype=jnp.float32).reshape(n, 6), NamedSharding(mesh, P("stage", "data"))
    )
    other = jax.device_put(jnp.ones(6), NamedSharding(mesh, P("data")))
    tree = {"stacked": stacked, "other": other, "moment": {"mu": stacked * 2}}
    staged = to_stage_order(tree, pipe)
    assert np.array_equal(staged["stacked"], np.asarray(stacked)[pipe.layer_order(n)])
    assert np.array_equal(staged["moment"]["mu"], np.asarray(stacked * 2)[pipe.layer_order(n)])
    assert staged["other"] is other and staged["stacked"].sharding == stacked.sharding
    back = to_layer_order(staged, pipe)
    assert np.array_equal(back["stacked"], stacked) and np.array_equal(back["moment"]["mu"], stacked * 2)
    assert to_stage_order(tree, Pipeline.for_mesh(mesh, 4)) is tree  # GPipe: layer order already

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    shardings = jax.tree.map(lambda a: a.sharding, tree)
    compiled = jax.jit(lambda t: to_stage_order(t, pipe, shardings)).lower(abstract).compile()
    ops = hlo.collectives(compiled.as_text())
    per_device = 2 * (n // 4) * (6 // 2) * 4  # two stacked leaves, a stage's 6 layers, 3 of 6 columns
    assert {op.kind for op in ops} == {"collective-permute"}
    assert hlo.collective_bytes(ops)["collective-permute"] == stage_order_bytes(pipe, per_device)


def test_bubble_and_cost_figures():
    assert bubble_fraction(4, 8) == 3 / 11  # GPipe: (S-1)/(M+S-1)
    assert bubble_fraction(4, 8, 2) == 3 / 19  # circular: (S-1)/(R*M+S-1)
    pipe = Pipeline(stages=4, microbatches=8, repeats=3)
    assert (pipe.schedule, pipe.iterations, pipe.bubble) == ("circular", 27, 3 / 27)
    # gpt2 (12 layers) on stage=4,data=2, global batch 32 x 1024, float32: 2 rows per microbatch
    cost = pipeline_cost(pipe, 12, (32, 1024, 768), "float32", batch_shards=2)
    microbatch = 2 * 1024 * 768 * 4
    assert (cost.layers_per_stage, cost.microbatch_rows) == (3, 2)
    assert cost.permute_bytes == 2 * 27 * microbatch  # one microbatch per iteration, forward and backward
    assert cost.boundary_bytes == 2 * 8 * microbatch  # the whole batch, forward and backward
    forward = pipeline_cost(pipe, 12, (32, 1024, 768), "bfloat16", batch_shards=2, backward=False)
    assert forward.permute_bytes == 27 * microbatch // 2


def test_lint_reports_a_stage_axis_that_holds_no_stacked_layers():
    stage_mesh = {"stage": 2, "data": 4}
    unstacked = [f.kind for f in nnxscale.lint(Block(D, nnx.Rngs(0)), stage_mesh, "auto")]
    assert unstacked == ["unused-rule"]  # the preset's layers -> stage: nothing to split by stage
    assert nnxscale.lint(Block(D, nnx.Rngs(0)), {"data": 8}, "auto") == []  # no stage axis: nothing to say
    stacked = stack_layers(lambda r: Block(D, r), L, rngs=nnx.Rngs(0))
    assert nnxscale.lint(stacked, stage_mesh, "auto") == []


def _one_line(excinfo, *fragments):
    message = str(excinfo.value)
    assert isinstance(excinfo.value, NnxscaleError) and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_pipelines_say_what_to_do():
    with pytest.raises(ConfigError) as e:
        Pipeline(stages=4, microbatches=2)
    _one_line(e, "2 microbatches", "4 stages", "at least 4")
    for bad in (dict(stages=0, microbatches=4), dict(stages=2, microbatches=4, repeats=0), dict(stages=2, microbatches=True)):
        with pytest.raises(ConfigError):
            Pipeline(**bad)
    with pytest.raises(ConfigError) as e:
        Pipeline(stages=4, microbatches=4).check(2)
    _one_line(e, "2 layers is too shallow", "4 stages x 1 repeats")
    with pytest.raises(ConfigError) as e:
        Pipeline(stages=2, microbatches=4, repeats=2).check(6)
    _one_line(e, "6 layers do not divide into 2 stages x 2 repeats", "1, 2, 3, 6")
    with pytest.raises(ConfigError) as e:
        Pipeline(stages=2, microbatches=4).check(8, batch_size=8, batch_shards=4)
    _one_line(e, "4 microbatches do not divide the 2 rows", "multiple of 16")
    with pytest.raises(ConfigError) as e:
        Pipeline.for_mesh(nnxscale.make_mesh("data=8"), 4)
    _one_line(e, "no 'stage' axis")
    with pytest.raises(ConfigError):
        with use_pipeline("gpipe"):
            pass


def test_pipeline_and_mesh_must_agree():
    mesh = nnxscale.make_mesh("stage=2,data=4")
    rules = nnxscale.resolve("auto", mesh, min_shard_bytes=0)
    layers = _stack(mesh, rules)
    x = jnp.zeros((B, T, D))
    with pytest.raises(ConfigError) as e:
        pipeline_layers(layers, x, SCALE, pipeline=Pipeline(stages=4, microbatches=4), mesh=mesh)
    _one_line(e, "stage=4", "stage=2,data=4 has stage=2")
    with pytest.raises(ConfigError) as e:
        pipeline_layers(layers, x, SCALE)
    _one_line(e, "none in force")
    with pytest.raises(ConfigError) as e:  # found through the rules in force: batch 16 over data=4
        with nnxscale.use_rules(rules), use_pipeline(Pipeline(stages=2, microbatches=8)):
            scan_layers(layers, x, SCALE)
    _one_line(e, "8 microbatches do not divide the 4 rows")


def test_layers_are_not_kept_per_iteration():
    """The backward pass reads each iteration's layers from the stage's stack again: a
    copy per iteration would be ``R*M + S - 1`` groups, eight times the stage's layers here (the
    order of the layers does not matter to memory)."""
    mesh = nnxscale.make_mesh("stage=2,data=4")
    rules = nnxscale.resolve("auto", mesh, min_shard_bytes=0)
    graphdef, state = nnx.split(nnxscale.place(stack_layers(lambda r: Block(128, r), L, rngs=nnx.Rngs(0)), mesh, rules))
    x = jax.ShapeDtypeStruct((32, 2, 128), jnp.float32, sharding=rules.sharding(rules.batch_spec(3)))  # tiny activations
    stage_bytes = sum(v.addressable_shards[0].data.nbytes for v in jax.tree.leaves(state))
    for remat in ("none", "full"):
        pipe = Pipeline.for_mesh(mesh, microbatches=8, repeats=2)

        def loss(state, x):
            with nnxscale.use_rules(rules), use_pipeline(pipe):
                return jnp.sum(scan_layers(nnx.merge(graphdef, state), x, jnp.ones(128), remat=remat) ** 2)

        memory = jax.jit(jax.grad(loss)).lower(state, x).compile().memory_analysis()
        assert memory.temp_size_in_bytes < 3 * stage_bytes, (remat, memory.temp_size_in_bytes, stage_bytes)
