"""Train any Flax NNX language model in its sharded layout on any mesh, checkpoint, resume exactly.

The trainer names no model. The model is a preset of a registered family (``--model
gpt2-mini``: :mod:`nnxscale.models`), or your own module (``nnxscale.train(cfg,
model=factory)``); either way it becomes a :class:`RunModel`, and everything here asks it.

:func:`train` reads top to bottom: setup (:func:`~nnxscale.training.state.setup`: mesh,
rules, model, optimizer, shardings), the run's tokens, the run directory opened (lock,
checkpointer, watchdog), then :class:`_Run`: restore or init, then the loop (batch ->
jitted step -> log / evaluate / save), then the end (final save, loss curve). The state and
the step are described in :mod:`nnxscale.training.state` and :mod:`nnxscale.training.step`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from nnxscale.checkpoint.checkpointer import Checkpointer, checkpoint_dir
from nnxscale.checkpoint.runlock import RunLock
from nnxscale.data import text
from nnxscale.data import tokens as datalib
from nnxscale.data.chat import ChatTemplate, template_directory
from nnxscale.errors import storage_error
from nnxscale.jobs.distributed import StopVote, current
from nnxscale.jobs.process import owns_process
from nnxscale.jobs.watchdog import ProgressWatchdog, timeout_from
from nnxscale.layers import attention
from nnxscale.models.common.generate import Sampling
from nnxscale.progress import ProgressBar
from nnxscale.sharding.devices import peak_flops
from nnxscale.sharding.mesh import format_mesh, process_findings
from nnxscale.sharding.state import LAYOUT_FINDINGS, group_findings, lint
from nnxscale.training import adapters as lora_state
from nnxscale.training import grpo, rewards, rollout
from nnxscale.training.config import ConfigError, TrainConfig
from nnxscale.training.guards import SkipCounter, StopSignals
from nnxscale.training.inputs import (
    DataKind, data_kind, document_separator, keep_tokenizer, load_data, pretrained_source, run_tokenizer,
)  # fmt: skip
from nnxscale.training.model import require_weights
from nnxscale.training.observe import ProfileWindow, Scalars, WandbRun, parse_profile_steps
from nnxscale.training.optimizer import describe_decay
from nnxscale.training.rundir import (
    append_metrics, check_run_dir, plot_metrics, repair_metrics, with_saved_schedule_length, write_atomic,
)  # fmt: skip
from nnxscale.training.state import (
    Setup, describe_pipeline, init_state, load_init_params, pipeline_notes, run_order, saved_order, setup,
)  # fmt: skip
from nnxscale.training.step import make_eval_step, make_policy_log_probs, make_train_step, step_compiler_options

#: Training steps dispatched ahead of the host: enough to overlap host and device; XLA:CPU's
#: in-process collectives deadlock with ~100 queued steps.
MAX_IN_FLIGHT = 2


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    final_loss: Optional[float]
    val_loss: Optional[float]
    tokens_per_s: Optional[float]
    wall_s: float
    interrupted_by: Optional[int] = None  # signal number when stopped by SIGTERM/SIGINT
    skipped_steps: int = 0  # steps whose update was skipped (non-finite loss or gradient norm)


def train(
    cfg: TrainConfig,
    *,
    model: Optional[Callable[[nnx.Rngs], nnx.Module]] = None,
    loss: Optional[Callable] = None,
    mesh=None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    step_predictor: Optional[Callable] = None,
) -> TrainResult:
    """Train (or resume) the run in ``cfg.run_dir``. Everything ``nnxscale train`` does.

    Args:
      cfg: the run's settings. ``cfg.parallel.rules`` may be your own rules string
        (``"batch=data,mlp=model,..."``).
      model: your own module instead of the preset ``cfg.model.name``: a function ``rngs ->
        nnx.Module`` (``lambda rngs: MyLM(..., rngs=rngs)``), called with ``nnx.Rngs(cfg.seed)``.
        The module maps ``(B, T)`` int tokens to ``(B, T, V)`` logits; ``cfg.model.name`` names it
        in the run directory. Checkpoints, resume (on any mesh) and ``cfg.model.init_from``
        another run of the module work as for a preset; ``cfg``'s dropout, dtype and remat
        are a preset's options and must stay at their defaults.
      loss: ``loss(model, inputs, targets, *, rngs) -> scalar`` instead of
        :func:`nnxscale.models.next_token_loss` (``rngs``: ``nnx.Rngs(dropout=key)`` in a
        training step, ``None`` in evaluation).
      mesh: a ``jax.sharding.Mesh`` instead of ``make_mesh(cfg.parallel.mesh)``.
      progress: draw a progress bar.
      log: where the run's lines go (resume, lint, weight decay, notes).
      step_predictor: sets the first speed logged beside the step's predicted time:
        ``step_predictor(setup, cfg)`` gives ``None`` where it has no figures for the run's
        devices, else a function of the compiled step that gives its prediction (its
        ``seconds``, ``hardware`` and ``bottleneck``). ``nnxscale.train`` and ``nnxscale
        train`` hand it the planner's (:func:`nnxscale.planning.trainer.step_predictor`);
        ``None``: no prediction.

    A first SIGINT (Ctrl-C) or SIGTERM stops the run at the next step with a checkpoint
    (``TrainResult.interrupted_by``); a second raises ``KeyboardInterrupt`` here, unsaved.

    Raises NnxscaleError subclasses for what a user can fix: bad settings
    (ConfigError), another trainer on the run directory (RunLockedError), a full or
    read-only disk (StorageError, CheckpointError), a run that diverged (DivergenceError).
    """
    t_start = time.perf_counter()
    with StopSignals() as stop:
        run_dir = Path(cfg.run_dir)
        cfg = with_saved_schedule_length(cfg, run_dir)
        WandbRun.check(cfg.logging.wandb)
        step_compiler_options()  # a bad NNXSCALE_STEP_XLA_OPTIONS fails here, before anything is built
        if model is None:
            require_weights(cfg)  # a --model DIR of config.json alone plans, it does not train
        tokenizer = run_tokenizer(cfg, run_dir)
        run_class = _Run
        if cfg.objective == "grpo":  # prompts, sampled from and rewarded; no validation split
            s = setup(cfg, mesh, model=model, loss=loss, ignored_targets=True)
            inputs, run_class = _Prompts.load(cfg, s, tokenizer, log), _GrpoRun
        else:
            kind = data_kind(cfg, tokenizer)
            s = setup(cfg, mesh, model=model, loss=loss, separator=document_separator(cfg, tokenizer, kind),
                      ignored_targets=kind.rows)  # fmt: skip
            inputs = _Inputs.load(cfg, s, tokenizer, kind, log)
        for finding in process_findings(s.mesh, current().hosts):  # tensor parallelism across hosts
            log(f"lint: {finding}")
        for line in layout_findings(s):
            log(f"lint: {line}")
        check_run_dir(cfg, run_dir)  # after validating the command itself, before writing anything
        with _opened(cfg, run_dir, log) as (ckpt, watch):
            run = run_class(cfg, s, inputs, ckpt, watch, stop, log, step_predictor)
            run.restore_or_init(own_model=model is not None)
            run.write_run_files()
            run.describe()
            run.loop(progress)
        stop.check()  # a second signal whose KeyboardInterrupt Python swallowed during the last save
    if jax.process_index() == 0:
        plot_metrics(run_dir)
    return run.result(run_dir, time.perf_counter() - t_start)


def layout_findings(setup: Setup) -> list[str]:
    """The lint lines a run prints when it starts: tensors the mesh cannot split as the rules
    ask (an axis that does not divide is replicated; ``plan`` says the same)."""
    return group_findings([f for f in lint(setup.model_state, setup.mesh, setup.rules) if f.kind in LAYOUT_FINDINGS])


@dataclasses.dataclass
class _Inputs:
    """A run's tokens: the tokenizer, the training iterator and the validation batches."""

    tokenizer: object
    tokens: datalib.TokenData
    train_it: object
    val_batches: list

    @classmethod
    def load(cls, cfg: TrainConfig, setup: Setup, tokenizer, kind: DataKind, log: Callable[[str], None]) -> _Inputs:
        tokens = load_data(cfg, tokenizer, setup.vocab_size(), kind)
        if kind.rows:
            log(f"data: {tokens.description}")
        train_tokens, val_tokens = datalib.split(tokens, cfg.data.val_fraction)
        rows = {"group": tokens.group}
        if tokens.trained is not None:  # which targets the loss trains, split as the tokens are
            val_rows = {"trained": tokens.trained[len(train_tokens):], **rows}
            rows["trained"] = tokens.trained[: len(train_tokens)]
        else:
            val_rows = rows
        d = cfg.data
        # each process reads the rows its devices hold
        train_it = datalib.train_batches(
            train_tokens, seq_len=d.seq_len, global_batch_size=d.batch_size, seed=cfg.seed, sharding=setup.batch_sharding,
            **rows,
        )  # fmt: skip
        val_batches = []
        if cfg.logging.eval_every and len(val_tokens) >= d.batch_size * (d.seq_len + 1):
            val_batches = datalib.eval_batches(
                val_tokens, seq_len=d.seq_len, global_batch_size=d.batch_size, max_batches=d.eval_batches,
                sharding=setup.batch_sharding, **val_rows,
            )  # fmt: skip
        elif cfg.logging.eval_every:
            log(
                f"note: the validation split ({len(val_tokens)} tokens) is smaller than one batch "
                f"({d.batch_size} x {d.seq_len + 1}): no validation loss (raise --val-fraction)"
            )
        return cls(tokenizer, tokens, train_it, val_batches)


@contextlib.contextmanager
def _opened(cfg: TrainConfig, run_dir: Path, log: Callable[[str], None]):
    """The run directory, held: its lock, its checkpointer and the progress watchdog.

    One trainer per run directory, from before its first write until after its last. As the
    only writer, it deletes the saves that a crash left unfinished (freeing their space) and
    the steps beyond --keep that a crash left behind. On the way out: the checkpointer's
    background threads are closed (on every path), then the watchdog, then the lock.
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error("creating the run directory", run_dir, e) from None
    try:
        timeout = timeout_from(cfg.hang_timeout)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if timeout is None and not (owns_process() or current().is_multiprocess):
        timeout = 0  # called from Python, alone: ending the process on a hang is the caller's choice
    with contextlib.ExitStack() as stack:
        lock = RunLock(run_dir, warn=log)
        lock.acquire()
        stack.callback(lock.release)
        watch = ProgressWatchdog(
            timeout, run_dir / "logs", process=jax.process_index(),
            resume_hint="Re-run the same command to resume from the last complete checkpoint.",
        )  # fmt: skip
        ckpt = Checkpointer(checkpoint_dir(run_dir), keep=cfg.checkpoint.keep, remove_unfinished=True)
        stack.callback(watch.__exit__, None, None, None)
        watch.__enter__()
        stack.callback(ckpt.close)
        yield ckpt, watch


class _Run:
    """One training run in an opened run directory: its state, and the steps that move it."""

    def __init__(self, cfg: TrainConfig, setup: Setup, inputs: _Inputs, ckpt: Checkpointer, watch, stop, log,
                 step_predictor: Optional[Callable] = None):  # fmt: skip
        self.cfg, self.s, self.inputs, self.ckpt, self.watch, self.stop, self.log = cfg, setup, inputs, ckpt, watch, stop, log
        self.step_predictor = step_predictor  # see train()
        self.is_main = jax.process_index() == 0
        self.metrics_path = Path(cfg.run_dir) / "metrics.jsonl"
        # A signal may reach one process only: every process stops at the step they agree on,
        # through a vote inside the step (read MAX_IN_FLIGHT steps later, when it is done).
        self.vote = StopVote(setup.mesh)
        self.step_fn = make_train_step(setup, vote=True) if self.vote.needed else make_train_step(setup)
        self.eval_fn = make_eval_step(setup)
        self.agreed: list[int] = []  # stop votes seen, in step order
        self.in_flight: collections.deque = collections.deque()  # (step, metrics) not yet accounted for
        self.completed: list = []  # (time, step) of the last step accounted for
        self.saved: list[int] = []
        self.evaluated: list[int] = []
        self.start = self.step = 0
        self.state = None
        self.stopping: Optional[int] = None
        self.last_loss = self.last_val = self.tokens_per_s = None
        self.t_last, self.s_last = time.perf_counter(), 0
        peak = peak_flops(jax.devices()[0])
        self.peak_total = peak * jax.device_count() if peak else None
        self.skips: Optional[SkipCounter] = None
        self.scalars: Optional[Scalars] = None  # TensorBoard, opened at the first record (after a resume's start is known)
        self.wandb: Optional[WandbRun] = None
        self.profile = ProfileWindow(parse_profile_steps(cfg.logging.profile_steps), cfg.run_dir)
        self.predicted = False  # the first speed logged has been set beside the predicted step time
        self.base: Optional[dict] = None  # a LoRA run's base: its source and fingerprint (adapters_base in checkpoints)

    # -- before the first step ----------------------------------------------------------

    def restore_or_init(self, *, own_model: bool) -> None:
        """Resume from the latest intact checkpoint, or create the state (fresh, or ``--init-from``)."""
        cfg, s, ckpt, watch = self.cfg, self.s, self.ckpt, self.watch
        skipped_before = 0
        init_from = cfg.model.init_from or (None if own_model else pretrained_source(cfg))
        lora = s.model.lora is not None
        if lora:
            self.base = lora_state.base_record(cfg, init_from, s.model)
        if ckpt.steps():
            watch.phase("restoring the latest checkpoint", compiles=True, kind="save")
            # A LoRA run's checkpoints hold its adapters and their optimizer state; the base comes from its source.
            target = lora_state.without_base(s.abstract) if lora else s.abstract
            start, state, extras = ckpt.restore_intact(target, warn=self.log, set_aside=True)
            if lora:
                lora_state.check_base(extras.get("adapters_base"), self.base, f"{cfg.run_dir} (step {start})")
                state[lora_state.BASE] = lora_state.load_base(s, init_from, lambda src: load_init_params(s, src, warn=self.log),
                                                              self.log)  # fmt: skip
            watch.progress(f"restored step {start}")
            self.state = run_order(s, state)  # checkpoints hold layer order
            ckpt.remove_surplus()
            self.inputs.train_it.set_state(extras["data"])
            if extras.get("data_fingerprint") is None:
                self.log(f"warning: checkpoint step {start} records no data fingerprint (saved before nnxscale recorded "
                         "one): that the data is the same as when it was saved cannot be checked")  # fmt: skip
            elif extras["data_fingerprint"] != self.inputs.tokens.fingerprint:
                raise ConfigError(f"the data in {self.inputs.tokens.description} changed since this run was saved")
            skipped_before = extras.get("skipped_steps", 0)
            if self.is_main:
                repair_metrics(self.metrics_path, start)
            self.log(f"resumed {cfg.run_dir} from step {start} on mesh {format_mesh(s.mesh.shape)}")
            self.start = self.step = self.s_last = start
        else:
            watch.phase("initializing the model", compiles=True, kind="save")
            params = load_init_params(s, init_from, warn=self.log) if init_from else None
            self.state = init_state(s, params, log=self.log)
            if self.is_main:
                self.metrics_path.unlink(missing_ok=True)
        self.skips = SkipCounter(cfg.max_bad_steps, skipped_before, cfg.optim.lr, Path(cfg.run_dir))

    def write_run_files(self) -> None:
        """``config.json`` (and the run's tokenizer files), written by process 0."""
        if not self.is_main:
            return
        run_dir, tokenizer = Path(self.cfg.run_dir), self.inputs.tokenizer
        saved = {"train": self.cfg.to_dict(), "model": self.s.model.describe(), "data": self.inputs.tokens.description}
        if self.base is not None:
            saved["adapters_base"] = self.base
        write_atomic(run_dir / "config.json", json.dumps(saved, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            keep_tokenizer(tokenizer, run_dir)

    def describe(self) -> None:
        s = self.s
        if s.model.lora is not None:
            self.log(lora_state.describe(s))
        self.log(describe_decay(s.decay_mask, s.abstract["params"], self.cfg.optim.weight_decay))
        if getattr(s.model.config, "attention", None):  # a family's model (your own module picks its own)
            c = s.model.config
            context = s.rules.length_shard_count
            self.log(attention.describe(c.attention, self.cfg.data.seq_len, c.dtype, s.model.dims.head_width, context,
                                        self.cfg.data.document_mask, attention.platform_of(s.mesh), s.pipeline is not None))
        if s.pipeline is not None:
            self.log(describe_pipeline(s))
            shardings = jax.tree.leaves(s.param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
            for note in pipeline_notes(s.pipeline, s.rules, [sh.spec for sh in shardings], routed=s.model.routed):
                self.log(f"lint: {note}")

    # -- the loop -----------------------------------------------------------------------

    def loop(self, progress: bool) -> None:
        """Dispatch steps until ``cfg.steps`` or an agreed stop; log, evaluate and save on schedule."""
        cfg = self.cfg
        bar = ProgressBar(progress and self.is_main, "train", cfg.steps, completed=self.start)
        try:
            while self.step < cfg.steps and not self.stopping:
                metrics = self.dispatch()
                step = self.step
                if step == self.start + 1:  # the first step includes compilation; time from here on
                    jax.block_until_ready(metrics)
                    self.t_last, self.s_last = time.perf_counter(), step
                do_eval = bool(self.inputs.val_batches) and (step % cfg.logging.eval_every == 0 or step == cfg.steps)
                if step % cfg.logging.log_every == 0 or step == cfg.steps or do_eval or self.stopping:
                    record = self.log_step(metrics, do_eval)
                    bar.update(step, _progress_info(record))
                else:
                    bar.update(step)
                self.skips.check(self.latest_saved)  # nothing is saved, or run, once the run has diverged
                self.stop.check()  # nor after a second signal whose KeyboardInterrupt Python swallowed
                if self.stopping or step == cfg.steps or (cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0):
                    self.save()
                    self.t_last = time.perf_counter()  # the host-side part of a save is not step time
        finally:
            bar.close()
            self.profile.stop(self.state)  # a run that ends inside the window keeps what it traced
            with self.stop.deferred():
                for writer in (self.scalars, self.wandb):
                    if writer is not None:
                        writer.close()
            self.watch.phase("writing the last checkpoint", kind="save")
            self.ckpt.wait()

    def dispatch(self):
        """Start the next step on the devices; account for the oldest beyond MAX_IN_FLIGHT."""
        s = self.s
        batch = datalib.to_global(next(self.inputs.train_it), s.batch_sharding)
        with jax.set_mesh(s.mesh), self.profile.step(self.step + 1):
            if self.vote.needed:
                self.state, metrics = self.step_fn(self.state, batch, self.vote.ballot(self.stop.signal))
            else:
                self.state, metrics = self.step_fn(self.state, batch)
        self.step += 1
        self.profile.after(self.step, self.state)
        self.in_flight.append((self.step, metrics))
        if len(self.in_flight) > MAX_IN_FLIGHT:
            self.account()
        self.stopping = (self.agreed[0] if self.agreed else None) if self.vote.needed else self.stop.signal
        return metrics

    def account(self) -> None:
        """Account for the oldest step in flight, and for the stop vote it carries."""
        done, metrics = self.in_flight.popleft()
        self.watch.phase(f"training step {done}", compiles=done == self.start + 1)
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        step_time = (now - self.completed[0]) / (done - self.completed[1]) if self.completed else None
        self.watch.progress(f"step {done}", step_time=step_time)
        self.completed[:] = [now, done]
        self.skips.seen(done, metrics)
        if metrics.get("stop"):  # the same on every process, seen at the same step
            self.agreed.append(int(metrics["stop"]))

    def settle(self) -> None:
        """Account for every step dispatched so far (they are done or nearly)."""
        while self.in_flight:
            self.account()

    def log_step(self, metrics, do_eval: bool) -> dict:
        """The metrics record of the current step (speed since the last one; validation loss)."""
        self.settle()
        if self.vote.needed and self.agreed:
            self.stopping = self.agreed[0]
        m = {k: float(v) if np.ndim(v) == 0 else [round(float(x), 6) for x in np.ravel(v)]  # a vector: a list
             for k, v in jax.device_get(metrics).items() if k not in ("skipped", "stop")}  # fmt: skip
        now, step, d = time.perf_counter(), self.step, self.cfg.data
        record = {"step": step, **m, "skipped_steps": self.skips.total}
        if step > self.s_last:
            dt = (now - self.t_last) / (step - self.s_last)
            self.tokens_per_s = d.batch_size * d.seq_len / dt
            flops = self.tokens_per_s * self.s.flops_per_token()
            record |= {"step_time_s": dt, "tokens_per_s": self.tokens_per_s, "tflops_per_s": flops / 1e12}
            if self.peak_total:
                record["mfu"] = flops / self.peak_total
            if not self.predicted:  # the first speed: beside the step's predicted time, where it is known
                self.predicted = True
                predicted = self.predicted_step()
                if predicted is not None:
                    record["predicted_step_time_s"] = predicted.seconds
                    self.log(f"speed: {dt:.3g} s per step measured, {predicted.seconds:.3g} s predicted "
                             f"({predicted.seconds / dt:.2f}x; {predicted.hardware}: {predicted.bottleneck})")  # fmt: skip
            self.t_last, self.s_last = now, step
        if do_eval:
            self.last_val = record["val_loss"] = self.evaluate()
            self.t_last = time.perf_counter()  # evaluation is not step time
        self.last_loss = m["loss"]
        if self.is_main:
            self.write_record(record)
        return record

    def predicted_step(self):
        """The step's predicted time on these devices, by the run's ``step_predictor`` (see
        :func:`train`) over the program the first step compiled: lowering it again is a cache
        hit, nothing is compiled twice. ``None`` without a predictor, where it has no figures
        for these devices (XLA:CPU, an unknown accelerator), or where the prediction fails."""
        s = self.s
        predict = None if self.step_predictor is None else self.step_predictor(s, self.cfg)
        if predict is None:
            return None
        args = (s.abstract, s.abstract_batch)
        if self.vote.needed:
            args += (jax.ShapeDtypeStruct((s.mesh.size,), np.int32, sharding=StopVote.sharding(s.mesh)),)
        try:
            with jax.set_mesh(s.mesh):
                compiled = self.step_fn.lower(*args).compile()
            return predict(compiled)
        except Exception as e:  # noqa: BLE001 - a diagnostic: it never stops the run
            self.log(f"note: the step-time prediction failed ({type(e).__name__}: {e}); training goes on")
            return None

    def write_record(self, record: dict) -> None:
        """``metrics.jsonl``, TensorBoard and W&B; a second signal takes effect after them."""
        with self.stop.deferred():
            append_metrics(self.metrics_path, record)
            if self.cfg.logging.tensorboard:
                if self.scalars is None:
                    self.scalars = Scalars(self.cfg.run_dir, self.start)
                self.scalars.write(record)
            if self.cfg.logging.wandb:
                if self.wandb is None:
                    self.wandb = WandbRun(self.cfg.logging.wandb, self.cfg.run_dir, self.cfg.to_dict())
                self.wandb.write(record)

    def evaluate(self) -> Optional[float]:
        """The mean validation loss. One batch at a time: evaluation programs are independent of
        each other, and two with cross-process collectives in flight at once can deadlock
        (docs/multiprocess.md)."""
        batches = self.inputs.val_batches
        if not batches:
            return None
        self.watch.phase(f"evaluating at step {self.step}", compiles=not self.evaluated, kind="eval")
        sharding = self.s.batch_sharding
        losses = [float(self.eval_fn(self.state, datalib.to_global(b, sharding))) for b in batches]
        self.evaluated.append(self.step)
        self.watch.progress(f"evaluation at step {self.step}")
        return float(np.mean(losses))

    def latest_saved(self) -> Optional[int]:
        self.ckpt.wait()
        return self.ckpt.latest_step()

    def save(self) -> None:
        """Start saving the current step (asynchronously): state in layer order, data position, config."""
        step = self.step
        self.settle()
        self.skips.check(self.latest_saved)
        extras = {"data": self.inputs.train_it.get_state(), "data_fingerprint": self.inputs.tokens.fingerprint,
                  "config": self.cfg.to_dict(), "skipped_steps": self.skips.total}  # fmt: skip
        if self.base is not None:  # a LoRA run saves its adapters, and names the base they belong to
            extras["adapters_base"] = self.base
        self.watch.phase(f"saving step {step}", compiles=not self.saved, kind="save")
        trained = lora_state.without_base(self.state)
        ordered = saved_order(self.s, trained)
        if ordered is not trained:  # a program with collectives beside the step's chain: let it finish
            jax.block_until_ready(ordered)
        self.ckpt.save(step, ordered, extras, force=True)
        self.saved.append(step)
        self.watch.progress(f"save of step {step} (started)")

    def result(self, run_dir: Path, wall_s: float) -> TrainResult:
        return TrainResult(
            run_dir=run_dir,
            start_step=self.start,
            final_step=self.step,
            final_loss=self.last_loss,
            val_loss=self.last_val,
            tokens_per_s=self.tokens_per_s,
            wall_s=wall_s,
            # a signal after the last step stops nothing
            interrupted_by=self.stopping if self.step < self.cfg.steps else None,
            skipped_steps=self.skips.total,
        )


class _Prompts:
    """``--objective grpo``'s inputs: the prompts and the order steps take them in (saved with
    a checkpoint), the reward functions, and how a completion ends and is read."""

    def __init__(self, tokenizer, decoder, prompts, order, rewards, stop):
        self.tokenizer, self.decoder, self.prompts, self.train_it, self.rewards, self.stop = (
            tokenizer, decoder, prompts, order, rewards, stop)  # fmt: skip
        self.tokens, self.val_batches = prompts, []  # what a run's files and checkpoints record of its data

    @classmethod
    def load(cls, cfg: TrainConfig, setup: Setup, tokenizer, log: Callable[[str], None]) -> "_Prompts":
        if cfg.data.data is None:
            raise ConfigError("--objective grpo needs --data PROMPTS.jsonl (rows of prompt or messages, and the fields "
                              "the rewards read)")  # fmt: skip
        if current().is_multiprocess:
            raise ConfigError("--objective grpo runs in one process for now (its rollouts are sampled on the host's devices)")
        if setup.pipeline is not None or setup.rules.length_shard_count > 1:
            raise ConfigError("--objective grpo samples with the KV cache, which a stage or context axis cannot split: "
                              "use data, fsdp and model axes")  # fmt: skip
        vocab = setup.vocab_size()
        decoder = tokenizer if tokenizer is not None else (text.ByteTokenizer() if vocab == text.BYTE_VOCAB else None)
        if decoder is None:
            raise ConfigError(f"--objective grpo decodes completions for the rewards: the model's vocabulary is {vocab:,}, "
                              "not bytes: give its tokenizer (--tokenizer, or a Hugging Face --model DIR)")  # fmt: skip
        where = template_directory(tokenizer) if tokenizer is not None else None
        template = ChatTemplate.find(where) if where is not None else None
        g = cfg.grpo
        prompts = rollout.load_prompts(cfg.data.data, decoder, template, longest=cfg.data.seq_len - g.max_new_tokens,
                                       skip_bad_rows=cfg.data.skip_bad_rows)  # fmt: skip
        weights = None if g.reward_weights is None else _weights(g.reward_weights)
        chosen = rewards.load_all(g.reward, weights)
        stop = [decoder.separator] if decoder.separator is not None else []
        end = template.turn_end() if template is not None else None
        if end and hasattr(decoder, "token_id") and decoder.token_id(end) is not None:
            stop.append(decoder.token_id(end))
        log(f"data: {prompts.description}; rewards: {', '.join(r.spec for r in chosen)}")
        return cls(tokenizer, decoder, prompts, rollout.PromptOrder(len(prompts), cfg.seed), chosen, stop or None)


def _weights(text_: str) -> list[float]:
    try:
        return [float(w) for w in text_.split(",")]
    except ValueError:
        raise ConfigError(f"--reward-weights {text_!r}: give comma-separated numbers, e.g. 1,0.5") from None


class _GrpoRun(_Run):
    """A GRPO run: before every ``--grpo-iterations`` th step, a rollout of the step's prompts
    from the current parameters, scored by the rewards; the steps train on it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.old_fn = make_policy_log_probs(self.s)  # the step is make_train_step's: it binds the batch's advantages
        self.batch, self.host = None, {}
        self.predicted = True  # the GRPO step's batch is not the planner's: no prediction
        self.rollouts_path = Path(self.cfg.run_dir) / "rollouts.jsonl"

    def dispatch(self):
        g = self.cfg.grpo
        if self.step % g.iterations == 0:
            self.settle()  # the rollout samples from the parameters every step so far has made
            self.batch, self.host = self.rollout()
        elif self.batch is None:  # resumed between two rollouts: the one these steps train on, as it was kept
            self.batch, self.host = self.kept_rollout()
        with jax.set_mesh(self.s.mesh), self.profile.step(self.step + 1):
            self.state, metrics = self.step_fn(self.state, self.batch)
        self.step += 1
        self.profile.after(self.step, self.state)
        metrics = {**metrics, **self.host}
        self.in_flight.append((self.step, metrics))
        if len(self.in_flight) > MAX_IN_FLIGHT:
            self.account()
        self.stopping = self.stop.signal
        return metrics

    def rollout(self) -> tuple[dict, dict]:
        """The next prompts' completions, their rewards and advantages: the batch, on the
        mesh, and what the step's record adds (rewards, lengths, the rollout's time)."""
        cfg, g, inputs = self.cfg, self.cfg.grpo, self.inputs
        self.watch.phase(f"sampling the rollout of step {self.step + 1}", compiles=self.batch is None)
        t = time.perf_counter()
        G = g.num_generations
        chosen = inputs.train_it.take(cfg.data.batch_size // G)
        prompts = [inputs.prompts.tokens[i] for i in chosen]
        sampling = Sampling(temperature=g.temperature, top_k=0, top_p=g.top_p, seed=rollout.sampling_seed(cfg.seed, self.step))
        completions = rollout.sample_completions(self.s, self.state, prompts, G, g.max_new_tokens, sampling,
                                                 stop=inputs.stop, vocab=self.s.vocab_size())  # fmt: skip
        sampled_s = time.perf_counter() - t
        rows = [i for i in chosen for _ in range(G)]
        stops = set(inputs.stop or ())
        texts = [inputs.decoder.decode([x for x in c if x not in stops]) for c in completions]
        fields = {k: [v[i] for i in rows] for k, v in inputs.prompts.fields.items()}
        total, each = rewards.score(inputs.rewards, [inputs.prompts.texts[i] for i in rows], texts, fields)
        advantages = grpo.group_advantages(total, G)
        host = rollout.training_batch([inputs.prompts.tokens[i] for i in rows], completions, advantages, cfg.data.seq_len)
        batch = datalib.to_global(host, self.s.batch_sharding)
        if g.iterations > 1:
            with jax.set_mesh(self.s.mesh):
                batch["old"] = self.old_fn(self.state, batch)
        record = {"reward": float(total.mean()), "reward_std": float(total.std()), "rollout_s": sampled_s,
                  **{f"reward/{spec}": float(v.mean()) for spec, v in each.items()},
                  **rollout.completion_stats(completions, g.max_new_tokens, inputs.stop)}  # fmt: skip
        if self.is_main and (self.step == 0 or (self.step + 1) % max(cfg.logging.log_every, 1) == 0):
            rollout.write_samples(self.rollouts_path, self.step + 1, inputs.prompts.texts, rows, texts, total)
        if g.iterations > 1 and self.is_main:  # the next steps train on it too: kept, so a resume between them has it
            oldest = min(self.ckpt.steps() or [self.step])  # a resume from any checkpoint kept finds its rollout
            rollout.keep(self.kept_dir, self.step, {**host, "old": np.asarray(jax.device_get(batch["old"]))}, record,
                         drop_before=oldest - oldest % g.iterations)  # fmt: skip
        self.watch.progress(f"rollout of step {self.step + 1}")
        return batch, record

    @property
    def kept_dir(self) -> Path:
        return Path(self.cfg.run_dir) / "rollouts"

    def kept_rollout(self) -> tuple[dict, dict]:
        """The rollout the steps since the last one train on, as :meth:`rollout` kept it."""
        made = self.step - self.step % self.cfg.grpo.iterations
        arrays, record = rollout.kept(self.kept_dir, made)
        return datalib.to_global(arrays, self.s.batch_sharding), record


def _progress_info(record: dict) -> str:
    """The progress bar's text for a logged step: its loss, validation loss and speed."""
    info = f"loss {record['loss']:.3f}"
    if "val_loss" in record:
        info += f"  val {record['val_loss']:.3f}"
    if "reward" in record:  # --objective grpo
        info += f"  reward {record['reward']:.3f}"
    if "tokens_per_s" in record:
        info += f"  {record['tokens_per_s']:,.0f} tok/s"
    return info
