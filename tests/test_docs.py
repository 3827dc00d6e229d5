"""The README and docs/ pages: every ```python block runs as printed, every relative link
resolves, and the README stays short.

The blocks of one page run in order, concatenated, in one fresh ``python`` process whose
working directory is a fresh temporary directory, with the environment ``torchrun`` gives
rank 0 of a one-process job (gloo on the loopback device), so distributed examples run too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
QUICK_START_COMMANDS = ["make demo", "make test"]

FENCE = re.compile(r"^```(\S*)\s*$")
# [text](target): inline links; images and reference-style links are not used here.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def fenced_blocks(lines: list[str], language: str, where: str) -> list[tuple[int, str]]:
    """The fenced blocks of ``language`` in ``lines``: (line number its code starts at, code)."""
    blocks: list[tuple[int, str]] = []
    inside: str | None = None
    start, body = 0, []
    for number, line in enumerate(lines, start=1):
        if inside is None:
            match = FENCE.match(line)
            if match:
                inside, start, body = match.group(1), number + 1, []
        elif line.strip() == "```":
            if inside == language:
                blocks.append((start, "\n".join(body)))
            inside = None
        else:
            body.append(line)
    assert inside is None, f"{where}: the ``` block opened at line {start - 1} is not closed"
    return blocks


def code_blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """The page's fenced blocks of ``language``, with the line each one's code starts at."""
    return fenced_blocks(page.read_text().splitlines(), language, page.name)


def page_script(page: Path) -> str:
    """The page's python blocks in order, each behind a comment naming where it starts."""
    name = page.relative_to(ROOT)
    return "".join(
        f"# {name}, from line {start}\n{code}\n\n" for start, code in code_blocks(page, "python")
    )


def torchrun_env() -> dict[str, str]:
    """The environment torchrun gives rank 0 of one process, on the loopback device only."""
    return {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def markdown_outside_code(page: Path) -> str:
    """The page's text without its fenced blocks (a link inside code is not a link)."""
    kept: list[str] = []
    inside = False
    for line in page.read_text().splitlines():
        if (not inside and FENCE.match(line)) or (inside and line.strip() == "```"):
            inside = not inside
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


PAGES_WITH_CODE = [page for page in PAGES if code_blocks(page, "python")]


@pytest.mark.release_independent
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[page.name for page in PAGES_WITH_CODE])
def test_python_blocks_run_as_printed(page: Path, tmp_path: Path) -> None:
    """The page's python blocks, run together in a fresh process, exit 0."""
    script = tmp_path / f"{page.stem}.py"
    script.write_text(page_script(page))
    result = subprocess.run(
        [sys.executable, script.name],
        cwd=tmp_path,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{page.name} failed:\n{result.stderr[-5000:]}"


def test_relative_links_resolve() -> None:
    """Every relative link in the README and docs/ names a file that exists."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(markdown_outside_code(page)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_readme_is_short_with_a_two_command_quick_start() -> None:
    """The README has at most 300 lines; its Quick start runs `make demo` and `make test`."""
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    start = lines.index("## Quick start")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    blocks = fenced_blocks(lines[start:end], "sh", "README.md's Quick start")
    commands = [
        line.split("#", 1)[0].strip()
        for _, code in blocks
        for line in code.splitlines()
        if line.split("#", 1)[0].strip()
    ]
    assert commands == QUICK_START_COMMANDS, f"Quick start runs {commands}"


def test_artifact_page_names_the_section_holding_the_graph() -> None:
    """docs/artifact.md says which numbered section of the source holds the compiled graph
    (Inductor's generated module where Inductor built it): the number the source gives it."""
    import torch

    from torch_precompile import precompile

    code, _ = precompile(
        lambda m, x: m(x), torch.nn.Linear(4, 3), torch.randn(2, 4), backend="eager"
    )
    numbers = re.findall(r"^# (\d+)\. The compiled graph", code, flags=re.MULTILINE)
    assert len(numbers) == 1, numbers
    intro = (ROOT / "docs" / "artifact.md").read_text().split("```", 1)[0]
    said = re.findall(r"section (\d+)\s+\(the compiled graph\) holds Inductor's", intro)
    assert said == numbers, f"docs/artifact.md names section {said}, the source {numbers}"


def _make_dry_run(folder: Path, target: str) -> list[str]:
    """The commands ``make TARGET`` would run in ``folder`` (the repository's Makefile)."""
    proc = subprocess.run(
        ["make", "-n", "-f", str(ROOT / "Makefile"), target],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _stamped(folder: Path, *stamps: str) -> None:
    """``folder`` as a venv whose ``stamps`` were made after pyproject.toml was written."""
    bin_dir = folder / ".venv" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    os.utime(folder / "pyproject.toml", (1_000_000_000, 1_000_000_000))
    for stamp in stamps:
        (bin_dir / stamp).touch()


@pytest.mark.release_independent
def test_make_demo_installs_torch_and_the_package_only(tmp_path: Path) -> None:
    """`make demo` fills .venv with torch and the package, no dev extra; `make test` adds the
    extra to the same venv, in either order."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    base = "pip install -q -e ."
    dev = "pip install -q -e '.[dev]'"

    def installs(target: str) -> list[str]:
        return [c for c in _make_dry_run(tmp_path, target) if "pip install" in c]

    fresh_demo = installs("demo")
    assert any(c.endswith(base) for c in fresh_demo), fresh_demo
    assert not any("[dev]" in c for c in fresh_demo), fresh_demo
    fresh_test = installs("test")
    assert any(c.endswith(base) for c in fresh_test) and any(c.endswith(dev) for c in fresh_test)
    _stamped(tmp_path, ".installed-base")  # after make demo: make test adds the extra alone
    assert [c.split("/")[-1] for c in installs("test")] == [f"python -m {dev}"]
    _stamped(tmp_path, ".installed-base", ".installed")  # after make test: demo installs nothing
    assert installs("demo") == [] and installs("test") == []
