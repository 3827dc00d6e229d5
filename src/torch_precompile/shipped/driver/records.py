"""The spec's records as the driver reads ``ARTIFACT_SPEC``: the fields of each record
and the defaults of its last ones (a field at its default is left out of the literal),
which record each list of the spec holds (those in ``SPEC_SINGLE`` hold one record,
not a list), and the fields every variant takes from the top level. Generated from
``torch_precompile.spec`` by ``python -m torch_precompile.spec_listing --write``; do not edit."""

from typing import Any

# fmt: off
SPEC_RECORDS: dict[str, tuple[str, ...]] = {
    "ArtifactSpec": (
        "schema_version", "backend", "torch", "args", "model", "submodules", "inputs", "in_spec",
        "out_spec", "value_guards", "dynamic_dims", "size_relations", "output_aliases", "meshes",
        "distributed", "kernels", "optimizers", "param_groups", "optimizer_state", "wrapped",
        "wrapped_inner", "data_parallel", "fully_sharded", "global_hooks", "read_values", "ambient",
        "mutated", "seed", "autograd", "autograd_for_inputs", "wrappers", "guards", "variants",
    ),
    "TorchBuild": ("version", "git"),
    "Argument": ("name", "is_model", "is_optimizer"),
    "ModelTensor": (
        "name", "kind", "tied_to", "shape", "dtype", "device", "strides", "requires_grad",
        "gets_grad", "hooks", "old_grad",
    ),
    "Submodule": ("name", "training", "cls", "hooks", "forward"),
    "InputLeaf": (
        "path", "kind", "shape", "dtype", "device", "strides", "requires_grad", "bounds", "value",
        "read",
    ),
    "ValueGuard": ("description", "expected"),
    "DynamicDim": ("shape_id", "places"),
    "SizeRelation": ("expr", "readable"),
    "OutputAlias": ("output", "source", "size", "stride", "offset"),
    "Mesh": ("device_type", "shape", "dim_names", "ranks", "groups", "coordinate"),
    "DistributedTensor": (
        "role", "index", "name", "mesh", "placements", "shape", "strides", "local_shape",
        "local_strides",
    ),
    "KernelObject": ("key", "sha256"),
    "Optimizer": ("argument", "cls", "zero_grad_first"),
    "ParamGroup": ("optimizer", "params", "call_time", "baked", "fresh_start"),
    "OptimizerState": ("optimizer", "param", "key", "shape", "dtype", "device", "strides"),
    "WrappedTensor": ("role", "index", "name", "cls", "context", "shape", "strides"),
    "InnerTensor": ("wrapper", "attr", "shape", "dtype", "device", "strides"),
    "DataParallel": ("argument", "model", "group", "world_size", "sync_grads", "forward_sync"),
    "FullyShardedGroup": (
        "model", "module", "reshard_after_forward", "param_dtype", "reduce_dtype", "divide_factor",
    ),
    "ReadValue": ("submodule", "module", "path", "expected", "where", "file"),
    "GuardNote": ("kind", "reads", "outcome", "by", "count"),
    "Ambient": ("autocast", "default_dtype", "deterministic", "modes", "settings"),
    "Autograd": ("inputs", "outputs", "tangent_strides", "saved", "unavailable"),
}
SPEC_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "ArtifactSpec": (
        (), (), (), (), (), (), (), (), (), (), (), (), (), (), (), (), None, (), None, None, None,
        (), (), (),
    ),
    "Argument": (False,),
    "ModelTensor": ((), None),
    "Submodule": (None, (), None),
    "InputLeaf": (None, None, None, None, None, None, None, ()),
    "OutputAlias": (None, None, None),
    "DistributedTensor": (None,),
    "Optimizer": (False,),
    "ParamGroup": (None,),
    "OptimizerState": (None,),
    "InnerTensor": (None,),
    "DataParallel": (None,),
    "FullyShardedGroup": (None, None, None),
    "ReadValue": (None,),
    "GuardNote": ('', '', '', '', 1),
    "Ambient": ((), None, False, (), ()),
    "Autograd": ((), (), (), (), None),
}
SPEC_LISTS: dict[str, str] = {
    "torch": "TorchBuild", "args": "Argument", "model": "ModelTensor", "submodules": "Submodule",
    "inputs": "InputLeaf", "value_guards": "ValueGuard", "dynamic_dims": "DynamicDim",
    "size_relations": "SizeRelation", "output_aliases": "OutputAlias", "meshes": "Mesh",
    "distributed": "DistributedTensor", "kernels": "KernelObject", "optimizers": "Optimizer",
    "param_groups": "ParamGroup", "optimizer_state": "OptimizerState", "wrapped": "WrappedTensor",
    "wrapped_inner": "InnerTensor", "data_parallel": "DataParallel",
    "fully_sharded": "FullyShardedGroup", "read_values": "ReadValue", "guards": "GuardNote",
    "ambient": "Ambient", "autograd": "Autograd", "autograd_for_inputs": "Autograd",
}
SPEC_SINGLE: tuple[str, ...] = ("torch", "ambient", "autograd", "autograd_for_inputs")
SPEC_SHARED: tuple[str, ...] = ("schema_version", "backend", "torch", "args", "kernels")
# fmt: on
