"""The shape of zerojax's code: the longest function, the largest file, functions over 40 lines.

    python scripts/checks/code_shape.py [REV]   (default: the working tree; REV: any git revision)

Lines of a function are its source lines (decorators and docstring included), from the AST.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sources(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "zerojax").rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "zerojax"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def main(rev: str | None = None) -> None:
    files, functions = sources(rev), []
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                functions.append((node.end_lineno - start + 1, f"{name}:{node.name}"))
    lines = {name: len(text.splitlines()) for name, text in files.items()}
    largest = max(lines, key=lines.get)
    functions.sort(reverse=True)
    print(f"{rev or 'working tree'}: {len(files)} files, {sum(lines.values())} lines, {len(functions)} functions")
    print(f"  longest function: {functions[0][1]} ({functions[0][0]} lines)")
    print(f"  largest file: {largest} ({lines[largest]} lines)")
    print(f"  functions over 40 lines: {sum(n > 40 for n, _ in functions)}")
    print(f"  files over 300 lines: {', '.join(f'{n} ({k})' for n, k in lines.items() if k > 300) or 'none'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
