"""Autoregressive generation: a batch of prompts, a KV cache, and the usual sampling controls.

:func:`generate` continues token prompts with a model of any family (or your own module)
on any mesh. A model that has ``init_cache(batch, length)`` and takes
``hidden_states(tokens, positions=, cache=)`` (GPT-2, Llama) decodes with a KV cache
(:mod:`nnxscale.layers.kv_cache`): the prompts are run once (prefill), then every new token
costs one position's work. Any other model is run on the whole sequence for every new token
(recomputation), which gives the same tokens, only slower.

Prompts of different lengths are right-padded and decoded together; each row has its own
positions. A row stops at ``stop`` (the tokenizer's end-of-text token) or after
``max_new_tokens``; the batch stops when every row has. The whole decoding loop of a round is
one compiled program (``jax.lax.while_loop``), so no token goes back to the host until the
round ends.

A continuation longer than the context goes in rounds: when the context is full, the last
three quarters of each row's tokens are taken as a new prompt, and decoding goes on from there.
Recomputation uses the same windows, so the two agree token for token, however long the text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from functools import partial
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.errors import ConfigError
from nnxscale.sharding.activations import constrain, use_rules

#: The largest seed: a uint32, as the trainer's (``nnxscale.training.config.MAX_SEED``).
MAX_SEED = 2**32 - 1


def check_max_new_tokens(n) -> int:
    """``n``, a positive number of tokens to generate; else ConfigError in one line."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"--max-new-tokens must be a positive integer (got {n})")
    return n


#: Cache and window lengths are rounded up to a multiple of this (fewer programs to compile).
ROUND_TO = 64


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each next token is chosen from the logits.

    ``temperature`` 0 is greedy (the most likely token). Otherwise the logits are divided by
    the temperature, cut to the ``top_k`` most likely (0: all), then to the smallest set whose
    probability reaches ``top_p`` (1: all), and a token is drawn; ``seed`` makes it repeatable.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> "Sampling":
        bad = []
        if not 0 <= self.temperature < math.inf:
            bad.append(f"--temperature must be finite and non-negative (got {self.temperature})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad.append(f"--top-k must be a non-negative integer (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            bad.append(f"--top-p must be in (0, 1] (got {self.top_p})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            bad.append(f"--seed must be in [0, {MAX_SEED}] (got {self.seed})")
        if bad:
            raise ConfigError("; ".join(bad))
        return self


def _draw(logits, key, temperature, top_k, top_p):
    """The next token of every row, drawn from ``logits (B, V)`` float32 at a positive
    ``temperature`` after the top-k and top-p cuts (see :class:`Sampling`); the controls are
    traced values, so one compiled program serves every setting. Returns ``(B,)`` int32."""
    logits = logits / temperature
    V = logits.shape[-1]
    ordered = -jnp.sort(-logits, axis=-1)  # (B, V), descending
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    kth = ordered[:, k - 1][:, None]  # top-k: nothing below the k-th largest
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens more likely than each
    keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # top-p: the smallest set reaching it, at least one
    cut = jnp.maximum(jnp.take_along_axis(ordered, keep - 1, axis=-1), kth)
    logits = jnp.where(logits < cut, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def has_cache(model: nnx.Module) -> bool:
    """Whether ``model`` decodes with a KV cache (``init_cache`` and ``hidden_states(..., cache=)``)."""
    return callable(getattr(model, "init_cache", None)) and callable(getattr(model, "hidden_states", None))


def _round_up(n: int, to: int, cap: int) -> int:
    return min(cap, -(-n // to) * to)


def _replicated(mesh):
    return None if mesh is None else NamedSharding(mesh, P())


def _round(graphdef, params, tokens, lengths, limit, step0, done, controls, seed, *, cache_len: int, cached: bool):
    """One round of decoding, traced under jit: up to ``limit`` new tokens after right-padded
    ``tokens (B, W)`` of ``lengths (B,)``. ``controls``: greedy (bool), temperature, top-k,
    top-p, the stop token (-1: none) and the vocabulary drawn from, as arrays, so one
    compiled program serves every setting. Returns ``(new (B, cache_len) int32, -1 where
    none; done (B,))``: a round never makes more tokens than the cache has positions."""
    greedy, temperature, top_k, top_p, stop, vocab = controls
    model = nnx.merge(graphdef, params)
    B, W = tokens.shape
    key = jax.random.key(seed)
    rows = jnp.arange(B)

    def pick(logits, i):  # logits (B, V) -> tokens, at global step step0 + i
        # a tokenizer smaller than the model's vocabulary: never draw a token it lacks
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, -jnp.inf)
        return jax.lax.cond(
            greedy,
            lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
            lambda: _draw(logits, jax.random.fold_in(key, step0 + i), temperature, top_k, top_p),
        )

    def emit(out, done, tok, i):
        tok = jnp.where(done, -1, tok)
        out = out.at[:, i].set(tok)
        done = done | jnp.any(tok[:, None] == stop[None, :], axis=-1)  # -1 without a stop token: never a token
        return out, done

    out = jnp.full((B, cache_len), -1, jnp.int32)
    if cached:
        # a ring cache (sliding-window layers) must hold every padded prompt position at once
        takes_prefill = "prefill" in inspect.signature(model.init_cache).parameters
        cache = model.init_cache(B, cache_len, prefill=W) if takes_prefill else model.init_cache(B, cache_len)
        positions = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
        h, cache = model.hidden_states(tokens, positions=positions, cache=cache)  # (B, W, C)
        last = constrain(h[rows, lengths - 1][:, None], "batch", "length", "embed")  # (B, 1, C)
        tok = pick(model.logits(last)[:, 0], 0)
    else:
        buf = jnp.zeros((B, cache_len), jnp.int32).at[:, :W].set(tokens)
        tok = pick(model(buf)[rows, lengths - 1], 0)
    out, done = emit(out, done, tok, 0)

    def cond(carry):
        i, _, done, *_ = carry
        return (i < limit) & ~jnp.all(done)

    def body(carry):
        i, out, done, tok, state = carry
        where = lengths + i - 1  # the position of the token fed in: the one chosen last
        if cached:
            h, state = model.hidden_states(tok[:, None], positions=where[:, None], cache=state)  # (B, 1, C)
            logits = model.logits(h)[:, 0]
        else:
            state = state.at[rows, where].set(tok)
            logits = model(state)[rows, where]
        nxt = pick(logits, i)
        out, done = emit(out, done, nxt, i)
        return i + 1, out, done, nxt, state

    state = cache if cached else buf
    _, out, done, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), out, done, tok, state))
    return out, done


@functools.lru_cache(maxsize=64)
def _round_program(graphdef, rules, cached: bool, cache_len: int):
    """The jitted round for a model's structure (its ``GraphDef``, hashable), its rules (the
    same object: the round is traced under them) and cache length, shared by every
    :class:`Generator` that has them: :func:`generate` makes a Generator per call, and a
    second call with the same model and rules traces and compiles nothing again, whatever
    the sampling controls, stop token and vocabulary (arguments of the program)."""
    fn = partial(_round, graphdef, cache_len=cache_len, cached=cached)
    mesh = None if rules is None else rules.mesh
    out = None if mesh is None else (_replicated(mesh), _replicated(mesh))
    return jax.jit(fn, out_shardings=out)


@dataclasses.dataclass
class Generator:
    """Decoding for one model on one mesh: :func:`generate` makes one per call; hold one to
    generate repeatedly (the bench). Its programs are compiled on first use per cache length
    and kept by :func:`_round_program`, for every Generator of the same model and rules.

    ``rules``: the :class:`~nnxscale.MeshRules` the model's parameters are laid out by
    (``None``: one device, or wherever the parameters are). ``context``: the longest sequence
    the model takes. ``cache``: decode with the KV cache (``False``: recompute, the baseline).
    """

    model: nnx.Module
    context: int
    rules: object = None
    cache: bool = True

    def __post_init__(self):
        if self.context < 2:
            raise ConfigError(f"a context of {self.context} token(s) leaves no room to generate")
        if self.cache and not has_cache(self.model):
            raise ConfigError(f"{type(self.model).__name__} has no init_cache: generate with cache=False (recomputation)")
        self.graphdef, self.params = nnx.split(self.model)

    def _put(self, *arrays):
        """Host arrays, the same on every process, replicated over the mesh."""
        if self.rules is None:
            return arrays
        return jax.device_put(arrays, _replicated(self.rules.mesh))

    def _scope(self):
        if self.rules is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.rules.mesh))
        stack.enter_context(use_rules(self.rules))
        return stack

    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
                 stop: Union[int, Sequence[int], None] = None, vocab: Optional[int] = None, length: Optional[int] = None) -> list[list[int]]:  # fmt: skip
        """The new tokens of each prompt (ending with ``stop`` where it was drawn).
        ``vocab``: draw only tokens below it (a tokenizer smaller than the model's vocabulary).
        ``length``: the cache's length (recomputing: the window's), at most the context;
        default the longest prompt and ``max_new_tokens``, rounded up to :data:`ROUND_TO`.
        Programs are compiled per length: the bench times a few tokens of a long run this way."""
        sampling.check()
        check_max_new_tokens(max_new_tokens)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("every prompt needs at least one token (start an empty one with the end-of-text token)")
        C = self.context
        keep = max(1, C - C // 4)  # a new round's prompt: the last three quarters of the context
        rows = [list(p)[-C:] for p in prompts]  # a prompt longer than the context: its end
        shards = 1 if self.rules is None else max(self.rules.batch_shard_count, 1)
        B = -(-len(rows) // shards) * shards  # rows padded to split evenly over the batch axes
        new: list[list[int]] = [[] for _ in rows]
        done = np.zeros(B, bool)
        done[len(rows):] = True
        step, new_since = 0, [[] for _ in rows]
        with self._scope():
            while step < max_new_tokens and not done.all():
                if step:  # the context is full: go on from the end of each row
                    rows = [(p + n)[-keep:] for p, n in zip(rows, new_since)]
                longest = max(len(r) for r in rows)
                W = _round_up(longest, ROUND_TO, C)  # the prompt window
                cache_len = max(W, _round_up(longest + max_new_tokens - step, ROUND_TO, C))
                if length is not None and step == 0:
                    if not W <= length <= C:
                        raise ConfigError(f"length {length} must hold the prompts' window of {W} and fit the context of {C}")
                    cache_len = length
                limit = min(max_new_tokens - step, cache_len - longest + 1)  # the last token fed in sits at cache_len - 1
                tokens = np.zeros((B, W), np.int32)
                lengths = np.ones(B, np.int32)
                for i, r in enumerate(rows):
                    tokens[i, : len(r)] = r
                    lengths[i] = len(r)
                program = _round_program(self.graphdef, self.rules, self.cache, cache_len)
                controls = (np.bool_(sampling.temperature == 0), np.float32(sampling.temperature), np.int32(sampling.top_k),
                            np.float32(sampling.top_p), _stops(stop),
                            np.int32(np.iinfo(np.int32).max if vocab is None else vocab))  # fmt: skip
                args = self._put(tokens, lengths, np.int32(limit), np.int32(step), done, controls, np.uint32(sampling.seed))
                out, done_now = program(self.params, *args)
                out, done = np.asarray(out), np.asarray(done_now).copy()
                new_since = [[int(t) for t in out[i, :limit] if t >= 0] for i in range(len(rows))]
                for i, n in enumerate(new_since):
                    new[i].extend(n)
                step += limit
        return new


def generate(model: nnx.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, context: int,
             sampling: Sampling = Sampling(), stop: Union[int, Sequence[int], None] = None, rules=None, cache: Optional[bool] = None,
             vocab: Optional[int] = None, note: Callable[[str], None] = print) -> list[list[int]]:  # fmt: skip
    """Continue each token prompt of ``prompts`` with up to ``max_new_tokens`` tokens.

    ``model``: any NNX module mapping tokens ``(B, T)`` to logits ``(B, T, V)``, its
    parameters laid out by ``rules`` (a :class:`~nnxscale.MeshRules`; ``None``: one device).
    ``context``: the longest sequence it takes. ``cache``: ``None`` decodes with the KV cache
    where the model has one and otherwise recomputes, saying so once through ``note``;
    ``False`` always recomputes. ``stop``: the end-of-text token (or several), after which a row stops.
    Returns the new tokens of each prompt, ``stop`` included where it was drawn.
    """
    if cache is None:
        cache = has_cache(model)
        if not cache:
            note(f"{type(model).__name__} has no KV cache (init_cache and hidden_states(..., cache=)): every new token "
                 "recomputes the whole sequence")  # fmt: skip
    return Generator(model, context, rules, cache)(prompts, max_new_tokens, sampling, stop=stop, vocab=vocab)


def _stops(stop) -> np.ndarray:
    """The stop tokens as an int32 array (``[-1]``: none), an argument of the compiled round."""
    if stop is None:
        return np.full((1,), -1, np.int32)
    ids = [stop] if isinstance(stop, (int, np.integer)) else list(stop)
    return np.asarray(ids or [-1], np.int32)
