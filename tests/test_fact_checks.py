"""Every fact capture records is read where a call is checked: a spec field that no shipped
driver module reads would be a fact recorded and then forgotten."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pkgutil

import torch_precompile.shipped.driver as driver_package
from torch_precompile.spec import ArtifactSpec

# Fields read outside the per-call driver, with where and why.
READ_ELSEWHERE = {
    "ArtifactSpec.schema_version": "load refuses an unreadable schema before executing",
    "ArtifactSpec.torch": "load refuses another torch build before executing",
    "TorchBuild.version": "load compares it with the running torch",
    "TorchBuild.git": "load compares it with the running torch",
    "ArtifactSpec.kernels": "load checks each cached kernel object against its digest",
    "KernelObject.key": "load finds each kernel object by it",
    "KernelObject.sha256": "load checks each kernel object against it",
    "ArtifactSpec.backend": "load pairs the cache's backend with it",
    "ArtifactSpec.variants": "the variants part reads each variant's literal by key",
    "ArtifactSpec.output_aliases": "the lowering builds results that view inputs from it",
    "OutputAlias.output": "the lowering builds results that view inputs from it",
    "OutputAlias.source": "the lowering builds results that view inputs from it",
    "OutputAlias.offset": "the lowering builds results that view inputs from it",
    "ParamGroup.call_time": "names the options the optimizer part reads at every call (lr)",
    "FullyShardedGroup.reshard_after_forward": "memory only: either way the step computes "
    "the same values",
    "Autograd.saved": "a description for inspect; the backward graph takes what the forward "
    "graph returns",
    "ArtifactSpec.wrappers": "a description for inspect; each graph's source is its wrapper",
    # The dynamo tracer's guard report: each guard it kept is a check recorded as another
    # fact (a read value, a hook set, ...); the report says which, for inspect.
    "ArtifactSpec.guards": "the guard report, for inspect and require_all_guards",
    "GuardNote.kind": "the guard report, for inspect",
    "GuardNote.reads": "the guard report, for inspect",
    "GuardNote.outcome": "the guard report, for inspect and require_all_guards",
    "GuardNote.by": "the guard report, for inspect",
    "GuardNote.count": "the guard report, for inspect",
}
# Recorded facts a call is not yet checked against, and what that leaves to the caller.
KNOWN_UNCHECKED = {
    "FullyShardedGroup.param_dtype": "a model sharded again with another MixedPrecisionPolicy "
    "after capture is not refused",
    "FullyShardedGroup.reduce_dtype": "as param_dtype",
}


def _driver_attribute_reads() -> set[str]:
    """Attribute names any shipped driver module reads (``record.cls``, ``spec.seed``)."""
    names: set[str] = set()
    for info in pkgutil.iter_modules(driver_package.__path__):
        module = __import__(f"torch_precompile.shipped.driver.{info.name}", fromlist=["_"])
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
    return names


def test_every_recorded_fact_is_read_by_the_driver() -> None:
    read = _driver_attribute_reads()
    unread = [
        f"{cls.__name__}.{field.name}"
        for cls in (ArtifactSpec, *ArtifactSpec.RECORDS.values())
        for field in dataclasses.fields(cls)
        if field.name not in read
        and f"{cls.__name__}.{field.name}" not in READ_ELSEWHERE.keys() | KNOWN_UNCHECKED
    ]
    assert not unread, (
        f"capture records {unread}, which no per-call check reads: check it in the driver "
        "(and test that a call breaking it is refused), or stop recording it."
    )


def test_the_check_fails_for_a_fact_nobody_reads(monkeypatch) -> None:
    """The test above would catch a new field: add one the driver never reads."""

    @dataclasses.dataclass(frozen=True)
    class Extra:
        forgotten_fact_xyz: int = 0

    monkeypatch.setitem(ArtifactSpec.RECORDS, "extra", Extra)
    try:
        test_every_recorded_fact_is_read_by_the_driver()
    except AssertionError as error:
        assert "Extra.forgotten_fact_xyz" in str(error)
    else:
        raise AssertionError("an unread field went unnoticed")
