"""The source layout a reader relies on (docs/design.md, "Source layout"): the
package's modules import each other without a circle, and the environment is
read in one place of the C code (MASKED_ATTN_ISA, common/isa.c)."""

import ast
import os
import re

import torch_masked_attn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the package the tests import: the checkout's, or an installed wheel's (make test-wheel)
PKG = os.path.dirname(os.path.abspath(torch_masked_attn.__file__))


def _import_graph():
    """module -> the package modules it imports (relative imports, at any depth in the file)."""
    graph = {}
    for name in sorted(os.listdir(PKG)):
        if not name.endswith(".py"):
            continue
        deps = set()
        with open(os.path.join(PKG, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        graph[name[:-3]] = deps - {"__init__"}
    return graph


def _cycles(graph):
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_package_imports_have_no_circle():
    graph = _import_graph()
    assert {"ops", "functional", "losses", "linear_ce", "modules", "autocast", "devices", "hf"} <= set(graph)
    assert _cycles(graph) == []
    # the checker itself finds a circle where there is one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_environment_read_in_one_place():
    readers = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for name in files:
            if name.endswith((".c", ".h", ".cpp", ".hpp")):
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    if re.search(r"\bgetenv\s*\(", f.read()):
                        readers.append(os.path.relpath(os.path.join(dirpath, name), ROOT))
    assert readers == ["csrc/common/isa.c"]
