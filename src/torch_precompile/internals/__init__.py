"""The one place that knows torch's internals; per-release differences live here.

Every private torch name the package uses is reached through this package, so a new torch
release is a local change. This module holds what ``load`` needs and stays cheap to import;
``tracing`` holds what capture needs; ``inductor`` what lowering needs, including every
rewrite of code that torch generates (each asserts that it matched where expected);
``vector_units`` the CPU's vector units as Inductor probes them;
``generation`` the few private names of transformers that ``for_generate`` relies on. The
driver and the kernel stand-ins, which ship inside artifacts, cannot import this package and
keep their own few touches of torch, listed in their docstrings.
"""

from __future__ import annotations

import os
from typing import cast

import torch
import torch.utils._pytree as pytree

from torch_precompile.spec import TorchBuild

__all__ = ["enable_prebuilt_kernel_imports", "pytree", "storage_id", "torch_build"]


def torch_build() -> TorchBuild:
    """The running torch: its release and the commit it was built from."""
    return TorchBuild(version=str(torch.__version__), git=str(torch.version.git_version))


def storage_id(tensor: torch.Tensor) -> int:
    """An identity for ``tensor``'s storage, shared by all views of it."""
    return cast(int, tensor.untyped_storage()._cdata)


def enable_prebuilt_kernel_imports() -> None:
    """Let kernel objects Inductor built be imported directly as extension modules.

    They read a tensor's data pointer through a function whose address Inductor passes in
    this environment variable.
    """
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
        # Missing from torch's stubs.
        torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr  # type: ignore[attr-defined]
    )
