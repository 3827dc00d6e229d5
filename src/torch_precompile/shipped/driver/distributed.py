"""The driver part for artifacts with DTensors: DTensors at the call, local tensors in the graph.

Before the graph runs, each DTensor parameter, buffer and input is checked against its record
(placements, global and local shape, mesh) and swapped for its local tensor; gradients and
result leaves that were DTensors at capture are rewrapped after it. The graph's collectives
name their process groups; the first call binds those names to the runtime mesh's groups
through ``torch._C._distributed_c10d``'s process-group registry. DTensor is imported only
when this part is built.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.core import Driver
from torch_precompile.shipped.driver.tensor_rules import PrecompileError, check_layout


class DistributedCall:
    """``call`` over the local tensors of a call's DTensors, gradients and results rewrapped."""

    def __init__(self, driver: Driver, call: Callable[[list[Any]], list[Any]]) -> None:
        from torch.distributed.tensor import DTensor

        spec = driver.spec
        self.call = call
        self.dtensor = DTensor
        self.meshes = spec.meshes
        self.agreed = False  # whether a first call passed on every rank (see first_call)
        self.inputs = [(d, _placements(d)) for d in spec.distributed if d.role == "input"]
        self.by_input = {d.index: (d, placements) for d, placements in self.inputs}
        self.results = [(d, _placements(d)) for d in spec.distributed if d.role == "result"]
        self.grad_indices = driver.grad_indices
        self.num_results = driver.num_results
        self.guards_start = driver.guards_start

    def __call__(self, flat: list[Any]) -> list[Any]:
        meshes = self.unwrap(flat) if self.agreed else self.first_call(flat)
        outputs = self.call(flat)
        results = outputs[: self.num_results]
        grads = outputs[self.num_results : self.guards_start]
        for position, index in enumerate(self.grad_indices):
            entry = self.by_input.get(index)
            if entry is not None:
                grads[position] = self.rewrap(meshes, entry, grads[position])
        for entry in self.results:
            index = entry[0].index
            results[index] = self.rewrap(meshes, entry, results[index])
        return [*results, *grads, *outputs[self.guards_start :]]

    def first_call(self, flat: list[Any]) -> list[Any]:
        """``unwrap``, then every rank of the mesh learns whether all ranks passed.

        A rank the artifact cannot serve raises ``PrecompileError``; the others would then
        wait for it in the graph's first collective. So on the first call the ranks agree
        first, and all of them raise.
        """
        mesh = next((t.device_mesh for t in flat if isinstance(t, self.dtensor)), None)
        error: PrecompileError | None = None
        meshes: list[Any] = []
        try:
            meshes = self.unwrap(flat)
        except PrecompileError as e:
            error = e
        if mesh is None:  # no DTensor given at all: nothing to agree over
            if error is not None:
                raise error
            return meshes
        failed = torch.tensor([0 if error is None else 1], device=mesh.device_type)
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(
                failed, torch.distributed.ReduceOp.MAX, group=mesh.get_group(dim)
            )
        if error is not None:
            raise error
        if failed.item():
            raise PrecompileError(
                "another rank of the device mesh refused this artifact at its first call (its "
                "own error says why), so no rank runs it: the graph's collectives would wait "
                "for that rank forever."
            )
        self.agreed = True
        return meshes

    def unwrap(self, flat: list[Any]) -> list[Any]:
        """Swap each DTensor in ``flat`` for its local tensor after checking it; returns the
        runtime mesh bound to each mesh record."""
        meshes: list[Any] = [None] * len(self.meshes)
        for record, _ in self.inputs:
            tensor = flat[record.index]
            check_dtensor(self, record, tensor)
            local = tensor.to_local()
            if local.shape != torch.Size(record.local_shape):
                raise PrecompileError(
                    f"{record.name}: this rank's shard has shape {tuple(local.shape)}; the "
                    f"artifact was built for a shard of shape {tuple(record.local_shape)} "
                    "(uneven sharding gives ranks different shards). Precompile on every rank "
                    "(compile_on_one_rank=False), or pick sizes that divide evenly."
                )
            if meshes[record.mesh] is None:
                meshes[record.mesh] = bind_mesh(self.meshes[record.mesh], tensor.device_mesh)
            if record.local_strides is not None:
                check_layout(local, record.local_strides, f"{record.name} (its local shard)")
            flat[record.index] = local
        return meshes

    def rewrap(self, meshes: Sequence[Any], entry: Any, local: Any) -> Any:
        record, placements = entry
        return self.dtensor.from_local(
            local,
            meshes[record.mesh],
            placements,
            run_check=False,
            shape=torch.Size(record.shape),
            stride=record.strides,
        )


def check_dtensor(part: DistributedCall, record: Any, tensor: Any) -> None:
    """A DTensor with the recorded placements and global shape, on the recorded kind of mesh."""
    mesh = part.meshes[record.mesh]
    expected = (
        f"a DTensor of shape {tuple(record.shape)} with placements "
        f"{_listed(record.placements)} on {_mesh_text(mesh)}"
    )
    if not isinstance(tensor, part.dtensor):
        raise PrecompileError(
            f"{record.name}: expected {expected}, got a plain tensor. Shard the model and "
            "inputs as at capture (parallelize_module, distribute_tensor)."
        )
    given = tuple(placement_text(p) for p in tensor.placements)
    if given != record.placements or tensor.shape != torch.Size(record.shape):
        raise PrecompileError(
            f"{record.name}: expected {expected}; got shape {tuple(tensor.shape)} with "
            f"placements {_listed(given)}. Shard it as at capture, or precompile again."
        )
    check_mesh(mesh, tensor.device_mesh, record.name)


def check_mesh(record: Any, mesh: Any, what: str) -> None:
    """A runtime mesh must have the recorded device type, shape and dim names.

    Its ranks may differ: the sub-mesh ``mesh["tp"]`` of another data-parallel replica serves.
    """
    if (mesh.device_type, tuple(mesh.shape), mesh.mesh_dim_names) != (
        record.device_type,
        tuple(record.shape),
        record.dim_names,
    ):
        given = _mesh_text(
            record._replace(
                device_type=mesh.device_type,
                shape=tuple(mesh.shape),
                dim_names=mesh.mesh_dim_names,
                ranks=mesh.mesh.flatten().tolist(),
            )
        )
        raise PrecompileError(
            f"{what} lives on {given}; the artifact was captured on {_mesh_text(record)}. "
            "Initialize that mesh (torch.distributed.init_process_group, then "
            f"init_device_mesh({record.device_type!r}, {tuple(record.shape)}"
            + (f", mesh_dim_names={tuple(record.dim_names)}" if record.dim_names else "")
            + ")), or precompile again for this one."
        )


def bind_mesh(record: Any, mesh: Any) -> Any:
    """Check this rank's place in a runtime mesh and bind the graph's group names to its
    groups (once per mesh, unless another mesh took the names meanwhile)."""
    coordinate = tuple(mesh.get_coordinate() or ())
    if record.coordinate is not None and coordinate != tuple(record.coordinate):
        raise PrecompileError(
            f"this rank sits at coordinate {coordinate} of {_mesh_text(record)}, but the "
            f"artifact was built at coordinate {tuple(record.coordinate)} and its graph "
            "depends on the rank (it takes this rank's slice of a replicated tensor). Load the "
            "artifact built on this rank, or precompile on every rank."
        )
    if _BOUND_MESHES.get(tuple(record.groups)) is not mesh:
        bind_groups(mesh, record.groups)
    return mesh


# Group names -> the mesh whose groups they resolve to in this process now.
_BOUND_MESHES: dict[tuple[str, ...], Any] = {}


def bind_groups(mesh: Any, names: Sequence[str]) -> None:
    """Make ``names[d]`` resolve to ``mesh``'s process group for dim ``d`` in this process."""
    registry: Any = torch._C._distributed_c10d  # private; its stubs differ between releases
    for dim, name in enumerate(names):
        group = mesh.get_group(dim)
        with contextlib.suppress(RuntimeError, KeyError, ValueError):  # not bound here yet
            registry._unregister_process_group(name)
        registry._register_process_group(name, group)
    _BOUND_MESHES[tuple(names)] = mesh


def placement_text(placement: Any) -> str:
    """A DTensor placement as the spec writes it: ``Shard(0)``, ``Replicate()``,
    ``Partial(sum)``, ``_StridedShard(0, 2)``."""
    kind = type(placement).__name__
    if kind == "Shard":
        return f"Shard({placement.dim})"
    if kind == "_StridedShard":  # FSDP2's dim-0 shard of a tensor-parallel Shard(0) one
        return f"_StridedShard({placement.dim}, {placement.split_factor})"
    if kind == "Partial":
        return f"Partial({placement.reduce_op})"
    return f"{kind}()" if kind == "Replicate" else repr(placement)


def _placements(record: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    made: list[Any] = []
    for text in record.placements:
        kind, argument = text[:-1].split("(")
        if kind == "_StridedShard":
            dim, split = argument.split(", ")
            made.append(_StridedShard(int(dim), split_factor=int(split)))
            continue
        made.append(
            Shard(int(argument))
            if kind == "Shard"
            else Partial(argument)
            if kind == "Partial"
            else Replicate()
        )
    return tuple(made)


def _mesh_text(mesh: Any) -> str:
    names = f" named {tuple(mesh.dim_names)}" if mesh.dim_names else ""
    return (
        f"a {mesh.device_type} device mesh of shape {tuple(mesh.shape)}{names} over "
        f"ranks {list(mesh.ranks)}"
    )


def _listed(placements: Sequence[str]) -> str:
    return "(" + ", ".join(placements) + ")"
