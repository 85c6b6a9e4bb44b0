"""The shape of zerojax's code, read at review (STYLE.md 10): the longest function, the largest
file, and every file over 400 lines and function over 60, each as file:line. A size is a prompt
to look again and split where the concepts part, never a gate to squeeze under, so this is a
report, not a test: it exits 0 whatever it finds.

    python scripts/checks/code_shape.py [REV]   (default: the working tree; REV: any git revision)

Lines of a function are its source lines (decorators and docstring included), from the AST.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60  # STYLE.md 10's "under ~400 lines", "a function over 60"


def sources(rev: str | None, root: Path = ROOT) -> dict[str, str]:
    """{path from `root`: text} of every .py file under root/zerojax, in the working tree or at `rev`."""
    if rev is None:
        return {str(p.relative_to(root)): p.read_text() for p in sorted((root / "zerojax").rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "zerojax"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=root, check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def function_lengths(source: str) -> list[tuple[int, str, int]]:
    """(line, name, lines) of every def and async def, decorators and docstring included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((start, node.name, node.end_lineno - start + 1))
    return sorted(out)


def report(files: dict[str, str]) -> list[str]:
    """The report's lines for {name: text}."""
    lines = {name: len(text.splitlines()) for name, text in files.items()}
    functions = sorted(((n, f"{name}:{line}: {function}") for name, text in files.items()
                        for line, function, n in function_lengths(text)), key=lambda f: (-f[0], f[1]))
    largest = max(lines, key=lambda name: (lines[name], name))
    long_files = [f"{name}: {n} lines" for name, n in sorted(lines.items()) if n > MAX_FILE_LINES]
    long_functions = [f"{where} ({n} lines)" for n, where in functions if n > MAX_FUNCTION_LINES]
    out = [f"{len(files)} files, {sum(lines.values())} lines, {len(functions)} functions",
           f"  longest function: {functions[0][1]} ({functions[0][0]} lines)" if functions else "  no functions",
           f"  largest file: {largest} ({lines[largest]} lines)",
           f"  functions over 40 lines: {sum(n > 40 for n, _ in functions)}",
           f"  files over {MAX_FILE_LINES} lines: {len(long_files)}", *(f"    {f}" for f in long_files),
           f"  functions over {MAX_FUNCTION_LINES} lines: {len(long_functions)}", *(f"    {f}" for f in long_functions)]
    return out


def main(rev: str | None = None) -> None:
    lines = report(sources(rev))
    print(f"{rev or 'working tree'}: {lines[0]}")
    print("\n".join(lines[1:]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
