"""Model families: what the trainer, ``init``, ``plan`` and ``sample`` know about a model.

Models are written for one device, annotated with logical axis names only
(``nnxscale.models.gpt2``). A *family* describes one of them to the rest of nnxscale in one
small explicit record, :class:`ModelFamily` (torchtitan's ``ModelSpec``): how to build a
module from a config, its presets, its loss, its FLOPs per token, its Hugging Face import
and export, the run options it takes and the dimensions the planner needs. The trainer
names no model: it asks the family.

Families live in the plain dict :data:`FAMILIES`. ``--model NAME`` finds the preset ``NAME``
in whichever family has it (:func:`find_preset`); ``--init-from DIR`` finds the family of a
Hugging Face directory by the ``model_type`` of its ``config.json`` (:func:`pretrained_family`).

A model of your own needs no family: ``nnxscale.train(cfg, model=factory)`` trains it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

import jax.numpy as jnp
import optax

from nnxscale.errors import ModelError
from nnxscale.layers.loss import chunked_cross_entropy, context_order
from nnxscale.models import deepseek, gemma, gpt2, llama, mistral, mixtral, qwen
from nnxscale.models.decoder import Decoder, hf_param_of
from nnxscale.models.common.documents import IGNORED, document_layout, trained_weights


def next_token_loss(model, inputs, targets, *, rngs=None):
    """Mean next-token cross-entropy: the default loss of every family and of your own module.

    ``model(inputs)`` maps ``(B, T)`` int tokens to ``(B, T, V)`` logits; ``targets`` are the
    ``(B, T)`` next tokens. In a training step ``rngs`` (``nnx.Rngs(dropout=key)``, a new
    key every step) is passed on as ``model(inputs, rngs=rngs)`` when the model's
    ``__call__`` takes an ``rngs`` argument (for dropout); evaluation passes ``None``.

    A loss of your own has this signature and returns a scalar; it may call the model any
    way it likes.
    """
    if rngs is not None and "rngs" in inspect.signature(model.__call__).parameters:
        logits = model(inputs, rngs=rngs)
    else:
        logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def chunked_next_token_loss(model, inputs, targets, *, rngs=None, separator: Optional[int] = None,
                            ignored_targets: bool = False):  # fmt: skip
    """GPT-2's and Llama's loss: :func:`next_token_loss` without ever holding every logit.

    The model's ``hidden_states`` go through its ``head()`` weight a slice of the vocabulary
    at a time (:func:`nnxscale.layers.loss.chunked_cross_entropy`); the value and gradients are
    those of :func:`next_token_loss`. With the sequence split over a ``context`` axis, the
    tokens are laid out in :func:`nnxscale.layers.attention.zigzag` order first. For a
    mixture of experts (Mixtral) the router's load-balancing loss and z-loss, averaged over
    the layers and weighted by the config's ``router_aux_loss_coef`` and
    ``router_z_loss_coef``, are added, and it returns ``(loss, extras)``: the two router
    losses, each expert's share of the assignments (``expert_load``, averaged over the
    layers) and its max over its mean, and with a capacity factor the share of the
    assignments dropped (``router_dropped``), which the step reports in ``metrics.jsonl``.

    ``separator`` (``--document-mask``): the token that ends each document of a packed row.
    Attention stops at document boundaries, positions restart at each document, and the
    mean is over the tokens whose input is not a separator
    (:func:`nnxscale.models.common.documents.document_layout`).

    ``ignored_targets`` (``--loss-on completion``): targets equal to
    :data:`~nnxscale.models.common.documents.IGNORED` (a prompt's) are not trained; the mean
    is over the others (:func:`~nnxscale.models.common.documents.trained_weights`).
    """
    hidden, targets, weights, extras = hidden_and_weights(model, inputs, targets, rngs, separator, ignored_targets)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)  # Gemma 2
    ce = chunked_cross_entropy(hidden, targets, model.head(), weights=weights, softcap=softcap)
    if extras is None:
        return ce
    return ce + extras.pop("router_aux_term") + extras.pop("router_z_term"), extras


def hidden_and_weights(model, inputs, targets, rngs, separator, ignored_targets):
    """``(hidden, targets, weights, extras)`` of a family's model on a batch: its last hidden
    states ``(B, T, C)``, the targets (``IGNORED`` ones as 0, their weight 0) and the
    weights (``None``: all count), in the order the tokens are laid out (zigzag over a
    ``context`` axis); ``extras``: a mixture's router losses (``router_aux_term`` and
    ``router_z_term`` join the objective) and statistics, ``None`` for a dense model."""
    positions = segments = None
    if separator is not None:
        positions, segments, _ = document_layout(inputs, separator)
    weights = trained_weights(inputs, targets, separator, ignored_targets)
    if ignored_targets:
        targets = jnp.where(targets == IGNORED, 0, targets)  # any valid id: its weight is 0
    order = context_order(inputs.shape[1])
    if order is not None:
        # The sequence is split over a context axis: lay it out head-tail (every device the
        # same causal work), tell the model where each token is; the loss is a sum, in any order.
        inputs, targets = inputs[:, order], targets[:, order]
        if separator is None:
            positions = jnp.asarray(order, jnp.int32)
        else:
            positions, segments = positions[:, order], segments[:, order]
        if weights is not None:
            weights = weights[:, order]
    if not getattr(model, "routed", False):
        return model.hidden_states(inputs, rngs=rngs, positions=positions, segments=segments), targets, weights, None
    # A mixture of experts: its router's losses join the objective, and the step reports them.
    hidden, stats = model.hidden_states(inputs, rngs=rngs, positions=positions, segments=segments, with_stats=True)
    c = model.config
    aux, z, load = jnp.mean(stats.aux_loss), jnp.mean(stats.z_loss), jnp.mean(stats.load, axis=0)  # over the layers
    extras = {"router_aux_loss": aux, "router_z_loss": z, "expert_load": load,
              "expert_load_max_over_mean": jnp.max(load) / jnp.mean(load),
              "router_aux_term": c.router_aux_loss_coef * aux, "router_z_term": c.router_z_loss_coef * z}  # fmt: skip
    if getattr(c, "capacity_factor", None):  # the share of the assignments over their expert's capacity
        extras["router_dropped"] = jnp.mean(stats.dropped)
    return hidden, targets, weights, extras


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """A model's shape in the few numbers the planner needs."""

    layers: int
    width: int  # the residual stream, d_model
    heads: int  # query heads
    kv_heads: int  # key/value heads (= heads without grouped-query attention)
    mlp_width: int  # the MLP's hidden width
    vocab_size: int
    context: int  # the longest sequence it takes
    head_dim: int = 0  # the width of one attention head (0: width // heads)
    mlp_inputs: int = 1  # the MLP's input projections (mlp_width wide each): 2 for a gated MLP (SwiGLU)

    @property
    def head_width(self) -> int:
        return self.head_dim or self.width // self.heads


@dataclasses.dataclass(frozen=True)
class LoraNames:
    """A family's names for LoRA (:mod:`nnxscale.layers.lora`) and for PEFT's files.

    ``targets``: ``--lora-targets`` name -> the weight path suffixes it adapts; ``default``:
    the names adapted when ``--lora-targets`` is not given. ``hf_param``: the family's HF
    naming of a parameter (``_hf_param(path, shape)``); ``hf_prefix``: what the HF
    ``*ForCausalLM`` model's keys have before the names ``save_pretrained`` writes (GPT-2:
    ``transformer.``); ``fan_in_fan_out``: HF stores the weights ``(in, out)`` (GPT-2's Conv1D).
    """

    targets: Mapping[str, tuple[str, ...]]
    default: tuple[str, ...]
    hf_param: Optional[Callable[..., Any]] = None
    hf_prefix: str = ""
    fan_in_fan_out: bool = False
    #: ``hf_param_of(config)`` -> ``hf_param``, for a family whose naming depends on the
    #: config (the decoder's stacks); else :attr:`hf_param` serves every config.
    hf_param_of: Optional[Callable[[Any], Callable[..., Any]]] = None

    def namer(self, config) -> Callable[..., Any]:
        """``hf_param(path, shape)`` for a model with ``config``."""
        return self.hf_param_of(config) if self.hf_param_of is not None else self.hf_param

    #: ``present(config, path suffix)``: whether a model of ``config`` has the weight (a name
    #: may stand for weights of several architectures: ``q`` is latent attention's ``q_a_proj``).
    present: Optional[Callable[[Any, str], bool]] = None

    def resolve(self, names: Optional[str], config=None) -> tuple[str, ...]:
        """Weight path suffixes of ``--lora-targets`` (comma-separated; default :attr:`default`);
        a name the family does not know is taken as a path suffix of its own. With ``config``,
        only the weights such a model has (a name that leaves none is an error naming it)."""
        chosen = self.default if names is None else [n.strip() for n in names.split(",") if n.strip()]
        out = []
        for n in chosen:
            paths = self.targets.get(n, (n,))
            if config is not None and self.present is not None and n in self.targets:
                paths = tuple(p for p in paths if self.present(config, p))
                if not paths and names is not None:
                    raise ModelError(f"--lora-targets {n!r}: this model has none of {', '.join(self.targets[n])}")
            out += paths
        return tuple(dict.fromkeys(out))


_LLAMA_ATTENTION = {"q": ("self_attn.q_proj",), "k": ("self_attn.k_proj",), "v": ("self_attn.v_proj",),
                    "o": ("self_attn.o_proj",)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One family of language models, described for the trainer.

    A config is the family's own frozen dataclass (``GPT2Config``); it has ``num_params()``
    (exact) and ``flops_per_token(seq_len)``.

    Attributes:
      name: the family's name, e.g. ``"gpt2"``.
      presets: preset name -> config. Preset names are unique across families.
      build: ``build(config, rngs=nnx.Rngs)`` -> the module; it is called as
        ``model(tokens)`` -> logits (see ``loss``).
      dims: config -> :class:`ModelDims`, for the planner and the trainer's checks.
      from_pretrained: ``from_pretrained(path, *, mesh=None, rules=None, dtype=None)`` -> a
        module (with its ``config``) from a Hugging Face directory, created in the layout
        the rules give on ``mesh``; ``dtype`` is the compute dtype.
      save_pretrained: ``save_pretrained(model, path)`` writes a Hugging Face directory.
      pretrained_config: ``pretrained_config(path)`` -> the config of a Hugging Face
        directory, read from its ``config.json`` only (``--model DIR``).
      hf_model_types: the ``model_type`` values of ``config.json`` this family loads.
      run_options: the :class:`~nnxscale.TrainConfig` fields that are also fields of the
        family's config (``dropout``, ``dtype``, ``remat``, ``attention``): a run sets them
        on the preset.
      loss: ``loss(model, inputs, targets, *, rngs)`` -> scalar; default
        :func:`next_token_loss`.
      lora: the family's LoRA target names and PEFT naming (:class:`LoraNames`).
    """

    name: str
    presets: Mapping[str, Any]
    build: Callable[..., Any]
    dims: Callable[[Any], ModelDims]
    from_pretrained: Callable[..., Any]
    save_pretrained: Callable[[Any, Any], None]
    pretrained_config: Callable[[Any], Any]
    hf_model_types: tuple[str, ...]
    run_options: tuple[str, ...] = ("dropout", "dtype", "remat", "attention")
    loss: Callable[..., Any] = next_token_loss
    lora: Optional[LoraNames] = None
    #: ``routed(config)``: whether the model routes tokens to experts (returns router statistics).
    routed: Callable[[Any], bool] = lambda config: False

    def flops_per_token(self, config, seq_len: int) -> int:
        """Training FLOPs per token at ``seq_len`` (the config's own formula)."""
        return int(config.flops_per_token(seq_len))


def _gpt2_dims(c: gpt2.GPT2Config) -> ModelDims:
    return ModelDims(layers=c.n_layer, width=c.n_embd, heads=c.n_head, kv_heads=c.n_head, mlp_width=4 * c.n_embd,
                     vocab_size=c.vocab_size, context=c.n_positions, head_dim=c.head_dim)  # fmt: skip


def _llama_dims(c: llama.LlamaConfig) -> ModelDims:
    return ModelDims(layers=c.num_hidden_layers, width=c.hidden_size, heads=c.num_attention_heads,
                     kv_heads=c.num_key_value_heads, mlp_width=c.intermediate_size, vocab_size=c.vocab_size,
                     context=c.max_position_embeddings, head_dim=c.head_size, mlp_inputs=2)  # fmt: skip


def _mixtral_dims(c: mixtral.MixtralConfig) -> ModelDims:
    return dataclasses.replace(_llama_dims(c), mlp_width=c.num_experts_per_tok * c.intermediate_size)


def _decoder_dims(c) -> ModelDims:
    """The decoder's shape for the planner: a mixture's MLP width is what one token runs
    through (its experts and the shared ones); latent attention's head width is the query's."""
    mlp = c.intermediate_size
    if c.num_local_experts:
        mlp = (c.num_experts_per_tok + c.n_shared_experts) * c.expert_size
    return ModelDims(layers=c.num_hidden_layers, width=c.hidden_size, heads=c.num_attention_heads,
                     kv_heads=c.num_key_value_heads, mlp_width=mlp, vocab_size=c.vocab_size,
                     context=c.max_position_embeddings, head_dim=c.head_size, mlp_inputs=2)  # fmt: skip


#: LoRA names every decoder family shares: the attention's projections (latent attention's
#: too), the MLP's, a mixture's experts and shared experts.
_DECODER_TARGETS = {
    "q": ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj"), "k": ("self_attn.k_proj",),
    "v": ("self_attn.v_proj",), "o": ("self_attn.o_proj",), "kv": ("self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"),
    "gate": ("mlp.gate_proj", "mlp.w1", "shared_experts.gate_proj"), "up": ("mlp.up_proj", "mlp.w3", "shared_experts.up_proj"),
    "down": ("mlp.down_proj", "mlp.w2", "shared_experts.down_proj"),
}  # fmt: skip


def _decoder_has(c, path: str) -> bool:
    """Whether a decoder of config ``c`` has a weight at ``path`` (a :data:`_DECODER_TARGETS` path)."""
    leaf = path.split(".")[-1]
    if path.startswith("self_attn."):
        if c.latent:
            return leaf in (("q_proj",) if c.q_lora_rank is None else ("q_a_proj", "q_b_proj")) + (
                "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        return leaf in ("q_proj", "k_proj", "v_proj", "o_proj")
    if path.startswith("shared_experts."):
        return c.routed and c.n_shared_experts > 0
    if leaf in ("w1", "w2", "w3"):
        return c.routed
    return not c.routed or bool(c.dense_layers)  # a dense MLP somewhere


def _decoder_family(name: str, module, hf_model_types: tuple[str, ...], default=("q", "k", "v", "o", "gate", "up", "down")):
    """A family of the decoder: its presets, its Hugging Face translation (``module.HF``) and
    the decoder's loss, dims and LoRA names."""
    hf = module.HF
    return ModelFamily(
        name=name, presets=module.PRESETS, build=Decoder, dims=_decoder_dims, from_pretrained=hf.from_pretrained,
        save_pretrained=hf.save_pretrained, pretrained_config=hf.pretrained_config, hf_model_types=hf_model_types,
        loss=chunked_next_token_loss, run_options=("dropout", "dtype", "remat", "attention", "capacity_factor"),
        lora=LoraNames(targets=_DECODER_TARGETS, default=default, hf_param_of=hf_param_of, present=_decoder_has),
        routed=lambda c: c.routed,
    )  # fmt: skip


#: Every registered family, by name.
FAMILIES: dict[str, ModelFamily] = {
    "gpt2": ModelFamily(
        name="gpt2",
        presets=gpt2.PRESETS,
        build=gpt2.GPT2,
        dims=_gpt2_dims,
        from_pretrained=gpt2.from_pretrained,
        save_pretrained=gpt2.save_pretrained,
        pretrained_config=gpt2.pretrained_config,
        hf_model_types=("gpt2",),
        loss=chunked_next_token_loss,
        lora=LoraNames(
            targets={"c_attn": ("attn.c_attn",), "c_proj": ("attn.c_proj", "mlp.c_proj"), "c_fc": ("mlp.c_fc",)},
            default=("c_attn", "c_proj", "c_fc"), hf_param=gpt2.hf._hf_param, hf_prefix="transformer.",
            fan_in_fan_out=True,
        ),  # fmt: skip
    ),
    "llama": ModelFamily(
        name="llama",
        presets=llama.PRESETS,
        build=llama.Llama,
        dims=_llama_dims,
        from_pretrained=llama.from_pretrained,
        save_pretrained=llama.save_pretrained,
        pretrained_config=llama.pretrained_config,
        hf_model_types=("llama",),
        loss=chunked_next_token_loss,
        lora=LoraNames(
            targets={**_LLAMA_ATTENTION, "gate": ("mlp.gate_proj",), "up": ("mlp.up_proj",), "down": ("mlp.down_proj",)},
            default=("q", "k", "v", "o", "gate", "up", "down"), hf_param_of=hf_param_of,
        ),
    ),
    "mixtral": ModelFamily(
        name="mixtral",
        presets=mixtral.PRESETS,
        build=mixtral.Mixtral,
        dims=_mixtral_dims,
        from_pretrained=mixtral.from_pretrained,
        save_pretrained=mixtral.save_pretrained,
        pretrained_config=mixtral.pretrained_config,
        hf_model_types=("mixtral",),
        loss=chunked_next_token_loss,
        run_options=("dropout", "dtype", "remat", "attention", "capacity_factor"),
        lora=LoraNames(
            targets={**_LLAMA_ATTENTION, **{w: (f"block_sparse_moe.{w}",) for w in ("w1", "w2", "w3")}},
            default=("q", "k", "v", "o", "w1", "w2", "w3"), hf_param_of=hf_param_of,
        ),
        routed=lambda c: True,
    ),
    "qwen": _decoder_family("qwen", qwen, ("qwen2", "qwen3", "qwen3_moe")),
    "mistral": _decoder_family("mistral", mistral, ("mistral",)),
    "gemma": _decoder_family("gemma", gemma, ("gemma2", "gemma3_text", "gemma3")),
    "deepseek": _decoder_family("deepseek", deepseek, ("deepseek_v3", "deepseek_v2")),
}


def preset_names() -> dict[str, list[str]]:
    """Family name -> its preset names."""
    return {name: list(f.presets) for name, f in FAMILIES.items()}


def find_preset(name: str) -> tuple[ModelFamily, Any]:
    """``(family, config)`` of the preset ``name``, in whichever family has it.

    Raises ModelError listing every family's presets when none has it.
    """
    for family in FAMILIES.values():
        if name in family.presets:
            return family, family.presets[name]
    known = "; ".join(f"{family}: {', '.join(names)}" for family, names in preset_names().items())
    raise ModelError(f"unknown model preset {name!r}: choose one of {known}")


def is_pretrained_dir(path) -> bool:
    """Whether ``path`` is a Hugging Face model directory: ``config.json`` and safetensors
    weights (``model.safetensors`` or a sharded set's ``model.safetensors.index.json``)."""
    path = Path(path)
    weights = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    return (path / "config.json").is_file() and weights


def is_config_dir(path) -> bool:
    """Whether ``path`` is a directory with a Hugging Face ``config.json``, weights or not:
    enough to know the architecture (``nnxscale plan --model DIR`` plans from it alone)."""
    return (Path(path) / "config.json").is_file()


def pretrained_family(path) -> ModelFamily:
    """The family of the Hugging Face directory ``path``, from its ``config.json``'s ``model_type``.

    Raises ModelError naming the model type when no registered family loads it.
    """
    config_file = Path(path) / "config.json"
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"cannot read {config_file} as a Hugging Face config ({e})") from None
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = ", ".join(f"{t!r} ({f.name})" for f in FAMILIES.values() for t in f.hf_model_types)
    raise ModelError(f"{config_file} has model_type {model_type!r}, which no model family loads: known types {known}")


def from_pretrained(path, *, mesh=None, rules=None, dtype: Optional[str] = None):
    """The model of the Hugging Face directory ``path``, whatever its architecture: the family
    its ``config.json``'s ``model_type`` names loads it (:func:`pretrained_family`), created in
    the layout ``rules`` give on ``mesh`` (each device reads only its slice), computing in
    ``dtype`` (default float32)."""
    return pretrained_family(path).from_pretrained(path, mesh=mesh, rules=rules, dtype=dtype)


def family_of(config) -> ModelFamily:
    """The family whose Hugging Face format holds a model of ``config``: by its class for
    GPT-2, Llama and Mixtral; a :class:`~nnxscale.models.decoder.DecoderConfig` by the
    switches it sets (latent attention: DeepSeek; Gemma's norms: Gemma; q/k norms, biases or
    experts: Qwen; a window: Mistral; none: Llama, whose format holds it)."""
    for family in FAMILIES.values():
        if type(config) is type(next(iter(family.presets.values()))) and family.name in ("gpt2", "llama", "mixtral"):
            return family
    if config.latent:
        return FAMILIES["deepseek"]
    if config.norm_offset:
        return FAMILIES["gemma"]
    if config.qk_norm or config.qkv_bias or config.num_local_experts:
        return FAMILIES["qwen"]
    return FAMILIES["mistral"] if config.sliding_window else FAMILIES["llama"]


def save_pretrained(model, path, **kw) -> None:
    """Write ``model`` as a Hugging Face directory that transformers loads with identical
    tensors, in the format of its family (:func:`family_of`)."""
    family_of(model.config).save_pretrained(model, path, **kw)


def architecture_differences(family: ModelFamily, a, b) -> list[str]:
    """Fields in which configs ``a`` and ``b`` describe different networks, as ``name: a vs b``.

    Run options and the parameters' storage dtype (``param_dtype``) do not count: the
    same weights serve either.
    """
    ignored = set(family.run_options) | {"param_dtype"}
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    differ = [k for k in sorted(set(da) | set(db)) if k not in ignored and da.get(k) != db.get(k)]
    return [f"{k}: {da.get(k)!r} vs {db.get(k)!r}" for k in differ]


__all__ = [
    "FAMILIES",
    "LoraNames",
    "ModelDims",
    "ModelFamily",
    "architecture_differences",
    "chunked_next_token_loss",
    "family_of",
    "find_preset",
    "from_pretrained",
    "gpt2",
    "hidden_and_weights",
    "is_config_dir",
    "is_pretrained_dir",
    "deepseek",
    "gemma",
    "llama",
    "mistral",
    "mixtral",
    "next_token_loss",
    "pretrained_family",
    "preset_names",
    "qwen",
    "save_pretrained",
]
