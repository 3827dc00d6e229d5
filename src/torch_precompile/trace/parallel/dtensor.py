"""DTensors in a capture: the graph runs on their local tensors, the spec says how to rewrap.

A DTensor parameter, buffer or input becomes a plain local tensor at the graph's boundary.
Inside the trace it is rebuilt with ``DTensor.from_local`` (a parameter as a fresh leaf, so a
backward inside fn leaves its gradient there), so every DTensor operation, collectives
included, is recorded on local tensors. DTensor results and gradients leave the graph as
their local tensors. The collectives' process groups are renamed after what they are (which
mesh, which mesh dim), so one artifact binds to any process's groups for that mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.distributed import (
    collective_group_names,
    is_dtensor,
    non_functional_collectives,
)
from torch_precompile.shipped.driver.distributed import bind_groups, placement_text
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.spec import DistributedTensor, Mesh

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_PLACEMENTS = ("Shard", "Replicate", "Partial", "_StridedShard")


@dataclass(frozen=True)
class Sharded:
    """A DTensor flat input of the capture: its spec record, and what rebuilding it takes."""

    record: DistributedTensor
    placements: tuple[Any, ...]
    requires_grad: bool


@dataclass
class Distribution:
    """The DTensors of one capture: its flat inputs that are DTensors, their meshes, and the
    records of DTensor results (filled while tracing)."""

    inputs: dict[int, Sharded]
    meshes: list[Any]
    results: list[DistributedTensor] = field(default_factory=list)

    def locals(self, examples: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The examples with each DTensor replaced by (a detached alias of) its local tensor."""
        with torch.no_grad():
            return [
                cast("DTensor", e).to_local().detach() if i in self.inputs else e
                for i, e in enumerate(examples)
            ]

    def rebuild(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Inside the trace: DTensors around the local flat inputs; parameters as leaves."""
        from torch.distributed.tensor import DTensor

        views = list(flat)
        for index, sharded in self.inputs.items():
            dtensor: torch.Tensor = DTensor.from_local(
                flat[index],
                self.meshes[sharded.record.mesh],
                sharded.placements,
                run_check=False,
                shape=torch.Size(sharded.record.shape),
                stride=sharded.record.strides,
            )
            if sharded.requires_grad:
                dtensor = dtensor.detach().requires_grad_(True)
            views[index] = dtensor
        return views

    def local_grad(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """A parameter's gradient as a local tensor laid out by the parameter's placements."""
        sharded = self.inputs.get(index)
        if sharded is None or not is_dtensor(grad):
            return grad
        if tuple(grad.placements) != sharded.placements:
            grad = grad.redistribute(self.meshes[sharded.record.mesh], sharded.placements)
        return grad.to_local()

    def local_results(self, leaves: Sequence[Any]) -> list[Any]:
        """Result leaves with DTensors replaced by their local tensors, each recorded."""
        self.results.clear()
        unwrapped = list(leaves)
        for index, leaf in enumerate(leaves):
            if is_dtensor(leaf):
                self._refuse_placements(leaf, f"result leaf {index}")
                self.results.append(
                    DistributedTensor(
                        role="result",
                        index=index,
                        name=f"result leaf {index}",
                        mesh=self._mesh_index(leaf.device_mesh, f"result leaf {index}"),
                        placements=tuple(placement_text(p) for p in leaf.placements),
                        shape=tuple(leaf.shape),
                        strides=tuple(leaf.stride()),
                        local_shape=tuple(leaf.to_local().shape),
                    )
                )
                unwrapped[index] = leaf.to_local()
        return unwrapped

    def mesh_records(self, coordinate_dependent: bool) -> tuple[Mesh, ...]:
        return tuple(
            Mesh(
                device_type=mesh.device_type,
                shape=tuple(mesh.shape),
                dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                ranks=tuple(mesh.mesh.flatten().tolist()),
                groups=group_names(mesh),
                coordinate=tuple(mesh.get_coordinate()) if coordinate_dependent else None,
            )
            for mesh in self.meshes
        )

    def group_names(self) -> dict[str, str]:
        """This process's name of each mesh dim's group -> the graph's name for it, and those
        names bound to this process's groups (lowering and a same-process call resolve them)."""
        stable: dict[str, str] = {}
        for mesh in self.meshes:
            names = group_names(mesh)
            bind_groups(mesh, names)
            stable.update({mesh.get_group(d).group_name: name for d, name in enumerate(names)})
        return stable

    def _mesh_index(self, mesh: Any, what: str) -> int:
        for index, known in enumerate(self.meshes):
            if known is mesh or known == mesh:
                return index
        raise PrecompileError(
            f"{what} is a DTensor on a device mesh that no DTensor parameter, buffer or input "
            "lives on; the artifact could not bind it at a call. Return it on one of those "
            "meshes, or return .full_tensor()."
        )

    @staticmethod
    def _refuse_placements(tensor: Any, what: str) -> None:
        odd = [p for p in tensor.placements if type(p).__name__ not in _PLACEMENTS]
        if odd:
            raise PrecompileError(
                f"{what} is a DTensor with placement {odd[0]!r}; precompiled artifacts carry "
                "Shard, Replicate and Partial placements. Redistribute it to those before "
                "precompiling."
            )


def find_dtensors(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> Distribution | None:
    """The capture's DTensor flat inputs, or None when it has none (other subclasses are
    ``capture.subclasses``'); a DTensor of another subclass is refused by name."""
    inputs: dict[int, Sharded] = {}
    meshes: list[Any] = []
    for index, (tensor, name) in enumerate(zip(tensors, names, strict=True)):
        if not is_dtensor(tensor):
            continue
        _refuse_nested(tensor, name)
        Distribution._refuse_placements(tensor, name)
        mesh = tensor.device_mesh
        if mesh.get_coordinate() is None:
            raise PrecompileError(
                f"{name} is a DTensor on a device mesh this rank is not part of; precompile on "
                "the ranks of its mesh, with their shards."
            )
        position = next((i for i, m in enumerate(meshes) if m is mesh or m == mesh), None)
        if position is None:
            position = len(meshes)
            meshes.append(mesh)
        record = DistributedTensor(
            role="input",
            index=index,
            name=name,
            mesh=position,
            placements=tuple(placement_text(p) for p in tensor.placements),
            shape=tuple(tensor.shape),
            strides=tuple(tensor.stride()),
            local_shape=tuple(tensor.to_local().shape),
        )
        inputs[index] = Sharded(record, tuple(tensor.placements), tensor.requires_grad)
    return Distribution(inputs, meshes) if inputs else None


def name_collectives(gm: torch.fx.GraphModule, stable: dict[str, str]) -> None:
    """Rename the graph's process groups after what they are (``stable``: this process's
    name -> the artifact's), refusing a collective over any other group."""
    for node, position, name in collective_group_names(gm):
        if name not in stable and name not in stable.values():
            raise PrecompileError(
                f"fn runs the collective {node.target} over process group {name!r}, which "
                "is neither a dimension of the device meshes of the model's or inputs' "
                "DTensors nor the group of a DistributedDataParallel model. Collectives "
                "inside fn must come from DTensor operations or DDP; run other communication "
                "outside fn."
            )
        node.update_arg(position, stable.get(name, name))
    gm.recompile()


def refuse_inplace_collectives(gm: torch.fx.GraphModule) -> None:
    """Collectives that mutate in place (``dist.all_reduce`` inside fn) are refused."""
    found = non_functional_collectives(gm)
    if found:
        raise PrecompileError(
            f"fn calls in-place collectives ({', '.join(found)}), such as "
            "torch.distributed.all_reduce, which a precompiled graph does not replay. Run them "
            "outside fn, or let the package communicate: pass the model wrapped in "
            "DistributedDataParallel (data parallelism), or shard it with DTensor."
        )


def group_names(mesh: Any) -> tuple[str, ...]:
    """The artifact's name for each dim's process group: what the mesh is (device, shape, dim
    names), not a name that exists only in the capturing process, nor its ranks (every
    data-parallel replica's sub-mesh serves)."""
    shape = "x".join(str(s) for s in mesh.shape)
    dims = mesh.mesh_dim_names or [str(d) for d in range(mesh.ndim)]
    return tuple(f"precompile/{mesh.device_type}/{shape}/{','.join(dims)}/{dim}" for dim in dims)


def _refuse_nested(tensor: Any, name: str) -> None:
    local = type(tensor.to_local())
    if local not in (torch.Tensor, torch.nn.Parameter):
        raise PrecompileError(
            f"{name} is a DTensor whose local shard is a {qualified_name(local)} "
            "(a quantized DTensor, say); nested tensor subclasses are not carried. Shard plain "
            "tensors, or quantize an unsharded model."
        )
