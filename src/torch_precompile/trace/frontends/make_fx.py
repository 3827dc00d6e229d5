"""The make_fx front-end: ``fn`` as a function of flat tensors, the examples it runs on, the
watchers around it, and the ``make_fx`` trace itself (on real examples, or symbolic where
dims are marked dynamic), with what the trace refuses as it goes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree, storage_id
from torch_precompile.internals.distributed import pretend_coordinate
from torch_precompile.internals.tracing import (
    FakeTensorMode,
    GuardOnDataDependentSymNode,
    differentiable_rnns,
    is_view,
    padded_lengths_in_python,
    plain_checkpoints,
    reparametrize_module,
    trace_with_user_lines,
    tracer_refusal,
    version_of,
    written_inputs,
)
from torch_precompile.spec import Ambient, OutputAlias
from torch_precompile.trace import checks, dynamic
from torch_precompile.trace.arguments import Layout
from torch_precompile.trace.blocks import BlockMarks, repeated_blocks
from torch_precompile.trace.facts.ambient import DefaultDtypeUse, ambient_at_capture
from torch_precompile.trace.facts.grads import GradUse
from torch_precompile.trace.facts.hooks import global_hooks, module_hooks
from torch_precompile.trace.facts.param_writes import ParamWrites
from torch_precompile.trace.facts.random_state import PythonDraws, SeedWatch
from torch_precompile.trace.facts.reads import ReadRecorder
from torch_precompile.trace.facts.settings import SettingReads
from torch_precompile.trace.facts.tensor_reads import TensorReads
from torch_precompile.trace.facts.value_guards import GuardRecorder
from torch_precompile.trace.holders import HolderCopies
from torch_precompile.trace.optimizers import only_arguments_step, refuse_returned_lrs, stepping
from torch_precompile.trace.parallel import data_parallel, fully_shard
from torch_precompile.trace.parallel.dtensor import Distribution
from torch_precompile.trace.stand_ins import StandIns
from torch_precompile.trace.state import ModelState


@dataclass
class Outputs:
    """What the flat function learns about fn's results while it is traced."""

    spec: pytree.TreeSpec | None = None
    grad_indices: list[int] = dataclasses.field(default_factory=list)
    aliases: tuple[OutputAlias, ...] = ()
    # Where fn returns a number it read off a tensor (``loss.item()``): every call checks it.
    returned_reads: list[str] = dataclasses.field(default_factory=list)

    def returned_reads_report(self) -> str | None:
        """Said at capture: a returned ``.item()`` makes every call with another value fail."""
        if not self.returned_reads:
            return None
        where = "; ".join(read.rsplit(" at ", 1)[-1] for read in self.returned_reads)
        return (
            f"fn returns a number it read off a tensor (.item(), at {where}). "
            "The artifact checks such a read at every call, so a call where it comes out "
            "another number is refused. Return the tensor instead (loss.detach()) and call "
            ".item() on the result."
        )


@dataclass(frozen=True)
class Traced:
    graph: torch.fx.GraphModule
    examples: list[torch.Tensor]
    dynamic_inputs: dynamic.DynamicInputs | None
    coordinate_dependent: bool
    mutated: tuple[int, ...] = ()  # flat inputs the graph writes in place


class Watch:
    """What capture notes about fn beyond tensors while it is traced: the Python values it
    reads, whether it builds tensors of the default dtype; and the state before it runs."""

    def __init__(self, layout: Layout, blocks: bool | Sequence[type] | None = None) -> None:
        self.layout = layout
        self.blocks = BlockMarks(repeated_blocks(layout.modules, blocks))
        self.submodules = [
            m for root in layout.modules for _, m in root.named_modules(remove_duplicate=False)
        ]
        self.reads = ReadRecorder(self.submodules)
        self.default_dtype = DefaultDtypeUse()
        self.settings = SettingReads()
        self.grads = GradUse()
        self.param_writes = ParamWrites()
        self.tensor_reads = TensorReads()
        self.global_hooks = global_hooks()
        self.hooks = [module_hooks(m) for m in self.submodules]
        self.seeds = SeedWatch()
        self.draws = PythonDraws()

    def named_submodules(self) -> list[tuple[str, torch.nn.Module]]:
        """Each submodule as messages name it, in walk order."""
        names = [
            arg for i, arg in enumerate(self.layout.arg_names) if i in self.layout.module_positions
        ]
        return [
            (f"module {name!r} of {arg}" if name else f"model {arg}", module)
            for arg, root in zip(names, self.layout.modules, strict=True)
            for name, module in root.named_modules(remove_duplicate=False)
        ]

    def ambient(self) -> Ambient:
        return ambient_at_capture(self.default_dtype.used, self.settings.records())


def flat_function(
    fn: Callable[..., Any],
    layout: Layout,
    recorder: GuardRecorder,
    outputs: Outputs,
    watch: Watch,
) -> Callable[..., list[Any]]:
    """``fn`` over flat tensors (model state, then input tensors), as make_fx traces it.

    It returns result leaves, then gradients, then value guards, and fills ``outputs``.
    """
    state, inputs, sharding = layout.state, layout.inputs, layout.sharding
    wrapping = layout.wrapping
    # A symbolic trace reads no values, so it has no guards to record.
    recording = contextlib.nullcontext() if any(layout.marks) else recorder

    def flat_fn(*locals_: torch.Tensor) -> list[Any]:
        flat = wrapping.rebuild(locals_)
        flat = flat if sharding is None else sharding.rebuild(flat)
        leaves = list(inputs.leaves)
        start, lrs = layout.optimizer_start, layout.optimizer_start + layout.num_optimizer_state
        placed = list(zip(layout.tensor_positions, flat[layout.num_state : start], strict=True))
        for position, tensor in placed:
            leaves[position] = tensor
        holders = HolderCopies()
        user_args = iter(pytree.tree_unflatten(leaves, inputs.spec))
        passed = {*layout.module_positions, *layout.optimizer_positions}
        call_args = [
            a if i in passed else holders.closed(a, next(user_args), layout.arg_names[i])
            for i, a in enumerate(layout.args)
        ]
        with contextlib.ExitStack() as stack:
            for module, binding in zip(layout.modules, state.bindings, strict=True):
                reparam = {name: flat[index] for name, index in binding.items()}
                stack.enter_context(reparametrize_module(module, reparam, tie_weights=True))
            stack.enter_context(
                stepping(
                    layout.optimizers,
                    flat[start:lrs],
                    flat[lrs:],
                    flat[: layout.num_params],
                    state.tensors,
                )
            )
            stack.enter_context(only_arguments_step(layout.optimizers))
            stack.enter_context(data_parallel.tracing(layout.data_parallel, _trained(layout, flat)))
            stack.enter_context(fully_shard.tracing(layout.fully_sharded, state.tensors, flat))
            with (
                watch.draws,  # outermost: what it runs to compare is not fn's
                recording,
                watch.reads,
                watch.default_dtype,
                watch.settings,
                watch.grads.watching(flat[: layout.num_params]),
                watch.param_writes.watching(
                    flat[: layout.num_params], copied=bool(layout.optimizers)
                ),
                watch.seeds,
                watch.tensor_reads.watching(placed, inputs.leaves),
                plain_checkpoints(),
                padded_lengths_in_python(),
                watch.blocks.watching(),
            ):
                result = fn(*call_args)
        holders.refuse_writes()
        _refuse_stray_gradients(state, flat, layout.num_params)
        result_leaves, outputs.spec = pytree.tree_flatten(result)
        checks.refuse_result_leaves(result_leaves)
        outputs.returned_reads = _returned_reads(recorder, result_leaves)
        refuse_returned_lrs(layout.optimizers, result_leaves)
        grads = [(i, p.grad) for i, p in enumerate(flat[: layout.num_params]) if p.grad is not None]
        if sharding is not None:
            result_leaves = sharding.local_results(result_leaves)
            grads = [(i, sharding.local_grad(i, g)) for i, g in grads]
        result_leaves, inner = wrapping.flat_results(result_leaves)
        outputs.grad_indices = [i for i, _ in grads]
        outputs.aliases = _output_aliases(result_leaves, locals_)
        return [
            *result_leaves,
            *(g for _, g in grads),
            *(g.tensor for g in recorder.guards),
            *inner,
        ]

    return flat_fn


def _trained(layout: Layout, flat: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each DDP model's traced parameters that require grad, once each."""
    bindings = layout.state.bindings
    return [
        [
            flat[i]
            for i in sorted(set(bindings[arg.model].values()))
            if i < layout.num_params and flat[i].requires_grad
        ]
        for arg in layout.data_parallel
    ]


def run_trace(
    flat_fn: Callable[..., list[Any]],
    layout: Layout,
    recorder: GuardRecorder,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
    on_fakes: bool,
    stand_ins: StandIns | None = None,
) -> Traced:
    """Trace with every parameter's ``.grad`` cleared, and put the caller's back afterwards.

    Parameters are traced as themselves, so an optimizer step inside fn would update them for
    real: with an optimizer among the arguments their values are put back too. So are the
    buffers traced as themselves (see ``_examples``).
    """
    params = layout.state.tensors[: layout.num_params]
    saved_grads = [p.grad for p in params]
    buffers = _buffers_as_themselves(layout)
    written = [*(params if layout.optimizers else ()), *buffers]
    # A fake holds no values to put back.
    saved_values = [t.detach().clone() for t in written] if not (on_fakes or stand_ins) else []
    # Subclasses and DTensors are laid out otherwise: their examples are not flat inputs.
    plain = layout.sharding is None and not layout.wrapping.inputs
    try:
        for p in params:
            p.grad = None
        if any(layout.marks):
            dynamic_inputs = dynamic.fake_inputs(
                layout.state.tensors, layout.inputs.leaves, layout.inputs.names, layout.marks
            )
            dynamic_inputs = dataclasses.replace(
                dynamic_inputs, fakes=layout.wrapping.expand(dynamic_inputs.fakes)
            )
            gm = _trace_symbolic(flat_fn, dynamic_inputs.fakes, dynamic_inputs, decompositions)
            mutated = tuple(written_inputs(gm.graph)) if plain else ()
            return Traced(gm, dynamic_inputs.fakes, dynamic_inputs, False, mutated)
        examples = _examples(layout, buffers)
        versions = [version_of(e) for e in examples]
        trace = _MakeFxRun(flat_fn, decompositions, examples, on_fakes, stand_ins)
        gm = trace.run()
        _refuse_grad_flags_set(layout, examples)
        # Which examples the trace wrote shows which inputs the graph writes, and so do the
        # operators' schemas (native_batch_norm writes its running statistics without moving
        # their versions): as laid out here, an example is a flat input.
        mutated = (
            tuple(
                sorted(
                    {
                        i
                        for i, (e, v) in enumerate(zip(examples, versions, strict=True))
                        if version_of(e) != v
                    }.union(written_inputs(gm.graph))
                )
            )
            if plain
            else ()
        )
        sharding = layout.sharding
        dependent = sharding is not None and (
            not on_fakes or trace.depends_on_coordinate(sharding, gm.code, recorder)
        )
        return Traced(gm, examples, None, dependent, mutated)
    finally:
        for p, grad in zip(params, saved_grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for t, value in zip(written, saved_values, strict=False):
                t.copy_(value)
        for t in buffers:
            if t.grad_fn is not None:  # an in-place write of a value with history
                t.detach_()


def _refuse_grad_flags_set(layout: Layout, examples: Sequence[torch.Tensor]) -> None:
    """Refuse fn's ``x.requires_grad_()`` on an input tensor: the copy the trace ran on took
    the flag, but an artifact leaves the caller's tensor as it was, where eager leaves it
    requiring grad."""
    if layout.sharding is not None or layout.wrapping.inputs:
        return  # examples laid out otherwise
    for k, i in enumerate(layout.tensor_positions):
        given = layout.inputs.leaves[i].requires_grad
        example = examples[layout.num_state + k]
        if example.grad_fn is not None and not torch.is_grad_enabled():
            continue  # an in-place write the trace recorded; eager, without grad, would not
        if example.requires_grad != given:
            name = layout.inputs.names[i]
            raise PrecompileError(
                f"fn sets requires_grad={not given} on input {name} (requires_grad_()) while "
                f"it is traced. An artifact leaves the tensor passed in as it was, so {name} "
                f"would not come back with the flag eager gives it. Set it before the call, "
                f"outside fn ({name}.requires_grad_({not given}) before precompile and before "
                "each call): fn computes the same gradients with it."
            )


def _buffers_as_themselves(layout: Layout) -> list[torch.Tensor]:
    """Plain buffers, which the trace takes as themselves: code that reaches one by another
    path (a cache object holding the tensor a wrapper registered) then reads the graph input,
    not a constant. ``run_trace`` puts back what fn writes to them (BatchNorm statistics)."""
    if layout.sharding is not None:
        return []
    return [
        t
        for i, t in enumerate(layout.state.tensors)
        if layout.num_params <= i
        and i not in layout.wrapping.inputs
        and not is_view(t)
        and not t.requires_grad
    ]


def _examples(layout: Layout, themselves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Parameters are traced as themselves (a backward writes their .grad, which run_trace
    # restores), and so are plain buffers (see _buffers_as_themselves); input tensors as
    # copies, so that mutations fn makes while being traced never touch the caller's.
    state, wrapped = layout.state, layout.wrapping.inputs
    as_themselves = {id(t) for t in themselves}
    # Optimizer state is copied for the same reason; each param group's lr is a 0-dim input.
    # A subclass's inner tensors are copied instead of it (see Wrapping.expand).
    flat = [*state.tensors, *(layout.inputs.leaves[i] for i in layout.tensor_positions)]
    examples = [
        *(
            t
            if i < layout.num_params
            or i in wrapped
            or (i < layout.num_state and id(t) in as_themselves)
            else _copy(t)
            for i, t in enumerate(flat)
        ),
        *(_copy(e.example) for o in layout.optimizers for e in o.entries),
        *(learning_rate(group) for o in layout.optimizers for group in o.optimizer.param_groups),
    ]
    if layout.sharding is not None:
        return layout.sharding.locals(examples)
    return layout.wrapping.expand(examples, _copy, layout.num_params)


def learning_rate(group: dict[str, Any]) -> torch.Tensor:
    """A param group's lr as the graph reads it: a 0-dim float64 tensor (a float's exact
    value)."""
    return torch.tensor(float(group["lr"]), dtype=torch.float64)


class _MakeFxRun:
    """One make_fx trace of the flat function, on the examples or on fakes of them."""

    def __init__(
        self,
        flat_fn: Callable[..., Any],
        decompositions: Mapping[Any, Callable[..., Any]] | None,
        examples: list[torch.Tensor],
        on_fakes: bool,
        stand_ins: StandIns | None = None,
    ) -> None:
        self.flat_fn, self.decompositions, self.examples = flat_fn, decompositions, examples
        self.on_fakes, self.stand_ins = on_fakes, stand_ins

    def run(self) -> torch.fx.GraphModule:
        with torch.enable_grad(), fork_rng(self.examples), differentiable_rnns():
            if self.stand_ins is not None:
                return self._run_on_stand_ins(self.stand_ins)
            if not self.on_fakes:
                try:
                    return trace_with_user_lines(
                        self.flat_fn, self.decompositions, tolerate_data_dependent_ops=True
                    )(*self.examples)
                except (NotImplementedError, TypeError) as e:
                    _raise_tracer_refusal(e)
                    raise
            fake_mode = FakeTensorMode()
            with fake_mode:
                fakes = [fake_mode.from_tensor(e) for e in self.examples]
                try:
                    return trace_with_user_lines(self.flat_fn, self.decompositions)(*fakes)
                except PrecompileError:
                    raise
                except Exception as e:
                    first_line = (str(e).splitlines() or [""])[0]
                    raise PrecompileError(
                        "compile_on_one_rank traces fn on fake tensors (so that no collective "
                        "waits for ranks that are not tracing), and fn failed there: "
                        f"{type(e).__name__}: {first_line}. Reading tensor "
                        "values (.item(), data-dependent Python branches) needs real tensors: "
                        "precompile on every rank instead (compile_on_one_rank=False)."
                    ) from e

    def _run_on_stand_ins(self, stand_ins: StandIns) -> torch.fx.GraphModule:
        with stand_ins.fake_mode:
            try:
                return trace_with_user_lines(self.flat_fn, self.decompositions)(*self.examples)
            except PrecompileError:
                raise
            except Exception as e:
                _raise_tracer_refusal(e)
                first_line = (str(e).splitlines() or [""])[0]
                raise PrecompileError(
                    "a build without the weights traces fn on fake tensors (stand-ins of "
                    f"{stand_ins.device} for the meta or fake ones given), and fn failed there: "
                    f"{type(e).__name__}: {first_line}. Reading tensor values (.item(), "
                    "data-dependent Python branches, tensors printed) needs real tensors: build "
                    "with the real weights, or keep such reads out of fn."
                ) from e

    def depends_on_coordinate(
        self, sharding: Distribution, code: str, recorder: GuardRecorder
    ) -> bool:
        """Whether the graph changes when this rank pretends to sit elsewhere in its meshes."""
        guards = list(recorder.guards)
        others = [
            [(c + 1) % size for c, size in zip(mesh.get_coordinate(), mesh.shape, strict=True)]
            for mesh in sharding.meshes
        ]
        recorder.guards.clear()  # the rerun records its own
        try:
            with pretend_coordinate(sharding.meshes, others):
                return self.run().code != code
        except PrecompileError:
            return True  # e.g. shards of other shapes there: the graph is this rank's alone
        finally:
            recorder.guards[:] = guards


def _trace_symbolic(
    flat_fn: Callable[..., Any],
    fakes: list[torch.Tensor],
    dynamic_inputs: dynamic.DynamicInputs,
    decompositions: Mapping[Any, Callable[..., Any]] | None,
) -> torch.fx.GraphModule:
    try:
        with torch.enable_grad(), dynamic_inputs.fake_mode, differentiable_rnns():
            return trace_with_user_lines(flat_fn, decompositions, tracing_mode="symbolic")(*fakes)
    except (NotImplementedError, TypeError) as e:
        _raise_tracer_refusal(e)
        raise
    except GuardOnDataDependentSymNode as e:
        raise PrecompileError(
            "fn branches on, or needs a fixed value of, a dim marked with mark_unbacked (or a "
            "value computed from one), so no single artifact can serve every size. Marked dims "
            "that must be equal should share one shape_id; a decision on whether a size is 1 "
            "is settled by declaring min=2 (mark_unbacked(x, dim, min=2)); otherwise leave the "
            "dim static or write fn without the size-dependent decision. The trace stopped at: "
            f"{str(e).splitlines()[0]}"
        ) from e


def _raise_tracer_refusal(error: BaseException) -> None:
    """Raise a PrecompileError for the tracer's refusal of what fn did; return on any other
    error (fn's own ones reach the caller unchanged)."""
    refusal = tracer_refusal(error)
    if refusal is None:
        return
    where = refusal.where
    if refusal.storage:
        raise PrecompileError(
            f"fn reads or writes a tensor's memory through its storage at {where} "
            "(x.untyped_storage()[i], x.storage()), which the trace cannot record: a graph "
            "takes tensors, not storages. Use tensor operations instead (x.flatten()[i].item() "
            "to read a value, x.view(torch.uint8) for its bytes), or do it outside fn."
        ) from error
    first_line = (str(error).splitlines() or [""])[0]
    raise PrecompileError(
        f"the trace cannot follow fn at {where}: it hands an operator something a graph cannot "
        f"record ({type(error).__name__}: {first_line}). Compute it with tensor operations, "
        "or do it outside fn."
    ) from error


def _returned_reads(recorder: GuardRecorder, leaves: Sequence[Any]) -> list[str]:
    """Where a float fn returns is one a read gave (``loss.item()``). Compared by value (torch
    makes a new float for the caller): floats only, where equal values seldom meet by chance,
    and only for a warning."""
    returned = {leaf for leaf in leaves if type(leaf) is float}
    return [
        g.description
        for g in recorder.guards
        if type(g.expected) is float and g.expected in returned
    ]


def _output_aliases(results: list[Any], flat: tuple[torch.Tensor, ...]) -> tuple[OutputAlias, ...]:
    owners = {storage_id(t): i for i, t in enumerate(flat)}
    aliases: list[OutputAlias] = []
    for out, result in enumerate(results):
        if not isinstance(result, torch.Tensor):
            continue
        source = owners.get(storage_id(result))
        if source is None:
            continue
        if result is flat[source]:
            aliases.append(OutputAlias(out, source))
            continue
        layout = (*result.shape, *result.stride(), result.storage_offset())
        if all(isinstance(v, int) for v in layout):  # a view with symbolic sizes stays a copy
            # An int: the result's offset is (checked above), and the flat inputs' are static.
            offset = cast(int, result.storage_offset() - flat[source].storage_offset())
            aliases.append(
                OutputAlias(out, source, tuple(result.shape), tuple(result.stride()), offset)
            )
    return tuple(aliases)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with exactly the same layout (strides, offset, even overlap), so that what the
    trace sees of an input's layout is what the caller passes."""
    with torch.no_grad():
        source = t.detach()
        try:
            if type(source) is not torch.Tensor or source.layout is not torch.strided:
                raise NotImplementedError("not a plain strided tensor")
            copy = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                source.untyped_storage().clone(),
                source.storage_offset(),
                source.shape,
                source.stride(),
            )
        except (NotImplementedError, RuntimeError):
            # Subclasses, sparse tensors, or storage access refused (inside another trace).
            copy = source.clone(memory_format=torch.preserve_format)
    return copy.requires_grad_(t.requires_grad)


@contextlib.contextmanager
def fork_rng(tensors: list[torch.Tensor]) -> Any:
    """Run the trace without advancing the caller's random streams (dropout draws)."""
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        yield


def _refuse_stray_gradients(
    state: ModelState, flat: Sequence[torch.Tensor], num_params: int
) -> None:
    for name, tensor in zip(state.buffer_names, flat[num_params : len(state.tensors)], strict=True):
        if tensor.is_leaf and tensor.grad is not None:
            raise PrecompileError(
                f"buffer {name!r} received a gradient (it has requires_grad=True), but only "
                "parameters get gradients from a precompiled step. Register it with "
                "register_parameter, or make it requires_grad=False."
            )
    # A tensor written in place with history (a KV cache) is no leaf: it gets no .grad.
    if any(t.is_leaf and t.grad is not None for t in flat[len(state.tensors) :]):
        raise PrecompileError(
            "a runtime input received a gradient; a precompiled step only puts gradients on "
            "model parameters, so the input's gradient would be lost. Make it a parameter of "
            "a module argument, or return torch.autograd.grad(...) from fn instead."
        )
