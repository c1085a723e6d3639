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


def bwd_grads(grads, head_mask):
    """masked_attn::backward's (grad_q, grad_k, grad_v, grad_head_mask,
    grad_scores): grad_head_mask reduced to head_mask's shape and dtype (a
    build whose op returns it per (B, H) in the accumulation type is reduced
    here as its Python caller did), later outputs (grad_sinks) left out."""
    grads = list(grads[:5])
    if head_mask is not None and grads[3].dim() == 2 and head_mask.dim() == 1:
        grads[3] = grads[3].sum(0).to(head_mask.dtype)
    return grads


def has_arg(op, name):
    return any(a.name == name for a in op.default._schema.arguments)


def dump_options(res):
    """The options with no case above (sinks, dropout, varlen's window, softcap
    and sinks) and, where the build has it, ALiBi: forward and backward by the
    ops' argument names."""
    fwd, bwd = torch.ops.masked_attn.forward, torch.ops.masked_attn.backward
    vf, vb = torch.ops.masked_attn.varlen_forward, torch.ops.masked_attn.varlen_backward
    alibi = has_arg(fwd, "alibi_slopes")
    g = torch.Generator().manual_seed(2)

    def r(*s, dt):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dt)

    seed = torch.tensor([1234, 5678])
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        B, H, Hkv, Lq, Lk, D = 2, 4, 2, 100, 140, 32
        q, k, v = r(B, H, Lq, D, dt=dt), r(B, Hkv, Lk, D, dt=dt), r(B, Hkv, Lk, D, dt=dt)
        go = r(B, H, Lq, D, dt=dt)
        sinks = r(H, dt=torch.float32)
        slopes = torch.rand(B, H, generator=g) * 0.5
        cases = {
            "sinks-causal": dict(is_causal=True, sinks=sinks),
            "dropout": dict(dropout_p=0.25, dropout_seed=seed),
            "sinks-win-cap-drop": dict(
                window_left=30, window_right=10, softcap=4.0, sinks=sinks, dropout_p=0.1, dropout_seed=seed
            ),
        }
        if alibi:
            cases["alibi"] = dict(alibi_slopes=slopes[0])
            cases["alibi-causal-win"] = dict(is_causal=True, window_left=40, alibi_slopes=slopes)
            cases["alibi-cap-sinks"] = dict(softcap=3.0, sinks=sinks, alibi_slopes=slopes)
        for cname, kw in cases.items():
            for need_w in (False, True):
                out, lse, w = fwd(q, k, v, need_weights=need_w, **kw)[:3]
                gw = torch.ones_like(w) * 0.1 if need_w else None
                grads = bwd(go, gw, q, k, v, out, lse, **kw)
                res[f"opt-{dt}-{cname}-w{int(need_w)}"] = [out, lse, w, *bwd_grads(grads, None)]
        # varlen: three sequences, bottom-right windows
        cu_q = torch.tensor([0, 17, 17, 90], dtype=torch.int32)
        cu_k = torch.tensor([0, 40, 45, 150], dtype=torch.int32)
        pq, pk, pv = r(90, H, D, dt=dt), r(150, Hkv, D, dt=dt), r(150, Hkv, D, dt=dt)
        pgo = r(90, H, D, dt=dt)
        vslopes = torch.rand(3, H, generator=g)  # drawn whether or not the build has ALiBi
        vcases = {
            "plain": dict(),
            "causal-cap-sinks": dict(window_left=-1, window_right=0, softcap=5.0, sinks=sinks),
            "win": dict(window_left=20, window_right=3),
        }
        if alibi:
            vcases["alibi-causal"] = dict(window_right=0, alibi_slopes=slopes[1])
            vcases["alibi-win-batch"] = dict(window_left=25, window_right=5, alibi_slopes=vslopes)
        for cname, kw in vcases.items():
            out, lse = vf(pq, pk, pv, cu_q, cu_k, 73, 105, **kw)[:2]
            grads = vb(pgo, pq, pk, pv, out, lse, cu_q, cu_k, 73, 105, **kw)
            res[f"opt-{dt}-varlen-{cname}"] = [out, lse, *grads[:3]]


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
                res[key] = [out, lse, w, *bwd_grads(grads, hmask)]
        # sliding windows (top-left), with causal, and soft-capping
        for vname, causal, wl, wr, cap in [
            ("win", False, 20, 5, None),
            ("causal-win", True, 30, -1, None),
            ("cap-win", False, 40, 70, 5.0),
        ]:
            win = dict(window_left=wl, window_right=wr, softcap=cap)
            out, lse = fwd(q, k, v, None, kpm, None, causal, None, False, **win)[:2]
            grads = bwd(go, None, q, k, v, out, lse, None, kpm, None, causal, None, False, False, **win)
            res[f"{name}-{vname}"] = [out, lse, *bwd_grads(grads, None)]
        # strided (non-contiguous) q, k, v
        qs = q.transpose(2, 3).contiguous().transpose(2, 3)
        out, lse, w = fwd(qs, k, v, None, kpm, None, True, 0.3, False)[:3]
        res[f"{name}-strided"] = [
            out,
            lse,
            *bwd_grads(bwd(go, None, qs, k, v, out, lse, None, kpm, None, True, 0.3, False, False), None),
        ]


def dump_attention_more(res):
    """Options and layouts the dense cases above leave out: soft-capping, sinks,
    windows and dropout together (the dropout and softcap blocks), decoding
    (Lq = 1, GQA: the decode kernel, dot_rows and axpy_keys), varlen (packed
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
                opts = dict(dropout_p=p, dropout_seed=ds, window_left=wl, window_right=wr, softcap=cap, sinks=sk)
                out, lse, w, lo = fwd(q, k, v, None, kpm, None, causal, None, False, **opts)
                lo = lo if lo.numel() else None
                grads = bwd(go, None, q, k, v, out, lse, None, kpm, None, causal, None, False, False, out_lo=lo, **opts)
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
            opts = dict(window_left=wl, window_right=wr, softcap=cap)
            out, lse, lo = vfwd(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), None, **opts)
            lo = lo if lo.numel() else None
            grads = vbwd(go, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), None, out_lo=lo, **opts)
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
                    q,
                    kc,
                    rows_v,
                    cu_q,
                    None,
                    max(lens_q),
                    max(lens_k),
                    None,
                    window_left=wl,
                    window_right=wr,
                    seqused_k=used,
                    block_table=table,
                    softcap=cap,
                    sinks=sk,
                )
                res[f"paged-{dt}-{lname}-{vname}"] = [out, lse, lo]


def dump_schedule(res):
    """Calls whose schedule differs (masked_attn.h, the plans): decoding
    (runs of heads, the serial path), varlen batches with empty, decoding and
    long entries (the work-item tables), a paged cache and seqused_k."""
    fwd, bwd = torch.ops.masked_attn.forward, torch.ops.masked_attn.backward
    vf, vb = torch.ops.masked_attn.varlen_forward, torch.ops.masked_attn.varlen_backward
    g = torch.Generator().manual_seed(3)

    def r(*s, dt):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dt)

    for dt in (torch.float32, torch.bfloat16):
        # dense decoding from a (B, L, H, D) cache: heads side by side, small and larger
        for B, H, Hkv, Lk, D in [(1, 8, 2, 60, 32), (2, 16, 4, 700, 64)]:
            q = r(B, 1, H, D, dt=dt).transpose(1, 2)
            k, v = r(B, Lk, Hkv, D, dt=dt).transpose(1, 2), r(B, Lk, Hkv, D, dt=dt).transpose(1, 2)
            out, lse = fwd(q, k, v, None, None, None, False, None, False)[:2]
            res[f"sched-{dt}-decode-{B}{H}{Hkv}-{Lk}"] = [out, lse]
        # a tiny training call (serial forward and backward)
        q, k, v, go = (r(1, 2, 9, 16, dt=dt) for _ in range(4))
        out, lse = fwd(q, k, v, None, None, None, True, None, False)[:2]
        grads = bwd(go, None, q, k, v, out, lse, None, None, None, True, None, False, False)
        res[f"sched-{dt}-tiny"] = [out, lse, *bwd_grads(grads, None)]
        # varlen: empty, decoding and long entries, GQA
        H, Hkv, D = 8, 2, 64
        lq = [0, 1, 1, 37, 200, 1, 64, 129, 0, 3]
        lk = [5, 90, 1, 37, 260, 0, 64, 300, 0, 70]
        cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
        Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
        pq, pk, pv, pgo = r(Tq, H, D, dt=dt), r(Tk, Hkv, D, dt=dt), r(Tk, Hkv, D, dt=dt), r(Tq, H, D, dt=dt)
        for cname, kw in {
            "plain": dict(),
            "causal": dict(window_right=0),
            "win": dict(window_left=50, window_right=7),
        }.items():
            out, lse = vf(pq, pk, pv, cu_q, cu_k, max(lq), max(lk), **kw)[:2]
            grads = vb(pgo, pq, pk, pv, out, lse, cu_q, cu_k, max(lq), max(lk), **kw)
            res[f"sched-{dt}-varlen-{cname}"] = [out, lse, *grads[:3]]
        # varlen decoding: one query per entry, seqused_k, then the same keys paged
        N, P = 6, 64
        used = torch.tensor([1, 64, 65, 200, 0, 130], dtype=torch.int32)
        cu_q = torch.arange(N + 1, dtype=torch.int32)
        cu_k = torch.arange(N + 1, dtype=torch.int32) * 256
        dq_, dk_, dv_ = r(N, H, D, dt=dt), r(N * 256, Hkv, D, dt=dt), r(N * 256, Hkv, D, dt=dt)
        out, lse = vf(dq_, dk_, dv_, cu_q, cu_k, 1, 256, seqused_k=used, window_right=0)[:2]
        res[f"sched-{dt}-varlen-decode"] = [out, lse]
        bt = torch.randperm(N * 4, generator=g)[: N * 4].view(N, 4).to(torch.int32)
        kc, vc = torch.zeros(N * 4, P, Hkv, D, dtype=dt), torch.zeros(N * 4, P, Hkv, D, dtype=dt)
        for b in range(N):
            for j in range(4):
                kc[bt[b, j]] = dk_[b * 256 + j * P : b * 256 + (j + 1) * P]
                vc[bt[b, j]] = dv_[b * 256 + j * P : b * 256 + (j + 1) * P]
        out, lse = vf(dq_, kc, vc, cu_q, None, 1, 256, seqused_k=used, block_table=bt, window_right=0)[:2]
        res[f"sched-{dt}-varlen-paged"] = [out, lse]


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
        only = sorted(a.keys() ^ b.keys())  # cases one build lacks the option for (a newer option)
        if only:
            print(f"{len(only)} cases in one dump only (not compared):", ", ".join(only))
        for key in sorted(a.keys() & b.keys()):
            for i, (x, y) in enumerate(zip(a[key], b[key])):
                if x != y:
                    bad += 1
                    print("DIFF", key, i)
        common = a.keys() & b.keys()
        n = sum(len(a[k]) for k in common)
        print(f"{len(common)} cases, {n} tensors, {bad} differ")
        sys.exit(1 if bad else 0)
    lib, isa, out = sys.argv[1:4]
    os.environ["MASKED_ATTN_ISA"] = isa
    torch.ops.load_library(lib)
    res = {}
    dump_attention(res)
    dump_options(res)
    dump_attention_more(res)
    dump_schedule(res)
    dump_ce(res)

    def digest(t):  # shape, dtype and a hash of the bytes: small files, exact comparison
        t = t.contiguous()
        return (tuple(t.shape), str(t.dtype), hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest())

    torch.save({k: [digest(t) for t in v] for k, v in res.items()}, out)
    print(isa, len(res), "cases ->", out)


if __name__ == "__main__":
    main()
