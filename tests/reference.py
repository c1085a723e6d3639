"""The tests' references in plain PyTorch, shared by every topic folder.

``from reference import ...`` (tests/ is on sys.path: conftest.py's directory).

* ``philox``, ``keep_mask``: attention dropout's keep mask as masked_attn.h defines it
  (Philox-4x32-10; tests/attention/test_dropout.py checks it against Random123's known answers
  and the kernels' masks).
"""

import torch

M32 = 0xFFFFFFFF


# ---- dropout's keep mask, re-implemented in plain torch ---------------------------------------


def _mulhilo(a, m):
    prod = a * m  # < 2^64: int64 wraps, the low 64 bits are exact
    return (prod >> 32) & M32, prod & M32


def philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 on int64 tensors holding uint32 values."""
    c = [torch.as_tensor(x, dtype=torch.int64) for x in (c0, c1, c2, c3)]
    c = torch.broadcast_tensors(*c)
    k0, k1 = k0 & M32, k1 & M32
    for _ in range(10):
        hi0, lo0 = _mulhilo(c[0], 0xD2511F53)
        hi1, lo1 = _mulhilo(c[2], 0xCD9E8D57)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


def keep_mask(seed_tensor, B, H, Lq, Lk, p):
    """Z[b, h, i, j] as masked_attn.h defines it."""
    seed, offset = (int(x) & ((1 << 64) - 1) for x in seed_tensor.tolist())
    k0, k1 = seed & M32, (seed >> 32) ^ (offset >> 32)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in (B, H, Lq, Lk)), indexing="ij")
    words = philox(j >> 3, i, (b * H + h) & M32, offset & M32, k0, k1)
    w = torch.stack(words, -1)  # (..., 4)
    sel = torch.gather(w, -1, ((j & 7) >> 1).unsqueeze(-1)).squeeze(-1)
    u = (sel >> (16 * (j & 1))) & 0xFFFF
    return u >= round(p * 65536)
