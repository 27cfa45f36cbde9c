"""Blocks of layers: stacked and scanned (one compiled layer body), or run as a pipeline.

``stack`` stacks ``n`` identical layers into one module whose parameters carry a leading
``layers`` axis and runs them with ``jax.lax.scan`` (with a rematerialization policy);
``pipeline`` runs the same stacked layers as a GPipe or circular pipeline over the mesh's
``stage`` axis, under :func:`use_pipeline`, without changing model code; ``one_f_one_b``
computes a loss and its gradients by the 1F1B schedule (:func:`pipeline_value_and_grad`),
whose memory does not grow with the microbatches. ``stack`` knows nothing of ``pipeline``:
a pipeline takes over the scan through ``stack.layers_run_by``.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "Pipeline": "nnxscale.layers.pipeline",
    "pipeline_cost": "nnxscale.layers.pipeline",
    "pipeline_layers": "nnxscale.layers.pipeline",
    "pipeline_value_and_grad": "nnxscale.layers.one_f_one_b",
    "to_layer_order": "nnxscale.layers.pipeline",
    "to_stage_order": "nnxscale.layers.pipeline",
    "use_pipeline": "nnxscale.layers.pipeline",
    "KEPT_NAMES": "nnxscale.layers.remat",
    "kept": "nnxscale.layers.stack",
    "LAYERS": "nnxscale.layers.stack",
    "REMAT_NAMES": "nnxscale.layers.remat",
    "remat_name": "nnxscale.layers.remat",
    "REMAT_POLICIES": "nnxscale.layers.stack",
    "Rows": "nnxscale.layers.stack",
    "scan_layers": "nnxscale.layers.stack",
    "stack_layers": "nnxscale.layers.stack",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
