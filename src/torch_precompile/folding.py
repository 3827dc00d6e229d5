"""Runs of items alike but for numbers that step, as a deep model's artifact is full of.

A stack of blocks gives the artifact one record, check line and piece call per block tensor,
submodule and call: ``'3.ln1.weight'`` and ``tensors[48]`` in one, ``'4.ln1.weight'`` and
``tensors[64]`` in the next. ``find_runs`` finds each run of groups of items that repeat but
for numbers growing by a fixed step; ``fold_lines`` writes such a run of source lines once,
in a loop (``spec.literal`` writes a run of spec records once, with its steps). Every fold is
checked against the items it stands for, number by number, before it is used.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch_precompile.shipped.driver.folds import stepping_digits

MIN_REPEATS = 3  # two alike blocks are written out: a loop would not be shorter
MIN_LINES_SAVED = 4  # a loop must be this much shorter than the lines it stands for


@dataclass(frozen=True)
class Pattern:
    """An item as its shape (everything but its numbers) and its numbers, in order."""

    shape: Hashable
    numbers: tuple[int, ...]


@dataclass(frozen=True)
class Run:
    """Items ``start`` to ``start + period * repeats``: ``repeats`` groups of ``period``
    items, the numbers of item ``j`` of group ``r`` those of group 0's plus ``r * steps[j]``."""

    start: int
    period: int
    repeats: int
    steps: tuple[tuple[int, ...], ...]

    @property
    def end(self) -> int:
        return self.start + self.period * self.repeats


def find_runs(patterns: Sequence[Pattern | None], min_repeats: int = MIN_REPEATS) -> list[Run]:
    """The runs of ``patterns`` (None: an item that never folds), left to right, each the
    longest that starts where it does (the shortest period among equals)."""
    runs: list[Run] = []
    start = 0
    while start < len(patterns):
        best = _longest_run(patterns, start, min_repeats)
        if best is None:
            start += 1
            continue
        runs.append(best)
        start = best.end
    return runs


def _longest_run(patterns: Sequence[Pattern | None], start: int, least: int) -> Run | None:
    first = patterns[start]
    if first is None:
        return None
    best: Run | None = None
    left = len(patterns) - start
    for period in range(1, left // least + 1):
        covered = 0 if best is None else best.period * best.repeats
        other = patterns[start + period]
        if other is None or other.shape != first.shape or left // period * period <= covered:
            continue  # (the last: no run of this period could cover more)
        run = _run(patterns, start, period)
        if run is not None and run.repeats >= least and run.period * run.repeats > covered:
            best = run
    return best


def _run(patterns: Sequence[Pattern | None], start: int, period: int) -> Run | None:
    """The run of groups of ``period`` from ``start``, its steps those of its first two."""
    first = patterns[start : start + period]
    second = patterns[start + period : start + 2 * period]
    steps = []
    for a, b in zip(first, second, strict=True):
        if a is None or b is None or a.shape != b.shape:
            return None
        steps.append(tuple(y - x for x, y in zip(a.numbers, b.numbers, strict=True)))
    repeats = 2
    while start + (repeats + 1) * period <= len(patterns):
        group = patterns[start + repeats * period : start + (repeats + 1) * period]
        if not all(
            p is not None
            and a is not None
            and p.shape == a.shape
            and all(
                n == x + repeats * s for n, x, s in zip(p.numbers, a.numbers, step, strict=True)
            )
            for p, a, step in zip(group, first, steps, strict=True)
        ):
            break
        repeats += 1
    return Run(start, period, repeats, tuple(steps))


# Source lines


@dataclass(frozen=True)
class _Slot:
    """A number of a line: a bare integer, or a run of digits in a string literal."""

    in_string: bool
    bare: bool  # a bare integer whose neighbours let an expression stand without parentheses


@dataclass(frozen=True)
class _Line:
    parts: tuple[str | _Slot, ...]  # text, and the numbers' places
    numbers: tuple[int, ...]
    strings: tuple[tuple[int, int], ...]  # the parts of each string literal: (first, end)
    element: bool  # an element of a bracketed list, not a statement


def fold_lines(lines: Sequence[str]) -> list[str]:
    """``lines`` (whole statements, one a line, and elements of lists, one a line, as the
    artifact's generated functions hold them) with each run of at least ``MIN_REPEATS``
    alike groups of lines written once in a ``for`` loop (statements) or a starred generator
    (list elements). Lines that do not parse alone are left as they are."""
    tokens = _tokens(lines)
    if tokens is None:
        return list(lines)
    parsed = _parsed_lines(lines, tokens)
    names = {t.string for t in tokens if t.type == tokenize.NAME}
    counter = _free_name("k", names)
    item = _free_name("item", names)
    patterns = [
        None if p is None else Pattern(_shape(lines[i], p), p.numbers) for i, p in enumerate(parsed)
    ]
    out: list[str] = []
    at = 0
    for run in find_runs(patterns):
        group = [parsed[run.start + j] for j in range(run.period)]
        if any(g is None for g in group) or len({g.element for g in group if g}) != 1:
            continue
        folded = _folded(lines, run, [g for g in group if g], counter, item)
        if run.period * run.repeats - len(folded) < MIN_LINES_SAVED:
            continue
        out += [*lines[at : run.start], *folded]
        at = run.end
    out += lines[at:]
    try:
        ast.parse("\n".join(out))
    except SyntaxError:
        return list(lines)
    return out


def _shape(line: str, parsed: _Line) -> Hashable:
    indent = len(line) - len(line.lstrip())
    return (indent, parsed.element, parsed.parts, parsed.strings)


def _free_name(stem: str, taken: set[str]) -> str:
    """``stem``, or ``stem`` with the fewest underscores after it that ``taken`` lacks."""
    name = stem
    while name in taken:
        name += "_"
    return name


def _tokens(lines: Sequence[str]) -> list[tokenize.TokenInfo] | None:
    try:
        return list(tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return None


def _parsed_lines(lines: Sequence[str], tokens: list[tokenize.TokenInfo]) -> list[_Line | None]:
    """Each line as text and numbers; None for a line that cannot fold."""
    by_line: dict[int, list[tokenize.TokenInfo]] = {}
    depth_at: dict[int, str] = {}
    opened: list[str] = []
    for token in tokens:
        row = token.start[0]
        depth_at.setdefault(row, opened[-1] if opened else "")
        by_line.setdefault(row, []).append(token)
        if token.type == tokenize.OP and token.string in "([{":
            opened.append(token.string)
        elif token.type == tokenize.OP and token.string in ")]}" and opened:
            opened.pop()
    return [
        _parsed(line, by_line.get(row, []), depth_at.get(row, ""))
        for row, line in enumerate(lines, 1)
    ]


_SIMPLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.Delete, ast.Assert, ast.Pass)
_LATE = (ast.Lambda, ast.GeneratorExp, ast.Yield, ast.YieldFrom, ast.Await, ast.JoinedStr)
_OPENING = {"", "(", "[", ",", ":", "="}
_CLOSING = {"", ")", "]", ",", ":"}


def _parsed(line: str, tokens: list[tokenize.TokenInfo], bracket: str) -> _Line | None:
    text = line.strip()
    element = bracket != ""
    if not text or not _one_line(text, element, bracket):
        return None
    code = [t for t in tokens if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
    code = [t for t in code if t.type not in (tokenize.INDENT, tokenize.DEDENT)]
    if any(t.start[0] != t.end[0] for t in code):
        return None
    parts: list[str | _Slot] = []
    numbers: list[int] = []
    strings: list[tuple[int, int]] = []
    column = 0
    for i, token in enumerate(code):
        start, end = token.start[1], token.end[1]
        parts.append(line[column:start])
        column = end
        if (
            token.type == tokenize.NUMBER
            and token.string.isdigit()
            and stepping_digits(token.string)
        ):
            before = code[i - 1].string if i > 0 else ""
            after = code[i + 1].string if i + 1 < len(code) else ""
            parts.append(_Slot(False, before in _OPENING and after in _CLOSING))
            numbers.append(int(token.string))
        elif (
            token.type == tokenize.STRING
            and token.string[0] in "'\""
            and token.string[:3] not in ('"""', "'''")
        ):
            first = len(parts)
            body = token.string
            at = 0
            for match in stepping_digits(body):
                parts.append(body[at : match.start()])
                parts.append(_Slot(True, False))
                numbers.append(int(match[0]))
                at = match.end()
            parts.append(body[at:])
            strings.append((first, len(parts)))
        else:
            parts.append(token.string)
    parts.append(line[column:])
    return _Line(tuple(parts), tuple(numbers), tuple(strings), element)


def _one_line(text: str, element: bool, bracket: str) -> bool:
    """Whether ``text`` is one simple statement, or (``element``) one list element."""
    try:
        if element:
            if bracket != "[" or not text.endswith(","):
                return False
            tree: ast.AST = ast.parse(text[:-1], mode="eval")
        else:
            module = ast.parse(text)
            if len(module.body) != 1 or not isinstance(module.body[0], _SIMPLE):
                return False
            tree = module
    except SyntaxError:
        return False
    return not any(isinstance(node, _LATE) for node in ast.walk(tree))


def _folded(
    lines: Sequence[str], run: Run, group: list[_Line], counter: str, item: str
) -> list[str]:
    """The run as a loop; the original lines where the loop would not stand for them."""
    for r in range(run.repeats):
        for j, line in enumerate(group):
            numbers = [n + r * s for n, s in zip(line.numbers, run.steps[j], strict=True)]
            if (
                _written(line, [str(n) for n in numbers], False)
                != lines[run.start + r * run.period + j]
            ):
                return list(lines[run.start : run.end])
    first = _first(group, run.steps)
    bodies = []
    for j, line in enumerate(group):
        exprs = [
            str(n) if s == 0 else _expression(n - s * first, s, counter)
            for n, s in zip(line.numbers, run.steps[j], strict=True)
        ]
        bodies.append(_written(line, exprs, True).strip())
    indent = lines[run.start][: len(lines[run.start]) - len(lines[run.start].lstrip())]
    counted = (
        f"for {counter} in range({first}, {first + run.repeats})"
        if first
        else f"for {counter} in range({run.repeats})"
    )
    if not group[0].element:
        return [f"{indent}{counted}:", *(f"{indent}    {b}" for b in bodies)]
    if len(bodies) == 1:
        return [
            f"{indent}*(",
            f"{indent}    {bodies[0][:-1]}",
            f"{indent}    {counted}",
            f"{indent}),",
        ]
    return [
        f"{indent}*(",
        f"{indent}    {item}",
        f"{indent}    {counted}",
        f"{indent}    for {item} in (",
        *(f"{indent}        {b}" for b in bodies),
        f"{indent}    )",
        f"{indent}),",
    ]


def _first(group: list[_Line], steps: tuple[tuple[int, ...], ...]) -> int:
    """Where the loop's counter starts: the value that makes most stepping numbers a plain
    multiple of the counter (``'{k}.ln1.weight'``, ``tensors[16 * k]``), else 0."""
    starts = Counter(
        n // s
        for line, step in zip(group, steps, strict=True)
        for n, s in zip(line.numbers, step, strict=True)
        if s > 0 and n % s == 0
    )
    return max(0, starts.most_common(1)[0][0]) if starts else 0


def _expression(constant: int, step: int, counter: str) -> str:
    term = counter if step == 1 else f"{step} * {counter}"
    if step < 0:
        term = f"-{counter}" if step == -1 else f"-{-step} * {counter}"
        return term if constant == 0 else f"{constant} - {term[1:]}"
    if constant == 0:
        return term
    return f"{term} + {constant}" if constant > 0 else f"{term} - {-constant}"


def _written(line: _Line, numbers: list[str], as_code: bool) -> str:
    """``line`` with its numbers written in: as digits, or (``as_code``) as the expressions
    given, strings that hold one becoming f-strings."""
    values = iter(numbers)
    texts: dict[int, str] = {}
    for index, part in enumerate(line.parts):
        if isinstance(part, str):
            texts[index] = part
            continue
        value = next(values)
        if not as_code or value.isdigit():
            texts[index] = value
        elif part.in_string:
            texts[index] = "{" + value + "}"
        else:
            texts[index] = value if part.bare or value.isidentifier() else f"({value})"
    for first, end in line.strings:
        if not as_code or not any(
            isinstance(line.parts[i], _Slot) and not texts[i].isdigit() for i in range(first, end)
        ):
            continue
        for i in range(first, end):
            if isinstance(line.parts[i], str):
                texts[i] = texts[i].replace("{", "{{").replace("}", "}}")
        texts[first] = "f" + texts[first]
    return "".join(texts[index] for index in range(len(line.parts)))
