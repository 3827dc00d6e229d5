"""What serving meets first: the cache found by content, a quiet notice, require_prebuilt."""

from __future__ import annotations

import json
import logging
import re
import shutil
import uuid
from pathlib import Path

import pytest

from torch_precompile import PrecompileError, capture, precompile, storage
from torch_precompile.artifact import envelope
from torch_precompile.prebuilt import VARIABLE, guard_namespace
from torch_precompile.runtime import LoadedArtifact, check_torch_build
from torch_precompile.shipped.kernel_loader import KernelBuildRefused, KernelLoader

from conftest import (
    assert_same,
    kernel_payload,
    poisoned_toolchain,
    run_python,
    with_kernel_payload,
)
from workloads import WORKLOADS

NAME = "mlp_infer"
KEY = b"serving key"
GOLDEN = Path(__file__).parent / "golden"
EXECUTING = "is executing python_code"


@pytest.fixture(scope="module")
def pairs(artifacts) -> dict[str, tuple[str, bytes]]:
    """The two inductor pairs of this file (C++ wrapper, Python wrapper) and an eager one,
    built for inference as a server builds them."""
    return {
        "cpp": artifacts.pair(NAME, "inductor", wrapper="cpp", inference=True),
        "python": artifacts.pair(NAME, "inductor", wrapper="python", inference=True),
        "eager": artifacts.pair(NAME, "eager", inference=True),
    }


def _runs(run) -> None:
    model, x = WORKLOADS[NAME].args()
    assert_same(run(model, x), WORKLOADS[NAME].fn(model, x))


def _without(code: str, cache: bytes, edit) -> tuple[bytes, list[str]]:
    """The cache with its kernel payload edited by ``edit``; the keys it removed."""
    payload = kernel_payload(code, cache)
    removed = edit(payload) or []
    return with_kernel_payload(code, payload), removed


def _drop_one(payload) -> list[str]:
    return [payload["kernels"].popitem()[0]]


def _fresh(code: str) -> str:
    """A source no load in this process has seen: the notice is said once per source."""
    return f"{code}# {uuid.uuid4().hex}\n"


def _no_cache_warnings(records) -> list[str]:
    return [r.getMessage() for r in records if "no cache" in r.getMessage()]


def test_the_cache_is_found_after_a_rename_and_a_copy(pairs, tmp_path, caplog) -> None:
    code, cache = pairs["cpp"]
    saved = precompile.save(code, cache, tmp_path / "mlp.py")
    cache_file = storage.cache_path(saved, code)
    renamed = saved.rename(tmp_path / "model_v2.py")
    copied = tmp_path / "copy.py"
    shutil.copy(renamed, copied)
    for source in (renamed, copied):
        assert storage.find_cache(source, code).found == cache_file
        with caplog.at_level(logging.WARNING, logger="torch_precompile"):
            # Refused if the cache were not found: an inductor load without it builds.
            _runs(precompile.load_file(source, require_prebuilt=True))
            _runs(precompile.load(str(source), require_prebuilt=True))
    assert _no_cache_warnings(caplog.records) == []


def test_a_version_1_cache_is_found_by_content(tmp_path) -> None:
    """Caches made before envelope version 2 (``torch.save`` archives) are told apart too."""
    ours, other = GOLDEN / "schema3-eager.artifact", GOLDEN / "schema4-eager.artifact"
    code = ours.read_text()
    shutil.copy(ours, tmp_path / "served.artifact")
    for name, source in (("b.cache", ours), ("a.cache", other)):
        shutil.copy(storage.find_cache(source, source.read_text()).found, tmp_path / name)
    assert (tmp_path / "a.cache").read_bytes().startswith(b"PK")  # a version-1 envelope
    assert storage.find_cache(tmp_path / "served.artifact", code).found == tmp_path / "b.cache"
    (tmp_path / "b.cache").unlink()
    assert storage.read_saved(tmp_path / "served.artifact").absence == (
        "no cache for served.artifact: a.cache beside it belongs to another source (made for "
        f"another sha256; this source's is {envelope.code_hash(code)[:12]}…)"
    )


def test_the_cache_a_capture_wrote_at_its_own_path_is_found(tmp_path, caplog) -> None:
    workload = WORKLOADS[NAME]
    source, cache_file = tmp_path / "step.py", tmp_path / "step.cache"
    with capture(
        workload.fn, artifact_path=source, cache_path=cache_file, backend="eager", sign_key=KEY
    ) as cap:
        cap(*workload.args())
    code = source.read_text()
    assert storage.find_cache(source, code).found == cache_file
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        # verify_key needs the cache (the signature is in it): found, and read past its
        # signature to the header.
        _runs(precompile.load_file(source, verify_key=KEY))
        _runs(precompile.load(source, verify_key=KEY))
    assert _no_cache_warnings(caplog.records) == []


def test_a_cache_of_another_source_is_named(pairs, tmp_path, caplog) -> None:
    code, cache = pairs["eager"]
    source, cache_file = tmp_path / "step.py", tmp_path / "step.cache"
    storage.save_pair(code, cache, source, cache_file)
    edited = _fresh(code)
    source.write_text(edited)  # the source changed; the cache is the old one's
    search = storage.find_cache(source, edited)
    assert search.found is None and [path for path, _ in search.others] == [cache_file]
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        _runs(precompile.load_file(source))
    expected = (
        f"no cache for step.py: step.cache beside it belongs to another source (made "
        f"for sha256 {envelope.code_hash(code)[:12]}…; this source's is "
        f"{envelope.code_hash(edited)[:12]}…); running from the source alone."
    )
    assert _no_cache_warnings(caplog.records) == [expected]

    inductor_code, inductor_cache = pairs["python"]
    storage.save_pair(inductor_code, inductor_cache, source, cache_file)
    source.write_text(pairs["cpp"][0])
    with pytest.raises(
        PrecompileError,
        match=r"require_prebuilt: no cache for step\.py: "
        r"step\.cache beside it belongs to another source",
    ):
        precompile.load_file(source, require_prebuilt=True)


def test_the_notice_is_said_once_per_source_and_silenced_by_the_logger_level(pairs, caplog) -> None:
    code, _ = pairs["eager"]
    first, second, silenced = _fresh(code), _fresh(code), _fresh(code)
    logger = logging.getLogger("torch_precompile")
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        for source in (first, first, second, first):
            precompile.load(source, None)
        said = [r for r in caplog.records if EXECUTING in r.getMessage()]
        assert [r.getMessage().split("sha256 ")[1][:12] for r in said] == [
            envelope.code_hash(first)[:12],
            envelope.code_hash(second)[:12],
        ]
        assert all(r.levelno == logging.WARNING and r.name == "torch_precompile" for r in said)
        caplog.clear()
        logger.setLevel(logging.ERROR)
        try:
            precompile.load(silenced, None)
        finally:
            logger.setLevel(logging.WARNING)
        assert [r for r in caplog.records if EXECUTING in r.getMessage()] == []


def test_the_notice_in_a_fresh_process(pairs, tmp_path) -> None:
    code, cache = pairs["eager"]
    path = precompile.save(code, cache, tmp_path / "m.py")
    proc = run_python(f"""
        import logging
        from torch_precompile import precompile
        for _ in range(3):
            precompile.load_file({str(path)!r})
        logging.getLogger("torch_precompile").setLevel(logging.ERROR)
        precompile.load(open({str(path)!r}).read() + "# another source\\n", None)
        print("LOADED")
    """)
    assert proc.returncode == 0 and "LOADED" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.count(EXECUTING) == 1, proc.stderr[-3000:]


def test_require_prebuilt_refuses_a_load_without_a_usable_cache(pairs, tmp_path) -> None:
    code, cache = pairs["cpp"]
    with pytest.raises(
        PrecompileError,
        match=r"require_prebuilt: no cache was given, so this "
        r"inductor artifact would build its 1 compiled object from its source",
    ):
        precompile.load(code, None, require_prebuilt=True)
    with pytest.raises(
        PrecompileError,
        match=r"require_prebuilt: the cache is unusable "
        r"\(precompile cache unreadable",
    ):
        precompile.load(code, b"not a cache", require_prebuilt=True)
    path = precompile.save(code, cache, tmp_path / "m.py")
    storage.cache_path(path, code).unlink()
    expected = f"no cache beside {path} (expected {storage.cache_path(path, code).name})"
    with pytest.raises(PrecompileError, match=re.escape(f"require_prebuilt: {expected}")):
        precompile.load_file(path, require_prebuilt=True)


def test_require_prebuilt_names_what_the_cache_lacks(pairs) -> None:
    code, cache = pairs["python"]
    count = len(kernel_payload(code, cache)["kernels"])
    assert count >= 1
    lacking, (key,) = _without(code, cache, _drop_one)
    with pytest.raises(
        PrecompileError,
        match=rf"lacks 1 of the {count} compiled objects this "
        rf"artifact names: C\+\+ kernel {key[:12]}… \(not in the cache\)",
    ):
        precompile.load(code, lacking, require_prebuilt=True)

    code, cache = pairs["cpp"]
    lacking, (key,) = _without(code, cache, _drop_one)
    with pytest.raises(
        PrecompileError,
        match=rf"lacks 1 of the 1 compiled objects this "
        rf"artifact names: C\+\+ wrapper library {key[:12]}…",
    ):
        precompile.load(code, lacking, require_prebuilt=True)
    stale, _ = _without(code, cache, lambda p: p["fingerprint"].update(torch_git="0" * 40))
    with pytest.raises(
        PrecompileError,
        match=r"lacks 1 of the 1 .*built for another machine "
        r"or torch \(torch_git",
    ):
        precompile.load(code, stale, require_prebuilt=True)
    with pytest.raises(PrecompileError, match="belongs to a different python_code"):
        precompile.load(pairs["python"][0], cache, require_prebuilt=True)


def test_require_prebuilt_loads_a_whole_pair_and_an_eager_artifact(pairs, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        for name in ("cpp", "python"):
            _runs(precompile.load(*pairs[name], require_prebuilt=True))
        code, _ = pairs["eager"]
        _runs(precompile.load(code, None, require_prebuilt=True))  # nothing to build
    assert not [r for r in caplog.records if "will be built" in r.getMessage()]


def test_the_environment_variable_is_read_at_each_load(pairs, monkeypatch) -> None:
    code, cache = pairs["cpp"]
    monkeypatch.setenv(VARIABLE, "1")
    with pytest.raises(PrecompileError, match="require_prebuilt: no cache was given"):
        precompile.load(code, None)
    _runs(precompile.load(code, cache))
    monkeypatch.setenv(VARIABLE, "sometimes")
    with pytest.raises(PrecompileError, match=rf"{VARIABLE}='sometimes' is not understood"):
        precompile.load(code, cache)


def test_the_kernel_loader_refuses_builds_when_told() -> None:
    refusing = KernelLoader({}, 0, prebuilt_only=True)
    with pytest.raises(KernelBuildRefused, match=r"C\+\+ kernel [0-9a-f]{12}…"):
        refusing.cpp_pybinding(["float*"], "void kernel() {}")
    with pytest.raises(KernelBuildRefused, match=r"C\+\+ wrapper library [0-9a-f]{12}…"):
        refusing.load_pybinding(["std::vector<AtenTensorHandle>"], "int main() {}")
    with pytest.raises(KernelBuildRefused, match="asks Inductor for 'triton' kernels"):
        getattr(refusing, "triton")  # noqa: B009 - the attribute read is the request
    # In an artifact the flag comes through the namespace load fills.
    import torch_precompile.shipped.kernel_loader as module

    namespace = {"PRECOMPILED_KERNELS_ONLY": True}
    exec(compile(Path(module.__file__).read_text(), module.__file__, "exec"), namespace)
    assert namespace["KernelLoader"]({}, 0).prebuilt_only
    assert not KernelLoader({}, 0).prebuilt_only

    def refused_at_call() -> None:
        refusing.cpp_pybinding(["float*"], "void kernel() {}")

    # At call time too, the loader's refusal reaches the caller as PrecompileError.
    artifact = LoadedArtifact(
        refused_at_call, precompile.inspect((GOLDEN / "schema8-eager.artifact").read_text())
    )
    with pytest.raises(PrecompileError, match=r"require_prebuilt: this artifact's C\+\+ kernel"):
        artifact()


def test_older_artifacts_refuse_through_their_kernel_table() -> None:
    """A loader made before require_prebuilt ignores the flag; its table refuses instead."""
    namespace = {"PRECOMPILED_KERNELS": {"present": print}}
    guard_namespace("an artifact whose loader predates the flag", namespace)
    assert namespace["PRECOMPILED_KERNELS"].get("present") is print
    with pytest.raises(PrecompileError, match="asks for kernel absent"):
        namespace["PRECOMPILED_KERNELS"].get("absent")
    namespace = {"PRECOMPILED_KERNELS": {}}
    guard_namespace("... PRECOMPILED_KERNELS_ONLY ...", namespace)
    assert (
        type(namespace["PRECOMPILED_KERNELS"]) is dict
        and namespace["PRECOMPILED_KERNELS_ONLY"] is True
    )
    # A golden pair of schema 2 names no kernels: strict, its cache's objects are all judged.
    source = GOLDEN / "schema2-inductor.artifact"
    saved = storage.read_saved(source)
    assert saved.cache is not None and saved.absence is None  # found by its name
    spec = precompile.inspect(saved.code)
    try:
        check_torch_build(spec)
    except PrecompileError:
        pytest.skip("the golden pairs were made under another torch build")
    stale, _ = _without(
        saved.code, saved.cache, lambda p: p["fingerprint"].update(torch_git="0" * 40)
    )
    with pytest.raises(
        PrecompileError,
        match=r"require_prebuilt: the cache's objects were "
        r"built for another machine or torch \(torch_git",
    ):
        precompile.load(saved.code, stale, require_prebuilt=True)


SERVE = """
    import json
    from torch_precompile import PrecompileError, precompile
    from workloads import WORKLOADS
    import torch
    model, x = WORKLOADS["mlp_infer"].args()
    run = precompile.load_file({renamed!r})  # strict by the environment, cache found by content
    torch.testing.assert_close(run(model, x), WORKLOADS["mlp_infer"].fn(model, x))
    try:
        precompile.load(open({renamed!r}).read(), open({lacking!r}, "rb").read())
        refused = None
    except PrecompileError as e:
        refused = str(e)
    precompile.load(open({eager!r}).read(), None)  # an eager artifact builds nothing
    print(json.dumps({{"refused": refused}}))
"""


def test_the_environment_variable_in_a_fresh_process(pairs, tmp_path) -> None:
    code, cache = pairs["cpp"]
    renamed = precompile.save(code, cache, tmp_path / "mlp.py").rename(tmp_path / "serve.py")
    lacking, (key,) = _without(code, cache, _drop_one)
    (tmp_path / "elsewhere").mkdir()  # not beside the source: this one is passed explicitly
    (tmp_path / "elsewhere" / "lacking.cache").write_bytes(lacking)
    (tmp_path / "eager.py").write_text(pairs["eager"][0])
    env, marker = poisoned_toolchain(tmp_path)
    proc = run_python(
        SERVE.format(
            renamed=str(renamed),
            lacking=str(tmp_path / "elsewhere" / "lacking.cache"),
            eager=str(tmp_path / "eager.py"),
        ),
        env={**env, VARIABLE: "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = json.loads(proc.stdout.strip().splitlines()[-1])["refused"]
    assert refused is not None and f"C++ wrapper library {key[:12]}…" in refused, refused
    assert not marker.exists(), marker.read_text()
