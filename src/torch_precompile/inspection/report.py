"""What ``inspect`` and ``verify`` report about a saved pair, read without executing it.

The source is parsed (never run); the cache's envelope is read as data (``envelope.decode``:
JSON and raw bytes, or ``torch.load(weights_only=True)`` for a version-1 one). The cache is the
one ``load_file`` would find, and what the reports say a load does is ``artifact.judgement``'s
decision, made with load's own checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_precompile.artifact import envelope, signature
from torch_precompile.artifact.judgement import (
    DEFECT,
    NOTE,
    OK,
    REFUSAL,
    Judgement,
    judge,
    pins,
)
from torch_precompile.artifact.kernel_payload import (
    PayloadExamination,
    count_objects,
    object_kind,
    read_payload,
)
from torch_precompile.errors import PrecompileError
from torch_precompile.lower import PIECE_LINE, WRAPPER_LINE
from torch_precompile.shipped.driver.encoded import shown_value
from torch_precompile.shipped.driver.variants import variant_label
from torch_precompile.spec import ArtifactSpec, Autograd, InputLeaf, parse_spec, shown_version
from torch_precompile.storage import cache_path, find_cache


@dataclass(frozen=True)
class _Pair:
    """A saved source and the cache a load of it would take (``storage.find_cache``)."""

    code: str
    spec: ArtifactSpec
    cache_file: Path  # where the cache was found, else where ``save`` would put it
    cache: bytes | None
    absence: str | None  # why there is no cache, in load's words (None: there is one)


def _read_pair(path: Path) -> _Pair:
    try:
        code = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PrecompileError(f"cannot read {path}: {e}") from e
    try:
        spec = parse_spec(code)
    except PrecompileError as e:
        raise PrecompileError(f"{path}: {e}") from e
    # The lookup load_file makes: a renamed or copied source keeps its cache.
    search = find_cache(path, code)
    if search.found is None:
        return _Pair(code, spec, cache_path(path, code), None, search.absence())
    return _Pair(code, spec, search.found, search.found.read_bytes(), None)


def describe(path: Path) -> dict[str, Any]:
    """Everything a reader wants to know about the pair at ``path``, as plain data; what it
    says a load does is ``judgement.judge``'s decision, made by load's own checks."""
    pair = _read_pair(path)
    code, spec, cache = pair.code, pair.spec, pair.cache
    judged = judge(code, cache, spec=spec)
    report: dict[str, Any] = {
        "source": {
            "path": str(path),
            "bytes": len(code.encode()),
            "backend": spec.backend,
            "schema_version": shown_version(spec.schema_version),
            "torch": f"{spec.torch.version} (git {spec.torch.git[:12]})",
        },
        "call": f"forward({', '.join(a.name for a in spec.args)})",
        "models": list(spec.model_names),
        "parameters": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "device": t.device,
                "gets_grad": t.gets_grad,
                "requires_grad": bool(t.requires_grad),
            }
            for t in spec.parameters
        ],
        "buffers": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "device": t.device}
            for t in spec.buffers
        ],
        "tied": {t.name: t.tied_to for t in spec.model if t.tied_to is not None},
        "modes": _describe_modes(spec),
        "inputs": [_describe_input(leaf) for leaf in spec.inputs],
        "dynamic_dims": [
            {
                "shape_id": dim.shape_id or None,
                "dims": [f"{spec.inputs[leaf].path}[{d}]" for leaf, d in dim.places],
            }
            for dim in spec.dynamic_dims
        ],
        "size_rules": [relation.readable for relation in spec.size_relations],
        "value_guards": [guard.description for guard in spec.value_guards],
        "tracer": "dynamo" if spec.guards else "make_fx",
        "dynamo_guards": [dataclasses.asdict(note) for note in spec.guards],
        "meshes": [
            {
                "device_type": m.device_type,
                "shape": list(m.shape),
                "dim_names": list(m.dim_names) if m.dim_names else None,
                "serves": "every rank"
                if m.coordinate is None
                else f"coordinate {list(m.coordinate)} only",
            }
            for m in spec.meshes
        ],
        "dtensors": [
            {
                "name": d.name,
                "mesh": d.mesh,
                "placements": list(d.placements),
                "shape": list(d.shape),
                "local_shape": list(d.local_shape),
            }
            for d in spec.distributed
        ],
        "optimizers": _describe_optimizers(spec),
        "subclasses": _describe_subclasses(spec),
        "data_parallel": _describe_data_parallel(spec),
        "wrapper": _describe_wrapper(code, spec),
        "blocks": _describe_blocks(code),
        "autograd": _describe_autograd(spec),
        "variants": [variant_label(v) for v in spec.all_variants] if spec.variants else [],
        "cache": _describe_cache(pair, judged),
        "load": {
            "outcome": judged.outcome,
            "refused": judged.refusal is not None,
            "prebuilt": count_objects(judged.prebuilt),
            "to_build": judged.to_build,
            "problems": [f.text for f in judged.findings if f.effect in (DEFECT, REFUSAL)],
        },
    }
    return report


def _describe_wrapper(code: str, spec: ArtifactSpec) -> str | None:
    """What calls the kernels (None for the eager backend): the spec's wrapper kinds (from
    10.0; before, section 2's comments), with section 2's reason where a graph runs in Python."""
    if spec.backend != "inductor":
        return None
    # Section 2 says why a graph runs in Python, one line per graph that says.
    said = [
        _shown_wrapper(line)
        for line in re.findall(f"^ *{re.escape(WRAPPER_LINE)}(.*)$", code, re.MULTILINE)
    ]
    kinds = [kind for variant in spec.all_variants for kind in variant.wrappers]
    if kinds:  # recorded in the spec from 10.0
        reasons = iter(s for s in said if s != "cpp")
        said = [kind if kind == "cpp" else next(reasons, "python") for kind in kinds]
    shown = sorted({*said, *["python"] * (len(spec.all_variants) - len(said))})
    return shown[0] if len(shown) == 1 else "per variant: " + "; ".join(shown)


def _describe_blocks(code: str) -> list[str]:
    """The repeated blocks that share compiled code, from the comment above each piece."""
    shared = re.findall(
        rf"^ *{re.escape(PIECE_LINE)}\d+ of \d+: (the \w+ of .*), run (\d+) times\.$",
        code,
        re.MULTILINE,
    )
    return [f"{what}: one piece of code, {runs} calls" for what, runs in shared]


def _shown_wrapper(said: str) -> str:
    if said.startswith("C++."):
        return "cpp"
    return "python (" + said.removeprefix("Python. ").rstrip(".") + ")"


def _describe_data_parallel(spec: ArtifactSpec) -> list[str]:
    """One line per DDP model and per FSDP2 param group: what the graph communicates."""
    lines = []
    for d in spec.data_parallel:
        sync = "averaged over" if d.sync_grads else "not synced (no_sync) over"
        buffers = ", buffers broadcast from rank 0 first" if d.forward_sync else ""
        lines.append(
            f"{d.argument}: DistributedDataParallel, gradients {sync} {d.world_size} ranks{buffers}"
        )
    for g in spec.fully_sharded:
        dtypes = "".join(
            f", {kind} {dtype}"
            for kind, dtype in (("gathered in", g.param_dtype), ("reduced in", g.reduce_dtype))
            if dtype
        )
        reshard = "resharded after forward" if g.reshard_after_forward else "kept after forward"
        lines.append(
            f"{spec.model_names[g.model]}.{g.module or '(root)'}: fully_shard, {reshard}{dtypes}"
        )
    return lines


def _describe_optimizers(spec: ArtifactSpec) -> list[dict[str, Any]]:
    """Each optimizer argument: class, param groups (options read per call, baked options,
    how a fresh state starts) and the state tensors per parameter."""
    described = []
    for number, optimizer in enumerate(spec.optimizers):
        state: dict[str, dict[str, str]] = {}
        for entry in spec.optimizer_state:
            if entry.optimizer == number:
                state.setdefault(entry.param, {})[entry.key] = (
                    f"{tuple(entry.shape)} {entry.dtype.removeprefix('torch.')}"
                )
        described.append(
            {
                "argument": optimizer.argument,
                "class": optimizer.cls,
                "param_groups": [
                    {
                        "params": list(g.params),
                        "read_at_every_call": list(g.call_time),
                        "baked": {
                            k: list(v) if isinstance(v, tuple) else v for k, (_, v) in g.baked
                        },
                        "fresh_start": g.fresh_start or "zero state",
                    }
                    for g in spec.param_groups
                    if g.optimizer == number
                ],
                "state": state,
            }
        )
    return described


def _describe_subclasses(spec: ArtifactSpec) -> list[dict[str, Any]]:
    """Each tensor subclass carried by its inner tensors: class, flatten context, inners."""
    return [
        {
            "name": w.name,
            "class": w.cls,
            "shape": list(w.shape),
            "context": shown_value(w.context),
            "inner": {
                t.attr: f"{tuple(t.shape)} {t.dtype.removeprefix('torch.')}"
                for t in spec.wrapped_inner
                if t.wrapper == number
            },
        }
        for number, w in enumerate(spec.wrapped)
    ]


def _describe_autograd(spec: ArtifactSpec) -> dict[str, Any] | None:
    """Whether results carry autograd history (fn without backward), and for each
    differentiable form, which calls it serves and what its forward saves for backward."""
    record = spec.autograd
    if record is None:
        return None
    if not spec.gives_history:
        said = record.unavailable or (
            "no: nothing required grad at capture, and no input can at a call"
            if not record.inputs and spec.autograd_for_inputs is None
            else "no: no result depends on what requires grad"
        )
        return {"differentiable": False, "why": said}
    # The capture's own form at the top level (as before there was a second one).
    return {
        "differentiable": True,
        **_describe_form(record, spec, "where only what required grad at capture requires grad"),
        "for_inputs": _describe_form(
            spec.autograd_for_inputs,
            spec,
            "where an input tensor requires grad that did not at capture",
        ),
    }


def _describe_form(record: Autograd | None, spec: ArtifactSpec, serves: str) -> dict[str, Any]:
    """One differentiable form: the calls it serves, the gradients its backward gives, the
    results it gives history and what its forward saves (or why it gives none)."""
    if record is None:
        return {}
    if not record.outputs:
        why = record.unavailable or (
            "no gradients: nothing required grad at capture"
            if not record.inputs
            else "no history: no result depends on what requires grad"
        )
        return {"serves": serves, "why": why}
    names = [*(t.name for t in spec.interned), *(leaf.path for leaf in spec.tensor_inputs)]
    return {
        "serves": serves,
        "gradients_for": len(record.inputs),
        "gradients_of": [names[i] for i in record.inputs],
        "results_with_history": list(record.outputs),
        "saved": list(record.saved),
    }


def _describe_modes(spec: ArtifactSpec) -> str:
    training = sum(s.training for s in spec.submodules)
    return f"{training} of {len(spec.submodules)} modules in training mode"


def _describe_input(leaf: InputLeaf) -> dict[str, Any]:
    if leaf.kind == "value":
        assert leaf.value is not None
        kind, value = leaf.value
        return {"name": leaf.path, "value": value[1] if kind == "repr" else value}
    assert leaf.shape is not None
    described: dict[str, Any] = {
        "name": leaf.path,
        "shape": ["*" if s is None else s for s in leaf.shape],
        "dtype": leaf.dtype,
        "device": leaf.device,
    }
    if leaf.bounds:
        described["bounds"] = {str(d): list(b) for d, b in leaf.bounds.items()}
    return described


def _describe_cache(pair: _Pair, judged: Judgement) -> dict[str, Any]:
    code, spec, cache = pair.code, pair.spec, pair.cache
    if cache is None:
        return {"path": str(pair.cache_file), "present": False, "absence": pair.absence}
    info: dict[str, Any] = {
        "path": str(pair.cache_file),
        "present": True,
        "bytes": len(cache),
        "signed": judged.signed,
    }
    try:
        outer = envelope.decode(signature.split(cache)[1])
    except Exception as e:
        info["readable"] = f"no ({type(e).__name__})"
        return info
    info.update(
        readable="yes",
        format=outer.get("format"),
        version=outer.get("version"),
        matches_source=outer.get("code_hash") == envelope.code_hash(code)
        and outer.get("backend") == spec.backend,
    )
    if judged.module is not None:
        info["compiled_module"] = judged.module
    payload = judged.payload
    if payload is not None and payload.unreadable is not None:
        info["kernels"] = f"unreadable ({payload.unreadable})"
    elif payload is not None:
        info["kernels"] = _describe_objects(payload, pins(spec))
        built_for = read_payload(outer["artifact"])["fingerprint"]  # readable: judged so
        info["built_for"] = {k: v for k, v in built_for.items() if k != "cpu_flags"}
        info["runs_here"] = payload.mismatch or "yes"
    return info


def _describe_objects(
    payload: PayloadExamination, pinned: dict[str, str] | None
) -> list[dict[str, Any]]:
    """Each prebuilt object of the cache: what it is, and what a load here does with it."""
    described = []
    for key, entry in payload.entries.items():
        named = pinned is None or pinned.get(key) == hashlib.sha256(entry["object"]).hexdigest()
        if key in payload.skipped:
            state = f"skipped ({payload.skipped[key]}); built from the source"
        elif not named:  # intact (else skipped) yet not named: what a load refuses
            state = "refused: the source does not name it"
        elif payload.refusal is not None:
            state = "not mapped: a load refuses the cache for another object"
        elif payload.mismatch is not None:
            state = "not mapped: built elsewhere, so built from the source"
        else:
            state = "mapped"
        described.append(
            {
                "key": key[:16],
                "kind": object_kind(entry),
                "bytes": len(entry["object"]),
                "named_by_source": named,
                "load": state,
            }
        )
    described.extend(
        {
            "key": str(key)[:16],
            "kind": "malformed entry",
            "bytes": 0,
            "named_by_source": False,
            "load": f"skipped ({why})",
        }
        for key, why in payload.skipped.items()
        if key not in payload.entries
    )
    return described


@dataclass(frozen=True)
class Verification:
    """What ``verify`` found: a pair verifies when ``problems`` is empty and ``unchecked`` is
    None."""

    checked: list[str]  # what is as it should be
    notes: list[str]  # nothing wrong, but worth saying (a load here builds or compiles)
    problems: list[str]  # damage or a refusal: the pair does not verify
    unchecked: str | None  # why the signature went unchecked (a signed pair, no key)


def verify(path: Path, key: bytes | None) -> Verification:
    """Pairing, compiled module, kernel objects and signature of the pair at ``path``, judged
    as a load with ``verify_key=key`` judges them (``judgement.judge``)."""
    pair = _read_pair(path)
    spec, cache = pair.spec, pair.cache
    judged = judge(pair.code, cache, key, spec=spec)

    def said(*effects: str) -> list[str]:
        return [f.text for f in judged.findings if f.effect in effects]

    checked = [f"{path.name}: a precompiled artifact, backend {spec.backend!r}", *said(OK)]
    # A refusal is among the problems, in load's words.
    notes = [
        *said(NOTE),
        "a load here refuses the pair, running nothing"
        if judged.refusal
        else f"a load here {judged.outcome}",
    ]
    if cache is None:
        notes.insert(0, str(pair.absence))
    unchecked = None
    if judged.signed and not judged.signature_checked:
        unchecked = (
            "the pair is signed, but no key was given, so its signature was not "
            "checked: pass the signing key with --key-file FILE"
        )
    elif not judged.signed and cache is not None:
        notes.insert(0, "unsigned: only the pairing binds the cache to the source")
    # Damage and refusals both fail verification, in the order a load meets them.
    return Verification(checked, notes, said(DEFECT, REFUSAL), unchecked)
