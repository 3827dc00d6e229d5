"""Schema versions of the artifact spec: which layout a literal has, and what each changed.

A version is ``(major, minor)``. A minor version adds fields that a reader of an older minor
of the same major may ignore (the artifact's own driver, which always matches its spec, is
what acts on them); a major version changes what older readers would misread. Every field
names the version it appeared in (``since``), so a reader can check a literal's fields
against the version it claims. Versions 1 to 9 were written as one integer, read as
``(n, 0)``. The policy is in ``docs/SPEC_VERSIONS.md``; reading of older layouts is in
``compat``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from torch_precompile.errors import PrecompileError

SchemaVersion = tuple[int, int]


@dataclass(frozen=True)
class SchemaChange:
    """One schema version: when it came and what it changed."""

    version: SchemaVersion
    date: str
    change: str


SCHEMA_HISTORY = (
    SchemaChange(
        (1, 0),
        "2026-11-30",
        "First typed spec, replacing 28 separate metadata literals: "
        "args, model (one record per parameter or buffer name), submodules, inputs "
        "(one record per leaf), value_guards, dynamic_dims, size_relations, "
        "output_aliases, backend, torch.",
    ),
    SchemaChange(
        (2, 0),
        "2026-11-30",
        "DTensors: meshes (device type, shape, dim names, ranks, "
        "the graph's group name per mesh dim, the capturing coordinate when the graph "
        "depends on it) and distributed (per DTensor flat input or result leaf).",
    ),
    SchemaChange(
        (3, 0),
        "2026-12-01",
        "kernels: the SHA-256 of every built kernel object, by "
        "kernel key, so the source names the exact objects its cache may hold.",
    ),
    SchemaChange(
        (4, 0),
        "2026-12-01",
        "Optimizers as arguments: Argument.is_optimizer; optimizers "
        "(class per optimizer argument, whether fn clears its gradients first), "
        "param_groups (parameters by name, options read at call time, baked options "
        "and their values, whether a fresh state may start from zeros) and "
        "optimizer_state (one flat input per state tensor). Python values are encoded "
        "by kind (const, float, dtype, device, enum, frozen), never by repr.",
    ),
    SchemaChange(
        (5, 0),
        "2026-12-01",
        "Traceable tensor subclasses: wrapped (per subclass flat "
        "input or result leaf: class, flatten context, outer shape and strides) and "
        "wrapped_inner (per inner tensor: attribute, shape, dtype, device, strides). "
        "Encoded values gain the kinds none, list, tuple, dict, size and dataclass "
        "(in flatten contexts).",
    ),
    SchemaChange(
        (6, 0),
        "2026-12-01",
        "Data parallelism: data_parallel (per DistributedDataParallel "
        "model argument: the graph's name for its process group, the world size its "
        "gradients are averaged over, whether they are (no_sync), and DDP's "
        "forward-sync flag before and after the call when it broadcasts buffers) and "
        "fully_sharded (per FSDP2 param group: its module, whether it reshards after "
        "forward, its mixed-precision dtypes).",
    ),
    SchemaChange(
        (7, 0),
        "2026-12-02",
        "Variants: variants (the artifact's further variants, each "
        "a spec of its own less the fields all variants share: schema_version, "
        "backend, torch, args and kernels, which the top level holds for all). The top "
        "level is the first variant.",
    ),
    SchemaChange(
        (8, 0),
        "2026-12-03",
        "Facts the trace relied on beyond tensors: Submodule.cls "
        "(each module's class), Submodule.hooks and ModelTensor.hooks (hooks by kind "
        "and name), "
        "global_hooks (process-wide module hooks), read_values (Python values the "
        "traced code read: module attributes and module globals), ambient (autocast, "
        "default dtype, deterministic algorithms and active modes at capture), "
        "mutated (the flat inputs the graph writes) and seed (a seed fn sets before "
        "its first random draw, set again before every call).",
    ),
    SchemaChange(
        (9, 0),
        "2026-12-04",
        "Differentiable results: autograd (for an artifact whose fn "
        "runs no backward: the flat inputs its backward graph gives gradients, the "
        "result leaves with history and their tangents' layouts, what the forward "
        "saves for backward, or why results carry no history).",
    ),
    SchemaChange(
        (10, 0),
        "2026-12-04",
        "Versions become (major, minor): a minor adds fields older readers of the same major "
        "may ignore; a major breaks them. Fields and record fields at their defaults are left "
        "out of the literal. wrappers: for the inductor backend, the wrapper that runs each of "
        "a variant's graphs ('cpp' or 'python').",
    ),
    SchemaChange(
        (10, 1),
        "2026-12-04",
        "Submodule.forward: the forward a module runs where it is not its class's own (one "
        "set on the instance, or a class's patched in). A global read's path may go on into "
        "attributes of the user's modules and objects (('config', 'SCALE')).",
    ),
    SchemaChange(
        (10, 2),
        "2026-12-05",
        "Ambient.settings: the torch settings fn's Python read (torch.is_grad_enabled(), the "
        "default dtype, the number of threads, ...), each with the value it gave and where. "
        "ModelTensor.old_grad: whether fn reads the .grad a call finds, or drops it first. "
        "Read values gain the encoded kinds set and frozenset (items sorted by repr), numpy (a "
        "NumPy scalar: its type and its .item()) and ndarray (a NumPy array of at most 256 "
        "elements: dtype, shape, elements in C order); a named tuple is encoded as frozen; a "
        "float is compared with its sign. The kind absent: an attribute the module lacked "
        "(hasattr); a read path may start at '__class__' (type(self).factor) and a global read "
        "may go on into a class of the user's (('Settings', 'SCALE')). The kind code: a lambda "
        "or nested function, by qualified name and a digest of its code and closure values.",
    ),
    SchemaChange(
        (10, 3),
        "2026-12-05",
        "Read values gain the encoded kind object: an object of the user's held in a list, "
        "tuple or dict that was read, by its class's qualified name and the plain values it "
        "holds, two objects deep (('object', ('pkg.Spec', (('s', ('const', 2.0)),)))). A read "
        "may name an attribute of a submodule that the code read through it (self.block.scale), "
        "through an index or off a loop variable (layer.scale in for layer in self.layers).",
    ),
    SchemaChange(
        (10, 4),
        "2026-12-05",
        "InputLeaf.read: the properties fn's Python read of an input tensor (its strides, "
        "through x.stride() or x.is_contiguous(); x.storage_offset(); x.is_inference(); "
        "x.is_neg(); x.is_conj()), each "
        "with the value it had and the line that read it.",
    ),
    SchemaChange(
        (10, 5),
        "2026-12-05",
        "guards (tracer='dynamo'): one GuardNote per guard Dynamo put on what fn's Python read "
        "(its kind, the place as Dynamo writes it, and whether the artifact checks it, cannot "
        "see it differ, or dropped it, with the check or the reason). A global read's path may "
        "step into a function's closure: '__closure__', then the name of the closure variable "
        "(('step', '__closure__', 'scale'), then attributes off its value).",
    ),
    SchemaChange(
        (10, 6),
        "2026-12-06",
        "autograd_for_inputs: an Autograd record for calls where a floating-point input "
        "tensor requires grad that did not at capture (an activation handed on by a "
        "pipeline schedule, a GAN's generated sample); its forward and backward graphs give "
        "gradients for those inputs too. autograd keeps serving calls where none does.",
    ),
    SchemaChange(
        (11, 0),
        "2026-12-06",
        "Runs of alike records: a list field may hold, in place of a run of records alike but "
        "for numbers that step (the tensors, submodules and reads of a deep model's blocks), "
        "one dict {'repeat': n, 'steps': ((j, field, steps), ...), 'records': (...)}: the "
        "run's first group of records, and for each field that steps, its steps (one per int, "
        "or per run of digits of a str). Readers of 10.x would take the dict for a record.",
    ),
)
SCHEMA_VERSION: SchemaVersion = SCHEMA_HISTORY[-1].version
"""The spec layout this version writes."""
OLDEST_READABLE_SCHEMA: SchemaVersion = (1, 0)
"""The oldest spec layout this version still reads (the window is inclusive)."""
_SINCE = "since"


def since(major: int, minor: int = 0) -> dict[str, SchemaVersion]:
    """Field metadata: the schema version the field appeared in (default: version 1.0, or
    that of the spec field holding its record)."""
    return {_SINCE: (major, minor)}


def field_since(field: dataclasses.Field[Any]) -> SchemaVersion | None:
    """The version a field says it appeared in, if it says."""
    found: SchemaVersion | None = field.metadata.get(_SINCE)
    return found


@functools.cache
def fields_since(cls: type, came: SchemaVersion = (1, 0)) -> dict[str, SchemaVersion]:
    """Each field of a record class with the version it appeared in; a field that does not
    say came with its record, in ``came``."""
    return {f.name: max(field_since(f) or came, came) for f in dataclasses.fields(cls)}


def shown_version(version: SchemaVersion) -> str:
    return f"{version[0]}.{version[1]}"


def literal_version(value: Any) -> SchemaVersion:
    """The version a literal's ``schema_version`` holds, refused where this package cannot read
    it (an older major below the window asks for a rebuild, a newer one for an upgrade)."""
    version: SchemaVersion | None = None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 9:
        version = (value, 0)  # versions 1 to 9 were one integer
    elif (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        and value[0] >= 10
    ):
        version = (value[0], value[1])
    if version is not None and OLDEST_READABLE_SCHEMA <= version < (SCHEMA_VERSION[0] + 1, 0):
        return version
    readable = f"{shown_version(OLDEST_READABLE_SCHEMA)} to {SCHEMA_VERSION[0]}.x"
    newer = version is not None and version > SCHEMA_VERSION
    raise PrecompileError(
        f"python_code has artifact spec schema version {_shown_literal(value)}; this "
        f"torch-precompile reads schema versions {readable}. "
        + ("Upgrade torch-precompile to load it, or precompile" if newer else "Precompile")
        + " it again with this version."
    )


def _shown_literal(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return shown_version(value)
    return repr(value)
