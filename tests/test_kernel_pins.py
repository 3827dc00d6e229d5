"""The source names its kernel objects: a cache holding any other object is refused.

Each built kernel object's SHA-256 is in the spec (``kernels``), so whoever can write an
unsigned cache cannot swap an object and its checksum together: the source, which ``code_hash``
binds, says which bytes belong to it.
"""

from __future__ import annotations

import logging

import pytest

from torch_precompile import PrecompileError, precompile

from conftest import (
    assert_runs_like_eager,
    kernel_payload,
    run_python,
    with_kernel_payload,
)

NAME = "mlp_train"


def test_the_spec_names_every_object_of_the_cache(artifacts) -> None:
    code, cache = artifacts.pair(NAME, "inductor")
    named = {k.key: k.sha256 for k in precompile.inspect(code).kernels}
    held = {key: entry["sha256"] for key, entry in kernel_payload(code, cache)["kernels"].items()}
    assert named == held and named
    assert precompile.inspect(artifacts.pair(NAME, "eager")[0]).kernels == ()


def _swapped(code: str, cache: bytes) -> bytes:
    """One object replaced by other bytes, its checksum updated to match them."""
    import hashlib

    payload = kernel_payload(code, cache)
    entry = next(iter(payload["kernels"].values()))
    entry["object"] = entry["object"] + b"\0"
    entry["sha256"] = hashlib.sha256(entry["object"]).hexdigest()
    return with_kernel_payload(code, payload)


_LOAD_SWAPPED = """
    import sys
    from torch_precompile import PrecompileError, precompile
    from torch_precompile.artifact import signature
    code = open({code!r}).read()
    cache = open({cache!r}, "rb").read()
    key = {key!r}
    if key is not None:
        cache = signature.sign(key, code, cache)
    try:
        precompile.load(code, cache, verify_key=key)
    except PrecompileError as e:
        print("REFUSED", e)
    mapped = [name for name in sys.modules if name.startswith("torch_precompile_kernel_")]
    print("MAPPED", len(mapped))
"""


@pytest.mark.parametrize("key", [None, b"signing key"], ids=["unsigned", "signed"])
def test_a_swapped_object_is_refused_before_anything_is_mapped(key, artifacts, tmp_path) -> None:
    code, cache = artifacts.pair(NAME, "inductor")
    (tmp_path / "a.py").write_text(code)
    (tmp_path / "a.cache").write_bytes(_swapped(code, cache))
    proc = run_python(
        _LOAD_SWAPPED.format(code=str(tmp_path / "a.py"), cache=str(tmp_path / "a.cache"), key=key)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "REFUSED the cache holds a kernel object that is not one python_code was built "
        "with" in proc.stdout
    )
    assert "python_code names sha256" in proc.stdout
    assert "MAPPED 0" in proc.stdout


def test_an_object_the_source_does_not_name_is_refused(artifacts) -> None:
    code, cache = artifacts.pair(NAME, "inductor")
    payload = kernel_payload(code, cache)
    entry = dict(next(iter(payload["kernels"].values())))
    payload["kernels"]["f" * 64] = entry
    with pytest.raises(
        PrecompileError, match="kernel ffffffffffff…: .*python_code names no such kernel"
    ):
        precompile.load(code, with_kernel_payload(code, payload))


def test_an_edited_pin_unbinds_the_pair(artifacts) -> None:
    """The pins are part of the source: editing one breaks the pair like any other edit."""
    code, cache = artifacts.pair(NAME, "inductor")
    other = code.replace("'sha256': '", "'sha256': '0", 1)
    with pytest.raises(PrecompileError, match="belongs to a different python_code"):
        precompile.load(other, cache)


def test_verify_and_inspect_name_the_swapped_object(artifacts, tmp_path) -> None:
    from torch_precompile.inspection import describe, render, verify

    code, cache = artifacts.pair(NAME, "inductor")
    path = precompile.save(code, _swapped(code, cache), tmp_path / "a.py")
    with pytest.raises(PrecompileError) as refused:
        precompile.load_file(path)
    problems = verify(path, None).problems
    assert str(refused.value) in problems, problems
    report = describe(path)
    assert (
        report["load"]["refused"]
        and [k["load"] for k in report["cache"]["kernels"]].count(
            "refused: the source does not name it"
        )
        == 1
    )
    assert f"load      : refuses the pair, running nothing: {refused.value}" in render(report)


def test_a_malformed_entry_is_skipped_with_a_warning(artifacts, caplog) -> None:
    code, cache = artifacts.pair(NAME, "inductor")
    payload = kernel_payload(code, cache)
    key = next(iter(payload["kernels"]))
    payload["kernels"][key] = {"object": "not bytes"}
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        run = precompile.load(code, with_kernel_payload(code, payload))
    assert any(
        f"kernel {key[:12]}… is unusable (a malformed entry)" in r.message for r in caplog.records
    )
    assert_runs_like_eager(run, NAME)
