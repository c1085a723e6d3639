"""The `kv8` group of run.py: the 8-bit KV cache (functional.quantize_kv,
masked_attention / varlen_attn with k_scale, v_scale) against the same
attention over a bfloat16 cache.

Every cache here lies on 2 MB pages, the int8 one (quantize_kv's output, which
the shim asks the kernel to back with transparent huge pages) and the
bfloat16 one alike (allocated here with the same madvise), so the ratio is the
cache format's alone: on 4 KB pages both read about 12% slower (SPR,
2026-11-28).

  kv8-decode     one decoding step, B=8 H=32 Lk=4096 D=128, bfloat16 queries: ours
                 over the int8 cache; "native" the faster of ours and F.sdpa over the
                 bfloat16 cache. traffic_bytes counts what the int8 step must read
                 (values and scales).
  kv8-prefill    a prefill chunk of 512 queries over 4096 cached keys (the chunk's own
                 keys the last 512, causal to the bottom right), H=32 D=128, varlen_attn
                 over packed rows; "native" ours over the bfloat16 cache.
  kv8-quantize   write_kv_cache quantizing 8 x 4096 new rows of keys and values
                 (H_kv=8, D=128, bfloat16) into preallocated int8 caches (quantize_kv's
                 kernel, without its fresh output, whose first touch costs more than
                 the kernel); "native" the same definition in PyTorch ops. traffic_bytes:
                 bfloat16 in, int8 and scales out.
  kv8-hf-generate  generate on a small Llama with hf.Int8Cache against transformers'
                 QuantizedCache (optimum-quanto, 4 bits) on "sdpa" (skipped without it).
"""

import ctypes
import math

import torch
import torch.nn.functional as F

import torch_masked_attn as tma

tf = tma.functional


def huge_empty(shape, dtype):
    """An uninitialised tensor on transparent huge pages (madvise), like quantize_kv's output."""
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    huge = 2 << 20
    buf = torch.empty(n + huge, dtype=torch.uint8)
    off = -buf.data_ptr() % huge
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(buf.data_ptr() + off), ctypes.c_size_t(n // huge * huge), 14)
    except (OSError, AttributeError):
        pass  # no madvise: 4 KB pages
    return buf[off : off + n].view(dtype).view(shape)


def _huge_copy(t):
    out = huge_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def decode(B=8, H=32, Lk=4096, D=128):
    from bench_cases import Bench, attention_flops

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g).bfloat16()
    k, v = (torch.randn(B, H, Lk, D, generator=g) for _ in range(2))
    (kq, ks), (vq, vs) = tf.quantize_kv(k), tf.quantize_kv(v)
    kb, vb = _huge_copy(k.bfloat16()), _huge_copy(v.bfloat16())
    del k, v

    def ours():
        with torch.no_grad():
            return tf.masked_attention(q, kq, vq, k_scale=ks, v_scale=vs)

    def ours_bf16():
        with torch.no_grad():
            return tf.masked_attention(q, kb, vb)

    def sdpa_bf16():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, kb, vb)

    traffic = 2.0 * B * H * Lk * (D + 4)
    fl = attention_flops(B, H, 1, Lk, D, causal=False, backward=False)
    return Bench(
        work=f"B={B} H={H} Lq=1 Lk={Lk} D={D}, bfloat16 q: ours over an int8 cache (K+V+scales "
        f"{traffic / 1e6:.0f} MB) vs the bfloat16 cache ({2 * B * H * Lk * D * 2 / 1e6:.0f} MB)",
        natives={"ours-bf16-cache": ours_bf16, "sdpa-bf16-cache": sdpa_bf16},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        traffic_bytes=traffic,
        info=dict(B=B, H=H, Lq=1, Lk=Lk, D=D, dtype="torch.bfloat16", cache="int8"),
    )


def prefill(Lq=512, Lk=4096, H=32, D=128):
    from bench_cases import Bench

    g = torch.Generator().manual_seed(1)
    q = torch.randn(Lq, H, D, generator=g).bfloat16()
    k, v = (torch.randn(Lk, H, D, generator=g) for _ in range(2))
    (kq, ks), (vq, vs) = tf.quantize_kv(k), tf.quantize_kv(v)
    kb, vb = _huge_copy(k.bfloat16()), _huge_copy(v.bfloat16())
    cu_q = torch.tensor([0, Lq], dtype=torch.int32)
    cu_k = torch.tensor([0, Lk], dtype=torch.int32)

    def ours():
        with torch.no_grad():
            return tf.varlen_attn(q, kq, vq, cu_q, cu_k, Lq, Lk, window_size=(-1, 0), k_scale=ks, v_scale=vs)

    def ours_bf16():
        with torch.no_grad():
            return tf.varlen_attn(q, kb, vb, cu_q, cu_k, Lq, Lk, window_size=(-1, 0))

    # causal to the bottom right: query i sees keys <= i + Lk - Lq
    fl = 4.0 * H * D * sum(Lk - Lq + i + 1 for i in range(Lq))
    return Bench(
        work=f"prefill chunk Lq={Lq} over Lk={Lk} cached keys (causal, bottom right) H={H} D={D}, "
        "bfloat16 q, varlen_attn: int8 cache vs bfloat16 cache",
        natives={"ours-bf16-cache": ours_bf16},
        ours=ours,
        flops=fl,
        attn_flops=fl,
        info=dict(Lq=Lq, Lk=Lk, H=H, D=D, dtype="torch.bfloat16", cache="int8"),
    )


def quantize(B=8, L=4096, H=8, D=128):
    from bench_cases import Bench

    g = torch.Generator().manual_seed(2)
    T = B * L
    k, v = (_huge_copy(torch.randn(T, H, D, generator=g).bfloat16()) for _ in range(2))
    kc, vc = (huge_empty((T, H, D), torch.int8).zero_() for _ in range(2))
    ks, vs = (huge_empty((T, H), torch.float32).zero_() for _ in range(2))
    slots = torch.arange(T)

    def ours():
        tf.write_kv_cache(k, v, kc, vc, slots, ks, vs)
        return kc

    def native():  # the definition (tests/decode/test_kv_int8.py, quant_ref) in PyTorch ops, into the same caches
        for x, xc, xs in ((k, kc, ks), (v, vc, vs)):
            xf = x.float()
            am = xf.abs().amax(-1, keepdim=True)
            c = torch.full_like(am, 127.0)
            xc.copy_((xf * (c / am)).clamp(-127, 127).round())
            xs.copy_((am / c)[..., 0])
        return kc

    n = T * H * D
    traffic = 2 * (n * 2.0 + n * 1.0 + n / D * 4.0)
    return Bench(
        work=f"write_kv_cache quantizing {T} new rows of keys and values (H_kv={H}, D={D}, bfloat16, "
        f"{2 * n * 2 / 1e6:.0f} MB in) into int8 caches ({2 * (n + n / D * 4) / 1e6:.0f} MB out), "
        "vs the definition in PyTorch ops into the same caches",
        natives={"torch-ops": native},
        ours=ours,
        traffic_bytes=traffic,
        info=dict(T=T, H=H, D=D, dtype="torch.bfloat16"),
    )


def hf_generate(B=2, prompt=512, new=32):
    """A small Llama (hidden 512, 4 layers, 8 heads on 2 KV heads, random weights, nothing
    downloaded) generating `new` tokens greedily after a `prompt`-token prompt: ours on
    "masked_attn" with hf.Int8Cache against transformers' QuantizedCache (optimum-quanto,
    4 bits, the smallest it offers; it dequantizes the whole cache at every step) on "sdpa".
    The peer installs beside the package (make bench), never as a dependency."""
    from bench_cases import Bench, Skip

    try:
        import optimum.quanto  # noqa: F401
        from transformers import AutoModelForCausalLM, LlamaConfig, QuantizedCache
    except ImportError as e:
        raise Skip(f"optimum-quanto is not installed ({e})") from e
    import torch_masked_attn.hf as tma_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    models = {
        impl: AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval() for impl in ("sdpa", "masked_attn")
    }
    models["masked_attn"].load_state_dict(models["sdpa"].state_dict())
    ids = torch.randint(1, 32000, (B, prompt))
    kw = dict(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    def ours():
        with torch.no_grad():
            return models["masked_attn"].generate(**kw, past_key_values=tma_hf.Int8Cache())[:, prompt:].float()

    def quanto():
        with torch.no_grad():
            cache = QuantizedCache(backend="quanto", config=cfg, nbits=4)
            return models["sdpa"].generate(**kw, past_key_values=cache)[:, prompt:].float()

    return Bench(
        work=f"HF generate, Llama hidden 512, 4 layers, 8 heads on 2 KV heads, B={B}, {prompt}-token prompt, "
        f"{new} new tokens (greedy): ours on masked_attn + hf.Int8Cache vs transformers' QuantizedCache "
        "(optimum-quanto, 4 bits) on sdpa (the tokens differ: 4 and 8 bits round differently)",
        natives={"quanto-4bit": quanto},
        ours=ours,
        memory=False,
        info=dict(B=B, prompt=prompt, new=new, cache="int8 vs quanto 4-bit"),
    )


NAMED = {"kv8-decode": decode, "kv8-prefill": prefill, "kv8-quantize": quantize, "kv8-hf-generate": hf_generate}
GROUP = list(NAMED)
