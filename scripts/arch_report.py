"""The house's figures: import floors and circles of tailcut's top-level modules and packages
(grimp, ``TYPE_CHECKING`` imports included), files over 400 lines, functions over 60.

A floor is a level of the longest import path: a module that imports nothing of tailcut is
on floor 1, one that imports only floor-1 modules on floor 2, and so on.

    .venv/bin/python scripts/arch_report.py [src/tailcut]
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

import grimp


def _top(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative enough here)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main(root: Path) -> None:
    sys.setrecursionlimit(10_000)
    g = grimp.build_graph("tailcut", exclude_type_checking_imports=False)
    modules = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    tops: dict[str, set[str]] = {_top(m): set() for m in g.modules if m != "tailcut"}
    for m, imported in modules.items():
        for i in imported:
            if m != "tailcut" and i != "tailcut" and _top(m) != _top(i):
                tops[_top(m)].add(_top(i))

    @cache
    def floor(v: str) -> int:
        return 1 + max((floor(w) for w in tops[v]), default=0)

    print("module circles:", _cycles(modules) or "none")
    print("package circles:", _cycles(tops) or "none")
    floors = {v: floor(v) for v in tops} if not _cycles(tops) else {}
    print("import floors:", max(floors.values(), default=0))
    for f in sorted(set(floors.values()), reverse=True):
        print(f"  {f}:", " ".join(sorted(v for v in floors if floors[v] == f)))
    big, long_fns = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 400:
            big.append(f"{path} ({text.count(chr(10))})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 60:
                    long_fns.append(f"{path}:{node.lineno} {node.name} ({n})")
    for title, rows in (("files over 400 lines", big), ("functions over 60 lines", long_fns)):
        print(f"{title}: {len(rows)}")
        for row in rows:
            print("  " + row)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "src/tailcut"))
