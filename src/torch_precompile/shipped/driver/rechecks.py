"""Cheap re-checks of what a full check found: a tensor guard in C++ and the count of
module registrations in the process.

A check that passed is remembered (``memo``, ``plain``); while the registration count and the
id of the next hook handle stand still, no module can have gained, lost or replaced a member or
a hook, and the tensor guard tells whether the tensors kept their type, dtype, device, sizes,
strides and requires_grad.
"""

import copy
import functools
import keyword
import operator
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """A check, in C++, that tensors keep the type, dtype, device, sizes, strides and
    requires_grad they have now (None where this torch has none). It is stricter than the
    capture's contract (exact strides everywhere): a call it refuses takes the full check,
    which decides."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        guards: Any = TensorGuards  # its stubs lag behind its keywords
        return guards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
            tensor_check_names=[f"t{i}" for i in range(len(tensors))],
        )
    except (ImportError, RuntimeError, TypeError):
        return None


# Every hook registration anywhere (module, global or tensor hook) takes a new handle id.
_HANDLES = torch.utils.hooks.RemovableHandle
_DEREF = weakref.ref.__call__  # a remembered model, or None once it is gone


# The registration count is one per process, in a module of its own shared by every artifact
# loaded (whatever version made it): hooks registered per load would pile up, each keeping its
# artifact alive. bump is compiled into that module, so its globals are the module's and it
# references no artifact. Artifacts of every version read counter[0]: a different layout
# needs a different module name.
_SHARED_COUNT = "_torch_precompile_registration_count"
_SHARED_COUNT_SOURCE = """\
counter = [0]


def bump(*_):
    counter[0] += 1
"""


def registration_counter() -> list[int]:
    """The process-wide count of parameter, buffer and submodule registrations, as a
    one-element list, counted from the process's first memo on: while it stands still, no
    remembered model can have a replaced, re-tied or added member."""
    shared = sys.modules.get(_SHARED_COUNT)
    if shared is None:
        fresh = types.ModuleType(_SHARED_COUNT, "torch_precompile's count of module registrations")
        exec(_SHARED_COUNT_SOURCE, vars(fresh))
        # setdefault is atomic: of two first loads at once, only one registers hooks.
        shared = sys.modules.setdefault(_SHARED_COUNT, fresh)
        if shared is fresh:
            hooks = torch.nn.modules.module
            hooks.register_module_parameter_registration_hook(fresh.bump)
            hooks.register_module_buffer_registration_hook(fresh.bump)
            hooks.register_module_module_registration_hook(fresh.bump)
    return shared.counter


class _CheckSource:
    """The generated check being written: its terms, and the objects they name."""

    def __init__(self, models: Sequence[Any]) -> None:
        self.roots = {id(m): f"model{k}" for k, m in enumerate(models)}
        self.held: dict[str, Any] = {}
        self.names: dict[tuple[str, int], str] = {}
        self.terms: list[str] = []

    def hold(self, prefix: str, obj: Any) -> str:
        """The global name ``obj`` goes by, one per object."""
        key = (prefix, id(obj))
        if key not in self.names:
            self.names[key] = f"{prefix}{len(self.names)}"
            self.held[self.names[key]] = obj
        return self.names[key]

    def module(self, module: Any) -> str:
        return self.roots.get(id(module)) or self.hold("module", module)

    def read(self, module: Any, path: Sequence[str]) -> str:
        """Code that reads ``path`` off ``module``: a first attribute that lives in the
        instance dict (as nn.Module keeps its flags and options) is read from that dict."""
        first, rest = path[0], path[1:]
        if first in vars(module) and not hasattr(type(module), first):
            code = f"{self.hold('attributes', vars(module))}[{first!r}]"
        else:
            code = _attribute(self.module(module), first)
        for name in rest:
            code = _attribute(code, name)
        return code

    def no_other_forward(self, module: Any) -> None:
        """A term: no forward set on the instance since the walk (or the same one)."""
        attributes = self.hold("attributes", vars(module))
        if "forward" in vars(module):
            self.same(f"{attributes}['forward']", vars(module)["forward"])
        else:
            self.terms.append(f"'forward' not in {attributes}")

    def same(self, code: str, value: Any) -> None:
        """A term: ``code`` gives the very object ``value`` (a list, dict, set or NumPy array:
        an equal one, item by item, since it can change in place)."""
        if type(value) is list:
            self.terms.append(f"{code} == {self.hold('value', copy.deepcopy(value))}")
            return
        if type(value) is set:
            held = self.hold("value", copy.deepcopy(value))
            self.terms.append(f"type({code}) is set and {code} == {held}")
            return
        if type(value).__name__ == "ndarray" and type(value).__module__ == "numpy":
            held = self.hold("value", (type(value), value.dtype, value.shape, value.tolist()))
            self.terms.append(f"{self.hold('value', _same_array)}({code}, {held})")
            return
        if type(value) is dict:
            items = self.hold("value", copy.deepcopy(list(value.items())))
            self.terms.append(f"list({code}.items()) == {items}")
            return
        if type(value) is types.MethodType:  # a new bound method at every read
            self.terms.append(f"{code}.__func__ is {self.hold('value', value.__func__)}")
            return
        if type(value) is types.FunctionType and value.__closure__:  # a cell can be set anew
            contents = self.hold("value", _cell_contents(value))
            self.terms.append(f"{self.hold('value', _cell_contents)}({code}) == {contents}")
        known = (
            repr(value)
            if value is None or value is True or value is False
            else self.hold("value", value)
        )
        self.terms.append(f"{code} is {known}")

    def compiled(self) -> Callable[..., bool]:
        # Terms repeat where several paths reach one object: each is written once.
        body = "".join(f"\n                {t} and" for t in dict.fromkeys(self.terms))
        source = (
            f"def unchanged({', '.join(self.roots.values())}):\n"
            "    try:\n"
            f"        return ({body}\n                True)\n"
            "    except (AttributeError, KeyError):\n"
            "        return False\n"
        )
        exec(compile(source, "<remembered models>", "exec"), self.held)
        return self.held["unchanged"]


_PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None))


def _holds_objects(value: Any) -> bool:
    """Whether a list, tuple or dict holds (at any depth) more than plain values."""
    if type(value) in (list, tuple):
        return any(map(_holds_objects, value))
    if type(value) is dict:
        return any(map(_holds_objects, value.values()))
    return type(value) not in _PLAIN_VALUES


def _is_object(value: Any) -> bool:
    """An object holding values in its instance dict (a hook's settings, a callable object
    of the user's too), not a tensor, module, class or function."""
    return type(getattr(value, "__dict__", None)) is dict and not isinstance(
        value, (torch.Tensor, torch.nn.Module, type, *_CODE)
    )


# Callables whose instance dict holds no settings of theirs.
_CODE: tuple[type, ...] = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    functools.partial,
)


def contents_of(value: Any, depth: int = 3) -> Any:
    """``value`` as data equal only to the same contents: lists, tuples and dicts item by
    item, an object by its class and attributes (``depth`` deep), a float by its text (its
    sign, nan), anything else by identity. An object a list attribute holds can change in
    place where the list stays the same."""
    kind = type(value)
    if kind in (list, tuple):
        return kind, [contents_of(v, depth) for v in value]
    if kind is dict:
        return kind, [(k, contents_of(v, depth)) for k, v in value.items()]
    if kind in _PLAIN_VALUES:
        return kind, repr(value) if kind is float else value
    if depth and _is_object(value):
        return kind, [(k, contents_of(v, depth - 1)) for k, v in vars(value).items()]
    return _Same(value)


class _Same:
    """An object compared by identity (held, so no other object can take its id)."""

    __slots__ = ("held",)

    def __init__(self, held: Any) -> None:
        self.held = held

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.held is self.held

    __hash__ = None  # type: ignore[assignment]


def _cell_contents(function: Any) -> list[_Same] | None:
    """What a function's closure cells hold now, each by identity (None for an empty
    cell)."""
    try:
        return [_Same(cell.cell_contents) for cell in function.__closure__ or ()]
    except ValueError:  # a cell not yet filled
        return None


def _same_array(value: Any, held: tuple[Any, ...]) -> bool:
    """Whether ``value`` is a NumPy array as ``held`` (type, dtype, shape, items) says (numpy
    is not imported: the array's own methods compare)."""
    cls, dtype, shape, items = held
    return (
        type(value) is cls
        and value.dtype == dtype
        and value.shape == shape
        and value.tolist() == items
    )


def _attribute(code: str, name: str) -> str:
    """Code that reads attribute ``name`` off the value of ``code``."""
    if name.isidentifier() and not keyword.iskeyword(name):
        return f"{code}.{name}"
    return f"getattr({code}, {name!r})"


def _value_at(module: Any, path: Sequence[str]) -> Any:
    try:
        return operator.attrgetter(".".join(path))(module)
    except AttributeError:
        return _GONE


_GONE = object()  # an attribute the walk found missing: no later read can be this object


def module_facts(check: "_CheckSource", modules: Sequence[Any]) -> None:
    """Terms of ``check`` for what a full walk checked in Python about ``modules``: each one's
    class, training flag and forward (none set on the instance since, none patched into its
    class), and the size of each member dict that was not empty (an empty one gains a member
    only by a registration, which the count sees)."""
    for module in modules:
        check.same(f"type({check.module(module)})", type(module))
        check.same(check.read(module, ("training",)), module.training)
        check.no_other_forward(module)
    for cls in dict.fromkeys(map(type, modules)):  # a forward patched into a class
        check.same(f"{check.hold('value', cls)}.forward", getattr(cls, "forward", None))
    members = [d for m in modules for d in (m._parameters, m._buffers, m._modules) if d]
    for d in members:
        check.terms.append(f"len({check.hold('members', d)}) == {len(d)}")


def read_facts(
    check: "_CheckSource", modules: Sequence[Any], paths: Sequence[tuple[int, Sequence[str]]]
) -> None:
    """Terms of ``check`` for the values at ``paths`` (submodule index, attribute path) that
    the trace read off ``modules``."""
    for index, path in paths:
        module = modules[index]
        value = _value_at(module, path)
        holder = _value_at(module, path[:-1]) if len(path) > 1 else _GONE
        if value is _GONE and len(path) == 1:  # read as absent: set on the instance later
            check.terms.append(f"{path[0]!r} not in {check.hold('attributes', vars(module))}")
        elif value is not _GONE and _is_object(holder):
            # One config object that every layer holds: each layer's reference is checked
            # for identity, and each value read off the object once.
            check.same(check.read(module, path[:-1]), holder)
            same_value(check, _attribute(check.hold("value", holder), path[-1]), value)
        else:
            same_value(check, check.read(module, path), value)


def same_value(check: "_CheckSource", code: str, value: Any) -> None:
    """A term for a value the trace read, as ``same``; a list, tuple or dict holding objects,
    or an object (a hook's settings), compared by its contents (``contents_of``), since an object
    can change in place where its holder stays the same."""
    if _holds_objects(value) and (type(value) in (list, tuple, dict) or _is_object(value)):
        held = check.hold("value", contents_of(value))
        check.terms.append(f"{check.hold('value', contents_of)}({code}) == {held}")
    else:
        check.same(code, value)
