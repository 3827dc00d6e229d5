"""The graph breaks Dynamo met while reading ``fn``: those the make_fx trace carries (a
backward, an optimizer step, ``.item()``, a branch on a tensor) are taken, any other refused,
naming the line and Dynamo's reason."""

from __future__ import annotations

import types

from torch_precompile.errors import PrecompileError
from torch_precompile.internals import dynamo
from torch_precompile.internals.origin import shown_path
from torch_precompile.trace.facts.code_homes import users_file

# Graph breaks the make_fx trace carries, by words of Dynamo's reason (lowercased): the trace
# records the backward, and checks at every call (or refuses by name) the values read off
# tensors, the seeds, generators and draws, the clock and torch's settings that fn reads.
_TENSOR_VALUE = "the make_fx trace checks the values read off tensors at every call"
_WATCHED = "the make_fx trace watches it (checked at every call, named, or refused)"
_CARRIED_BREAKS = (
    ("backward()", "the make_fx trace records the backward"),
    ("autograd.grad", "the make_fx trace records the backward"),
    (".item()", _TENSOR_VALUE),
    ("tolist()", _TENSOR_VALUE),
    ("generic_jump", _TENSOR_VALUE),
    ("data-dependent", _TENSOR_VALUE),
    ("data dependent", _TENSOR_VALUE),
    ("dynamic shape operator", _TENSOR_VALUE),
    ("untypedstorage", _TENSOR_VALUE),
    ("numpy", _TENSOR_VALUE),
    ("manual_seed", _WATCHED),
    ("seed", _WATCHED),
    ("rng_state", _WATCHED),
    ("random", _WATCHED),
    ("perf_counter", _WATCHED),
    ("time.time", _WATCHED),
    ("monotonic", _WATCHED),
    ("torch.* op returned non-tensor", _WATCHED),
    # Dynamo skips it (a break at the user's call, with or without a graph before it); the
    # trace steps the optimizers passed to fn, their gradients cleared as eager clears them.
    ("`Optimizer.zero_grad`", "the make_fx trace carries the optimizers passed to fn"),
)


def refuse_breaks(reading: dynamo.DynamoReading) -> None:
    """Refuse a graph break the make_fx trace does not carry, naming its line and reason."""
    for brk in reading.breaks:
        if carried(brk) is None:
            raise PrecompileError(
                f"tracer='dynamo' could not read fn past {break_line(brk)}: "
                f"{brk.reason.rstrip('.')}. Code Dynamo cannot read would run once, at "
                "capture, and never at a call: move it out of fn, around the artifact's call, "
                "or capture with tracer='make_fx' (the default), which runs it once at capture "
                "too and warns of each print, logging or warnings call it ran."
            )


def break_line(brk: dynamo.GraphBreak) -> str:
    if not brk.line:
        return "an unknown line"
    file, _, line = brk.line.rpartition(":")
    code = f" ({brk.text.strip()})" if brk.text else ""
    return f"{shown_path(file)}:{line}{code}"


def carried(brk: dynamo.GraphBreak) -> str | None:
    """Why the make_fx trace carries ``brk``; None where it does not."""
    text = brk.reason.lower()
    why = next((why for key, why in _CARRIED_BREAKS if key.lower() in text), None)
    if why is None and brk.line and not users_file(brk.line.rpartition(":")[0]):
        # torch's, the standard library's or an installed package's code: the trace runs it
        # and its watchers see what it reads of the model (module attributes, hooks, ...)
        why = "code not the user's, which the make_fx trace runs and watches"
    return why


def resumes(code: types.CodeType, fn_code: types.CodeType) -> bool:
    """Whether ``code`` is one of Dynamo's resume functions for fn (after a graph break)."""
    return code.co_filename == fn_code.co_filename and code.co_name.startswith(
        "torch_dynamo_resume_in_"
    )
