"""The NVIDIA kernels against XLA's attention on a real GPU: outputs and gradients.

cuDNN cannot run on a CPU (the tests check the Pallas kernels' own code in interpret mode
there, and that an H100 target's compiler puts cuDNN in the train step); this runs both
NVIDIA paths of ``nnxscale.layers.attention.attention`` on the GPU it finds:

- ``cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")``), bfloat16, causal;
- ``pallas-gpu`` (the Pallas GPU flash kernel), bfloat16 and float32, causal, with and
  without packed documents;

each against ``jax.nn.dot_product_attention`` computed by XLA in float32 at the highest
matmul precision on the same (rounded) inputs, and XLA's own attention in the kernel's dtype
beside it (the error a dtype costs anyway). Grouped-query (16 query heads over 4 key/value
heads, width 64), 1,000 tokens (not a multiple of any tile), batch 2. Errors are the largest
absolute difference over the largest magnitude of the float32 reference.

Prints one line per case and one JSON line ``{case: {"out": err, "dq": err, "dk": err,
"dv": err, "xla_same_dtype": {...}}}``; the tests' tolerances are 2e-2 in bfloat16 and, on a
CPU, 1e-5 in float32 (a GPU's float32 matmuls may use TF32: larger there).

    python bench/kernels_gpu.py      # needs an NVIDIA GPU, jax[cuda12]
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from nnxscale.layers import attention as attn

B, T, N, K, H = 2, 1000, 16, 4, 64


def documents() -> np.ndarray:
    seg = np.zeros((B, T), np.int32)
    seg[0, 300:] = 1
    seg[0, 720:] = 2  # three documents in row 0, one in row 1
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


def main() -> None:
    device = jax.devices()[0]
    print(f"{device.device_kind}, jax {jax.__version__}; B={B} T={T} N={N} K={K} H={H}, causal")
    r = np.random.default_rng(0)
    results = {}
    cases = [("cudnn", jnp.bfloat16, False), ("pallas-gpu", jnp.bfloat16, False), ("pallas-gpu", jnp.bfloat16, True),
             ("pallas-gpu", jnp.float32, False), ("pallas-gpu", jnp.float32, True)]  # fmt: skip
    for impl, dtype, docs in cases:
        q, k, v, ct = (jnp.asarray(r.standard_normal(s), dtype) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))
        seg = documents() if docs else None
        kw = {} if seg is None else {"q_segments": seg, "k_segments": seg}
        exact = functools.partial(reference, seg=seg)
        want = out_and_grads(exact, *(x.astype(jnp.float32) for x in (q, k, v, ct)))
        got = out_and_grads(lambda q, k, v: attn.attention(q, k, v, impl=impl, **kw), q, k, v, ct)  # noqa: B023
        same = out_and_grads(exact, q, k, v, ct)
        name = f"{impl} {jnp.dtype(dtype).name}{' documents' if docs else ''}"
        results[name] = {**errors(got, want), "xla_same_dtype": errors(same, want)}
        print(f"{name:32}" + "  ".join(f"{k} {v:.2e}" for k, v in results[name].items() if k != "xla_same_dtype")
              + "   (XLA in the same dtype: " + "  ".join(f"{k} {v:.2e}" for k, v in results[name]["xla_same_dtype"].items())
              + ")", flush=True)  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
