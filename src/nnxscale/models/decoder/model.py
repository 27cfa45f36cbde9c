"""The decoder: every supported architecture is this module with a :class:`DecoderConfig`.

The layers are stacked and scanned (:func:`nnxscale.stack_layers`): one stack ``layers``
when every layer is alike (Llama, Mixtral, Qwen, Mistral), else the stacks of
:meth:`DecoderConfig.segments` run in order: DeepSeek's dense ``first_layers`` before its
mixture ``layers``; Gemma's repeating pattern of sliding and global layers stacked as groups
(:class:`~nnxscale.models.decoder.layers.LayerGroup`), what is left of the last group in
``last_layers``. Each stack compiles one body, whatever the depth. A pipeline's stages split
``layers`` (their number must divide its groups); ``first_layers`` and ``last_layers`` run
whole on every stage, before and after it (MaxText runs DeepSeek's dense layers outside its
pipeline alike).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscale.errors import ModelError
from nnxscale.layers import kv_cache, lora
from nnxscale.layers.loss import capped
from nnxscale.layers.stack import Rows, scan_layers, stack_layers
from nnxscale.models.common.documents import layer_args
from nnxscale.models.common.dropout import dropout, dropout_keys
from nnxscale.models.decoder.config import DecoderConfig, Segment
from nnxscale.models.decoder.layers import DecoderLayer, LayerGroup, rms_norm
from nnxscale.models.decoder.rope import rope_tables
from nnxscale.sharding.activations import constrain
from nnxscale.sharding.rules import logical

_normal = nnx.initializers.normal(0.02)  # HF's initializer_range for every weight matrix


def _segment_layer(c: DecoderConfig, seg: Segment, kw: dict):
    if len(seg.kinds) == 1:
        return lambda rngs: DecoderLayer(c, seg.kinds[0], **(kw | {"rngs": rngs}))
    return lambda rngs: LayerGroup(c, seg.kinds, **(kw | {"rngs": rngs}))


class Decoder(nnx.Module):
    """A decoder-only language model; the output head is the token embedding when
    ``config.tie_word_embeddings``, else its own ``lm_head``.

    The state is parameters only (no RNG state): dropout randomness comes from the
    ``rngs`` argument of each call.
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), rngs=rngs)
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, embedding_init=logical(_normal, "vocab", "embed"), **kw)
        for seg in c.segments():
            # A pipeline splits the main stack; the others run whole on every stage.
            stack = stack_layers(_segment_layer(c, seg, kw), seg.groups, rngs=rngs, pipelined=seg.name == "layers")
            setattr(self, seg.name, stack)
        self.norm = rms_norm(c.hidden_size, c.rms_norm_eps, offset=c.norm_offset, **kw)
        if not c.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                c.hidden_size, c.vocab_size, use_bias=False, kernel_init=logical(_normal, "embed", "vocab"), **kw
            )  # fmt: skip

    @property
    def routed(self) -> bool:
        """Whether a layer routes tokens to experts (and returns its statistics)."""
        return self.config.routed

    def __call__(self, tokens, *, rngs: Optional[nnx.Rngs] = None):
        """``tokens`` int (B, T) -> float32 logits (B, T, vocab_size).

        Dropout (embeddings and residual branches) is applied only when ``rngs`` is given
        and ``config.dropout > 0``; its key comes from the ``dropout`` stream (or ``default``).
        """
        return self.logits(self.hidden_states(tokens, rngs=rngs))

    def rope_tables(self, positions) -> tuple:
        """``(cos, sin, cos of the sliding layers, sin of the sliding layers)``, each
        ``([B,] T, rotary width)`` float32, for ``positions`` ``([B,] T)``."""
        c = self.config
        full = rope_tables(positions, c.rope_dim, c.rope_theta, c.rope_scaling)
        if c.local_rope_theta is None:
            return (*full, *full)
        return (*full, *rope_tables(positions, c.rope_dim, *c.local_rope()))

    def embed(self, tokens):
        x = self.embed_tokens(tokens)
        if self.config.embedding_scale:  # Gemma: times sqrt(hidden), rounded to the compute dtype as HF's
            x = x * jnp.asarray(np.sqrt(self.config.hidden_size), x.dtype)
        return constrain(x, "batch", "length", "embed")

    def hidden_states(self, tokens, *, rngs: Optional[nnx.Rngs] = None, positions=None, segments=None, cache=None,
                      with_stats: bool = False):  # fmt: skip
        """``tokens`` int (B, T) -> the final norm's output (B, T, hidden_size), before the head.

        ``positions`` (T,) or (B, T) ints: each token's place in its sequence, for RoPE and
        the causal mask (default ``0..T-1``): given when ``tokens`` are stored out of order
        (a zigzag layout over a ``context`` axis) or hold several documents, each starting at 0.
        ``segments`` (B, T) ints: document ids; a token attends only within its document.
        ``cache``: decoding (no dropout): a cache from :meth:`init_cache`, ``positions``
        ``(B, T)`` contiguous in each row; returns ``(hidden states, updated cache)``.
        ``with_stats`` (a routed model): returns ``(hidden states, router statistics of every
        routed layer)`` (:class:`nnxscale.layers.moe.RouterStats`, each field with a leading layers axis).
        """
        c = self.config
        T = tokens.shape[1]
        if T > c.max_position_embeddings:
            raise ModelError(f"sequence length {T} exceeds the context max_position_embeddings={c.max_position_embeddings}")
        tables = self.rope_tables(jnp.arange(T) if positions is None else positions)
        if cache is not None:
            x, new = self.embed(tokens), {}
            one = self._one_stack()
            for seg in c.segments():
                part = cache if one else cache[seg.name]
                x, new[seg.name] = scan_layers(getattr(self, seg.name), x, *tables, positions, cache=part)
            return self.norm(x), (new["layers"] if one else new)
        embed_key, layer_keys = dropout_keys(rngs, max(c.dropout, lora.dropout_rate(self)), c.num_hidden_layers)
        x = dropout(self.embed(tokens), c.dropout, embed_key)  # (B, T, C)
        if positions is not None and jnp.ndim(positions) == 2:  # per row: split with the batch in a pipeline
            tables = tuple(Rows(t) for t in tables)
        args = (*tables, *layer_args(positions, segments))
        stats = []
        for seg in c.segments():
            keys = None if layer_keys is None else layer_keys[seg.start : seg.start + seg.layers : len(seg.kinds)]
            routed = any(k.moe for k in seg.kinds)
            x = scan_layers(getattr(self, seg.name), x, *args, keys=keys, remat=c.remat, aux=routed)
            if routed:
                x, s = x
                stats.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), s) if len(seg.kinds) > 1 else s)
        if not self.routed or not with_stats:
            return self.norm(x)
        return self.norm(x), jax.tree.map(lambda *a: jnp.concatenate(a), *stats)

    def init_cache(self, batch: int, length: int, *, prefill: int = 0) -> dict:
        """An empty decoding cache for ``batch`` rows of up to ``length`` positions (at most
        ``max_position_embeddings``), laid out by the activation rules in force: per stack,
        and per member of a group; a sliding layer's holds its window, or ``prefill`` slots
        when more: right-padded prompts prefilled together write ``prefill`` positions at
        once, and a ring of fewer slots would overwrite a short row's tokens with padding."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        heads = c.num_key_value_heads

        def one(n, kind):
            window = None if kind.window is None else max(kind.window, int(prefill))
            return kv_cache.empty(n, batch, length, heads, c.head_size, dtype, heads_name="kv_heads" if not c.latent else "heads",
                                  window=window, v_head_dim=c.value_size)  # fmt: skip

        if self._one_stack():  # every layer alike: the stack's cache itself, {"k", "v"}
            return one(c.num_hidden_layers, c.segments()[0].kinds[0])
        out = {}
        for seg in c.segments():
            if len(seg.kinds) == 1:
                out[seg.name] = one(seg.groups, seg.kinds[0])
            else:
                out[seg.name] = {f"layer_{j}": one(seg.groups, kind) for j, kind in enumerate(seg.kinds)}
        return out

    def _one_stack(self) -> bool:
        segments = self.config.segments()
        return len(segments) == 1 and len(segments[0].kinds) == 1

    def head(self):
        """The output head's weight (hidden_size, vocab_size), in the parameters' dtype: the
        token embedding's transpose when tied, else ``lm_head``'s kernel."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, x):
        """The output head: (B, T, hidden_size) -> float32 logits (B, T, vocab_size), soft-capped
        when ``final_logit_softcapping`` is set (Gemma 2)."""
        logits = jnp.einsum("btc,cv->btv", x, self.head().astype(x.dtype), preferred_element_type=jnp.float32)
        return constrain(capped(logits, self.config.final_logit_softcapping), "batch", "length", "vocab")  # (B, T, V)
