"""Invariants enforced on a captured graph, and the lifting of tensor literals to inputs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals.tracing import effect_of

_LIFT_FRESH = torch.ops.aten.lift_fresh_copy.default
# Literals are written into the artifact as source; past this size they belong in a buffer.
MAX_LITERAL_ELEMENTS = 1 << 16


def _get_attrs(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Any]]:
    found = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        found.append((node, value))
    return found


def refuse_control_flow(gm: torch.fx.GraphModule) -> None:
    subgraphs = [str(n.target) for n, v in _get_attrs(gm) if isinstance(v, torch.fx.GraphModule)]
    if subgraphs:
        raise PrecompileError(
            "fn uses a control-flow operator (torch.cond or torch.while_loop), whose branches "
            f"are captured as subgraphs {subgraphs}; precompile cannot lower those yet. Decide "
            "the branch in Python (the trace follows the branch taken by the example) or move "
            "the loop out of fn."
        )


def refuse_own_generators(gm: torch.fx.GraphModule) -> None:
    """A random op that draws from a ``torch.Generator`` of fn's own (a module's ``self.gen``)
    would need that generator, whose state moves at every draw, inside the artifact."""
    for node, value in _get_attrs(gm):
        if isinstance(value, torch.Generator):
            users = ", ".join(str(user.target) for user in node.users)
            raise PrecompileError(
                f"fn draws random numbers from a torch.Generator of its own ({users}); the "
                "artifact cannot carry that generator's state from call to call. Draw from "
                "the default generator (seed it with torch.manual_seed, before the call or "
                "inside fn) or pass the noise in as an input tensor."
            )


def refuse_effects(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if effect_of(node.target):
            raise PrecompileError(
                f"fn calls the effectful operator {node.target} (it has an ordering side "
                "effect such as printing or recording), which a precompiled graph cannot "
                "replay faithfully. Move it out of fn."
            )


def lift_literals(
    gm: torch.fx.GraphModule, describe_origin: Callable[[torch.Tensor], str | None]
) -> list[torch.Tensor]:
    """Turn tensor literals into trailing placeholders; reject every other baked tensor.

    A literal (``torch.tensor([...])`` inside fn) shows up as a constant read only by
    ``lift_fresh_copy``. It is as fixed as any Python value in fn, so it becomes an input the
    artifact builds itself. Any other constant tensor is live state closed over by fn.
    """
    literals: list[torch.Tensor] = []
    baked: list[str] = []
    last_placeholder = list(gm.graph.find_nodes(op="placeholder"))[-1:]
    for node, value in _get_attrs(gm):
        if not isinstance(value, torch.Tensor):
            continue
        if node.users and all(user.target is _LIFT_FRESH for user in node.users):
            _refuse_large_literal(value)
            anchor = last_placeholder[-1] if last_placeholder else next(iter(gm.graph.nodes))
            insert = gm.graph.inserting_after if last_placeholder else gm.graph.inserting_before
            with insert(anchor):
                placeholder = gm.graph.placeholder(f"literal_{len(literals)}")
            placeholder.meta.update(node.meta)
            last_placeholder.append(placeholder)
            node.replace_all_uses_with(placeholder)
            gm.graph.erase_node(node)
            delattr(gm, str(node.target))
            literals.append(value.detach().clone())
        else:
            origin = describe_origin(value)
            # A training step reads the same tensor forward and backward: name it once.
            baked.append(
                f"{origin or 'unknown origin'} (shape {tuple(value.shape)}, dtype {value.dtype})"
            )
    if baked:
        raise PrecompileError(
            "fn reads tensors that are neither inputs nor computed inside fn, so the trace "
            "would bake their current values into the artifact: "
            + "; ".join(dict.fromkeys(baked))
            + ". "
            "Register module state with register_buffer / register_parameter, or pass the "
            "tensor as an argument of fn."
        )
    if literals:
        gm.recompile()
    return literals


def _refuse_large_literal(value: torch.Tensor) -> None:
    if value.numel() > MAX_LITERAL_ELEMENTS:
        raise PrecompileError(
            f"fn builds a tensor literal of {value.numel()} elements (shape "
            f"{tuple(value.shape)}); precompile writes literals into the artifact as source and "
            f"accepts at most {MAX_LITERAL_ELEMENTS}. Register it as a buffer or pass it as an "
            "argument."
        )
    if value.is_complex() or value.layout is not torch.strided or value.is_quantized:
        raise PrecompileError(
            f"fn builds a {value.dtype} {value.layout} tensor literal, which precompile cannot "
            "write as source. Register it as a buffer or pass it as an argument."
        )


def constant_source(value: Any) -> str:
    """Source for a constant a graph returns (a number, None), nan and infinities included."""
    if isinstance(value, float) and value != value:
        return "float('nan')"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return f"float({str(value)!r})"
    return repr(value)


def literal_source(value: torch.Tensor) -> str:
    """Python source that rebuilds ``value`` exactly (``inf`` / ``nan`` must be in scope)."""

    def text(item: Any) -> str:
        if isinstance(item, list):
            return "[" + ", ".join(text(x) for x in item) + "]"
        if isinstance(item, float) and not math.isfinite(item):
            return "nan" if math.isnan(item) else ("inf" if item > 0 else "-inf")
        return repr(item)

    body = text(value.cpu().tolist())
    return (
        f"torch.tensor({body}, dtype={value.dtype}, device={str(value.device)!r})"
        f".reshape({tuple(value.shape)!r})"
    )


def refuse_result_leaves(leaves: Sequence[Any]) -> None:
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor | bool | int | float | str | type(None)):
            raise PrecompileError(
                f"fn's result holds a {type(leaf).__name__} at leaf {i}; a precompiled artifact "
                "can return tensors and plain Python values (int, float, bool, str, None) in "
                "lists, tuples and dicts."
            )
        if isinstance(leaf, torch.Tensor) and leaf.layout is not torch.strided:
            raise PrecompileError(
                f"fn's result holds a tensor of layout {leaf.layout} at leaf {i}; a precompiled "
                "artifact returns dense (strided) tensors. Return it dense (.to_dense()) and "
                "convert it after the call."
            )


def origin_finder(
    fn: Callable[..., Any], modules: Sequence[tuple[str, torch.nn.Module]]
) -> Callable[[torch.Tensor], str | None]:
    """Return a function naming where a baked tensor lives: a module attribute, or fn's scope."""

    def find(value: torch.Tensor) -> str | None:
        for arg_name, module in modules:
            for prefix, sub in module.named_modules(remove_duplicate=False):
                for attr, held in vars(sub).items():
                    if held is value:
                        where = f"{arg_name}.{prefix}.{attr}" if prefix else f"{arg_name}.{attr}"
                        return f"unregistered module attribute {where}"
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        for name, cell in zip(
            code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False
        ):
            if _cell_value(cell) is value:
                return f"variable {name!r} closed over by fn"
        scope = getattr(fn, "__globals__", {})
        for name in code.co_names:
            if scope.get(name) is value:
                return f"global {name!r} read by fn"
        return "a tensor closed over by fn or by a function it calls"

    return find


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return None
