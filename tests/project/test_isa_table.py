"""The table of instruction sets (csrc/masked_attn.h, MA_ISA_TABLE) is the one source of the
kernel variants: the names the library gives Python are its rows, in its values' order, and no
other C file lists the variants by hand. The constants the library states for a variant
(ops.kernel_traits) are the ones its kernels run on: the tile is found from which key and query
blocks the kernels skip, the decode constants from the decode plan, and a paged cache's page
size from what the op reads in place and what it refuses."""

import math
import os
import platform
import re

import pytest
import torch

import torch_masked_attn as tma
from conftest import isa_available
from torch_masked_attn import _library, ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = ("ID", "name", "abi", "arch", "bq", "bk", "fb", "own", "inst", "usable")
# the C ABI: the values Python and the shim have always given these variants
ABI = {"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3, "avx512bf16": 4, "neon": 5, "sve": 6, "svebf16": 7}
ARCH = {"x86_64": "x86", "amd64": "x86", "aarch64": "arm", "arm64": "arm"}.get(platform.machine().lower())


def _strip_comments(text):
    return re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", " ", text), flags=re.S)


def _split_args(s):
    """The comma-separated arguments of a macro call's text, split at depth 0."""
    args, depth, cur = [], 0, ""
    for ch in s:
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    return args + [cur.strip()]


def table_rows():
    """MA_ISA_TABLE's rows as read from the header: [{column: text}]."""
    with open(os.path.join(ROOT, "csrc", "masked_attn.h"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#define MA_ISA_TABLE(X)"))
    body = [lines[start]]
    while body[-1].rstrip().endswith("\\"):
        body.append(lines[start + len(body)])
    text = _strip_comments(" ".join(line.rstrip().rstrip("\\") for line in body))
    text = text[text.index(")") + 1 :]  # past the macro's parameter list
    rows = []
    for m in re.finditer(r"\bX\(", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        args = _split_args(text[m.end() : i - 1])
        assert len(args) == len(COLUMNS), args
        row = dict(zip(COLUMNS, args))
        enumerator, _, value = row["abi"].partition("=")  # "MA_ISA_<ID> = <value>"
        assert enumerator.strip() == f"MA_ISA_{row['ID']}", row
        row["value"] = int(value)
        rows.append(row)
    assert rows
    return rows


def test_library_names_are_the_tables_rows():
    rows = table_rows()
    values = [r["value"] for r in rows]
    assert sorted(values) == list(range(len(rows)))  # each value once, no gap: ma_isa_name's indices
    names = tuple(r["name"] for r in sorted(rows, key=lambda r: r["value"]))
    assert _library._ISAS == names  # ma_isa_name, generated from the rows
    assert all(r["ID"] == r["name"].upper() for r in rows)  # MA_ISA_<ID> names the variant
    assert {r["name"]: r["value"] for r in rows if r["name"] in ABI} == ABI  # never renumbered
    assert ARCH is not None
    by_id = {r["ID"]: r for r in rows}
    assert ops.built_isas() == tuple(n for n in names if by_id[n.upper()]["arch"] in ("any", ARCH))
    for r in rows:  # a fallback has every kernel of its own, on the variant's architecture
        fb = by_id[r["fb"]]
        assert fb["own"] == "all" and fb["inst"] == "one" and fb["arch"] in ("any", r["arch"]), r
        assert r["own"] in ("all", "attn", "bf16") and r["inst"] in ("one", "vl"), r


def test_no_other_list_of_variants_in_csrc():
    """Every switch over the variants is generated (no `case MA_ISA_X:` written out), and a variant's
    name is a string in no C file (comments aside) but the table, its mapping and its instances."""
    names = [r["name"] for r in table_rows()]
    wrong = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for f in files:
            if not f.endswith((".c", ".h", ".cpp", ".hpp")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, "csrc")).replace(os.sep, "/")
            with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                code = _strip_comments(fh.read())
            wrong += [f"{rel}: {c}" for c in re.findall(r"\bcase\s+MA_ISA_[A-Z0-9_]+\s*:", code)]
            for n in names:
                own = rel == "masked_attn.h" or f in (f"{n}.c", f"simd_{n}.h")
                if f'"{n}"' in code and not own:
                    wrong.append(f'{rel}: "{n}"')
    assert not wrong, "variants listed outside MA_ISA_TABLE:\n" + "\n".join(wrong)


def _variants():
    return [(isa, dt) for isa in ops.built_isas() for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("isa, dtype", _variants(), ids=str)
def test_tile_is_the_one_the_kernels_skip_by(isa, dtype):
    """The kernels skip a key block whose keys are all padded and a tile whose attn_mask entries
    are all -inf, and compute every other whole: NaN values under padded keys reach the output
    (0 * NaN) only from a block they share with a key that is read. So the padded prefixes of
    keys that leave the output finite are the multiples of the kernels' block_k, and query 0's
    output is finite once the blocked rows fill its query block, block_q of them."""
    if not isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    t = ops.kernel_traits(dtype, isa)
    bq, bk, D = t["block_q"], t["block_k"], 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 2 * bq + 3, D, generator=g).to(dtype)  # more rows than the decode kernel takes
    k = torch.randn(1, 1, 2 * bk + 5, D, generator=g).to(dtype)
    Lq, Lk = q.size(2), k.size(2)

    def finite_with_padding(m):  # keys [0, m) padded, their values NaN
        v = torch.randn(1, 1, Lk, D, generator=g).to(dtype)
        v[:, :, :m] = float("nan")
        kpm = torch.zeros(1, Lk, dtype=torch.bool)
        kpm[:, :m] = True
        with ops.use_isa(isa):
            return bool(torch.isfinite(tma.functional.masked_attention(q, k, v, key_padding_mask=kpm)).all())

    def row0_finite_with_blocked_rows(r):  # rows [0, r) block keys [0, bk) (NaN values), the others the rest
        v = torch.randn(1, 1, Lk, D, generator=g).to(dtype)
        v[:, :, :bk] = float("nan")
        am = torch.zeros(Lq, Lk)
        am[:r, :bk] = float("-inf")
        am[r:, bk:] = float("-inf")
        with ops.use_isa(isa):
            out = tma.functional.masked_attention(q, k, v, attn_mask=am.to(dtype))
        return bool(torch.isfinite(out[0, 0, 0]).all())

    # tiles are multiples of 32 (the table's rule): these prefixes tell every such block size apart
    ms = sorted({*range(32, 2 * bk + 1, 32), bk - 1, bk + 1})
    assert [m for m in ms if finite_with_padding(m)] == [m for m in ms if m % bk == 0]
    rs = sorted({*range(32, 2 * bq + 1, 32), bq - 1, bq + 1})
    assert [r for r in rs if row0_finite_with_blocked_rows(r)] == [r for r in rs if r >= bq]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_cache_pages_are_multiples_of_the_tile(dtype):
    """The op reads pages of block_k rows in place (a key block in one page) and refuses half of it,
    naming block_k; varlen_attn gathers pages of that size into rows first (the same outputs)."""
    bk = ops.kernel_traits(dtype)["block_k"]
    g = torch.Generator().manual_seed(1)
    H, D, used = 2, 16, [3 * bk // 2, 5]
    q = torch.randn(4, H, D, generator=g).to(dtype)
    cq = torch.tensor([0, 3, 4], dtype=torch.int32)
    seqused = torch.tensor(used, dtype=torch.int32)
    keys = [torch.randn(u, H, D, generator=g).to(dtype) for u in used]
    vals = [torch.randn(u, H, D, generator=g).to(dtype) for u in used]
    ref = tma.functional.varlen_attn(
        q, torch.cat(keys), torch.cat(vals), cq, torch.tensor([0, used[0], sum(used)], dtype=torch.int32), 3, used[0]
    )
    for page in (bk, bk // 2):
        n = [math.ceil(u / page) for u in used]
        kp, vp = torch.zeros(sum(n), page, H, D, dtype=dtype), torch.zeros(sum(n), page, H, D, dtype=dtype)
        table = torch.zeros(2, max(n), dtype=torch.int32)
        at = 0
        for b in range(2):
            for p in range(n[b]):
                rows = slice(p * page, min((p + 1) * page, used[b]))
                kp[at, : rows.stop - rows.start], vp[at, : rows.stop - rows.start] = keys[b][rows], vals[b][rows]
                table[b, p] = at
                at += 1
        out = tma.functional.varlen_attn(q, kp, vp, cq, None, 3, max(used), seqused_k=seqused, block_table=table)
        assert torch.equal(out, ref)
        args = (q, kp, vp, cq, None, 3, max(used), None, seqused, table, False)
        if page % bk == 0:
            assert torch.equal(torch.ops.masked_attn.varlen_forward(*args)[0], ref)
        else:
            with pytest.raises(RuntimeError, match=rf"page_size = key.size\(1\) must be a positive multiple of {bk}\b"):
                torch.ops.masked_attn.varlen_forward(*args)
    assert ops.page_multiple() % bk == 0


def test_decode_constants_are_the_plans():
    """decode_chunk keys per chunk and decode_rows rows per slab at most, as the decode plan
    (ma_attn_decode_shape) cuts a call."""
    t = ops.kernel_traits()
    chunk, rows = t["decode_chunk"], t["decode_rows"]
    for Lk in (1, chunk - 1, chunk, chunk + 1, 5 * chunk - 3):
        assert ops.decode_plan(1, 8, 8, 1, Lk, 1)["chunks"] == math.ceil(Lk / chunk)
    for lq in (1, 2, 4):
        s = ops.decode_plan(1, 4 * rows, 1, lq, 1000, 1)  # 4 rows' worth of query heads on one key head
        assert s["slab_heads"] * lq == rows and s["slabs"] == 4 * lq
    assert 1 <= t["decode_qrows"] <= rows and t["decode_kv_heads"] >= 1
