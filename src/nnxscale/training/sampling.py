"""Sample text from a trained run, decoded with the run's tokenizer (bytes for byte-level models)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscale.checkpoint.checkpointer import Checkpointer, checkpoint_dir
from nnxscale.data import text as text
from nnxscale.sharding.mesh import make_mesh
from nnxscale.training.config import MAX_SEED, ConfigError, TrainConfig, with_overrides
from nnxscale.training.inputs import TOKENIZER_FILE
from nnxscale.training.rundir import saved_config
from nnxscale.training.state import Setup, setup


def _restore(run_dir, model: Optional[Callable], warn: Callable[[str], None]) -> tuple[Setup, nnx.Module]:
    """The setup of a run, on one device (of this process, in a job), and the model of its
    newest intact checkpoint. Damaged newer checkpoints are skipped, each with a ``warn`` line."""
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
    one = make_mesh("data=1", devices=jax.local_devices()[:1])
    s = setup(with_overrides(cfg, {"parallel.mesh": "data=1", "parallel.microbatches": None, "parallel.pipeline_repeats": 1,
                                 "data.document_mask": False}), mesh=one, model=model,
              recorded=recorded)  # fmt: skip
    with Checkpointer(checkpoint_dir(run_dir), async_save=False) as ckpt:
        _, state, _ = ckpt.restore_intact(s.abstract, warn=warn)
    return s, nnx.merge(s.graphdef, state["params"])


def load_model(run_dir, *, model: Optional[Callable] = None, warn: Callable[[str], None] = print) -> nnx.Module:
    """The model of a run's newest intact checkpoint, on one device (of this process, in a job).

    ``model``: the factory of your own module, for a run trained with ``train(cfg, model=...)``.
    Damaged newer checkpoints are skipped, each with a ``warn`` line.
    """
    return _restore(run_dir, model, warn)[1]


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


def sample(
    run_dir, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
    tokenizer=None, model: Optional[Callable] = None, warn: Callable[[str], None] = print,
) -> str:  # fmt: skip
    """Continue ``prompt`` with ``max_new_tokens`` sampled tokens; returns prompt + continuation.

    The prompt is encoded and the tokens decoded with the run's tokenizer (see
    :func:`run_decoder`); an empty prompt starts a new document (the tokenizer's separator).
    The context is the model's (its family's), or the run's sequence length for your own
    module (``model``: its factory).
    """
    if max_new_tokens < 1 or not 0 <= temperature < math.inf or top_k < 0 or not 0 <= seed <= MAX_SEED:
        raise ConfigError(
            f"--max-new-tokens must be positive (got {max_new_tokens}), --temperature finite and non-negative "
            f"(got {temperature}), --top-k non-negative (got {top_k}), --seed in [0, {MAX_SEED}] (got {seed})"
        )
    s, net = _restore(run_dir, model, warn)
    vocab = s.vocab_size()
    decoder = run_decoder(run_dir, vocab, tokenizer)
    if decoder.vocab_size > vocab:
        raise ConfigError(f"tokenizer {decoder.path} has {decoder.vocab_size:,} tokens, more than the model's {vocab:,}")
    context = s.model.dims.context if s.model.dims is not None else s.cfg.data.seq_len
    graphdef, params = nnx.split(net)

    @jax.jit
    def next_logits(params, window, length):
        logits = nnx.merge(graphdef, params)(window[None, :])[0]  # (T, V)
        return logits[length - 1]

    prompt_ids = decoder.encode(prompt)
    tokens = list(prompt_ids) or [decoder.separator or 0]
    key = jax.random.key(seed)
    for _ in range(max_new_tokens):
        ctx = tokens[-context:]
        window = np.zeros(context, np.int32)
        window[: len(ctx)] = ctx
        logits = next_logits(params, jnp.asarray(window), jnp.int32(len(ctx)))
        if temperature == 0:
            nxt = int(jnp.argmax(logits))
        else:
            logits = logits / temperature
            if top_k:
                kth = jnp.sort(logits)[-min(top_k, logits.shape[-1])]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, logits))
        tokens.append(nxt)
    new = tokens[len(tokens) - max_new_tokens :]
    # Decoded with the prompt before it (a word's leading space depends on what precedes it).
    head, whole = decoder.decode(prompt_ids), decoder.decode(list(prompt_ids) + new)
    return prompt + (whole[len(head) :] if whole.startswith(head) else decoder.decode(new))
