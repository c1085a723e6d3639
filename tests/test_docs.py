"""docs/performance.md's tables and README.md's results table are the benchmark
records': tools/make_docs.py generates them from benchmarks/results_<machine>.json,
and the pages must be what it writes (`make docs`). No benchmark runs here."""

import copy
import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def make_docs():
    spec = importlib.util.spec_from_file_location("make_docs", os.path.join(ROOT, "tools", "make_docs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def page(make_docs):
    with open(make_docs.DOC, encoding="utf-8") as f:
        return f.read()


def test_performance_md_is_what_the_records_give(make_docs, page):
    assert make_docs.generate(page, make_docs.load_records()) == page, (
        "docs/performance.md differs from benchmarks/results_*.json: run `make docs`"
    )


def test_readme_results_are_what_the_records_give(make_docs):
    with open(make_docs.README, encoding="utf-8") as f:
        text = f.read()
    assert make_docs.generate_readme(text, make_docs.load_records()) == text, (
        "README.md's results differ from benchmarks/results_*.json: run `make docs`"
    )


def test_every_record_has_its_block(make_docs, page):
    recs = make_docs.load_records()
    assert recs, "no benchmarks/results_<machine>.json"
    blocks = [m.group("key") for m in make_docs.BLOCK_RE.finditer(page)]
    assert sorted(blocks) == sorted(recs)


def test_a_changed_figure_changes_the_page(make_docs, page):
    """The check can fail: a ratio edited in a record shows up in the generated page."""
    recs = copy.deepcopy(make_docs.load_records())
    key = sorted(recs)[0]
    row = next(r for r in recs[key]["rows"] if isinstance(r.get("ratio"), float))
    row["ratio"] = 123.456
    new = make_docs.generate(page, recs)
    assert new != page and "| 123.46 |" in new


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
