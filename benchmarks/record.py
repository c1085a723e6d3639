"""The benchmark record: one JSON per machine kind, benchmarks/results_<key>.json
(key: bench_machine.machine_key, e.g. "amd-avx2-2cpu"), from which
tools/make_docs.py writes each record's tables into its page, docs/performance/<machine>.md.

    {
      "machine": "intel-amx-2cpu",        # the key, also the file name's
      "cpu": "Intel(R) Xeon(R) Processor", # the heading's CPU name
      "threads": 2,                        # torch threads of the rows that name none
      "torch": "2.13.0+cpu",
      "date": "2026-11-27",                # the newest row's date
      "about": "...",                      # optional: one paragraph under the heading
      "rows": [{"case": "gpt-train", "date": "2026-11-27", "native": "sdpa-float",
                "native_ms": 154.3, "ours_ms": 60.2, "ratio": 2.56, ...}, ...]
    }

A row is one case, identified by (case, isa, threads): "isa" where a variant was
forced (MASKED_ATTN_ISA), "threads" where it differs from the file's. Its other
fields, all optional: native (what ours is compared with), native_ms, ours_ms,
unit (default "ms"; "tok/s" for throughput, where ratio = ours / native),
ratio (native ms / ours ms; a [low, high] pair for a range of runs), gflops,
pct_peak (and peak_kind "bf16" where the yardstick is the VDPBF16PS peak),
pct_peak_alongside, peak_mb_native, peak_mb_ours (peak_mb_date where the
memory probes ran on another day), note (a footnote), source (the script that
measured it, or "docs table" for a row carried over from a hand-written table).

`make bench` measures and merges: each script given --record replaces the rows it
measured and keeps the others, so a partial run refreshes its own rows only.
"""

import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def path_for(key, root=HERE):
    return os.path.join(root, f"results_{key}.json")


def row_key(row):
    return (row["case"], row.get("isa"), row.get("threads"))


def load(key, root=HERE):
    try:
        with open(path_for(key, root)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def dumps(rec):
    """The record's text: the header's fields one a line, then one line per row (diffs stay per case)."""
    head = {k: v for k, v in rec.items() if k != "rows"}
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
    rows = [f"  {json.dumps(r, ensure_ascii=False)}" for r in rec["rows"]]
    return "{\n" + "\n".join(lines) + '\n "rows": [\n' + ",\n".join(rows) + "\n ]\n}\n"


def save(rec, root=HERE):
    rec["date"] = max(r["date"] for r in rec["rows"])
    text = dumps(rec)
    assert json.loads(text) == rec
    with open(path_for(rec["machine"], root), "w") as f:
        f.write(text)


def merge(key, cpu, threads, torch_version, rows, root=HERE):
    """Replace or add `rows` in the machine's record (created if absent); rows
    measured at the record's default thread count drop their "threads"."""
    rec = load(key, root) or {"machine": key, "cpu": cpu, "threads": threads, "torch": torch_version, "rows": []}
    rec["torch"] = torch_version
    for row in rows:
        if row.get("threads") == rec["threads"]:
            row.pop("threads")
    new = {row_key(r): r for r in rows}
    old = {row_key(r) for r in rec["rows"]}
    rec["rows"] = [new.get(row_key(r), r) for r in rec["rows"]] + [r for k, r in new.items() if k not in old]
    save(rec, root)
    return path_for(key, root)


def today():
    return time.strftime("%Y-%m-%d")


def _r(x, nd):
    return None if x is None else round(x, nd)


def row_from_run(r, date, isa=None, threads=None, bf16_isa=None):
    """One record row from a benchmarks/run.py case record, or None for a
    skipped or failed case. bf16_isa: the variant bfloat16 cases ran on; a
    bfloat16 % peak is kept only against a yardstick of that variant."""
    if "skipped" in r or "error" in r or ("ours_ms" not in r and "peak_mb_ours" not in r):
        return None
    row = {"case": r["name"], "date": date}
    if isa:
        row["isa"] = isa
    if threads:
        row["threads"] = threads
    fields = {
        "native": r.get("native_variant"),
        "native_ms": _r(r.get("native_ms"), 3),
        "ours_ms": _r(r.get("ours_ms"), 3),
        "ratio": _r(r.get("ratio"), 4),
        "gflops": _r(r.get("gflops"), 1),
        "pct_peak": _r(r.get("pct_peak"), 1),
        "pct_peak_alongside": _r(r.get("pct_peak_alongside"), 1),
        "peak_mb_native": r.get("peak_mb_native"),
        "peak_mb_ours": r.get("peak_mb_ours"),
    }
    if r.get("peak_kind") == "bf16":
        if bf16_isa == "avx512bf16":
            fields["peak_kind"] = "bf16"
        else:  # measured against a yardstick of another variant
            fields["pct_peak"] = None
    row.update({k: v for k, v in fields.items() if v is not None})
    row["source"] = "run.py"
    return row
