"""The eager backend: the captured ATen graph's own code, run op by op."""

from __future__ import annotations

from torch_precompile.capture import Capture
from torch_precompile.capture.checks import literal_source
from torch_precompile.internals.tracing import fx_builtin_imports, graph_function_source
from torch_precompile.lower import LoweredGraph


def lower_eager(capture: Capture) -> LoweredGraph:
    gm = capture.graph
    graph_code = graph_function_source(gm, "captured_graph")
    lines = [
        "# The fx names the graph code refers to.",
        *fx_builtin_imports(),
        "",
        *_literal_lines(capture),
        graph_code.strip("\n"),
        "",
        "",
        "def call(flat_inputs):",
        '    """Run the graph on the flat inputs (they are consumed) and return its outputs."""',
        "    args = [*flat_inputs, *TENSOR_LITERALS]",
        "    flat_inputs.clear()",
        "    return captured_graph(*args)",
    ]
    return LoweredGraph(source="\n".join(lines) + "\n", acceleration=None)


def _literal_lines(capture: Capture) -> list[str]:
    if not capture.literals:
        return ["TENSOR_LITERALS = []", "", ""]
    lines = ["# Tensor literals built inside fn (torch.tensor(...)), in graph-input order."]
    lines.append("TENSOR_LITERALS = [")
    lines.extend(f"    {literal_source(t)}," for t in capture.literals)
    lines.extend(["]", "", ""])
    return lines


