"""What ``inspect`` and ``verify`` report about a saved pair, read without executing it.

The source is parsed (never run); the cache is read with ``torch.load(weights_only=True)``,
which only rebuilds plain data.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import torch

from torch_precompile.artifact import envelope, signature
from torch_precompile.artifact.metadata import parse_metadata
from torch_precompile.errors import PrecompileError
from torch_precompile.storage import cache_path


def _read_pair(path: Path) -> tuple[str, dict[str, Any], Path, bytes | None]:
    try:
        code = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PrecompileError(f"cannot read {path}: {e}") from e
    meta = parse_metadata(code)
    cache_file = cache_path(path, code)
    cache = cache_file.read_bytes() if cache_file.exists() else None
    return code, meta, cache_file, cache


def _load_plain(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def describe(path: Path) -> dict[str, Any]:
    """Everything a reader wants to know about the pair at ``path``, as plain data."""
    code, meta, cache_file, cache = _read_pair(path)
    names = meta["ARG_NAMES"]
    report: dict[str, Any] = {
        "source": {"path": str(path), "bytes": len(code.encode()), "backend": meta["BACKEND"]},
        "call": f"forward({', '.join(names)})",
        "models": [names[i] for i in meta["MODULE_POSITIONS"]],
        "parameters": [
            {"name": n, "shape": list(s), "dtype": d, "device": v,
             "gets_grad": i in meta["GRAD_PARAM_INDICES"]}
            for i, (n, s, d, v) in enumerate(zip(meta["PARAM_NAMES"], meta["PARAM_SHAPES"],
                                                  meta["PARAM_DTYPES"], meta["PARAM_DEVICES"],
                                                  strict=True))
        ],
        "buffers": [
            {"name": n, "shape": list(s), "dtype": d, "device": v}
            for n, s, d, v in zip(meta["BUFFER_NAMES"], meta["BUFFER_SHAPES"],
                                  meta["BUFFER_DTYPES"], meta["BUFFER_DEVICES"], strict=True)
        ],
        "tied": meta["TIED_NAMES"],
        "inputs": [_describe_input(meta, i) for i in range(len(meta["USER_INPUT_NAMES"]))],
        "dynamic_dims": [
            {"shape_id": label or None,
             "dims": [f"{meta['USER_INPUT_NAMES'][leaf]}[{dim}]" for leaf, dim in places]}
            for label, places in meta["DYNAMIC_DIMS"]
        ],
        "size_rules": [readable for _, readable in meta["SHAPE_RELATIONS"]],
        "value_guards": [description for description, _ in meta["VALUE_GUARDS"]],
        "cache": _describe_cache(code, meta, cache_file, cache),
    }
    return report


def _describe_input(meta: dict[str, Any], i: int) -> dict[str, Any]:
    name = meta["USER_INPUT_NAMES"][i]
    shape = meta["USER_INPUT_SHAPES"][i]
    if shape is None:
        kind, value = meta["USER_INPUT_VALUES"][i]
        return {"name": name, "value": value[1] if kind == "repr" else value}
    described = {"name": name, "shape": ["*" if s is None else s for s in shape],
                 "dtype": meta["USER_INPUT_DTYPES"][i], "device": meta["USER_INPUT_DEVICES"][i]}
    if meta["USER_INPUT_BOUNDS"][i]:
        described["bounds"] = {str(d): list(b) for d, b in meta["USER_INPUT_BOUNDS"][i].items()}
    return described


def _describe_cache(code: str, meta: dict[str, Any], cache_file: Path, cache: bytes | None
                    ) -> dict[str, Any]:
    if cache is None:
        return {"path": str(cache_file), "present": False}
    signed, body = signature.split(cache)
    info: dict[str, Any] = {"path": str(cache_file), "present": True, "bytes": len(cache),
                            "signed": signed is not None}
    try:
        outer = _load_plain(body)
    except Exception as e:
        info["readable"] = f"no ({type(e).__name__})"
        return info
    info.update(readable="yes", format=outer.get("format"), version=outer.get("version"),
                matches_source=outer.get("code_hash") == envelope.code_hash(code)
                and outer.get("backend") == meta["BACKEND"])
    artifact = outer.get("artifact")
    if meta["BACKEND"] == "inductor" and isinstance(artifact, bytes):
        from torch_precompile.lower.kernels import fingerprint_mismatch

        try:
            payload = _load_plain(artifact)
        except Exception as e:
            info["kernels"] = f"unreadable ({type(e).__name__})"
            return info
        info["kernels"] = [
            {"key": key[:16], "bytes": len(entry["object"])}
            for key, entry in payload["kernels"].items()
        ]
        fingerprint = payload["fingerprint"]
        info["built_for"] = {k: v for k, v in fingerprint.items() if k != "cpu_flags"}
        info["runs_here"] = fingerprint_mismatch(fingerprint) or "yes"
    return info


def render(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    lines = [f"{report['source']['path']}: backend {report['source']['backend']}, "
             f"{report['source']['bytes'] / 1024:.1f} KiB",
             f"  call      : {report['call']}   (models: {', '.join(report['models']) or '-'})"]
    grads = sum(p["gets_grad"] for p in report["parameters"])
    lines.append(f"  parameters: {len(report['parameters'])} ({grads} get gradients)"
                 f", buffers: {len(report['buffers'])}, tied: {len(report['tied'])}")
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
    cache = report["cache"]
    if not cache["present"]:
        lines.append(f"  cache     : missing ({Path(cache['path']).name}); loads build kernels")
    else:
        lines.append(f"  cache     : {Path(cache['path']).name}, {cache['bytes'] / 1024:.1f} KiB, "
                     f"{'signed' if cache['signed'] else 'unsigned'}, readable {cache['readable']}"
                     + (f", matches source {cache['matches_source']}"
                        if "matches_source" in cache else ""))
        if isinstance(cache.get("kernels"), list):
            total = sum(k["bytes"] for k in cache["kernels"])
            lines.append(f"  kernels   : {len(cache['kernels'])} prebuilt, {total / 1024:.1f} KiB; "
                         f"built for {cache['built_for']}; runs here: {cache['runs_here']}")
        elif "kernels" in cache:
            lines.append(f"  kernels   : {cache['kernels']}")
    return "\n".join(lines)


def verify(path: Path, key: bytes | None) -> tuple[list[str], list[str]]:
    """(problems, notes) about the pair at ``path``: pairing, kernels, signature."""
    problems: list[str] = []
    notes: list[str] = []
    code, meta, cache_file, cache = _read_pair(path)
    notes.append(f"{path.name}: a precompiled artifact, backend {meta['BACKEND']!r}")
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
        outer = _load_plain(body)
    except Exception as e:
        problems.append(f"the cache is unreadable ({type(e).__name__}: {e})")
        return problems, notes
    if not isinstance(outer, dict) or outer.get("format") != envelope.FORMAT:
        problems.append("the cache is not a torch-precompile envelope")
        return problems, notes
    if outer.get("version") != envelope.VERSION:
        problems.append(f"the cache has version {outer.get('version')!r}; this version reads "
                        f"{envelope.VERSION}")
    if outer.get("backend") != meta["BACKEND"] or outer.get("code_hash") != envelope.code_hash(
            code):
        problems.append("the cache belongs to a different source (code_hash or backend differ)")
    else:
        notes.append("the cache belongs to this source")
    artifact = outer.get("artifact")
    if meta["BACKEND"] == "inductor":
        problems_before = len(problems)
        try:
            payload = _load_plain(artifact)
            for name, entry in payload["kernels"].items():
                if hashlib.sha256(entry["object"]).hexdigest() != entry["sha256"]:
                    problems.append(f"kernel {name[:16]} is corrupt (checksum mismatch)")
        except Exception as e:
            problems.append(f"the kernel payload is unreadable ({type(e).__name__})")
            return problems, notes
        if len(problems) == problems_before:
            notes.append(f"{len(payload['kernels'])} kernels intact")
        from torch_precompile.lower.kernels import fingerprint_mismatch

        reason = fingerprint_mismatch(payload["fingerprint"])
        notes.append("kernels built for this machine" if reason is None else
                     f"kernels built elsewhere ({reason}); a load here rebuilds them")
    return problems, notes
