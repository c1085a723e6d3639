"""Hugging Face transformers integration (torch_masked_attn.hf).

Tiny random models built from configs in code (no hub), float64 (float32 where
the reference is eager, see _dtype), each compared
with transformers' own "sdpa" (or "eager" where sdpa cannot run the model):
logits, gradients of every parameter, greedy generate tokens, left and right
padding, caches; apply(model)'s fused loss against the model's own.
"""

import copy

import pytest
import torch

from conftest import require

transformers = require("transformers")

from transformers import (  # noqa: E402
    AttentionInterface,
    BertConfig,
    BertModel,
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.masking_utils import (  # noqa: E402
    AttentionMaskInterface,
    create_causal_mask,
    create_sliding_window_causal_mask,
    sdpa_mask,
)

import torch_masked_attn.functional as tma_F  # noqa: E402
import torch_masked_attn.hf as hf  # noqa: E402
from reference import attention64, keep_mask  # noqa: E402
from torch_masked_attn import ops as tma_ops  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models are tiny: one thread (two threads' synchronisation costs more than
    the work, and far more when other processes share the cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


V = 64  # vocabulary
_SMALL = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _gpt_oss():
    try:
        from transformers import GptOssConfig, GptOssForCausalLM
    except ImportError:
        return None
    cfg = GptOssConfig(
        **{**_SMALL, "intermediate_size": 32},
        head_dim=8,
        sliding_window=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    return GptOssForCausalLM, cfg


# name: (model class, config, reference attn_implementation)
def _models():
    models = {
        "llama": (LlamaForCausalLM, LlamaConfig(**_SMALL), "sdpa"),
        "mistral": (MistralForCausalLM, MistralConfig(**_SMALL, sliding_window=4), "sdpa"),
        "qwen2": (
            Qwen2ForCausalLM,
            Qwen2Config(
                **_SMALL,
                use_sliding_window=True,
                sliding_window=5,
                max_window_layers=1,
                layer_types=["full_attention", "sliding_attention"],
            ),
            "sdpa",
        ),
        "gemma2": (
            Gemma2ForCausalLM,
            Gemma2Config(
                **_SMALL,
                head_dim=8,
                sliding_window=4,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0,
                query_pre_attn_scalar=8,
            ),
            "eager",
        ),
        "gpt2": (
            GPT2LMHeadModel,
            GPT2Config(
                vocab_size=V,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            "sdpa",
        ),
        "gpt_neox": (
            GPTNeoXForCausalLM,
            GPTNeoXConfig(
                vocab_size=V,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            "sdpa",
        ),
    }
    oss = _gpt_oss()
    if oss is not None:
        models["gpt_oss"] = (*oss, "eager")
    return models


MODELS = _models()


def _dtype(name):
    """float64, except where the reference is transformers' eager attention: it
    takes the softmax in float32, where float64's most negative mask value is
    -inf, and a fully masked row (a left-padded query) then gives NaN."""
    return torch.float32 if MODELS[name][2] == "eager" else torch.float64


def _tol(name):
    return dict(rtol=1e-9, atol=1e-10) if _dtype(name) == torch.float64 else dict(rtol=2e-5, atol=2e-5)


def _pair(name, ref_impl=None, dtype=None):
    """(reference model, masked_attn model) with the same weights, eval mode."""
    cls, cfg, ref = MODELS[name]
    cfg = copy.deepcopy(cfg)
    torch.manual_seed(1234)
    model = cls(cfg).to(dtype or _dtype(name))
    model.set_attn_implementation(ref_impl or ref)
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("masked_attn")
    return model.eval(), ours.eval()


def _batch(side, B=3, L=12, lengths=(12, 7, 9)):
    ids = torch.randint(3, V, (B, L))
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, L - n :] = 1
        else:
            mask[b, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _valid_loss(logits, mask, w):
    return (logits * w * mask[..., None]).sum()


def _assert_grads(ref, ours, rtol=1e-7, atol=1e-9):
    n = 0
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        n += 1
    assert n > 0


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_grads(name, side):
    ref, ours = _pair(name)
    ref.train(), ours.train()  # dropout is 0 in these configs; train mode for the training path
    ids, mask = _batch(side)
    w = torch.randn(*ids.shape, V, dtype=_dtype(name))
    outs = []
    for model in (ref, ours):
        out = model(input_ids=ids, attention_mask=mask)
        _valid_loss(out.logits, mask, w).backward()
        outs.append(out.logits)
    valid = mask.bool()
    torch.testing.assert_close(outs[1][valid], outs[0][valid], **_tol(name))
    if _dtype(name) == torch.float64:
        _assert_grads(ref, ours)
    else:
        _assert_grads(ref, ours, rtol=1e-4, atol=1e-4)


def test_bert_bidirectional_padding():
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    ref = BertModel(cfg, add_pooling_layer=False).to(torch.float64)
    ref.set_attn_implementation("sdpa")
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("masked_attn")
    ids, mask = _batch("right")
    w = torch.randn(*ids.shape, 32, dtype=torch.float64)
    outs = []
    for model in (ref, ours):
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        _valid_loss(h, mask, w).backward()
        outs.append(h)
    valid = mask.bool()
    torch.testing.assert_close(outs[1][valid], outs[0][valid], rtol=1e-9, atol=1e-10)
    _assert_grads(ref, ours)


_GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_generate_dynamic_cache(name, side):
    ref, ours = _pair(name)
    ids, mask = _batch(side, lengths=(12, 5, 9))
    a = ref.generate(input_ids=ids, attention_mask=mask, **_GEN)
    b = ours.generate(input_ids=ids, attention_mask=mask, **_GEN)
    keep = torch.ones(ids.size(0), dtype=torch.bool)
    w = getattr(ref.config, "sliding_window", None)
    if side == "right" and w:
        # right padding: the first new token is predicted from the last prompt
        # position, a padding query; where the padding is longer than a sliding
        # window that query sees no key at all: ours gives 0 there, eager a
        # uniform average (docs/design.md section 13) -- real tokens never differ
        keep = (ids.size(1) - mask.sum(1)) < w
        assert keep.any()
    torch.testing.assert_close(b[keep], a[keep], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_generate_static_cache(name):
    ref, ours = _pair(name)
    ids, mask = _batch("left", lengths=(12, 5, 9))
    a = ref.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **_GEN)
    b = ours.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **_GEN)
    torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_chunked_prefill_with_cache(name):
    """A second forward of several tokens onto a cache: the causal diagonal is
    bottom-right aligned there (q_offset > 0), the kernel's is top-left."""
    ref, ours = _pair(name)
    ids, mask = _batch("left", L=13, lengths=(13, 6, 10))
    logits = []
    for model in (ref, ours):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache, use_cache=True)
        out = model(input_ids=ids[:, 8:], attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    torch.testing.assert_close(logits[1], logits[0], **_tol(name))


def test_output_attentions_like_eager():
    ref, ours = _pair("llama", "eager", torch.float32)  # float32: see _dtype
    ids, mask = _batch("left")
    a = ref(input_ids=ids, attention_mask=mask, output_attentions=True)
    b = ours(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(b.attentions) == len(a.attentions) == 2
    # query rows of real tokens: a padded query row has no key (eager: uniform, ours: 0)
    valid = mask.bool()[:, None, :, None]
    for wa, wb in zip(a.attentions, b.attentions):
        assert wb is not None and wb.shape == wa.shape
        torch.testing.assert_close(torch.where(valid, wb, 0), torch.where(valid, wa, 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_custom_4d_mask_goes_through(kind):
    ref, ours = _pair("llama")
    B, L = 2, 10
    ids = torch.randint(3, V, (B, L))
    keep = torch.rand(B, 1, L, L) > 0.3
    keep |= torch.eye(L, dtype=torch.bool)  # no empty row
    mask = keep if kind == "bool" else torch.zeros(B, 1, L, L, dtype=torch.float64).masked_fill(~keep, -1e9)
    a = ref(input_ids=ids, attention_mask=mask).logits
    b = ours(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10)


def _emb(B, L):
    return torch.zeros(B, L, 32)


def test_mask_function_hands_structure():
    cfg = copy.deepcopy(MODELS["llama"][1])
    cfg._attn_implementation = "masked_attn"
    B, L = 3, 9
    _, mask = _batch("left", L=L, lengths=(9, 4, 6))
    m = create_causal_mask(cfg, _emb(B, L), mask, None)
    assert isinstance(m, hf.StructuredMask)
    args = m.kernel_args(L, L)
    assert args["is_causal"] and "attn_mask" not in args
    torch.testing.assert_close(args["key_padding_mask"], mask == 0)
    # no padding at all: nothing but is_causal on the top-left diagonal
    m = create_causal_mask(cfg, _emb(B, L), torch.ones(B, L, dtype=torch.long), None)
    assert m.kernel_args(L, L) == {"key_padding_mask": None, "is_causal": True, "diagonal": 0}
    # decoding one token onto a cache: the diagonal at the last key (every cached key visible)
    cache = DynamicCache(config=cfg)
    cache.update(torch.zeros(B, 2, L, 8), torch.zeros(B, 2, L, 8), 0)
    cache.update(torch.zeros(B, 2, L, 8), torch.zeros(B, 2, L, 8), 1)
    m = create_causal_mask(cfg, _emb(B, 1), torch.ones(B, L + 1, dtype=torch.long), cache)
    assert m.kernel_args(1, L + 1) == {"key_padding_mask": None, "is_causal": True, "diagonal": L}
    # sliding window: masked_attention's own window about the causal diagonal
    scfg = copy.deepcopy(MODELS["mistral"][1])
    scfg._attn_implementation = "masked_attn"
    m = create_sliding_window_causal_mask(scfg, _emb(B, L), mask, None)
    assert isinstance(m, hf.StructuredMask) and m.sliding_window == 4
    args = m.kernel_args(L, L)
    assert args["window"] == (3, None) and args["is_causal"] and args["diagonal"] == 0
    # a mask the structure does not cover goes through as transformers' own tensor
    m = create_causal_mask(cfg, _emb(B, L), mask, None, or_mask_function=lambda b, h, q, k: k == 0)
    assert isinstance(m, torch.Tensor) and m.shape == (B, 1, L, L)


@pytest.mark.parametrize("name", ["mistral", "gemma2"] + (["gpt_oss"] if "gpt_oss" in MODELS else []))
def test_window_softcap_sinks_paths(name, monkeypatch):
    """Sliding windows (also relative to a shifted diagonal, with a cache), soft-capping and
    sinks reach masked_attention as its own arguments, and the logits equal the reference
    implementation's."""
    calls = []
    real = tma_F.masked_attention

    def spy(*args, **kwargs):
        calls.append(sorted(k for k in ("window", "softcap", "sinks") if kwargs.get(k) is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(tma_F, "masked_attention", spy)
    ref, ours = _pair(name)
    ids, mask = _batch("left", L=13, lengths=(13, 6, 10))
    a = ref(input_ids=ids, attention_mask=mask).logits
    b = ours(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(b[valid], a[valid], **_tol(name))
    # decoding and a chunk onto a cache: windows relative to a shifted diagonal
    logits = []
    for model in (ref, ours):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :7], attention_mask=mask[:, :7], past_key_values=cache, use_cache=True)
        out = model(input_ids=ids[:, 7:12], attention_mask=mask[:, :12], past_key_values=cache, use_cache=True)
        out2 = model(input_ids=ids[:, 12:], attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(torch.cat([out.logits, out2.logits], 1))
    torch.testing.assert_close(logits[1], logits[0], **_tol(name))
    used = set(sum(calls, []))
    assert "window" in used
    if name == "gemma2":
        assert "softcap" in used
    if name == "gpt_oss":
        assert "sinks" in used


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract, sequence by sequence through the reference
    (tests/reference.py) in q's dtype, each window about the sequence's bottom-right diagonal."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    assert enable_gqa == (k.shape[1] != q.shape[1])
    outs = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        assert 0 < b - a <= max_q
        part = [t[a:b].transpose(0, 1) for t in (q, k, v)]
        out = attention64(*part, scale=scale, window=window_size, diagonal=0, dtype=q.dtype)  # Lq = Lk
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences_through_varlen(name, monkeypatch):
    """Packed sequences (position_ids restarting, no attention_mask): the mask function hands
    over the sequence ids and no mask is built; run here against a float64 stand-in with
    torch's varlen_attn contract (the exact window each model asks for)."""
    calls = []
    monkeypatch.setattr(
        tma_F, "varlen_attn", lambda *a, **k: calls.append(k["window_size"]) or _reference_varlen(*a, **k)
    )
    ref, ours = _pair(name)
    ids = torch.randint(3, V, (2, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]])
    a = ref(input_ids=ids, position_ids=pos, use_cache=False).logits  # transformers looks for packing without
    b = ours(input_ids=ids, position_ids=pos, use_cache=False).logits  # a cache only
    plain = ref(input_ids=ids, use_cache=False).logits
    assert not torch.allclose(a, plain)  # the packing changes the result
    torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10)
    assert calls and set(calls) == {(-1, 0) if name == "llama" else (3, 0)}


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_packed_sequences_real_varlen(name, monkeypatch):
    """Packed sequences through functional.varlen_attn itself (windows and softcap as its
    keyword extensions): logits and every parameter's gradient equal the reference
    implementation's on transformers' packed mask. (transformers 5.23 looks for packing in
    these models; GPT-OSS's masks never carry it, so its sinks reach varlen_attn only
    through tests/attention/test_varlen.py.)"""
    calls = []
    real = tma_F.varlen_attn
    monkeypatch.setattr(tma_F, "varlen_attn", lambda *a, **k: calls.append(k) or real(*a, **k))
    ref, ours = _pair(name)
    ids = torch.randint(3, V, (2, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]])
    a = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    b = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(b, a, **_tol(name))
    w = torch.randn_like(a)
    (a * w).sum().backward()
    (b * w).sum().backward()
    for (n, p), (_, p2) in zip(ref.named_parameters(), ours.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p2.grad, p.grad, **_tol(name), msg=lambda m, n=n: f"{n}: {m}")
    assert calls
    if name == "gemma2":
        assert all(c.get("softcap") for c in calls)


def test_packed_sequences_with_weights_or_dropout():
    """Packed sequences where varlen_attn cannot serve (attention weights, dropout): the packed
    pattern as transformers' 4-D mask into masked_attention, never the plain causal pattern.
    Weights: logits equal sdpa's on the packed batch. Dropout 0.25: equal to the plain-torch
    dropout reference (same seeds) on the packed mask, and unlike the unpacked batch."""
    ref, ours = _pair("llama")
    ids = torch.randint(3, V, (2, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]])
    a = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    b = ours(input_ids=ids, position_ids=pos, use_cache=False, output_attentions=True).logits
    torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10)
    for model in (ref, ours):
        model.config.attention_dropout = 0.25
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.25
    ref.set_attn_implementation("ref_dropout")
    out = []
    for model, p in ((ref, pos), (ours, pos), (ours, None)):
        torch.manual_seed(3)
        out.append(model.train()(input_ids=ids, position_ids=p, use_cache=False).logits)
    torch.testing.assert_close(out[1], out[0], rtol=1e-9, atol=1e-10)
    assert not torch.allclose(out[2], out[1])


def _ref_dropout_mask(*args, **kwargs):
    """transformers' sdpa mask, always as a tensor (True = attend)."""
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})


def _ref_dropout_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention with dropout from the definition: the reference (tests/reference.py) in the
    query's dtype, P = softmax(scale q k^T) under the mask, P' = P Z / (1 - p) with Z the keep mask
    of masked_attn.h (reference.keep_mask) for a (seed, offset) drawn from torch's default
    generator as masked_attention draws it, out = P' v. Returns (B, Lq, H, Dv) as transformers
    wants."""
    B, H, Lq, _ = query.shape
    keep = None
    if dropout > 0.0:
        keep = keep_mask(tma_ops.new_dropout_seed(), B, H, Lq, key.shape[2], dropout)
    out = attention64(
        query,
        key,
        value,
        scale=scaling,
        attn_mask=~attention_mask,  # a fully masked row gives 0, as ours does
        dropout_keep=keep,
        dropout_p=dropout,
        dtype=query.dtype,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("ref_dropout", _ref_dropout_attention)
AttentionMaskInterface.register("ref_dropout", _ref_dropout_mask)


@pytest.mark.parametrize("side", ["left", "right"])
def test_dropout_in_our_kernel(side, monkeypatch):
    """The model's attention_dropout in training runs in our kernel (no fallback), and is the
    kernels' dropout: the loss and every parameter's gradient equal a plain-torch reference
    that drops with the same keep mask (same seeds from torch's default generator); the same
    seed gives the same loss, another seed another; eval mode has no dropout and equals sdpa."""

    def no_fallback(*a, **k):
        raise AssertionError("dropout fell back to transformers' sdpa")

    monkeypatch.setattr(hf, "sdpa_attention_forward", no_fallback)
    cls, cfg, _ = MODELS["llama"]
    cfg = copy.deepcopy(cfg)
    cfg.attention_dropout = 0.25
    torch.manual_seed(1234)
    ref = cls(cfg).to(torch.float64)
    ours = copy.deepcopy(ref)
    ref.set_attn_implementation("ref_dropout")
    ours.set_attn_implementation("masked_attn")
    ids, mask = _batch(side)
    w = torch.randn(*ids.shape, V, dtype=torch.float64)

    def loss(model, seed):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        value = _valid_loss(model.train()(input_ids=ids, attention_mask=mask).logits, mask, w)
        value.backward()
        return value.detach()

    a, b = loss(ref, 7), loss(ours, 7)
    torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10)
    _assert_grads(ref, ours)
    assert torch.equal(loss(ours, 7), b)  # same seed, same result
    assert not torch.allclose(loss(ours, 8), b)  # another seed, other masks
    no_drop = copy.deepcopy(ours)
    no_drop.config.attention_dropout = 0.0
    for layer in no_drop.model.layers:
        layer.self_attn.attention_dropout = 0.0
    assert not torch.allclose(loss(no_drop, 7), b)  # the dropout is applied at all
    sdpa = copy.deepcopy(ours)
    sdpa.set_attn_implementation("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(
            ours.eval()(input_ids=ids, attention_mask=mask).logits,
            sdpa.eval()(input_ids=ids, attention_mask=mask).logits,
            rtol=1e-9,
            atol=1e-10,
        )


# ---------------------------------------------------------------------------------------------
# apply(model): the fused linear-cross-entropy loss
# ---------------------------------------------------------------------------------------------


def _labels(ids, mask):
    return ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2", "qwen2"])
def test_apply_loss_and_grads(name):
    ref, ours = _pair(name, "masked_attn")  # the same attention on both sides: the loss alone differs
    hf.apply(ours)
    # transformers takes the loss in float32 (logits.float()); ours in the model's dtype
    tol = dict(rtol=1e-6, atol=1e-6)
    gtol = dict(rtol=1e-5, atol=1e-6) if _dtype(name) == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    ref.train(), ours.train()
    ids, mask = _batch("right")
    labels = _labels(ids, mask)
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = ours(input_ids=ids, attention_mask=mask, labels=labels)
    assert b.logits is None and a.logits is not None
    torch.testing.assert_close(b.loss, a.loss.to(b.loss.dtype), **tol)
    a.loss.backward()
    b.loss.backward()
    _assert_grads(ref, ours, **gtol)
    # Trainer's num_items_in_batch: a sum over the tokens divided by it
    n = torch.tensor(17)
    a = ref(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    b = ours(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    torch.testing.assert_close(b.loss, a.loss.to(b.loss.dtype), **tol)
    # eval mode, or skip_logits=False: the model as before, logits and its own loss
    ours.eval()
    c = ours(input_ids=ids, attention_mask=mask, labels=labels)
    assert c.logits is not None and c.logits.shape == (*ids.shape, V)
    d = ours(input_ids=ids, attention_mask=mask, labels=labels, skip_logits=True)
    assert d.logits is None
    torch.testing.assert_close(d.loss, c.loss.to(d.loss.dtype), **tol)
    # generate is untouched
    ours.generate(input_ids=ids[:1], attention_mask=mask[:1], **_GEN)


def test_apply_skips_ignored_rows():
    """No (tokens x vocab) product: the matrix-product FLOPs of the LM head
    scale with the labelled tokens, not with all of them."""
    from torch.utils.flop_counter import FlopCounterMode

    _, ours = _pair("llama", "masked_attn")
    hf.apply(ours).train()
    ids, mask = _batch("right", B=4, L=16, lengths=(16, 16, 16, 16))
    flops = {}
    for kept in (64, 8):
        labels = ids.clone()
        labels.view(-1)[kept:] = -100
        with FlopCounterMode(display=False) as counter:
            ours(input_ids=ids, attention_mask=mask, labels=labels)
        flops[kept] = counter.get_total_flops()
    # labels shift by one: 60 rows (the last token of each sequence has no label) against 7;
    # the head's product alone is 2 * d * V FLOPs a row (its gradients add more)
    assert flops[64] - flops[8] >= 2 * 32 * V * (60 - 7)


def test_apply_refuses_non_causal_lm():
    bert = BertModel(
        BertConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    )
    with pytest.raises(TypeError, match="not a causal LM"):
        hf.apply(bert)
    from transformers import CohereConfig, CohereForCausalLM

    cohere = CohereForCausalLM(
        CohereConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            eos_token_id=2,
        )
    )
    with pytest.raises(NotImplementedError, match="scales its logits"):
        hf.apply(cohere)


def test_gradient_checkpointing_and_bfloat16():
    """The structured mask through activation checkpointing; a bfloat16 model against sdpa."""
    ref, ours = _pair("mistral")
    # activation_checkpointing_* from transformers 5.23, gradient_checkpointing_* before
    word = "activation" if hasattr(ref, "activation_checkpointing_enable") else "gradient"
    for model in (ref, ours):
        getattr(model, f"{word}_checkpointing_enable")()
        model.train()
    ids, mask = _batch("left")
    labels = _labels(ids, mask)
    for model in (ref, ours):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    _assert_grads(ref, ours)
    ref, ours = ref.to(torch.bfloat16).eval(), ours.to(torch.bfloat16).eval()
    for model in (ref, ours):
        getattr(model, f"{word}_checkpointing_disable")()
    a = ref(input_ids=ids, attention_mask=mask).logits.float()
    b = ours(input_ids=ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    torch.testing.assert_close(b[valid], a[valid], rtol=0.05, atol=0.05)
