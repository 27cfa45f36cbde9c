"""The NVIDIA kernels against XLA's attention on a real GPU: outputs and gradients.

cuDNN cannot run on a CPU (the tests check the Pallas kernels' own code in interpret mode
there, and that an H100 target's compiler puts cuDNN in the train step); this runs both
NVIDIA paths of ``nnxscale.layers.attention.attention`` on the GPU it finds (with
``--interpret``, on any machine: the splash and Pallas GPU kernels' own code in Pallas
interpret mode instead, at 200 tokens, the same cases otherwise):

- ``cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")``), bfloat16, causal;
- ``pallas-gpu`` (the Pallas GPU flash kernel), bfloat16 and float32, causal, with and
  without packed documents: JAX's own kernel where the installed jax ships it (to 0.12.0),
  else nnxscale's; where JAX's runs, ``nnxscale-triton`` (nnxscale's) runs the same cases;

each against ``jax.nn.dot_product_attention`` computed by XLA in float32 at the highest
matmul precision on the same (rounded) inputs, and XLA's own attention in the kernel's dtype
beside it (the error a dtype costs anyway). Grouped-query (16 query heads over 4 key/value
heads, width 64), 1,000 tokens (not a multiple of any tile), batch 2. Errors are the largest
absolute difference over the largest magnitude of the float32 reference.

Prints one line per case and one JSON line ``{case: {"out": err, "dq": err, "dk": err,
"dv": err, "xla_same_dtype": {...}}}``; the tests' tolerances are 2e-2 in bfloat16 and, on a
CPU, 1e-5 in float32 (a GPU's float32 matmuls may use TF32: larger there).

    python bench/kernels_gpu.py                 # needs an NVIDIA GPU, jax[cuda13] (or cuda12)
    python bench/kernels_gpu.py --interpret     # any machine: splash and pallas-gpu in interpret mode
"""

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from nnxscale.layers import attention as attn
from nnxscale.layers.kernels.gpu_flash import gpu_flash_attention, shipped_kernel
from nnxscale.layers.kernels.splash import splash_attention

B, N, K, H = 2, 16, 4, 64


def documents(T: int) -> np.ndarray:
    seg = np.zeros((B, T), np.int32)
    seg[0, 3 * T // 10 :] = 1
    seg[0, 7 * T // 10 + 20 :] = 2  # three documents in row 0, one in row 1
    return seg


def reference(q, k, v, seg):
    """XLA's attention in ``q``'s dtype, matmuls at the highest precision."""
    mask = None if seg is None else jnp.asarray(seg[:, :, None] == seg[:, None, :])[:, None]
    with jax.default_matmul_precision("highest"):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)


def out_and_grads(f, q, k, v, ct):
    @jax.jit
    def both(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(ct.astype(out.dtype)))

    return [np.asarray(x, np.float32) for x in both(q, k, v, ct)]


def errors(got, want) -> dict:
    return {name: float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def on_the_gpu(impl: str):
    """``attention(q, k, v, segments)`` by nnxscale's ``impl``, as the models call it."""

    def run(q, k, v, seg):
        kw = {} if seg is None else {"q_segments": seg, "k_segments": seg}
        return attn.attention(q, k, v, impl=impl, **kw)

    return run


def interpreted(impl: str):
    """The Pallas kernel's own code in interpret mode (any backend)."""
    kernel = {"splash": splash_attention, "pallas-gpu": gpu_flash_attention}[impl]
    return lambda q, k, v, seg: kernel(q, k, v, seg, seg, causal=True, interpret=True)


def own_triton(interpret: bool):
    """nnxscale's Pallas GPU kernel where ``pallas-gpu`` runs JAX's."""
    return lambda q, k, v, seg: gpu_flash_attention(q, k, v, seg, seg, causal=True, interpret=interpret, own=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interpret", action="store_true", help="the Pallas kernels (splash and pallas-gpu) in Pallas "
                    "interpret mode, on any machine (a CPU: 200 tokens, not 1,000), instead of the GPU's kernels")  # fmt: skip
    interpret = ap.parse_args().interpret
    T = 200 if interpret else 1000  # not a multiple of any tile
    device = jax.devices()[0]
    mode = "Pallas interpret mode" if interpret else "the GPU's kernels"
    print(f"{device.device_kind}, jax {jax.__version__}, {mode}; B={B} T={T} N={N} K={K} H={H}, causal")
    r = np.random.default_rng(0)
    results = {}
    impls = ("splash", "pallas-gpu") if interpret else ("cudnn", "pallas-gpu")
    if shipped_kernel() is not None:
        impls += ("nnxscale-triton",)
    cases = [(impl, dtype, docs) for impl in impls for dtype in (jnp.bfloat16, jnp.float32) for docs in (False, True)
             if impl != "cudnn" or (dtype == jnp.bfloat16 and not docs)]  # cuDNN: bfloat16, no document mask here
    for impl, dtype, docs in cases:
        q, k, v, ct = (jnp.asarray(r.standard_normal(s), dtype) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))
        seg = documents(T) if docs else None
        exact = functools.partial(reference, seg=seg)
        want = out_and_grads(exact, *(x.astype(jnp.float32) for x in (q, k, v, ct)))
        kernel = own_triton(interpret) if impl == "nnxscale-triton" else (interpreted if interpret else on_the_gpu)(impl)
        got = out_and_grads(lambda q, k, v: kernel(q, k, v, seg), q, k, v, ct)  # noqa: B023
        same = out_and_grads(exact, q, k, v, ct)
        name = f"{impl} {jnp.dtype(dtype).name}{' documents' if docs else ''}"
        results[name] = {**errors(got, want), "xla_same_dtype": errors(same, want)}
        print(f"{name:34}" + "  ".join(f"{k} {v:.2e}" for k, v in results[name].items() if k != "xla_same_dtype")
              + "   (XLA in the same dtype: " + "  ".join(f"{k} {v:.2e}" for k, v in results[name]["xla_same_dtype"].items())
              + ")", flush=True)  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
