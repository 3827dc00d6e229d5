"""The artifact spec's records: what an artifact's calling convention holds, field by field.

``ArtifactSpec`` is the whole spec; each of its lists holds one kind of record below. Every
field that came after schema 1.0 names its version (``since``); a record's other fields came
with the spec field that holds it. How the records are laid out as the ``ARTIFACT_SPEC``
literal is in ``literal``; how they map onto the graph's flat inputs, in ``layout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, ClassVar

from torch_precompile.errors import PrecompileError
from torch_precompile.shipped.driver.tensor_rules import argument_kind, runs_backward
from torch_precompile.spec.versions import SchemaVersion, since

# Field metadata: a feature only the generic driver has. A spec that holds anything but the
# default in such a field, at any depth, is run by the generic ``Driver``; the rest by the
# plain runtime (``artifact.plain_checks``).
GENERIC: dict[str, bool] = {"generic": True}

# (kind, value) for a Python value, written by ``trace.values.encode``: ("none", None),
# ("const", 3) (a bool, int, float, complex, str or bytes), ("float", "nan") (a non-finite
# float), ("dtype", "float16"), ("device", "cpu"), ("enum", ("pkg.Mode", "FAST")), ("list",
# (items...)), ("tuple", (...)), ("dict", ((key, value), ...)), ("set", (items sorted by
# repr...)), ("frozenset", (...)), ("frozen", ("pkg.Cfg", (("n", ("const", 2)),))) (a record
# compared field by field: a frozen dataclass or a named tuple), ("dataclass", like "frozen")
# (a record built again from its init fields: in a flatten context), ("size", (2, 3)),
# ("numpy", ("numpy.float32", ("const", 2.0))), ("ndarray", ("float32", (2,), (items...))),
# ("callable", "torch.relu"), ("code", ("f.<locals>.g", digest)) and ("object", ("pkg.Spec",
# (("s", ("const", 2.0)),))) (an object of the user's by the plain values it holds). Which
# kinds a value may take depends on what it is kept for (``trace.values.Use``): inputs are
# scalars and "frozen"; flatten contexts add containers, "size" and "dataclass"; read values
# all but "size" and "dataclass"; optimizer options are ("const", value), a tuple of plain
# values included; a read of an attribute a module lacks is ("absent", None). Schema 3 and
# older also wrote ("repr", (type name, repr)).
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
    is_optimizer: bool = field(default=False, metadata=since(4))

    @property
    def kind(self) -> str:
        """``"model"``, ``"optimizer"`` or ``"input"``."""
        return argument_kind(self)


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
    # tensor hooks on a parameter of a training step
    hooks: tuple[HookSet, ...] = field(default=(), metadata=since(8) | GENERIC)
    # What fn does with the .grad a call finds: None, its backward adds to it; "read", fn
    # reads it (a call must come without one); "replaced", fn drops it before any read.
    old_grad: str | None = field(default=None, metadata=since(10, 2) | GENERIC)


@dataclass(frozen=True)
class Submodule:
    """A module reached from a model argument: its ``training`` flag, its class by qualified
    name (None: not recorded, schema 7 and older), the hooks on it at capture, and the
    forward it ran where that is not its class's own (None: the class's own)."""

    name: str
    training: bool
    cls: str | None = field(default=None, metadata=since(8))
    hooks: tuple[HookSet, ...] = field(default=(), metadata=since(8) | GENERIC)
    forward: str | None = field(default=None, metadata=since(10, 1))


@dataclass(frozen=True)
class InputLeaf:
    """One leaf of the runtime inputs, in pytree order: a tensor, or a baked Python value.

    ``shape`` has None for a dynamic dim; ``bounds`` maps such a dim to its declared (min,
    max); ``strides`` is the layout the kernels assume (a memory-format name for an input
    with dynamic dims; None: any layout). ``read`` (from 10.4): the properties fn's Python read
    of the tensor, each as (``"stride"``, ``"storage_offset"``, ``"is_inference"``, ``"is_neg"``
    or ``"is_conj"``, the value it had, the line that read it).
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
    read: tuple[tuple[str, tuple[int, ...] | int | bool, str], ...] = field(
        default=(), metadata=since(10, 4) | GENERIC
    )


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
    module named ``module``, then the attributes ``path[1:]`` off it (from 10.1), or, for
    ``os``'s ``environ``, the variable ``path[1]`` (expected None where it was unset); a step
    ``__closure__`` of a global read takes the function reached so far into its closure: the
    next step names the closure variable (``("step", "__closure__", "scale")``, from 10.5);
    for ``__main__``, ``file`` is the base name of the script it was at capture (no path of
    the build machine). ``where`` is the line that read it.
    """

    submodule: int | None
    module: str | None
    path: tuple[str, ...]
    expected: EncodedValue
    where: str
    file: str | None = None


@dataclass(frozen=True)
class GuardNote:
    """A guard Dynamo put on what ``fn``'s Python read (``tracer="dynamo"``, from 10.5), and
    what became of it: ``outcome`` is ``"checked"`` (``by`` names the artifact's check that
    holds it), ``"fixed"`` (it cannot differ at a call of this artifact; ``by`` says why) or
    ``"dropped"`` (nothing checks it; ``by`` says why). ``kind`` is Dynamo's guard kind
    (``CONSTANT_MATCH``), ``reads`` the place as Dynamo writes it (``G['SCALE']``), ``count``
    how many guards of that kind on that place of that outcome it stands for."""

    # Defaults only because the record came in a minor version (see docs/SPEC_VERSIONS.md):
    # capture writes every field.
    kind: str = ""
    reads: str = ""
    outcome: str = ""
    by: str = ""
    count: int = 1


@dataclass(frozen=True)
class Ambient:
    """Thread and process state that changes what the traced ops compute, as at capture:
    autocast (device type and dtype, where enabled), the default dtype (None when fn built no
    tensor from it), deterministic algorithms, the active torch function and dispatch modes by
    class name, and the torch settings fn's Python read (from 10.2): each as (the reading call,
    ``"torch.is_grad_enabled"``, the value it gave, the line that read it)."""

    autocast: tuple[tuple[str, str], ...] = ()
    default_dtype: str | None = None
    deterministic: bool = False
    modes: tuple[str, ...] = ()
    settings: tuple[tuple[str, bool | int | str, str], ...] = field(
        default=(), metadata=since(10, 2)
    )


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

    A spec holds up to two: ``autograd``, for calls where only flat inputs that required grad
    at capture require grad, and ``autograd_for_inputs``, for calls where a floating-point
    input tensor requires grad that did not (its ``inputs`` add every such tensor). With
    ``outputs``, the artifact holds a forward and a backward graph for the record beside the
    plain one: a call under grad mode runs the forward, whose results get history;
    ``backward()`` later runs the backward graph, which gives gradients for ``inputs`` (flat
    input indices). ``outputs`` are the result leaves with history, in the order the backward
    takes their tangents, each in the layout ``tangent_strides`` gives. ``saved`` says what
    the forward keeps for backward, one entry per value. ``unavailable`` says why results
    carry no history where they cannot (None: they can, or nothing required grad).
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

    schema_version: SchemaVersion
    backend: str
    torch: TorchBuild
    args: tuple[Argument, ...]
    model: tuple[ModelTensor, ...]
    submodules: tuple[Submodule, ...]
    inputs: tuple[InputLeaf, ...]
    in_spec: str | None
    out_spec: str
    value_guards: tuple[ValueGuard, ...] = field(default=(), metadata=GENERIC)
    dynamic_dims: tuple[DynamicDim, ...] = field(default=(), metadata=GENERIC)
    size_relations: tuple[SizeRelation, ...] = field(default=(), metadata=GENERIC)
    output_aliases: tuple[OutputAlias, ...] = field(default=(), metadata=GENERIC)
    meshes: tuple[Mesh, ...] = field(default=(), metadata=since(2) | GENERIC)
    distributed: tuple[DistributedTensor, ...] = field(default=(), metadata=since(2) | GENERIC)
    kernels: tuple[KernelObject, ...] = field(default=(), metadata=since(3))
    optimizers: tuple[Optimizer, ...] = field(default=(), metadata=since(4))
    param_groups: tuple[ParamGroup, ...] = field(default=(), metadata=since(4))
    optimizer_state: tuple[OptimizerState, ...] = field(default=(), metadata=since(4))
    wrapped: tuple[WrappedTensor, ...] = field(default=(), metadata=since(5) | GENERIC)
    wrapped_inner: tuple[InnerTensor, ...] = field(default=(), metadata=since(5) | GENERIC)
    data_parallel: tuple[DataParallel, ...] = field(default=(), metadata=since(6) | GENERIC)
    fully_sharded: tuple[FullyShardedGroup, ...] = field(default=(), metadata=since(6) | GENERIC)
    global_hooks: tuple[HookSet, ...] = field(default=(), metadata=since(8) | GENERIC)
    read_values: tuple[ReadValue, ...] = field(default=(), metadata=since(8))
    ambient: Ambient | None = field(default=None, metadata=since(8))
    mutated: tuple[int, ...] = field(default=(), metadata=since(8))
    seed: int | None = field(default=None, metadata=since(8) | GENERIC)
    autograd: Autograd | None = field(default=None, metadata=since(9))
    # The same for calls where a floating-point input tensor requires grad that did not at
    # capture: its backward also gives their gradients (see Autograd).
    autograd_for_inputs: Autograd | None = field(default=None, metadata=since(10, 6))
    # inductor: the wrapper of each graph (plain, then forward and backward): cpp or python
    wrappers: tuple[str, ...] = field(default=(), metadata=since(10))
    # tracer="dynamo": what its guards became (see GuardNote)
    guards: tuple[GuardNote, ...] = field(default=(), metadata=since(10, 5))
    variants: tuple[ArtifactSpec, ...] = field(default=(), metadata=since(7) | GENERIC)

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
        "guards": GuardNote,
        "ambient": Ambient,
        "autograd": Autograd,
        "autograd_for_inputs": Autograd,
    }
    # Fields that hold one record (or None), not a list of them.
    SINGLE: ClassVar[tuple[str, ...]] = ("torch", "ambient", "autograd", "autograd_for_inputs")

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
    def needs_generic_driver(self) -> bool:
        """Whether a field only the generic driver handles (``GENERIC``) holds anything, here
        or in a record the spec holds, or the call takes more than one model."""
        return len(self.model_names) > 1 or _holds_generic(self)

    @property
    def runs_backward(self) -> bool:
        """Whether fn runs a backward itself: a model tensor gets a gradient from it, or it
        steps an optimizer argument."""
        return runs_backward(self)

    @property
    def gives_history(self) -> bool:
        """Whether some call's results get autograd history from a forward and backward graph
        of the artifact (fn runs no backward itself)."""
        forms = (self.autograd, self.autograd_for_inputs)
        return any(form is not None and form.outputs for form in forms)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args if a.is_model)

    @property
    def optimizer_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args if a.is_optimizer)

    def with_kernels(self, kernels: Sequence[KernelObject]) -> ArtifactSpec:
        """The spec naming the kernel objects a lowering built."""
        return replace(self, kernels=tuple(kernels))

    @property
    def all_variants(self) -> tuple[ArtifactSpec, ...]:
        """Every variant, the first (this spec, less its ``variants``) included."""
        return (replace(self, variants=()), *self.variants)

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
        return replace(
            self,
            kernels=kept,
            variants=tuple(replace(o, kernels=kept, variants=()) for o in others),
        )


def _holds_generic(record: Any) -> bool:
    for f in fields(record):
        value = getattr(record, f.name)
        if f.metadata.get("generic") and value != f.default:
            return True
        held = value if type(value) is tuple else (value,)
        if any(is_dataclass(v) and _holds_generic(v) for v in held):
            return True
    return False


def _arguments(spec: ArtifactSpec) -> str:
    return ", ".join(f"{a.name}: {a.kind}" for a in spec.args)
