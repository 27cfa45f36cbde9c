"""Training runs: settings, the run's model, setup, the jitted step, the loop, sampling.

``config`` holds the settings (dataclasses that the CLI's flags are generated from);
``model`` turns a preset name, a Hugging Face directory or your own module factory into
the run's model; ``optimizer`` builds AdamW with its schedule and weight-decay mask;
``state`` derives everything a run needs before any array exists (:func:`setup`: mesh, rules, abstract
state, shardings); the planner builds its runs with the same function; ``step`` is the
jitted training and evaluation step; ``rundir`` reads and writes a run directory's files;
``inputs`` gives a run its tokens; ``guards`` watches signals and divergence; ``loop``
restores or initializes, then steps, logs, evaluates and saves; ``seed`` writes seed
checkpoints (``nnxscale init``); ``sampling`` generates text from a run.

Loads lazily: ``nnxscale.training.config`` is read by the CLI before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "TrainConfig": "config", "OptimConfig": "config", "DataConfig": "config", "ModelSettings": "config",
    "ParallelConfig": "config", "CheckpointConfig": "config", "LoggingConfig": "config", "LoraSettings": "config",
    "RunModel": "model", "run_model": "model",
    "make_optimizer": "optimizer", "decay_mask": "optimizer",
    "Setup": "state", "setup": "state", "init_state": "state",
    "make_train_step": "step", "make_eval_step": "step",
    "read_metrics": "rundir",
    "TrainResult": "loop", "train": "loop",
    "init_run": "seed",
    "sample": "sampling", "load_model": "sampling",
}  # fmt: skip

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy(__name__, {name: f"{__name__}.{module}" for name, module in _EXPORTS.items()})
