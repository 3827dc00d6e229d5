"""Damaged, foreign and mismatched pairs: each is refused, or runs correctly from the source.

Never another exception, never a wrong result."""

from __future__ import annotations

import ast
import io
import itertools
import logging
import re
from pathlib import Path

import pytest
import torch

from torch_precompile import PrecompileError, precompile
from torch_precompile.artifact import envelope
from torch_precompile.spec import OLDEST_READABLE_SCHEMA, SCHEMA_VERSION, shown_version

from conftest import assert_same, kernel_payload, with_kernel_payload
from workloads import WORKLOADS

NAME = "mlp_train"


def _expect_refused_or_correct(code: str, cache: bytes | None) -> str:
    """Load and run; return 'refused' or 'ran'. Anything else fails the test."""
    try:
        run = precompile.load(code, cache)
    except PrecompileError:
        return "refused"
    workload = WORKLOADS[NAME]
    args, eager_args = workload.args(), workload.args()
    try:
        result = run(*args)
    except PrecompileError:
        return "refused"
    assert_same(result, workload.fn(*eager_args))
    assert_same(
        [p.grad for p in args[0].parameters()], [p.grad for p in eager_args[0].parameters()]
    )
    return "ran"


def _flip(data: bytes, position: int) -> bytes:
    flipped = bytearray(data)
    flipped[position % len(flipped)] ^= 1 << (position % 8)
    return bytes(flipped)


def test_truncated_caches(backend: str, artifacts, caplog) -> None:
    code, cache = artifacts.pair(NAME, backend)
    with caplog.at_level(logging.ERROR, logger="torch_precompile"):
        for length in (0, 1, 10, len(cache) // 3, len(cache) // 2, len(cache) - 1):
            assert _expect_refused_or_correct(code, cache[:length]) == "ran", length


def test_bit_flipped_caches(backend: str, artifacts, caplog) -> None:
    code, cache = artifacts.pair(NAME, backend)
    outcomes = []
    with caplog.at_level(logging.ERROR, logger="torch_precompile"):
        for position in range(0, len(cache), max(1, len(cache) // 40)):
            outcomes.append(_expect_refused_or_correct(code, _flip(cache, position)))
    assert "ran" in outcomes


def test_bit_flipped_kernel_objects(artifacts) -> None:
    code, cache = artifacts.pair(NAME, "inductor")
    payload = kernel_payload(code, cache)
    for entry in payload["kernels"].values():
        entry["object"] = _flip(entry["object"], len(entry["object"]) // 2)
    assert _expect_refused_or_correct(code, with_kernel_payload(code, payload)) == "ran"


def test_foreign_and_future_caches(backend: str, artifacts) -> None:
    code, cache = artifacts.pair(NAME, backend)
    envelope_dict = envelope.decode(cache)
    # Written the version-1 way (torch.save), which load still reads.
    for change in ({"version": 99}, {"format": "other-tool"}, {"artifact": "not bytes"}):
        buffer = io.BytesIO()
        torch.save({**envelope_dict, **change}, buffer)
        assert _expect_refused_or_correct(code, buffer.getvalue()) == "ran", change
    for junk in (b"", b"\0" * 100, b"PK\x03\x04garbage", bytearray(b"junk")):
        assert _expect_refused_or_correct(code, junk) == "ran"  # type: ignore[arg-type]
    # The current layout cut short, grown, or with a header that lies about its blobs.
    magic_end = cache.index(b"\n") + 1
    header_end = magic_end + 8 + int.from_bytes(cache[magic_end : magic_end + 8], "little")
    lying = cache[:header_end].replace(b'"artifact": ', b'"artifact": 9', 1) + cache[header_end:]
    for damaged in (cache[:-7], cache + b"x", cache[: header_end - 3], lying):
        assert _expect_refused_or_correct(code, damaged) == "ran"
    with pytest.raises(PrecompileError, match="no cache at a string"):
        precompile.load(code, "a string")  # a string names the cache's file


def test_swapped_pairs_are_refused(backend: str, artifacts) -> None:
    code, cache = artifacts.pair(NAME, backend)
    other_code, other_cache = artifacts.pair("mlp_infer", backend)
    with pytest.raises(PrecompileError, match="different python_code"):
        precompile.load(code, other_cache)
    with pytest.raises(PrecompileError, match="different python_code"):
        precompile.load(other_code, cache)
    other_backend = "eager" if backend == "inductor" else "inductor"
    with pytest.raises(PrecompileError, match="made by backend"):
        precompile.load(code, artifacts.pair(NAME, other_backend)[1])


def _spec_span(code: str) -> tuple[int, int]:
    """Offsets of the ``ARTIFACT_SPEC = ...`` statement in ``code``, found by Python's parser."""
    node = next(
        n
        for n in ast.parse(code).body
        if isinstance(n, ast.Assign)
        and [getattr(t, "id", None) for t in n.targets] == ["ARTIFACT_SPEC"]
    )
    starts = [0, *itertools.accumulate(len(line) for line in code.splitlines(keepends=True))]
    return (
        starts[node.lineno - 1] + node.col_offset,
        starts[node.end_lineno - 1] + node.end_col_offset,
    )


def _binds_forward(source: str) -> bool:
    return any(
        isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["forward"]
        for n in ast.parse(source).body
    )


def _cut_refusal(code: str, damaged: str) -> tuple[str, str | None]:
    """(kind of cut, the message loading ``damaged``, a prefix of ``code``, alone must raise;
    None: it must run)."""
    if len(damaged) < _spec_span(code)[1]:
        return "spec cut", "not a precompile artifact"
    try:
        compile(damaged, "damaged", "exec")
    except SyntaxError as e:  # IndentationError included
        return "does not compile", rf"executing python_code failed \({type(e).__name__}: "
    if _binds_forward(damaged):
        return "forward bound", None
    # A cut that still compiles runs until it ends, or until a statement it cut in two
    # fails (a name cut short, say).
    return "forward not bound", (
        "python_code ran but did not reach its end|executing python_code failed"
    )


def test_damaged_sources(backend: str, artifacts) -> None:
    code, cache = artifacts.pair(NAME, backend)
    spec_start, spec_end = _spec_span(code)
    lines = code.splitlines(keepends=True)
    truncations = [code[: len(code) // k] for k in (2, 3, 5)]
    truncations += ["".join(lines[:n]) for n in (len(lines) // 2, len(lines) - 3)]
    truncations += [
        code[:spec_start],  # just before the spec
        code[: (spec_start + spec_end) // 2],  # inside it
        code[: code.index("\ndef ", spec_end) + 4],  # after it, mid-statement
        code[: code.rindex("\nforward = ") + 1],  # all but the line binding forward
        code[: code.rindex("\nif __name__") + 1],  # only the main guard and the seal lost
    ]
    assert {_cut_refusal(code, cut)[0] for cut in truncations} == {
        "spec cut",
        "does not compile",
        "forward not bound",
        "forward bound",
    }
    for damaged in truncations:
        spec_survived = len(damaged) >= spec_end
        with pytest.raises(
            PrecompileError,
            match="cache belongs to a different python_code"
            if spec_survived
            else "not a precompile artifact",
        ):
            precompile.load(damaged, cache)
        expected = _cut_refusal(code, damaged)[1]
        if expected is None:  # cut only after forward is bound: still runs right
            assert _expect_refused_or_correct(damaged, None) == "ran"
        else:
            with pytest.raises(PrecompileError, match=expected):
                precompile.load(damaged, None)
    for damaged in ["", "\n\n", code.replace("ARTIFACT_SPEC", "SPEC")]:
        for damaged_cache in (cache, None):
            with pytest.raises(
                PrecompileError,
                match="python_code has no ARTIFACT_SPEC; it is not a precompile artifact",
            ):
                precompile.load(damaged, damaged_cache)
    for position in range(0, len(code), max(1, len(code) // 25)):
        flipped = _flip(code.encode(), position).decode(errors="replace")
        if spec_start - 1 <= position < spec_end + 2:
            # A flipped spec is unreadable, or reads as another artifact's: each is refused
            # for what it now says.
            message = (
                "not a precompile artifact|different python_code|schema version|"
                "built with torch|made by backend"
            )
        else:  # the spec is intact: the cache no longer matches the source
            message = "cache belongs to a different python_code"
        with pytest.raises(PrecompileError, match=message):
            precompile.load(flipped, cache)


def test_a_version_1_spec_reads_with_no_meshes(backend: str) -> None:
    """The literal a version-1 release wrote (its golden pair), as it stands."""
    from torch_precompile.spec import from_literal, spec_literal

    code = (Path(__file__).parent / "golden" / f"schema1-{backend}.artifact").read_text()
    literal = spec_literal(code)
    assert literal["schema_version"] == 1 and "meshes" not in literal
    assert "distributed" not in literal and "autograd" not in literal
    spec = from_literal(literal)
    assert spec.meshes == () and spec.distributed == () and spec.schema_version == (1, 0)
    assert spec.autograd is None


def test_unknown_schema_version_is_refused_before_anything_runs(
    tmp_path, backend: str, artifacts
) -> None:
    code, _ = artifacts.pair(NAME, backend)
    marker = tmp_path / "ran"
    future = f"open({str(marker)!r}, 'w').close()\n" + code.replace(
        f"'schema_version': {SCHEMA_VERSION},", "'schema_version': (99, 0),", 1
    )
    with pytest.raises(
        PrecompileError,
        match=f"schema version 99.0; this torch-precompile reads schema versions "
        f"{shown_version(OLDEST_READABLE_SCHEMA)} to {SCHEMA_VERSION[0]}.x. Upgrade",
    ):
        precompile.load(future, None)
    with pytest.raises(PrecompileError, match="schema version 99.0"):
        precompile.inspect(future)
    assert not marker.exists()


def test_artifact_of_another_torch_is_refused_before_anything_runs(
    tmp_path, backend: str, artifacts
) -> None:
    code, _ = artifacts.pair(NAME, backend)
    marker = tmp_path / "ran"
    here = f"'version': {str(torch.__version__)!r}"
    assert here in code
    other = f"open({str(marker)!r}, 'w').close()\n" + code.replace(here, "'version': '2.99.0'", 1)
    assert precompile.inspect(other).torch.version == "2.99.0"  # readable, not runnable
    with pytest.raises(
        PrecompileError,
        match=r"built with torch 2\.99\.0 \(git .*\); this "
        rf"process runs torch {re.escape(str(torch.__version__))} .*precompile fn "
        "again under this torch",
    ):
        precompile.load(other, None)
    assert not marker.exists()
