"""The artifact spec: one typed, versioned description of an artifact's calling convention.

Capture builds an ``ArtifactSpec``; the artifact carries it as ONE literal (``ARTIFACT_SPEC``,
plain dicts, tuples and scalars); ``load``, ``inspect`` and the tests read it back with
``parse_spec`` without executing anything; the driver inside the artifact reads the same
literal. ``SCHEMA_VERSION`` names the literal's layout and ``SCHEMA_HISTORY`` says what each
version changed; the compatibility policy is in ``docs/SPEC_VERSIONS.md``, and
``docs/spec-schema.txt`` lists every record's fields (``python -m torch_precompile.spec_listing``
writes it; a test holds it to these dataclasses).

Flat graph inputs are the model tensors that are not tied to an earlier one (in ``model``
order), then the tensor leaves of ``inputs``, then each ``optimizer_state`` tensor, then one
0-dim float64 learning rate per param group. Graph outputs are ``fn``'s result leaves, then
one gradient per parameter with ``gets_grad``, then one tensor per value guard. A flat input or
result leaf that is a DTensor at the call is a plain local tensor in the graph; its
``DistributedTensor`` record says how to unwrap and rewrap it. One that is another tensor
subclass (torchao's quantized weights) is its inner tensors in the graph: the first in its
place, the others after every flat input (after the value guards, for a result leaf), in
``wrapped`` order; its ``WrappedTensor`` record says how to check and rebuild it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pprint
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from torch_precompile.errors import PrecompileError


@dataclass(frozen=True)
class SchemaChange:
    """One schema version: when it came and what it changed."""

    version: int
    date: str
    change: str


SCHEMA_HISTORY = (
    SchemaChange(
        1,
        "2026-11-30",
        "First typed spec, replacing 28 separate metadata literals: "
        "args, model (one record per parameter or buffer name), submodules, inputs "
        "(one record per leaf), value_guards, dynamic_dims, size_relations, "
        "output_aliases, backend, torch.",
    ),
    SchemaChange(
        2,
        "2026-11-30",
        "DTensors: meshes (device type, shape, dim names, ranks, "
        "the graph's group name per mesh dim, the capturing coordinate when the graph "
        "depends on it) and distributed (per DTensor flat input or result leaf).",
    ),
    SchemaChange(
        3,
        "2026-12-01",
        "kernels: the SHA-256 of every built kernel object, by "
        "kernel key, so the source names the exact objects its cache may hold.",
    ),
    SchemaChange(
        4,
        "2026-12-01",
        "Optimizers as arguments: Argument.is_optimizer; optimizers "
        "(class per optimizer argument, whether fn clears its gradients first), "
        "param_groups (parameters by name, options read at call time, baked options "
        "and their values, whether a fresh state may start from zeros) and "
        "optimizer_state (one flat input per state tensor). Python values are encoded "
        "by kind (const, float, dtype, device, enum, frozen), never by repr.",
    ),
    SchemaChange(
        5,
        "2026-12-01",
        "Traceable tensor subclasses: wrapped (per subclass flat "
        "input or result leaf: class, flatten context, outer shape and strides) and "
        "wrapped_inner (per inner tensor: attribute, shape, dtype, device, strides). "
        "Encoded values gain the kinds none, list, tuple, dict, size and dataclass "
        "(in flatten contexts).",
    ),
    SchemaChange(
        6,
        "2026-12-01",
        "Data parallelism: data_parallel (per DistributedDataParallel "
        "model argument: the graph's name for its process group, the world size its "
        "gradients are averaged over, whether they are (no_sync), and DDP's "
        "forward-sync flag before and after the call when it broadcasts buffers) and "
        "fully_sharded (per FSDP2 param group: its module, whether it reshards after "
        "forward, its mixed-precision dtypes).",
    ),
    SchemaChange(
        7,
        "2026-12-02",
        "Variants: variants (the artifact's further variants, each "
        "a spec of its own less the fields all variants share: schema_version, "
        "backend, torch, args and kernels, which the top level holds for all). The top "
        "level is the first variant.",
    ),
    SchemaChange(
        8,
        "2026-12-03",
        "Facts the trace relied on beyond tensors: Submodule.cls "
        "(each module's class), Submodule.hooks and ModelTensor.hooks (hooks by kind "
        "and name), "
        "global_hooks (process-wide module hooks), read_values (Python values the "
        "traced code read: module attributes and module globals), ambient (autocast, "
        "default dtype, deterministic algorithms and active modes at capture), "
        "mutated (the flat inputs the graph writes) and seed (a seed fn sets before "
        "its first random draw, set again before every call).",
    ),
    SchemaChange(
        9,
        "2026-12-04",
        "Differentiable results: autograd (for an artifact whose fn "
        "runs no backward: the flat inputs its backward graph gives gradients, the "
        "result leaves with history and their tangents' layouts, what the forward "
        "saves for backward, or why results carry no history).",
    ),
)
SCHEMA_VERSION = SCHEMA_HISTORY[-1].version
"""The spec layout this version writes."""
OLDEST_READABLE_SCHEMA = 1
"""The oldest spec layout this version still reads (the window is inclusive)."""
SPEC_NAME = "ARTIFACT_SPEC"
"""The one top-level name the spec is assigned to in ``python_code``."""
_NOT_AN_ARTIFACT = "it is not a precompile artifact (python_code from precompile())"

# (kind, value) for a Python value: ("const", 3), ("float", "nan"), ("dtype", "float16"),
# ("device", "cpu"), ("enum", ("pkg.Mode", "FAST")), ("frozen", ("pkg.Cfg", (("n", ("const",
# 2)),))). Flatten contexts also hold ("none", None), ("list", (items...)), ("tuple", (...)),
# ("dict", ((key, value), ...)), ("size", (2, 3)) and ("dataclass", like "frozen"). Schema 3
# and older also wrote ("repr", (type name, repr)).
EncodedValue = tuple[str, Any]
Shape = tuple[int | None, ...]
Layout = tuple[int, ...] | str | None
# Hooks of one kind, by name: ("forward", ("pkg.log_shapes",)).
HookSet = tuple[str, tuple[str, ...]]


@dataclass(frozen=True)
class TorchBuild:
    """The torch an artifact was built with, and so the only one it runs under."""

    version: str
    git: str


@dataclass(frozen=True)
class Argument:
    """One positional argument of ``fn``: a model (``nn.Module``), an optimizer
    (``torch.optim.Optimizer``) or a runtime input."""

    name: str
    is_model: bool
    is_optimizer: bool = False


@dataclass(frozen=True)
class ModelTensor:
    """One name of a model's parameter or buffer, in the order ``forward`` walks them.

    The walk is ``named_parameters(remove_duplicate=False)`` of every model, then
    ``named_buffers``; with several models names are ``m{i}.{name}``. A name whose tensor
    appeared earlier under ``tied_to`` takes no flat input of its own. ``strides`` is the
    layout the compiled kernels assume (None: any layout).
    """

    name: str
    kind: str  # "parameter" or "buffer"
    tied_to: str | None
    shape: tuple[int, ...]
    dtype: str
    device: str
    strides: tuple[int, ...] | None
    requires_grad: bool
    gets_grad: bool
    hooks: tuple[HookSet, ...] = ()  # tensor hooks on a parameter of a training step


@dataclass(frozen=True)
class Submodule:
    """A module reached from a model argument: its ``training`` flag, its class by qualified
    name (None: not recorded, schema 7 and older) and the hooks on it at capture."""

    name: str
    training: bool
    cls: str | None = None
    hooks: tuple[HookSet, ...] = ()


@dataclass(frozen=True)
class InputLeaf:
    """One leaf of the runtime inputs, in pytree order: a tensor, or a baked Python value.

    ``shape`` has None for a dynamic dim; ``bounds`` maps such a dim to its declared (min,
    max); ``strides`` is the layout the kernels assume (a memory-format name for an input
    with dynamic dims; None: any layout).
    """

    path: str
    kind: str  # "tensor" or "value"
    shape: Shape | None = None
    dtype: str | None = None
    device: str | None = None
    strides: Layout = None
    requires_grad: bool | None = None
    bounds: dict[int, tuple[int | None, int | None]] | None = None
    value: EncodedValue | None = None


@dataclass(frozen=True)
class ValueGuard:
    """A tensor value the trace decided on; each call must reproduce ``expected``."""

    description: str
    expected: EncodedValue


@dataclass(frozen=True)
class ReadValue:
    """A Python value the traced code read, baked into the graph: each call must find
    ``expected`` there.

    With ``submodule`` set it is the attribute ``path`` of ``submodules[submodule]``
    (``("scaling",)``, ``("config", "eps")``); otherwise the global ``path[0]`` of the Python
    module named ``module``; for ``__main__``, ``file`` is the base name of the script it was
    at capture (no path of the build machine). ``where`` is the line that read it.
    """

    submodule: int | None
    module: str | None
    path: tuple[str, ...]
    expected: EncodedValue
    where: str
    file: str | None = None


@dataclass(frozen=True)
class Ambient:
    """Thread and process state that changes what the traced ops compute, as at capture:
    autocast (device type and dtype, where enabled), the default dtype (None when fn built no
    tensor from it), deterministic algorithms, and the active torch function and dispatch
    modes by class name."""

    autocast: tuple[tuple[str, str], ...] = ()
    default_dtype: str | None = None
    deterministic: bool = False
    modes: tuple[str, ...] = ()


@dataclass(frozen=True)
class DynamicDim:
    """One dynamic size: every (input leaf index, dim) that carries it."""

    shape_id: str
    places: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SizeRelation:
    """A relation over the dynamic sizes that must hold at every call.

    ``expr`` is an expression tree: an int, ``("d", i)`` for the size of ``dynamic_dims[i]``,
    or ``(operator, *operands)`` with the operators of the driver's ``evaluate``.
    """

    expr: Any
    readable: str


@dataclass(frozen=True)
class OutputAlias:
    """A result leaf that is a view of flat input ``source`` (``size`` None: the input)."""

    output: int
    source: int
    size: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    offset: int | None = None


@dataclass(frozen=True)
class Mesh:
    """A DeviceMesh the artifact's DTensors live on, and the graph's names for its groups.

    ``ranks`` is the capturing mesh's global ranks, flattened row-major (shown in messages; a
    sub-mesh of other ranks with the same shape and dim names serves). ``groups[d]`` is the
    name the compiled graph's collectives use for mesh dim ``d``; the driver binds it to the runtime
    mesh's group for that dim. ``coordinate`` is the capturing rank's place in the mesh when
    the graph depends on it (None: the graph serves every rank).
    """

    device_type: str
    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    ranks: tuple[int, ...]
    groups: tuple[str, ...]
    coordinate: tuple[int, ...] | None


@dataclass(frozen=True)
class DistributedTensor:
    """A DTensor at flat input ``index`` (``role`` "input") or result leaf ``index`` ("result").

    The graph sees its local tensor, of ``local_shape``; ``local_strides`` is the layout the
    kernels assume for an input (None: any). ``placements`` are written as ``Shard(0)``,
    ``Replicate()``, ``Partial(sum)``; ``shape`` and ``strides`` are global.
    """

    role: str
    index: int
    name: str
    mesh: int
    placements: tuple[str, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    local_shape: tuple[int, ...]
    local_strides: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Optimizer:
    """An optimizer argument: its class, by qualified name (another class is refused).
    ``zero_grad_first``: fn calls its ``zero_grad()`` before any gradient exists, so a call
    drops the gradients its parameters hold, as that ``zero_grad()`` would."""

    argument: str
    cls: str
    zero_grad_first: bool = False


@dataclass(frozen=True)
class ParamGroup:
    """One param group of optimizer ``optimizer`` (an index into ``optimizers``).

    ``params`` names the model parameters it steps, in group order. Each option in
    ``call_time`` is read from the group at every call (a flat input); each of ``baked`` is
    fixed in the graph, so a call must pass the same value. ``fresh_start`` is None when a
    parameter without state may start from zero state (what its first step creates), else why
    it may not.
    """

    optimizer: int
    params: tuple[str, ...]
    call_time: tuple[str, ...]
    baked: tuple[tuple[str, EncodedValue], ...]
    fresh_start: str | None = None


@dataclass(frozen=True)
class OptimizerState:
    """One state tensor ``optimizer`` keeps for model parameter ``param``: a flat graph input
    the graph updates in place (``strides``: the layout the kernels assume; None: any)."""

    optimizer: int
    param: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    strides: tuple[int, ...] | None = None


@dataclass(frozen=True)
class WrappedTensor:
    """A traceable tensor subclass (one with ``__tensor_flatten__``) at flat input ``index``
    (``role`` "input") or result leaf ``index`` ("result"), carried as its inner tensors.

    ``cls`` is its class by qualified name; ``context`` its flatten context, encoded (a call
    must pass an equal one; a result is rebuilt with it); ``shape`` and ``strides`` are its own
    (outer) size and strides. Its ``wrapped_inner`` records list the inner tensors.
    """

    role: str
    index: int
    name: str
    cls: str
    context: EncodedValue
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class InnerTensor:
    """One inner tensor of ``wrapped[wrapper]``, by its flatten attribute name, in flatten
    order (``strides``: the layout the kernels assume; None: any)."""

    wrapper: int
    attr: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    strides: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DataParallel:
    """A model argument wrapped in DistributedDataParallel; ``model`` is its index among the
    model arguments.

    The graph averages its parameters' gradients over the process group it names ``group``
    (of ``world_size`` ranks) when ``sync_grads`` (False: captured inside ``no_sync()``), and
    broadcasts its buffers from rank 0 first when ``forward_sync`` is given: DDP's
    ``require_forward_param_sync`` before the call (which must match) and after it.
    """

    argument: str
    model: int
    group: str
    world_size: int
    sync_grads: bool
    forward_sync: tuple[bool, bool] | None = None


@dataclass(frozen=True)
class FullyShardedGroup:
    """An FSDP2 param group: the module of model argument ``model`` (by index among the model
    arguments) whose forward gathers it, ``module`` its path ("" for the model itself).

    The graph gathers the group's parameters before that module's forward (in ``param_dtype``
    when given), reduce-scatters their gradients' average (in ``reduce_dtype``) and, with
    ``reshard_after_forward``, gathers them again for backward. Gradients are divided by
    ``divide_factor`` (``set_gradient_divide_factor``; None: the world size) before the sum.
    """

    model: int
    module: str
    reshard_after_forward: bool
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    divide_factor: float | None = None


@dataclass(frozen=True)
class Autograd:
    """How the results of an artifact whose fn runs no backward carry autograd history.

    With ``inputs``, the artifact holds a forward and a backward graph beside the plain one:
    a call under grad mode where a flat input requires grad runs the forward, whose results
    get history; ``backward()`` later runs the backward graph, which gives gradients for
    ``inputs`` (flat input indices). ``outputs`` are the result leaves with history, in the
    order the backward takes their tangents, each in the layout ``tangent_strides`` gives.
    ``saved`` says what the forward keeps for backward, one entry per value. Without
    ``inputs``, ``unavailable`` says why results carry no history (None: nothing required
    grad at capture).
    """

    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    tangent_strides: tuple[tuple[int, ...], ...] = ()
    saved: tuple[str, ...] = ()
    unavailable: str | None = None


@dataclass(frozen=True)
class KernelObject:
    """A built kernel object the cache may carry: its kernel key and the SHA-256 of its bytes."""

    key: str
    sha256: str


@dataclass(frozen=True)
class ArtifactSpec:
    """Everything the driver needs to check a call and map it onto ``call(flat_inputs)``."""

    schema_version: int
    backend: str
    torch: TorchBuild
    args: tuple[Argument, ...]
    model: tuple[ModelTensor, ...]
    submodules: tuple[Submodule, ...]
    inputs: tuple[InputLeaf, ...]
    in_spec: str | None
    out_spec: str
    value_guards: tuple[ValueGuard, ...] = ()
    dynamic_dims: tuple[DynamicDim, ...] = ()
    size_relations: tuple[SizeRelation, ...] = ()
    output_aliases: tuple[OutputAlias, ...] = ()
    meshes: tuple[Mesh, ...] = ()
    distributed: tuple[DistributedTensor, ...] = ()
    kernels: tuple[KernelObject, ...] = ()
    optimizers: tuple[Optimizer, ...] = ()
    param_groups: tuple[ParamGroup, ...] = ()
    optimizer_state: tuple[OptimizerState, ...] = ()
    wrapped: tuple[WrappedTensor, ...] = ()
    wrapped_inner: tuple[InnerTensor, ...] = ()
    data_parallel: tuple[DataParallel, ...] = ()
    fully_sharded: tuple[FullyShardedGroup, ...] = ()
    global_hooks: tuple[HookSet, ...] = ()
    read_values: tuple[ReadValue, ...] = ()
    ambient: Ambient | None = None
    mutated: tuple[int, ...] = ()
    seed: int | None = None
    autograd: Autograd | None = None
    variants: tuple[ArtifactSpec, ...] = ()

    # What every variant has in common, held once at the top level (the first variant's).
    SHARED: ClassVar[tuple[str, ...]] = ("schema_version", "backend", "torch", "args", "kernels")
    RECORDS: ClassVar[dict[str, type]] = {
        "torch": TorchBuild,
        "args": Argument,
        "model": ModelTensor,
        "submodules": Submodule,
        "inputs": InputLeaf,
        "value_guards": ValueGuard,
        "dynamic_dims": DynamicDim,
        "size_relations": SizeRelation,
        "output_aliases": OutputAlias,
        "meshes": Mesh,
        "distributed": DistributedTensor,
        "kernels": KernelObject,
        "optimizers": Optimizer,
        "param_groups": ParamGroup,
        "optimizer_state": OptimizerState,
        "wrapped": WrappedTensor,
        "wrapped_inner": InnerTensor,
        "data_parallel": DataParallel,
        "fully_sharded": FullyShardedGroup,
        "read_values": ReadValue,
        "ambient": Ambient,
        "autograd": Autograd,
    }
    # Fields that hold one record (or None), not a list of them.
    SINGLE: ClassVar[tuple[str, ...]] = ("torch", "ambient", "autograd")

    @property
    def interned(self) -> tuple[ModelTensor, ...]:
        """The model tensors that are flat graph inputs (those not tied to an earlier one)."""
        return tuple(t for t in self.model if t.tied_to is None)

    @property
    def parameters(self) -> tuple[ModelTensor, ...]:
        return tuple(t for t in self.interned if t.kind == "parameter")

    @property
    def buffers(self) -> tuple[ModelTensor, ...]:
        return tuple(t for t in self.interned if t.kind == "buffer")

    @property
    def tensor_inputs(self) -> tuple[InputLeaf, ...]:
        return tuple(leaf for leaf in self.inputs if leaf.kind == "tensor")

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args if a.is_model)

    @property
    def optimizer_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args if a.is_optimizer)

    def with_strides(self, strides: Sequence[Layout] | None) -> ArtifactSpec:
        """The spec with the layout a lowering assumes for each flat input (None: any)."""
        if strides is None:
            return self
        # A DTensor's layout is its local tensor's: the driver checks it after unwrapping.
        local = {d.index: d for d in self.distributed if d.role == "input"}
        distributed = [
            dataclasses.replace(local[i], local_strides=cast(Any, s))
            for i, s in enumerate(strides)
            if i in local
        ]
        # So is a subclass's: its inner tensors' layouts are recorded with them.
        unwrapped = local.keys() | {w.index for w in self.wrapped if w.role == "input"}
        # Model and optimizer tensors have static shapes: their layouts are strides, not names.
        flat: Iterator[Any] = iter(None if i in unwrapped else s for i, s in enumerate(strides))
        model = tuple(
            dataclasses.replace(t, strides=next(flat)) if t.tied_to is None else t
            for t in self.model
        )
        inputs = tuple(
            dataclasses.replace(leaf, strides=next(flat)) if leaf.kind == "tensor" else leaf
            for leaf in self.inputs
        )
        state = tuple(dataclasses.replace(t, strides=next(flat)) for t in self.optimizer_state)
        results = tuple(d for d in self.distributed if d.role != "input")
        return dataclasses.replace(
            self,
            model=model,
            inputs=inputs,
            optimizer_state=state,
            distributed=(*distributed, *results),
            wrapped_inner=self._inner_strides(strides),
        )

    def _inner_strides(self, strides: Sequence[Layout]) -> tuple[InnerTensor, ...]:
        """Inner tensors of subclass inputs take the strides of their graph inputs: the first
        at the subclass's flat index, the others after every flat input (see the module)."""
        first: dict[int, int | None] = {
            w: r.index for w, r in enumerate(self.wrapped) if r.role == "input"
        }
        extra = len(strides) - sum(1 for t in self.wrapped_inner if t.wrapper in first) + len(first)
        inner = []
        for record in self.wrapped_inner:
            if record.wrapper not in first:
                inner.append(record)
                continue
            held = first[record.wrapper]
            if held is not None:
                position, first[record.wrapper] = held, None
            else:
                position, extra = extra, extra + 1
            layout = strides[position]
            inner.append(
                dataclasses.replace(record, strides=layout if isinstance(layout, tuple) else None)
            )
        return tuple(inner)

    def with_kernels(self, kernels: Sequence[KernelObject]) -> ArtifactSpec:
        """The spec naming the kernel objects a lowering built."""
        return dataclasses.replace(self, kernels=tuple(kernels))

    @property
    def all_variants(self) -> tuple[ArtifactSpec, ...]:
        """Every variant, the first (this spec, less its ``variants``) included."""
        return (dataclasses.replace(self, variants=()), *self.variants)

    def with_variants(self, others: Sequence[ArtifactSpec]) -> ArtifactSpec:
        """This spec as the first variant of an artifact that also holds ``others``; the
        kernels of all of them are named at the top level."""
        for other in others:
            if other.args != self.args or other.backend != self.backend:
                raise PrecompileError(
                    "the calls of one capture must take the same arguments (models in the same "
                    f"positions) and use one backend; got ({_arguments(self)}) and then "
                    f"({_arguments(other)}). Capture each calling convention on its own."
                )
        kernels = {k.key: k for spec in (self, *others) for k in spec.kernels}
        kept = tuple(sorted(kernels.values(), key=lambda k: k.key))
        return dataclasses.replace(
            self,
            kernels=kept,
            variants=tuple(dataclasses.replace(o, kernels=kept, variants=()) for o in others),
        )

    def to_literal(self) -> dict[str, Any]:
        """The spec as plain dicts, tuples and scalars (what ``ARTIFACT_SPEC`` holds)."""
        literal = dataclasses.asdict(dataclasses.replace(self, variants=()))
        literal["variants"] = tuple(
            {k: v for k, v in variant.to_literal().items() if k not in (*self.SHARED, "variants")}
            for variant in self.variants
        )
        return literal

    def source(self, notes: Mapping[str, str] | None = None) -> str:
        """``ARTIFACT_SPEC = {...}``: the assignment written into ``python_code``, one field
        a line and one record a line (wrapped), each ``notes[field]`` as a comment above it.
        Each further variant is a dict laid out the same way inside ``variants``."""
        lines = [f"{SPEC_NAME} = {{", *_field_lines(self.to_literal(), "    ", notes or {})]
        return "\n".join([*lines, "}"]) + "\n"

    @classmethod
    def from_literal(cls, literal: Any) -> ArtifactSpec:
        """Rebuild the typed spec; a literal of an unreadable schema version is refused."""
        if not isinstance(literal, dict):
            raise PrecompileError(f"python_code's {SPEC_NAME} is not a dict; {_NOT_AN_ARTIFACT}.")
        check_schema_version(literal.get("schema_version"))
        fields = _record_fields(cls, literal)
        for name, record in cls.RECORDS.items():
            if name not in fields:  # an optional list an older schema lacks
                continue
            value = fields[name]
            if name in cls.SINGLE:
                fields[name] = None if value is None else _record(record, value)
                continue
            if not isinstance(value, list | tuple):
                raise PrecompileError(
                    f"python_code's {SPEC_NAME} holds {type(value).__name__} for {name!r} where "
                    f"a list of {record.__name__} records belongs; {_NOT_AN_ARTIFACT}."
                )
            fields[name] = tuple(_record(record, item) for item in value)
        variants = fields.get("variants", ())
        if not isinstance(variants, list | tuple):
            raise PrecompileError(
                f"python_code's {SPEC_NAME} holds {type(variants).__name__} for 'variants' "
                f"where a list of variant dicts belongs; {_NOT_AN_ARTIFACT}."
            )
        fields["variants"] = tuple(cls._variant(literal, v) for v in variants)
        return cls(**fields)

    @classmethod
    def _variant(cls, top: dict[str, Any], literal: Any) -> ArtifactSpec:
        if not isinstance(literal, dict) or literal.keys() & {*cls.SHARED, "variants"}:
            raise PrecompileError(
                f"python_code's {SPEC_NAME} holds a malformed variant (not a dict, or one with "
                f"fields only the top level holds); {_NOT_AN_ARTIFACT}."
            )
        return cls.from_literal({**{k: top[k] for k in cls.SHARED if k in top}, **literal})


def _arguments(spec: ArtifactSpec) -> str:
    return ", ".join(
        f"{a.name}: {'model' if a.is_model else 'optimizer' if a.is_optimizer else 'input'}"
        for a in spec.args
    )


def _field_lines(literal: Mapping[str, Any], indent: str, notes: Mapping[str, str]) -> list[str]:
    lines = []
    for name, value in literal.items():
        if name in notes:
            lines.append(f"{indent}# {notes[name]}")
        if name == "variants" and value:
            lines.append(f"{indent}'variants': (")
            for variant in value:
                lines += [
                    f"{indent}    {{",
                    *_field_lines(variant, indent + "        ", {}),
                    f"{indent}    }},",
                ]
            lines.append(f"{indent}),")
        elif isinstance(value, tuple) and value and isinstance(value[0], dict):
            lines.append(f"{indent}{name!r}: (")
            lines.extend(_wrapped(record, indent + "    ") + "," for record in value)
            lines.append(f"{indent}),")
        else:
            lines.append(_wrapped(value, indent, f"{name!r}: ") + ",")
    return lines


def _wrapped(value: Any, indent: str, prefix: str = "") -> str:
    """``value``'s repr; a dict's items filled onto lines of at most 100 characters."""
    if not isinstance(value, dict):
        text = pprint.pformat(value, width=100 - len(indent + prefix), compact=True)
        return indent + prefix + text.replace("\n", "\n" + indent + " " * len(prefix))
    lines, line = [], indent + prefix + "{"
    for i, (key, item) in enumerate(value.items()):
        text = f"{key!r}: {item!r}" + ("}" if i == len(value) - 1 else ",")
        if len(indent + prefix) + 1 + len(text) > 100:  # a long item gets lines of its own
            lines.append(line)
            inner = indent + " " * len(prefix) + " "
            text = _wrapped(item, inner, f"{key!r}: ").lstrip() + text[len(f"{key!r}: {item!r}") :]
            line = inner + text
            continue
        if len(line) + 1 + len(text) > 100 and not line.endswith("{"):
            lines.append(line)
            line = indent + " " * len(prefix) + " " + text
        else:
            line += ("" if line.endswith("{") else " ") + text
    return "\n".join([*lines, line if value else line + "}"])


def check_schema_version(version: Any) -> None:
    """Refuse a spec this version cannot read, naming both sides."""
    if not isinstance(version, int) or not OLDEST_READABLE_SCHEMA <= version <= SCHEMA_VERSION:
        readable = (
            f"{SCHEMA_VERSION}"
            if OLDEST_READABLE_SCHEMA == SCHEMA_VERSION
            else f"{OLDEST_READABLE_SCHEMA} to {SCHEMA_VERSION}"
        )
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        raise PrecompileError(
            f"python_code has artifact spec schema version {version!r}; this torch-precompile "
            f"reads schema version {readable}. "
            + ("Upgrade torch-precompile to load it, or precompile" if newer else "Precompile")
            + " it again with this version."
        )


@functools.cache
def _field_names(cls: type) -> tuple[frozenset[str], frozenset[str]]:
    """A record class's field names, and those without a default."""
    fields = dataclasses.fields(cls)
    return (
        frozenset(f.name for f in fields),
        frozenset(
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ),
    )


def _record_fields(cls: type, literal: Any) -> dict[str, Any]:
    if not isinstance(literal, dict):
        raise PrecompileError(
            f"python_code's {SPEC_NAME} holds a malformed {cls.__name__} record; "
            f"{_NOT_AN_ARTIFACT}."
        )
    names, required = _field_names(cls)
    if not required <= literal.keys() <= names:
        odd = sorted((required - literal.keys()) | (literal.keys() - names))
        raise PrecompileError(
            f"python_code's {SPEC_NAME} has a {cls.__name__} record with missing or unknown "
            f"fields {odd}; {_NOT_AN_ARTIFACT}."
        )
    return dict(literal)


def _record(cls: type, literal: Any) -> Any:
    return cls(**_record_fields(cls, literal))


def parse_spec(python_code: str) -> ArtifactSpec:
    """Read ``python_code``'s spec by parsing only; nothing in it is executed."""
    return ArtifactSpec.from_literal(spec_literal(python_code))


def spec_literal(python_code: str) -> dict[str, Any]:
    """The ``ARTIFACT_SPEC`` literal of ``python_code``, evaluated with ``ast.literal_eval``."""
    if not isinstance(python_code, str):
        raise PrecompileError(
            f"python_code must be a str, got {type(python_code).__name__}; {_NOT_AN_ARTIFACT}."
        )
    # Fast path: parse the assignment alone; the kernels' source makes the whole file slow.
    start = python_code.find(f"\n{SPEC_NAME} = ")
    if start >= 0:
        end = python_code.find("\n\n", start + 1)
        try:
            return _assigned_literal(python_code[start + 1 : end if end > 0 else None])
        except PrecompileError:
            pass  # not laid out as rendered: read the whole module below
    return _assigned_literal(python_code)


def _assigned_literal(source: str) -> Any:
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise PrecompileError(
            f"python_code does not parse (line {e.lineno}: {e.msg}); {_NOT_AN_ARTIFACT}."
        ) from e
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == SPEC_NAME
        ):
            try:
                return ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError) as e:
                raise PrecompileError(
                    f"python_code's {SPEC_NAME} is not a literal; {_NOT_AN_ARTIFACT}."
                ) from e
    raise PrecompileError(f"python_code has no {SPEC_NAME}; {_NOT_AN_ARTIFACT}.")
