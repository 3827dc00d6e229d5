"""The ``inspect`` report (``report.describe``) as text for a terminal."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_precompile.artifact.kernel_payload import count_objects


def render(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    source = report["source"]
    lines = [
        f"{source['path']}: backend {source['backend']}, {source['bytes'] / 1024:.1f} KiB, "
        f"spec schema {source['schema_version']}, torch {source['torch']}",
        f"  call      : {report['call']}   (models: {', '.join(report['models']) or '-'})",
    ]
    lines.append(
        f"  parameters: {len(report['parameters'])} ({_gradients_said(report)})"
        f", buffers: {len(report['buffers'])}, tied: {len(report['tied'])}, "
        f"{report['modes']}"
    )
    for p in report["parameters"]:
        lines.append(
            f"    {p['name']:<40} {tuple(p['shape'])!s:<16} {p['dtype']:<16} "
            f"{p['device']}{'  grad' if p['gets_grad'] else ''}"
        )
    for b in report["buffers"]:
        lines.append(
            f"    {b['name']:<40} {tuple(b['shape'])!s:<16} {b['dtype']:<16} {b['device']}  buffer"
        )
    lines.append("  inputs    :")
    for item in report["inputs"]:
        if "shape" in item:
            shape = "(" + ", ".join(str(s) for s in item["shape"]) + ")"
            bounds = f"  bounds {item['bounds']}" if "bounds" in item else ""
            lines.append(
                f"    {item['name']:<30} {shape:<16} {item['dtype']:<16} {item['device']}{bounds}"
            )
        else:
            lines.append(f"    {item['name']:<30} = {item['value']!r} (baked)")
    for dim in report["dynamic_dims"]:
        label = f"shape_id {dim['shape_id']!r}" if dim["shape_id"] else "dynamic"
        lines.append(f"  {label}: {', '.join(dim['dims'])}")
    lines.extend(f"  size rule : {rule}" for rule in report["size_rules"])
    lines.extend(f"  guard     : {guard}" for guard in report["value_guards"])
    lines.extend(_render_dynamo_guards(report.get("dynamo_guards", ())))
    for index, mesh in enumerate(report["meshes"]):
        names = f" {tuple(mesh['dim_names'])}" if mesh["dim_names"] else ""
        lines.append(
            f"  mesh {index}    : {mesh['device_type']} {tuple(mesh['shape'])}{names}, "
            f"serves {mesh['serves']}"
        )
    for d in report["dtensors"]:
        lines.append(
            f"    {d['name']:<40} ({', '.join(d['placements'])}) on mesh {d['mesh']}, "
            f"global {tuple(d['shape'])}, local {tuple(d['local_shape'])}"
        )
    lines.extend(f"  data par. : {line}" for line in report.get("data_parallel", ()))
    lines.extend(_render_optimizer(o) for o in report.get("optimizers", ()))
    for w in report.get("subclasses", ()):
        inner = ", ".join(f"{attr} {shown}" for attr, shown in w["inner"].items())
        lines.append(f"  subclass  : {w['name']} is a {w['class']}: {inner}")
        lines.append(f"    flatten context {w['context']}")
    if report.get("wrapper"):
        lines.append(f"  wrapper   : {report['wrapper']}")
    lines.extend(f"  blocks    : {line}" for line in report.get("blocks", ()))
    lines.extend(_render_autograd(report.get("autograd")))
    for number, label in enumerate(report.get("variants", ()), 1):
        lines.append(
            f"  variant {number} : {label}"
            + ("   (the spec's top level, shown above)" if number == 1 else "")
        )
    cache = report["cache"]
    if not cache["present"]:
        lines.append(f"  cache     : missing: {cache['absence']}")
    else:
        lines.append(
            f"  cache     : {Path(cache['path']).name}, {cache['bytes'] / 1024:.1f} KiB, "
            f"{'signed' if cache['signed'] else 'unsigned'}, readable {cache['readable']}"
            + (f", matches source {cache['matches_source']}" if "matches_source" in cache else "")
        )
        if "compiled_module" in cache:
            lines.append(f"  module    : compiled in the cache: {cache['compiled_module']}")
        if isinstance(cache.get("kernels"), list):
            total = sum(k["bytes"] for k in cache["kernels"])
            held = count_objects(k["kind"] for k in cache["kernels"])
            lines.append(
                f"  prebuilt  : {held}, {total / 1024:.1f} KiB; built for "
                f"{cache['built_for']}; runs here: {cache['runs_here']}"
            )
        elif "kernels" in cache:
            lines.append(f"  prebuilt  : {cache['kernels']}")
    load = report["load"]
    lines.append(f"  load      : {load['outcome']}")
    shown = load["outcome"]
    lines.extend(f"  problem   : {text}" for text in load["problems"] if text not in shown)
    return "\n".join(lines)


def _render_dynamo_guards(notes: Sequence[dict[str, Any]]) -> list[str]:
    """Dynamo's guards (tracer="dynamo"): a count per outcome, then each guard, the dropped
    ones first."""
    if not notes:
        return []
    counts = {o: sum(n["count"] for n in notes if n["outcome"] == o) for o in _OUTCOMES}
    lines = [
        "  dynamo    : guards "
        + ", ".join(f"{counts[o]} {o}" for o in _OUTCOMES)
        + "   (tracer='dynamo')"
    ]
    for note in sorted(notes, key=lambda n: _OUTCOMES.index(n["outcome"])):
        times = f" (x{note['count']})" if note["count"] > 1 else ""
        lines.append(
            f"    {note['outcome']:<8} {note['kind']} {note['reads']}{times}: {note['by']}"
        )
    return lines


_OUTCOMES = ("dropped", "checked", "fixed")


def _gradients_said(report: dict[str, Any]) -> str:
    """Which parameters get gradients, and from which backward."""
    parameters = report["parameters"]
    if report.get("autograd") is None:  # fn runs its backward, or no form was recorded
        return f"{sum(p['gets_grad'] for p in parameters)} get gradients from fn's backward"
    requiring = sum(p.get("requires_grad", False) for p in parameters)
    return f"{requiring} require grad: backward() after a call gives their gradients"


def _render_autograd(autograd: dict[str, Any] | None) -> list[str]:
    if autograd is None:
        return []
    if not autograd["differentiable"]:
        return [f"  autograd  : results carry no history ({autograd['why']})"]
    lines = []
    for label, form in (("autograd  ", autograd), ("for inputs", autograd.get("for_inputs"))):
        if not form:
            continue
        if "why" in form:
            lines.append(f"  {label}: {form['why']}")
            continue
        saved = form["saved"]
        said = "differentiable" if form is autograd else form["serves"]
        lines += [
            f"  {label}: {said}: results {form['results_with_history']} carry "
            f"history; its backward gives {form['gradients_for']} gradient"
            f"{'' if form['gradients_for'] == 1 else 's'}; {len(saved)} values saved for "
            "backward:",
            *(f"    {entry}" for entry in saved),
        ]
    return lines


def _render_optimizer(optimizer: dict[str, Any]) -> str:
    lines = [
        f"  optimizer : {optimizer['argument']} ({optimizer['class']}), state updated in place"
    ]
    for index, group in enumerate(optimizer["param_groups"]):
        baked = ", ".join(f"{k}={v!r}" for k, v in group["baked"].items())
        lines.append(
            f"    group {index}: {len(group['params'])} parameters; read at every call: "
            f"{', '.join(group['read_at_every_call'])}; baked: {baked}; a fresh "
            f"state: {group['fresh_start']}"
        )
    for param, entries in optimizer["state"].items():
        shown = ", ".join(f"{k} {v}" for k, v in entries.items())
        lines.append(f"    {param:<40} {shown}")
    return "\n".join(lines)
