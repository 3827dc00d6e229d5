"""What ``inspect``, ``verify``, the demo and a refused variant call say matches what happens.

Each report is checked against the thing it reports on: the objects a fresh process really
mapped, what ``load`` really does with a damaged or foreign object, the signature really
checked, and the variant whose shapes really are closest.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_precompile import PrecompileError, capture, precompile
from torch_precompile.artifact import envelope, signature
from torch_precompile.artifact.judgement import judge, pins
from torch_precompile.artifact.kernel_payload import (
    WRAPPER_LIBRARY,
    count_objects,
    load_built_kernels,
    object_kind,
    read_payload,
    write_payload,
)
from torch_precompile.storage import cache_path

from conftest import run_python

FACTORY = """
import torch


def make():
    torch.manual_seed(0)
    return (lambda m, x: (m(x) * 2).relu()), (torch.nn.Linear(4, 2), torch.randn(3, 4))
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch_precompile", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(cwd)},
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny inductor pair (the default wrapper) for inference, compiled from the command
    line."""
    folder = tmp_path_factory.mktemp("reports")
    (folder / "factory.py").write_text(FACTORY)
    proc = _cli("compile", "factory:make", "-o", "model.py", "--inference", cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "model.py"


def _pair(path: Path) -> tuple[str, bytes]:
    code = path.read_text()
    return code, cache_path(path, code).read_bytes()


def _edited(code: str, cache: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``cache`` with its kernel payload edited; the compiled module kept."""
    fields = envelope.decode(signature.split(cache)[1])
    payload = read_payload(fields["artifact"])
    edit(payload)
    return envelope.pack(
        "inductor",
        code,
        write_payload(payload["fingerprint"], payload["kernels"]),
        fields.get("compiled"),
    )


def _flip(payload: dict[str, Any], *, keep_checksum: bool = True) -> None:
    entry = next(iter(payload["kernels"].values()))
    data = bytearray(entry["object"])
    data[len(data) // 2] ^= 0xFF
    entry["object"] = bytes(data)
    if not keep_checksum:  # a swapped object: bytes and checksum agree, the source's pin not
        entry["sha256"] = hashlib.sha256(entry["object"]).hexdigest()


def _drop(payload: dict[str, Any]) -> None:
    payload["kernels"].popitem()


EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "intact": lambda payload: None,
    "damaged": _flip,
    "swapped": lambda payload: _flip(payload, keep_checksum=False),
    "missing": _drop,
    "stale": lambda payload: payload["fingerprint"].update(torch_git="0" * 40),
}


def _saved(built: Path, folder: Path, edit: str, sign_key: bytes | None = None) -> Path:
    code, cache = _pair(built)
    return precompile.save(
        code, _edited(code, cache, EDITS[edit]), folder / "model.py", sign_key=sign_key
    )


# -- 1. prebuilt objects: counted and named as what they are, as a fresh load maps them --------

_FRESH_LOAD = """
    import json, sys, torch
    from torch_precompile import precompile
    from torch_precompile.artifact.kernel_payload import loaded_objects
    run = precompile.load_file({path!r})
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
    assert torch.allclose(run(model, x), (model(x) * 2).relu())
    print(json.dumps({{"loaded": sorted(loaded_objects().values()),
                      "inductor_imported": "torch._inductor" in sys.modules}}))
"""


def test_inspect_counts_what_a_fresh_load_maps_and_names_it(built: Path) -> None:
    _, cache = _pair(built)
    held = sorted(
        object_kind(e)
        for e in read_payload(envelope.decode(signature.split(cache)[1])["artifact"])[
            "kernels"
        ].values()
    )
    report = json.loads(_cli("inspect", "model.py", "--json", cwd=built.parent).stdout)
    assert sorted(k["kind"] for k in report["cache"]["kernels"]) == held
    if report["wrapper"] == "cpp":  # its kernels are compiled into the wrapper's library
        assert held == [WRAPPER_LIBRARY]
    assert report["load"]["prebuilt"] == count_objects(held) and report["load"]["to_build"] == 0
    text = _cli("inspect", "model.py", cwd=built.parent).stdout
    assert f"prebuilt  : {count_objects(held)}, " in text
    assert (
        f"load      : runs from the cache: maps {count_objects(held)} from the cache, "
        "builds nothing" in text
    )
    fresh = run_python(_FRESH_LOAD.format(path=str(built)))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert json.loads(fresh.stdout.splitlines()[-1]) == {"loaded": held, "inductor_imported": False}


def test_the_demo_note_counts_the_loaded_objects_and_checks_them_against_inspect(
    built: Path,
) -> None:
    from torch_precompile.demo import _prebuilt_note

    code, cache = _pair(built)
    held = sorted(judge(code, cache).prebuilt)
    note, agrees = _prebuilt_note(code, cache, {"loaded": held, "inductor_imported": False})
    assert agrees and f"{count_objects(held)} loaded from the cache, nothing built" in note
    note, agrees = _prebuilt_note(code, cache, {"loaded": [], "inductor_imported": True})
    assert not agrees and "MISMATCH: inspect says a load runs from the cache" in note
    assert "no prebuilt object loaded from the cache, built here" in note


# -- 2. inspect, verify and load: one judgement ------------------------------------------------


@pytest.mark.parametrize("edit", list(EDITS))
def test_the_judgement_is_what_load_built_kernels_does(edit: str, built: Path) -> None:
    code, cache = _pair(built)
    edited = _edited(code, cache, EDITS[edit])
    judged = judge(code, edited)
    try:
        mapped: Any = load_built_kernels(
            envelope.read(edited).acceleration, pins(precompile.inspect(code))
        )
    except PrecompileError as e:
        mapped = e
    if isinstance(mapped, PrecompileError):
        assert judged.refusal == str(mapped)
    else:
        assert judged.refusal is None and len(judged.prebuilt) == len(mapped)
        assert judged.to_build == len(precompile.inspect(code).kernels) - len(mapped)
    assert (judged.refusal is not None) == (edit == "swapped")
    assert (len(judged.prebuilt) > 0) == (edit == "intact")


_LOAD_AND_CALL = """
    import torch
    from torch_precompile import PrecompileError, precompile
    try:
        run = precompile.load_file({path!r})
    except PrecompileError as e:
        print("REFUSED", e)
    else:
        model, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
        print("RAN", torch.allclose(run(model, x), (model(x) * 2).relu()))
"""


def test_a_damaged_object_is_reported_as_load_treats_it(built: Path, tmp_path: Path) -> None:
    """Damaged bytes: a load warns, builds the object from the source and runs; the reports
    say exactly that, and nowhere that a load refuses the cache."""
    path = _saved(built, tmp_path, "damaged")
    shown = _cli("inspect", "model.py", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "load      : runs, but builds 1 object from the source" in shown.stdout
    assert "is unusable (its bytes are damaged" in shown.stdout
    assert "refuse" not in shown.stdout
    checked = _cli("verify", "model.py", cwd=tmp_path)
    assert checked.returncode == 1, checked.stdout
    assert "a load warns, skips it and builds it from the source" in checked.stdout
    loaded = run_python(_LOAD_AND_CALL.format(path=str(path)), timeout=600)
    assert loaded.stdout.strip() == "RAN True", loaded.stderr[-3000:]
    assert "is unusable (its bytes are damaged" in loaded.stderr


def test_a_foreign_object_is_refused_by_all_three_in_loads_words(
    built: Path, tmp_path: Path
) -> None:
    path = _saved(built, tmp_path, "swapped")
    loaded = run_python(_LOAD_AND_CALL.format(path=str(path)))
    assert loaded.stdout.startswith("REFUSED the cache holds a kernel object that is not one"), (
        loaded.stdout + loaded.stderr[-2000:]
    )
    refusal = loaded.stdout.removeprefix("REFUSED ").strip()
    report = json.loads(_cli("inspect", "model.py", "--json", cwd=tmp_path).stdout)
    assert report["load"]["refused"] and report["load"]["outcome"].endswith(refusal)
    checked = _cli("verify", "model.py", cwd=tmp_path)
    assert checked.returncode == 1 and f"FAILED: {refusal}" in checked.stdout


def test_a_pair_from_another_torch_build_is_reported_refused(built: Path, tmp_path: Path) -> None:
    code, _ = _pair(built)
    git = precompile.inspect(code).torch.git
    other = code.replace(git, "0" * len(git))  # the source (and so the pairing) changes too
    (tmp_path / "model.py").write_text(other)
    checked = _cli("verify", "model.py", cwd=tmp_path)
    assert checked.returncode == 1
    assert (
        f"this artifact was built with torch {torch.__version__} (git {'0' * 40})" in checked.stdout
    )


# -- 3. verify claims only the verification it did -----------------------------------------


@pytest.fixture(scope="module")
def eager_pair() -> tuple[str, bytes]:
    torch.manual_seed(0)
    return precompile(lambda m, x: m(x), torch.nn.Linear(4, 2), torch.randn(3, 4), backend="eager")


def test_verify_without_the_key_does_not_claim_a_signed_pair(eager_pair, tmp_path) -> None:
    precompile.save(*eager_pair, tmp_path / "model.py", sign_key=b"sekrit")
    (tmp_path / "key").write_bytes(b"sekrit\n")
    (tmp_path / "other").write_bytes(b"guess")
    unkeyed = _cli("verify", "model.py", cwd=tmp_path)
    assert unkeyed.returncode == 3, unkeyed.stdout + unkeyed.stderr
    assert "model.py: NOT verified: signed, signature unchecked" in unkeyed.stdout
    assert "pass the signing key with --key-file FILE" in unkeyed.stdout
    assert ": verified" not in unkeyed.stdout
    keyed = _cli("verify", "model.py", "--key-file", "key", cwd=tmp_path)
    assert keyed.returncode == 0 and "model.py: verified (signature valid)" in keyed.stdout
    wrong = _cli("verify", "model.py", "--key-file", "other", cwd=tmp_path)
    assert wrong.returncode == 1 and "signature does not match" in wrong.stdout


def test_verify_of_an_unsigned_pair(eager_pair, tmp_path) -> None:
    precompile.save(*eager_pair, tmp_path / "model.py")
    (tmp_path / "key").write_bytes(b"sekrit")
    plain = _cli("verify", "model.py", cwd=tmp_path)
    assert plain.returncode == 0
    assert "model.py: verified (unsigned: no signature to check)" in plain.stdout
    keyed = _cli("verify", "model.py", "--key-file", "key", cwd=tmp_path)
    assert keyed.returncode == 1 and "FAILED: the artifact is not signed" in keyed.stdout


# -- 5. the nearest variant is the closest shape -------------------------------------------


def _bucketed(tmp_path: Path, batches: tuple[int, ...]):
    model = torch.nn.Linear(3, 2).eval()
    with capture(lambda m, x: m(x), artifact_path=tmp_path / "v.py", backend="eager") as cap:
        for batch in batches:
            cap(model, torch.randn(batch, 3))
    return precompile.load(tmp_path / "v.py"), model


@pytest.mark.parametrize(
    ("batches", "call", "nearest", "expected"),
    [
        ((1, 4, 16), 5, 2, 4),
        ((1, 4, 16), 12, 3, 16),
        ((1, 4, 16), 2, 1, 1),
        ((6, 4), 5, 2, 4),  # a tie goes to the smaller variant, whatever the capture order
    ],
)
def test_the_nearest_variant_has_the_closest_shape(
    batches, call, nearest, expected, tmp_path: Path
) -> None:
    run, model = _bucketed(tmp_path, batches)
    with pytest.raises(PrecompileError) as refused:
        run(model, torch.randn(call, 3))
    assert (
        f"Nearest is variant {nearest} (closest input shapes): input x: expected shape "
        f"({expected}, 3), got ({call}, 3)"
    ) in str(refused.value)


def test_variants_of_python_values_fall_back_to_the_furthest_check(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    with capture(lambda m, x, s: m(x) * s, artifact_path=tmp_path / "v.py", backend="eager") as cap:
        for scale in (2.0, 3.0):
            cap(model, torch.randn(4, 3), scale)
    run = precompile.load(tmp_path / "v.py")
    with pytest.raises(
        PrecompileError,
        match=r"Nearest is variant 1 \(its checks got "
        r"furthest\)",
    ):
        run(model, torch.randn(4, 3), 5.0)
