"""Assemble ``python_code``: header, spec, compiled graph, driver, and the line binding them.

A reader meets meaning first: what the file is and how to call it, the calling convention
(the spec), the graph, then the driver that checks calls, with only the driver parts this
spec needs.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from torch_precompile.artifact.checks import check_function
from torch_precompile.artifact.header import header
from torch_precompile.artifact.plain_checks import (
    argument_lines,
    is_plain,
    plain_binding,
    plain_checks,
)
from torch_precompile.errors import PrecompileError
from torch_precompile.internals import pytree
from torch_precompile.lower import LoweredGraph, VariantGraphs, indented
from torch_precompile.shipped.driver import (
    autograd,
    call_state,
    core,
    data_parallel,
    distributed,
    dynamic,
    encoded,
    facts,
    folds,
    hook_values,
    memo,
    module_rules,
    no_history,
    optimizers,
    plain,
    planned,
    rechecks,
    records,
    subclasses,
    tensor_rules,
    values,
    variants,
)
from torch_precompile.shipped.source import (
    ShippedSource,
    import_block,
    shipped_source,
    shipped_text,
    used_only,
)
from torch_precompile.spec import ArtifactSpec, spec_source, to_literal
from torch_precompile.spec_listing import driver_records

_RULE = "# " + "=" * 78

_MAIN = """
if __name__ == "__main__":
    print("This is a precompiled computation; exec it and call forward({call_example}).")
"""


@dataclass(frozen=True)
class DriverPart:
    """An optional driver module, and the keyword of ``Driver`` that takes its class."""

    module: ModuleType
    keyword: str | None  # None: a part other parts use, not one Driver takes
    factory: str | None


_VALUES = DriverPart(values, "values", "InputValues")
_FACTS = DriverPart(facts, "facts", "PythonFacts")
_HOOK_VALUES = DriverPart(hook_values, "hooks", "hook_values")
_RECHECKS = DriverPart(rechecks, None, None)
_MEMO = DriverPart(memo, "memo", "ModelMemo")
_SIZES = DriverPart(dynamic, "sizes", "DynamicSizes")
_DISTRIBUTED = DriverPart(distributed, "distributed", "DistributedCall")
_SUBCLASSES = DriverPart(subclasses, "subclasses", "WrappedCall")
_PLANNED = DriverPart(planned, None, None)
_OPTIMIZERS = DriverPart(optimizers, "optimizers", "optimizer_steps")
_DATA_PARALLEL = DriverPart(data_parallel, "data_parallel", "DataParallelSteps")
_NO_HISTORY = DriverPart(no_history, "autograd", "NoHistory")
_AUTOGRAD = DriverPart(autograd, "autograd", "differentiable")
_ENCODED = DriverPart(encoded, None, None)
_VARIANTS = DriverPart(variants, None, None)
_PART_ORDER = (
    _ENCODED,
    _VALUES,
    _FACTS,
    _HOOK_VALUES,
    _RECHECKS,
    _MEMO,
    _PLANNED,
    _SIZES,
    _DISTRIBUTED,
    _SUBCLASSES,
    _OPTIMIZERS,
    _DATA_PARALLEL,
    _NO_HISTORY,
    _AUTOGRAD,
)
# Parts other parts call into: shipped with them.
_USED_BY = {
    id(_VALUES): _ENCODED,
    id(_FACTS): _ENCODED,
    id(_AUTOGRAD): _NO_HISTORY,
    id(_MEMO): _RECHECKS,
    id(_SUBCLASSES): _RECHECKS,
}


def driver_parts(spec: ArtifactSpec) -> list[DriverPart]:
    """The optional parts ``spec`` needs, in the order the artifact holds them."""
    # memo's tensor guard also serves the subclass part; planned serves it and optimizers.
    return [
        part
        for part, needed in (
            (_VALUES, _has_values(spec)),
            (_FACTS, bool(spec.read_values)),
            (_HOOK_VALUES, _has_hooks(spec)),
            (_MEMO, bool(spec.model_names or spec.wrapped)),
            (_PLANNED, bool(spec.optimizers or spec.wrapped)),
            (_SIZES, bool(spec.dynamic_dims)),
            (_DISTRIBUTED, bool(spec.meshes)),
            (_SUBCLASSES, bool(spec.wrapped)),
            (_OPTIMIZERS, bool(spec.optimizers)),
            (_DATA_PARALLEL, bool(spec.data_parallel or spec.fully_sharded)),
            (_NO_HISTORY, spec.autograd is not None and not spec.gives_history),
            (_AUTOGRAD, spec.gives_history),
        )
        if needed
    ]


def _all_parts(variants: Sequence[ArtifactSpec]) -> list[DriverPart]:
    """The parts any variant needs, in driver order, and the dispatch over several."""
    needed = {id(part) for variant in variants for part in driver_parts(variant)}
    needed |= {id(_USED_BY[part]) for part in needed if part in _USED_BY}
    parts = [part for part in _PART_ORDER if id(part) in needed]
    return [*parts, _VARIANTS] if len(variants) > 1 else parts


def _has_hooks(spec: ArtifactSpec) -> bool:
    """Whether the capture had hooks, whose values a call compares."""
    return (
        bool(spec.global_hooks)
        or any(s.hooks for s in spec.submodules)
        or any(t.hooks for t in spec.model)
    )


def _has_values(spec: ArtifactSpec) -> bool:
    """Whether a call passes more than positional tensors, or fn decided on tensor values."""
    positional = pytree.treespec_dumps(pytree.tree_flatten(tuple(spec.inputs))[1])
    return (
        spec.in_spec != positional
        or bool(spec.value_guards)
        or any(leaf.kind != "tensor" for leaf in spec.inputs)
    )


def render(
    spec: ArtifactSpec,
    graphs: Sequence[VariantGraphs],
    tracer: str = "make_fx",
    origin: str | None = None,
) -> str:
    """Return the artifact's source: the graphs of each variant of ``spec`` (one, mostly); the
    driver's modules are copied in (see ``shipped``). ``origin`` names the captured function
    and where it is defined."""
    variants = spec.all_variants
    if len(graphs) != len(variants):
        raise PrecompileError(f"internal: {len(variants)} variants and {len(graphs)} graphs")
    call_example = ", ".join(a.name for a in spec.args)
    named = _named_graphs(variants, graphs)
    graph_section = _graph_section(named)
    written_spec = spec_source(spec, _structure_notes(spec))
    plain_spec = len(variants) == 1 and is_plain(spec, not _has_values(spec))
    if plain_spec:
        parts = [tensor_rules, call_state, module_rules, rechecks]
        parts += [*([encoded] if spec.read_values else []), plain]
        parts += [facts] if any(r.submodule is None for r in spec.read_values) else []
        parts += [planned, optimizers] if spec.optimizers else []
        if spec.autograd is not None:
            parts += [no_history, *([autograd] if spec.gives_history else [])]
        shipped = [shipped_source(m) for m in parts]
        if spec.autograd is not None:  # the Autograd record's fields, for the autograd part
            held = ("autograd", "autograd_for_inputs")
            shipped.insert(0, shipped_text(driver_records(held, top=False), records.__name__))
        checks = [plain_checks(spec)]
        binding = plain_binding(spec, _differentiable_call(named[0]))
    else:
        shipped = [
            _records(variants),
            *(
                shipped_source(m)
                for m in (
                    tensor_rules,
                    call_state,
                    module_rules,
                    core,
                    *(p.module for p in _all_parts(variants)),
                )
            ),
        ]
        checks = [
            check_function(v, _check_name(n, len(variants)), _keywords(v))
            for n, v in enumerate(variants, 1)
        ]
        binding = _binding(variants, named)
    if written_spec.folded:
        shipped.append(shipped_source(folds))
        binding = [
            "# The spec writes each run of alike records (blocks of a deep model) once: listed",
            "# again here, before anything reads it.",
            "ARTIFACT_SPEC = unfolded_spec(ARTIFACT_SPEC)",
            *binding,
        ]
    roots = "\n".join([graph_section, *checks, *binding, _MAIN])
    driver_source = _driver_source(used_only(shipped, roots), graph_section, checks)
    _check_no_clash(graph_section, driver_source)
    all_named = [g for per_variant in named for g in per_variant]
    sections = [
        header(variants, call_example, origin, tracer, _sections_line(all_named, plain_spec)),
        _section(1, "The spec: the calling convention, read by load() without executing"),
        written_spec.text,
        _section(
            2,
            "The compiled graph: call(flat_inputs) -> flat_outputs"
            if len(all_named) == 1
            else "The compiled graphs: "
            + ", ".join(f"{g.function}()" if g.lazy else g.name for g in all_named),
        ),
        graph_section,
        _section(3, "The driver: forward and the checks it runs"),
        driver_source,
        "",
        _RULE,
        *binding,
        _MAIN.format(call_example=call_example),
    ]
    return "\n".join(sections)


@dataclass(frozen=True)
class _NamedGraph:
    """A compiled graph as the artifact names it (``call``, ``call_2_backward``), and the
    comment above it. A lazy one is readied at its first use (a call that needs history),
    not at load: ``function`` is what the driver is given."""

    name: str
    comment: str
    graph: LoweredGraph
    # The keyword of ``differentiable`` a lazy graph is given by (its role).
    keyword: str | None = None

    @property
    def lazy(self) -> bool:
        return self.keyword is not None

    @property
    def function(self) -> str:
        return self.name.replace("call", "graph", 1)


def _named_graphs(
    specs: Sequence[ArtifactSpec], graphs: Sequence[VariantGraphs]
) -> list[list[_NamedGraph]]:
    """Each variant's graphs, named."""
    named = []
    for number, (spec, held) in enumerate(zip(specs, graphs, strict=True), 1):
        base = "call" if len(specs) == 1 else f"call_{number}"
        whose = (
            f"Variant {number} of {len(specs)} ({variants.variant_label(spec)})"
            if len(specs) > 1
            else "The computation"
        )
        per_variant = [
            _NamedGraph(
                base,
                f"{whose}: the plain graph"
                + (", for calls whose results need no history." if len(held.all) > 1 else "."),
                held.plain,
            )
        ]
        per_variant += _history_graphs(base, whose, held)
        named.append(per_variant)
    return named


def _history_graphs(base: str, whose: str, held: VariantGraphs) -> list[_NamedGraph]:
    """The forward and backward graphs of each differentiable form a variant holds."""
    ready = "readied at the first call that needs them"
    forms = (
        ("", "calls whose results carry autograd history", held.forward, held.backward),
        (
            "input_",
            "calls where an input tensor requires grad that did not at capture",
            held.input_forward,
            held.input_backward,
        ),
    )
    named = []
    for role, serves, forward, backward in forms:
        if forward is None or backward is None:
            continue
        named += [
            _NamedGraph(
                f"{base}_{role}forward",
                f"{whose}: the forward, for {serves}; it returns the results, then what the "
                f"backward needs ({ready}).",
                forward,
                keyword=f"{role}forward",
            ),
            _NamedGraph(
                f"{base}_{role}backward",
                f"{whose}: the backward for the same calls; it takes the saved values, then "
                "one tangent per result with history, and returns the gradients of the "
                f"inputs {'that may require grad' if role else 'that required grad'} ({ready}).",
                backward,
                keyword=f"{role}backward",
            ),
        ]
    return named


def _differentiable_call(graphs: Sequence[_NamedGraph]) -> str:
    """``differentiable(...)`` given the functions that ready a variant's lazy graphs: in
    order, or by keyword where the capture's own form has none."""
    lazy = [g for g in graphs if g.lazy]
    if lazy and lazy[0].keyword == "forward":
        return "differentiable(" + ", ".join(g.function for g in lazy) + ")"
    return "differentiable(" + ", ".join(f"{g.keyword}={g.function}" for g in lazy) + ")"


def _sections_line(named: Sequence[_NamedGraph], plain_spec: bool) -> str:
    """The header's list of sections; what sections 2 and 3 hold depends on the graphs and
    on the driver."""
    if len(named) == 1:
        graphs = "the compiled graph, call(flat_inputs)"
    elif any(g.lazy for g in named):
        graphs = (
            "the compiled graphs: the plain one, and the forward and backward that give "
            "results autograd history"
            + (
                " (and the same for calls where an input tensor requires grad)"
                if any(str(g.keyword).startswith("input_") for g in named)
                else ""
            )
        )
    else:
        graphs = "the compiled graphs, one per variant"
    text = (
        f"Sections: 1. the spec (ARTIFACT_SPEC, the calling convention)  2. {graphs}  "
        + (
            "3. the driver: check_call and check_models (the checks a call runs, one a line, "
            "in order), the runtime they call, then what they compare with and forward. "
            if plain_spec
            else "3. the driver: check_call (the checks a call runs, one a line, in order), "
            "then the helpers it calls and forward. "
        )
        + "Last, the seal."
    )
    return textwrap.fill(text, width=96, initial_indent="# ", subsequent_indent="# ")


def _binding(variants: Sequence[ArtifactSpec], named: Sequence[Sequence[_NamedGraph]]) -> list[str]:
    """The lines that bind ``forward``."""

    def keywords(variant: ArtifactSpec, graphs: Sequence[_NamedGraph]) -> list[str]:
        given = {id(_AUTOGRAD): _differentiable_call(graphs)}
        return [f"{p.keyword}={given.get(id(p), p.factory)}" for p in _given_parts(variant)]

    if len(variants) == 1:
        arguments = ["ARTIFACT_SPEC", "call", "check_call", *keywords(variants[0], named[0])]
        line = f"forward = Driver({', '.join(arguments)})"
        if len(line) > 100:  # one argument a line, as a reader would wrap it
            wrapped = [row for a in arguments for row in argument_lines(a, "    ")]
            line = "\n".join(["forward = Driver(", *wrapped, ")"])
        return ["# forward: the driver over this spec and graph.", line]
    return [
        "# forward: a driver over each variant's spec and graph; a call runs the variant it fits.",
        "forward = Variants([",
        *(
            f"    Driver(variant_spec(ARTIFACT_SPEC, {n}), {graphs[0].name}, "
            f"{', '.join([_check_name(n, len(variants)), *keywords(v, graphs)])}),"
            for n, (v, graphs) in enumerate(zip(variants, named, strict=True), 1)
        ),
        "])",
    ]


def _graph_section(named: Sequence[Sequence[_NamedGraph]]) -> str:
    """The stand-ins the graphs use, once, then the graphs. A lone variant's plain graph is
    at the top level; any other graph is in a function of its own, so that names stay apart."""
    every = [g for per_variant in named for g in per_variant]
    stand_ins = list(dict.fromkeys(module for g in every for module in g.graph.stand_ins))
    shipped = [shipped_source(module) for module in stand_ins]
    pieces = [
        *(part.comment for part in shipped),
        import_block([i for part in shipped for i in part.imports]) if shipped else "",
        *(part.body for part in shipped),
    ]
    top_level = every[0] if len(named) == 1 else None
    if top_level is not None and not shipped and len(every) == 1:
        return top_level.graph.source
    if top_level is not None:
        pieces.append(top_level.graph.source)
    pieces.extend(_graph_function(g) for g in every if g is not top_level)
    return "\n".join(pieces)


def _graph_function(named: _NamedGraph) -> str:
    source = named.graph.source
    if named.graph.stand_ins:  # an inductor graph: its kernel loader runs inside the function
        from torch_precompile.internals.inductor import loader_resolving_now

        source = loader_resolving_now(source)
    bound = [] if named.lazy else ["", "", f"{named.name} = {named.function}()"]
    return "\n".join(
        [
            "",
            *textwrap.wrap(named.comment, width=96, initial_indent="# ", subsequent_indent="# "),
            f"def {named.function}():",
            '    """Readies this graph; returns its call(flat_inputs)."""'
            if named.lazy
            else f'    """Returns {named.name}(flat_inputs)."""',
            indented(source).rstrip("\n"),
            "",
            "    return call",
            *bound,
            "",
        ]
    )


def _records(variants: Sequence[ArtifactSpec]) -> ShippedSource:
    """The driver's table of the spec's records (``driver/records.py``), for the records
    these variants' spec holds."""
    held = {name for variant in variants for name in to_literal(variant)}
    return shipped_text(driver_records(held), records.__name__)


def _check_name(number: int, count: int) -> str:
    """The generated check function of variant ``number`` (of ``count``)."""
    return "check_call" if count == 1 else f"check_call_{number}"


def _given_parts(variant: ArtifactSpec) -> list[DriverPart]:
    """The driver parts a variant's ``Driver`` is given, by keyword."""
    return [
        p for p in driver_parts(variant) if p.keyword and (p is not _MEMO or variant.model_names)
    ]


def _keywords(variant: ArtifactSpec) -> list[str]:
    return [p.keyword for p in _given_parts(variant) if p.keyword]


def _driver_source(shipped: list[ShippedSource], graph_source: str, checks: list[str]) -> str:
    """The generated check functions, then the driver's modules, after the imports the graph
    section has not made already."""
    made = {
        ast.unparse(node)
        for node in ast.parse(graph_source).body
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    block = [
        line
        for line in import_block([i for s in shipped for i in s.imports]).splitlines()
        if line not in made
    ]
    pieces = ["\n".join(block)]
    for check in checks:
        pieces += ["", "", check.rstrip("\n")]
    for source in shipped:
        pieces += ["", "", source.comment, "", source.body.rstrip("\n")]
    return "\n".join(pieces) + "\n"


def _structure_notes(spec: ArtifactSpec) -> dict[str, str]:
    """What the pytree specs encode, as comments beside them."""
    leaves = [
        leaf.path
        if leaf.kind == "tensor" or leaf.value is None
        else tensor_rules.Shown(repr(leaf.value[1]))
        for leaf in spec.inputs
    ]
    notes = {"out_spec": "fn's result: " + _structure(spec.out_spec, None)}
    if spec.wrapped:
        notes["wrapped"] = "tensor subclasses, carried as their inner tensors (wrapped_inner)"
    if spec.in_spec is not None:
        after = "the models and optimizers" if spec.optimizers else "the models"
        notes["in_spec"] = f"the inputs (after {after}): " + _structure(spec.in_spec, leaves)
    return notes


def _structure(dumped: str, names: Sequence[object] | None) -> str:
    spec = pytree.treespec_loads(dumped)
    shown = names if names is not None else [tensor_rules.Shown("Tensor")] * spec.num_leaves
    text = repr(
        pytree.tree_unflatten(
            [tensor_rules.Shown(n) if isinstance(n, str) else n for n in shown], spec
        )
    )
    return text if len(text) <= 80 else text[:77] + "..."


def _section(number: int, title: str) -> str:
    lead = f"# {number}. "
    lines = textwrap.wrap(
        title, width=80, initial_indent=lead, subsequent_indent="#" + " " * (len(lead) - 1)
    )
    return "\n".join(["", _RULE, *lines, _RULE, ""])


def _top_level_names(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _check_no_clash(graph_source: str, driver_source: str) -> None:
    clash = _top_level_names(graph_source) & _top_level_names(driver_source)
    if clash:
        raise PrecompileError(f"internal: graph and driver both define {sorted(clash)}")
