"""What artifacts of older schema versions lack, in one place, each difference dated.

The literal reader (``literal``) already fills a field an older version lacks with its
default: no DTensor records before 2.0 (2026-11-30), no optimizers before 4.0, no subclasses
before 5.0, no data parallelism before 6.0, no variants before 7.0, no facts beyond tensors
before 8.0 (2026-12-03), no autograd record before 9.0 (2026-12-04: results carry no history,
as those versions ran), no wrapper kinds before 10.0 (2026-12-04: ``inspect`` reads the
comment section 2 carries). The differences below change what a reader does.
"""

from __future__ import annotations

from torch_precompile.spec.records import ArtifactSpec
from torch_precompile.spec.versions import SchemaVersion

KERNELS_NAMED: SchemaVersion = (3, 0)
"""2026-12-01: from 3.0 the source names every kernel object its cache may hold, with its
SHA-256. Before, the cache was checked against its own checksums only."""


def names_kernels(spec: ArtifactSpec) -> bool:
    return spec.schema_version >= KERNELS_NAMED


def kernel_pins(spec: ArtifactSpec) -> dict[str, str] | None:
    """The kernel digests the source names; None for a source that names none."""
    return {k.key: k.sha256 for k in spec.kernels} if names_kernels(spec) else None


def ends_with_plan(spec: ArtifactSpec) -> bool:
    """2026-12-01: before 3.0 an artifact's last lines bound ``PLAN`` (then ``forward``);
    a load checks both are there to tell a whole file from a cut one."""
    return not names_kernels(spec)
