"""The trainer with its first speed line set beside the step's predicted time: ``nnxscale.train``.

The trainer (:func:`nnxscale.training.loop.train`) sits below the planner and predicts nothing
itself; it is handed a ``step_predictor``. :func:`step_predictor` is the planner's (the
devices' figures, :func:`nnxscale.planning.calibration.local_hardware`, and the roofline walk
over the compiled step, :func:`nnxscale.planning.steptime.predict`), and :func:`train`, which
``nnxscale.train`` and ``nnxscale train`` call, is the trainer handed it.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from nnxscale.planning import calibration, steptime
from nnxscale.training import loop
from nnxscale.training.config import TrainConfig
from nnxscale.training.state import Setup


def step_predictor(setup: Setup, cfg: TrainConfig) -> Optional[Callable]:
    """The run's step-time prediction: ``None`` where there are no figures for its devices
    (XLA:CPU, an unknown accelerator: :func:`~nnxscale.planning.calibration.local_hardware`),
    else a function of the compiled step that gives its
    :class:`~nnxscale.planning.steptime.StepTime` on them."""
    hw = calibration.local_hardware(setup.mesh)
    if hw is None:
        return None
    tokens = cfg.data.batch_size * cfg.data.seq_len

    def predict(compiled) -> steptime.StepTime:
        return steptime.predict(compiled.as_text(), hw, n_devices=setup.mesh.size, tokens_per_step=tokens,
                                model_flops_per_step=setup.flops_per_token() * tokens, compute_dtype=cfg.model.dtype,
                                fresh_bytes=steptime.fresh_bytes_of(compiled.memory_analysis()))  # fmt: skip

    return predict


@functools.wraps(loop.train)
def train(cfg: TrainConfig, **kwargs):
    kwargs.setdefault("step_predictor", step_predictor)
    return loop.train(cfg, **kwargs)
