"""Variants: several captured calls in one artifact; each call runs the variant it fits.

``forward = Variants([Driver(...), ...])`` holds one driver per variant, each over its own
spec and graph. A call fits a variant when it passes that driver's checks, which run before
anything is computed. Where every variant takes positional tensors of static shapes (batch
size buckets, say), the call's input shapes pick the variant to try; otherwise the variant
that ran last is tried first. Either way a steady run of calls of one kind pays for one
variant's checks. A call that fits none is refused, naming every variant and the first
difference from the one whose checks it got furthest through.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch_precompile.shipped.driver.records import SPEC_SHARED
from torch_precompile.shipped.driver.tensor_rules import PrecompileError


def variant_spec(literal: Mapping[str, Any], number: int) -> dict[str, Any]:
    """Variant ``number`` (counting from 1, the top level) of ``ARTIFACT_SPEC`` as a whole
    spec: its own fields over those every variant shares."""
    if number == 1:
        return {**literal, "variants": ()}
    return {
        **{k: literal[k] for k in SPEC_SHARED if k in literal},
        **literal["variants"][number - 2],
    }


def variant_label(spec: Any) -> str:
    """What a variant specializes on, for messages: input shapes, Python values, mode."""
    return ", ".join(_label_parts(spec)) or "no inputs"


def _label_parts(spec: Any) -> list[str]:
    shown = []
    for leaf in spec.inputs:
        if leaf.kind == "tensor":
            dims = ", ".join("*" if size is None else str(size) for size in leaf.shape or ())
            shown.append(f"{leaf.path} ({dims})")
        else:
            shown.append(f"{leaf.path}={leaf.value[1]!r}")
    if spec.submodules:
        shown.append("training" if spec.submodules[0].training else "eval")
    return shown


def variant_labels(specs: Sequence[Any]) -> list[str]:
    """Each variant's label, without what every variant shares (when they share anything),
    each cut to a readable length."""
    parts = [_label_parts(spec) for spec in specs]
    shared = set.intersection(*(set(p) for p in parts)) if len(parts) > 1 else set()
    labels = []
    for own in parts:
        text = ", ".join(p for p in own if p not in shared) or "no inputs"
        labels.append(text if len(text) <= 200 else text[:197] + "...")
    return labels


class Variants:
    """``forward`` of an artifact with several variants."""

    def __init__(self, drivers: Sequence[Any]) -> None:
        self.drivers = list(drivers)
        self.last = self.drivers[0]
        self.labels = variant_labels([d.spec for d in self.drivers])
        # The variants by their inputs' shapes, when each is positional tensors of static shape.
        self.positions = self.drivers[0].input_positions
        self.by_shape: dict[tuple[Any, ...], Any] | None = None
        if all(d.plain_inputs for d in self.drivers):
            self.by_shape = {}
            for driver in reversed(self.drivers):  # the first variant of a shape wins
                self.by_shape[tuple(p.shape for p in driver.leaves)] = driver

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the variant this call fits (the captured fn's positional arguments)."""
        return self.run(args, self.checked(args, kwargs))

    def checked(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
        """The driver of the variant this call fits, and the call as it checked it."""
        driver, shapes = self.last, None
        if self.by_shape is not None:
            shapes = _shapes(args, self.positions)
            if shapes is not None:
                driver = self.by_shape.get(shapes, driver)
        try:
            return driver, driver.checked(args, kwargs)
        except PrecompileError as refused:
            found = self._fitting(args, kwargs, driver, refused)
            self.last = found[0]
            if self.by_shape is not None and shapes in self.by_shape:
                self.by_shape[shapes] = found[0]  # variants of one shape: the last runs first
            return found

    def run(self, args: Sequence[Any], fitted: tuple[Any, Any]) -> Any:
        driver, checked = fitted
        return driver.run(args, checked)

    def _fitting(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], tried: Any, refused: Exception
    ) -> tuple[Any, Any]:
        refusals = {id(tried): refused}
        for driver in self.drivers:
            if driver is tried:
                continue
            try:
                return driver, driver.checked(args, kwargs)
            except PrecompileError as error:
                refusals[id(driver)] = error
        errors = [refusals[id(d)] for d in self.drivers]
        shapes = _shapes(args, self.positions)
        gaps = [_shape_gap(shapes, d) for d in self.drivers]
        # Nearest: the closest input shapes (ties to the smaller variant), then the variant
        # whose checks the call got furthest through.
        nearest = min(
            range(len(errors)),
            key=lambda i: (gaps[i][0], -getattr(errors[i], "check_stage", 0), gaps[i][1], i),
        )
        why = "closest input shapes" if gaps[nearest][0] != _FAR else "its checks got furthest"
        listed = "; ".join(f"{i + 1}: {label}" for i, label in enumerate(self.labels))
        raise PrecompileError(
            f"this call fits none of the artifact's {len(self.drivers)} variants ({listed}). "
            f"Nearest is variant {nearest + 1} ({why}): {errors[nearest]} Capture this call "
            "too (one more call inside the capture block) to add a variant for it."
        ) from None


_FAR = float("inf")  # shapes that cannot be compared: another rank or count of inputs


def _shape_gap(shapes: Sequence[Any] | None, driver: Any) -> tuple[float, int]:
    """How far a call's positional input shapes are from a variant's: the sum over dims of
    the absolute size difference (a dynamic dim counts 0), and the variant's own element count
    (ties go to the smaller); ``_FAR`` where they cannot be compared."""
    tensors = [leaf.shape for leaf in driver.leaves if leaf.is_tensor]
    if shapes is None or len(shapes) != len(tensors) or len(tensors) != len(driver.leaves):
        return _FAR, 0
    gap, size = 0, 0
    for got, expected in zip(shapes, tensors, strict=True):
        if len(got) != len(expected):
            return _FAR, 0
        gap += sum(abs(g - e) for g, e in zip(got, expected, strict=True) if e is not None)
        size += math.prod(e for e in expected if e is not None)
    return gap, size


def _shapes(args: Sequence[Any], positions: Sequence[int]) -> tuple[Any, ...] | None:
    """The shapes of the inputs at ``positions``; None where one is not a tensor (the checks
    then say what is wrong)."""
    try:
        return tuple([args[i].shape for i in positions])
    except (AttributeError, IndexError):
        return None
