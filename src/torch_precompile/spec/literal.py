"""The spec as ``ARTIFACT_SPEC``: one literal of plain dicts, tuples and scalars.

Written one field a line and one record a line, with the fields at their defaults left out
(a reader fills them in). Read back with ``ast.literal_eval`` only, nothing executed; the
reader checks each field against the schema version the literal claims (see ``versions``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pprint
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch_precompile.errors import PrecompileError
from torch_precompile.folding import Pattern, find_runs
from torch_precompile.shipped.driver.folds import is_fold, stepping_digits, unfolded
from torch_precompile.spec.records import ArtifactSpec
from torch_precompile.spec.versions import (
    SCHEMA_VERSION,
    SchemaVersion,
    field_since,
    fields_since,
    literal_version,
    shown_version,
)

SPEC_NAME = "ARTIFACT_SPEC"
"""The one top-level name the spec is assigned to in ``python_code``."""
_NOT_AN_ARTIFACT = "it is not a precompile artifact (python_code from precompile())"
_FIRST: SchemaVersion = (1, 0)


def to_literal(spec: ArtifactSpec) -> dict[str, Any]:
    """The spec as ``ARTIFACT_SPEC`` holds it; each further variant without the fields every
    variant shares."""
    literal = _record_literal(dataclasses.replace(spec, variants=()))
    if spec.variants:
        literal["variants"] = tuple(
            {k: v for k, v in to_literal(variant).items() if k not in ArtifactSpec.SHARED}
            for variant in spec.variants
        )
    return literal


def _record_literal(record: Any) -> dict[str, Any]:
    literal = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue  # a reader fills in the default
        if dataclasses.is_dataclass(value):
            value = _record_literal(value)
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            value = tuple(_record_literal(item) for item in value)
        literal[field.name] = value
    return literal


@dataclass(frozen=True)
class SpecSource:
    """The spec as ``python_code`` holds it, and whether a run of its records is folded (a
    driver reading it must unfold them: ``driver.folds``)."""

    text: str
    folded: bool


def spec_source(spec: ArtifactSpec, notes: Mapping[str, str] | None = None) -> SpecSource:
    """``ARTIFACT_SPEC = {...}``: the assignment written into ``python_code``, one field a
    line and one record a line (wrapped), each ``notes[field]`` as a comment above it, each
    run of alike records (a deep model's blocks) once with its steps. Each further variant
    is a dict laid out the same way inside ``variants``."""
    body = _field_lines(to_literal(spec), "    ", notes or {})
    text = "\n".join([f"{SPEC_NAME} = {{", *body, "}"]) + "\n"
    return SpecSource(text, any(line.lstrip().startswith(_FOLD_OPENING) for line in body))


def from_literal(literal: Any) -> ArtifactSpec:
    """Rebuild the typed spec, refusing a literal of an unreadable version or with fields its
    version does not have."""
    if not isinstance(literal, dict):
        raise PrecompileError(f"python_code's {SPEC_NAME} is not a dict; {_NOT_AN_ARTIFACT}.")
    version = literal_version(literal.get("schema_version"))
    fields = _known_fields(ArtifactSpec, literal, version, _FIRST)
    fields["schema_version"] = version
    by_name = {f.name: f for f in dataclasses.fields(ArtifactSpec)}
    for name, record in ArtifactSpec.RECORDS.items():
        if name not in fields:
            continue
        came = field_since(by_name[name]) or _FIRST
        value = fields[name]
        if name in ArtifactSpec.SINGLE:
            fields[name] = None if value is None else _record(record, value, version, came)
            continue
        if not isinstance(value, list | tuple):
            raise PrecompileError(
                f"python_code's {SPEC_NAME} holds {type(value).__name__} for {name!r} where "
                f"a list of {record.__name__} records belongs; {_NOT_AN_ARTIFACT}."
            )
        fields[name] = tuple(_record(record, item, version, came) for item in _listed(value))
    variants = fields.get("variants", ())
    if not isinstance(variants, list | tuple):
        raise PrecompileError(
            f"python_code's {SPEC_NAME} holds {type(variants).__name__} for 'variants' "
            f"where a list of variant dicts belongs; {_NOT_AN_ARTIFACT}."
        )
    fields["variants"] = tuple(_variant(literal, v) for v in variants)
    return ArtifactSpec(**fields)


def _listed(items: list[Any] | tuple[Any, ...]) -> tuple[Any, ...]:
    """A list field's records, each run written once listed again."""
    try:
        return unfolded(items)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PrecompileError(
            f"python_code's {SPEC_NAME} holds a malformed run of records; {_NOT_AN_ARTIFACT}."
        ) from e


def _variant(top: dict[str, Any], literal: Any) -> ArtifactSpec:
    if not isinstance(literal, dict) or literal.keys() & {*ArtifactSpec.SHARED, "variants"}:
        raise PrecompileError(
            f"python_code's {SPEC_NAME} holds a malformed variant (not a dict, or one with "
            f"fields only the top level holds); {_NOT_AN_ARTIFACT}."
        )
    return from_literal({**{k: top[k] for k in ArtifactSpec.SHARED if k in top}, **literal})


@functools.cache
def _required(cls: type) -> frozenset[str]:
    """The fields of a record class without a default."""
    return frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )


def _known_fields(
    cls: type, literal: Any, version: SchemaVersion, came: SchemaVersion
) -> dict[str, Any]:
    """``literal``'s fields, checked against ``version``: none missing that has no default,
    none that came later, none unknown (those of a newer minor of this major are ignored)."""
    if not isinstance(literal, dict):
        raise PrecompileError(
            f"python_code's {SPEC_NAME} holds a malformed {cls.__name__} record; "
            f"{_NOT_AN_ARTIFACT}."
        )
    versions, required = fields_since(cls, came), _required(cls)
    unknown = literal.keys() - versions.keys()
    newer_minor = version[0] == SCHEMA_VERSION[0] and version > SCHEMA_VERSION
    odd = sorted((required - literal.keys()) | (set() if newer_minor else unknown))
    if odd:
        raise PrecompileError(
            f"python_code's {SPEC_NAME} has a {cls.__name__} record with missing or unknown "
            f"fields {odd}; {_NOT_AN_ARTIFACT}."
        )
    later = sorted(n for n in literal.keys() - unknown if versions[n] > version)
    if later:
        raise PrecompileError(
            f"python_code's {SPEC_NAME} claims schema version {shown_version(version)} but its "
            f"{cls.__name__} record has fields of later versions: "
            + ", ".join(f"{n} ({shown_version(versions[n])})" for n in later)
            + f"; {_NOT_AN_ARTIFACT}."
        )
    return {k: v for k, v in literal.items() if k not in unknown}


def _record(cls: type, literal: Any, version: SchemaVersion, came: SchemaVersion) -> Any:
    return cls(**_known_fields(cls, literal, version, came))


def _field_lines(literal: Mapping[str, Any], indent: str, notes: Mapping[str, str]) -> list[str]:
    lines = []
    for name, value in literal.items():
        if name in notes:
            lines.append(f"{indent}# {notes[name]}")
        if name == "variants" and value:
            lines.append(f"{indent}'variants': (")
            for variant in value:
                lines += [
                    f"{indent}    {{",
                    *_field_lines(variant, indent + "        ", {}),
                    f"{indent}    }},",
                ]
            lines.append(f"{indent}),")
        elif isinstance(value, tuple) and value and isinstance(value[0], dict):
            lines.append(f"{indent}{name!r}: (")
            for item in _folded(value):
                if is_fold(item):
                    lines += _fold_lines(item, indent + "    ")
                else:
                    lines.append(_wrapped(item, indent + "    ") + ",")
            lines.append(f"{indent}),")
        else:
            lines.append(_wrapped(value, indent, f"{name!r}: ") + ",")
    return lines


_FOLD_OPENING = "{'repeat': "


def _folded(records: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """``records`` with each run of alike ones as one fold (``driver.folds``), where the fold
    lists them again exactly."""
    out: list[dict[str, Any]] = []
    at = 0
    for run in find_runs([_pattern(r) for r in records]):
        first = records[run.start : run.start + run.period]
        steps = []
        for j, record in enumerate(first):
            numbers = iter(run.steps[j])
            for field, count in _number_counts(record):
                field_steps = tuple(next(numbers) for _ in range(count))
                if any(field_steps):
                    steps.append((j, field, field_steps))
        fold = {"repeat": run.repeats, "steps": tuple(steps), "records": first}
        if list(unfolded([fold])) != list(records[run.start : run.end]):
            continue
        out += [*records[at : run.start], fold]
        at = run.end
    return [*out, *records[at:]]


def _number_counts(record: dict[str, Any]) -> list[tuple[str, int]]:
    """Each field of ``record`` that holds numbers that may step, with how many."""
    counts = []
    for field, value in record.items():
        if isinstance(value, str):
            counts.append((field, len(stepping_digits(value))))
        elif isinstance(value, int) and not isinstance(value, bool):
            counts.append((field, 1))
    return counts


def _pattern(record: dict[str, Any]) -> Pattern | None:
    """``record`` as its shape and numbers; None where a value is not hashable."""
    shape: list[Any] = []
    numbers: list[int] = []
    for field, value in record.items():
        if isinstance(value, str):
            runs = stepping_digits(value)
            cuts = [0, *(p for m in runs for p in (m.start(), m.end())), len(value)]
            shape.append(
                (
                    field,
                    "str",
                    tuple(value[a:b] for a, b in zip(cuts[::2], cuts[1::2], strict=True)),
                )
            )
            numbers += [int(m[0]) for m in runs]
        elif isinstance(value, int) and not isinstance(value, bool):
            shape.append((field, "int"))
            numbers.append(value)
        else:
            shape.append((field, "value", value))
    try:
        hash(tuple(shape))
    except TypeError:
        return None
    return Pattern(tuple(shape), tuple(numbers))


def _fold_lines(fold: dict[str, Any], indent: str) -> list[str]:
    """A fold as ``_field_lines`` lays out a record list: its count and steps, then its
    records one a line."""
    return [
        f"{indent}{_FOLD_OPENING}{fold['repeat']},",
        _wrapped(fold["steps"], indent + " ", "'steps': ") + ",",
        f"{indent} 'records': (",
        *(_wrapped(record, indent + "     ") + "," for record in fold["records"]),
        f"{indent} )}},",
    ]


def _wrapped(value: Any, indent: str, prefix: str = "") -> str:
    """``value``'s repr; a dict's items filled onto lines of at most 100 characters."""
    if not isinstance(value, dict):
        text = pprint.pformat(value, width=100 - len(indent + prefix), compact=True)
        return indent + prefix + text.replace("\n", "\n" + indent + " " * len(prefix))
    lines, line = [], indent + prefix + "{"
    for i, (key, item) in enumerate(value.items()):
        text = f"{key!r}: {item!r}" + ("}" if i == len(value) - 1 else ",")
        if len(indent + prefix) + 1 + len(text) > 100:  # a long item gets lines of its own
            lines.append(line)
            inner = indent + " " * len(prefix) + " "
            text = _wrapped(item, inner, f"{key!r}: ").lstrip() + text[len(f"{key!r}: {item!r}") :]
            line = inner + text
            continue
        if len(line) + 1 + len(text) > 100 and not line.endswith("{"):
            lines.append(line)
            line = indent + " " * len(prefix) + " " + text
        else:
            line += ("" if line.endswith("{") else " ") + text
    return "\n".join([*lines, line if value else line + "}"])


def parse_spec(python_code: str) -> ArtifactSpec:
    """Read ``python_code``'s spec by parsing only; nothing in it is executed."""
    return from_literal(spec_literal(python_code))


def spec_literal(python_code: str) -> dict[str, Any]:
    """The ``ARTIFACT_SPEC`` literal of ``python_code``, evaluated with ``ast.literal_eval``."""
    if not isinstance(python_code, str):
        raise PrecompileError(
            f"python_code must be a str, got {type(python_code).__name__}; {_NOT_AN_ARTIFACT}."
        )
    # Fast path: parse the assignment alone; the kernels' source makes the whole file slow.
    start = python_code.find(f"\n{SPEC_NAME} = ")
    if start >= 0:
        end = python_code.find("\n\n", start + 1)
        try:
            return _assigned_literal(python_code[start + 1 : end if end > 0 else None])
        except PrecompileError:
            pass  # not laid out as rendered: read the whole module below
    return _assigned_literal(python_code)


def _assigned_literal(source: str) -> Any:
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise PrecompileError(
            f"python_code does not parse (line {e.lineno}: {e.msg}); {_NOT_AN_ARTIFACT}."
        ) from e
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == SPEC_NAME
        ):
            try:
                return ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError) as e:
                raise PrecompileError(
                    f"python_code's {SPEC_NAME} is not a literal; {_NOT_AN_ARTIFACT}."
                ) from e
    raise PrecompileError(f"python_code has no {SPEC_NAME}; {_NOT_AN_ARTIFACT}.")
