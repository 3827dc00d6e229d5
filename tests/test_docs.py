"""The README and docs/ pages: every ```python block runs as printed, every relative link
resolves, and the README stays short.

The blocks of one page run in order, concatenated, in one fresh ``python`` process whose
working directory is a fresh temporary directory, with the environment ``torchrun`` gives
rank 0 of a one-process job (gloo on the loopback device), so distributed examples run too.
What a ``print(...)`` prints is compared with the comment after it (see ``Said``).
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import tokenize
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Said:
    """What a page's comment says a ``print(...)`` prints: the comment after the call, with the
    comment lines right below it at the same column (the printed text wrapped, or what later
    prints of the same call print); or, with none after the call, the comment lines right below
    it at its own column. The call must print, and what it printed match the comment.

    Whitespace and line breaks compare as one space. ``...`` stands for text left out (at the
    end: the rest of it), ``<...>`` for a value that varies (``<16 hex>``, ``<file>:<line>``),
    and a comment that opens with ``e.g.`` shows an example only. What was printed may be
    followed by a gloss: after ``: `` or ``, `` where it is a Python value's repr
    (``tensor(3.): the optimizer's own state``), or in parentheses at the end (``Torch not
    compiled with CUDA enabled (a CPU-only torch build)``)."""

    line: int  # of the call, in the page's script
    text: str

    def matches(self, printed: str) -> bool:
        printed = " ".join(printed.split())
        text = " ".join(self.text.split())
        parts = re.split(r"(\.\.\.|<[^<>\s][^<>]*>)", text.removesuffix("..."))
        pattern = "".join(".*?" if i % 2 else re.escape(part) for i, part in enumerate(parts))
        if re.fullmatch(pattern + (".*" if text.endswith("...") else ""), printed):
            return True
        if text.startswith(printed) and printed:
            gloss = text[len(printed) :]
            if re.fullmatch(r" \([^()]*\)", gloss):
                return True
            if re.match(r"[:,] ", gloss):
                try:
                    ast.parse(printed, mode="eval")
                except SyntaxError:
                    return False
                return True
        return False

    @property
    def compared(self) -> bool:
        return not self.text.startswith("e.g.")


def said_prints(script: str) -> list[Said]:
    """Each ``print(...)`` of ``script`` that a comment says the output of."""
    comments = {
        token.start[0]: token
        for token in tokenize.generate_tokens(io.StringIO(script).readline)
        if token.type == tokenize.COMMENT
    }
    lines = script.splitlines()
    found = []
    for node in ast.walk(ast.parse(script)):
        if not (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "print"
        ):
            continue
        end = node.end_lineno or node.lineno
        comment = comments.get(end)
        if comment is not None:
            column, said = comment.start[1], [comment.string[1:].strip()]
        else:  # the output in comment lines right below the call, at its column
            column, said = node.col_offset, []
        number = end + 1  # each comment line below, at that column: more of it
        while (
            number <= len(lines)
            and lines[number - 1][:column].strip() == ""
            and lines[number - 1][column:].startswith("#")
        ):
            said.append(lines[number - 1][column + 1 :].strip())
            number += 1
        if said:
            found.append(Said(node.lineno, " ".join(said)))
    return found


# Comments that say what the CPU-only torch build the tests use prints, and only it.
CPU_BUILD_ONLY = {"Torch not compiled with CUDA enabled (a CPU-only torch build)"}


# Imported by the page's script first: what each print() of the script's own lines printed,
# by line, written to $DOC_PRINTED at exit (only in the process that runs the script).
PRINT_RECORDER = """
import atexit, builtins, json, os, sys

_main = sys.modules["__main__"]
if _main.__name__ == "__main__":
    _files = {_main.__file__, os.path.abspath(_main.__file__)}
    _printed: dict[int, list[str]] = {}
    _print = builtins.print

    def _recorded(*values, sep=" ", end="\\n", file=None, flush=False):
        frame = sys._getframe(1)
        if file is None and frame.f_code.co_filename in _files:
            text = (" " if sep is None else sep).join(map(str, values))
            _printed.setdefault(frame.f_lineno, []).append(text)
        _print(*values, sep=sep, end=end, file=file, flush=flush)

    builtins.print = _recorded
    atexit.register(lambda: open(os.environ["DOC_PRINTED"], "w").write(json.dumps(_printed)))
"""


@pytest.mark.release_independent
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[page.name for page in PAGES_WITH_CODE])
def test_python_blocks_run_as_printed(page: Path, tmp_path: Path) -> None:
    """The page's python blocks, run together in a fresh process, exit 0, and each print the
    page shows the output of prints what its comment says (see ``Said``)."""
    folder, recorder = tmp_path / "page", tmp_path / "recorder"
    folder.mkdir()
    recorder.mkdir()
    (recorder / "doc_print_recorder.py").write_text(textwrap.dedent(PRINT_RECORDER))
    script = page_script(page)
    # The recorder is imported on the script's first line, so every line keeps its number.
    first, rest = script.split("\n", 1)
    (folder / f"{page.stem}.py").write_text(f"import doc_print_recorder  {first}\n{rest}")
    printed_file = tmp_path / "printed.json"
    path = os.pathsep.join([str(recorder), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, f"{page.stem}.py"],
        cwd=folder,
        env={**torchrun_env(), "PYTHONPATH": path, "DOC_PRINTED": str(printed_file)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{page.name} failed:\n{result.stderr[-5000:]}"
    import torch

    printed = {int(line): texts for line, texts in json.loads(printed_file.read_text()).items()}
    wrong = []
    for said in said_prints(script):
        if not said.compared or (said.text in CPU_BUILD_ONLY and torch.backends.cuda.is_built()):
            continue
        texts = printed.get(said.line, [])
        if not texts or not said.matches("\n".join(texts)):
            wrong.append(
                f"{page.name} script line {said.line}: printed {' / '.join(texts) or 'nothing'!r}"
                f"; the comment says {said.text!r}"
            )
    assert not wrong, "\n".join(wrong)


def test_a_print_comment_is_compared_as_the_pages_write_it() -> None:
    """``Said``'s reading of a comment: elisions, varying values, glosses, and what it refuses."""
    assert Said(1, "input x: expected device meta, got cpu.").matches(
        "input x: expected device meta,\n got cpu."
    )
    assert not Said(1, "input x: expected device meta, got cpu.").matches("input x")
    assert not Said(1, "got cpu.").matches("got cpu. More.")
    assert Said(1, "got cpu. ...").matches("got cpu. More.")
    assert Said(1, "fits none (...). Nearest is 2 ...").matches(
        "fits none (1; 2). Nearest is 2 (x)"
    )
    assert not Said(1, "at capture. ...").matches("at capture (each hook). The artifact")
    assert Said(1, "[..., 'model.<16 hex>.cache']").matches("['a.py', 'model.0123.cache']")
    assert Said(1, "tensor(3.): the state, stepped").matches("tensor(3.)")
    assert not Said(1, "tensor(3.): the state").matches("tensor(4.)")
    assert Said(1, "not compiled (a CPU-only build)").matches("not compiled")
    assert not Said(1, "e.g. (10, 0) eager").compared
    script = "print(1)  # 1\nx = 2\nprint(x)\n# 2\nprint(3)\n\n# a remark\n"
    assert said_prints(script) == [Said(1, "1"), Said(3, "2")]


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
