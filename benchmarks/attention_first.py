"""First figure for attention: one forward+backward at B=8, H=8, L=512, D=64,
causal + key padding, float32, ours next to F.scaled_dot_product_attention on
the same work (bool (B, 1, L, L) mask = causal & not padding). Timings
interleave native and ours in one process and take medians; the ratio is
native / ours (above 1: we are faster).

Run: .venv/bin/python benchmarks/attention_first.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

import torch_masked_attn as tma


def main(B=8, H=8, L=512, D=64, reps=7):
    torch.manual_seed(0)
    lengths = torch.randint(L // 2, L + 1, (B,))
    kpm = torch.arange(L)[None, :] >= lengths[:, None]  # (B, L) True = padding
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    allowed = ~(causal[None, None] | kpm[:, None, None, :])  # (B, 1, L, L) True = take part
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D)

    def native():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        torch.autograd.grad(o, (q, k, v), g)

    def ours():
        o = tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True)
        torch.autograd.grad(o, (q, k, v), g)

    # same results first (rows fully masked do not occur: key 0 is never padding)
    o_n = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    o_o = tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True)
    print(f"max |ours - native| = {(o_n - o_o).abs().max().item():.2e}")
    times = {"native": [], "ours": []}
    for fn in (native, ours):
        fn()  # warm-up
    for _ in range(reps):
        for name, fn in (("native", native), ("ours", ours)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tn, to = statistics.median(times["native"]), statistics.median(times["ours"])
    print(f"B={B} H={H} L={L} D={D} float32 causal+key padding, fwd+bwd, {torch.get_num_threads()} threads")
    print("| native F.sdpa (ms) | ours (ms) | ratio native/ours |")
    print("|---|---|---|")
    print(f"| {tn * 1e3:.1f} | {to * 1e3:.1f} | {tn / to:.2f} |")


if __name__ == "__main__":
    main()
