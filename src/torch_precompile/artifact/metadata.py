"""Calling-convention metadata: written as top-level literals, read back without executing."""

from __future__ import annotations

import ast
import pprint
from typing import Any

from torch_precompile.convention import METADATA_NAMES, CallingConvention
from torch_precompile.errors import PrecompileError

_NOT_AN_ARTIFACT = "it is not a precompile artifact (python_code from precompile())"
# The layout of python_code; an artifact of another format is refused, not half-understood.
ARTIFACT_FORMAT = "torch-precompile artifact 1"


def metadata_source(convention: CallingConvention) -> str:
    """One ``NAME = literal`` assignment per field; ``parse_metadata`` is its inverse."""
    lines = [f"ARTIFACT_FORMAT = {ARTIFACT_FORMAT!r}"]
    for name, value in convention.literals().items():
        text = pprint.pformat(value, width=96, compact=True, sort_dicts=False)
        lines.append(f"{name} = {text}")
    return "\n".join(lines) + "\n"


def parse_metadata(python_code: str) -> dict[str, Any]:
    """Read the metadata literals of ``python_code`` by parsing only; nothing is executed."""
    if not isinstance(python_code, str):
        raise PrecompileError(
            f"python_code must be a str, got {type(python_code).__name__}; {_NOT_AN_ARTIFACT}."
        )
    try:
        tree = ast.parse(python_code)
    except SyntaxError as e:
        raise PrecompileError(
            f"python_code does not parse (line {e.lineno}: {e.msg}); {_NOT_AN_ARTIFACT}."
        ) from e
    found: dict[str, Any] = {}
    wanted = {"ARTIFACT_FORMAT", *METADATA_NAMES}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in wanted
        ):
            name = node.targets[0].id
            try:
                found[name] = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError) as e:
                raise PrecompileError(
                    f"python_code's {name} is not a literal; {_NOT_AN_ARTIFACT}."
                ) from e
    artifact_format = found.pop("ARTIFACT_FORMAT", None)
    if artifact_format is not None and artifact_format != ARTIFACT_FORMAT:
        raise PrecompileError(
            f"python_code is a {artifact_format!r}, made by another version of torch-precompile; "
            f"this version reads {ARTIFACT_FORMAT!r}. Precompile it again with this version."
        )
    missing = [name for name in METADATA_NAMES if name not in found]
    if artifact_format is None:
        missing.insert(0, "ARTIFACT_FORMAT")
    if missing:
        raise PrecompileError(
            f"python_code lacks the metadata {', '.join(missing)}; {_NOT_AN_ARTIFACT}."
        )
    return found
