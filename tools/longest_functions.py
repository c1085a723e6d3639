#!/usr/bin/env python3
"""The package's longest Python functions (ast-based).

    python tools/longest_functions.py [--limit N (default 80)] [--all] [paths...]

A function's length is its lines from ``def`` to its last line, docstring and
nested functions included (decorators not). Lists every function over the
limit, longest first, as ``lines (docstring lines)  path:line  qualified.name``;
``--all`` lists every function. Paths default to the package, torch_masked_attn/.
tests/project/test_source_layout.py holds the package to the limit (its exceptions
named there, each with its reason).
"""

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 80


def _doc_lines(node):
    """The lines of a function's docstring (0 without one)."""
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def functions(path):
    """(lines, lineno, qualified name, docstring lines) of every function in the file at path,
    methods and nested functions included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((child.end_lineno - child.lineno + 1, child.lineno, name, _doc_lines(child)))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def package_functions(paths):
    """(lines, relative path, lineno, qualified name, docstring lines) of every function under
    paths (.py files), longest first."""
    out = []
    for top in paths:
        files = [top] if top.endswith(".py") else []
        for dirpath, _, names in os.walk(top):
            files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py")]
        for path in files:
            rel = os.path.relpath(path, ROOT)
            out += [(n, rel, line, name, doc) for n, line, name, doc in functions(path)]
    return sorted(out, key=lambda t: (-t[0], t[1], t[2]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=LIMIT)
    p.add_argument("--all", action="store_true", help="every function, not only those over the limit")
    p.add_argument("paths", nargs="*", default=[os.path.join(ROOT, "torch_masked_attn")])
    a = p.parse_args(argv)
    rows = package_functions(a.paths)
    over = [r for r in rows if r[0] > a.limit]
    for n, rel, line, name, doc in rows if a.all else over:
        print(f"{n:5d} ({doc:3d})  {rel}:{line}  {name}")
    print(f"{len(over)} function(s) over {a.limit} lines", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
