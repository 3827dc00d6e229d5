"""The artifact spec: one typed, versioned description of an artifact's calling convention.

Capture builds an ``ArtifactSpec`` (``records``); the artifact carries it as ONE literal
(``ARTIFACT_SPEC``, written and read by ``literal``); ``load``, ``inspect`` and the tests read
it back with ``parse_spec`` without executing anything; the driver inside the artifact reads
the same literal. ``versions`` says which layout a literal has and what each version changed
(the policy: ``docs/SPEC_VERSIONS.md``); ``compat`` what older ones lack; ``layout`` how the
spec maps onto the graph's flat inputs. ``docs/spec-schema.txt`` lists every record's fields
(``python -m torch_precompile.spec_listing`` writes it; a test holds it to the records).
"""

from torch_precompile.spec.layout import with_strides
from torch_precompile.spec.literal import (
    SPEC_NAME,
    from_literal,
    parse_spec,
    spec_literal,
    spec_source,
    to_literal,
)
from torch_precompile.spec.records import (
    Ambient,
    Argument,
    ArtifactSpec,
    Autograd,
    DataParallel,
    DistributedTensor,
    DynamicDim,
    EncodedValue,
    FullyShardedGroup,
    GuardNote,
    HookSet,
    InnerTensor,
    InputLeaf,
    KernelObject,
    Layout,
    Mesh,
    ModelTensor,
    Optimizer,
    OptimizerState,
    OutputAlias,
    ParamGroup,
    ReadValue,
    Shape,
    SizeRelation,
    Submodule,
    TorchBuild,
    ValueGuard,
    WrappedTensor,
)
from torch_precompile.spec.versions import (
    OLDEST_READABLE_SCHEMA,
    SCHEMA_HISTORY,
    SCHEMA_VERSION,
    SchemaChange,
    SchemaVersion,
    shown_version,
)

__all__ = [
    "OLDEST_READABLE_SCHEMA",
    "SCHEMA_HISTORY",
    "SCHEMA_VERSION",
    "SPEC_NAME",
    "Ambient",
    "Argument",
    "ArtifactSpec",
    "Autograd",
    "DataParallel",
    "DistributedTensor",
    "DynamicDim",
    "EncodedValue",
    "FullyShardedGroup",
    "GuardNote",
    "HookSet",
    "InnerTensor",
    "InputLeaf",
    "KernelObject",
    "Layout",
    "Mesh",
    "ModelTensor",
    "Optimizer",
    "OptimizerState",
    "OutputAlias",
    "ParamGroup",
    "ReadValue",
    "SchemaChange",
    "SchemaVersion",
    "Shape",
    "SizeRelation",
    "Submodule",
    "TorchBuild",
    "ValueGuard",
    "WrappedTensor",
    "from_literal",
    "parse_spec",
    "shown_version",
    "spec_literal",
    "spec_source",
    "to_literal",
    "with_strides",
]
