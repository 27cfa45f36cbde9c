"""The accelerators' attention kernels: the Pallas splash (TPU) and GPU flash kernels' own
code, run in Pallas interpret mode on CPU, equal ``jax.nn.dot_product_attention`` (outputs
and gradients: 1e-5 in float32, 2e-2 in bfloat16, of the largest magnitude) with grouped
queries, a length that is not a multiple of the tile, causal and document masks, split over
a mesh's batch and heads; ``--attention auto`` picks each platform's kernel from the mesh's
devices; and an NVIDIA target's compiler (deviceless) puts the chosen kernel in the real
train step."""

import functools
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_long_context import assert_close, documents, inputs, reference, value_and_grads

from nnxscale.errors import ConfigError
from nnxscale.jobs import jax_private
from nnxscale.layers import attention as attn
from nnxscale.layers.kernels import per_device
from nnxscale.layers.kernels import gpu_flash
from nnxscale.layers.kernels.gpu_flash import gpu_flash_attention
from nnxscale.layers.kernels.splash import splash_attention
from nnxscale.sharding.activations import use_rules
from nnxscale.sharding.mesh import make_mesh

KERNELS = {"splash": splash_attention, "pallas-gpu": gpu_flash_attention}
if gpu_flash.shipped_kernel() is not None:  # pallas-gpu runs JAX's kernel on this jax: nnxscale's as well
    KERNELS["nnxscale-triton"] = functools.partial(gpu_flash_attention, own=True)
# B, T, N, K, H: grouped queries (two per key/value head) and 100 tokens, in one tile of 128
# with 28 padded
SHAPE = (2, 100, 4, 2, 32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_in_float32_with_documents_split_over_batch_and_heads_equals_xla(kernel):
    """One device's rows and heads each (data=2, model=2: one query and one key/value head
    group per device), packed documents (three in one row, one in the other), causal."""
    B, T, N, K, H = SHAPE
    q, k, v, ct = inputs(B, T, T, N, K, H, seed=2)
    seg = jnp.asarray(documents(B, T, [(17, 60, 23), (100,)]))
    want = value_and_grads(lambda q, k, v: reference(q, k, v, True, q_segments=seg, k_segments=seg), q, k, v, ct)
    run = functools.partial(KERNELS[kernel], causal=True, interpret=True)
    mesh = make_mesh("data=2,model=2", devices=jax.devices()[:4])

    def f(q, k, v):
        with use_rules("auto", mesh):
            return per_device(run, q, k, v, seg, seg)

    assert_close(value_and_grads(f, q, k, v, ct), want, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_in_bfloat16_equals_xla(kernel):
    B, T, N, K, H = SHAPE
    q, k, v, ct = (x.astype(jnp.bfloat16) for x in inputs(B, T, T, N, K, H, seed=3))
    want = value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, v, ct)
    got = value_and_grads(lambda q, k, v: KERNELS[kernel](q, k, v, causal=True, interpret=True), q, k, v, ct)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == jnp.bfloat16
    assert_close(jax.tree.map(lambda x: x.astype(jnp.float32), got), jax.tree.map(lambda x: x.astype(jnp.float32), want),
                 kernel, atol=2e-2)  # fmt: skip


class _Device:
    def __init__(self, platform, kind):
        self.platform, self.device_kind = platform, kind


class _Mesh:  # the devices of a mesh are all platform_of reads
    def __init__(self, device):
        self.devices = np.array([device])


def test_auto_picks_each_platforms_kernel_from_the_meshs_devices(monkeypatch):
    tpu, h100 = _Mesh(_Device("tpu", "TPU v5 lite")), _Mesh(_Device("gpu", "NVIDIA H100 80GB HBM3"))
    assert attn.platform_of(tpu) == "tpu" and attn.platform_of(h100) == "nvidia"
    assert attn.platform_of(_Mesh(_Device("gpu", "AMD Instinct MI300X"))) == "gpu"
    assert attn.platform_of(make_mesh("data=8")) == "cpu"
    assert attn.platform_of(make_mesh("data=8").abstract_mesh) == "cpu"  # no devices: this process's
    assert attn.platform_of({"data": 8}) == "cpu"
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert attn.resolve("auto", 1024, f32, 64, platform="tpu") == "splash"
    assert attn.resolve("auto", 128, bf16, 64, documents=True, platform="tpu") == "splash"
    monkeypatch.setattr(jax_private, "cudnn_version", lambda: 92800)
    assert attn.resolve("auto", 4096, bf16, 64, platform="nvidia") == "cudnn"
    assert attn.resolve("auto", 4096, bf16, 64, documents=True, platform="nvidia") == "pallas-gpu"
    assert attn.resolve("auto", 4096, f32, 64, platform="nvidia") == "pallas-gpu"
    assert attn.describe("auto", 4096, bf16, 64, documents=True, platform="nvidia") == (
        "attention: pallas-gpu (auto: NVIDIA GPU, bfloat16; the Pallas GPU flash kernel, as cuDNN takes no document "
        "mask here), masked at document boundaries"
    )
    assert attn.describe("auto", 4096, bf16, 64, platform="tpu") == "attention: splash (auto: TPU: the Pallas splash attention kernel)"
    monkeypatch.setattr(jax_private, "cudnn_version", lambda: None)  # jax-cuda12-plugin without nvidia-cudnn-cu12
    assert attn.resolve("auto", 4096, bf16, 64, platform="nvidia") == "pallas-gpu"
    assert "the cuDNN library is not installed" in attn.describe("auto", 4096, bf16, 64, platform="nvidia")
    # CPU: as before
    assert attn.resolve("auto", 1024, f32, 64, platform="cpu") == "xla"
    assert attn.resolve("auto", 4096, f32, 64, platform="cpu") == "blockwise"
    with pytest.raises(ConfigError, match="--attention splash runs on TPUs, and the mesh's devices are cpu"):
        attn.resolve("splash", 1024, f32, 64, platform="cpu")
    with pytest.raises(ConfigError, match="--attention pallas-gpu runs on NVIDIA GPUs, and the mesh's devices are tpu"):
        attn.resolve("pallas-gpu", 1024, f32, 64, platform="tpu")


def test_in_a_pipelines_stages_auto_leaves_out_the_pallas_kernels(monkeypatch):
    """JAX refuses a Pallas kernel's output inside a pipeline's shard_map: there ``auto`` takes
    XLA's attention (blockwise for long sequences) where it would take NVIDIA's flash kernel or
    TPU's splash, says so, and ``--attention pallas-gpu`` or ``splash`` is one line; cuDNN stays."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    monkeypatch.setattr(jax_private, "cudnn_version", lambda: None)
    assert attn.resolve("auto", 1024, f32, 64, platform="nvidia", pipelined=True) == "xla"
    assert attn.resolve("auto", 4096, bf16, 64, platform="nvidia", pipelined=True) == "blockwise"
    with attn.in_pipeline_stages():  # while tracing the stages: the default
        assert attn.resolve("auto", 1024, f32, 64, platform="nvidia") == "xla"
        with pytest.raises(ConfigError, match="--attention pallas-gpu does not run inside a pipeline's stages"):
            attn.resolve("pallas-gpu", 1024, f32, 64, platform="nvidia")
    assert attn.resolve("auto", 1024, f32, 64, platform="nvidia") == "pallas-gpu"  # outside them again
    line = attn.describe("auto", 1024, f32, 64, platform="nvidia", pipelined=True)
    assert line.startswith("attention: xla (auto: NVIDIA GPU") and "nor the Pallas GPU flash kernel" in line, line
    assert attn.resolve("auto", 1024, f32, 64, platform="tpu", pipelined=True) == "xla"  # not splash either
    assert "not the Pallas splash attention kernel" in attn.describe("auto", 1024, f32, 64, platform="tpu", pipelined=True)
    with pytest.raises(ConfigError, match="--attention splash does not run inside a pipeline's stages"):
        attn.resolve("splash", 1024, f32, 64, platform="tpu", pipelined=True)
    monkeypatch.setattr(jax_private, "cudnn_version", lambda: 92800)
    assert attn.resolve("auto", 4096, bf16, 64, platform="nvidia", pipelined=True) == "cudnn"


def _bench_targets():
    """``bench/_targets.py``: deviceless meshes of the planner's targets (``plan --target``'s)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "_targets.py"
    spec = importlib.util.spec_from_file_location("_bench_targets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.needs_cuda_plugin
@pytest.mark.parametrize("document_mask", [False, True], ids=["plain", "documents"])
def test_an_nvidia_targets_compiler_puts_the_chosen_kernel_in_the_train_step(document_mask):
    """llama-tiny, bfloat16, fsdp=8 on 8 H100s (compiled for, deviceless): the step holds
    cuDNN's fused attention (with the cuDNN library) or the Pallas kernel (Triton)."""
    from nnxscale.training.config import TrainConfig
    from nnxscale.training.state import setup
    from nnxscale.training.step import make_train_step

    mesh = _bench_targets().target_mesh("h100x8", "fsdp=8")
    cfg = TrainConfig.from_flags(model="llama-tiny", batch_size=8, seq_len=128, dtype="bfloat16", document_mask=document_mask)
    s = setup(cfg, mesh=mesh, separator=0 if document_mask else None)
    c = s.model.config
    chosen = attn.resolve(c.attention, 128, c.dtype, s.model.dims.head_width, document_mask, attn.platform_of(s.mesh))
    assert chosen == ("cudnn" if jax_private.cudnn_version() and not document_mask else "pallas-gpu")
    with jax.set_mesh(s.mesh):
        text = make_train_step(s).lower(s.abstract, s.abstract_batch).compile().as_text()
    targets = set(re.findall(r'custom_call_target="([^"]+)"', text))
    want = "__cudnn$fmha" if chosen == "cudnn" else "__gpu$xla.gpu.triton"
    assert any(t.startswith(want) for t in targets), targets


def test_wide_heads_take_smaller_forward_tiles():
    """The Pallas GPU kernel's forward tile shrinks with the head width so that it fits shared
    memory (Gemma's 256-wide heads: 64 tokens; 128 wide and less: 128)."""
    from nnxscale.layers.kernels.gpu_flash import forward_tile

    assert [forward_tile(h) for h in (64, 128, 192, 256, 512)] == [128, 128, 64, 64, 32]


@pytest.mark.needs_cuda_plugin
def test_heads_256_wide_compile_for_an_nvidia_target():
    """gemma-3-1b's attention (256-wide heads) in the Pallas GPU kernel compiles for an H100
    (deviceless): 128-token tiles asked 320 KiB of shared memory, over the H100's 227 KiB."""
    from nnxscale.layers.kernels.gpu_flash import gpu_flash_attention

    mesh = _bench_targets().target_mesh("h100x8", "data=8")
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    q = jax.ShapeDtypeStruct((8, 512, 4, 256), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((8, 512, 1, 256), jnp.bfloat16, sharding=sharding)

    def loss(q, k, v):
        return jnp.sum(gpu_flash_attention(q, k, v, causal=True).astype(jnp.float32))

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.needs_cuda_plugin
def test_a_pipelined_step_compiles_for_an_nvidia_target_with_auto_attention():
    """gpt2-tiny on stage=2,data=4 for 8 H100s (deviceless), ``--attention auto``: the step
    compiles (the Pallas GPU kernel stays out of the stages) with XLA's attention, no Triton."""
    from nnxscale.training.config import TrainConfig
    from nnxscale.training.state import setup
    from nnxscale.training.step import make_train_step

    mesh = _bench_targets().target_mesh("h100x8", "stage=2,data=4")
    cfg = TrainConfig.from_flags(model="gpt2-tiny", mesh="stage=2,data=4", microbatches=2, batch_size=8, seq_len=64)
    s = setup(cfg, mesh=mesh)
    with jax.set_mesh(s.mesh):
        text = make_train_step(s).lower(s.abstract, s.abstract_batch).compile().as_text()
    assert not any(t.startswith("__gpu$xla.gpu.triton") for t in re.findall(r'custom_call_target="([^"]+)"', text))

