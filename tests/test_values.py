"""The one encoder of the spec's Python values: each kind means one thing in every use, and
what it writes is what the artifact's driver reads back (compares, or builds again)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import pytest
import torch

from torch_precompile.errors import PrecompileError
from torch_precompile.shipped.driver.encoded import shown_value, value_matches
from torch_precompile.shipped.driver.subclasses import decode_context
from torch_precompile.trace.inputs import encode_value
from torch_precompile.trace.values import Use, encode


class Mode(enum.Enum):
    FAST = 1


@dataclasses.dataclass(frozen=True)
class Frozen:
    n: int
    mode: Mode


@dataclasses.dataclass
class Mutable:
    n: int
    scale: float = 1.0


class Pair(NamedTuple):
    a: int
    b: float


SCALARS = [None, True, 3, 2.5, -0.0, float("nan"), float("-inf"), 1 + 2j, "s", b"b"]
SCALARS += [torch.float16, torch.device("cpu"), Mode.FAST]


@pytest.mark.parametrize("use", [Use.INPUT, Use.READ, Use.CONTEXT])
@pytest.mark.parametrize("value", SCALARS, ids=repr)
def test_a_scalar_encodes_alike_in_every_use_and_matches_itself(use: Use, value: Any) -> None:
    encoded = encode(value, use)
    assert encoded is not None and encoded == encode(value, Use.READ)
    assert value_matches(encoded, value)
    if use is Use.CONTEXT:
        rebuilt = decode_context(encoded)
        assert type(rebuilt) is type(value) and repr(rebuilt) == repr(value)


def test_a_record_is_frozen_where_compared_and_dataclass_where_built_again() -> None:
    frozen = Frozen(2, Mode.FAST)
    assert encode(frozen, Use.INPUT) == (
        "frozen",
        (
            f"{__name__}.Frozen",
            (("n", ("const", 2)), ("mode", ("enum", (f"{__name__}.Mode", "FAST")))),
        ),
    )
    assert value_matches(encode(frozen, Use.INPUT), frozen)
    assert not value_matches(encode(frozen, Use.INPUT), Frozen(3, Mode.FAST))
    for value in (frozen, Mutable(4, 0.5)):
        encoded = encode(value, Use.CONTEXT)
        assert encoded is not None and encoded[0] == "dataclass"
        assert decode_context(encoded) == value
    assert encode(Pair(1, 2.0), Use.CONTEXT)[0] == "frozen"
    assert decode_context(encode(Pair(1, 2.0), Use.CONTEXT)) == Pair(1, 2.0)
    # A read dataclass is an object whose attributes the code reads: no whole-value kind.
    assert encode(frozen, Use.READ) is None
    assert encode([Mutable(1)], Use.READ) == (
        "list",
        (("object", (f"{__name__}.Mutable", (("n", ("const", 1)), ("scale", ("const", 1.0))))),),
    )


def test_each_use_takes_only_its_kinds() -> None:
    size = torch.Size([2, 3])
    assert encode(size, Use.CONTEXT) == ("size", (2, 3))
    assert decode_context(encode(size, Use.CONTEXT)) == size
    assert shown_value(encode(size, Use.CONTEXT)) == "torch.Size([2, 3])"
    assert encode(size, Use.READ) is None and encode(size, Use.INPUT) is None
    assert encode([1, 2], Use.INPUT) is None  # inputs' containers are flattened, not encoded
    assert encode(Mutable(1), Use.INPUT) is None
    assert encode(Frozen(1, Mode.FAST), Use.OPTION) is None
    assert encode((0.9, 0.999), Use.OPTION) == ("const", (0.9, 0.999))
    assert encode({1, 2}, Use.CONTEXT) is None and encode({1, 2}, Use.READ)[0] == "set"
    assert encode(torch.relu, Use.READ)[0] == "callable"
    assert encode(torch.relu, Use.CONTEXT) is None
    assert encode(list(range(300)), Use.READ) is None  # a table, not a setting
    assert encode(list(range(300)), Use.CONTEXT) is not None


def test_an_input_that_takes_no_kind_is_refused_by_name() -> None:
    with pytest.raises(PrecompileError, match=r"input cfg is a .*Mutable, which is neither"):
        encode_value("cfg", Mutable(1))
    with pytest.raises(PrecompileError, match="input g is a torch.Generator"):
        encode_value("g", torch.Generator())
