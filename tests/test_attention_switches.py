"""The attention switches of Mistral, Gemma 2/3, Qwen3 and DeepSeek: a sliding ``window``, a
logit ``softcap``, a softmax ``scale``, and values of another width than the keys (MLA).

Every path equals masked softmax attention written from its definition here (outputs and
gradients, float32, 1e-5 of the largest magnitude), alone and together, with grouped queries,
documents and reordered positions: XLA's, the blockwise kernel's (several tiles), the ring's over
a ``context`` axis (a window shorter and longer than a device's share), the Pallas kernels' own
code in interpret mode (splash; nnxscale's Triton kernel), and decoding with a ring KV cache
that holds only the window. Tiles outside the window are really skipped: the blockwise
kernel's tile test is counted as it runs (the window's band, not the causal triangle), and a
ring over a sequence in order sends no block the window cannot reach."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_long_context import assert_close, documents, value_and_grads

from nnxscale.errors import ConfigError
from nnxscale.jobs import jax_private
from nnxscale.layers import attention as attn
from nnxscale.layers import kv_cache
from nnxscale.layers.kernels.gpu_flash import gpu_flash_attention
from nnxscale.layers.kernels.splash import splash_attention


def definition(q, k, v, *, causal=True, q_positions=None, k_positions=None, q_segments=None, k_segments=None,
               window=None, softcap=None, scale=None):  # fmt: skip
    """Attention from its definition: query heads repeated onto their key/value head, scores
    ``q.k * scale`` (default ``1/sqrt(H)``), capped to ``softcap * tanh(s / softcap)``, keys
    hidden unless ``k <= p`` (causal), ``p - k < window`` and of the query's document; a
    softmax over the rest; the values' weighted sum. Positions ``(T,)`` or ``(B, T)``."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    qp = jnp.broadcast_to(jnp.arange(T) if q_positions is None else jnp.asarray(q_positions), (B, T))
    kp = jnp.broadcast_to(jnp.arange(S) if k_positions is None else jnp.asarray(k_positions), (B, S))
    kk, vv = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kk, precision="highest") * (H**-0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    seen = jnp.ones((B, T, S), bool)
    if causal:
        seen &= qp[:, :, None] >= kp[:, None, :]
    if window is not None:
        seen &= qp[:, :, None] - kp[:, None, :] < window
    if q_segments is not None:
        seen &= jnp.asarray(q_segments)[:, :, None] == jnp.asarray(k_segments)[:, None, :]
    s = jnp.where(seen[:, None], s, -jnp.inf)
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return jnp.einsum("bnts,bsnh->btnh", e / jnp.sum(e, axis=-1, keepdims=True), vv, precision="highest")


def inputs(B, T, S, N, K, H, Hv=None, seed=0, q_scale=1.0):
    """``q, k, v, ct`` float32; ``q_scale`` makes the scores large enough for a cap to matter."""
    r = np.random.default_rng(seed)
    Hv = H if Hv is None else Hv
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, Hv), (B, T, N, Hv))
    q, k, v, ct = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes)
    return q * q_scale, k, v, ct


B, T, N, K = 2, 40, 4, 2  # grouped queries: two per key/value head; 40 tokens in 5 tiles of 8
SEG = documents(B, T, [(9, 25, 6), (40,)])
ORDER = np.concatenate([np.arange(0, 10), np.arange(30, 40), np.arange(10, 20), np.arange(20, 30)])  # head-tail
CASES = {
    # name: (H, Hv, switches, masks)
    "window": (8, 8, dict(window=7), {}),
    "softcap": (8, 8, dict(softcap=2.0), {}),
    "scale": (8, 8, dict(scale=0.3), {}),
    "values narrower than keys": (12, 8, {}, {}),
    "all, documents, reordered positions": (12, 8, dict(window=9, softcap=3.0, scale=0.4),
                                            dict(q_positions=ORDER, k_positions=ORDER, q_segments=SEG[:, ORDER],
                                                 k_segments=SEG[:, ORDER])),
    "window and cap, documents": (8, 8, dict(window=5, softcap=1.5), dict(q_segments=SEG, k_segments=SEG)),
}  # fmt: skip


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
@pytest.mark.parametrize("case", CASES)
def test_each_switch_equals_the_definition(impl, case):
    H, Hv, switches, masks = CASES[case]
    q, k, v, ct = inputs(B, T, T, N, K, H, Hv, seed=len(case), q_scale=3.0)
    want = value_and_grads(lambda q, k, v: definition(q, k, v, **masks, **switches), q, k, v, ct)
    got = value_and_grads(lambda q, k, v: attn.attention(q, k, v, impl=impl, block=8, **masks, **switches), q, k, v, ct)
    assert got[0].shape == (B, T, N, Hv)
    assert_close(got, want, f"{impl}: {case}")
    if switches:  # the switches change the result: a path that dropped one would fail above
        plain = jax.jit(functools.partial(definition, **masks))(q, k, v)
        assert float(jnp.max(jnp.abs(plain - want[0]))) > 0.05, case


def test_not_causal_with_a_window_and_more_keys_than_queries():
    """Without the causal mask the window limits the left only (``p - k < window``)."""
    q, k, v, ct = inputs(2, 20, 33, N, K, 8, 6, seed=7)
    want = value_and_grads(lambda q, k, v: definition(q, k, v, causal=False, window=6, scale=0.5), q, k, v, ct)
    for impl in ("xla", "blockwise"):
        f = functools.partial(attn.attention, causal=False, window=6, scale=0.5, impl=impl, block=8)
        assert_close(value_and_grads(f, q, k, v, ct), want, impl)


def _count_tiles(monkeypatch):
    """Counts the tiles the blockwise kernel visits, as it runs: its tile test, reported
    through a callback (every ``lax.cond`` it decides visits the tile when True)."""
    visited = []
    test = attn._tile_needed

    def counted(meta, qp, kp, qs, ks):
        needed = test(meta, qp, kp, qs, ks)
        jax.debug.callback(lambda x: visited.append(bool(x)), needed)
        return needed

    monkeypatch.setattr(attn, "_tile_needed", counted)
    return visited


def test_the_blockwise_kernel_visits_only_the_tiles_in_the_window(monkeypatch):
    """256 tokens in 16 tiles of 16, a window of 16: each query tile visits its own key tile
    and the one before (31 of the 256 pairs), forward and backward; causal alone 136. The cost
    grows with the window, not with the sequence's square."""
    visited = _count_tiles(monkeypatch)
    q, k, v, ct = inputs(1, 256, 256, 1, 1, 8, seed=3)
    for window, tiles in ((16, 31), (None, 136)):
        f = functools.partial(attn.attention, impl="blockwise", block=16, window=window)
        got = value_and_grads(f, q, k, v, ct)
        jax.block_until_ready(got)
        jax.effects_barrier()
        assert len(visited) == 2 * 256 and sum(visited) == 2 * tiles, (window, sum(visited))
        visited.clear()
        assert_close(got, value_and_grads(functools.partial(definition, window=window), q, k, v, ct), f"window {window}")


def _tiles_in_window(order, n, block, window) -> int:
    """Pairs of (query tile, key tile) with a query and a key within the causal window, over
    every device's tiles and every block of keys the ring brings (positions ``order``)."""
    tiles = np.asarray(order).reshape(n * len(order) // (n * block), block)
    per_device = len(tiles) // n
    count = 0
    for d in range(n):
        for qt in tiles[d * per_device : (d + 1) * per_device]:
            diff = qt[:, None] - tiles[:, None, :]  # every key tile of the sequence: (tiles, block, block)
            count += int(np.sum(np.any((diff >= 0) & (diff < window), axis=(1, 2))))
    return count


@pytest.mark.parametrize("n, window", [(4, 5), (2, 20)], ids=["shorter than a device's share", "longer than a device's share"])
def test_ring_attention_with_the_switches_equals_the_definition(n, window, monkeypatch):
    """32 tokens over context=4 (8 per device, a window of 5) or context=2 (16 per device, a
    window of 20), tiles of 4: in order with documents and in the zigzag layout, the switches
    together with values narrower than keys; outputs and gradients equal the definition's (in
    order through ``attention`` under rules that split the sequence, which takes the ring). In
    order the ring sends only the blocks the window reaches (ppermutes counted in the
    program); zigzag visits exactly the tiles that hold a pair in the window (counted as it
    runs)."""
    import nnxscale

    mesh = nnxscale.make_mesh(f"context={n}", devices=jax.devices()[:n])
    rules = nnxscale.resolve("auto", mesh, min_shard_bytes=0)
    T = 32
    q, k, v, ct = inputs(2, T, T, N, K, 12, 8, seed=5, q_scale=3.0)
    seg = documents(2, T, [(5, 20, 7), (32,)])
    switches = dict(window=window, softcap=3.0, scale=0.4)
    order = attn.zigzag(T, n)
    visited = _count_tiles(monkeypatch)
    for positions in (None, order):
        # In order with documents; zigzag without them, where the tile test reads the tiles'
        # extreme positions (with documents it tests every pair).
        kw = dict(q_segments=seg, k_segments=seg) if positions is None else dict(q_positions=positions, k_positions=positions)
        want = value_and_grads(lambda q, k, v: definition(q, k, v, **kw, **switches), q, k, v, ct)  # noqa: B023

        def ring(q, k, v):
            if positions is None:  # noqa: B023
                with nnxscale.use_rules(rules):
                    return attn.attention(q, k, v, impl="xla", block=4, **kw, **switches)  # noqa: B023
            return attn.ring_attention(q, k, v, axis="context", mesh=mesh, block=4, **kw, **switches)  # noqa: B023

        visited.clear()
        assert_close(value_and_grads(ring, q, k, v, ct), want, f"window {window}, zigzag {positions is not None}")
        jax.effects_barrier()
        if positions is not None:  # forward and backward each visit exactly the tiles with a pair in the window
            expected = _tiles_in_window(order, n, 4, window)
            assert sum(visited) == 2 * expected < 2 * _tiles_in_window(order, n, 4, T), (sum(visited), expected)

    def permutes(window):
        f = lambda q, k, v: jnp.sum(attn.ring_attention(q, k, v, axis="context", mesh=mesh, window=window) * ct)  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)).count("ppermute")

    hops = attn.ring_hops(n, T // n, True, window, True)
    assert hops == 2  # context=4: the block before only; context=2: both (the whole ring)
    # One ppermute per array sent: hops - 1 shifts of the 4 key/value arrays forward and again
    # backward, hops shifts of their 2 gradients and, short of the whole ring, one home.
    assert permutes(window) == 8 * (hops - 1) + 2 * hops + (2 if hops < n else 0) == (14 if n == 4 else 12)
    if hops < n:  # without the window: the whole ring
        assert permutes(None) == 8 * (n - 1) + 2 * n == 32


KERNELS = {  # name: (kernel, the values' width)
    "splash": (splash_attention, 16),  # values narrower than keys too
    # a window or a cap: nnxscale's Triton kernel, whichever jax; tiles of 32 (4 of them, some skipped)
    "pallas-gpu": (functools.partial(gpu_flash_attention, block=32), 32),
}


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernels_take_the_switches_in_interpret_mode(kernel):
    """The kernels' own code (Pallas interpret mode), 100 tokens padded to whole tiles, grouped
    queries, documents, a window of 20, a cap and a scale (splash: values of 16 beside keys of
    32): the definition's outputs and gradients."""
    run, Hv = KERNELS[kernel]
    q, k, v, ct = inputs(2, 100, 100, N, K, 32, Hv, seed=8, q_scale=3.0)
    seg = jnp.asarray(documents(2, 100, [(17, 60, 23), (100,)]))
    switches = dict(window=20, softcap=2.0, scale=0.25)
    want = value_and_grads(lambda q, k, v: definition(q, k, v, q_segments=seg, k_segments=seg, **switches), q, k, v, ct)
    run = functools.partial(run, causal=True, interpret=True, **switches)
    assert_close(value_and_grads(lambda q, k, v: run(q, k, v, seg, seg), q, k, v, ct), want, kernel)


def test_auto_leaves_out_the_kernels_that_cannot_take_a_switch(monkeypatch):
    """NVIDIA: cuDNN takes the window and the scale but no cap (auto takes the Pallas kernel,
    which does) and no values of another width (nor does the Pallas kernel: XLA's attention);
    naming a kernel that cannot is one line saying what can. TPU: splash takes them all."""
    monkeypatch.setattr(jax_private, "cudnn_version", lambda: 92800)
    bf16 = jnp.bfloat16
    resolve = functools.partial(attn.resolve, "auto", 4096, bf16, 128, platform="nvidia")
    assert resolve() == resolve(window=4096) == "cudnn"
    assert resolve(softcap=50.0) == resolve(window=4096, softcap=50.0) == "pallas-gpu"
    assert resolve(v_head_dim=64) == "blockwise" and resolve(window=8, causal=False) == "pallas-gpu"
    assert attn.resolve("auto", 1024, bf16, 192, platform="nvidia", v_head_dim=128) == "xla"
    for switches in (dict(softcap=50.0), dict(window=8), dict(v_head_dim=128)):
        assert attn.resolve("auto", 4096, bf16, 192, platform="tpu", **switches) == "splash"
    with pytest.raises(ConfigError, match="--attention cudnn takes no logit soft-capping here: use --attention pallas-gpu, xla or blockwise"):
        attn.resolve("cudnn", 4096, bf16, 128, platform="nvidia", softcap=50.0)
    with pytest.raises(ConfigError, match=r"--attention cudnn takes values as wide as the keys only \(here 64, keys 128\): use --attention xla or blockwise"):
        attn.resolve("cudnn", 4096, bf16, 128, platform="nvidia", v_head_dim=64)
    with pytest.raises(ConfigError, match="--attention pallas-gpu takes values as wide .*: use --attention xla or blockwise"):
        attn.resolve("pallas-gpu", 4096, bf16, 128, platform="nvidia", v_head_dim=64)
    assert attn.resolve("pallas-gpu", 4096, bf16, 128, platform="nvidia", softcap=50.0, window=16) == "pallas-gpu"
    line = attn.describe("auto", 4096, bf16, 128, platform="nvidia", window=4096, softcap=50.0)
    assert line == ("attention: pallas-gpu (auto: NVIDIA GPU, bfloat16; the Pallas GPU flash kernel, as cuDNN takes no "
                    "logit soft-capping here), sliding window of 4,096 tokens, logits soft-capped at 50"), line  # fmt: skip
    line = attn.describe("auto", 4096, bf16, 128, platform="nvidia", v_head_dim=64)
    assert "not cuDNN, as cuDNN takes values as wide as the keys only" in line and "nor the Pallas GPU flash kernel, which takes" in line
    assert attn.describe("auto", 4096, bf16, 128, platform="nvidia") == "attention: cudnn (auto: NVIDIA GPU, bfloat16)"


@pytest.mark.parametrize("prefill", [1, 7], ids=["token by token", "a prefill longer than the window"])
def test_a_ring_cache_decodes_like_windowed_attention_over_the_whole_sequence(prefill):
    """A cache of 4 slots for a window of 4 over 13 tokens per row, rows starting at positions 0
    and 3, values narrower than keys, a cap and a scale: a prefill, then one token at a time
    with ``step`` gives the definition's outputs over the whole sequence (float32 1e-5), as a
    whole cache does (row 0: a whole cache takes the slots before a row's first position as
    written); the ring ends holding each row's last 4 positions. Decoding the last
    position again with another token (a slot written before, as padding is) sees the new
    token only, not what was written there."""
    W, L, H, Hv = 4, 13, 8, 6
    starts = np.array([0, 3])
    positions = jnp.asarray(starts[:, None] + np.arange(L), jnp.int32)
    q, k, v, _ = inputs(2, L, L, N, K, H, Hv, seed=11, q_scale=3.0)
    switches = dict(window=W, softcap=2.0, scale=0.4)
    want = jax.jit(functools.partial(definition, q_positions=positions, k_positions=positions, **switches))(q, k, v)
    step = jax.jit(functools.partial(kv_cache.step, impl="auto", **switches))
    layer = lambda c: jax.tree.map(lambda x: x[0], c)  # noqa: E731  (one layer of the stack)
    caches = {"ring": layer(kv_cache.empty(1, 2, 64, K, H, jnp.float32, window=W, v_head_dim=Hv)),
              "whole": layer(kv_cache.empty(1, 2, 64, K, H, jnp.float32, v_head_dim=Hv))}  # fmt: skip
    ring = caches["ring"]
    assert ring["k"].shape == (2, W, K, H) and ring["v"].shape == (2, W, K, Hv) and ring["pos"].tolist() == [[-1] * W] * 2
    assert set(caches["whole"]) == {"k", "v"} and caches["whole"]["v"].shape == (2, 64, K, Hv)
    # The last position again, another token: the definition over the rewritten rows.
    q2, k2, v2 = (x.at[:, L - 1].set(-2 * x[:, L - 1]) for x in (q, k, v))
    again = jax.jit(functools.partial(definition, q_positions=positions, k_positions=positions, **switches))(q2, k2, v2)
    again = again[:, L - 1 :]
    assert float(jnp.max(jnp.abs(again - want[:, L - 1 :]))) > 0.05
    for name, cache in caches.items():
        outs = []
        for a, b in [(0, prefill)] + [(t, t + 1) for t in range(prefill, L)]:
            y, cache = step(cache, q[:, a:b], k[:, a:b], v[:, a:b], positions[:, a:b])
            outs.append(y)
        rows = slice(None) if name == "ring" else slice(0, 1)
        assert_close(jnp.concatenate(outs, axis=1)[rows], want[rows], f"{name}, prefill {prefill}")
        y, _ = step(cache, q2[:, L - 1 :], k2[:, L - 1 :], v2[:, L - 1 :], positions[:, L - 1 :])
        assert_close(y[rows], again[rows], f"{name}, the last position again")
        caches[name] = cache
    assert [sorted(row) for row in caches["ring"]["pos"].tolist()] == [list(range(s + L - W, s + L)) for s in starts]


def test_a_ring_cache_refuses_a_window_wider_than_its_slots():
    ring = jax.tree.map(lambda x: x[0], kv_cache.empty(1, 1, 64, K, 8, jnp.float32, window=4))
    x = jnp.zeros((1, 1, K, 8))
    with pytest.raises(ValueError, match="a ring cache of 4 slots serves a window of at most 4 tokens, got 8"):
        kv_cache.step(ring, x, x, x, jnp.zeros((1, 1), jnp.int32), window=8)
