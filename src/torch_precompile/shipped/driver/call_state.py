"""The state a call is made in, as the artifact compares it with the capture's: autocast,
the default dtype, deterministic algorithms, active torch function and dispatch modes, and
grad mode where fn runs a backward. Shipped in every artifact."""

from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_precompile.shipped.driver.tensor_rules import (
    PrecompileError,
    dtype_named,
    qualified_name,
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The torch settings fn's Python may read and branch on, by the call that reads them: how to
# read each now, and how the spec holds the value it gives.
SETTINGS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "torch.is_grad_enabled": (torch.is_grad_enabled, bool),
    "torch.is_inference_mode_enabled": (torch.is_inference_mode_enabled, bool),
    "torch.get_default_dtype": (torch.get_default_dtype, _dtype_name),
    "torch.get_num_threads": (torch.get_num_threads, int),
    "torch.get_float32_matmul_precision": (torch.get_float32_matmul_precision, str),
}


class AmbientPlan:
    """Thread and process state the graph was specialized to: autocast, the default dtype
    (where fn built tensors from it), deterministic algorithms, active modes, and the torch
    settings fn's Python read (``settings``: the reading call, its value, where it was read)."""

    def __init__(
        self,
        recorded: bool = True,
        autocast: Sequence[Any] = (),
        default_dtype: str | None = None,
        deterministic: bool = False,
        modes: Sequence[str] = (),
        settings: Sequence[tuple[str, Any, str]] = (),
    ) -> None:
        self.recorded = recorded  # artifacts before ambient state was recorded check none
        self.autocast = tuple(autocast)
        self.default_dtype = dtype_named(default_dtype) if default_dtype else None
        self.deterministic = deterministic
        self.modes = tuple(modes)
        self.settings = tuple(
            (*SETTINGS[name], value, name, where) for name, value, where in settings
        )

    def check(self) -> None:
        """A few C calls when nothing differs; the full comparison names what does."""
        if not self.recorded:
            return
        if (
            (_ANY_AUTOCAST() or self.autocast)
            or _DETERMINISTIC() is not self.deterministic
            or _FUNCTION_MODES() + _DISPATCH_MODES() != len(self.modes)
            or (
                self.default_dtype is not None
                and torch.get_default_dtype() is not self.default_dtype
            )
        ):
            self._compare()
        for read, held, value, name, where in self.settings:
            if held(read()) != value:
                raise PrecompileError(
                    f"{name}() gives {held(read())!r} at this call, but gave {value!r} when fn "
                    f"read it at capture ({where}): the trace took fn's Python branch for that "
                    "value. Call it in the same setting, or precompile again in this one."
                )

    def _compare(self) -> None:
        now = ambient_now()
        for what, captured, current in (
            ("autocast", self.autocast, now[0]),
            ("the default dtype", self.default_dtype or now[1], now[1]),
            ("deterministic algorithms", self.deterministic, now[2]),
            ("active torch function and dispatch modes", self.modes, now[3]),
        ):
            if captured != current:
                raise PrecompileError(
                    f"{what} at this call: {_shown_state(current)}; at capture: "
                    f"{_shown_state(captured)}. The graph was traced under the capture's "
                    "state (autocast's casts, the dtype of tensors fn builds, the modes' "
                    "behaviour are in it), so this call would not compute what fn computes "
                    "now. Call it as at capture, or precompile again in this state."
                )


def ambient_now() -> tuple[Any, ...]:
    """(autocast per device type, default dtype, deterministic algorithms, modes) now."""
    autocast = tuple(
        (device, str(torch.get_autocast_dtype(device)).removeprefix("torch."))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )
    modes = tuple(
        qualified_name(type(m))
        for m in (
            *torch.overrides._get_current_function_mode_stack(),
            *torch.utils._python_dispatch._get_current_dispatch_mode_stack(),
        )
    )
    return autocast, torch.get_default_dtype(), _DETERMINISTIC(), modes


def _shown_state(value: Any) -> str:
    if isinstance(value, tuple):
        return (
            ", ".join(" ".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)
            or "none"
        )
    return str(value)


_ANY_AUTOCAST = torch._C._is_any_autocast_enabled


_DETERMINISTIC = torch._C._get_deterministic_algorithms


_FUNCTION_MODES = torch._C._len_torch_function_stack


_DISPATCH_MODES = torch._C._len_torch_dispatch_stack


def grad_mode_error() -> PrecompileError:
    return PrecompileError(
        "fn runs a backward, but this call is under torch.no_grad() (or inference_mode), "
        "where eager fn would fail: no gradient can flow. Call the artifact with gradients "
        "enabled."
    )
