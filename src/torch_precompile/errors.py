"""The package's error type.

It is defined in ``driver`` because artifacts raise it too and must not import this package;
``load`` points every loaded artifact at this same class.
"""

from torch_precompile.shipped.driver.tensor_rules import PrecompileError

PrecompileError.__module__ = "torch_precompile"

__all__ = ["PrecompileError"]
