#!/usr/bin/env python3
"""The float32 backward's error class (issue 63, part 2): the three cases of the issue,
reproduced from their descriptions, ours against PyTorch's math path, both against float64.

    PYTHONPATH=. python tools/bwd_error_cases.py [--isa scalar|avx2|...] [--seeds N]

For every case and gradient: ours' max error against tests/reference.py's attention64 in
float64, the math path's (attention64 in float32: plain torch ops), their ratio, and the bound
of flash-attention's rule (tests/conftest.py's assert_close_ref: 2 x the math path's error +
5e-6 x max(1, max|ref|)). Exit status 1 if a gradient is past the bound.

docs/design/05-attention-algorithm.md, "The float32 backward's error", has the cause and the
bound; tests/attention/test_bwd_error.py the regression tests.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reference import attention64  # noqa: E402
from torch_masked_attn import ops  # noqa: E402
from torch_masked_attn.functional import masked_attention  # noqa: E402

SLACK32 = 5e-6  # tests/conftest.py's rel_slack(torch.float32)


def case_one_key(seed, H=12, Hkv=3, B=2, D=64):
    """Lk = 1, 129 causal rows, GQA, a bool key padding mask, a head mask with a gradient."""
    g = torch.Generator().manual_seed(seed)
    Lq, Lk = 129, 1
    x = {
        "q": torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64),
        "head_mask": torch.rand(H, generator=g, dtype=torch.float64) * 2,
    }
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[-1, -1] = True  # the last entry fully padded
    go = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    kw = {"key_padding_mask": kpm, "is_causal": True}
    return x, kw, go, ("q", "k", "v", "head_mask")


def case_expanded(seed, B=2, H=4, D=48, L=130):
    """K, V (B, 1, L, D) expanded to the H query heads (stride 0), scale 2.0, no causal."""
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, H, L, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, 1, L, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, 1, L, D, generator=g, dtype=torch.float64),
    }
    go = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    kw = {"scale": 2.0, "_expand": H}
    return x, kw, go, ("q", "k", "v")


def case_mask_b111(seed, B=3, H=4, L=100, D=64):
    """A float attn_mask (B, 1, 1, 1) with a gradient, scale 0.05, trailing key padding."""
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, H, L, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, H, L, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, H, L, D, generator=g, dtype=torch.float64),
        "attn_mask": torch.randn(B, 1, 1, 1, generator=g, dtype=torch.float64),
    }
    lens = torch.tensor([L - 7 * (b + 1) for b in range(B)])
    kpm = torch.arange(L)[None, :] >= lens[:, None]
    go = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    kw = {"key_padding_mask": kpm, "scale": 0.05}
    return x, kw, go, ("q", "k", "v", "attn_mask")


CASES = {"one_key": case_one_key, "expanded": case_expanded, "mask_b111": case_mask_b111}


def _grads(fn, x, go, names, dtype):
    """d(out . go)/d(names) of fn on x rounded to float32 then cast to dtype."""
    leaves = {n: t.to(torch.float32).to(dtype).requires_grad_(n in names) for n, t in x.items()}
    out = fn(leaves)
    gr = torch.autograd.grad(out, [leaves[n] for n in names], go.to(torch.float32).to(dtype))
    return dict(zip(names, gr))


def run(name, seed, isa=None, **shape):
    """{grad: (ours, math path's error, ref max, bound)} for one case."""
    x, kw, go, names = CASES[name](seed, **shape)
    kw = dict(kw)
    expand = kw.pop("_expand", None)

    def views(t):
        k, v = t["k"], t["v"]
        if expand:
            k, v = k.expand(-1, expand, -1, -1), v.expand(-1, expand, -1, -1)
        return t["q"], k, v

    def ours(t):
        q, k, v = views(t)
        return masked_attention(q, k, v, attn_mask=t.get("attn_mask"), head_mask=t.get("head_mask"), **kw)

    def ref(dtype):
        def f(t):
            q, k, v = views(t)
            return attention64(q, k, v, attn_mask=t.get("attn_mask"), head_mask=t.get("head_mask"), dtype=dtype, **kw)

        return f

    with ops.use_isa(isa):
        g_ours = _grads(ours, x, go, names, torch.float32)
    g64 = _grads(ref(torch.float64), x, go, names, torch.float64)
    g32 = _grads(ref(torch.float32), x, go, names, torch.float32)
    res = {}
    for n in names:
        r = g64[n]
        e_ours = (g_ours[n].double() - r).abs().max().item()
        e_math = (g32[n].double() - r).abs().max().item()
        bound = 2 * e_math + SLACK32 * max(1.0, r.abs().max().item())
        res[n] = (e_ours, e_math, r.abs().max().item(), bound)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default=None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--case", default=None, choices=list(CASES))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    bad = 0
    for name in [a.case] if a.case else CASES:
        for seed in range(a.seeds):
            res = run(name, seed, a.isa)
            for n, (eo, em, mx, bd) in res.items():
                flag = "FAIL" if eo > bd else "ok"
                bad += eo > bd
                print(
                    f"{name:10s} seed {seed} d{n:10s} ours {eo:.2e} math {em:.2e} "
                    f"ratio {eo / max(em, 1e-30):7.2f} max|ref| {mx:.2e} bound {bd:.2e} {flag}"
                )
    print(f"{bad} past the bound")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
