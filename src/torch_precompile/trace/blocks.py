"""Repeated blocks: the submodules that repeat (a model's ``layers[i]``), and which of the
trace's operations each one's forward and backward recorded.

The trace stays whole: every block runs its own Python, so every fact about every block is
recorded and checked as before. Only the operations are marked, each with the block call
that recorded it; the lowering (``lower.regions``) compiles the operations of blocks that
came out the same once, and runs that code once per block with its own tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree
from torch_precompile.internals.regions import (
    accumulates,
    at_backward_end,
    creation_number,
    module_calls,
    node_number,
    traced_graph,
)

# The node meta key that holds an operation's BlockMark.
BLOCK_MARK = "precompile_block"


@dataclass(frozen=True)
class BlockMark:
    """Which block call recorded an operation: its forward or its backward."""

    pass_: str  # "forward" or "backward"
    call: int  # the block call's number, in the order of the forward
    block: str  # the block's path, as messages name it ("layers.3")


def repeated_blocks(
    modules: Sequence[torch.nn.Module], choice: bool | Sequence[type] | None
) -> dict[int, str]:
    """``id(block) -> its path`` for each block whose operations are marked.

    By default (``choice`` None or True), the children of a ``ModuleList`` or
    ``Sequential`` of which at least two share a class; with classes, the submodules of those
    classes; with False, none. A block inside another block is part of it.
    """
    if choice is False:
        return {}
    classes = None if choice is None or choice is True else tuple(choice)
    if classes is not None and not all(isinstance(c, type) for c in classes):
        raise PrecompileError(
            "blocks= takes True, False, or the classes of the repeated blocks (blocks="
            f"[DecoderLayer]), got {choice!r}."
        )
    found: dict[int, str] = {}
    for root_number, root in enumerate(modules):
        prefix = f"m{root_number}." if len(modules) > 1 else ""
        for name, module in root.named_modules():
            if classes is not None:
                if isinstance(module, classes):
                    found.setdefault(id(module), prefix + name)
                continue
            if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
                kinds = [type(child) for child in module.children()]
                for child_name, child in module.named_children():
                    if kinds.count(type(child)) >= 2:
                        found.setdefault(id(child), f"{prefix}{name}.{child_name}".lstrip("."))
    paths = sorted(found.values())
    outer = {p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)}
    return {key: path for key, path in found.items() if path in outer}


class BlockMarks:
    """Marks each operation a block's forward or backward records, while fn is traced."""

    def __init__(self, blocks: dict[int, str]) -> None:
        self.blocks = blocks
        self.calls = 0
        self._open: tuple[int, int, int, int] | None = None  # id, call, nodes, autograd number
        self._backward_mark: BlockMark | None = None
        self._backward_from = 0
        self._backward_nodes: dict[Any, BlockMark | None] = {}
        self._ending = False
        self._handles: list[Any] = []
        self._hooked: set[Any] = set()
        # Each block call's output nodes, the numbers its autograd nodes were created in, and
        # its backward's mark: walked when a backward first reaches a block.
        self._walks: list[tuple[list[Any], int, int, BlockMark]] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        if not self.blocks:
            yield
            return
        try:
            with module_calls(self._before, self._after):
                yield
        finally:
            # A parameter's AccumulateGrad node outlives the trace: no hook may stay on it.
            for handle in self._handles:
                handle.remove()
            self._handles.clear()

    def _before(self, module: torch.nn.Module) -> None:
        graph = traced_graph()
        if self._open is not None or id(module) not in self.blocks or graph is None:
            return
        self._open = (id(module), self.calls, len(graph.nodes), creation_number())
        self.calls += 1

    def _after(self, module: torch.nn.Module, output: Any) -> None:
        graph = traced_graph()
        if self._open is None or self._open[0] != id(module) or graph is None:
            return
        _, call, count, first_number = self._open
        self._open = None
        mark = BlockMark("forward", call, self.blocks[id(module)])
        _mark_last(graph, len(graph.nodes) - count, mark)
        # Its backward's nodes are hooked only once a backward reaches the block's outputs:
        # a trace that runs none (inference) walks no autograd graph.
        outputs = [
            t.grad_fn
            for t in pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        backward = BlockMark("backward", call, mark.block)
        self._walks.append((outputs, first_number, creation_number(), backward))
        for node in outputs:
            if node not in self._hooked:
                self._hooked.add(node)
                self._handles.append(node.register_prehook(self._prehook(node)))

    def _walk(
        self, outputs: list[Any], first_number: int, last_number: int, mark: BlockMark
    ) -> None:
        """Hook the autograd nodes a block's forward created (and those just outside it),
        so that the operations each one's backward records are marked as it runs."""
        pending = list(outputs)
        while pending:
            node = pending.pop()
            if node in self._backward_nodes:
                continue
            inside = first_number <= node_number(node) < last_number
            # A parameter's gradient lands (AccumulateGrad) as part of its block's backward.
            self._backward_nodes[node] = mark if inside or accumulates(node) else None
            if node not in self._hooked:
                self._hooked.add(node)
                self._handles.append(node.register_prehook(self._prehook(node)))
            if inside:
                pending.extend(n for n, _ in node.next_functions if n is not None)

    def _prehook(self, node: Any) -> Any:
        def entered(grad_outputs: Any) -> None:
            while self._walks:  # in the forward's order: a block claims its own nodes first
                self._walk(*self._walks.pop(0))
            self._switch(self._backward_nodes.get(node))
            if not self._ending:
                self._ending = True
                at_backward_end(self._ended)

        return entered

    def _switch(self, mark: BlockMark | None) -> None:
        """From here on, the backward's operations are ``mark``'s (those since the last
        switch, and the sums autograd made of their gradients, are the previous one's)."""
        graph = traced_graph()
        if graph is None or mark == self._backward_mark:
            return
        if self._backward_mark is not None:
            _mark_last(graph, len(graph.nodes) - self._backward_from, self._backward_mark)
        self._backward_mark, self._backward_from = mark, len(graph.nodes)

    def _ended(self) -> None:
        self._switch(None)
        self._ending = False


def _mark_last(graph: torch.fx.Graph, count: int, mark: BlockMark) -> None:
    for node, _ in zip(reversed(graph.nodes), range(count), strict=False):
        if node.op == "call_function":
            node.meta.setdefault(BLOCK_MARK, mark)


def block_mark(node: torch.fx.Node) -> BlockMark | None:
    return node.meta.get(BLOCK_MARK)


# Where a mark rides through AOTAutograd: the "custom" node meta, which it copies onto the
# forward operations it records and onto the backward operations of each.
_CARRIED = "torch_precompile_block"


def carry_marks(graph: torch.fx.Graph) -> bool:
    """Put each operation's mark where AOTAutograd's retrace of ``graph`` copies it from;
    whether any operation has one."""
    marked = False
    for node in graph.nodes:
        mark = block_mark(node)
        if mark is not None:
            node.meta["custom"] = {**node.meta.get("custom", {}), _CARRIED: mark}
            marked = True
    return marked


def take_marks(graph: torch.fx.Graph, pass_: str) -> None:
    """Make the marks AOTAutograd carried into its ``pass_`` ("forward" or "backward") graph
    the operations' marks again, leaving their "custom" meta as it was."""
    for node in graph.nodes:
        custom = node.meta.get("custom")
        if not isinstance(custom, dict) or _CARRIED not in custom:
            continue
        mark = custom[_CARRIED]
        rest = {k: v for k, v in custom.items() if k != _CARRIED}
        if rest:
            node.meta["custom"] = rest
        else:
            del node.meta["custom"]
        node.meta[BLOCK_MARK] = dataclasses.replace(mark, pass_=pass_)
    if pass_ == "backward":
        _mark_gradient_sums(graph)


def _mark_gradient_sums(graph: torch.fx.Graph) -> None:
    """AOTAutograd's sums of the gradients of a value used twice (a residual's input) carry
    no mark: each joins the block whose backward gave the last of its terms, as the other
    blocks' sums do theirs."""
    for node in graph.nodes:
        if block_mark(node) is not None or not node.meta.get("is_gradient_acc"):
            continue
        marks = [block_mark(a) for a in node.all_input_nodes]
        given = [m for m in marks if m is not None and m.pass_ == "backward"]
        if given:
            node.meta[BLOCK_MARK] = given[-1]
