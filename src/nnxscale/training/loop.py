"""Train any Flax NNX language model in its sharded layout on any mesh, checkpoint, resume exactly.

The trainer names no model. The model is a preset of a registered family (``--model
gpt2-mini``: :mod:`nnxscale.models`), or your own module (``nnxscale.train(cfg,
model=factory)``); either way it becomes a :class:`RunModel`, and everything here asks it.

The loop reads top to bottom: setup (mesh, rules, model, optimizer, shardings), state
(fresh sharded init, ``--init-from``, or resume from the run directory), then the loop
(batch -> jitted step -> log / eval / save), then the end (final save, loss curve).

The train state is one pytree of plain dicts, every leaf a sharded ``jax.Array``::

    {"params": {...}, "opt_state": optax state, "step": int32[], "key": uint32[2]}

Parameters take the layout of the rules; the optimizer state takes the layout of the
parameter it belongs to (``optax.tree_map_params``); step and key are replicated. The
step is a ``jax.jit`` over that pytree with buffer donation, so the host does no NNX
graph walk per step. Dropout keys are ``fold_in(key, step)``: a resumed run draws exactly
the keys an uninterrupted one would.
"""

from __future__ import annotations

import collections
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
from nnxscale.data import text as text
from nnxscale.data import tokens as datalib
from nnxscale.errors import storage_error
from nnxscale.jobs.distributed import StopVote, current
from nnxscale.jobs.watchdog import ProgressWatchdog, timeout_from
from nnxscale.progress import ProgressBar
from nnxscale.sharding.devices import peak_flops
from nnxscale.sharding.mesh import format_mesh, process_findings
from nnxscale.training.config import ConfigError, TrainConfig
from nnxscale.training.guards import _SkipCounter, _StopSignals
from nnxscale.training.inputs import (
    _keep_tokenizer,
    load_data,
    pretrained_source,
    run_tokenizer,
)
from nnxscale.training.optimizer import describe_decay
from nnxscale.training.rundir import (
    _append_metrics,
    _fix_schedule_length,
    _repair_metrics,
    _write_atomic,
    check_run_dir,
    plot_metrics,
)
from nnxscale.training.state import (
    describe_pipeline,
    init_state,
    load_init_params,
    pipeline_notes,
    run_order,
    saved_order,
    setup,
)
from nnxscale.training.step import make_eval_step, make_train_step

#: Training steps dispatched ahead of the host (see the loop).
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
) -> TrainResult:
    """Train (or resume) the run in ``cfg.run_dir``. Everything ``nnxscale train`` does.

    Args:
      cfg: the run's settings. ``cfg.rules`` may be your own rules string
        (``"batch=data,mlp=model,..."``).
      model: your own module instead of the preset ``cfg.model``: a function ``rngs ->
        nnx.Module`` (``lambda rngs: MyLM(..., rngs=rngs)``), called with ``nnx.Rngs(cfg.seed)``.
        The module maps ``(B, T)`` int tokens to ``(B, T, V)`` logits; ``cfg.model`` names it
        in the run directory. Checkpoints, resume (on any mesh) and ``cfg.init_from``
        another run of the module work as for a preset; ``cfg``'s dropout, dtype and remat
        are a preset's options and must stay at their defaults.
      loss: ``loss(model, inputs, targets, *, rngs) -> scalar`` instead of
        :func:`nnxscale.models.next_token_loss` (``rngs``: ``nnx.Rngs(dropout=key)`` in a
        training step, ``None`` in evaluation).
      mesh: a ``jax.sharding.Mesh`` instead of ``make_mesh(cfg.mesh)``.
      progress: draw a progress bar.
      log: where the run's lines go (resume, lint, weight decay, notes).

    Raises NnxscaleError subclasses for what a user can fix: bad settings
    (ConfigError), another trainer on the run directory (RunLockedError), a full or
    read-only disk (StorageError, CheckpointError), a run that diverged (DivergenceError).
    """
    with _StopSignals() as stop:
        return _train(cfg, stop, model=model, loss=loss, progress=progress, mesh=mesh, log=log)


def _train(cfg: TrainConfig, stop: _StopSignals, *, model, loss, progress: bool, mesh, log: Callable[[str], None]) -> TrainResult:
    t_start = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    cfg = _fix_schedule_length(cfg, run_dir)
    s = setup(cfg, mesh, model=model, loss=loss)
    is_main = jax.process_index() == 0

    # Data: tokens (text through the run's tokenizer), validation split, per-process iterators.
    tokenizer = run_tokenizer(cfg, run_dir)
    tokens = load_data(cfg, tokenizer, s.vocab_size())
    train_tokens, val_tokens = datalib.split(tokens.tokens, cfg.data.val_fraction)
    train_it = datalib.train_batches(
        train_tokens,
        seq_len=cfg.data.seq_len,
        global_batch_size=cfg.data.batch_size,
        seed=cfg.seed,
        sharding=s.batch_sharding,  # each process reads the rows its devices hold
    )
    val_batches = []
    if cfg.eval_every:
        if len(val_tokens) >= cfg.data.batch_size * (cfg.data.seq_len + 1):
            val_batches = datalib.eval_batches(
                val_tokens,
                seq_len=cfg.data.seq_len,
                global_batch_size=cfg.data.batch_size,
                max_batches=cfg.data.eval_batches,
                sharding=s.batch_sharding,
            )
        else:
            log(
                f"note: the validation split ({len(val_tokens)} tokens) is smaller than one batch "
                f"({cfg.data.batch_size} x {cfg.data.seq_len + 1}): no validation loss (raise --val-fraction)"
            )

    for finding in process_findings(s.mesh, current().hosts):  # tensor parallelism across hosts
        log(f"lint: {finding}")

    check_run_dir(cfg, run_dir)  # after validating the command itself, before writing anything
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error("creating the run directory", run_dir, e) from None
    # One trainer per run directory, from before its first write until after its last. As
    # the only writer, it deletes the saves that a crash left unfinished (freeing their
    # space) and the steps beyond --keep that a crash left behind.
    lock = RunLock(run_dir, warn=log)
    lock.acquire()
    try:
        ckpt = Checkpointer(checkpoint_dir(run_dir), keep=cfg.keep, remove_unfinished=True)
    except BaseException:
        lock.release()
        raise
    try:
        watch = ProgressWatchdog(
            timeout_from(cfg.hang_timeout), run_dir / "logs", process=jax.process_index(),
            resume_hint="Re-run the same command to resume from the last complete checkpoint.",
        )  # fmt: skip
    except ValueError as e:
        ckpt.close()
        lock.release()
        raise ConfigError(str(e)) from None
    try:  # the checkpointer's background threads must be closed on every path
        watch.__enter__()
        metrics_path = run_dir / "metrics.jsonl"
        skipped_before = 0
        if ckpt.steps():
            watch.phase("restoring the latest checkpoint", compiles=True, kind="save")
            start, state, extras = ckpt.restore_intact(s.abstract, warn=log, set_aside=True)
            watch.progress(f"restored step {start}")
            state = run_order(s, state)  # checkpoints hold layer order
            ckpt.remove_surplus()
            train_it.set_state(extras["data"])
            if extras.get("data_fingerprint") not in (None, tokens.fingerprint):
                raise ConfigError(f"the data in {tokens.description} changed since this run was saved")
            skipped_before = extras.get("skipped_steps", 0)
            if is_main:
                _repair_metrics(metrics_path, start)
            log(f"resumed {run_dir} from step {start} on mesh {format_mesh(s.mesh.shape)}")
        else:
            start = 0
            init_from = cfg.init_from or (pretrained_source(cfg) if model is None else None)
            watch.phase("initializing the model", compiles=True, kind="save")
            params = load_init_params(s, init_from, warn=log) if init_from else None
            state = init_state(s, params)
            if is_main:
                metrics_path.unlink(missing_ok=True)
        if is_main:
            saved = {"train": cfg.to_dict(), "model": s.model.describe(), "data": tokens.description}
            _write_atomic(run_dir / "config.json", json.dumps(saved, indent=2, sort_keys=True) + "\n")
            if tokenizer is not None:
                _keep_tokenizer(tokenizer, run_dir)
        log(describe_decay(s.decay_mask, s.abstract["params"], cfg.optim.weight_decay))
        if s.pipeline is not None:
            log(describe_pipeline(s))
            specs = [sh.spec for sh in jax.tree.leaves(s.param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))]
            for note in pipeline_notes(s.pipeline, s.rules, specs):
                log(f"lint: {note}")

        # A signal may reach one process only: every process stops at the step they agree on,
        # through a vote inside the step (read MAX_IN_FLIGHT steps later, when it is done).
        vote, stopping, agreed = StopVote(s.mesh), None, []
        step_fn = make_train_step(s, vote=True) if vote.needed else make_train_step(s)
        eval_fn = make_eval_step(s)
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        flops_per_token = s.flops_per_token()
        peak = peak_flops(jax.devices()[0])
        peak_total = peak * jax.device_count() if peak else None
        skips = _SkipCounter(cfg.max_bad_steps, skipped_before, cfg.optim.lr, run_dir)

        def evaluate(params) -> Optional[float]:
            # One batch at a time: evaluation programs are independent of each other, and two
            # with cross-process collectives in flight at once can deadlock (docs/multiprocess.md).
            if not val_batches:
                return None
            watch.phase(f"evaluating at step {step}", compiles=not evaluated, kind="eval")
            losses = [float(eval_fn(params, datalib.to_global(b, s.batch_sharding))) for b in val_batches]
            evaluated.append(step)
            watch.progress(f"evaluation at step {step}")
            return float(np.mean(losses))

        def account() -> None:
            """Account for the oldest step in flight, and for the stop vote it carries."""
            done, metrics = in_flight.popleft()
            watch.phase(f"training step {done}", compiles=done == start + 1)
            metrics = jax.device_get(metrics)
            now = time.perf_counter()
            watch.progress(f"step {done}", step_time=(now - completed[0]) / (done - completed[1]) if completed else None)
            completed[:] = [now, done]
            skips.seen(done, metrics)
            if metrics.get("stop"):  # the same on every process, seen at the same step
                agreed.append(int(metrics["stop"]))

        def settle() -> None:
            """Account for every step dispatched so far (they are done or nearly)."""
            while in_flight:
                account()

        def latest_saved() -> Optional[int]:
            ckpt.wait()
            return ckpt.latest_step()

        def save(step: int) -> None:
            settle()
            skips.check(latest_saved)
            extras = {"data": train_it.get_state(), "data_fingerprint": tokens.fingerprint, "config": cfg.to_dict(),
                      "skipped_steps": skips.total}  # fmt: skip
            watch.phase(f"saving step {step}", compiles=not saved, kind="save")
            ordered = saved_order(s, state)
            if ordered is not state:  # a program with collectives beside the step's chain: let it finish
                jax.block_until_ready(ordered)
            ckpt.save(step, ordered, extras, force=True)
            saved.append(step)
            watch.progress(f"save of step {step} (started)")

        completed: list = []  # (time, step) of the last step accounted for
        saved: list[int] = []
        evaluated: list[int] = []
        bar = ProgressBar(progress and is_main, "train", cfg.steps, completed=start)
        last_loss = last_val = tokens_per_s = None
        t_last, s_last = time.perf_counter(), start
        step = start
        # At most MAX_IN_FLIGHT steps are queued on the devices: enough to overlap host and
        # device, and XLA:CPU's in-process collectives deadlock with ~100 queued steps.
        in_flight: collections.deque = collections.deque()  # (step, metrics) not yet accounted for
        try:
            while step < cfg.steps and not stopping:
                batch = datalib.to_global(next(train_it), s.batch_sharding)
                with jax.set_mesh(s.mesh):
                    if vote.needed:
                        state, metrics = step_fn(state, batch, vote.ballot(stop.signal))
                    else:
                        state, metrics = step_fn(state, batch)
                step += 1
                in_flight.append((step, metrics))
                if len(in_flight) > MAX_IN_FLIGHT:
                    account()
                stopping = (agreed[0] if agreed else None) if vote.needed else stop.signal
                if step == start + 1:  # first step includes compilation; time from here on
                    jax.block_until_ready(metrics)
                    t_last, s_last = time.perf_counter(), step
                do_eval = bool(val_batches) and (step % cfg.eval_every == 0 or step == cfg.steps)
                if step % cfg.log_every == 0 or step == cfg.steps or do_eval or stopping:
                    settle()
                    if vote.needed and agreed:
                        stopping = agreed[0]
                    m = {k: float(v) for k, v in jax.device_get(metrics).items() if k not in ("skipped", "stop")}
                    now = time.perf_counter()
                    record = {"step": step, **m, "skipped_steps": skips.total}
                    if step > s_last:
                        dt = (now - t_last) / (step - s_last)
                        tokens_per_s = tokens_per_step / dt
                        record |= {"step_time_s": dt, "tokens_per_s": tokens_per_s,
                                   "tflops_per_s": tokens_per_s * flops_per_token / 1e12}
                        if peak_total:
                            record["mfu"] = tokens_per_s * flops_per_token / peak_total
                        t_last, s_last = now, step
                    if do_eval:
                        last_val = record["val_loss"] = evaluate(state["params"])
                        t_last = time.perf_counter()  # evaluation is not step time
                    last_loss = m["loss"]
                    if is_main:
                        _append_metrics(metrics_path, record)
                    bar.update(step, _progress_info(record))
                else:
                    bar.update(step)
                skips.check(latest_saved)  # nothing is saved, or run, once the run has diverged
                if stopping or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                    save(step)
                    t_last = time.perf_counter()  # the host-side part of a save is not step time
        finally:
            bar.close()
            watch.phase("writing the last checkpoint", kind="save")
            ckpt.wait()
    finally:
        try:
            ckpt.close()
        finally:
            watch.__exit__(None, None, None)
            lock.release()
    if is_main:
        plot_metrics(run_dir)
    return TrainResult(
        run_dir=run_dir,
        start_step=start,
        final_step=step,
        final_loss=last_loss,
        val_loss=last_val,
        tokens_per_s=tokens_per_s,
        wall_s=time.perf_counter() - t_start,
        interrupted_by=stopping if step < cfg.steps else None,  # a signal after the last step stops nothing
        skipped_steps=skips.total,
    )


def _progress_info(record: dict) -> str:
    """The progress bar's text for a logged step: its loss, validation loss and speed."""
    info = f"loss {record['loss']:.3f}"
    if "val_loss" in record:
        info += f"  val {record['val_loss']:.3f}"
    if "tokens_per_s" in record:
        info += f"  {record['tokens_per_s']:,.0f} tok/s"
    return info
