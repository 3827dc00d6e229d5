"""Build time: collect every C++ kernel Inductor built for a wrapper into the cache payload."""

from __future__ import annotations

import ast
import hashlib
import io
from typing import Any

import torch

from torch_precompile.artifact.kernel_payload import PAYLOAD_VERSION, machine_fingerprint
from torch_precompile.internals.inductor import built_kernel_object
from torch_precompile.kernel_loader import kernel_key


def cpp_kernel_calls(wrapper_source: str) -> list[tuple[list[str], str, dict[str, Any]]]:
    """The ``async_compile.cpp_pybinding(...)`` calls of a wrapper: (argtypes, source, options)."""
    calls = []
    for node in ast.walk(ast.parse(wrapper_source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "cpp_pybinding"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "async_compile"
        ):
            args = [ast.literal_eval(a) for a in node.args]
            options = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            calls.append((args[0], args[1], options))
    return calls


def collect_built_kernels(wrapper_source: str) -> bytes:
    """Package the shared objects of every C++ kernel in ``wrapper_source``."""
    kernels: dict[str, dict[str, Any]] = {}
    for argtypes, source, options in cpp_kernel_calls(wrapper_source):
        module, path = built_kernel_object(argtypes, source, options)
        data = path.read_bytes()
        kernels[kernel_key(argtypes, source, options)] = {
            "module": module,
            "object": data,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    payload = {"version": PAYLOAD_VERSION, "fingerprint": machine_fingerprint(),
               "kernels": kernels}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()
