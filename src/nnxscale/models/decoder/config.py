"""The decoder's config: one frozen dataclass whose fields are the switches every supported
architecture sets (Llama, Mixtral, Mistral, Qwen2/3, Qwen3-MoE, Gemma 2/3, DeepSeek-V2/V3),
named as Hugging Face names them where one name serves, and the layer pattern they make.

A family is a translation of its ``config.json`` into these fields (``nnxscale.models.<family>``),
its Hugging Face names and its presets: the network is this decoder.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Union

from nnxscale.errors import ModelError
from nnxscale.models.common.model_config import ModelConfig
from nnxscale.models.decoder.rope import LinearScaling, RopeScaling, YarnScaling, parse_rope_scaling

FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SCORINGS = ("softmax", "sigmoid")


class LayerKind(NamedTuple):
    """What distinguishes one layer from another: a sliding window (its width, or None) and a
    mixture of experts (or a dense MLP) after the attention."""

    window: Optional[int]
    moe: bool


class Segment(NamedTuple):
    """Consecutive layers stacked and scanned together: ``groups`` repeats of the layer
    kinds ``kinds`` (one compiled body, of ``len(kinds)`` layers), the first at ``start``."""

    name: str
    start: int
    groups: int
    kinds: tuple[LayerKind, ...]

    @property
    def layers(self) -> int:
        return self.groups * len(self.kinds)


@dataclasses.dataclass(frozen=True)
class DecoderConfig(ModelConfig):
    """A decoder-only transformer's hyperparameters (the defaults are Llama's).

    Attention: ``num_attention_heads`` query heads over ``num_key_value_heads`` K/V heads of
    width ``head_dim`` (default ``hidden_size // num_attention_heads``); ``qkv_bias`` /
    ``o_bias`` (Qwen2: q, k, v); ``qk_norm``: RMSNorm of each query and key head before the
    rotation (Qwen3, Gemma 3); ``sliding_window`` with ``layer_types`` (one of
    ``full_attention``/``sliding_attention`` per layer; None: every layer sliding when a
    window is set, else full); ``attn_logit_softcapping`` (Gemma 2);
    ``query_pre_attn_scalar``: the softmax scale is its inverse square root (Gemma).

    Rotary embeddings: ``rope_theta`` and ``rope_scaling`` (a scaling of
    :mod:`nnxscale.models.decoder.rope`); the sliding layers use ``local_rope_theta`` and
    ``local_rope_scaling`` when ``local_rope_theta`` is set (Gemma 3), else the same.

    Norms and embeddings (Gemma): ``norm_offset``: RMSNorm scales by ``1 + w``;
    ``sandwich_norms``: norms after the attention and the MLP as well as before;
    ``embedding_scale``: the embedding multiplied by ``sqrt(hidden_size)``; ``hidden_act``;
    ``final_logit_softcapping``.

    Mixture of experts (``num_local_experts`` > 0): ``num_experts_per_tok`` of them per token,
    each ``moe_intermediate_size`` wide (default ``intermediate_size``); the layers in
    ``dense_layers`` keep a dense MLP of ``intermediate_size``. Router: ``router_scoring``
    (softmax, or DeepSeek-V3's sigmoid), ``norm_topk_prob``, ``n_group``/``topk_group``
    (group-limited top-k, a group scored by its best ``router_group_top`` experts: 2 in
    DeepSeek-V3, 1 in V2), ``routed_scaling_factor``, ``router_score_bias``
    (``e_score_correction_bias``); ``n_shared_experts`` always-on experts. The router's
    load-balancing loss (``router_aux_loss_coef``) and z-loss (``router_z_loss_coef``) join
    the objective; ``capacity_factor`` drops assignments past an expert's capacity
    (None: dropless).

    Multi-head latent attention (DeepSeek, ``kv_lora_rank`` set): queries through a rank
    ``q_lora_rank`` bottleneck (None: one projection), keys and values from a
    ``kv_lora_rank`` latent; each head ``qk_nope_head_dim`` wide without rotation and
    ``qk_rope_head_dim`` with (one rotated key part shared by every head), values
    ``v_head_dim`` wide; ``rope_interleave``: the rotated pairs are adjacent dimensions.

    Run options: ``dtype`` (compute), ``param_dtype`` (storage), ``dropout``, ``remat``,
    ``attention`` (as every family's).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Optional[Union[RopeScaling, LinearScaling, YarnScaling]] = None
    tie_word_embeddings: bool = False
    dropout: float = 0.0
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"
    # attention switches
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple[str, ...]] = None
    local_rope_theta: Optional[float] = None
    local_rope_scaling: Optional[Union[RopeScaling, LinearScaling, YarnScaling]] = None
    attn_logit_softcapping: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    # norms, embeddings, MLP, head
    norm_offset: bool = False
    sandwich_norms: bool = False
    embedding_scale: bool = False
    hidden_act: str = "silu"
    final_logit_softcapping: Optional[float] = None
    # mixture of experts
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: Optional[int] = None
    dense_layers: tuple[int, ...] = ()
    router_scoring: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_score_bias: bool = False
    router_group_top: int = 2
    n_shared_experts: int = 0
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    capacity_factor: Optional[float] = None
    # multi-head latent attention
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False

    def __post_init__(self):
        name = type(self).__name__
        self._check_training_fields()
        for field in ("rope_scaling", "local_rope_scaling"):
            object.__setattr__(self, field, parse_rope_scaling(getattr(self, field), f"{name}.{field}"))
        for field in ("layer_types", "dense_layers"):  # JSON records lists
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings") + (("head_dim",) if self.head_dim is not None else ())  # fmt: skip
        self._check_positive_ints(sizes)
        N, K = self.num_attention_heads, self.num_key_value_heads
        if N % K:
            raise ModelError(
                f"{name}.num_attention_heads={N} is not a multiple of num_key_value_heads={K}: "
                "every K/V head serves the same number of query heads"
            )
        if self.head_dim is None and self.hidden_size % N and not self.latent:
            raise ModelError(
                f"{name}.hidden_size={self.hidden_size} is not divisible by num_attention_heads={N}: "
                "set head_dim, or make every head hidden_size // num_attention_heads wide"
            )
        if self.rope_dim % 2:
            raise ModelError(f"{name} head width {self.rope_dim} is odd: rotary embeddings turn pairs of dimensions")
        for field in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ModelError(f"{name}.{field} must be a positive number, got {value!r}")
        for field in ("tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm", "norm_offset", "sandwich_norms",
                      "embedding_scale", "norm_topk_prob", "router_score_bias", "rope_interleave"):  # fmt: skip
            if not isinstance(getattr(self, field), bool):
                raise ModelError(f"{name}.{field} must be True or False, got {getattr(self, field)!r}")
        for field in ("local_rope_theta", "attn_logit_softcapping", "query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ModelError(f"{name}.{field} must be a positive number or None, got {value!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelError(f"{name}.hidden_act={self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        self._check_attention_pattern(name)
        self._check_experts(name)
        self._check_latent(name)

    def _check_attention_pattern(self, name: str) -> None:
        w = self.sliding_window
        if w is not None:
            self._check_positive_ints(("sliding_window",))
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelError(f"{name}.layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            raise ModelError(f"{name}.layer_types holds {unknown}: each layer is {FULL!r} or {SLIDING!r}")
        if SLIDING in self.layer_types and w is None:
            raise ModelError(f"{name}.layer_types has sliding layers but sliding_window is not set")

    def _check_experts(self, name: str) -> None:
        E = self.num_local_experts
        if isinstance(E, bool) or not isinstance(E, int) or E < 0:
            raise ModelError(f"{name}.num_local_experts must be 0 (dense) or a positive integer, got {E!r}")
        if not E:
            return
        self._check_positive_ints(("num_experts_per_tok", "n_group", "topk_group"))
        if self.num_experts_per_tok > E:
            raise ModelError(
                f"{name}.num_experts_per_tok={self.num_experts_per_tok} is larger than "
                f"num_local_experts={E}: a token cannot pick more experts than there are"
            )
        if self.moe_intermediate_size is not None:
            self._check_positive_ints(("moe_intermediate_size",))
        if self.router_scoring not in SCORINGS:
            raise ModelError(f"{name}.router_scoring must be one of {SCORINGS}, got {self.router_scoring!r}")
        if E % self.n_group or self.topk_group > self.n_group:
            raise ModelError(f"{name}: {E} experts in n_group={self.n_group} groups with topk_group={self.topk_group}: "
                             "the groups must split the experts evenly and topk_group be at most n_group")  # fmt: skip
        if bad := [i for i in self.dense_layers if not (isinstance(i, int) and 0 <= i < self.num_hidden_layers)]:
            raise ModelError(f"{name}.dense_layers names layers {bad} outside 0..{self.num_hidden_layers - 1}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ModelError(f"{name}.capacity_factor must be a positive number (or None: dropless), got {cf!r}")
        for field in ("router_aux_loss_coef", "router_z_loss_coef", "n_shared_experts"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ModelError(f"{name}.{field} must be a non-negative number, got {value!r}")

    def _check_latent(self, name: str) -> None:
        if not self.latent:
            return
        self._check_positive_ints(("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        if self.q_lora_rank is not None:
            self._check_positive_ints(("q_lora_rank",))
        if self.num_key_value_heads != self.num_attention_heads:
            raise ModelError(f"{name}: latent attention gives every query head its own keys and values: "
                             f"num_key_value_heads must equal num_attention_heads ({self.num_attention_heads})")  # fmt: skip
        if self.qk_norm or self.attn_logit_softcapping:
            raise ModelError(f"{name}: latent attention takes no qk_norm or attn_logit_softcapping")

    # ---- derived -------------------------------------------------------------------------

    @property
    def latent(self) -> bool:
        """Whether the attention is DeepSeek's multi-head latent attention."""
        return self.kv_lora_rank is not None

    @property
    def head_size(self) -> int:
        """The width of one query/key head: ``head_dim``, ``hidden_size // num_attention_heads``,
        or with latent attention ``qk_nope_head_dim + qk_rope_head_dim``."""
        if self.latent:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def value_size(self) -> int:
        """The width of one value head."""
        return self.v_head_dim if self.latent else self.head_size

    @property
    def rope_dim(self) -> int:
        """How many dimensions of each query/key head rotate."""
        return self.qk_rope_head_dim if self.latent else self.head_size

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def routed(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return self.num_local_experts > 0 and len(set(self.dense_layers)) < self.num_hidden_layers

    def attention_types(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return self.layer_types
        return ((SLIDING if self.sliding_window is not None else FULL),) * self.num_hidden_layers

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's :class:`LayerKind`. A window no shorter than the context is no window."""
        dense = set(self.dense_layers)
        w = self.sliding_window if self.sliding_window and self.sliding_window < self.max_position_embeddings else None
        return tuple(LayerKind(w if t == SLIDING else None, self.num_local_experts > 0 and i not in dense)
                     for i, t in enumerate(self.attention_types()))  # fmt: skip

    def segments(self) -> tuple[Segment, ...]:
        """The layers as stacks: see :func:`layer_segments`."""
        return layer_segments(self.layer_kinds())

    def local_rope(self):
        """``(theta, scaling)`` of the sliding layers."""
        if self.local_rope_theta is None:
            return self.rope_theta, self.rope_scaling
        return self.local_rope_theta, self.local_rope_scaling

    # ---- counting ------------------------------------------------------------------------

    def _attention_params(self) -> int:
        C, N, K, H, Hv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_size, self.value_size
        if self.latent:
            r, q = self.kv_lora_rank, self.q_lora_rank
            queries = C * N * H if q is None else C * q + q + q * N * H  # q_a_proj, its norm, q_b_proj
            latent = C * (r + self.qk_rope_head_dim) + r + r * N * (self.qk_nope_head_dim + Hv)
            return queries + latent + N * Hv * C + (C if self.o_bias else 0)
        total = C * N * H + 2 * C * K * H + N * H * C
        total += (N * H + 2 * K * H) if self.qkv_bias else 0
        total += C if self.o_bias else 0
        return total + (2 * H if self.qk_norm else 0)

    def _layer_params(self, moe: bool, experts: Optional[int] = None) -> int:
        C = self.hidden_size
        norms = (4 if self.sandwich_norms else 2) * C
        if not moe:
            return self._attention_params() + 3 * C * self.intermediate_size + norms
        E = self.num_local_experts if experts is None else experts
        F = self.expert_size
        mixture = C * self.num_local_experts + E * 3 * C * F + 3 * C * F * self.n_shared_experts
        # DeepSeek's correction bias is not counted: a buffer in the reference, never trained by gradients
        return self._attention_params() + mixture + norms

    def _count(self, experts: Optional[int]) -> int:
        V, C = self.vocab_size, self.hidden_size
        heads = V * C * (1 if self.tie_word_embeddings else 2)
        layers = sum(self._layer_params(kind.moe, experts) for kind in self.layer_kinds())
        return heads + layers + C

    def num_params(self) -> int:
        """Exact parameter count from the shapes; a tied output head counts once."""
        return self._count(None)

    def active_params(self) -> int:
        """Parameters one token uses: the experts it is not routed to left out."""
        return self._count(self.num_experts_per_tok if self.num_local_experts else None)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at context ``seq_len``: ``6*N + 6*L*n_heads*(qk + v)*seq_len``.

        ``N`` counts the active parameters that multiply activations (the input embedding
        left out when the head is untied; tied, the matrix counts once, as the output head).
        The second term is the attention's scores and weighted values over the query heads
        (``12*L*n_heads*head_dim*seq_len`` when values are as wide as keys), without halving
        for the causal mask; a sliding layer sees at most its window.
        """
        n = self.active_params() - (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)
        width = self.head_size + self.value_size
        seen = sum(min(int(seq_len), kind.window or int(seq_len)) for kind in self.layer_kinds())
        return 6 * n + 6 * self.num_attention_heads * width * seen


def layer_segments(kinds: tuple[LayerKind, ...]) -> tuple[Segment, ...]:
    """Layers of ``kinds`` as few stacks as compile the fewest layer bodies: an optional
    uniform first stack (DeepSeek's dense layers), then the rest as repeats of its shortest
    repeating group (Gemma 3's five sliding layers and one global), then what is left of a
    last incomplete group. One kind throughout is one stack ``layers``, as Llama's."""
    best = None
    L = len(kinds)
    for p in range(L):
        if len(set(kinds[:p])) > 1:
            break
        rest = kinds[p:]
        for g in range(1, len(rest) + 1):
            pattern = rest[:g]
            if all(rest[i] == pattern[i % g] for i in range(len(rest))):
                break
        n, r = divmod(len(rest), g)
        tail = pattern[:r]
        cost = (1 if p else 0) + g + (0 if not r else 1 if len(set(tail)) == 1 else r)
        if best is None or cost < best[0]:
            best = (cost, p, g, n, r)
    _, p, g, n, r = best
    out = []
    if p:
        out.append(Segment("first_layers", 0, p, kinds[:1]))
    out.append(Segment("layers", p, n, kinds[p : p + g]))
    if r:
        tail = kinds[p + n * g :]
        start = p + n * g
        out.append(Segment("last_layers", start, r, tail[:1]) if len(set(tail)) == 1 else Segment("last_layers", start, 1, tail))
    return tuple(out)
