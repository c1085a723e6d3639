"""Continuous batching (transformers' generate_batch / ContinuousBatchingManager) on
"masked_attn": the same greedy tokens as transformers' own generate() with its reference
attention, for every batch shape CB builds (prefill, decode, chunked prefill mixed with decodes),
full-attention and sliding-window layers (CB's ring buffer), soft-capping, sinks and grouped-query
heads, with page sizes our kernels read in place (multiples of 64) and others; our ops counted
as called and no dense mask built."""

import copy

import pytest
import torch

from conftest import require

transformers = require("transformers")

from test_hf import MODELS  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import torch_masked_attn.functional as tma_F  # noqa: E402
import torch_masked_attn.hf as hf  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of our attention and cache ops from the CB path."""
    calls = {"varlen_attn": 0, "write_kv_cache": 0, "sdpa": 0, "ring_in_place": 0, "ring_gathered": 0}
    ring_step = hf._ring_step

    def ring_spy(*a, **k):
        step = ring_step(*a, **k)
        calls["ring_in_place"] += int((step.seqused > 0).sum())
        calls["ring_gathered"] += 0 if step.gathered is None else int(step.gathered.sum())
        return step

    monkeypatch.setattr(hf, "_ring_step", ring_spy)
    for name in ("varlen_attn", "write_kv_cache"):
        fn = getattr(tma_F, name)

        def spy(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(tma_F, name, spy)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def no_sdpa(*a, **k):
        calls["sdpa"] += 1
        return sdpa(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    return calls


def _pair(name, dtype=torch.float64, **overrides):
    cls, cfg, ref_impl = MODELS[name]
    cfg = copy.deepcopy(cfg)
    cfg.max_position_embeddings = 512
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(4321)
    ref = cls(cfg).to(dtype).eval()
    ref.set_attn_implementation(ref_impl)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("masked_attn")
    hf.apply(ours)
    return ref, ours


def _prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference_tokens(ref, prompts, new):
    return _generate_logprobs(ref, prompts, new, fake_quant=False)[0]


def _cb_tokens(model, prompts, new, **cb):
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    res = model.generate_batch(
        prompts, generation_config=gc, continuous_batching_config=ContinuousBatchingConfig(**cb), progress_bar=False
    )
    return [res[f"req_{i}"].generated_tokens for i in range(len(prompts))]


CASES = [  # (model, prompt lengths, CB config[, config overrides])
    ("llama", (5, 17, 40, 3, 64, 90), dict(page_size=64)),
    ("llama", (130, 7, 200), dict(page_size=256)),
    ("llama", (33, 70, 9), dict(page_size=16)),  # pages the kernels do not read in place
    ("llama", (100, 6, 150, 41), dict(page_size=64, max_batch_tokens=48)),  # chunked prefill mixed with decodes
    ("mistral", (3, 12, 30, 70), dict(page_size=64)),  # sliding window 4: CB's ring buffer
    ("mistral", (50, 9, 80), dict(page_size=64, max_batch_tokens=24)),
    ("qwen2", (20, 45, 7), dict(page_size=64)),  # full and sliding layers
    ("gemma2", (11, 60, 25), dict(page_size=64, max_batch_tokens=32)),  # softcap, sliding, scaling
]
CASES += [  # a ring of several pages: read in place when they are whole (128 = 2 x 64), decodes past
    # the window gathered when the ring's last page is partial (100 = 64 + 36)
    ("mistral", (150, 20, 230), dict(page_size=64), dict(sliding_window=128)),
    ("mistral", (150, 20, 230), dict(page_size=64, max_batch_tokens=64), dict(sliding_window=128)),
    ("mistral", (150, 20, 230), dict(page_size=64), dict(sliding_window=100)),
]
if "gpt_oss" in MODELS:
    CASES.append(("gpt_oss", (14, 52, 6, 33), dict(page_size=64, max_batch_tokens=40)))  # sinks


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_generate_batch_matches_generate(case, counted):
    name, lengths, cb, overrides = (*case, {})[:4]
    ref, ours = _pair(
        name,
        dtype=torch.float32 if name == "gpt_oss" else torch.float64,  # MoE: no float64
        **overrides,
    )
    prompts = _prompts(lengths, ref.config.vocab_size)
    new = 12
    want = _reference_tokens(ref, prompts, new)
    counted["sdpa"] = 0
    got = _cb_tokens(ours, prompts, new, **cb)
    assert got == want
    assert counted["write_kv_cache"] > 0 and counted["varlen_attn"] >= counted["write_kv_cache"]
    assert counted["sdpa"] == 0
    assert ours.config._attn_implementation == "masked_attn"
    window = getattr(ours.config, "sliding_window", None)
    if window is not None and name != "qwen2" and (window % cb["page_size"] == 0 or window <= cb["page_size"]):
        assert counted["ring_in_place"] > 0  # the decodes read the ring in place
        if "max_batch_tokens" not in cb:
            assert counted["ring_gathered"] == 0
    if overrides.get("sliding_window") == 128 and "max_batch_tokens" in cb:
        assert counted["ring_gathered"] > 0  # chunks past the window beside in-place decodes
    if overrides.get("sliding_window") == 100:
        assert counted["ring_gathered"] > 0  # a decode past a window of partial pages


def test_manager_context_and_no_mask(counted):
    """init_continuous_batching / continuous_batching_context_manager run on our kernels too, and
    transformers builds no attention mask for them."""
    ref, ours = _pair("llama", dtype=torch.float32)
    prompts = _prompts((20, 35), ref.config.vocab_size, seed=3)
    want = _reference_tokens(ref, prompts, 6)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with ours.continuous_batching_context_manager(generation_config=gc, warmup=False) as manager:
        assert isinstance(manager, hf.MaskedAttnBatchingManager)
        ids = [manager.add_request(p) for p in prompts]
        got = [manager.get_result(request_id=i, timeout=60).generated_tokens for i in ids]
        ios = manager.batch_processor.inputs_and_outputs
        assert ios.attention_mask is None  # sdpa's would be (1, 1, max_batch_tokens, cache rows + max_batch_tokens)
    assert got == want
    assert counted["varlen_attn"] > 0


def test_other_implementations_keep_transformers_manager():
    """apply() changes nothing for a model on another attention implementation."""
    ref, ours = _pair("llama", dtype=torch.float32)
    ours.set_attn_implementation("sdpa")
    manager = ours.init_continuous_batching(generation_config=GenerationConfig(max_new_tokens=2, eos_token_id=-1))
    assert not isinstance(manager, hf.MaskedAttnBatchingManager)


# ---- an 8-bit paged cache: hf.apply(model, kv_cache_dtype=torch.int8) ----------------------------


class _FakeQuantLayer(DynamicLayer):
    """A float cache holding each row as the 8-bit cache's values dequantized: the reference
    model attends over exactly what the 8-bit pool holds, with transformers' own attention."""

    def update(self, key_states, value_states, *args, **kwargs):
        def fq(x):
            q, s = tma_F.quantize_kv(x)
            return (q.double() * s.double()[..., None]).to(x.dtype)

        return super().update(fq(key_states), fq(value_states), *args, **kwargs)


def _generate_logprobs(ref, prompts, new, fake_quant):
    """generate()'s greedy tokens and their log-probabilities, per prompt."""
    tokens, logprobs = [], []
    for p in prompts:
        ids = torch.tensor([p])
        cache = {"past_key_values": Cache(layer_class_to_replicate=_FakeQuantLayer)} if fake_quant else {}
        g = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
            **cache,
        )
        t = g.sequences[0, len(p) :]
        tokens.append(t.tolist())
        logprobs.append(torch.stack([torch.log_softmax(lg[0].double(), -1)[i] for lg, i in zip(g.logits, t)]))
    return tokens, logprobs


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_generate_batch_int8_cache(case, monkeypatch):
    """Continuous batching over an int8 paged pool: the same greedy tokens as generate() over a
    float cache holding the same quantized rows, log-probabilities equal to float32 rounding
    (far below what the quantization itself moves them); every write quantizes into the int8
    pool and every read of the pool passes its scales."""
    name, lengths, cb, overrides = (*case, {})[:4]
    ref, ours = _pair(name, dtype=torch.float32, **overrides)
    hf.apply(ours, kv_cache_dtype=torch.int8)
    seen = {"writes": 0, "pool_reads": 0, "reads_without_scales": 0}
    write, varlen = tma_F.write_kv_cache, tma_F.varlen_attn

    def write_spy(k, v, kc, vc, slots, ks=None, vs=None):
        assert kc.dtype == torch.int8 and vc.dtype == torch.int8 and ks is not None and vs is not None
        seen["writes"] += 1
        return write(k, v, kc, vc, slots, ks, vs)

    def varlen_spy(q, k, v, *a, **kw):
        seen["pool_reads"] += kw.get("block_table") is not None
        seen["reads_without_scales"] += k.dtype == torch.int8 and kw.get("k_scale") is None
        assert k.dtype == torch.int8  # every key the step reads is the pool's, or quantized as it
        return varlen(q, k, v, *a, **kw)

    monkeypatch.setattr(tma_F, "write_kv_cache", write_spy)
    monkeypatch.setattr(tma_F, "varlen_attn", varlen_spy)
    prompts = _prompts(lengths, ref.config.vocab_size)
    new = 8
    want, want_lp = _generate_logprobs(ref, prompts, new, fake_quant=True)
    _, float_lp = _generate_logprobs(ref, prompts, new, fake_quant=False)
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    res = ours.generate_batch(
        prompts,
        generation_config=gc,
        continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True, **cb),
        progress_bar=False,
    )
    got = [res[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    got_lp = [torch.tensor(res[f"req_{i}"].logprobs, dtype=torch.float64) for i in range(len(prompts))]
    assert got == want
    err = max((a - b).abs().max().item() for a, b in zip(got_lp, want_lp))
    quantization = max((a - b).abs().max().item() for a, b in zip(float_lp, want_lp))
    assert err < 5e-6 and quantization > 20 * err, (err, quantization)
    assert seen["writes"] > 0 and seen["pool_reads"] > 0 and seen["reads_without_scales"] == 0


def test_int8_cache_pool_and_refusals():
    """The 8-bit pool takes a quarter of a float32 pool's bytes for the same blocks (and its
    scales beside it); forks copy scales with their blocks; what it cannot do is refused."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    _, ours = _pair("llama", dtype=torch.float32)
    cfg = ours.config.get_text_config()

    def pool(cls, **cb):
        c = ContinuousBatchingConfig(page_size=64, num_blocks=8, max_batch_tokens=64, max_memory_percent=0.05, **cb)
        return cls(cfg, c, "cpu", DistributedHelper(None, None), dtype=torch.float32)

    f32, i8 = pool(PagedAttentionCache), pool(hf._Int8PagedCache)
    assert i8.num_blocks == f32.num_blocks and i8.dtype == torch.float32
    assert i8.cache_tensor.numel() * 4 == f32.cache_tensor.numel()
    (name, alloc), layer = next(iter(i8.cache_allocators.items())), cfg.num_hidden_layers - 1
    k_pages, _ = alloc._kv_page_views[layer]
    ks = i8.scales_of(k_pages)
    assert ks.shape == k_pages.shape[:3] and ks.dtype == torch.float32
    # a fork: the blocks' bytes and their scales both copied
    page = k_pages.shape[1]
    src_row = 3 * alloc.bytes_per_block // (k_pages.shape[2] * k_pages.shape[3])  # block 3's first row
    flat = ks.reshape(-1, ks.shape[-1])
    start = ks.storage_offset() // ks.shape[-1]
    flat[src_row - start : src_row - start + page] = torch.arange(page * ks.shape[-1], dtype=torch.float32).view(
        page, -1
    )
    i8.perform_cache_copy({name: ([3], [5])})
    dst_row = src_row + 2 * alloc.bytes_per_block // (k_pages.shape[2] * k_pages.shape[3])
    assert torch.equal(flat[dst_row - start : dst_row - start + page], flat[src_row - start : src_row - start + page])
    with pytest.raises(NotImplementedError, match="cpu_offload_space"):
        pool(hf._Int8PagedCache, cpu_offload_space=1.0)
    with pytest.raises(ValueError, match="kv_cache_dtype must be None or torch.int8"):
        hf.apply(ours, kv_cache_dtype=torch.float16)


def test_int8_cache_prefix_sharing(monkeypatch):
    """Prompts sharing a prefix of whole pages, twice through one persistent manager: the second
    round reuses the first's cached blocks (transformers' prefix sharing) and the scales that lie
    beside them, and gives the first round's tokens and log-probabilities, those of generate()
    over the same quantized rows."""
    matched = []
    search = hf._Int8PagedCache.search_prefix_match

    def spy(self, *a, **k):
        matched.append(search(self, *a, **k))
        return matched[-1]

    monkeypatch.setattr(hf._Int8PagedCache, "search_prefix_match", spy)
    ref, ours = _pair("llama", dtype=torch.float32)
    hf.apply(ours, kv_cache_dtype=torch.int8)
    g = torch.Generator().manual_seed(7)
    vocab = ref.config.vocab_size
    prefix = torch.randint(3, vocab, (150,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 20, 33)]
    want, want_lp = _generate_logprobs(ref, prompts, 6, fake_quant=True)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    for _ in range(2):
        res = ours.generate_batch(
            prompts,
            generation_config=gc,
            continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True, page_size=64),
            progress_bar=False,
            persistent_manager=True,
        )
        done = sorted(res.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
        assert [o.generated_tokens for o in done] == want
        err = max((torch.tensor(o.logprobs, dtype=torch.float64) - w).abs().max().item() for o, w in zip(done, want_lp))
        assert err < 5e-6
    assert ours._cached_continuous_batching_manager.batch_processor.cache.use_prefix_sharing
    assert max(matched) >= 128  # whole pages of the prefix were found in the cache
    ours.destroy_cached_continuous_batching_manager()
