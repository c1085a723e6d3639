"""Train a small causal transformer language model twice, side by side:
once built on torch.nn (nn.MultiheadAttention, nn.CrossEntropyLoss) and once on
torch_masked_attn's drop-ins, from identical initial weights, on padded
variable-length batches.

The task, generated in code: reverse a sequence of letters.
    "c a d b = b d a c"
Only the answer after "=" is scored; the prompt and the padding carry
ignore_index, so the loss (and perplexity) count answer tokens only.

Every few steps the program prints both models' loss, perplexity and time per
step; at the end a summary, a PNG of both loss curves and a PNG of the trained
model's attention weights per head for one example.

Run:  make demo     (or .venv/bin/python examples/demo.py [--steps N])
"""
import argparse
import math
import os
import time

import torch
from torch import nn

import torch_masked_attn as tma

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")

# ---- the task ----------------------------------------------------------------
LETTERS = "abcdefghijklmnop"
PAD, SEP = 0, 1                    # token ids; letters are 2 .. 2 + len(LETTERS) - 1
VOCAB = 2 + len(LETTERS)
IGNORE = -100
MIN_LEN, MAX_LEN = 3, 12


def make_batch(batch_size, gen):
    """A padded batch: tokens (B, L), targets (B, L) with IGNORE on the prompt
    and the padding, key_padding_mask (B, L) True at padding."""
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (batch_size,), generator=gen)
    L = 2 * MAX_LEN + 1
    tokens = torch.full((batch_size, L), PAD, dtype=torch.long)
    targets = torch.full((batch_size, L), IGNORE, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        seq = torch.randint(2, VOCAB, (n,), generator=gen)
        row = torch.cat([seq, torch.tensor([SEP]), seq.flip(0)])
        tokens[b, : 2 * n + 1] = row
        targets[b, n: 2 * n] = row[n + 1: 2 * n + 1]   # predict the answer from "=" on
    padding = tokens == PAD
    return tokens, targets, padding


def decode(tokens):
    return " ".join("=" if t == SEP else LETTERS[t - 2] for t in tokens.tolist() if t != PAD)


# ---- the model ---------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d, heads, mha_cls):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = mha_cls(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, causal, padding, need_weights=False):
        h = self.ln1(x)
        a, w = self.attn(h, h, h, key_padding_mask=padding, attn_mask=causal, is_causal=True,
                         need_weights=need_weights, average_attn_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x)), w


class TinyLM(nn.Module):
    def __init__(self, mha_cls, d=64, heads=4, layers=2, max_len=2 * MAX_LEN + 1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, mha_cls) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, tokens, padding, need_weights=False):
        L = tokens.size(1)
        causal = torch.ones(L, L, dtype=torch.bool).triu(1)        # True = blocked
        x = self.tok(tokens) + self.pos(torch.arange(L))
        weights = []
        for blk in self.blocks:
            x, w = blk(x, causal, padding, need_weights)
            weights.append(w)
        return self.head(self.ln(x)), weights


def build_pair(seed=0):
    torch.manual_seed(seed)
    native = TinyLM(nn.MultiheadAttention)
    ours = TinyLM(tma.MultiheadAttention)
    ours.load_state_dict(native.state_dict())                     # identical initial weights
    return native, ours


# ---- training ------------------------------------------------------------------
def train(steps=300, batch_size=32, lr=3e-3, log_every=25, seed=0, verbose=True):
    """Trains both models on the same batches; returns a dict of per-step
    losses, perplexities and step times of both, and the trained models."""
    native, ours = build_pair(seed)
    losses = {"native": nn.CrossEntropyLoss(ignore_index=IGNORE),
              "ours": tma.CrossEntropyLoss(ignore_index=IGNORE)}
    models = {"native": native, "ours": ours}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=lr) for k, m in models.items()}
    hist = {k: {"loss": [], "ppl": [], "time": []} for k in models}
    gen = torch.Generator().manual_seed(seed + 1)
    if verbose:
        print(f"{'step':>5} | {'native loss':>11} {'ppl':>7} {'ms/step':>8} | "
              f"{'ours loss':>9} {'ppl':>7} {'ms/step':>8}")
    for step in range(1, steps + 1):
        tokens, targets, padding = make_batch(batch_size, gen)
        for name in ("native", "ours"):
            model, opt = models[name], opts[name]
            t0 = time.perf_counter()
            logits, _ = model(tokens, padding)
            loss = losses[name](logits.reshape(-1, VOCAB), targets.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            hist[name]["time"].append(time.perf_counter() - t0)
            hist[name]["loss"].append(loss.item())
            hist[name]["ppl"].append(math.exp(loss.item()))
        if verbose and (step % log_every == 0 or step == 1):
            n, o = hist["native"], hist["ours"]
            print(f"{step:>5} | {n['loss'][-1]:>11.4f} {n['ppl'][-1]:>7.3f} {1e3 * n['time'][-1]:>8.1f} | "
                  f"{o['loss'][-1]:>9.4f} {o['ppl'][-1]:>7.3f} {1e3 * o['time'][-1]:>8.1f}", flush=True)
    return hist, models


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"training two identical 2-layer causal LMs (vocab {VOCAB}, d=64, 4 heads) on sequence "
          f"reversal, padded batches of 32, lengths {2 * MIN_LEN + 1}..{2 * MAX_LEN + 1}\n")
    t_start = time.perf_counter()
    hist, models = train(args.steps)
    n, o = hist["native"], hist["ours"]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731

    # a held-out batch: exact-match accuracy of greedy answers, and perplexity
    gen = torch.Generator().manual_seed(12345)
    tokens, targets, padding = make_batch(256, gen)
    scored = targets != IGNORE
    summary = {}
    with torch.no_grad():
        for name, model in models.items():
            logits, _ = model(tokens, padding)
            correct = (logits.argmax(-1) == targets) | ~scored
            acc = correct.all(dim=1).float().mean().item()
            ppl = tma.perplexity(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE).item()
            summary[name] = (acc, ppl)
    first = min(20, len(n["loss"]))
    max_diff = max(abs(a - b) for a, b in zip(n["loss"][:first], o["loss"][:first]))
    print("\nsummary")
    print(f"  steps: {args.steps}; total time {time.perf_counter() - t_start:.1f} s")
    print(f"  max |loss difference| over the first {first} steps: {max_diff:.2e}")
    for name in ("native", "ours"):
        h = hist[name]
        acc, ppl = summary[name]
        print(f"  {name:>6}: final loss {h['loss'][-1]:.4f}, held-out perplexity {ppl:.3f}, "
              f"exact-match answers {100 * acc:.1f}%, median step {1e3 * med(h['time']):.1f} ms")
    print(f"  speed ratio (native / ours, median step): {med(n['time']) / med(o['time']):.2f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(OUT_DIR, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(n["loss"], label="torch.nn", lw=2)
    ax.plot(o["loss"], label="torch_masked_attn", lw=1, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (answer tokens)")
    ax.legend()
    ax.set_title("identical models, identical batches")
    fig.tight_layout()
    curves = os.path.join(OUT_DIR, "loss_curves.png")
    fig.savefig(curves, dpi=110)

    b = 0
    with torch.no_grad():
        _, weights = models["ours"](tokens[b:b + 1], padding[b:b + 1], need_weights=True)
    n_real = int((~padding[b]).sum())
    words = decode(tokens[b]).split()
    layers, heads = len(weights), weights[0].size(1)
    fig, axes = plt.subplots(layers, heads, figsize=(3 * heads, 3 * layers))
    for li in range(layers):
        for h in range(heads):
            ax = axes[li][h]
            ax.imshow(weights[li][0, h, :n_real, :n_real], cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"layer {li} head {h}", fontsize=9)
            ax.set_xticks(range(n_real), words, fontsize=6)
            ax.set_yticks(range(n_real), words, fontsize=6)
    fig.suptitle(f"trained model's attention: {decode(tokens[b])}")
    fig.tight_layout()
    heat = os.path.join(OUT_DIR, "trained_attention.png")
    fig.savefig(heat, dpi=110)
    print(f"\nwrote {curves}\nwrote {heat}")


if __name__ == "__main__":
    main()
