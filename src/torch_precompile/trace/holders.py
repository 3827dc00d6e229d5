"""Objects that hold tensors (a KV cache, say) passed to fn: rebuilt around the traced tensors
for the traced run, and refused where fn rebinds their attributes, which an artifact cannot
replay.

The driver opens such an object at every call (``driver.values.opened``): its tensors are
inputs, written in place as in eager, and its other attributes values each call must match.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.shipped.driver.tensor_rules import qualified_name
from torch_precompile.shipped.driver.values import CLASS_KEY

_CACHES = "transformers.cache_utils."


@dataclass
class _Copy:
    """A copy of one object fn receives, and what its attributes held when fn got it."""

    name: str
    obj: Any
    given: dict[str, Any]
    items: dict[str, list[Any]]  # the items of its list attributes, to see appends


@dataclass
class HolderCopies:
    """The copies of objects that hold tensors made for one traced run."""

    copies: list[_Copy] = field(default_factory=list)

    def closed(self, original: Any, opened: Any, name: str) -> Any:
        """``original`` rebuilt around the leaves of ``opened`` (its opened form, tensors
        replaced by traced ones), copying each object that holds tensors."""
        if type(original) in (list, tuple):
            return type(original)(
                self.closed(o, v, f"{name}[{i}]")
                for i, (o, v) in enumerate(zip(original, opened, strict=True))
            )
        if type(original) is dict:
            return {k: self.closed(original[k], v, f"{name}[{k!r}]") for k, v in opened.items()}
        if not (type(opened) is dict and CLASS_KEY in opened):  # not an opened object
            return opened
        made = copy.copy(original)
        for key, value in opened.items():
            if key != CLASS_KEY:
                made.__dict__[key] = self.closed(getattr(original, key), value, f"{name}.{key}")
        given = dict(vars(made))
        items = {k: list(v) for k, v in given.items() if type(v) is list}
        self.copies.append(_Copy(name, made, given, items))
        return made

    def refuse_writes(self) -> None:
        """Refuse, by name, an attribute fn bound anew on an object it was given."""
        for held in self.copies:
            now = vars(held.obj)
            for key in [*held.given, *(k for k in now if k not in held.given)]:
                if not _same(held.given.get(key, _MISSING), now.get(key, _MISSING)) or (
                    key in held.items and list(now[key]) != held.items[key]
                ):
                    raise PrecompileError(_write_message(held, key))


_MISSING = object()


def _same(before: Any, after: Any) -> bool:
    if before is after:
        return True
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        return False
    try:
        return bool(type(before) is type(after) and before == after)
    except Exception:  # a value without a plain ==
        return False


def _write_message(held: _Copy, key: str) -> str:
    kind = qualified_name(type(held.obj))
    lead = (
        f"fn sets {held.name}.{key} (an attribute of a {kind}) during the call. An artifact "
        "replays tensor computation, not Python attribute writes, so later calls would not "
        "make this write."
    )
    if not kind.startswith(_CACHES):
        return (
            f"{lead} Keep such state in tensors written in place (t.copy_(...), t.add_(1)), "
            "or keep the object out of fn."
        )
    if held.given.get("is_initialized") is False:
        return (
            f"{lead} The cache creates its tensors on first use: create them before capture "
            "and before every call with cache.early_initialization(batch_size, num_heads, "
            "head_dim, dtype, device) (precompile.for_generate does this for generate())."
        )
    if "Dynamic" in kind:
        return (
            f"{lead} A DynamicCache grows by making new tensors at each step; pass a "
            "StaticCache (in generate(): cache_implementation='static'), whose tensors are "
            "written in place."
        )
    return (
        f"{lead} This cache layer keeps a Python count of its tokens (a sliding window does); "
        "serve the model with full attention in every layer (for Mistral-style configs, "
        "sliding_window=None)."
    )
