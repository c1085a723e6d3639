"""The source layout a reader relies on (docs/design.md, "Source layout"): the
package's modules import each other without a circle, no Python function of it
is longer than 80 lines (but those named with a reason), and the environment is
read in one place of the C code (MASKED_ATTN_ISA, common/isa.c)."""

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

import torch_masked_attn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the package the tests import: the checkout's, or an installed wheel's (make test-wheel)
PKG = os.path.dirname(os.path.abspath(torch_masked_attn.__file__))


def _import_graph():
    """module -> the package modules it imports (relative imports, at any depth in the file);
    a subpackage's modules by dotted name ("hf" its __init__.py, "hf._compat")."""
    graph = {}
    for dirpath, _, files in os.walk(PKG):
        package = [p for p in os.path.relpath(dirpath, PKG).split(os.sep) if p != "."]
        for name in sorted(f for f in files if f.endswith(".py")):
            deps = set()
            with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level >= 1:
                    base = package[: len(package) - (node.level - 1)]
                    names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                    deps.update(".".join([*base, n]) for n in names)
            module = ".".join(package) if name == "__init__.py" and package else ".".join([*package, name[:-3]])
            graph[module] = deps - {"__init__"}
    return graph


def test_import_loads_neither_dynamo_nor_transformers():
    """`import torch_masked_attn` costs what `import torch` costs, not seconds more: nothing it
    loads at import reaches torch._dynamo (torch.nn.attention.bias does) or transformers (hf
    is imported when used). A fresh interpreter, so that no other test's imports count."""
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import torch_masked_attn, torch_masked_attn.functional, torch_masked_attn.flash_attn\n"
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'transformers' "
        "or m.startswith(('torch._dynamo', 'torch.nn.attention.bias'))))"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(PKG)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["[]"], out.stdout[-2000:]


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
    assert {"ops", "functional", "losses", "linear_ce", "modules", "autocast", "devices", "hf", "hf._compat"} <= set(
        graph
    )
    assert {"functional", "ops", "hf._compat"} <= graph["hf"]
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


FUNCTION_LINES = 80
# The functions allowed past FUNCTION_LINES (path in the package:qualified name), each with why.
LONGER_FUNCTIONS = {
    "functional.py:masked_attention": "its docstring (58 lines) is the reference of the op's conventions, "
    "every argument's; its signature 20 lines; its code under 50",
}


def test_functions_under_80_lines():
    """No function of the package (methods and nested functions too) is longer than 80 lines from
    def to its last line, docstring included (tools/longest_functions.py lists them), but those
    LONGER_FUNCTIONS names; each of those is longer (the list does not go stale) and its code
    without the docstring is not."""
    spec = importlib.util.spec_from_file_location(
        "longest_functions", os.path.join(ROOT, "tools", "longest_functions.py")
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    lines = {}
    for dirpath, _, files in os.walk(PKG):
        for name in sorted(f for f in files if f.endswith(".py")):
            rel = os.path.relpath(os.path.join(dirpath, name), PKG).replace(os.sep, "/")
            for n, _, qualname, doc in tool.functions(os.path.join(dirpath, name)):
                lines[f"{rel}:{qualname}"] = (n, doc)
    assert "flash_attn.py:flash_attn_with_kvcache" in lines and "modules.py:MultiheadAttention.forward" in lines
    over = {f: n for f, (n, _) in lines.items() if n > FUNCTION_LINES and f not in LONGER_FUNCTIONS}
    assert not over, f"functions over {FUNCTION_LINES} lines (split them, or name them in LONGER_FUNCTIONS): {over}"
    for f in LONGER_FUNCTIONS:
        assert f in lines, f"LONGER_FUNCTIONS names {f}, which the package does not define"
        n, doc = lines[f]
        assert n > FUNCTION_LINES, f"{f} is {n} lines now: drop it from LONGER_FUNCTIONS"
        assert n - doc <= FUNCTION_LINES, f"{f}: {n - doc} lines besides its docstring"


ATTENTION_OPS = ("forward", "backward", "backward_into", "varlen_forward", "varlen_backward")


def test_attention_options_declared_once():
    """The options all five attention ops take end every schema, identically
    (declared once, csrc/shim/options.cpp), and are what ops.AttnOptions
    hands the ops; ALiBi, the example of such an option, is named only where
    an option of its kind must be (docs/design.md, "The options object")."""
    import torch

    def tail(op):
        args = getattr(torch.ops.masked_attn, op).default._schema.arguments
        return [(a.name, str(a.type), a.default_value) for a in args]

    tails = {op: tail(op) for op in ATTENTION_OPS}
    n = min(len(t) for t in tails.values())
    common = 0  # the longest common suffix
    while common < n and len({tuple(t[len(t) - 1 - common]) for t in tails.values()}) == 1:
        common += 1
    shared = [name for name, _, _ in tails["forward"][len(tails["forward"]) - common :]]
    opts = torch_masked_attn.ops.AttnOptions(
        window=(1, 2), softcap=1.0, sinks=torch.zeros(2), alibi_slopes=torch.zeros(2), diagonal=3
    ).op_args()
    assert shared == ["window_left", "window_right", "softcap", "sinks", "alibi_slopes", "diagonal"]
    assert set(shared) <= set(opts)
    readers = set()
    for top in ("csrc", "torch_masked_attn"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".c", ".h", ".cpp", ".hpp", ".py")):
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        if "alibi" in f.read().lower():
                            readers.add(os.path.relpath(os.path.join(dirpath, name), ROOT))
    assert readers == {
        "csrc/masked_attn.h",
        "csrc/attention/attention_tmpl.h",
        "csrc/attention/shared_tmpl.h",
        "csrc/shim/options.cpp",
        "torch_masked_attn/ops.py",  # the ops' reference names the options
        "torch_masked_attn/_options.py",
        "torch_masked_attn/functional.py",
        "torch_masked_attn/flash_attn.py",
        # vLLM hands its attention impls alibi_slopes (by position: the seam names the order)
        "torch_masked_attn/vllm/_compat.py",
        "torch_masked_attn/vllm/backend.py",
    }


# manylinux_2_28 (PyTorch's own wheels' floor): the newest symbol version of each system library
# the extension may need (auditwheel's policy for manylinux_2_28)
GLIBC_FLOOR = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}


def test_extension_needs_no_newer_glibc_than_torch():
    """The built extension references no symbol version newer than manylinux_2_28 allows, so its
    wheel installs wherever torch's does (csrc/common/glibc_compat.h: exp and log bound to their
    old versions, float16 conversions in integers, libstdc++'s single-thread flag renamed)."""
    if not sys.platform.startswith("linux") or not shutil.which("objdump"):
        pytest.skip("objdump on Linux reads the symbol versions")
    so = [f for f in os.listdir(PKG) if f.startswith("_C") and f.endswith(".so")]
    assert so, f"no built extension in {PKG}"
    out = subprocess.run(["objdump", "-T", os.path.join(PKG, so[0])], capture_output=True, text=True, check=True)
    newer = set()
    for lib, ver in re.findall(r"\((GLIBCXX|GLIBC|CXXABI|GCC)_([0-9.]+)\)", out.stdout):
        if tuple(int(x) for x in ver.split(".")) > GLIBC_FLOOR[lib]:
            newer.add(f"{lib}_{ver}")
    assert not newer, f"symbol versions past manylinux_2_28: {sorted(newer)}"
