"""The calling convention of one artifact: how a call's arguments map onto the graph's inputs.

Capture produces it; the artifact writes it as top-level literals (the one place it lives);
``load`` and the driver read it back from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# (kind, value) for a non-tensor input leaf: ("const", 3), ("float", "nan"),
# ("repr", ("torch.dtype", "torch.float16")).
EncodedValue = tuple[str, Any]
Shape = tuple[int | None, ...]


@dataclass(frozen=True)
class CallingConvention:
    """Everything the driver needs to check a call and map it onto ``call(flat_inputs)``.

    Flat graph inputs are the interned parameters, then the interned buffers, then the tensor
    leaves of the runtime inputs. Graph outputs are ``fn``'s result leaves, then one gradient
    per entry of ``grad_param_indices``, then one tensor per value guard (see
    ``capture.guards``) that must hold the recorded value. Per-leaf lists are aligned with
    ``user_input_names``; tensor-only fields hold None for a Python-value leaf and vice versa.
    ``dynamic_dims`` lists one (shape_id or "", [[leaf, dim], ...]) per dynamic size symbol;
    ``shape_relations`` are (Python expression over ``d``, the sizes in that order; readable
    form) that must hold at every call. ``input_strides`` (per flat input, set by a backend
    whose kernels assume a layout) lists the strides each call must present (or a
    memory-format name for a dynamic input), None where any layout will do.
    """

    backend: str
    num_positional_args: int
    arg_names: list[str]
    module_positions: list[int]
    param_names: list[str]
    param_shapes: list[tuple[int, ...]]
    param_dtypes: list[str]
    param_devices: list[str]
    param_requires_grad: list[bool]
    buffer_names: list[str]
    buffer_shapes: list[tuple[int, ...]]
    buffer_dtypes: list[str]
    buffer_devices: list[str]
    tied_names: dict[str, str]
    grad_param_indices: list[int]
    in_spec: str | None
    out_spec: str
    user_input_names: list[str]
    user_input_shapes: list[Shape | None]
    user_input_dtypes: list[str | None]
    user_input_devices: list[str | None]
    user_input_requires_grad: list[bool | None]
    user_input_bounds: list[dict[int, tuple[int | None, int | None]] | None]
    user_input_values: list[EncodedValue | None]
    value_guards: list[tuple[str, EncodedValue]]
    dynamic_dims: list[tuple[str, list[list[int]]]]
    shape_relations: list[tuple[str, str]]
    input_strides: list[tuple[int, ...] | str | None] | None = None

    def literals(self) -> dict[str, Any]:
        """The convention as ``{METADATA_NAME: literal value}``, in field order."""
        return {f.name.upper(): getattr(self, f.name) for f in dataclasses.fields(self)}


METADATA_NAMES: tuple[str, ...] = tuple(
    f.name.upper() for f in dataclasses.fields(CallingConvention)
)
