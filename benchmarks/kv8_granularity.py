"""Which scale granularity for the 8-bit KV cache (docs/design.md, "8-bit KV cache"):
the demo's model (examples/demo.py) trained on its text, its keys and values on
held-out windows collected per layer, quantized to int8 three ways, and the
error of each against float32:

  row        one float32 scale per row of D (per token and head): quantize_kv's
  block32    one scale per 32 values of a row (llama.cpp's q8_0 granularity)
  channel    keys: one scale per (head, channel) over a window's tokens (KIVI's
             per-channel key quantization); values per row as KIVI does

Reported per layer: relative RMS error of K and V, the attention output's
relative error (the window's causal attention, float32 vs the dequantized
cache), and the scales' bytes per value. Then the continuation perplexity
through the demo's cached decoding with quantize_kv's scales.

    .venv/bin/python benchmarks/kv8_granularity.py [--steps 600]
"""

import argparse
import importlib.util
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "examples", "demo.py"))
    demo = importlib.util.module_from_spec(spec)
    sys.modules["demo"] = demo
    spec.loader.exec_module(demo)
    return demo


def q_rows(x, group):
    """Symmetric int8 over groups of `group` consecutive values of the last dim."""
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // group, group)
    s = g.abs().amax(-1, keepdim=True) / 127
    return ((g / s.clamp_min(1e-30)).round().clamp(-127, 127) * s).reshape(shape)


def q_channels(x):
    """Symmetric int8 with one scale per channel (last dim) over the tokens (dim 1) of each window and head."""
    s = x.abs().amax(1, keepdim=True) / 127
    return (x / s.clamp_min(1e-30)).round().clamp(-127, 127) * s


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def collect(demo, model, seqs, L=96):
    """Per layer: (q, k, v) of the windows, (B, L, H, Dh) each, from the model's own forward."""
    x = torch.stack([s[:L] for s in seqs if len(s) >= L])
    B = x.shape[0]
    h = model.tok(x) + model.pos(torch.arange(L))
    out = []
    for blk in model.blocks:
        H = blk.attn.num_heads
        d = h.shape[-1]
        q, k, v = (
            F.linear(blk.ln1(h), blk.attn.in_proj_weight, blk.attn.in_proj_bias).view(B, L, 3, H, d // H).unbind(2)
        )
        out.append((q, k, v))
        h = demo._cached_block(blk, h, 0, {"k": torch.empty(B, L, H, d // H), "v": torch.empty(B, L, H, d // H)}, False)
    return out


def attend(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--d", type=int, default=256, help="model width")
    ap.add_argument("--heads", type=int, default=2, help="heads (head dim d / heads: 128 by default)")
    args = ap.parse_args()
    demo = load_demo()
    _, models, data = demo.train(args.steps, names=("ours",), verbose=False, d=args.d, heads=args.heads)
    model = models["ours"].eval()
    layers = collect(demo, model, data["held"])
    Dh = layers[0][1].shape[-1]
    print(
        f"demo model after {args.steps} steps, {len(layers)} layers, head dim {Dh}, "
        f"{layers[0][1].shape[0]} held-out windows of 96 tokens"
    )
    print("| layer | scheme | K rel. RMS err | V rel. RMS err | attention out rel. err | scale bytes / value |")
    print("|---|---|---:|---:|---:|---:|")
    # and the same keys with 4 channels per head scaled 20x (the outlier channels KIVI reports
    # in LLMs' keys; this small model has none): synthetic, labelled "outliers"
    outl = []
    for q, k, v in layers:
        k2 = k.clone()
        k2[..., :4] *= 20
        outl.append((q, k2, v))
    for i, (q, k, v) in enumerate(layers + outl):
        if i == len(layers):
            print("| keys with 4 outlier channels (x20, synthetic) | | | | | |")
        ref = attend(q, k, v)
        schemes = {
            "row (quantize_kv)": (q_rows(k, Dh), q_rows(v, Dh), 4 / Dh),
            "block32": (q_rows(k, 32), q_rows(v, 32), 4 / 32),
            "channel keys, row values": (q_channels(k), q_rows(v, Dh), None),
        }
        for name, (kq, vq, sb) in schemes.items():
            sb_s = f"{sb:.3f}" if sb is not None else f"{4 / 96:.3f} (K) / {4 / Dh:.3f} (V)"
            err = rel(attend(q, kq, vq), ref)
            print(f"| {i % len(layers)} | {name} | {rel(kq, k):.2e} | {rel(vq, v):.2e} | {err:.2e} | {sb_s} |")
    ch = torch.stack([k.abs().amax((0, 1)) for _, k, _ in layers])  # (layers, H, Dh)
    print(f"key channel absmax / median channel absmax: max {(ch / ch.median(-1, keepdim=True).values).max():.2f}")
    res = {i8: demo.cached_continuation(model, data["held"], i8) for i8 in (False, True)}
    p32, p8 = math.exp(res[False][0]), math.exp(res[True][0])
    print(f"continuation perplexity: float32 cache {p32:.3f}, int8 cache {p8:.3f} ({100 * (p8 / p32 - 1):+.3f}%)")


if __name__ == "__main__":
    main()
