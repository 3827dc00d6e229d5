"""The artifact's header: what it computes and from what, how it was made, how to run it,
what a call must pass and what stays the caller's, and the list of its sections.

Each sentence is written only where the spec makes it true (a note on optimizers only where
there are optimizers), so the header describes this artifact and no other.
"""

from __future__ import annotations

import datetime
import os
import textwrap
from collections.abc import Sequence

import torch_precompile
from torch_precompile.artifact.checks import few, settings_read, tensor_type
from torch_precompile.artifact.plain_checks import apart
from torch_precompile.spec import ArtifactSpec


def header(
    specs: Sequence[ArtifactSpec],
    call_example: str,
    origin: str | None,
    tracer: str,
    sections: str,
) -> str:
    """The header of an artifact holding ``specs`` (its variants), ending with ``sections``."""
    return _HEADER.format(
        origin=_origin(specs, call_example, origin),
        provenance=_provenance(specs[0], tracer),
        call_example=call_example,
        checks=_checks(specs),
        sections=sections,
    )


_HEADER = """\
{origin}
#
{provenance}
#
# Run it with torch_precompile.precompile.load(code, cache) (with its cache nothing is built),
# or with torch alone:
#
#     namespace = {{}}
#     exec(open("this_file.py").read(), namespace)
#     result = namespace["forward"]({call_example})
#
{checks}
#
{sections}
"""

_CHECKS = (
    "Checked at every call: the number of arguments, the structure of the inputs, each input "
    "tensor's shape, dtype and device{inputs_read}{values}{models}.{reads} Autocast, the "
    "default dtype, "
    "deterministic algorithms and active modes must be as at capture{settings}.{optimizers}"
    "{subclasses}{data_parallel}{writes}{layout} "
    "Yours to keep: control flow and data-dependent decisions follow the example the "
    "computation was captured with. Mutations of inputs{buffers} land on what you pass in{grads}."
)
_VALUES_NOTE = " (and Python values, which are baked)"
_MODELS_NOTE = (
    ", and each model's parameter and buffer names, order, tying, shapes, dtypes and devices, "
    "and every submodule's class, training mode, forward and hooks (those present at capture "
    "are in the graph, with the plain values they hold)"
)
_READS_NOTE = (
    " The Python values the trace read (module attributes, module globals, environment "
    "variables; listed in read_values) must be as they were."
)
_GRADS_NOTE = (
    "; gradients of the backward inside fn are added to the parameters' .grad, as eager "
    "backward does"
)
_DROPPED_GRADS_NOTE = ", or replace it where fn drops it first (zero_grad)"
_READ_GRADS_NOTE = (
    " A call that comes with a .grad on a parameter whose gradient fn reads (clip_grad_norm_) "
    "is refused."
)
_INDUCTOR_LAYOUT = (
    " The kernels also assume the memory layout (strides) of every tensor they read; another "
    "layout is refused before any kernel runs."
)
_WRITES_NOTE = (
    " A tensor the graph writes in place (an input or a buffer) must share no memory with "
    "another input, a buffer or a parameter, and hold each element at an address of its own "
    "(not expanded)."
)
_OPTIMIZER_NOTE = (
    " For each optimizer: its class, param groups, baked options and state tensors; its lr is "
    "read at every call, and its state tensors are updated in place (a fresh optimizer gets "
    "zero state first)."
)

_SUBCLASS_NOTE = (
    " For each tensor subclass (a quantized weight): its class, flatten context and inner "
    "tensors; the graph runs on the inner tensors."
)

_DATA_PARALLEL_NOTE = (
    " For each DistributedDataParallel model: its process group's size and no_sync() state; "
    "the graph averages gradients over that group as DDP does."
)
_FULLY_SHARDED_NOTE = (
    " For each fully_shard (FSDP2) module: that it is still sharded, with gradient sync on and "
    "the captured divide factor; the graph gathers its parameters and reduce-scatters their "
    "gradients as FSDP2 does."
)

_AUTOGRAD_NOTE = (
    " Under grad mode, where a tensor that required grad at capture requires grad, results "
    "carry autograd history: the forward graph runs and backward() runs the backward graph"
)
_INPUTS_NOTE = (
    "; where an input tensor requires grad that did not at capture, the input_forward and "
    "input_backward graphs run instead, which also give its gradient (a parameter requiring "
    "grad that did not at capture is refused)."
)
_ONLY_INPUTS_NOTE = (
    " Under grad mode, where an input tensor requires grad, results carry autograd history: "
    "the input_forward graph runs and backward() runs the input_backward graph, which gives "
    "its gradient (a parameter requiring grad that did not at capture is refused)."
)
_NO_INPUTS_NOTE = " (a tensor requiring grad that did not at capture is refused)."

_VARIANTS_NOTE = (
    " This artifact holds {count} variants, one per call captured (section 1 lists each one's "
    "spec): a call runs the first variant whose checks it passes, trying the one that ran last "
    "first, and a call that fits none is refused."
)


def _origin(specs: Sequence[ArtifactSpec], call_example: str, origin: str | None) -> str:
    """The header's first lines: what the artifact computes, captured from what, on which
    inputs, and whether its results carry autograd history."""
    text = f"A precompiled PyTorch computation: forward({call_example})"
    if origin is not None:
        text += f", captured from {origin}"
    tensors = [
        f"{leaf.path} {tensor_type(leaf)}" for leaf in specs[0].inputs if leaf.kind == "tensor"
    ]
    if tensors:
        text += " with " + ", ".join(tensors)
        if len(specs) > 1:
            text += f" (and {len(specs) - 1} other variant{'s' if len(specs) > 2 else ''})"
    text += "."
    unavailable = specs[0].autograd.unavailable if specs[0].autograd is not None else None
    if unavailable:
        text += f" Its {unavailable}."
    return textwrap.fill(text, width=96, initial_indent="# ", subsequent_indent="# ")


_OUTCOMES = ("checked", "fixed", "dropped")


def _provenance(spec: ArtifactSpec, tracer: str) -> str:
    text = (
        f"Made by torch-precompile {torch_precompile.__version__} on {_build_date()} with "
        f"tracer {tracer} and backend {spec.backend!r}, for torch {spec.torch.version} "
        f"(git {spec.torch.git[:12]}) only. No weights are inside: pass your model at "
        "every call. Do not edit: the cache made with it is bound to these exact bytes."
    )
    if spec.guards:
        counts = {o: sum(g.count for g in spec.guards if g.outcome == o) for o in _OUTCOMES}
        text += (
            " Dynamo read fn's Python and guarded what it read: "
            + ", ".join(f"{n} guards {o}" for o, n in counts.items())
            + " (ARTIFACT_SPEC's guards, or inspect, say which and why)."
        )
    return textwrap.fill(text, width=96, initial_indent="# ", subsequent_indent="# ")


def _checks(specs: Sequence[ArtifactSpec]) -> str:
    """The header's paragraph on what a call must pass: only what this artifact checks."""

    def anywhere(field: str) -> bool:
        return any(getattr(spec, field) for spec in specs)

    def note(applies: bool, text: str) -> str:
        return text if applies else ""

    settings = list(dict.fromkeys(name for spec in specs for name in settings_read(spec)))
    leaves = [leaf for spec in specs for leaf in spec.inputs]
    inputs_read = list(dict.fromkeys(f"{t.path}: {r[0]}" for t in leaves for r in t.read))
    text = _CHECKS.format(
        inputs_read=note(bool(inputs_read), f", what fn's code read of one ({few(inputs_read)})"),
        values=note(any(leaf.kind == "value" for s in specs for leaf in s.inputs), _VALUES_NOTE),
        models=note(bool(specs[0].model_names), _MODELS_NOTE),
        reads=note(anywhere("read_values"), _READS_NOTE),
        buffers=note(bool(specs[0].model_names), " and buffers"),
        settings=note(
            bool(settings), f", and so must the torch settings fn read ({few(settings)})"
        ),
        grads=note(any(t.gets_grad for s in specs for t in s.model), _GRADS_NOTE)
        + note(any(t.old_grad == "replaced" for s in specs for t in s.model), _DROPPED_GRADS_NOTE),
        optimizers=note(anywhere("optimizers"), _OPTIMIZER_NOTE),
        subclasses=note(anywhere("wrapped"), _SUBCLASS_NOTE),
        data_parallel=note(anywhere("data_parallel"), _DATA_PARALLEL_NOTE)
        + note(anywhere("fully_sharded"), _FULLY_SHARDED_NOTE),
        writes=note(any(apart(spec) for spec in specs), _WRITES_NOTE),
        layout=note(specs[0].backend == "inductor", _INDUCTOR_LAYOUT),
    )
    if any(t.old_grad == "read" for s in specs for t in s.model):
        text += _READ_GRADS_NOTE
    text += _history_note(specs)
    if len(specs) > 1:
        text += _VARIANTS_NOTE.format(count=len(specs))
    return textwrap.fill(text, width=96, initial_indent="# ", subsequent_indent="# ")


def _history_note(specs: Sequence[ArtifactSpec]) -> str:
    """The header's sentence on which graphs give results autograd history, if any do."""
    forms = [(s.autograd, s.autograd_for_inputs) for s in specs]
    own = any(a is not None and a.outputs for a, _ in forms)
    for_inputs = any(b is not None and b.outputs for _, b in forms)
    if own:
        return _AUTOGRAD_NOTE + (_INPUTS_NOTE if for_inputs else _NO_INPUTS_NOTE)
    return _ONLY_INPUTS_NOTE if for_inputs else ""


def _build_date() -> str:
    """Today (UTC), or the date of ``SOURCE_DATE_EPOCH`` for reproducible builds."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
        if epoch
        else datetime.datetime.now(datetime.UTC)
    )
    return moment.date().isoformat()
