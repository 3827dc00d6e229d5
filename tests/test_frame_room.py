"""The build's calls run on a stretch of the frame stack of their own."""

from __future__ import annotations

import sys

import pytest

from torch_precompile.frame_room import with_frame_room


def test_the_call_runs_below_a_frame_larger_than_a_stack_chunk() -> None:
    def caller_slots() -> int:
        frame = sys._getframe(1)
        return frame.f_code.co_nlocals

    # 16 KiB chunks hold 2048 slots of 8 bytes: a larger frame gets a chunk of its own.
    assert with_frame_room(caller_slots) > 2048


def test_results_and_errors_pass_through() -> None:
    assert with_frame_room(lambda: "built") == "built"
    with pytest.raises(KeyError, match="missing"):
        with_frame_room(lambda: {}["missing"])
