"""Attention whose memory is linear in the sequence: one function, several implementations.

:func:`attention` takes queries ``(B, T, N, H)`` and keys and values ``(B, S, K, H)``
(grouped-query attention when ``K < N``: query head ``n`` reads key/value head
``n // (N // K)``), as ``jax.nn.dot_product_attention`` does, and returns ``(B, T, N, H)``.
Masks are given as what they mean, not as a ``(T, S)`` array, so no implementation ever
needs one:

- ``causal``: a query sees the keys at its own position and before;
- ``q_positions`` / ``k_positions``: each token's position in the whole sequence (default
  ``0..T-1``), for a sequence that is split or reordered (ring attention);
- ``q_segments`` / ``k_segments``: document ids of packed sequences; a query sees only
  keys of its own document;
- ``window``: a sliding window (Mistral, Gemma 2/3's local layers): a query at position ``p``
  sees only keys at positions ``k`` with ``p - k < window`` (Hugging Face transformers' mask,
  ``kv_idx > q_idx - sliding_window``), besides the causal ``k <= p``. Every implementation
  skips the tiles wholly outside it, so it costs the window, not the sequence.

Two more switches change the scores themselves: ``scale`` (the softmax scale, default
``1 / sqrt(H)``: Gemma's ``query_pre_attn_scalar ** -0.5``, DeepSeek's yarn factor) and
``softcap`` (Gemma 2: the scaled scores become ``softcap * tanh(scores / softcap)`` before the
mask and the softmax). Values may be narrower or wider than queries and keys (DeepSeek's
multi-head latent attention: ``v (B, S, K, Hv)``, the result ``(B, T, N, Hv)``). Without
these switches every path runs exactly the program it ran before they existed.

Implementations (``impl``):

- ``"xla"``: ``jax.nn.dot_product_attention``, which materializes the ``(T, S)`` scores
  of every head, and again for their gradient. Fastest for short sequences on CPU.
- ``"blockwise"``: the flash-attention recurrence in plain JAX. Queries are taken a block at
  a time; each block walks the key/value blocks with an online softmax (a running maximum
  and sum), so only a ``(block, block)`` tile of scores exists at once. Its backward
  (``jax.custom_vjp``) recomputes the tiles from the saved log-sum-exp instead of storing
  the scores. Tiles that the masks hide entirely are skipped (``lax.cond``): causal
  attention does about half the work. Works on every backend.
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, NVIDIA's fused
  kernel; needs an NVIDIA GPU (or an NVIDIA target compiled for here), the cuDNN library
  (``nvidia-cudnn-cu13``, or ``-cu12`` with CUDA 12's plugin), float16 or bfloat16, and no document mask.
- ``"splash"``: TPU, the Pallas splash attention kernel shipped in JAX
  (:mod:`nnxscale.layers.kernels.splash`): causal, grouped-query, document masks.
- ``"pallas-gpu"``: NVIDIA, a Pallas GPU flash attention kernel, JAX's own where jax ships it
  (:mod:`nnxscale.layers.kernels.gpu_flash`): causal, grouped-query, document masks.
- ``"auto"``: chosen for the platform of the mesh's devices (a mesh of a deviceless target
  included): ``splash`` on TPU; ``cudnn`` on NVIDIA where it applies, else ``pallas-gpu``;
  elsewhere (CPU) ``xla`` up to :data:`AUTO_BLOCKWISE_FROM` tokens, else ``blockwise``.

What each implementation does with the switches: ``xla`` passes ``scale`` and the window
(``local_window_size``) to ``jax.nn.dot_product_attention`` and computes the scores itself
(einsums) for ``softcap`` or values of another width, which that function does not take;
``blockwise`` and the ring take them all; ``splash`` takes them all (a static
``LocalMask``, ``attn_logits_soft_cap``, the queries pre-scaled); ``pallas-gpu`` runs
nnxscale's kernel (:mod:`nnxscale.layers.kernels.triton_flash`) for a window or a cap, JAX's
having neither, and takes no values of another width; ``cudnn`` takes the window
(causal only) and the scale, no cap and no values of another width. :func:`resolve` leaves a
kernel out of ``auto`` where it cannot, and refuses it by name (saying what can) where asked for.

The two Pallas kernels mask by place in the sequence: they take the attention of plain or
packed sequences (positions that restart at each document and rise within it, as
``nnxscale.models.common.documents`` makes them). Positions in any other order (a sequence
split over a ``context`` axis is a ring, below) go to the blockwise kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nnxscale.errors import ConfigError
from nnxscale.jobs import jax_private
from nnxscale.layers.attention_names import IMPLEMENTATIONS
from nnxscale.layers.kernels import pad_tokens, per_device
from nnxscale.layers.kernels.gpu_flash import gpu_flash_attention
from nnxscale.layers.kernels.splash import splash_attention
from nnxscale.sharding.activations import current_rules
from nnxscale.sharding.devices import installed_extra
from nnxscale.sharding.mesh import context_mesh, varying_like

#: ``auto`` uses the blockwise kernel from this many query tokens on (on CPU and other platforms without a kernel).
AUTO_BLOCKWISE_FROM = 2048
#: Query and key/value tokens per tile of the blockwise kernel.
BLOCK = 512

_NEG = -1e30  # "minus infinity" that keeps exp() and max() finite in the masked tiles


#: The kernels each platform family runs (see :func:`platform_of`); elsewhere XLA's ops only.
KERNELS = {"splash": "tpu", "pallas-gpu": "nvidia", "cudnn": "nvidia"}
#: The Pallas kernels among them: not inside a pipeline's stages (:func:`resolve`).
PALLAS = ("splash", "pallas-gpu")
_PLATFORM_NAMES = {"tpu": "TPU", "nvidia": "NVIDIA GPU"}


def check_impl(impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ConfigError(f"--attention {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    return impl


def device_of(mesh=None):
    """One device of ``mesh``: the first of a ``jax.sharding.Mesh`` (a deviceless target's
    devices too); for an abstract mesh, a ``{axis: size}`` mapping or None, this process's
    first device; ``None`` where this process has no backend."""
    try:
        devices = getattr(mesh, "devices", None)
    except ValueError:  # an AbstractMesh has no devices
        devices = None
    if devices is not None and np.size(devices):
        return np.ravel(devices)[0]
    try:
        return jax.devices()[0]
    except RuntimeError:
        return None


def platform_of(mesh=None) -> str:
    """The platform family of ``mesh``'s devices (:func:`device_of`): ``"tpu"``, ``"nvidia"``,
    or the platform's own name (``"cpu"``, ...). A ``jax.sharding.Mesh`` of a deviceless
    target's devices (``jax.experimental.topologies``) names that target; an abstract mesh, a
    ``{axis: size}`` mapping or None names this process's devices."""
    device = device_of(mesh)
    if device is None:
        return "cpu"
    if device.platform in ("gpu", "cuda") and "nvidia" in device.device_kind.lower():
        return "nvidia"
    return device.platform


def platform_here() -> str:
    """:func:`platform_of` the mesh of the activation rules in force (while tracing)."""
    rules = current_rules()
    return platform_of(rules.mesh if rules is not None else None)


def cudnn_applies(dtype, head_dim: int, platform: Optional[str] = None) -> bool:
    """Whether ``jax.nn.dot_product_attention(implementation="cudnn")`` can run (or be compiled)
    for ``platform`` (default: this process's devices)."""
    platform = platform or platform_of()
    shape_ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 128 and head_dim % 8 == 0
    return platform == "nvidia" and shape_ok and jax_private.cudnn_version() is not None


#: Whether attention is traced inside a pipeline's stages (:func:`in_pipeline_stages`).
_IN_STAGES: contextvars.ContextVar[bool] = contextvars.ContextVar("nnxscale_attention_in_stages", default=False)


@contextlib.contextmanager
def in_pipeline_stages():
    """Attention traced here runs inside a pipeline's ``jax.shard_map`` over its stages
    (:mod:`nnxscale.layers.pipeline`, :mod:`nnxscale.layers.one_f_one_b`), where the Pallas
    kernels (NVIDIA's flash, TPU's splash) cannot run (:func:`resolve`)."""
    token = _IN_STAGES.set(True)
    try:
        yield
    finally:
        _IN_STAGES.reset(token)


class _Switches(NamedTuple):
    """The switches of :func:`attention` that some implementations cannot take
    (``v_head_dim``: the values' width, None for the keys')."""

    window: Optional[int] = None
    softcap: Optional[float] = None
    v_head_dim: Optional[int] = None
    causal: bool = True


def _refusal(impl: str, head_dim: int, switches: _Switches) -> Optional[tuple[str, str]]:
    """Why ``impl`` cannot take ``switches``, and the implementations that can: ``(reason,
    alternatives)``, or None where it can."""
    wide = switches.v_head_dim is not None and switches.v_head_dim != head_dim
    narrow = f"takes values as wide as the keys only (here {switches.v_head_dim}, keys {head_dim})", "xla or blockwise"
    if impl == "cudnn":
        if switches.softcap is not None:  # jax.nn.dot_product_attention has no soft-capping
            return "takes no logit soft-capping here", "pallas-gpu, xla or blockwise"
        if wide:  # jax.nn.dot_product_attention checks that values are as wide as keys
            return narrow
        if switches.window is not None and not switches.causal:  # cuDNN's window is (p - window, p]
            return "takes a sliding window with the causal mask only", "pallas-gpu, xla or blockwise"
    if impl == "pallas-gpu" and wide:  # its tiles are one width
        return narrow
    return None


def resolve(impl: str, q_len: int, dtype, head_dim: int, documents: bool = False, platform: Optional[str] = None,
            pipelined: Optional[bool] = None, *, window: Optional[int] = None, softcap: Optional[float] = None,
            v_head_dim: Optional[int] = None, causal: bool = True) -> str:  # fmt: skip
    """The implementation ``impl`` names for queries of ``q_len`` tokens on ``platform``
    (:func:`platform_of` a mesh; default this process's devices): ``auto`` decided.
    ``documents``: a document mask is in force (segments and per-document positions), which
    the cuDNN path here does not take. ``pipelined``: the layers run in a pipeline's stages
    (default: whether this is traced inside them, :func:`in_pipeline_stages`), where JAX
    (0.10.2, compiling for H100 and TPU v5e targets) refuses a Pallas kernel's output inside
    the stages' ``shard_map`` ("manual_axis_type ... must not be None"): ``auto`` takes XLA's
    attention there (blockwise for long sequences; cuDNN where it applies), and ``splash``
    and ``pallas-gpu`` are refused. ``window``, ``softcap``, ``v_head_dim`` (the values' width)
    and ``causal`` as :func:`attention` takes them: ``auto`` leaves out the kernels that cannot
    take them, and naming one is refused, saying what can."""
    check_impl(impl)
    platform = platform or platform_of()
    pipelined = _IN_STAGES.get() if pipelined is None else pipelined
    if impl in PALLAS and pipelined:
        raise ConfigError(f"--attention {impl} does not run inside a pipeline's stages (JAX refuses a Pallas kernel's "
                          "output inside the stages' shard_map): use --attention auto, xla or blockwise")  # fmt: skip
    if impl == "cudnn" and documents:
        raise ConfigError("--attention cudnn takes plain causal attention here, not --document-mask: use auto or pallas-gpu")
    if impl == "cudnn" and not cudnn_applies(dtype, head_dim, platform):
        raise ConfigError(
            f"--attention cudnn needs an NVIDIA GPU, the cuDNN library (pip install {cudnn_package()}) and float16 or "
            f"bfloat16 (head width a multiple of 8, at most 128); here: {platform}, {jnp.dtype(dtype).name}, head width "
            f"{head_dim}: use --attention auto, xla or blockwise"
        )
    if impl in KERNELS and KERNELS[impl] != platform:
        raise ConfigError(
            f"--attention {impl} runs on {_PLATFORM_NAMES[KERNELS[impl]]}s, and the mesh's devices are {platform}: "
            "use --attention auto, xla or blockwise"
        )
    switches = _Switches(window, softcap, v_head_dim, causal)
    refused = _refusal(impl, head_dim, switches)
    if refused is not None:
        raise ConfigError(f"--attention {impl} {refused[0]}: use --attention {refused[1]}")
    if impl != "auto":
        return impl
    if platform == "tpu" and not pipelined:
        return "splash"  # takes every switch
    cudnn = cudnn_applies(dtype, head_dim, platform) and not documents and _refusal("cudnn", head_dim, switches) is None
    if platform == "nvidia" and cudnn:
        return "cudnn"
    if platform == "nvidia" and not pipelined and _refusal("pallas-gpu", head_dim, switches) is None:
        return "pallas-gpu"
    return "blockwise" if q_len >= AUTO_BLOCKWISE_FROM else "xla"


def describe(impl: str, q_len: int, dtype, head_dim: int, context: int = 1, documents: bool = False,
             platform: Optional[str] = None, pipelined: bool = False, *, window: Optional[int] = None,
             softcap: Optional[float] = None, v_head_dim: Optional[int] = None,
             causal: bool = True) -> str:  # fmt: skip
    """One line for the start of a run and for ``plan``: the implementation in use, and why.
    ``context``: how many ways the sequence is split (then attention is a ring);
    ``documents``: a document mask is in force; ``platform``: :func:`platform_of` the mesh;
    ``pipelined``: the layers run in a pipeline's stages; ``window``, ``softcap``,
    ``v_head_dim``, ``causal``: as :func:`resolve` takes them."""
    platform = platform or platform_of()
    switches = _Switches(window, softcap, v_head_dim, causal)
    masked = (", masked at document boundaries" if documents else "") + _switches_text(switches)
    if context > 1:
        return (f"attention: ring over {context} devices (the context axis), {q_len // context:,} tokens each, "
                f"blockwise tiles of {min(BLOCK, q_len // context)}{masked}")  # fmt: skip
    chosen = resolve(impl, q_len, dtype, head_dim, documents, platform, pipelined, **switches._asdict())
    if impl != "auto":
        return f"attention: {chosen} (--attention {impl}){masked}"
    if chosen == "splash":
        why = "TPU: the Pallas splash attention kernel"
    elif platform == "tpu":  # in a pipeline's stages
        why = (f"TPU, not the Pallas splash attention kernel, which does not run in a pipeline's stages; "
               f"{q_len:,} tokens per sequence, blockwise from {AUTO_BLOCKWISE_FROM:,}")  # fmt: skip
    elif platform == "nvidia":
        why = "NVIDIA GPU, " + jnp.dtype(dtype).name
        not_cudnn = _why_not_cudnn(dtype, head_dim, documents, _refusal("cudnn", head_dim, switches))
        if chosen == "pallas-gpu":
            why += "; the Pallas GPU flash kernel, as " + not_cudnn
        elif chosen != "cudnn":  # in a pipeline's stages, or values the kernel does not take
            kernel = _refusal("pallas-gpu", head_dim, switches)
            kernel_why = "does not run in a pipeline's stages" if kernel is None else kernel[0]
            why += f"; not cuDNN, as {not_cudnn}, nor the Pallas GPU flash kernel, which {kernel_why}"
    else:
        why = f"{q_len:,} tokens per sequence; blockwise from {AUTO_BLOCKWISE_FROM:,}"
    return f"attention: {chosen} (auto: {why}){masked}"


def _switches_text(switches: _Switches) -> str:
    text = "" if switches.window is None else f", sliding window of {switches.window:,} tokens"
    return text + ("" if switches.softcap is None else f", logits soft-capped at {switches.softcap:g}")


def cudnn_package() -> str:
    """The pip package of the cuDNN library for the installed CUDA plugin (13 where none is)."""
    return "nvidia-cudnn-cu12" if installed_extra("gpu") == "cuda12" else "nvidia-cudnn-cu13"


def _why_not_cudnn(dtype, head_dim: int, documents: bool, refused: Optional[tuple[str, str]] = None) -> str:
    if documents:
        return "cuDNN takes no document mask here"
    if jax_private.cudnn_version() is None:
        return f"the cuDNN library is not installed ({cudnn_package()})"
    if refused is not None:
        return "cuDNN " + refused[0]
    return f"cuDNN takes float16 or bfloat16 and head widths up to 128 in multiples of 8 (here {head_dim})"


def attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    q_positions=None,
    k_positions=None,
    q_segments=None,
    k_segments=None,
    impl: str = "auto",
    block: Optional[int] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    scale: Optional[float] = None,
):
    """Scaled dot-product attention of ``q (B, T, N, H)`` over ``k (B, S, K, H)`` and
    ``v (B, S, K, Hv)``; the result is ``(B, T, N, Hv)`` in ``q``'s dtype.

    Positions are ``(T,)`` / ``(S,)`` integers (or ``(B, T)`` / ``(B, S)``); segments are
    ``(B, T)`` / ``(B, S)`` integers. ``block``: tokens per tile of the blockwise kernel
    (default :data:`BLOCK`). ``window``: a query at position ``p`` sees keys at ``p - window <
    k``; ``softcap``: the scaled scores become ``softcap * tanh(scores / softcap)``; ``scale``:
    the softmax scale (default ``1 / sqrt(H)``). ``auto`` is decided for the platform of the
    mesh of the activation rules in force (this process's devices without one).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if N % K:
        raise ValueError(f"{N} query heads do not share {K} key/value heads evenly")
    _check_switches(q, k, v, window, softcap)
    switches = dict(window=window, softcap=softcap, scale=scale)
    plain = q_positions is None and k_positions is None and q_segments is None and k_segments is None
    impl = resolve(impl, T, q.dtype, H, documents=q_segments is not None, platform=platform_here(), window=window,
                   softcap=softcap, v_head_dim=v.shape[-1], causal=causal)  # fmt: skip
    masks = dict(q_positions=q_positions, k_positions=k_positions, q_segments=q_segments, k_segments=k_segments)
    ring = _ring_axis()
    if ring is not None:  # the sequence is split: a ring, whatever the implementation asked for
        axis, mesh = ring
        return ring_attention(q, k, v, axis=axis, mesh=mesh, causal=causal, block=block, **masks, **switches)
    # The Pallas kernels mask by place in the sequence: plain or packed sequences (module docstring).
    in_order = plain or q_segments is not None
    if impl in ("splash", "pallas-gpu") and in_order and (impl == "splash" or T == S):
        kernel = splash_attention if impl == "splash" else gpu_flash_attention
        return per_device(functools.partial(kernel, causal=causal, **switches), q, k, v, q_segments, k_segments)
    if impl in ("blockwise", "splash", "pallas-gpu"):
        return blockwise_attention(q, k, v, causal=causal, block=block, **masks, **switches)
    if impl == "cudnn":
        if not plain:
            raise ConfigError("--attention cudnn takes plain causal attention here (no positions or segments): use blockwise")
        options = _xla_options(window, scale, causal, S)
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn", **options)
    return _xla_attention(q, k, v, causal=causal, plain=plain, masks=masks, **switches)


def _check_switches(q, k, v, window, softcap):
    if k.shape[-1] != q.shape[-1] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"keys {k.shape} and values {v.shape} do not match queries {q.shape}: "
                         "(B, S, K, H) and (B, S, K, Hv)")  # fmt: skip
    if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"window must be a positive number of tokens (static), got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap!r}")


def _xla_options(window, scale, causal: bool, S: int) -> dict:
    """``jax.nn.dot_product_attention``'s keywords for a window and a scale (none without them).
    Its window ``(left, right)`` keeps ``q - left <= k <= q + right``: ``(window - 1, 0)`` is
    causal local attention; without the causal mask nothing limits the right (``S``)."""
    options = {} if scale is None else {"scale": scale}
    if window is not None:
        options["local_window_size"] = (window - 1, 0 if causal else S)
    return options


def _xla_attention(q, k, v, *, causal: bool, plain: bool, masks: dict, window, softcap, scale):
    """``impl="xla"``: ``jax.nn.dot_product_attention`` where it takes the switches, else the
    scores written out (a cap, or values of another width, which it does not take)."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    explicit = softcap is not None or v.shape[-1] != q.shape[-1]
    if plain and not explicit:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, **_xla_options(window, scale, causal, S))
    qp, kp = _positions(masks["q_positions"], T), _positions(masks["k_positions"], S)
    visible = _visible(qp, kp, masks["q_segments"], masks["k_segments"], causal, B, window)
    if not explicit:
        return jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], **_xla_options(None, scale, causal, S))
    return _explicit_attention(q, k, v, visible, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, softcap)


def _explicit_attention(q, k, v, visible, scale: float, softcap: Optional[float]):
    """Attention with the ``(B, K, G, T, S)`` scores materialized (float32), grouped queries
    reading their key/value head without repeating it; ``visible (B, T, S)``."""
    B, T, N, H = q.shape
    K, Hv = k.shape[2], v.shape[-1]
    s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    p = jax.nn.softmax(jnp.where(visible[:, None, None], s, _NEG), axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, Hv).astype(q.dtype)


def _ring_axis():
    """``(axis, mesh)`` when the activation rules in force split the sequence, else None."""
    rules = current_rules()
    if rules is None or rules.length_shard_count <= 1:
        return None
    if len(rules.length_axes) != 1:
        raise ConfigError(f"the sequence is split over {rules.length_axes}: ring attention takes one mesh axis")
    mesh = rules.mesh if isinstance(rules.mesh, Mesh) else jax.sharding.get_abstract_mesh()
    return rules.length_axes[0], mesh


def _positions(p, n: int):
    return jnp.arange(n, dtype=jnp.int32) if p is None else jnp.asarray(p, jnp.int32)


def _visible(qp, kp, qs, ks, causal: bool, batch: int, window: Optional[int] = None):
    """``(B, T, S)`` bool: which keys each query sees."""
    qp = jnp.broadcast_to(qp, (batch,) + qp.shape[-1:])
    kp = jnp.broadcast_to(kp, (batch,) + kp.shape[-1:])
    out = jnp.ones((batch, qp.shape[-1], kp.shape[-1]), bool)
    if causal:
        out = out & (qp[:, :, None] >= kp[:, None, :])
    if window is not None:
        out = out & (qp[:, :, None] - kp[:, None, :] < window)
    if qs is not None:
        out = out & (jnp.asarray(qs)[:, :, None] == jnp.asarray(ks)[:, None, :])
    return out


# --------------------------------------------------------------------------------------
# the blockwise kernel
# --------------------------------------------------------------------------------------


def blockwise_attention(q, k, v, *, causal=True, q_positions=None, k_positions=None, q_segments=None,
                        k_segments=None, block: Optional[int] = None, window: Optional[int] = None,
                        softcap: Optional[float] = None, scale: Optional[float] = None):  # fmt: skip
    """:func:`attention` with ``impl="blockwise"``: scores one ``(block, block)`` tile at a time."""
    masks = _mask_inputs(q, k, q_positions, k_positions, q_segments, k_segments)
    meta, tiles, untile = _tiled(q, k, v, *masks, causal=causal, segmented=q_segments is not None, block=block,
                                 window=window, softcap=softcap, scale=scale)  # fmt: skip
    return untile(_flash(meta, *tiles))


def _mask_inputs(q, k, q_positions, k_positions, q_segments, k_segments):
    """``(qp, kp, qs, ks)``: positions and segments as ``(B, T)`` / ``(B, S)`` int32 arrays."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    qp = jnp.broadcast_to(_positions(q_positions, T), (B, T))
    kp = jnp.broadcast_to(_positions(k_positions, S), (B, S))
    if q_segments is None:
        return qp, kp, jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    return qp, kp, jnp.asarray(q_segments, jnp.int32), jnp.asarray(k_segments, jnp.int32)


def _tiled(q, k, v, qp, kp, qs, ks, *, causal: bool, segmented: bool, block: Optional[int],
           window: Optional[int] = None, softcap: Optional[float] = None, scale: Optional[float] = None):  # fmt: skip
    """The kernel's view of one device's tokens: ``(meta, tiles, untile)``.

    ``tiles`` are ``(qb, kb, vb, qpb, kpb, qsb, ksb)``, the tokens padded to whole tiles of
    ``block`` and split into them (queries grouped by their key/value head); ``untile``
    turns the kernel's ``(B, nq, bq, K, G, Hv)`` result back into ``q``'s shape and dtype.
    Padded keys are never seen (segment -1, which no query has); padded queries are
    computed and dropped.
    """
    block = block or BLOCK
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    bq, bk = min(block, T), min(block, S)
    nq, nk = -(-T // bq), -(-S // bk)
    # Under a window, padded queries take the last real query's position: at position 0 they
    # would make the last query tile reach back to the first key tile.
    qpad = pad_tokens(qp, nq * bq) if window is None else jnp.pad(qp, ((0, 0), (0, nq * bq - T)), mode="edge")
    tiles = (
        pad_tokens(q, nq * bq).reshape(B, nq, bq, K, N // K, H),
        pad_tokens(k, nk * bk).reshape(B, nk, bk, K, H),
        pad_tokens(v, nk * bk).reshape(B, nk, bk, K, Hv),
        qpad.reshape(B, nq, bq),
        pad_tokens(kp, nk * bk).reshape(B, nk, bk),
        pad_tokens(qs, nq * bq).reshape(B, nq, bq),
        pad_tokens(ks, nk * bk, fill=-1).reshape(B, nk, bk),
    )
    meta = _Meta(causal=causal, segmented=segmented or nk * bk > S,
                 scale=1.0 / math.sqrt(H) if scale is None else float(scale),
                 window=None if window is None else int(window),
                 softcap=None if softcap is None else float(softcap))  # fmt: skip
    return meta, tiles, lambda out: out.reshape(B, nq * bq, N, Hv)[:, :T].astype(q.dtype)


class _Meta(NamedTuple):
    """What the kernel's masks and scores are (static: one program per combination)."""

    causal: bool
    segmented: bool  # segments given, or padded keys to hide
    scale: float
    window: Optional[int] = None  # a query at p sees keys at k > p - window
    softcap: Optional[float] = None  # scores become softcap * tanh(scores / softcap)


def _tile_mask(meta: _Meta, qp, kp, qs, ks):
    """``(B, bq, bk)`` bool: which keys of a tile each query sees (None: all)."""
    mask = None
    if meta.causal:
        mask = qp[:, :, None] >= kp[:, None, :]
    if meta.window is not None:
        near = qp[:, :, None] - kp[:, None, :] < meta.window
        mask = near if mask is None else mask & near
    if meta.segmented:
        same = qs[:, :, None] == ks[:, None, :]
        mask = same if mask is None else mask & same
    return mask


def _tile_needed(meta: _Meta, qp, kp, qs, ks):
    """Whether any query of the tile sees any of its keys (a scalar, for lax.cond). Without
    segments, from the tile's extreme positions: exact for tiles of consecutive positions,
    else it may visit a tile that turns out hidden (never skip one that is not)."""
    if meta.segmented:
        return jnp.any(_tile_mask(meta, qp, kp, qs, ks))
    if meta.window is None:
        return jnp.max(qp) >= jnp.min(kp) if meta.causal else jnp.bool_(True)
    near = jnp.min(qp) - jnp.max(kp) < meta.window  # the closest pair is within the window
    return near & (jnp.max(qp) >= jnp.min(kp)) if meta.causal else near


def _scores(meta: _Meta, q, k, qp, kp, qs, ks):
    """One tile's masked scores ``(B, K, G, bq, bk)`` in float32, and with a cap the slope of
    the capped scores against the scaled ones (``1 - tanh^2``, for the backward; else None)."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * meta.scale
    slope = None
    if meta.softcap is not None:
        t = jnp.tanh(s / meta.softcap)
        s, slope = meta.softcap * t, 1.0 - t * t
    mask = _tile_mask(meta, qp, kp, qs, ks)
    if mask is not None:
        s = jnp.where(mask[:, None, None], s, _NEG)
    return s, slope


def _forward(meta: _Meta, qb, kb, vb, qpb, kpb, qsb, ksb):
    # Rematerialized as a whole: inside a differentiated scan (the model's layers), JAX would
    # otherwise split these loops and keep their per-tile values (a T x T mask and scores)
    # as residuals of the parts that depend only on the layer-invariant positions.
    return jax.checkpoint(functools.partial(_forward_body, meta), policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False)(qb, kb, vb, qpb, kpb, qsb, ksb)  # fmt: skip


def _forward_body(meta: _Meta, qb, kb, vb, qpb, kpb, qsb, ksb):
    """``(out (B, nq, bq, K, G, Hv) float32, lse (B, nq, K, G, bq))``."""
    B, nq, bq, K, G, H = qb.shape
    nk, Hv = kb.shape[1], vb.shape[-1]
    masked = meta.causal or meta.segmented or meta.window is not None

    def one_query_block(args):
        q, qp, qs = args  # (B, bq, K, G, H), (B, bq), (B, bq)

        def step(j, carry):
            k, v, kp, ks = kb[:, j], vb[:, j], kpb[:, j], ksb[:, j]

            def visit(carry):
                m, l, acc = carry
                s, _ = _scores(meta, q, k, qp, kp, qs, ks)  # (B, K, G, bq, bk)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.exp(s - m_new[..., None])
                if masked:
                    p = jnp.where(s > _NEG / 2, p, 0.0)  # a row with nothing visible yet adds nothing
                corr = jnp.exp(m - m_new)
                l = l * corr + jnp.sum(p, axis=-1)
                acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p, v.astype(jnp.float32))
                return m_new, l, acc

            return jax.lax.cond(_tile_needed(meta, qp, kp, qs, ks), visit, lambda c: c, carry)

        init = varying_like((
            jnp.full((B, K, G, bq), _NEG, jnp.float32),
            jnp.zeros((B, K, G, bq), jnp.float32),
            jnp.zeros((B, K, G, bq, Hv), jnp.float32),
        ), q, kb)  # fmt: skip
        m, l, acc = jax.lax.fori_loop(0, nk, step, init)
        safe = jnp.where(l > 0, l, 1.0)
        out = acc / safe[..., None]  # (B, K, G, bq, Hv)
        lse = jnp.where(l > 0, m + jnp.log(safe), -jnp.inf)  # -inf: nothing visible (the row's p are all 0)
        return jnp.moveaxis(out, 3, 1), lse  # (B, bq, K, G, Hv), (B, K, G, bq)

    xs = (jnp.moveaxis(qb, 1, 0), jnp.moveaxis(qpb, 1, 0), jnp.moveaxis(qsb, 1, 0))
    out, lse = jax.lax.map(one_query_block, xs)  # leading nq
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(lse, 0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(meta, qb, kb, vb, qpb, kpb, qsb, ksb):
    return _forward(meta, qb, kb, vb, qpb, kpb, qsb, ksb)[0]


def _flash_fwd(meta, qb, kb, vb, qpb, kpb, qsb, ksb):
    out, lse = _forward(meta, qb, kb, vb, qpb, kpb, qsb, ksb)
    return out, (qb, kb, vb, qpb, kpb, qsb, ksb, out, lse)


def _backward(meta: _Meta, qb, kb, vb, qpb, kpb, qsb, ksb, out, lse, d_out):
    """``(dq, dk, dv)`` float32 of one query set against one key/value set, given the
    attention's final ``out`` and ``lse`` (for a ring, those over every key: then each
    set's ``p = exp(s - lse)`` is exactly its share of the softmax)."""
    d_out = d_out.astype(jnp.float32)
    delta = jnp.einsum("bnqkgh,bnqkgh->bnkgq", d_out, out)  # rowsum(dO * O): (B, nq, K, G, bq)
    nq = qb.shape[1]

    def one_key_block(carry, xs):
        dq = carry  # (B, nq, bq, K, G, H) float32
        k, v, kp, ks = xs  # (B, bk, K, H), (B, bk, K, Hv), (B, bk), (B, bk)
        k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

        def step(i, inner):
            q, qp, qs = qb[:, i], qpb[:, i], qsb[:, i]

            def visit(inner):
                dq, dk, dv = inner
                s, slope = _scores(meta, q, k, qp, kp, qs, ks)  # (B, K, G, bq, bk)
                p = jnp.where(s > _NEG / 2, jnp.exp(s - lse[:, i][..., None]), 0.0)
                do = d_out[:, i]  # (B, bq, K, G, Hv)
                dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p, do)
                dp = jnp.einsum("bqkgh,bskh->bkgqs", do, v32)
                ds = p * (dp - delta[:, i][..., None])  # the gradient of the (capped) scores
                if slope is not None:
                    ds = ds * slope  # through softcap * tanh(s / softcap)
                ds = ds * meta.scale
                dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, q.astype(jnp.float32))
                dq_i = jnp.einsum("bkgqs,bskh->bqkgh", ds, k32)
                dq = jax.lax.dynamic_update_index_in_dim(dq, dq[:, i] + dq_i, i, axis=1)
                return dq, dk, dv

            return jax.lax.cond(_tile_needed(meta, qp, kp, qs, ks), visit, lambda c: c, inner)

        zeros = varying_like((jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)), k, qb, d_out)
        dq, dk, dv = jax.lax.fori_loop(0, nq, step, (dq, *zeros))
        return dq, (dk, dv)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (kb, vb, kpb, ksb))
    dq, (dk, dv) = jax.lax.scan(one_key_block, varying_like(jnp.zeros(qb.shape, jnp.float32), qb, kb, d_out), xs)
    return dq, jnp.moveaxis(dk, 0, 1), jnp.moveaxis(dv, 0, 1)


def _no_grad(x):
    return np.zeros(x.shape, jax.dtypes.float0)  # integer inputs (positions, segments) have no gradient


def _flash_bwd(meta, res, d_out):
    qb, kb, vb, qpb, kpb, qsb, ksb, out, lse = res
    dq, dk, dv = _backward(meta, qb, kb, vb, qpb, kpb, qsb, ksb, out, lse, d_out)
    ints = tuple(_no_grad(x) for x in (qpb, kpb, qsb, ksb))
    return (dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), *ints)


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------------------
# ring attention: the sequence split over a mesh axis
# --------------------------------------------------------------------------------------


def _shift(tree, axis: str, n: int, by: int = 1):
    """Every device's ``tree`` to the device ``by`` further along ``axis`` (round the ring)."""
    return jax.lax.ppermute(tree, axis, [(i, (i + by) % n) for i in range(n)])


def _merge(out, lse, o, l):
    """Two partial attentions of the same queries over disjoint keys, as one (online softmax)."""
    new = jnp.logaddexp(lse, l)
    finite = jnp.isfinite(new)
    wa = jnp.where(finite, jnp.exp(lse - new), 0.0)
    wb = jnp.where(finite, jnp.exp(l - new), 0.0)
    to_out = lambda w: jnp.moveaxis(w, -1, 2)[..., None]  # noqa: E731  (B, nq, K, G, bq) -> (B, nq, bq, K, G, 1)
    return out * to_out(wa) + o * to_out(wb), new


def _ring_forward(meta, axis, n, hops, qb, kb, vb, qpb, kpb, qsb, ksb):
    """Each device keeps its queries; the key/value blocks go round the ring (``hops - 1``
    shifts: ``n - 1``, or fewer where a window hides the blocks further back), and each
    visit's partial attention joins the running one by its log-sum-exp."""
    kv = (kb, vb, kpb, ksb)
    out, lse = _forward(meta, qb, kb, vb, qpb, kpb, qsb, ksb)
    for _ in range(hops - 1):
        kv = _shift(kv, axis, n)
        o, l = _forward(meta, qb, kv[0], kv[1], qpb, kv[2], qsb, kv[3])
        out, lse = _merge(out, lse, o, l)
    return out, lse


def _ring_backward(meta, axis, n, hops, qb, kb, vb, qpb, kpb, qsb, ksb, out, lse, d_out):
    """The blocks go round again; each one's key/value gradient travels with it and is home
    after the n-th shift (after ``hops`` visits, the rest of the way in one).
    ``(dq, dk, dv)`` float32, in tiles."""
    kv = (kb, vb, kpb, ksb)
    dq = varying_like(jnp.zeros(qb.shape, jnp.float32), qb, d_out)
    dkv = varying_like((jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32)), kb, d_out)
    for i in range(hops):
        dq_i, dk_i, dv_i = _backward(meta, qb, kv[0], kv[1], qpb, kv[2], qsb, kv[3], out, lse, d_out)
        dq = dq + dq_i
        dkv = (dkv[0] + dk_i, dkv[1] + dv_i)
        if i < hops - 1:
            kv = _shift(kv, axis, n)
        dkv = _shift(dkv, axis, n)
    if hops < n:
        dkv = _shift(dkv, axis, n, by=n - hops)
    return dq, dkv[0], dkv[1]


def ring_hops(n: int, tokens: int, causal: bool, window: Optional[int], in_order: bool) -> int:
    """How many of the ``n`` key/value blocks each device visits: all, or under a causal
    window over a sequence in order (``tokens`` per device), its own and the
    ``ceil((window - 1) / tokens)`` before it (the block ``h`` back is ``(h - 1) * tokens + 1``
    positions from the nearest query at the least). A zigzag layout (positions given) goes
    round the whole ring, and its tiles outside the window are skipped one by one."""
    if window is None or not causal or not in_order:
        return n
    return min(n, 2 + (window - 2) // tokens)


class _Ring(NamedTuple):
    """What a ring's programs depend on besides their operands (static)."""

    axis: str
    n: int
    mesh: object
    causal: bool
    segmented: bool
    block: Optional[int]
    window: Optional[int] = None
    softcap: Optional[float] = None
    scale: Optional[float] = None
    hops: Optional[int] = None  # None: n

    def tiled(self, q, k, v, qp, kp, qs, ks):
        return _tiled(q, k, v, qp, kp, qs, ks, causal=self.causal, segmented=self.segmented, block=self.block,
                      window=self.window, softcap=self.softcap, scale=self.scale)  # fmt: skip

    def visits(self) -> int:
        return self.n if self.hops is None else self.hops

    def map(self, local, operands: int, results: int):
        """``local`` over this device's ``T / n`` tokens of every operand and result (axis 1)."""
        tokens = P(None, self.axis)
        return jax.shard_map(local, mesh=context_mesh(self.mesh), in_specs=(tokens,) * operands,
                             out_specs=(tokens,) * results, axis_names=frozenset({self.axis}), check_vma=False)  # fmt: skip


# The gradient is defined around the shard_map, not inside it: then JAX never has to choose
# how to hold the ring's residuals between two shard_maps, which it could not do for a ring
# nested in a pipeline stage's shard_map (Shardy rejected the residuals' layout, "manual axis
# context after free axis stage", jax 0.10). The residuals are the operands and the result
# in tiles, each device's T / n tokens of them.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, qp, kp, qs, ks):
    return _ring_fwd(ring, q, k, v, qp, kp, qs, ks)[0]


def _ring_fwd(ring: _Ring, q, k, v, qp, kp, qs, ks):
    def local(q, k, v, qp, kp, qs, ks):
        meta, tiles, untile = ring.tiled(q, k, v, qp, kp, qs, ks)
        out, lse = _ring_forward(meta, ring.axis, ring.n, ring.visits(), *tiles)
        return untile(out), out, lse

    y, out, lse = ring.map(local, 7, 3)(q, k, v, qp, kp, qs, ks)
    # The result varies over what the operands vary over (an enclosing pipeline stage's
    # manual axes): left invariant, its gradient would be summed over those axes.
    return varying_like(y, q, k, v), (q, k, v, qp, kp, qs, ks, out, lse)


def _ring_bwd(ring: _Ring, res, dy):
    q, k, v, qp, kp, qs, ks, out, lse = res

    def local(q, k, v, qp, kp, qs, ks, out, lse, dy):
        meta, tiles, _ = ring.tiled(q, k, v, qp, kp, qs, ks)
        (B, nq, bq, K, G, H), (nk, bk), Hv = tiles[0].shape, tiles[1].shape[1:3], v.shape[-1]
        d_out = pad_tokens(dy, nq * bq).reshape(B, nq, bq, K, G, Hv)
        dq, dk, dv = _ring_backward(meta, ring.axis, ring.n, ring.visits(), *tiles, out, lse, d_out)
        T, S = q.shape[1], k.shape[1]
        return (dq.reshape(B, nq * bq, K * G, H)[:, :T].astype(q.dtype),
                dk.reshape(B, nk * bk, K, H)[:, :S].astype(k.dtype),
                dv.reshape(B, nk * bk, K, Hv)[:, :S].astype(v.dtype))  # fmt: skip

    dq, dk, dv = ring.map(local, 10, 3)(q, k, v, qp, kp, qs, ks, out, lse, dy)
    dq, dk, dv = varying_like(dq, q), varying_like(dk, k), varying_like(dv, v)  # the operands' types
    return (dq, dk, dv, *(_no_grad(x) for x in (qp, kp, qs, ks)))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, *, axis: str, mesh, causal=True, q_positions=None, k_positions=None, q_segments=None,
                   k_segments=None, block: Optional[int] = None, window: Optional[int] = None,
                   softcap: Optional[float] = None, scale: Optional[float] = None):  # fmt: skip
    """:func:`attention` with the sequence split over the mesh axis ``axis`` (length ``T``:
    each device holds ``T / n`` of the queries, keys and values).

    ``jax.shard_map`` over ``axis`` alone (the other axes stay with the compiler, or with an
    enclosing shard_map such as a pipeline stage's): each device keeps its queries and passes
    its key/value block to the next with ``ppermute``, ``n`` visits in all, so no device ever
    holds more than two blocks of keys and values. Give the tokens' ``positions`` when the
    sequence is stored out of order (a zigzag layout, which gives every device the same share
    of causal work); tiles the masks hide are skipped. Under a causal ``window`` over a
    sequence in order, the blocks the window cannot reach are not even sent (:func:`ring_hops`).
    """
    T, S = q.shape[1], k.shape[1]
    n = mesh.shape[axis]
    if T % n or S % n:
        raise ValueError(f"the mesh axis {axis}={n} does not divide the sequence of {T} tokens")
    masks = _mask_inputs(q, k, q_positions, k_positions, q_segments, k_segments)
    hops = ring_hops(n, T // n, causal, window, q_positions is None and k_positions is None and T == S)
    ring = _Ring(axis, n, mesh, causal, q_segments is not None, block, window, softcap, scale,
                 None if hops == n else hops)  # fmt: skip
    return _ring(ring, q, k, v, *masks)


def zigzag(length: int, n: int) -> np.ndarray:
    """The head-tail order of ``length`` positions over ``n`` devices: the sequence cut into
    ``2n`` chunks, device ``i`` holding chunks ``i`` and ``2n - 1 - i``, so under a causal
    mask every device has the same work. ``x[:, zigzag(T, n)]`` lays a sequence out so."""
    if length % (2 * n):
        return np.arange(length)  # too short to balance: in order (correct, less even)
    chunks = np.arange(length).reshape(2 * n, length // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])
