"""Sample text from a trained run, decoded with the run's tokenizer (bytes for byte-level models)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import jax
from flax import nnx

from nnxscale.checkpoint.checkpointer import Checkpointer, checkpoint_dir
from nnxscale.data import text as text
from nnxscale.data.chat import ChatTemplate, RowError
from nnxscale.errors import NnxscaleError
from nnxscale.models.common.generate import Sampling, check_max_new_tokens, generate
from nnxscale.sharding.axes import BATCH_AXES, CONTEXT, DATA, STAGE
from nnxscale.sharding.mesh import format_mesh, make_mesh, resolve_mesh_shape
from nnxscale.training import adapters as lora_state
from nnxscale.training.config import ConfigError, TrainConfig, with_overrides
from nnxscale.training.inputs import TOKENIZER_FILE, pretrained_source
from nnxscale.training.rundir import saved_config
from nnxscale.training.state import Setup, load_init_params, setup


def sampling_mesh(run_dir, mesh=None, *, note: Callable[[str], None] = print):
    """The mesh ``sample`` runs on: ``mesh`` (a spec or a ``jax.sharding.Mesh``) when given,
    else the run's own mesh with its ``stage`` and ``context`` axes folded into ``data``
    (decoding runs the layers in one scan and the sequence whole), else, when this job does
    not have the devices that takes, one device, said through ``note``."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    if mesh is not None:
        return make_mesh(mesh)
    saved = saved_config(Path(run_dir)) or {}
    spec = (saved.get("parallel") or {}).get("mesh") or "data=1"
    try:
        axes = resolve_mesh_shape(spec, jax.device_count())
    except NnxscaleError:
        note(f"sampling on one device: the run's mesh {spec} does not fit the {jax.device_count()} devices here "
             "(--mesh to choose one)")  # fmt: skip
        return make_mesh("data=1", devices=jax.local_devices()[:1])
    folded = {a: n for a, n in axes.items() if a not in (STAGE, CONTEXT)}
    moved = math.prod(n for a, n in axes.items() if a in (STAGE, CONTEXT))
    if moved > 1:
        folded = {DATA: folded.pop(DATA, 1) * moved, **folded}
        note(f"sampling on mesh {format_mesh(folded)}: the run's {format_mesh(axes)} with its stage and context axes as data")
    return make_mesh(folded)


def restore_model(run_dir, model: Optional[Callable], warn: Callable[[str], None],
                  mesh=None) -> tuple[Setup, nnx.Module]:  # fmt: skip
    """The setup of a run on ``mesh`` (default: one device of this process), and the model of
    its newest intact checkpoint laid out on it. Damaged newer checkpoints are skipped, each
    with a ``warn`` line."""
    run_dir = Path(run_dir)
    saved = saved_config(run_dir)
    if saved is None:
        raise ConfigError(f"{run_dir} is not an nnxscale run directory (no config.json)")
    recorded = json.loads((run_dir / "config.json").read_text()).get("model", {})
    own_module = recorded.get("family", "") is None
    if own_module and model is None:
        raise ConfigError(
            f"{run_dir} trained a module of your own (model=): sample it from Python, "
            "nnxscale.sample(run_dir, prompt, model=factory)"
        )
    cfg = TrainConfig.from_dict(saved)
    mesh = make_mesh("data=1", devices=jax.local_devices()[:1]) if mesh is None else mesh
    # the batch of the setup is one row per batch shard: sampling sizes its own batches
    rows = math.prod(n for a, n in zip(mesh.axis_names, mesh.devices.shape) if a in BATCH_AXES)
    s = setup(with_overrides(cfg, {"parallel.mesh": format_mesh(dict(zip(mesh.axis_names, mesh.devices.shape))),
                                 "parallel.microbatches": None, "parallel.pipeline_repeats": 1,
                                 "data.document_mask": False, "data.batch_size": rows, "optim.grad_accum": 1,
                                 # a GRPO run's batch counts its groups' completions: sampling needs only its model
                                 "objective": "lm" if cfg.objective == "grpo" else cfg.objective}),
              mesh=mesh, model=model, recorded=recorded)  # fmt: skip
    with Checkpointer(checkpoint_dir(run_dir), async_save=False) as ckpt:
        step, state, extras = ckpt.restore_intact({"params": s.abstract["params"]}, warn=warn, part=True)
    if s.model.lora is None:
        return s, nnx.merge(s.graphdef, state["params"])
    return s, nnx.merge(s.graphdef, lora_base(s, cfg, state["params"], extras, f"{run_dir} (step {step})", warn, own_module))


def lora_base(setup: Setup, cfg: TrainConfig, adapters: dict, extras: dict, where: str, warn, own_module: bool) -> dict:
    """A LoRA run's model parameters: its restored ``adapters`` over its base, loaded again from
    where the run took it (refused in one line when that base is not the one they were trained on)."""
    source = cfg.model.init_from or (None if own_module else pretrained_source(cfg))
    lora_state.check_base(extras.get("adapters_base"), lora_state.base_record(cfg, source, setup.model), where)
    base = lora_state.load_base(setup, source, lambda src: load_init_params(setup, src, warn=warn))
    return lora_state.merge_params(base, adapters)


def load_model(run_dir, *, model: Optional[Callable] = None, mesh=None, warn: Callable[[str], None] = print) -> nnx.Module:
    """The model of a run's newest intact checkpoint, on one device (of this process, in a
    job), or laid out by the run's rules on ``mesh`` (a spec or a ``jax.sharding.Mesh``).

    ``model``: the factory of your own module, for a run trained with ``train(cfg, model=...)``.
    Damaged newer checkpoints are skipped, each with a ``warn`` line.
    """
    mesh = None if mesh is None else sampling_mesh(run_dir, mesh)
    return restore_model(run_dir, model, warn, mesh)[1]


def run_decoder(run_dir, vocab_size: int, tokenizer=None):
    """How a run's tokens become text: ``tokenizer`` when given, else the run directory's
    ``tokenizer.json``, else bytes for a byte-level model (vocabulary 256).

    Raises ConfigError for a model that is not byte-level and has no tokenizer.
    """
    if tokenizer is not None:
        return text.load_tokenizer(tokenizer)
    kept = Path(run_dir) / TOKENIZER_FILE
    if kept.is_file():
        return text.load_tokenizer(kept)
    if vocab_size == text.BYTE_VOCAB:
        return text.ByteTokenizer()
    raise ConfigError(
        f"{run_dir} has no {TOKENIZER_FILE} (it trained on token files) and its model's vocabulary is "
        f"{vocab_size:,}, not bytes: give the tokenizer the tokens came from, --tokenizer tokenizer.json"
    )


def _chat_prompts(run_dir, tokenizer, decoder, texts: Sequence[str]) -> tuple[list[list[int]], Optional[int]]:
    """Each text as a user's message in the chat template, the assistant's turn opened,
    encoded; and the token that ends an assistant's turn in the template, where the tokenizer
    has it as one token (Gemma's ``<end_of_turn>`` is not its ``eos_token``)."""
    where = Path(tokenizer).expanduser() if tokenizer is not None else Path(run_dir)
    template = ChatTemplate.find(where if where.is_dir() else where.parent)
    if template is None or not hasattr(decoder, "encode_plain"):
        raise ConfigError(f"--chat: {where} has no chat template (chat_template.jinja, or chat_template in "
                          "tokenizer_config.json): the run was not trained with one; give --tokenizer DIR of a model that has")  # fmt: skip
    try:
        rendered = [template.render([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    except RowError as e:
        raise ConfigError(f"--chat: {template.source}: {e}") from None
    end = template.turn_end()
    return decoder.encode_plain(rendered), (decoder.token_id(end) if end and hasattr(decoder, "token_id") else None)


def sample(
    run_dir, prompt: Union[str, Sequence[str]], *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
    top_p: float = 1.0, seed: int = 0, tokenizer=None, model: Optional[Callable] = None, mesh=None,
    cache: Optional[bool] = None, chat: bool = False, warn: Callable[[str], None] = print,
) -> Union[str, list[str]]:  # fmt: skip
    """Continue ``prompt`` (one text, or a list of them, decoded together as a batch) with up
    to ``max_new_tokens`` tokens each; returns prompt + continuation (a list for a list).

    Each continuation ends at the tokenizer's end-of-text token (not printed) or after
    ``max_new_tokens``. ``temperature`` 0 is greedy; otherwise the logits are cut to the
    ``top_k`` most likely (0: all) and the smallest set of probability ``top_p``, and drawn
    with ``seed``. The prompt is encoded and the tokens decoded with the run's tokenizer (see
    :func:`run_decoder`); an empty prompt starts a new document (the tokenizer's separator).

    The model is restored onto ``mesh`` (default: the run's own, see :func:`sampling_mesh`)
    in the run's layout, so a model that needs tensor parallelism to fit samples with it.
    GPT-2 and Llama decode with a KV cache; your own module (``model``: its factory) decodes
    with one if it has ``init_cache`` (see :mod:`nnxscale.models.common.generate`), else by
    recomputation, said once through ``warn``; ``cache=False`` recomputes always. The
    context is the model's (its family's), or the run's sequence length for your own module.

    ``chat``: each prompt is a user's message, rendered by the run's chat template (kept in
    the run directory from the tokenizer's, or beside ``tokenizer``) with the assistant's
    turn opened (:meth:`nnxscale.data.chat.ChatTemplate.render`, ``add_generation_prompt``),
    and the reply alone is returned; it ends at the tokenizer's end-of-text token
    (``eos_token``: ``<|eot_id|>`` for Llama 3 Instruct, ``<|im_end|>`` for ChatML models) or
    at the token the template ends an assistant's turn with (Gemma's ``<end_of_turn>``).
    """
    sampling = Sampling(temperature, top_k, top_p, seed).check()
    check_max_new_tokens(max_new_tokens)  # before the checkpoint is read
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ConfigError("prompt: give a text, or a non-empty list of texts")
    s, net = restore_model(run_dir, model, warn, sampling_mesh(run_dir, mesh, note=warn))
    vocab = s.vocab_size()
    decoder = run_decoder(run_dir, vocab, tokenizer)
    if decoder.vocab_size > vocab:
        raise ConfigError(f"tokenizer {decoder.path} has {decoder.vocab_size:,} tokens, more than the model's {vocab:,}")
    context = s.model.dims.context if s.model.dims is not None else s.cfg.data.seq_len
    stops = [decoder.separator]
    if chat:
        encoded, turn_end = _chat_prompts(run_dir, tokenizer, decoder, texts)
        stops.append(turn_end)
    else:
        encoded = [decoder.encode(t) for t in texts]
    start = [list(ids) or [decoder.separator or 0] for ids in encoded]
    stop = sorted({t for t in stops if t is not None}) or None
    new = generate(net, start, max_new_tokens=max_new_tokens, context=context, sampling=sampling, stop=stop,
                   rules=s.rules, cache=cache, vocab=decoder.vocab_size, note=warn)  # fmt: skip
    out = []
    for text_in, ids, more in zip(texts, encoded, new):
        more = more[:-1] if more and stop and more[-1] in stop else more
        if chat:
            out.append(decoder.decode(more))
            continue
        # Decoded with the prompt before it (a word's leading space depends on what precedes it).
        head, whole = decoder.decode(ids), decoder.decode(list(ids) + more)
        out.append(text_in + (whole[len(head):] if whole.startswith(head) else decoder.decode(more)))
    return out[0] if isinstance(prompt, str) else out
