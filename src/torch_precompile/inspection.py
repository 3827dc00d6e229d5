"""What ``inspect`` and ``verify`` report about a saved pair, read without executing it.

The source is parsed (never run); the cache's envelope is read as data (``envelope.decode``:
JSON and raw bytes, or ``torch.load(weights_only=True)`` for a version-1 one).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from torch_precompile.artifact import bytecode, envelope, signature
from torch_precompile.driver.variants import variant_label
from torch_precompile.errors import PrecompileError
from torch_precompile.lower import WRAPPER_LINE
from torch_precompile.spec import ArtifactSpec, InputLeaf, parse_spec
from torch_precompile.storage import cache_path


def _read_pair(path: Path) -> tuple[str, ArtifactSpec, Path, bytes | None]:
    try:
        code = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PrecompileError(f"cannot read {path}: {e}") from e
    spec = parse_spec(code)
    cache_file = cache_path(path, code)
    cache = cache_file.read_bytes() if cache_file.exists() else None
    return code, spec, cache_file, cache


def describe(path: Path) -> dict[str, Any]:
    """Everything a reader wants to know about the pair at ``path``, as plain data."""
    code, spec, cache_file, cache = _read_pair(path)
    report: dict[str, Any] = {
        "source": {"path": str(path), "bytes": len(code.encode()), "backend": spec.backend,
                   "schema_version": spec.schema_version,
                   "torch": f"{spec.torch.version} (git {spec.torch.git[:12]})"},
        "call": f"forward({', '.join(a.name for a in spec.args)})",
        "models": list(spec.model_names),
        "parameters": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "device": t.device,
             "gets_grad": t.gets_grad}
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
            {"shape_id": dim.shape_id or None,
             "dims": [f"{spec.inputs[leaf].path}[{d}]" for leaf, d in dim.places]}
            for dim in spec.dynamic_dims
        ],
        "size_rules": [relation.readable for relation in spec.size_relations],
        "value_guards": [guard.description for guard in spec.value_guards],
        "meshes": [
            {"device_type": m.device_type, "shape": list(m.shape),
             "dim_names": list(m.dim_names) if m.dim_names else None,
             "serves": "every rank" if m.coordinate is None
             else f"coordinate {list(m.coordinate)} only"}
            for m in spec.meshes
        ],
        "dtensors": [
            {"name": d.name, "mesh": d.mesh, "placements": list(d.placements),
             "shape": list(d.shape), "local_shape": list(d.local_shape)}
            for d in spec.distributed
        ],
        "optimizers": _describe_optimizers(spec),
        "subclasses": _describe_subclasses(spec),
        "data_parallel": _describe_data_parallel(spec),
        "wrapper": _describe_wrapper(code, spec),
        "variants": [variant_label(v) for v in spec.all_variants] if spec.variants else [],
        "cache": _describe_cache(code, spec, cache_file, cache),
    }
    return report


def _describe_wrapper(code: str, spec: ArtifactSpec) -> str | None:
    """What calls the kernels, as section 2 says (None for the eager backend)."""
    if spec.backend != "inductor":
        return None
    # One line per graph that says (indented in a variant's function); none: Python.
    said = [_shown_wrapper(line) for line in re.findall(
        f"^ *{re.escape(WRAPPER_LINE)}(.*)$", code, re.MULTILINE)]
    shown = sorted({*said, *["python"] * (len(spec.all_variants) - len(said))})
    return shown[0] if len(shown) == 1 else "per variant: " + "; ".join(shown)


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
        lines.append(f"{d.argument}: DistributedDataParallel, gradients {sync} "
                     f"{d.world_size} ranks{buffers}")
    for g in spec.fully_sharded:
        dtypes = "".join(f", {kind} {dtype}" for kind, dtype in (
            ("gathered in", g.param_dtype), ("reduced in", g.reduce_dtype)) if dtype)
        reshard = "resharded after forward" if g.reshard_after_forward else "kept after forward"
        lines.append(f"{spec.model_names[g.model]}.{g.module or '(root)'}: fully_shard, "
                     f"{reshard}{dtypes}")
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
                    f"{tuple(entry.shape)} {entry.dtype.removeprefix('torch.')}")
        described.append({
            "argument": optimizer.argument, "class": optimizer.cls,
            "param_groups": [
                {"params": list(g.params), "read_at_every_call": list(g.call_time),
                 "baked": {k: list(v) if isinstance(v, tuple) else v for k, (_, v) in g.baked},
                 "fresh_start": g.fresh_start or "zero state"}
                for g in spec.param_groups if g.optimizer == number],
            "state": state,
        })
    return described


def _describe_subclasses(spec: ArtifactSpec) -> list[dict[str, Any]]:
    """Each tensor subclass carried by its inner tensors: class, flatten context, inners."""
    return [
        {"name": w.name, "class": w.cls, "shape": list(w.shape),
         "context": _shown_context(w.context),
         "inner": {t.attr: f"{tuple(t.shape)} {t.dtype.removeprefix('torch.')}"
                   for t in spec.wrapped_inner if t.wrapper == number}}
        for number, w in enumerate(spec.wrapped)
    ]


def _shown_context(encoded: Any) -> str:
    """An encoded flatten context as it reads in Python (nothing is imported to show it)."""
    kind, value = encoded
    if kind in ("list", "tuple"):
        items = [_shown_context(v) for v in value]
        return (f"[{', '.join(items)}]" if kind == "list"
                else f"({', '.join(items)}{',' if len(items) == 1 else ''})")
    if kind == "dict":
        return "{" + ", ".join(f"{_shown_context(k)}: {_shown_context(v)}"
                               for k, v in value) + "}"
    if kind in ("dataclass", "frozen"):
        fields = ", ".join(f"{name}={_shown_context(v)}" for name, v in value[1])
        return f"{value[0].rsplit('.', 1)[-1]}({fields})"
    if kind == "enum":
        return f"{value[0].rsplit('.', 1)[-1]}.{value[1]}"
    if kind == "dtype":
        return f"torch.{value}"
    if kind in ("device", "size"):
        return f"{'device' if kind == 'device' else 'Size'}({value!r})"
    return repr(value) if kind != "float" else value


def _pins(spec: ArtifactSpec) -> dict[str, str] | None:
    """The kernel digests the source names; None before schema 3, which named none."""
    return {k.key: k.sha256 for k in spec.kernels} if spec.schema_version >= 3 else None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _describe_modes(spec: ArtifactSpec) -> str:
    training = sum(s.training for s in spec.submodules)
    return f"{training} of {len(spec.submodules)} modules in training mode"


def _describe_input(leaf: InputLeaf) -> dict[str, Any]:
    if leaf.kind == "value":
        assert leaf.value is not None
        kind, value = leaf.value
        return {"name": leaf.path, "value": value[1] if kind == "repr" else value}
    assert leaf.shape is not None
    described = {"name": leaf.path, "shape": ["*" if s is None else s for s in leaf.shape],
                 "dtype": leaf.dtype, "device": leaf.device}
    if leaf.bounds:
        described["bounds"] = {str(d): list(b) for d, b in leaf.bounds.items()}
    return described


def _describe_cache(code: str, spec: ArtifactSpec, cache_file: Path, cache: bytes | None
                    ) -> dict[str, Any]:
    if cache is None:
        return {"path": str(cache_file), "present": False}
    signed, body = signature.split(cache)
    info: dict[str, Any] = {"path": str(cache_file), "present": True, "bytes": len(cache),
                            "signed": signed is not None}
    try:
        outer = envelope.decode(body)
    except Exception as e:
        info["readable"] = f"no ({type(e).__name__})"
        return info
    info.update(readable="yes", format=outer.get("format"), version=outer.get("version"),
                matches_source=outer.get("code_hash") == envelope.code_hash(code)
                and outer.get("backend") == spec.backend,
                compiled_module=_compiled_module_state(code, outer.get("compiled")))
    artifact = outer.get("artifact")
    if spec.backend == "inductor" and isinstance(artifact, bytes):
        from torch_precompile.artifact.kernel_payload import fingerprint_mismatch, read_payload

        try:
            payload = read_payload(artifact)
        except Exception as e:
            info["kernels"] = f"unreadable ({type(e).__name__})"
            return info
        pins = _pins(spec)
        info["kernels"] = [
            {"key": key[:16], "bytes": len(entry["object"]),
             "named_by_source": pins is None or pins.get(key) == _digest(entry["object"])}
            for key, entry in payload["kernels"].items()
        ]
        fingerprint = payload["fingerprint"]
        info["built_for"] = {k: v for k, v in fingerprint.items() if k != "cpu_flags"}
        info["runs_here"] = fingerprint_mismatch(fingerprint) or "yes"
    return info


def render(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    source = report["source"]
    lines = [f"{source['path']}: backend {source['backend']}, {source['bytes'] / 1024:.1f} KiB, "
             f"spec schema {source['schema_version']}, torch {source['torch']}",
             f"  call      : {report['call']}   (models: {', '.join(report['models']) or '-'})"]
    grads = sum(p["gets_grad"] for p in report["parameters"])
    lines.append(f"  parameters: {len(report['parameters'])} ({grads} get gradients)"
                 f", buffers: {len(report['buffers'])}, tied: {len(report['tied'])}, "
                 f"{report['modes']}")
    for p in report["parameters"]:
        lines.append(f"    {p['name']:<40} {tuple(p['shape'])!s:<16} {p['dtype']:<16} "
                     f"{p['device']}{'  grad' if p['gets_grad'] else ''}")
    for b in report["buffers"]:
        lines.append(f"    {b['name']:<40} {tuple(b['shape'])!s:<16} {b['dtype']:<16} "
                     f"{b['device']}  buffer")
    lines.append("  inputs    :")
    for item in report["inputs"]:
        if "shape" in item:
            shape = "(" + ", ".join(str(s) for s in item["shape"]) + ")"
            bounds = f"  bounds {item['bounds']}" if "bounds" in item else ""
            lines.append(f"    {item['name']:<30} {shape:<16} {item['dtype']:<16} "
                         f"{item['device']}{bounds}")
        else:
            lines.append(f"    {item['name']:<30} = {item['value']!r} (baked)")
    for dim in report["dynamic_dims"]:
        label = f"shape_id {dim['shape_id']!r}" if dim["shape_id"] else "dynamic"
        lines.append(f"  {label}: {', '.join(dim['dims'])}")
    lines.extend(f"  size rule : {rule}" for rule in report["size_rules"])
    lines.extend(f"  guard     : {guard}" for guard in report["value_guards"])
    for index, mesh in enumerate(report["meshes"]):
        names = f" {tuple(mesh['dim_names'])}" if mesh["dim_names"] else ""
        lines.append(f"  mesh {index}    : {mesh['device_type']} {tuple(mesh['shape'])}{names}, "
                     f"serves {mesh['serves']}")
    for d in report["dtensors"]:
        lines.append(f"    {d['name']:<40} ({', '.join(d['placements'])}) on mesh {d['mesh']}, "
                     f"global {tuple(d['shape'])}, local {tuple(d['local_shape'])}")
    lines.extend(f"  data par. : {line}" for line in report.get("data_parallel", ()))
    lines.extend(_render_optimizer(o) for o in report.get("optimizers", ()))
    for w in report.get("subclasses", ()):
        inner = ", ".join(f"{attr} {shown}" for attr, shown in w["inner"].items())
        lines.append(f"  subclass  : {w['name']} is a {w['class']}: {inner}")
        lines.append(f"    flatten context {w['context']}")
    if report.get("wrapper"):
        lines.append(f"  wrapper   : {report['wrapper']}")
    for number, label in enumerate(report.get("variants", ()), 1):
        lines.append(f"  variant {number} : {label}" + ("   (the spec's top level, shown above)"
                                                      if number == 1 else ""))
    cache = report["cache"]
    if not cache["present"]:
        lines.append(f"  cache     : missing ({Path(cache['path']).name}); loads build kernels")
    else:
        lines.append(f"  cache     : {Path(cache['path']).name}, {cache['bytes'] / 1024:.1f} KiB, "
                     f"{'signed' if cache['signed'] else 'unsigned'}, readable {cache['readable']}"
                     + (f", matches source {cache['matches_source']}"
                        if "matches_source" in cache else ""))
        if "compiled_module" in cache:
            lines.append(f"  module    : compiled in the cache: {cache['compiled_module']}")
        if isinstance(cache.get("kernels"), list):
            total = sum(k["bytes"] for k in cache["kernels"])
            strangers = sum(not k["named_by_source"] for k in cache["kernels"])
            lines.append(f"  kernels   : {len(cache['kernels'])} prebuilt, {total / 1024:.1f} KiB; "
                         f"built for {cache['built_for']}; runs here: {cache['runs_here']}"
                         + (f"; {strangers} NOT named by the source (load refuses the cache)"
                            if strangers else ""))
        elif "kernels" in cache:
            lines.append(f"  kernels   : {cache['kernels']}")
    return "\n".join(lines)


def _render_optimizer(optimizer: dict[str, Any]) -> str:
    lines = [f"  optimizer : {optimizer['argument']} ({optimizer['class']}), state updated in "
             "place"]
    for index, group in enumerate(optimizer["param_groups"]):
        baked = ", ".join(f"{k}={v!r}" for k, v in group["baked"].items())
        lines.append(f"    group {index}: {len(group['params'])} parameters; read at every call: "
                     f"{', '.join(group['read_at_every_call'])}; baked: {baked}; a fresh "
                     f"state: {group['fresh_start']}")
    for param, entries in optimizer["state"].items():
        shown = ", ".join(f"{k} {v}" for k, v in entries.items())
        lines.append(f"    {param:<40} {shown}")
    return "\n".join(lines)


def _compiled_module_state(code: str, entry: Any) -> str:
    """What a load here does with the cache's compiled module."""
    if entry is None:
        return "absent (a load compiles the source)"
    if not bytecode.is_sealed(code):
        return "not used (the source has no seal line; a load compiles it)"
    if not isinstance(entry, dict) or entry.get("magic") != bytecode.MAGIC:
        return "not used here (made by another Python; a load compiles the source)"
    try:
        sealed = bytecode.unseal(code, entry)
    except PrecompileError:
        return "refused (the source's seal does not name it)"
    if sealed is not None:
        return "used (sealed by the source, for this Python)"
    return "damaged (a load compiles the source)"


def verify(path: Path, key: bytes | None) -> tuple[list[str], list[str]]:
    """(problems, notes) about the pair at ``path``: pairing, kernels, signature."""
    problems: list[str] = []
    notes: list[str] = []
    code, spec, cache_file, cache = _read_pair(path)
    notes.append(f"{path.name}: a precompiled artifact, backend {spec.backend!r}")
    if cache is None:
        problems.append(f"the cache {cache_file.name} is missing")
        return problems, notes
    signed, body = signature.split(cache)
    if key is not None:
        try:
            signature.verify(key, code, cache)
            notes.append("signature valid for the given key")
        except PrecompileError as e:
            problems.append(str(e))
    else:
        notes.append("signed (not checked: no --key-file)" if signed else "unsigned")
    try:
        outer = envelope.decode(body)
    except Exception as e:
        problems.append(f"the cache is unreadable ({type(e).__name__}: {e})")
        return problems, notes
    if not isinstance(outer, dict) or outer.get("format") != envelope.FORMAT:
        problems.append("the cache is not a torch-precompile envelope")
        return problems, notes
    if outer.get("version") not in envelope.READABLE_VERSIONS:
        problems.append(f"the cache has version {outer.get('version')!r}; this version reads "
                        f"{' and '.join(map(str, envelope.READABLE_VERSIONS))}")
    if outer.get("backend") != spec.backend or outer.get("code_hash") != envelope.code_hash(
            code):
        problems.append("the cache belongs to a different source (code_hash or backend differ)")
    else:
        notes.append("the cache belongs to this source")
    state = _compiled_module_state(code, outer.get("compiled"))
    # A damaged module still loads (from the source), but the cache is corrupt: say so.
    (problems if state.startswith(("refused", "damaged")) else notes).append(
        f"compiled module: {state}")
    artifact = outer.get("artifact")
    if spec.backend == "inductor":
        from torch_precompile.artifact.kernel_payload import fingerprint_mismatch, read_payload

        problems_before = len(problems)
        try:
            payload = read_payload(artifact)
            pins = _pins(spec)
            for name, entry in payload["kernels"].items():
                digest = _digest(entry["object"])
                if digest != entry["sha256"]:
                    problems.append(f"kernel {name[:16]} is corrupt (checksum mismatch)")
                elif pins is not None and pins.get(name) != digest:
                    problems.append(f"kernel {name[:16]} is not an object the source names "
                                    "(its digest is not in the spec's kernels)")
        except Exception as e:
            problems.append(f"the kernel payload is unreadable ({type(e).__name__})")
            return problems, notes
        if len(problems) == problems_before:
            notes.append(f"{len(payload['kernels'])} kernels intact")
        reason = fingerprint_mismatch(payload["fingerprint"])
        notes.append("kernels built for this machine" if reason is None else
                     f"kernels built elsewhere ({reason}); a load here rebuilds them")
    return problems, notes
