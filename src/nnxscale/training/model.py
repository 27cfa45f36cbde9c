"""The model of a run: a family's preset, a Hugging Face directory, or your own module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

from flax import nnx

from nnxscale.data import text as text
from nnxscale.errors import ModelError
from nnxscale.layers import fp8 as fp8_layers
from nnxscale.layers import lora as lora_layers
from nnxscale.models import (
    FAMILIES,
    ModelDims,
    ModelFamily,
    find_preset,
    is_config_dir,
    is_pretrained_dir,
    next_token_loss,
    pretrained_family,
)  # fmt: skip
from nnxscale.training.config import ConfigError, TrainConfig, flag
from nnxscale.training.grpo import run_loss
from nnxscale.training.preference import dpo_loss

#: TrainConfig fields that set a family's config (see ``ModelFamily.run_options``).
RUN_OPTIONS = ("dropout", "dtype", "remat", "attention", "capacity_factor")


@dataclasses.dataclass(frozen=True)
class RunModel:
    """The model a run trains: a preset of a registered family, or your own module.

    ``build(rngs)`` creates it (seeded by ``rngs``); ``loss(model, inputs, targets, *,
    rngs)`` is its scalar loss (default :func:`nnxscale.models.next_token_loss`). A family's
    model also has its ``family`` and ``config`` (with this run's options), hence its
    dimensions, FLOPs per token and Hugging Face import; your own module has neither.
    """

    name: str
    build: Callable[[nnx.Rngs], nnx.Module]
    loss: Callable
    family: Optional[ModelFamily] = None
    config: Any = None
    separator: Optional[int] = None  # --document-mask: the token that ends a document
    ignored_targets: bool = False  # --loss-on completion: targets IGNORED (a prompt's) are not trained
    reference: bool = False  # --objective dpo: ``loss`` also takes ``reference=``, the reference's log-probabilities
    # (under LoRA the reference is the base with its adapters off: no copy of the weights)
    lora: Optional[lora_layers.LoraSpec] = None  # --lora-rank: adapters beside the targets, the rest frozen
    fp8: bool = False  # --fp8: the stacked layers' linear products in FP8 (nnxscale.layers.fp8)

    @property
    def dims(self) -> Optional[ModelDims]:
        return None if self.family is None else self.family.dims(self.config)

    @property
    def routed(self) -> bool:
        """Whether the family's model is a mixture of experts (``ModelFamily.routed``)."""
        return self.family is not None and bool(self.family.routed(self.config))

    def describe(self) -> dict:
        """What ``config.json`` records of the model: the family and its config."""
        if self.family is None:
            return {"family": None}
        return {"family": self.family.name, **dataclasses.asdict(self.config)}


def lora_spec(cfg: TrainConfig, family: Optional[ModelFamily], config=None) -> Optional[lora_layers.LoraSpec]:
    """The adapters ``cfg.lora`` asks for (``None`` without ``--lora-rank``): the family's
    target names resolved to weight paths; for your own module the names are path suffixes,
    and by default every linear layer of its stacked layers (:func:`nnxscale.stack_layers`)."""
    settings = cfg.lora
    if settings.rank is None:
        return None
    if family is not None and family.lora is not None:
        targets = family.lora.resolve(settings.targets, config)
    elif settings.targets is not None:
        targets = tuple(dict.fromkeys(t.strip() for t in settings.targets.split(",") if t.strip()))
    else:
        targets = None
    alpha = float(settings.rank if settings.alpha is None else settings.alpha)
    return lora_layers.LoraSpec(settings.rank, alpha, targets, settings.dropout)


def with_adapters(build: Callable[[nnx.Rngs], nnx.Module], spec: Optional[lora_layers.LoraSpec]):
    """``build`` followed by :func:`nnxscale.layers.lora.attach` (its ``A`` from the same ``rngs``)."""
    if spec is None:
        return build

    def adapted(rngs: nnx.Rngs) -> nnx.Module:
        model = build(rngs)
        return lora_layers.attach(model, spec, key=rngs.params())

    return adapted


def with_fp8(build: Callable[[nnx.Rngs], nnx.Module], fp8: bool):
    """``build`` followed by :func:`nnxscale.layers.fp8.attach` on its stacked layers' linear
    layers (every linear layer where none is stacked), with ``fp8``."""
    if not fp8:
        return build

    def in_fp8(rngs: nnx.Rngs) -> nnx.Module:
        model = build(rngs)
        fp8_layers.attach(model, lora_layers.stacked_layers(model))
        return model

    return in_fp8


def model_architecture(name: str, recorded: Optional[dict] = None) -> tuple[ModelFamily, Any]:
    """``(family, config)`` of ``--model NAME``: a preset of any family, or a Hugging Face
    directory whose ``config.json`` gives the architecture (its weights are not read here: a
    directory holding ``config.json`` alone is enough to plan a published model;
    :func:`require_weights` is what training asks).

    ``recorded``: the ``model`` record of a run's ``config.json`` (family and config), used
    when ``name`` is a directory that is no longer there, so a run trained from a Hugging
    Face directory can still be sampled and resumed.
    """
    if is_config_dir(name):
        family = pretrained_family(name)
        return family, family.pretrained_config(name)
    try:
        return find_preset(name)
    except ModelError:
        if recorded and recorded.get("family") in FAMILIES:
            family = FAMILIES[recorded["family"]]
            kind = type(next(iter(family.presets.values())))
            return family, kind.from_dict({k: v for k, v in recorded.items() if k != "family"})
        if "/" in name or Path(name).exists():
            raise ModelError(
                f"--model {name}: not a Hugging Face model directory (no config.json in it), and not a preset"
            ) from None
        raise


def require_weights(cfg: TrainConfig, command: str = "train") -> None:
    """Refuse, in one line, to ``command`` (train, init) a ``--model DIR`` that holds a
    ``config.json`` but no weights, where the weights would come from it (no ``--init-from``):
    only ``nnxscale plan`` works from the architecture alone."""
    name = cfg.model.name
    if cfg.model.init_from is None and is_config_dir(name) and not is_pretrained_dir(name):
        raise ModelError(
            f"--model {name} holds config.json but no weights (model.safetensors, or model.safetensors.index.json "
            f"and its files): {command} needs them; nnxscale plan works from config.json alone, or start from "
            "weights with --init-from RUN_OR_HF_DIR"
        )


def run_model(
    cfg: TrainConfig,
    model: Optional[Callable] = None,
    loss: Optional[Callable] = None,
    *,
    recorded: Optional[dict] = None,
    separator: Optional[int] = None,
    ignored_targets: bool = False,
) -> RunModel:
    """The :class:`RunModel` of ``cfg``: the preset ``cfg.model.name`` (or the architecture of
    the Hugging Face directory ``cfg.model.name``) with ``cfg``'s run options, or, given
    ``model`` (a function ``rngs -> nnx.Module``), that module, named ``cfg.model.name``.
    ``recorded``: see :func:`model_architecture`. ``separator``: the token that ends a
    document, required with ``cfg.data.document_mask`` (the family's loss masks at it).
    ``ignored_targets``: the data marks targets the loss does not train (``--loss-on
    completion``). ``cfg.objective`` ``"dpo"``: the loss is
    :func:`nnxscale.training.preference.dpo_loss`.

    Raises ConfigError for an unknown preset (listing every family's), a run option the
    family does not take, a run option set for your own module (it sets its own), or a
    document mask with your own module or loss (they decide their own masks).
    """
    defaults = TrainConfig()
    changed = {k: getattr(cfg.model, k) for k in RUN_OPTIONS if getattr(cfg.model, k) != getattr(defaults.model, k)}
    if cfg.data.document_mask:
        if model is not None or loss is not None:
            raise ConfigError(
                "--document-mask is the GPT-2 and Llama families' loss; your own module or loss= decides its own "
                "masks: leave document_mask off"
            )
        if separator is None:
            raise ConfigError("document_mask: the separator token that ends a document is not known (pass separator=)")
    if ignored_targets and (model is not None and loss is None):
        raise ConfigError(
            "--loss-on completion masks the prompt with the GPT-2, Llama and Mixtral families' loss; with your own module "
            "pass a loss= that skips targets equal to nnxscale.models.common.documents.IGNORED, or train with --loss-on all"
        )
    if cfg.objective in ("dpo", "grpo") and (model is not None or loss is not None):
        raise ConfigError(f"--objective {cfg.objective} trains a family's model (GPT-2, Llama, Mixtral, ...) with its own "
                          "loss; your own module or loss= cannot take it")  # fmt: skip
    if model is not None:
        if not callable(model):
            raise ConfigError(f"model= must be a function rngs -> nnx.Module, got {type(model).__name__}")
        if changed:
            given = ", ".join(f"{flag('model.' + k)} {v}" for k, v in changed.items())
            raise ConfigError(f"{given}: these set a family preset's options; your own module (model=) sets its own")
        spec = lora_spec(cfg, None)
        build = with_fp8(with_adapters(model, spec), cfg.model.fp8)
        return RunModel(cfg.model.name, build, loss or next_token_loss, lora=spec, fp8=cfg.model.fp8)
    family, preset = model_architecture(cfg.model.name, recorded)
    if unsupported := [k for k in changed if k not in family.run_options]:
        given = ", ".join(f"{flag('model.' + k)} {changed[k]}" for k in unsupported)
        raise ConfigError(f"{given}: {cfg.model.name} ({family.name}) has no such option; it takes {', '.join(family.run_options)}")
    config = dataclasses.replace(preset, **{k: getattr(cfg.model, k) for k in family.run_options})
    spec = lora_spec(cfg, family, config)
    if spec is not None:  # the frozen base is stored in the compute dtype (the adapters are float32)
        config = dataclasses.replace(config, param_dtype=cfg.model.dtype)
    objective = loss or family.loss
    if separator is not None and cfg.data.document_mask:
        if "separator" not in inspect.signature(objective).parameters:
            raise ConfigError(f"--document-mask: the {family.name} family's loss takes no document mask")
        objective = functools.partial(objective, separator=separator)
    else:
        separator = None
    if ignored_targets and cfg.objective != "dpo":
        if "ignored_targets" not in inspect.signature(objective).parameters:
            raise ConfigError(f"--loss-on completion: the {family.name} family's loss cannot skip a prompt's targets")
        objective = functools.partial(objective, ignored_targets=True)
    if cfg.objective == "dpo":
        objective = functools.partial(dpo_loss, beta=cfg.dpo_beta, separator=separator)
        ignored_targets = True
    if cfg.objective == "grpo":  # the step binds each rollout's advantages (and old log-probabilities) from its batch
        objective, ignored_targets = run_loss(cfg.grpo), True
    build = with_fp8(with_adapters(lambda rngs: family.build(config, rngs=rngs), spec), cfg.model.fp8)
    # DPO's reference, and GRPO's for its KL penalty: under LoRA the base itself (no copy)
    reference = cfg.objective == "dpo" or (cfg.objective == "grpo" and cfg.grpo.kl_beta > 0)
    return RunModel(cfg.model.name, build, objective, family, config, separator, ignored_targets, reference, spec,
                    cfg.model.fp8)  # fmt: skip
