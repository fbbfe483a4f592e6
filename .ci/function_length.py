"""The gate's "no function over 60 lines": lists every longer function and exits 1 if there is one.

    .venv/bin/python .ci/function_length.py [--max 60] [FILE ...]

A function's length is its lines from `def` (decorators not counted) to its last line, docstring and
blank lines included, as the reader meets it; a nested function counts in its parent and on its own.
Without FILE it checks the project's Python: the top-level scripts, launchd/, bench/, docs/reference.py
and .ci/ (not tests/: a test is one scenario told in order). Reads no env.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GATED = ("*.py", "launchd/*.py", "bench/*.py", "docs/*.py", ".ci/*.py")


def long_functions(path: Path, limit: int) -> list[tuple[int, str, int]]:
    """(lines, qualified name, first line) of each function in ``path`` longer than ``limit`` lines.

    Raises SyntaxError when the file does not parse and OSError when it cannot be read."""
    found: list[tuple[int, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}."
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > limit:
                    found.append((lines, name[:-1], child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def gated_files() -> list[Path]:
    """The project's Python files the gate checks, sorted, relative to the repository root."""
    files = {p.relative_to(ROOT) for pattern in GATED for p in ROOT.glob(pattern)}
    return sorted(files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--max", type=int, default=60, help="the most lines a function may have (default 60)")
    parser.add_argument("files", nargs="*", type=Path, help="files to check (default: the gated project files)")
    args = parser.parse_args()
    offenders = []
    for path in args.files or [ROOT / p for p in gated_files()]:
        try:
            offenders += [(lines, path, name, line) for lines, name, line in long_functions(path, args.max)]
        except (OSError, SyntaxError) as exc:
            print(f"{path}: cannot check it: {exc}", file=sys.stderr)
            return 2
    for lines, path, name, line in sorted(offenders, key=lambda row: -row[0]):
        where = path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path
        print(f"{where}:{line}: {name} has {lines} lines (max {args.max}): split it into named steps")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
