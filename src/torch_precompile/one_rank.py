"""``compile_on_one_rank``: rank 0 builds the artifact pair, every rank receives it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from torch_precompile.errors import PrecompileError

Built = TypeVar("Built")


def build_on_rank_zero(build: Callable[[], Built]) -> Built:
    """Run ``build`` on rank 0 of the default process group and broadcast what it made (a
    pair, or a list of pairs; or its failure) to every rank; the other ranks trace, lower and
    compile nothing."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise PrecompileError(
            "compile_on_one_rank=True shares rank 0's artifact over the default process group, "
            "which is not initialized in this process. Call "
            "torch.distributed.init_process_group(...) first on every rank, or leave "
            "compile_on_one_rank off."
        )
    outcome: list[object] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("pair", build())
        except Exception as e:  # every rank must hear how rank 0 fared, or they would hang
            failure = e
            outcome[0] = ("failed", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    kind, payload = cast("tuple[str, Any]", outcome[0])
    if kind == "failed":
        raise PrecompileError(f"rank 0 could not precompile, so no rank has an artifact: {payload}")
    built: Built = payload
    return built
