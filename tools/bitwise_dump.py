"""Dump the raw ops' outputs and gradients on a fixed set of cases, for one
build and one instruction set, so that two builds can be compared bit for bit.

    python tools/bitwise_dump.py LIB.so ISA OUT.pt     # one build, one ISA
    python tools/bitwise_dump.py --compare A.pt B.pt   # exits 1 on any difference

Used to show that a refactoring leaves every result unchanged (docs/design.md,
"Changing the kernels"). Only the raw torch.ops.masked_attn.* ops are called,
so the Python package of either build does not matter.
"""

import hashlib
import os
import sys

import torch


def attention_cases():
    g = torch.Generator().manual_seed(0)

    def r(*s, dt):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dt)

    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for B, H, Hkv, Lq, Lk, D, Dv in [
            (2, 4, 2, 130, 130, 64, 64),
            (1, 2, 2, 7, 200, 40, 24),
            (2, 2, 1, 64, 96, 128, 128),
            (1, 1, 1, 300, 300, 64, 32),
        ]:
            q, k, v = r(B, H, Lq, D, dt=dt), r(B, Hkv, Lk, D, dt=dt), r(B, Hkv, Lk, Dv, dt=dt)
            go = r(B, H, Lq, Dv, dt=dt)
            kpm = torch.arange(Lk)[None] >= torch.tensor([Lk, Lk * 2 // 3] * B)[:B, None]
            fm = r(1, H, Lq, Lk, dt=dt) * 0.5
            hm = torch.rand(H, generator=g, dtype=torch.float64).to(dt) + 0.5
            yield f"{dt}-{B}{H}{Hkv}-{Lq}x{Lk}-{D}/{Dv}", q, k, v, go, kpm, fm, hm


def dump_attention(res):
    fwd, bwd = torch.ops.masked_attn.forward, torch.ops.masked_attn.backward
    for name, q, k, v, go, kpm, fm, hm in attention_cases():
        variants = {
            "plain": dict(),
            "causal+kpm": dict(key_padding_mask=kpm, is_causal=True),
            "float+head": dict(attn_mask=fm, head_mask=hm),
            "all": dict(attn_mask=fm, key_padding_mask=kpm, head_mask=hm, is_causal=True),
        }
        for vname, kw in variants.items():
            am, kp, hmask, causal = (
                kw.get("attn_mask"),
                kw.get("key_padding_mask"),
                kw.get("head_mask"),
                kw.get("is_causal", False),
            )
            for need_w in (False, True):
                out, lse, w = fwd(q, k, v, am, kp, hmask, causal, None, need_w)[:3]
                gw = torch.ones_like(w) * 0.1 if need_w else None
                mask_grad = am is not None and am.dtype != torch.bool
                grads = bwd(go, gw, q, k, v, out, lse, am, kp, hmask, causal, None, hmask is not None, mask_grad)
                key = f"{name}-{vname}-w{int(need_w)}"
                res[key] = [out, lse, w, *grads]
        # sliding windows (top-left), with causal, and soft-capping
        for vname, causal, wl, wr, cap in [
            ("win", False, 20, 5, None),
            ("causal-win", True, 30, -1, None),
            ("cap-win", False, 40, 70, 5.0),
        ]:
            win = (0.0, None, wl, wr, cap, None)
            out, lse = fwd(q, k, v, None, kpm, None, causal, None, False, *win)[:2]
            grads = bwd(go, None, q, k, v, out, lse, None, kpm, None, causal, None, False, False, *win)
            res[f"{name}-{vname}"] = [out, lse, *grads]
        # strided (non-contiguous) q, k, v
        qs = q.transpose(2, 3).contiguous().transpose(2, 3)
        out, lse, w = fwd(qs, k, v, None, kpm, None, True, 0.3, False)[:3]
        res[f"{name}-strided"] = [
            out,
            lse,
            *bwd(go, None, qs, k, v, out, lse, None, kpm, None, True, 0.3, False, False),
        ]


def dump_attention_more(res):
    """Options and layouts the dense cases above leave out: soft-capping, sinks,
    windows and dropout together (the dropout and softcap blocks), decoding
    (Lq = 1, GQA: the rows path, dot_keys and axpy_keys), varlen (packed
    sequences), paged row caches (block_table) and K^T pages (dot_keys_t)."""
    fwd, bwd = torch.ops.masked_attn.forward, torch.ops.masked_attn.backward
    vfwd, vbwd = torch.ops.masked_attn.varlen_forward, torch.ops.masked_attn.varlen_backward
    g = torch.Generator().manual_seed(2)

    def r(*s, dt):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dt)

    seed = torch.tensor([1234, 7], dtype=torch.int64)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        # dense: cap + sinks + window, with and without dropout; decode (Lq = 1) and short blocks, GQA
        for B, H, Hkv, Lq, Lk, D in [(2, 4, 2, 70, 150, 64), (2, 8, 2, 1, 300, 128), (1, 8, 1, 3, 77, 64)]:
            q, k, v, go = r(B, H, Lq, D, dt=dt), r(B, Hkv, Lk, D, dt=dt), r(B, Hkv, Lk, D, dt=dt), r(B, H, Lq, D, dt=dt)
            sinks = torch.randn(H, generator=g)
            kpm = torch.arange(Lk)[None] >= torch.tensor([Lk, Lk - 9] * B)[:B, None]
            for vname, p, causal, wl, wr, cap, sk in [
                ("cap-sinks", 0.0, False, -1, -1, 4.0, sinks),
                ("drop", 0.2, False, -1, -1, None, None),
                ("drop-cap-win-sinks", 0.3, True, 50, -1, 6.0, sinks),
            ]:
                ds = seed if p > 0 else None
                out, lse, w, lo = fwd(q, k, v, None, kpm, None, causal, None, False, p, ds, wl, wr, cap, sk)
                lo = lo if lo.numel() else None
                grads = bwd(
                    go, None, q, k, v, out, lse, None, kpm, None, causal, None, False, False, p, ds, wl, wr, cap, sk, lo
                )
                res[f"more-{dt}-{B}{H}{Hkv}-{Lq}x{Lk}-{D}-{vname}"] = [out, lse, *grads]
            out, lse, w, lo = fwd(q, k, v, None, kpm, None, False, None, True, 0.25, seed)
            res[f"more-{dt}-{B}{H}{Hkv}-{Lq}x{Lk}-{D}-drop-weights"] = [out, lse, w]
        # varlen: packed sequences, GQA, forward and backward
        H, Hkv, D = 4, 2, 64
        lens_q, lens_k = [1, 70, 5, 33], [90, 70, 130, 33]
        cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
        q, k, v = r(int(cu_q[-1]), H, D, dt=dt), r(int(cu_k[-1]), Hkv, D, dt=dt), r(int(cu_k[-1]), Hkv, D, dt=dt)
        go = r(int(cu_q[-1]), H, D, dt=dt)
        for vname, wl, wr, cap in [("plain", -1, -1, None), ("causal-cap", -1, 0, 5.0), ("win", 20, 3, None)]:
            out, lse, lo = vfwd(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), None, wl, wr, None, None, cap)
            lo = lo if lo.numel() else None
            grads = vbwd(go, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), None, wl, wr, cap, None, lo)
            res[f"varlen-{dt}-{vname}"] = [out, lse, *grads]
        # paged caches: row pages and K^T pages (element d of key c at d * page + c within a head's page)
        H, Hkv, D, page, pages = 8, 2, 64, 64, 40
        lens_q, lens_k = [1, 1, 6, 40, 1], [200, 64, 77, 290, 3]
        table = torch.randperm(pages, generator=g)[:25].view(5, 5).to(torch.int32)
        cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
        used = torch.tensor(lens_k, dtype=torch.int32)
        q = r(int(cu_q[-1]), H, D, dt=dt)
        rows_k, rows_v = r(pages, page, Hkv, D, dt=dt), r(pages, page, Hkv, D, dt=dt)
        t_k = rows_k.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # K^T pages, as (pages, page, H_kv, D)
        for lname, kc in [("rows", rows_k), ("kt", t_k)]:
            for vname, wl, wr, cap, sk in [
                ("causal", -1, 0, None, None),
                ("cap-sinks-win", 60, 0, 3.0, torch.randn(H, generator=g)),
            ]:
                out, lse, lo = vfwd(
                    q, kc, rows_v, cu_q, None, max(lens_q), max(lens_k), None, wl, wr, used, table, cap, sk
                )
                res[f"paged-{dt}-{lname}-{vname}"] = [out, lse, lo]


def dump_ce(res):
    g = torch.Generator().manual_seed(1)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for N, C in [(37, 1000), (8, 32001), (5, 7)]:
            x = torch.randn(N, C, generator=g, dtype=torch.float64).to(dt) * 3
            t = torch.randint(0, C, (N,), generator=g)
            t[::4] = -100
            w = torch.rand(C, generator=g, dtype=torch.float64).to(dt) + 0.5
            for red in ("mean", "sum", "none"):
                for opts in [(None, 0.0, 0.0, None), (w, 0.1, 1e-4, 30.0)]:
                    wt, ls, z, cap = opts
                    loss, lse = torch.ops.masked_attn.cross_entropy(x, t, wt, red, -100, ls, z, cap, False)
                    gl = torch.ones_like(loss)
                    gi, _ = torch.ops.masked_attn.cross_entropy_backward(
                        gl, x, t, wt, lse, red, -100, ls, False, z, cap
                    )
                    res[f"ce-{dt}-{N}x{C}-{red}-{wt is not None}"] = [loss, lse, gi]


def main():
    if sys.argv[1] == "--compare":
        a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
        bad = 0
        if a.keys() != b.keys():
            print("different case sets")
            sys.exit(1)
        for key in a:
            for i, (x, y) in enumerate(zip(a[key], b[key])):
                if x != y:
                    bad += 1
                    print("DIFF", key, i)
        n = sum(len(v) for v in a.values())
        print(f"{len(a)} cases, {n} tensors, {bad} differ")
        sys.exit(1 if bad else 0)
    lib, isa, out = sys.argv[1:4]
    os.environ["MASKED_ATTN_ISA"] = isa
    torch.ops.load_library(lib)
    res = {}
    dump_attention(res)
    dump_attention_more(res)
    dump_ce(res)

    def digest(t):  # shape, dtype and a hash of the bytes: small files, exact comparison
        t = t.contiguous()
        return (tuple(t.shape), str(t.dtype), hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest())

    torch.save({k: [digest(t) for t in v] for k, v in res.items()}, out)
    print(isa, len(res), "cases ->", out)


if __name__ == "__main__":
    main()
