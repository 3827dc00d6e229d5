"""What ``load`` does with a pair, decided by the very functions ``load`` decides with.

``inspect``, ``verify`` and the demo report this judgement, so what they say a load does is
what it does: refuse the pair, run it building some objects from the source, or run it from
the cache alone. Nothing of the pair is executed: the source is parsed and the cache read as
data (a compiled module is unmarshalled to check its seal, never run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch_precompile.artifact import bytecode, envelope, signature
from torch_precompile.artifact.kernel_payload import (
    PayloadExamination,
    count_objects,
    examine_payload,
    object_kind,
)
from torch_precompile.errors import PrecompileError
from torch_precompile.spec import ArtifactSpec, compat, parse_spec, shown_version

# What a finding means for a load and for ``verify``.
OK = "ok"  # as it should be
NOTE = "note"  # nothing is wrong with the pair; a load adapts (builds or compiles here)
DEFECT = "defect"  # the pair is damaged or incomplete; a load warns and builds from the source
REFUSAL = "refusal"  # a load raises PrecompileError and runs nothing
_BUILD = " (this needs a C++ compiler)"


@dataclass(frozen=True)
class Finding:
    """One fact about the pair, worded as what a load does about it."""

    effect: str  # OK, NOTE, DEFECT or REFUSAL
    text: str


@dataclass(frozen=True)
class Judgement:
    """Everything a load of the pair decides, before it executes anything."""

    spec: ArtifactSpec
    findings: tuple[Finding, ...]  # in the order a load meets them
    signed: bool  # the cache carries a signature
    signature_checked: bool  # a key was given and the signature checked against it
    payload: PayloadExamination | None  # the kernel payload, where the cache holds one
    module: str | None  # what a load does with the compiled module (None: not considered)

    @property
    def refusal(self) -> str | None:
        """The error a load raises (the first it meets), or None when it runs."""
        return next((f.text for f in self.findings if f.effect == REFUSAL), None)

    @property
    def prebuilt(self) -> list[str]:
        """The kind (``object_kind``) of each object a load here maps from the cache."""
        if self.payload is None or self.refusal is not None:
            return []
        return [object_kind(entry) for entry in self.payload.mapped.values()]

    @property
    def to_build(self) -> int | None:
        """How many objects the source names that a load here builds (None: unknown, for a
        schema before 3, whose source names none)."""
        if self.spec.backend != "inductor":
            return 0
        if not compat.names_kernels(self.spec):
            return None
        return len(self.spec.kernels) - len(self.prebuilt)

    @property
    def outcome(self) -> str:
        """What a load here does, in one line."""
        if self.refusal is not None:
            return f"refuses the pair, running nothing: {self.refusal}"
        if self.spec.backend != "inductor":
            return "runs (the eager graph: nothing to build)"
        mapped = f"maps {count_objects(self.prebuilt)} from the cache"
        if self.to_build == 0:
            return f"runs from the cache: {mapped}, builds nothing, runs no compiler"
        if self.to_build is None and not self.prebuilt:
            return f"runs, but builds every kernel from the source{_BUILD}"
        if self.to_build is None:
            return (
                f"runs: {mapped}; its source (schema "
                f"{shown_version(self.spec.schema_version)}) names no objects, so any other it "
                f"needs is built on first use{_BUILD}"
            )
        built = f"{self.to_build} object{'' if self.to_build == 1 else 's'}"
        return f"runs, but builds {built} from the source{_BUILD}" + (
            f"; {mapped}" if self.prebuilt else ""
        )


def pins(spec: ArtifactSpec) -> dict[str, str] | None:
    """The kernel digests the source names; None before schema 3, which named none."""
    return compat.kernel_pins(spec)


def judge(
    python_code: str,
    cache: bytes | None,
    key: bytes | None = None,
    spec: ArtifactSpec | None = None,
) -> Judgement:
    """How ``load(python_code, cache, verify_key=key)`` treats the pair, in load's order:
    signature, envelope, compiled module, torch build, pairing, kernel objects (``spec``: the
    source's, when already parsed)."""
    spec = spec if spec is not None else parse_spec(python_code)
    signed = cache is not None and signature.split(bytes(cache))[0] is not None
    findings = _signature(python_code, cache, key)
    payload, module = None, None
    unusable: list[str] = []  # why the envelope is unusable, worded by envelope.read
    contents = envelope.read(cache, unusable)
    if cache is None:
        builds = f", building every kernel{_BUILD}" if spec.backend == "inductor" else ""
        findings.append(
            Finding(DEFECT, f"there is no cache: a load runs from the source alone{builds}")
        )
    findings.extend(Finding(DEFECT, why) for why in unusable)
    if contents is not None and contents.belongs_to(python_code):
        finding, module = _module(python_code, contents.compiled)
        findings.append(finding)
    findings.extend(_torch_build(spec))
    if contents is not None:
        try:
            envelope.check_pairing(contents, spec.backend, python_code)
            findings.append(Finding(OK, "the cache belongs to this source"))
        except PrecompileError as e:
            findings.append(Finding(REFUSAL, str(e)))
        else:
            payload = _kernels(spec, contents.acceleration, findings)
    return Judgement(spec, tuple(findings), signed, key is not None, payload, module)


def _signature(python_code: str, cache: bytes | None, key: bytes | None) -> list[Finding]:
    """With a key, load's signature check; without one a load checks nothing (``signed`` and
    ``signature_checked`` say so)."""
    if key is None:
        return []
    try:
        signature.verify(key, python_code, cache)
    except PrecompileError as e:
        return [Finding(REFUSAL, str(e))]
    return [Finding(OK, "signature valid for the given key")]


def _torch_build(spec: ArtifactSpec) -> list[Finding]:
    # load's own check; runtime imports this package, so it is imported when needed.
    from torch_precompile.runtime import check_torch_build

    try:
        check_torch_build(spec)
    except PrecompileError as e:
        return [Finding(REFUSAL, str(e))]
    return []


def _module(python_code: str, entry: Any) -> tuple[Finding, str]:
    """What a load does with the cache's compiled module (``bytecode.unseal`` decides): the
    finding, and the module's state in a few words."""
    if entry is None:
        state, effect = "absent (a load compiles the source)", NOTE
    elif not bytecode.is_sealed(python_code):
        state, effect = "not used (the source has no seal line; a load compiles it)", NOTE
    elif not isinstance(entry, dict) or entry.get("magic") != bytecode.MAGIC:
        state, effect = "not used here (made by another Python; a load compiles the source)", NOTE
    else:
        try:
            sealed = bytecode.unseal(python_code, entry)
        except PrecompileError as e:
            return Finding(REFUSAL, str(e)), "refused (the source's seal does not name it)"
        state, effect = (
            ("damaged (a load warns and compiles the source)", DEFECT)
            if sealed is None
            else ("used (sealed by the source, for this Python)", OK)
        )
    return Finding(effect, f"compiled module: {state}"), state


def _kernels(
    spec: ArtifactSpec, acceleration: bytes | None, findings: list[Finding]
) -> PayloadExamination | None:
    """Append what a load does with each kernel object; the examination, where readable."""
    if spec.backend != "inductor":
        return None
    if acceleration is None:
        findings.append(
            Finding(
                DEFECT,
                "the cache holds no kernel objects: a load builds "
                f"every kernel from the source{_BUILD}",
            )
        )
        return None
    found = examine_payload(acceleration, pins(spec))
    if found.unreadable is not None:
        findings.append(
            Finding(
                DEFECT,
                f"the kernel payload is unreadable ({found.unreadable})"
                f": a load builds every kernel from the source{_BUILD}",
            )
        )
        return found
    for key, why in found.skipped.items():
        kind = object_kind(found.entries.get(key, {}))
        findings.append(
            Finding(
                DEFECT,
                f"{kind} {key[:12]}… is unusable ({why}): a load warns, "
                f"skips it and builds it from the source{_BUILD}",
            )
        )
    if found.refusal is not None:
        findings.append(Finding(REFUSAL, found.refusal))
    if found.missing:
        findings.append(
            Finding(
                DEFECT,
                f"the cache lacks {len(found.missing)} object(s) the "
                "source names: a load warns and builds them from the "
                f"source{_BUILD}",
            )
        )
    if not (found.skipped or found.refusal or found.missing):
        intact = count_objects(object_kind(e) for e in found.entries.values())
        findings.append(Finding(OK, f"{intact} intact, each named by the source"))
    findings.append(
        Finding(OK, "built for this machine")
        if found.mismatch is None
        else Finding(
            NOTE,
            f"built elsewhere ({found.mismatch}): a load here builds "
            f"every kernel from the source{_BUILD}",
        )
    )
    return found
