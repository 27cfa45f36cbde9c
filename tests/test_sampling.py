"""Generation with a KV cache: greedy output equals greedy decoding by hand (the whole
sequence through the model for every token), for GPT-2 and Llama, on one device and on
``data=2,model=4``; batches of prompts of different lengths, the end-of-text token, the
sampling controls, text longer than the context, a module of your own without a cache."""

import jax
import numpy as np
import pytest
from flax import nnx

import nnxscale
from model_testing import greedy_rows_by_hand, jit_logits, randomize, rules_for
from nnxscale.errors import ConfigError
from nnxscale.models import gpt2, llama
from nnxscale.models.common.generate import ROUND_TO, Generator, Sampling, _round_program, _round_up, generate

BUILD = {"gpt2-tiny": (gpt2.GPT2, gpt2.PRESETS), "llama-tiny": (llama.Llama, llama.PRESETS)}
CONTEXT = 128  # both tiny presets'
PROMPTS = [[72, 101, 108, 108, 111], [100 + i % 20 for i in range(23)], [9, 8]]
GREEDY = Sampling(temperature=0.0)


def _factory(name):
    cls, presets = BUILD[name]
    return lambda: randomize(cls(presets[name], rngs=nnx.Rngs(0)))


def by_hand(model, prompts, n):
    """Greedy decoding by hand (model_testing), every call in a batch of len(PROMPTS) rows: one
    compiled forward per model."""
    return greedy_rows_by_hand(model, prompts, n, CONTEXT, rows=len(PROMPTS))


@pytest.fixture(scope="module", params=sorted(BUILD))
def tiny(request):
    """``(name, model on one device, greedy references of PROMPTS by hand, 24 tokens each)``."""
    model = _factory(request.param)()
    return request.param, model, by_hand(model, PROMPTS, 24)


def test_greedy_with_the_cache_is_greedy_decoding_by_hand(tiny):
    name, model, refs = tiny
    assert generate(model, PROMPTS, max_new_tokens=24, context=CONTEXT, sampling=GREEDY) == refs


def test_greedy_on_a_tensor_parallel_mesh_is_the_same_and_the_cache_is_sharded(tiny):
    """data=2,model=4: the parameters and the cache split over heads and rows; same tokens."""
    name, one, refs = tiny
    mesh = nnxscale.make_mesh("data=2,model=4")
    rules = rules_for(mesh)
    model = nnxscale.place(one, mesh, rules)
    kernel = model.h.attn.c_attn.kernel if name == "gpt2-tiny" else model.layers.self_attn.q_proj.kernel
    assert "model" in str(kernel[...].sharding.spec)  # tensor parallel: split by heads
    gen = Generator(model, CONTEXT, rules)
    assert gen(PROMPTS, 24, GREEDY) == refs

    with jax.set_mesh(mesh), nnxscale.use_rules(rules):
        cache = jax.jit(lambda: model.init_cache(4, 64))()
    heads = model.config.n_head if name == "gpt2-tiny" else model.config.num_key_value_heads
    for layer_stack in cache.values():
        assert layer_stack.shape[-2] == heads
        shard = layer_stack.sharding.shard_shape(layer_stack.shape)
        assert shard[1] == 4 // 2 and shard[-2] == heads // 4, (layer_stack.shape, shard)


def test_recomputation_gives_the_same_tokens_past_the_context_and_when_sampling(tiny):
    """cache=False (the baseline) takes the same windows: equal token for token, greedy and
    drawn, also when the text runs past the context and decoding goes on in rounds."""
    name, model, refs = tiny
    long_prompt = [[(7 * i) % 200 + 1 for i in range(100)], [5, 6]]
    for sampling, n in ((GREEDY, 60), (Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=3), 24)):
        cached = generate(model, long_prompt, max_new_tokens=n, context=CONTEXT, sampling=sampling)
        again = generate(model, long_prompt, max_new_tokens=n, context=CONTEXT, sampling=sampling, cache=False)
        assert cached == again and [len(r) for r in cached] == [n, n]
        if sampling is GREEDY:
            greedy = cached
    # within the context, the greedy text is the one by hand: 100 + 28 tokens fill it, and the 29th comes from its end
    assert greedy[0][:29] == by_hand(model, long_prompt[:1], 29)[0]


def test_each_row_stops_at_the_end_of_text_token(tiny):
    name, model, refs = tiny
    stop = refs[0][5]
    got = generate(model, PROMPTS, max_new_tokens=24, context=CONTEXT, sampling=GREEDY, stop=stop)
    for row, ref in zip(got, refs):
        assert row == (ref[: ref.index(stop) + 1] if stop in ref else ref)
    assert got[0][-1] == stop and len(got[0]) <= 6


def test_sampling_controls(tiny):
    name, model, refs = tiny
    draw = lambda **kw: generate(model, PROMPTS, max_new_tokens=24, context=CONTEXT, sampling=Sampling(**kw))  # noqa: E731
    assert draw(temperature=1.0, top_k=1) == refs  # one candidate: the greedy one
    programs = _round_program.cache_info().currsize
    assert draw(temperature=1.0, top_k=0, top_p=1e-6) == refs  # the smallest set of any mass: the most likely
    first = draw(temperature=1.0, top_k=0, seed=1)
    assert draw(temperature=1.0, top_k=0, seed=1) == first  # a seed repeats
    assert draw(temperature=1.0, top_k=0, seed=2) != first
    stop, vocab = refs[1][3], max(max(r) for r in refs) + 1  # a vocabulary that keeps every greedy token
    greedy_to_stop = generate(model, PROMPTS, max_new_tokens=24, context=CONTEXT, sampling=GREEDY, stop=stop, vocab=vocab)
    assert greedy_to_stop[1] == refs[1][: refs[1].index(stop) + 1]
    # each call made a Generator, and all of them ran the first call's program: the controls,
    # greedy or not, the stop token and the vocabulary are its arguments, so nothing was
    # traced or compiled again
    assert _round_program.cache_info().currsize == programs
    cache_len = _round_up(max(map(len, PROMPTS)) + 24, ROUND_TO, CONTEXT)
    assert _round_program(nnx.graphdef(model), None, True, cache_len)._cache_size() == 1
    # top-k: every drawn token is among the k most likely at its place
    k = 3
    drawn = draw(temperature=2.0, top_k=k, seed=5)[1]
    seq = list(PROMPTS[1])
    for token in drawn:
        padded = np.zeros((len(PROMPTS), CONTEXT), np.int32)  # by_hand's batch: its compiled forward
        padded[0, : len(seq)] = seq
        logits = np.asarray(jit_logits(model, padded))[0, len(seq) - 1]
        assert token in np.argsort(logits)[-k:]
        seq.append(token)


class Bigram(nnx.Module):
    """A module of your own without a cache: logits from the current token alone."""

    def __init__(self, rngs):
        self.table = nnx.Embed(256, 256, rngs=rngs)

    def __call__(self, tokens):
        return self.table(tokens)


def test_a_module_without_a_cache_samples_by_recomputation_and_says_so_once():
    model, notes = Bigram(nnx.Rngs(0)), []
    got = generate(model, PROMPTS, max_new_tokens=10, context=32, sampling=GREEDY, note=notes.append)
    table = np.asarray(model.table.embedding[...])
    for prompt, row in zip(PROMPTS, got):
        expected, last = [], prompt[-1]
        for _ in range(10):
            last = int(np.argmax(table[last]))
            expected.append(last)
        assert row == expected
    assert len(notes) == 1 and "recomputes the whole sequence" in notes[0]
    with pytest.raises(ConfigError, match="init_cache"):
        Generator(model, 32, cache=True)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(sampling=Sampling(temperature=-1.0)), ["--temperature", "-1.0"]),
        (dict(sampling=Sampling(top_p=0.0)), ["--top-p", "(0, 1]"]),
        (dict(sampling=Sampling(top_k=-2)), ["--top-k", "-2"]),
        (dict(sampling=Sampling(seed=-1)), ["--seed"]),
        (dict(max_new_tokens=0), ["--max-new-tokens", "0"]),
        (dict(prompts=[[1], []]), ["every prompt", "end-of-text"]),
    ],
)
def test_bad_sampling_settings_are_one_clear_error(kw, words):
    model = Bigram(nnx.Rngs(0))
    args = dict(prompts=PROMPTS, max_new_tokens=4, context=32, sampling=GREEDY) | kw
    with pytest.raises(ConfigError) as e:
        generate(model, args.pop("prompts"), **args)
    assert all(w in str(e.value) for w in words), str(e.value)
