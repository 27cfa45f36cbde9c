"""GRPO's rollouts (issue 51): prompts read from JSON Lines, ``G`` completions of each sampled
with the KV cache on the training mesh from the run's own parameters (no second copy of the
model), and the batch the GRPO step trains on.

Prompt rows (``.jsonl``): ``prompt`` as text (encoded with the tokenizer's special tokens, as
a ``prompt``/``completion`` row's prompt is), or ``messages`` rendered by the model's chat
template with the assistant's turn opened (``add_generation_prompt``). Every other field of a
row (``answer``, ...) goes to the reward functions (:mod:`nnxscale.training.rewards`).

The batch: row ``i`` is its prompt then its completion, inputs its first ``T`` tokens, targets
the next ones; only the completion's tokens are trained (the prompt's targets and the padding
are ``IGNORED``), a completion that drew the stop token trained through it. Rows ``G p`` to
``G p + G - 1`` are prompt ``p``'s group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from flax import nnx

from nnxscale.data.chat import IGNORED, ChatTemplate, RowError, check_messages, iter_rows
from nnxscale.errors import DataError
from nnxscale.models.common.generate import Generator, Sampling
from nnxscale.training.adapters import model_params


@dataclasses.dataclass
class Prompts:
    """A file's prompts: each one's tokens and text, and the other fields of its row, by name
    (one value per prompt; ``None`` where a row lacks the field)."""

    tokens: list[list[int]]
    texts: list[str]
    fields: dict[str, list[Any]]
    description: str
    fingerprint: str

    def __len__(self) -> int:
        return len(self.tokens)


def load_prompts(path, tokenizer, template: Optional[ChatTemplate], *, longest: int, skip_bad_rows: bool = False) -> Prompts:
    """Every row of a JSON Lines file as a prompt of at most ``longest`` tokens (the sequence
    less the completion's room). Raises DataError naming the file and row of a bad one
    (no ``prompt`` or ``messages``, too long), or with ``skip_bad_rows`` skips and counts it."""
    path = Path(path)
    tokens, texts, rows, bad = [], [], [], 0
    for row, value in iter_rows(path):
        try:
            if not isinstance(value, dict) or ("prompt" in value) == ("messages" in value):
                raise RowError("a prompt row needs a 'prompt' (text) or a 'messages' (a conversation), one of them")
            if "messages" in value:
                if template is None:
                    raise DataError("prompts as messages need the model's chat template (a chat_template.jinja or a "
                                    "tokenizer_config.json with chat_template beside the tokenizer)")  # fmt: skip
                check_messages(value["messages"])
                text = template.render(value["messages"], add_generation_prompt=True)
                encode = getattr(tokenizer, "encode_plain", None)
                ids = encode([text])[0] if encode is not None else tokenizer.encode(text)
            else:
                if not isinstance(value["prompt"], str) or not value["prompt"]:
                    raise RowError(f"'prompt' must be non-empty text, got {value['prompt']!r:.60}")
                text = value["prompt"]
                ids = tokenizer.encode(text)  # with the tokenizer's own special tokens, as a completion row's prompt
            if len(ids) > longest:
                raise RowError(f"it is {len(ids):,} tokens: longer than --seq-len less --max-new-tokens ({longest})")
        except RowError as e:
            if not skip_bad_rows:
                raise DataError(f"{path}: row {row}: {e}: fix the row, or pass --skip-bad-rows to skip and count bad rows") from None
            bad += 1
            continue
        tokens.append([int(t) for t in ids])
        texts.append(text)
        rows.append({k: v for k, v in value.items() if k not in ("prompt", "messages")})
    if not tokens:
        raise DataError(f"{path}: no row gives a prompt ({bad} bad rows skipped)")
    names = sorted({k for r in rows for k in r})
    fields = {k: [r.get(k) for r in rows] for k in names}
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    skipped = f", {bad} bad rows skipped" if bad else ""
    return Prompts(tokens, texts, fields, f"{path}: {len(tokens):,} prompts{skipped}", digest)


class PromptOrder:
    """Which prompts each step takes: every prompt once per epoch, in an order drawn from
    ``seed`` and the epoch; its state (``get_state``/``set_state``) is saved with a checkpoint,
    so a resumed run takes the same prompts."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed, self.epoch, self.position = count, seed, 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.count)

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            order = self._order()
            k = min(n - len(out), self.count - self.position)
            out += [int(i) for i in order[self.position : self.position + k]]
            self.position += k
            if self.position == self.count:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "count": self.count}

    def set_state(self, state: dict) -> None:
        if state.get("count") != self.count:
            raise DataError(f"the prompts changed since this run was saved: {state.get('count')} then, {self.count} now")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def sampling_seed(seed: int, step: int) -> int:
    """The sampling seed of the rollout before optimizer step ``step + 1``: from the run's seed
    and the step, so a resumed run draws the completions the uninterrupted one draws."""
    return int(np.random.default_rng([seed, step, 0x5EED]).integers(0, 2**31 - 1))


def sample_completions(setup, state, prompts: Sequence[Sequence[int]], group: int, max_new_tokens: int,
                       sampling: Sampling, *, stop, vocab: Optional[int] = None) -> list[list[int]]:  # fmt: skip
    """``group`` completions of each prompt (rows ``group p`` to ``group p + group - 1``),
    sampled with the KV cache from the train state's own parameters, on its mesh."""
    model = nnx.merge(setup.graphdef, model_params(state))
    generate = Generator(model, setup.cfg.data.seq_len, setup.rules)
    rows = [list(p) for p in prompts for _ in range(group)]
    return generate(rows, max_new_tokens, sampling, stop=stop, vocab=vocab, length=setup.cfg.data.seq_len)


def training_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], advantages, seq_len: int,
                   pad: int = 0) -> dict[str, np.ndarray]:  # fmt: skip
    """``{"inputs", "targets", "advantages"}``, each ``(rows, seq_len)``: each row its prompt
    then its completion; only the completion's tokens trained, each with its row's advantage
    (0 elsewhere). ``prompts`` and ``completions`` row by row."""
    n = len(completions)
    inputs = np.full((n, seq_len), pad, np.int32)
    targets = np.full((n, seq_len), IGNORED, np.int32)
    adv = np.zeros((n, seq_len), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        row = list(p) + list(c)
        if len(row) > seq_len + 1:
            raise ValueError(f"row {i}: {len(p)} prompt and {len(c)} completion tokens exceed --seq-len {seq_len} + 1")
        inputs[i, : len(row) - 1] = row[:-1]
        start, end = len(p) - 1, len(row) - 1  # targets of the completion's tokens
        targets[i, start:end] = row[len(p):]
        adv[i, start:end] = advantages[i]
    return {"inputs": inputs, "targets": targets, "advantages": adv}


def completion_stats(completions: Sequence[Sequence[int]], max_new_tokens: int, stop) -> dict[str, float]:
    """Completion lengths (mean, max) and the share truncated (no stop token drawn, the length
    limit reached)."""
    stops = {int(s) for s in np.atleast_1d(stop)} if stop is not None else set()
    lengths = np.array([len(c) for c in completions])
    truncated = np.array([not (c and int(c[-1]) in stops) and len(c) >= max_new_tokens for c in completions])
    return {"completion_length": float(lengths.mean()), "completion_length_max": float(lengths.max()),
            "truncated": float(truncated.mean())}  # fmt: skip


#: Completions a rollout writes to ``rollouts.jsonl`` (its first ones: the first prompt's group).
SAMPLES = 4


def write_samples(path, step: int, texts: Sequence[str], rows: Sequence[int], completions: Sequence[str], rewards) -> None:
    """Append a step's first :data:`SAMPLES` completions, with their prompts and rewards, as a
    JSON line of ``rollouts.jsonl``."""
    samples = [{"prompt": texts[rows[i]], "completion": completions[i], "reward": float(rewards[i])}
               for i in range(min(SAMPLES, len(completions)))]  # fmt: skip
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "samples": samples}, ensure_ascii=False) + "\n")


def keep(directory, step: int, arrays: dict, record: dict, *, drop_before: int = 0) -> None:
    """Write a rollout's batch (host arrays) and its record, made before step ``step + 1``, to
    ``directory/step_{step}.npz`` (the steps after it train on it too: a run resumed between
    them reads it), and remove those made before step ``drop_before``."""
    directory = Path(directory)
    directory.mkdir(exist_ok=True)
    partial = directory / f"step_{step}.partial.npz"
    np.savez(partial, **arrays, _record=np.array(json.dumps(record)))
    partial.replace(directory / f"step_{step}.npz")
    for old in directory.glob("step_*.npz"):
        made = old.name[len("step_"):-len(".npz")]
        if made.isdigit() and int(made) < drop_before:
            old.unlink(missing_ok=True)


def kept(directory, step: int) -> tuple[dict, dict]:
    """The rollout :func:`keep` wrote before step ``step + 1``: ``(arrays, record)``."""
    path = Path(directory) / f"step_{step}.npz"
    if not path.is_file():
        raise DataError(f"{path} is missing: this run resumes between two rollouts (--grpo-iterations) and needs the "
                        f"rollout made before step {step + 1}")  # fmt: skip
    with np.load(path) as f:
        return {k: f[k] for k in f.files if not k.startswith("_")}, json.loads(str(f["_record"]))
