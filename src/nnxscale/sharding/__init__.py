"""Where every array lives: meshes, layouts, logical axis rules, state shardings, activations.

``mesh`` builds and validates meshes from a short spec (``data=4,model=2``); ``axes``
names the mesh axes nnxscale knows; ``layout`` is the pure arithmetic of a
``PartitionSpec`` on a mesh (shard shapes and bytes, clear errors); ``rules`` maps the
logical axis names models use to mesh axes (presets for data, FSDP, tensor parallel and
hybrids); ``state`` lays out, creates (sharded init), measures and lints a model's whole
state; ``activations`` constrains activations by logical name inside model code. Nothing
here trains: the trainer (:mod:`nnxscale.training`) and the planner
(:mod:`nnxscale.planning`) build on it.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "ActivationRecord": "nnxscale.sharding.activations",
    "constrain": "nnxscale.sharding.activations",
    "current_rules": "nnxscale.sharding.activations",
    "record_activations": "nnxscale.sharding.activations",
    "use_rules": "nnxscale.sharding.activations",
    "BATCH": "nnxscale.sharding.axes",
    "DATA": "nnxscale.sharding.axes",
    "FSDP": "nnxscale.sharding.axes",
    "MODEL": "nnxscale.sharding.axes",
    "STAGE": "nnxscale.sharding.axes",
    "TENSOR": "nnxscale.sharding.axes",
    "entry_axes": "nnxscale.sharding.axes",
    "format_bytes": "nnxscale.sharding.layout",
    "full_bytes": "nnxscale.sharding.layout",
    "shard_bytes": "nnxscale.sharding.layout",
    "shard_shape": "nnxscale.sharding.layout",
    "state_bytes": "nnxscale.sharding.layout",
    "make_mesh": "nnxscale.sharding.mesh",
    "parse_mesh_spec": "nnxscale.sharding.mesh",
    "LOGICAL_NAMES": "nnxscale.sharding.rules",
    "PRESETS": "nnxscale.sharding.rules",
    "AxisRules": "nnxscale.sharding.rules",
    "DroppedAxis": "nnxscale.sharding.rules",
    "MeshRules": "nnxscale.sharding.rules",
    "get_rules": "nnxscale.sharding.rules",
    "logical": "nnxscale.sharding.rules",
    "logical_to_spec": "nnxscale.sharding.rules",
    "resolve": "nnxscale.sharding.rules",
    "abstract_state": "nnxscale.sharding.state",
    "compile_init": "nnxscale.sharding.state",
    "layout_bytes": "nnxscale.sharding.state",
    "layouts": "nnxscale.sharding.state",
    "lint": "nnxscale.sharding.state",
    "place": "nnxscale.sharding.state",
    "reshard": "nnxscale.sharding.state",
    "sharded_init": "nnxscale.sharding.state",
    "sharding_table": "nnxscale.sharding.state",
    "state_shardings": "nnxscale.sharding.state",
    "state_specs": "nnxscale.sharding.state",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
