"""The checks of a call as generated code: one function per variant, one line per check.

The function opens section 3 of the artifact. It lists, in the order they run, only the checks
its spec needs (no branch for a feature the artifact does not use), each a call into the
driver's helpers below it with a comment saying what it holds the call to. ``Driver`` calls it
for every call; it returns the flat tensors the graph takes.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch_precompile.spec import ArtifactSpec, InputLeaf, ModelTensor, ReadValue

_SHOWN_LEAVES = 4  # inputs or globals named in a comment before the rest are counted
_LINE_LENGTH = 100


def check_function(spec: ArtifactSpec, name: str, parts: Sequence[str]) -> str:
    """The source of ``name(driver, args, kwargs)`` for ``spec``; ``parts`` are the keywords
    of the driver parts the artifact gives this variant's ``Driver``."""
    call = f"forward({', '.join(a.name for a in spec.args)})"
    steps = _steps(spec, parts)
    stepped = "stepped" if "optimizers" in parts else "()"
    lines = [
        f"def {name}(",
        '    driver: "Driver", args: "tuple[Any, ...]", kwargs: "dict[str, Any]"',
        ') -> "CheckedCall":',
        f'    """What a call {call} must pass before anything runs, in the order the checks',
        "    run (generated from the spec). Each raises PrecompileError naming what differs from",
        '    the capture; the error\'s ``check_stage`` says how far the checks got."""',
        "    stage = 0",
        "    try:",
        *(line for step in steps for line in _fitted(f"        {step}")),
        "    except PrecompileError as error:",
        "        error.check_stage = stage",
        "        raise",
        f"    return state, inputs, {stepped}",
    ]
    return "\n".join(lines) + "\n"


def _fitted(line: str) -> list[str]:
    """``line``, its comment put above it where the two overrun the line length."""
    code, _, comment = line.partition("  # ")
    if len(line) <= _LINE_LENGTH or not comment:
        return [line]
    indent = code[: len(code) - len(code.lstrip())]
    return [f"{indent}# {comment}", code]


def _steps(spec: ArtifactSpec, parts: Sequence[str]) -> list[str]:
    """The body of the check function: stage by stage, as ``Driver.checked`` documents."""
    models = [i for i, a in enumerate(spec.args) if a.is_model]
    arguments = ", ".join(f"{a.name} ({a.kind})" for a in spec.args)
    steps = [f"driver.ambient.check()  # {ambient_comment(spec)}"]
    if spec.runs_backward:
        steps += [
            "if not torch.is_grad_enabled():  # fn runs a backward",
            "    raise grad_mode_error()",
        ]
    steps += [
        f"if kwargs or len(args) != {len(spec.args)}:  # {arguments or 'no arguments'}",
        "    check_arguments(driver, args, kwargs)",
        "stage = 1",
        (
            "leaves = driver.values.input_leaves(args)  # the inputs' structure and Python values"
            if "values" in parts
            else "leaves = positional_leaves(driver, args)  # positional tensors"
        ),
        "stage = 2",
        f"inputs = checked_inputs(driver, leaves)  # {_shown_inputs(spec.inputs)}",
        "stage = 3",
    ]
    if "data_parallel" in parts:
        steps.append("driver.data_parallel.check(args)  # DDP and FSDP2 wrappers, as captured")
    shown = ", ".join(f"args[{i}]" for i in models)
    steps.append(f"state = model_tensors(driver, [{shown}])  # {_shown_models(spec)}")
    if any(t.old_grad == "read" for t in spec.model):
        steps.append(
            "check_no_old_grads(state, driver.grads_read, driver.flat_name)  # fn reads .grad"
        )
    if any(r.submodule is None for r in spec.read_values):
        paths = sorted({global_name(r) for r in spec.read_values if r.submodule is None})
        steps.append(f"driver.facts.check_globals()  # the globals the trace read: {few(paths)}")
    if spec.mutated:  # before an optimizer's state is installed or anything is written
        steps.append(
            "check_written_apart([*state, *inputs], driver.separate, driver.mutated, "
            "driver.flat_name, driver.first_buffer)  # written inputs apart in memory"
        )
    steps.append("stage = 4")
    if "optimizers" in parts:
        names = ", ".join(a.name for a in spec.args if a.is_optimizer)
        steps.append(
            f"stepped = driver.optimizers.flat_inputs(args, state)  # {names}: groups, state"
        )
    return steps


def settings_read(spec: ArtifactSpec) -> list[str]:
    """The torch settings fn read, as calls (``torch.is_grad_enabled()``)."""
    return [f"{name}()" for name, _, _ in spec.ambient.settings] if spec.ambient else []


def ambient_comment(spec: ArtifactSpec) -> str:
    """What the ambient check's line checks, for its comment."""
    settings = settings_read(spec)
    return "autocast, default dtype, deterministic, modes" + (
        f", {few(settings)}: as captured" if settings else ": as captured"
    )


def _shown_inputs(leaves: Sequence[InputLeaf]) -> str:
    tensors = [leaf for leaf in leaves if leaf.kind == "tensor"]
    if not tensors:
        return "no input tensors"
    return few([f"{leaf.path}: {tensor_type(leaf)} on {leaf.device}" for leaf in tensors])


def few(items: Sequence[str]) -> str:
    """The first few of ``items``, and how many more."""
    more = len(items) - _SHOWN_LEAVES
    return ", ".join(items[:_SHOWN_LEAVES]) + (f" and {more} more" if more > 0 else "")


def tensor_type(leaf: InputLeaf) -> str:
    """An input tensor's dtype and shape as the artifact shows them: ``float32[*, 4]`` (``*``
    for a dynamic dim, as the driver's messages show one)."""
    dims = ", ".join("*" if d is None else str(d) for d in leaf.shape or ())
    return f"{str(leaf.dtype).removeprefix('torch.')}[{dims}]"


def _shown_models(spec: ArtifactSpec) -> str:
    if not spec.model_names:
        return "no models"
    parameters = _count(spec.model, "parameter")
    buffers = _count(spec.model, "buffer")
    modules = len(spec.submodules)
    names = ", ".join(spec.model_names)
    plural = "" if modules == 1 else "s"
    return (
        f"{names}: {parameters} parameters, {buffers} buffers, {modules} module{plural} "
        "(classes, modes, forwards, hooks)"
    )


def _count(tensors: Sequence[ModelTensor], kind: str) -> int:
    return sum(1 for t in tensors if t.kind == kind)


def global_name(read: ReadValue) -> str:
    """A global read as code names it: ``config.SCALE``, ``os.environ['SCALE']``."""
    if read.module == "os" and read.path[0] == "environ":
        return f"os.environ[{read.path[1]!r}]"
    return ".".join(read.path)
