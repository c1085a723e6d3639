"""A tour of torch_masked_attn's attention on a padded batch.

Four sentences of different lengths are padded to one length, and attention
runs with a causal mask and a key padding mask through the op
torch.ops.masked_attn.forward. The program prints the attention weights of each
head for one sentence, checks the two properties a causal language model
relies on (no look-ahead, padding invariance), compares the drop-in
MultiheadAttention with torch.nn.MultiheadAttention, and writes a heatmap of
the attention weights per head.

Run:  make demo-attention     (or .venv/bin/python examples/attention_demo.py)
"""

import os

import torch

import torch_masked_attn as tma

torch.manual_seed(0)
torch.set_printoptions(precision=2, sci_mode=False, linewidth=120)
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")

# ---- a padded batch ---------------------------------------------------------
sentences = ["the cat sat on the mat", "dogs bark", "a quick brown fox jumps over", "hello world again"]
lengths = torch.tensor([len(s.split()) for s in sentences])
B, L, H, D = len(sentences), int(lengths.max()), 4, 8
E = H * D
x = torch.randn(B, L, E)
key_padding_mask = torch.arange(L)[None, :] >= lengths[:, None]  # (B, L), True = padding
print(f"batch of {B} sentences, lengths {lengths.tolist()}, padded to L={L}")
print("key_padding_mask (True = padding):")
print(key_padding_mask.int())

# ---- the op itself: q, k, v in (B, H, L, D) ---------------------------------
proj = torch.nn.Linear(E, 3 * E)
q, k, v = proj(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)  # views, no copies
out, lse, weights, _ = torch.ops.masked_attn.forward(
    q, k, v, None, key_padding_mask, None, is_causal=True, need_weights=True
)
print(
    f"\ntorch.ops.masked_attn.forward: out {tuple(out.shape)}, lse {tuple(lse.shape)}, weights {tuple(weights.shape)}"
)
b = 1
n = int(lengths[b])
print(f"\nattention weights of sentence {b} ({sentences[b]!r}, {n} real tokens), per head;")
print("rows = queries, columns = keys; causal (upper triangle 0) and padded keys (last columns 0):")
for h in range(H):
    print(f"head {h}:")
    print(weights[b, h].detach())


# ---- property 1: no look-ahead ---------------------------------------------
# Each call is compared with the same call on changed inputs: a call's rows keep their bits
# within the path it takes (a few query rows go to the decode kernel, need_weights=True to the
# weights path; the two round differently: docs/design/05-attention-algorithm.md, "Bits").
def attend(q, k, v, kpm, need_weights):
    if need_weights:
        return torch.ops.masked_attn.forward(q, k, v, None, kpm, None, is_causal=True, need_weights=True)[0]
    return tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True)


t = 3
x2 = x.clone()
x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])  # change every token after t
q2, k2, v2 = proj(x2).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
for need_weights in (False, True):
    a, b2 = attend(q, k, v, key_padding_mask, need_weights), attend(q2, k2, v2, key_padding_mask, need_weights)
    same = torch.equal(a[:, :, : t + 1], b2[:, :, : t + 1])
    changed = not torch.equal(a[:, :, t + 1 :], b2[:, :, t + 1 :])
    print(
        f"\nno look-ahead ({'need_weights=True' if need_weights else 'plain call'}): tokens after position {t} "
        f"changed, outputs up to {t} bitwise unchanged: {same}, later outputs changed: {changed}"
    )
    assert same and changed

# ---- property 2: padding invariance ----------------------------------------
extra = 5
x3 = torch.cat([x, torch.randn(B, extra, E)], dim=1)  # more padding, random content
kpm3 = torch.arange(L + extra)[None, :] >= lengths[:, None]
q3, k3, v3 = proj(x3).view(B, L + extra, 3, H, D).permute(2, 0, 3, 1, 4)
real = ~key_padding_mask  # (B, L) real tokens
for need_weights in (False, True):
    a, b3 = attend(q, k, v, key_padding_mask, need_weights), attend(q3, k3, v3, kpm3, need_weights)
    same = torch.equal(a.permute(0, 2, 1, 3)[real], b3[:, :, :L].permute(0, 2, 1, 3)[real])
    print(
        f"padding invariance ({'need_weights=True' if need_weights else 'plain call'}): {extra} more padded "
        f"positions, real tokens' outputs bitwise unchanged: {same}"
    )
    assert same

# ---- drop-in for nn.MultiheadAttention ---------------------------------------
native = torch.nn.MultiheadAttention(E, H, batch_first=True)
ours = tma.MultiheadAttention(E, H, batch_first=True)
ours.load_state_dict(native.state_dict())
causal = torch.ones(L, L, dtype=torch.bool).triu(1)  # True = blocked
y_native, w_native = native(x, x, x, key_padding_mask=key_padding_mask, attn_mask=causal, is_causal=True)
y_ours, w_ours = ours(x, x, x, key_padding_mask=key_padding_mask, attn_mask=causal, is_causal=True)
print(
    f"\nvs nn.MultiheadAttention (same weights): max |output diff| {(y_native - y_ours).abs().max():.1e}, "
    f"max |weights diff| {(w_native - w_ours).abs().max():.1e}"
)
assert torch.allclose(y_native, y_ours, atol=1e-5) and torch.allclose(w_native, w_ours, atol=1e-6)

# ---- heatmap -----------------------------------------------------------------
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

os.makedirs(OUT_DIR, exist_ok=True)
words = sentences[b].split() + ["<pad>"] * (L - n)
fig, axes = plt.subplots(1, H, figsize=(3.2 * H, 3.4))
for h, ax in enumerate(axes):
    ax.imshow(weights[b, h].detach(), cmap="viridis", vmin=0, vmax=1)
    ax.set_title(f"head {h}")
    ax.set_xticks(range(L), words, rotation=90, fontsize=7)
    ax.set_yticks(range(L), words, fontsize=7)
fig.suptitle(f"attention weights, causal + key padding: {sentences[b]!r}")
fig.tight_layout()
path = os.path.join(OUT_DIR, "attention_heads.png")
fig.savefig(path, dpi=110)
print(f"\nwrote {path}")
