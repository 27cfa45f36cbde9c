"""What a run writes besides ``metrics.jsonl``: TensorBoard scalars and profiler traces.

- :class:`Scalars`: every number of every ``metrics.jsonl`` record as a TensorBoard scalar
  under ``RUN_DIR/tensorboard`` (``tensorboardX``'s writer; TensorFlow is not needed). A
  resumed run starts its events with a purge at its first step, so the steps it trains
  again after an interruption replace the ones logged before, in TensorBoard as in
  ``metrics.jsonl``. Process 0 writes.
- :class:`WandbRun`: the same records in Weights & Biases with ``--wandb PROJECT``, when
  ``wandb`` is installed (it is never a dependency).
- :class:`ProfileWindow`: ``--profile-steps A:B`` records a ``jax.profiler`` trace of
  steps ``A`` to ``B`` (inclusive) under ``RUN_DIR/profile``, each step annotated
  (``StepTraceAnnotation("train", step_num=step)``), viewable in TensorBoard's profile
  plugin or Perfetto (``perfetto_trace.json.gz``). Outside the window nothing is traced.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from nnxscale.errors import ConfigError

#: Where a run's TensorBoard event files and profiler traces go, inside the run directory.
TENSORBOARD_DIR = "tensorboard"
PROFILE_DIR = "profile"


class Scalars:
    """TensorBoard event files of a run's metrics records (see the module docstring)."""

    def __init__(self, run_dir, start_step: int = 0):
        from tensorboardX import SummaryWriter  # protobuf: slow to import, for event files only

        # Whatever an earlier session logged after this run's start (its checkpoint, or step 0
        # when a run killed before its first save starts again) is replaced.
        self._writer = SummaryWriter(logdir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=start_step + 1)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbRun:
    """Weights & Biases, when ``--wandb PROJECT`` asks for it: one W&B run per run directory
    (its id kept in ``RUN_DIR/wandb_id``, so a resume continues the same W&B run), every
    metrics record logged at its step. ``wandb`` is never a dependency of nnxscale."""

    @staticmethod
    def check(project: Optional[str]) -> None:
        """Before anything is written: ``--wandb`` without the package is one line."""
        if project is None:
            return
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(f"--wandb {project}: the wandb package is not installed: pip install wandb (and wandb login)") from None

    def __init__(self, project: str, run_dir, config: dict):
        import wandb  # optional: --wandb only

        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        self._run = wandb.init(project=project, id=run_id, resume="allow", name=run_dir.name, dir=str(run_dir),
                               config=config)  # fmt: skip
        if not id_file.exists():
            id_file.write_text(run_id + "\n")

    def write(self, record: dict) -> None:
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


def parse_profile_steps(text: Optional[str]) -> Optional[tuple[int, int]]:
    """``"A:B"`` -> ``(A, B)``, steps ``1 <= A <= B``; ``None`` -> ``None``.

    Raises ConfigError, naming the flag, for anything else.
    """
    if text is None:
        return None
    first, sep, last = str(text).partition(":")
    try:
        a, b = int(first), int(last if sep else first)
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise ConfigError(f"--profile-steps {text!r} must be A:B, two steps with 1 <= A <= B (e.g. 10:12), or one step")
    return a, b


class ProfileWindow:
    """Starts a ``jax.profiler`` trace before step ``A`` and stops it once step ``B`` is done."""

    def __init__(self, steps: Optional[tuple[int, int]], run_dir):
        self.steps = steps
        self.directory = Path(run_dir) / PROFILE_DIR
        self.active = False

    def step(self, step: int):
        """A context for dispatching ``step``: the trace starts at ``A``; the step is annotated."""
        import jax  # jax: not while the CLI starts

        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return contextlib.nullcontext()
        if not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, outputs) -> None:
        """After dispatching ``step``: at ``B`` (or the run's last step), wait for it and stop."""
        if self.active and step >= self.steps[1]:
            self.stop(outputs)

    def stop(self, outputs=None) -> None:
        import jax  # jax: not while the CLI starts

        if not self.active:
            return
        if outputs is not None:
            jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.active = False
