"""The checks of a plain artifact as generated code, over the small runtime in ``driver.plain``.

A plain spec (``is_plain``) takes at most one model, positional tensors and optimizers, and
uses no feature of the generic ``Driver``. Its artifact holds ``check_call``, which checks a
call one line per check in the order they run, and ``check_models``, the full check of the
model one line per tensor and module (and ``OPTIMIZERS``, one line per param group and state
tensor): what a reader sees is what a call checks, with nothing for features the artifact
does not use.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from torch_precompile.artifact.checks import ambient_comment, few, global_name, tensor_type
from torch_precompile.folding import fold_lines
from torch_precompile.shipped.driver.tensor_rules import written_apart
from torch_precompile.spec import ArtifactSpec, InputLeaf, ModelTensor, ReadValue


def is_plain(spec: ArtifactSpec, positional: bool) -> bool:
    """Whether ``spec`` needs no more than the plain runtime; ``positional``: its inputs are
    positional tensors."""
    return positional and not spec.needs_generic_driver


def plain_checks(spec: ArtifactSpec) -> str:
    """The generated functions that open a plain artifact's driver section."""
    training = spec.runs_backward
    lines = _check_call(spec, training)
    if spec.model_names:
        lines += ["", "", *_check_models(spec, training)]
    return "\n".join(lines) + "\n"


def plain_binding(spec: ArtifactSpec, history: str) -> list[str]:
    """The lines that close a plain artifact: what the checks compare with, and ``forward``
    (after the runtime they are made of); ``history`` is the autograd part where results may
    carry history (``differentiable(...)``, given the functions that ready its graphs)."""
    training = spec.runs_backward
    grads = tuple(i for i, t in enumerate(spec.interned) if t.gets_grad)
    arguments = ['ARTIFACT_SPEC["out_spec"]', "FLAT_NAMES"]
    if grads:
        arguments.append(f"grads={grads}")
    if spec.autograd is not None:
        part = history if spec.gives_history else "NoHistory"
        records = '(ARTIFACT_SPEC["autograd"], ARTIFACT_SPEC.get("autograd_for_inputs"))'
        arguments += [f"autograd={part}", f"autograd_records={records}"]
    if spec.optimizers:
        arguments.append("optimizers=OPTIMIZERS")
    reads = ", READS, read_facts" if _module_reads(spec) else ""
    checked = f"check_models{reads}" if spec.model_names else "None"
    return [
        "# What the checks compare with, and forward: the checks, then the graph.",
        *_constants(spec, training),
        f"REMEMBERED = RememberedCall({checked})",
        *_global_plans(spec),
        *_optimizer_plans(spec),
        "forward = PlainForward(",
        "    call,",
        "    check_call,",
        *(line for a in arguments for line in argument_lines(a, "    ")),
        ")",
    ]


def argument_lines(argument: str, indent: str) -> list[str]:
    """``argument,`` at ``indent``; a call that would pass 100 columns (``autograd=
    differentiable(...)`` with four graphs) gets its own arguments on a line below."""
    line = f"{indent}{argument},"
    opened = argument.find("(")
    if len(line) <= 100 or opened < 0 or not argument.endswith(")"):
        return [line]
    inner = argument[opened + 1 : -1]
    return [f"{indent}{argument[: opened + 1]}", f"{indent}    {inner}", f"{indent}),"]


def _constants(spec: ArtifactSpec, training: bool) -> list[str]:
    inputs = [f"input {leaf.path}" for leaf in spec.inputs]
    written = set(spec.mutated)
    lines = [
        "FLAT_NAMES = [  # in messages: the model's tensors (one per tie), then the inputs",
        "    *(f\"model {t['kind']} {t['name']!r}\" for t in ARTIFACT_SPEC[\"model\"]"
        ' if not t["tied_to"]),',
        *(f"    {name!r}," for name in inputs),
        "]",
        "INPUTS = (",
        *(
            f"    {_leaf_plan(leaf, spec.backend, training, len(spec.interned) + i in written)},"
            for i, leaf in enumerate(spec.inputs)
        ),
        ")",
        f"AMBIENT = {_ambient(spec)}",
    ]
    if apart(spec):
        parameters = sum(t.kind == "parameter" for t in spec.interned)
        lines += [
            f"WRITTEN = {set(spec.mutated)!r}  # the flat inputs the graph writes in place",
            f"APART = {apart(spec)!r}  # buffers and inputs that must not share memory with them",
            f"PARAMETERS = {parameters}  # the first flat inputs, whose memory none of them shares",
        ]
    if spec.model_names:
        lines += [
            "# Each parameter and buffer: (kind, name, the one it is tied to or None).",
            'MEMBERS = [(t["kind"], t["name"], t["tied_to"]) for t in ARTIFACT_SPEC["model"]]',
            'SUBMODULES = [s["name"] for s in ARTIFACT_SPEC["submodules"]]',
        ]
    if _module_reads(spec):
        lines += [
            "# Where the trace read each value off a submodule: (its index, attribute path).",
            f"READS = {_module_reads(spec)!r}",
        ]
    return lines


def _leaf_plan(leaf: InputLeaf, backend: str, training: bool, written: bool) -> str:
    arguments = [
        repr(leaf.path),
        f"shape={tuple(leaf.shape or ())!r}",
        f"dtype={leaf.dtype!r}",
        f"device={leaf.device!r}",
    ]
    if leaf.strides is not None:
        arguments.append(f"strides={tuple(leaf.strides)!r}")
    if training:
        arguments.append(f"requires_grad={leaf.requires_grad!r}")
    if backend == "eager" and leaf.strides is not None and not written:
        arguments.append("relayout=True")  # the graph neither writes it nor views it
    return f"LeafPlan({', '.join(arguments)})"


def _ambient(spec: ArtifactSpec) -> str:
    record = spec.ambient
    if record is None:
        return "AmbientPlan(recorded=False)"
    return (
        f"AmbientPlan(autocast={tuple(record.autocast)!r}, default_dtype="
        f"{record.default_dtype!r}, deterministic={record.deterministic!r}, "
        f"modes={tuple(record.modes)!r}"
        + (f", settings={tuple(record.settings)!r})" if record.settings else ")")
    )


def _check_call(spec: ArtifactSpec, training: bool) -> list[str]:
    names = [a.name for a in spec.args]
    shown = ", ".join(f"{a.name} ({a.kind})" for a in spec.args)
    inputs = [i for i, a in enumerate(spec.args) if a.kind == "input"]
    steps = [f"AMBIENT.check()  # {ambient_comment(spec)}"]
    if training:
        steps += [
            "if not torch.is_grad_enabled():  # fn runs a backward",
            "    raise grad_mode_error()",
        ]
    steps += [
        f"if kwargs or len(args) != {len(names)}:",
        f"    raise arguments_error(kwargs, len(args), {len(names)}, {shown or 'none'!r})",
        "stage = 1",
        f"inputs = [{', '.join(f'args[{i}]' for i in inputs)}]",
        "positional_inputs(inputs, INPUTS)  # tensors where the capture had tensors",
        "stage = 2",
        "if not REMEMBERED.inputs_unchanged(inputs):  # else laid out as a call that passed",
        *(
            f"    inputs[{index}] = check_input(INPUTS[{index}], inputs[{index}], "
            f"{spec.backend!r})  # {leaf.path}: {tensor_type(leaf)}"
            for index, leaf in enumerate(spec.inputs)
        ),
        "    REMEMBERED.remember_inputs(inputs)",
        "stage = 3",
    ]
    models = [f"args[{i}]" for i, a in enumerate(spec.args) if a.is_model]
    flat = f"[*REMEMBERED.model_tensors([{models[0]}]), *inputs]" if models else "inputs"
    if not apart(spec) and not spec.optimizers and not _global_reads(spec):
        return _check_call_function(names, [*steps, f"return {flat}"], "3 model")
    steps.append(f"flat = {flat}")
    if _global_reads(spec):
        shown = few(sorted({global_name(r) for r in _global_reads(spec)}))
        steps.append(f"GLOBALS.check()  # the globals the trace read: {shown}")
    if apart(spec):
        steps.append(
            "check_written_apart(flat, APART, WRITTEN, FLAT_NAMES.__getitem__, PARAMETERS)"
        )
    if spec.optimizers:
        optimizers = ", ".join(a.name for a in spec.args if a.is_optimizer)
        steps += [
            "stage = 4",
            f"flat += OPTIMIZERS.flat_inputs(args, flat)  # {optimizers}: groups, state, lr",
        ]
    last = "3 model, 4 optimizers" if spec.optimizers else "3 model"
    return _check_call_function(names, [*steps, "return flat"], last)


def _check_call_function(names: Sequence[str], steps: Sequence[str], last: str) -> list[str]:
    return [
        'def check_call(args: "Sequence[Any]", kwargs: "dict[str, Any]") -> "list[Any]":',
        *textwrap.wrap(
            f'"""The checks a call forward({", ".join(names)}) must pass before the graph runs, '
            "one a line, in the order they run (generated from the spec). Each raises "
            "PrecompileError naming what differs from the capture; its check_stage says how "
            f"far they got (0 state and arguments, 1 structure, 2 inputs, {last}). Returns "
            'the graph\'s flat inputs."""',
            width=96,
            initial_indent="    ",
            subsequent_indent="    ",
        ),
        "    stage = 0",
        "    try:",
        *(f"        {step}" for step in steps),
        "    except PrecompileError as error:",
        "        error.check_stage = stage",
        "        raise",
    ]


def _check_models(spec: ArtifactSpec, training: bool) -> list[str]:
    name = spec.model_names[0]
    lines = [
        f"    check_is_model({name}, {name!r})",
        f"    tensors = members({name}, {name!r}, MEMBERS)",
        *(_tensor_check(index, t, training) for index, t in enumerate(spec.interned)),
        f"    modules = submodules({name}, SUBMODULES)",
    ]
    for index, module in enumerate(spec.submodules):
        forward = "" if module.forward is None else f", forward={module.forward!r}"
        lines.append(
            f"    check_module(modules[{index}], {module.name!r}, {module.cls!r}{forward}, "
            f"training={module.training!r})"
        )
    # With a backward inside fn, hooks on its tensors would run in it (as the generic walk).
    parameters = [f"({t.name!r}, tensors[{i}])" for i, t in enumerate(spec.interned)]
    hooks = f"check_no_hooks(modules, SUBMODULES{', [' if training else ''}"
    if training:
        lines.append(f"    {hooks}")
        lines += [f"        {p}," for p in parameters]
        lines.append("    ])")
    else:
        lines.append(f"    {hooks})")
    for read in spec.read_values:
        if read.submodule is not None:  # the globals read are GLOBALS
            lines.append(
                f"    check_read(modules[{read.submodule}], "
                f"{spec.submodules[read.submodule].name!r}, {tuple(read.path)!r}, "
                f"{read.expected!r}, {read.where!r})"
            )
    lines.append("    return tensors, modules")
    header = f'def check_models({name}: "torch.nn.Module") -> "tuple[list[Any], list[Any]]":'
    folded = fold_lines([header, *lines])[1:]
    looped = " (the lines of alike blocks once, in a loop)" if folded != lines else ""
    docstring = textwrap.wrap(
        f'"""The full check of model argument {name}: one line per tensor, submodule and value '
        f"the trace read off one, in the order capture walked them{looped}. A call whose "
        'model passed it and is unchanged since skips it (RememberedCall)."""',
        width=88,
        initial_indent="    ",
        subsequent_indent="    ",
    )
    return [header, *docstring, *folded]


def _tensor_check(index: int, tensor: ModelTensor, training: bool) -> str:
    arguments = [
        f"tensors[{index}]",
        repr(f"model {tensor.kind} {tensor.name!r}"),
        repr(tuple(tensor.shape)),
        repr(tensor.dtype),
        repr(tensor.device),
    ]
    if tensor.strides is not None:
        arguments.append(f"strides={tuple(tensor.strides)!r}")
    if training:
        arguments.append(f"requires_grad={tensor.requires_grad!r}")
    return f"    check_model_tensor({', '.join(arguments)})"


def apart(spec: ArtifactSpec) -> list[int]:
    """The flat inputs a call must pass in separate memory."""
    interned = spec.interned
    parameters = sum(t.kind == "parameter" for t in interned)
    return written_apart(spec.mutated, parameters, len(interned) + len(spec.inputs))


def _optimizer_plans(spec: ArtifactSpec) -> list[str]:
    """``OPTIMIZERS``: what each optimizer argument must be, one line per param group and
    state tensor (a spec without optimizers: none)."""
    if not spec.optimizers:
        return []
    index = {t.name: i for i, t in enumerate(spec.interned)}
    positions = [i for i, a in enumerate(spec.args) if a.is_optimizer]
    lines = [
        "# What each optimizer argument must be: its param groups and state tensors.",
        "OPTIMIZERS = OptimizerSteps([",
    ]
    for number, record in enumerate(spec.optimizers):
        groups = [g for g in spec.param_groups if g.optimizer == number]
        fresh = {name: g.fresh_start for g in groups for name in g.params}
        lines += [f"    OptimizerPlan({positions[number]}, {record.argument!r}, {record.cls!r}, ["]
        for g in groups:
            lines += [
                "        # a param group: the parameters it steps, in order, and its options",
                "        # baked into the graph (lr is read at every call)",
                f"        GroupPlan({tuple(index[n] for n in g.params)!r}, {tuple(g.params)!r}, (",
            ]
            lines += [f"            {option!r}," for option in g.baked]
            lines.append("        )),")
        lines.append("    ], [")
        for state in (s for s in spec.optimizer_state if s.optimizer == number):
            extra = "" if fresh[state.param] is None else f", fresh_start={fresh[state.param]!r}"
            lines.append(
                f"        StatePlan({index[state.param]}, {state.key!r}, {state.param!r}, "
                f"{tuple(state.shape)!r}, {state.dtype!r}, {state.device!r}"
                f"{'' if state.strides is None else f', {tuple(state.strides)!r}'}{extra}),"
            )
        lines.append(f"    ], zero_grad_first={record.zero_grad_first!r}),")
    return [*lines, "])"]


def _global_reads(spec: ArtifactSpec) -> list[ReadValue]:
    return [r for r in spec.read_values if r.submodule is None]


def _global_plans(spec: ArtifactSpec) -> list[str]:
    """``GLOBALS``: each global the trace read, where and as what (none: no lines)."""
    reads = _global_reads(spec)
    if not reads:
        return []
    lines = ["# The globals the trace read: module, attribute path, value, where it was read."]
    lines.append("GLOBALS = GlobalReads([")
    for r in reads:
        file = "" if r.file is None else f", {r.file!r}"
        lines.append(
            f"    GlobalRead({r.module!r}, {tuple(r.path)!r}, {r.expected!r}, {r.where!r}{file}),"
        )
    return [*lines, "])"]


def _module_reads(spec: ArtifactSpec) -> list[tuple[int, tuple[str, ...]]]:
    return [(r.submodule, tuple(r.path)) for r in spec.read_values if r.submodule is not None]
