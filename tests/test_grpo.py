"""GRPO's parts: group advantages (a group of equal rewards teaches nothing), the objective and
its gradient against a by-hand computation for each --loss-norm, per-token log-probabilities
against the model's logits (chunked or not), and the reward functions: built-in answers,
loading from a file, and one clear error for a function that raises, miscounts or returns NaN."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxscale.models import find_preset
from nnxscale.models.common.documents import IGNORED
from nnxscale.training import grpo, rewards


def test_group_advantages_by_hand_and_zero_for_equal_rewards():
    r = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # two groups of 4; the second all equal
    got = grpo.group_advantages(r, 4)
    g = np.array(r[:4])
    want = (g - g.mean()) / (math.sqrt(((g - g.mean()) ** 2).sum() / 3) + grpo.STD_EPS)
    np.testing.assert_allclose(got[:4], want, rtol=1e-6)
    assert np.all(got[4:] == 0.0)
    with pytest.raises(ValueError, match="groups of 3"):
        grpo.group_advantages(r, 3)


def _by_hand(lp, old, ref, w, adv, *, beta, eps, norm, max_new):
    """The objective written out token by token in float64 (module docstring's formulas)."""
    B, T = lp.shape
    rows, total = [], 0.0
    for b in range(B):
        row = 0.0
        for t in range(T):
            if not w[b, t]:
                continue
            ratio = math.exp(lp[b, t] - old[b, t])
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            k3 = math.exp(ref[b, t] - lp[b, t]) - (ref[b, t] - lp[b, t]) - 1
            row += -min(ratio * adv[b], clipped * adv[b]) + beta * k3
        rows.append(row / w[b].sum())
        total += row
    if norm == "sequence":
        return sum(rows) / B
    return total / (w.sum() if norm == "token" else B * max_new)


@pytest.mark.parametrize("norm", grpo.LOSS_NORMS)
def test_objective_and_its_gradient_equal_the_by_hand_computation(norm):
    """Per-token log-probabilities from logits theta (B, T, V): the loss equals the by-hand
    sum in float64, and its gradient in theta equals the by-hand loss's central differences;
    rows of different lengths, so the three normalizations differ."""
    rng = np.random.default_rng(0)
    B, T, V = 4, 5, 3
    theta = rng.normal(size=(B, T, V))
    tokens = rng.integers(0, V, (B, T))
    w = np.ones((B, T))
    w[0, 3:] = 0
    w[2, 1:] = 0  # completions of 3, 5, 1 and 5 tokens
    old = np.log(rng.uniform(0.2, 0.6, (B, T)))
    ref = np.log(rng.uniform(0.2, 0.6, (B, T)))
    adv = np.array([1.0, -0.5, 0.3, -1.2])
    kw = dict(beta=0.04, eps=0.2, norm=norm, max_new=6)

    def log_probs(th):
        return jnp.take_along_axis(jax.nn.log_softmax(th, -1), jnp.asarray(tokens)[..., None], -1)[..., 0]

    def loss(th):
        return grpo.objective(log_probs(th), jnp.asarray(w), jnp.asarray(adv)[:, None] * jnp.ones((B, T)), old=jnp.asarray(old),
                              reference=jnp.asarray(ref), kl_beta=0.04, clip_eps=0.2, loss_norm=norm, max_new_tokens=6)[0]  # fmt: skip

    def numpy_loss(th):
        lp = th - np.log(np.exp(th).sum(-1, keepdims=True))
        return _by_hand(np.take_along_axis(lp, tokens[..., None], -1)[..., 0], old, ref, w, adv, **kw)

    with jax.enable_x64():
        got = float(loss(jnp.asarray(theta)))
        grad = np.asarray(jax.grad(loss)(jnp.asarray(theta)))
    assert got == pytest.approx(numpy_loss(theta), rel=1e-10)
    h, fd = 1e-6, np.zeros_like(theta)
    for i in np.ndindex(theta.shape):
        d = np.zeros_like(theta)
        d[i] = h
        fd[i] = (numpy_loss(theta + d) - numpy_loss(theta - d)) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)
    assert np.all(grad[0, 3:] == 0) and np.all(grad[2, 1:] == 0)  # untrained tokens move nothing


def test_one_iteration_is_the_policy_gradient_and_metrics():
    """Without old log-probabilities (one iteration per rollout) the ratio is 1: the gradient
    is -A grad log pi / tokens; nothing is clipped; the KL of the policy to itself is 0."""
    lp = jnp.log(jnp.array([[0.5, 0.25], [0.4, 0.1]]))
    w, adv = jnp.ones((2, 2)), jnp.array([[1.0, 1.0], [-2.0, -2.0]])
    (loss, m), g = jax.value_and_grad(lambda x: grpo.objective(x, w, adv, reference=jax.lax.stop_gradient(x), kl_beta=0.1),
                                      has_aux=True)(lp)  # fmt: skip
    np.testing.assert_allclose(g, -adv / 4, rtol=1e-6)
    assert float(loss) == pytest.approx(-float(jnp.sum(adv)) / 4) and float(m["kl"]) == 0.0 and float(m["clip_fraction"]) == 0.0


@pytest.mark.parametrize("chunk_bytes", [None, 4096])
def test_token_log_probs_are_the_models_log_softmax(monkeypatch, chunk_bytes):
    """llama-tiny's per-token log-probabilities equal log_softmax of its logits at the
    targets, in one piece and in chunks of tokens; IGNORED targets weigh 0."""
    if chunk_bytes:
        monkeypatch.setattr(grpo, "CHUNK_BYTES", chunk_bytes)
    family, config = find_preset("llama-tiny")
    model = family.build(config, rngs=nnx.Rngs(0))
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
    y = jax.random.randint(jax.random.key(2), (2, 16), 0, config.vocab_size).at[:, :5].set(IGNORED)
    lp, w, _ = grpo.token_log_probs(model, x, y)
    logits = jax.nn.log_softmax(model(x).astype(jnp.float32), -1)
    want = jnp.take_along_axis(logits, jnp.maximum(y, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp)[:, 5:], np.asarray(want)[:, 5:], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(w)[:, :5] == 0) and np.all(np.asarray(w)[:, 5:] == 1)


def test_final_answers_and_the_built_in_rewards():
    assert rewards.final_answer(r"so \boxed{\frac{1}{2}} and then \boxed{42}.") == "42"
    assert rewards.final_answer(r"\boxed{x^{2}}") == "x^{2}"
    assert rewards.final_answer("The total is 1,234.5 apples, not 7") == "7"
    assert rewards.final_answer("no numbers") is None
    got = rewards.exact_answer(["q"] * 4, ["it is 12", r"\boxed{12.0}", "13", "none"], answer=["12", "12", "12", "12"])
    assert got == [1.0, 1.0, 0.0, 0.0]
    assert rewards.load("regex:^[a-z ]+$")(["p", "p"], ["only lowercase", "Not"]) == [1.0, 0.0]


def test_reward_functions_from_a_file_and_their_errors(tmp_path):
    """A file's function gets the rows' other fields; weights sum the rewards; a function
    that raises, miscounts or returns NaN is one RewardError line naming it."""
    f = tmp_path / "my_rewards.py"
    f.write_text("def length(prompts, completions, target_len, **kw):\n"
                 "    return [-abs(len(c) - t) for c, t in zip(completions, target_len)]\n"
                 "def boom(prompts, completions, **kw):\n    raise KeyError('answer')\n"
                 "def short(prompts, completions, **kw):\n    return [1.0]\n"
                 "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n")  # fmt: skip
    rs = rewards.load_all([f"{f}:length", "regex:a"], [0.5, 2.0])
    total, each = rewards.score(rs, ["p", "p"], ["aaa", "bbbbb"], {"target_len": [3, 3]})
    np.testing.assert_allclose(total, [0.5 * 0 + 2.0, 0.5 * -2 + 0.0])
    assert set(each) == {f"{f}:length", "regex:a"}
    for name, problem in (("boom", "raised KeyError"), ("short", "returned 1 rewards for 2 completions"),
                          ("nan", "returned nan for completion 0")):  # fmt: skip
        with pytest.raises(rewards.RewardError, match=problem) as e:
            rewards.score(rewards.load_all([f"{f}:{name}"]), ["p", "p"], ["a", "b"], {})
        assert f"{f}:{name}" in str(e.value) and "\n" not in str(e.value)
    for spec, problem in (("nope", "give FILE.py:FUNCTION"), (f"{tmp_path}/missing.py:f", "no such file"),
                          (f"{f}:absent", "has no function 'absent'"), ("regex:(", "not a regular expression")):  # fmt: skip
        with pytest.raises(rewards.RewardError, match=problem):
            rewards.load(spec)
    with pytest.raises(rewards.RewardError, match="2 weights for 1"):
        rewards.load_all(["exact-answer"], [1.0, 2.0])


def _prompts(path, n=16):
    """Prompts whose rows carry an ``answer`` field the rewards may read."""
    import json

    path.write_text("".join(json.dumps({"prompt": f"Q{i}: say it\nA:", "answer": "x" * (i % 3 + 1)}) + "\n" for i in range(n)))
    return path


def _grpo_cfg(tmp_path, name, **overrides):
    from test_train import tiny_cfg

    fields = dict(model="llama-tiny", objective="grpo", data__seq_len=48, data__batch_size=8, grpo__num_generations=4,
                  grpo__max_new_tokens=12, grpo__reward=(f"{tmp_path / 'r.py'}:short", "regex:[a-z]"), optim__lr=1e-2,
                  optim__warmup_steps=0, steps=4, save_every=2)  # fmt: skip
    fields.update(overrides)
    return tiny_cfg(tmp_path / name, _prompts(tmp_path / "prompts.jsonl"), **fields)


def _reward_file(tmp_path, body="return [-float(len(c)) / 12 for c in completions]"):
    (tmp_path / "r.py").write_text(f"def short(prompts, completions, answer, **kw):\n    {body}\n")


def test_grpo_runs_logs_rewards_and_resumes_exactly(tmp_path):
    """llama-tiny, 4 GRPO steps of 2 prompts x 4 completions on fsdp=2,model=4, each rollout
    trained twice (--grpo-iterations 2): metrics.jsonl has the loss, the rewards (each
    function's too), KL, clip fraction, completion lengths and the rollout's time;
    rollouts.jsonl has samples; a run stopped at step 3 (between a rollout's two steps) and
    resumed logs the uninterrupted run's losses and rewards: the sampling keys follow from the
    seed and the step, and the rollout a resumed step trains on was kept."""
    import json

    from test_train import quiet_train

    from nnxscale.training.rundir import read_metrics

    _reward_file(tmp_path)
    quiet_train(_grpo_cfg(tmp_path, "full", mesh="fsdp=2,model=4", grpo__iterations=2))
    full = read_metrics(tmp_path / "full")
    keys = {"loss", "reward", "reward_std", "kl", "clip_fraction", "completion_length", "truncated", "rollout_s"}
    assert keys <= set(full[0]) and f"reward/{tmp_path / 'r.py'}:short" in full[0], full[0]
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    samples = [json.loads(line) for line in (tmp_path / "full" / "rollouts.jsonl").read_text().splitlines()]
    assert samples and samples[0]["samples"][0]["prompt"].startswith("Q")
    quiet_train(_grpo_cfg(tmp_path, "resumed", mesh="fsdp=2,model=4", grpo__iterations=2, steps=3))
    assert sorted(p.name for p in (tmp_path / "resumed" / "rollouts").iterdir()) == ["step_2.npz"]  # the one checkpoint 2 needs
    quiet_train(_grpo_cfg(tmp_path, "resumed", mesh="fsdp=2,model=4", grpo__iterations=2))
    resumed = read_metrics(tmp_path / "resumed")
    assert full[1]["reward"] == full[0]["reward"] and full[2]["reward"] != full[1]["reward"]  # a rollout per 2 steps
    assert abs(full[0]["kl"]) < 1e-6 < full[-1]["kl"]  # the reference is the starting model: KL 0 before any update
    for key in ("loss", "reward", "kl", "clip_fraction"):
        np.testing.assert_allclose([r[key] for r in resumed], [r[key] for r in full], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("body, problem", [("raise ValueError('bad row')", "raised ValueError: bad row"),
                                           ("return [1.0]", "returned 1 rewards for 8 completions"),
                                           ("return [float('nan')] * len(completions)", "returned nan")])  # fmt: skip
def test_a_failing_reward_stops_the_run_in_one_line(tmp_path, capsys, body, problem):
    """From the command line: exit 2, one line naming the function and the problem."""
    from test_cli import run_main

    _reward_file(tmp_path, body)
    _prompts(tmp_path / "prompts.jsonl")
    code, _, err = run_main(capsys, ["train", "--model", "llama-tiny", "--objective", "grpo", "--data", str(tmp_path / "prompts.jsonl"),
                                     "--reward", f"{tmp_path / 'r.py'}:short", "--num-generations", "4", "--batch-size", "8",
                                     "--seq-len", "48", "--max-new-tokens", "12", "--steps", "2",
                                     "--run-dir", str(tmp_path / "run")])  # fmt: skip
    lines = [line for line in err.strip().splitlines() if line.startswith("nnxscale: error")]
    assert code == 2 and len(lines) == 1 and f"r.py:short {problem}" in lines[0], err


@pytest.mark.parametrize("extra, problem", [(["--mesh", "context=2,data=4"], "stage or context axis"),
                                            (["--num-generations", "3"], "a multiple of --num-generations"),
                                            (["--num-generations", "1", "--batch-size", "4"], "at least 2")])  # fmt: skip
def test_grpo_settings_it_cannot_run_are_one_line(tmp_path, capsys, extra, problem):
    from test_cli import run_main

    _reward_file(tmp_path)
    _prompts(tmp_path / "prompts.jsonl")
    argv = ["train", "--model", "llama-tiny", "--objective", "grpo", "--data", str(tmp_path / "prompts.jsonl"), "--reward",
            f"{tmp_path / 'r.py'}:short", "--batch-size", "8", "--seq-len", "48", "--max-new-tokens", "12", "--steps", "1",
            "--run-dir", str(tmp_path / "run"), *extra]  # fmt: skip
    code, _, err = run_main(capsys, argv)
    assert code == 2 and problem in err and len(err.strip().splitlines()) == 1, err


def test_grpo_under_lora_takes_the_base_as_its_reference(tmp_path, capsys):
    """With --lora-rank the reference is the base with the adapters off (no copy in the
    state): the KL is 0 at the first step (the adapters start at zero) and grows as they
    train. ``sample`` continues a prompt from the run (its batch counts completions: sampling
    sizes its own)."""
    from test_cli import run_main
    from test_train import quiet_train

    from nnxscale.training.rundir import read_metrics

    _reward_file(tmp_path)
    quiet_train(_grpo_cfg(tmp_path, "lora", mesh="data=8", steps=3, lora__rank=4, optim__lr=5e-2))
    records = read_metrics(tmp_path / "lora")
    assert abs(records[0]["kl"]) < 1e-6 < records[-1]["kl"], [r["kl"] for r in records]
    code, out, err = run_main(capsys, ["sample", "--run-dir", str(tmp_path / "lora"), "--prompt", "Q1: say it\nA:",
                                       "--max-new-tokens", "4"])  # fmt: skip
    assert code == 0 and out.startswith("Q1: say it"), err


def test_grpo_prompts_as_messages_open_the_assistants_turn(tmp_path):
    """Prompt rows given as messages are rendered by the model's chat template with the
    assistant's turn opened (Llama 3's template: the prompt ends with its assistant header);
    the template's end of turn ends a completion."""
    import json
    import shutil

    from test_chat import byte_tokenizer
    from test_train import quiet_train

    from nnxscale.models import llama

    tok = byte_tokenizer(tmp_path / "tok", "<|eot_id|>", "<|begin_of_text|>", template_field="llama3.jinja")
    config = llama.preset("llama-tiny", vocab_size=272, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    hf = tmp_path / "Llama-chat"
    llama.save_pretrained(llama.Llama(config, rngs=nnx.Rngs(3)), hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, hf / name)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n"
                                                 for i in range(4)))  # fmt: skip
    cfg = _grpo_cfg(tmp_path, "chat", model=str(hf), mesh="data=8", steps=1, data__data=str(tmp_path / "chat.jsonl"),
                    data__seq_len=96, grpo__max_new_tokens=8, grpo__reward=("regex:[a-z]",))  # fmt: skip
    quiet_train(cfg)
    sample = json.loads((tmp_path / "chat" / "rollouts.jsonl").read_text().splitlines()[0])["samples"][0]
    assert sample["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n"), sample["prompt"]
    assert "hi " in sample["prompt"]
    from nnxscale.data import text
    from nnxscale.training import loop
    from nnxscale.training.state import setup

    tokenizer = text.load_tokenizer(hf)
    inputs = loop._Prompts.load(cfg, setup(cfg, ignored_targets=True), tokenizer, lambda _: None)
    assert tokenizer.token_id("<|eot_id|>") in inputs.stop
