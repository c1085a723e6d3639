"""The demo's training run (examples/demo.py), shortened and shrunk: the model
built on torch_masked_attn (+ fused linear cross-entropy) and the one built on
torch.nn (+ F.cross_entropy), from identical weights on identical batches of
pydoc_data.topics paragraphs, agree at the first step within float32 noise,
both learn, and agree on held-out perplexity."""

import importlib.util
import math
import os

from conftest import require

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "examples", "demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_corpus_and_byte_tokenizer():
    demo = load_demo()
    train, held = demo.load_paragraphs()
    assert len(train) > 1000 and len(held) > 50
    assert not set(train) & set(held)
    tok = demo.ByteTokenizer()
    text = held[3] + " \u2014 caf\u00e9"
    assert tok.decode([demo.BOS] + tok.encode(text)) == text
    seqs = demo.windows(held[:5], tok, 64)  # long paragraphs: several windows
    assert len(seqs) > 5 and all(2 <= len(s) <= 65 for s in seqs)
    tokens, targets, padding = demo.pad_batch(seqs)
    assert ((targets == demo.IGNORE) == padding).all() and tokens.size(1) == 64
    assert tokens[0, 0] == demo.BOS and (tokens[:, 1:] == targets[:, :-1])[~padding[:, 1:]].all()


def test_demo_runs_agree_and_learn():
    require("tokenizers")
    demo = load_demo()
    steps = 8
    hist, models, data = demo.train(
        steps=steps, batch_size=8, max_len=64, d=64, layers=2, log_every=4, eval_every=steps, verbose=False
    )
    native, ours = hist["native"]["loss"], hist["ours"]["loss"]
    assert len(native) == len(ours) == steps
    assert all(math.isfinite(v) for v in native + ours)
    # identical weights, identical batch: only float32 rounding differs at the first step
    assert abs(native[0] - ours[0]) <= 1e-5 * abs(native[0]), (native[0], ours[0])
    assert abs(native[0] - math.log(data["tok"].vocab_size)) < 0.5  # starts near uniform
    ((s_n, nll_n),) = hist["native"]["eval"]
    ((s_o, nll_o),) = hist["ours"]["eval"]
    assert s_n == s_o == steps
    for losses, nll in ((native, nll_n), (ours, nll_o)):  # both learn
        assert losses[-1] < losses[0] - 0.3 and nll < native[0] - 0.3, (losses, nll)
    assert abs(math.exp(nll_o) / math.exp(nll_n) - 1) < 1e-3, (nll_n, nll_o)
    text = demo.sample(models["ours"], data["tok"], "The ", n_tokens=5, max_len=64)
    assert text.startswith("The ")


def test_demo_kv_cache_decoding():
    """The demo's cached decoding (float32 and 8-bit caches): the float32 cache gives the
    model's own uncached NLL of the continuation tokens (float32 rounding), the int8 cache
    within 0.5% of its perplexity, in (Dh + 4) / (4 Dh) of the bytes."""
    require("tokenizers")
    import torch
    import torch.nn.functional as F

    demo = load_demo()
    _, models, data = demo.train(
        steps=6, batch_size=8, max_len=128, d=64, layers=2, log_every=6, eval_every=6, verbose=False, names=("ours",)
    )
    model, prompt, cont = models["ours"], 32, 64
    (nll32, b32), (nll8, b8) = (demo.cached_continuation(model, data["held"], i8, prompt, cont) for i8 in (False, True))
    x = torch.stack([s[: prompt + cont + 1] for s in data["held"] if len(s) >= prompt + cont + 1])
    with torch.no_grad():
        logits = model.eval().logits(x[:, :-1])
    ref = F.cross_entropy(
        logits[:, prompt - 1 : prompt + cont - 1].flatten(0, 1), x[:, prompt : prompt + cont].flatten()
    )
    assert abs(nll32 - ref.item()) < 1e-4, (nll32, ref.item())
    assert abs(math.exp(nll8 - nll32) - 1) < 5e-3, (nll32, nll8)
    dh = model.tok.weight.shape[1] // model.blocks[0].attn.num_heads
    assert b8 * 4 * dh == b32 * (dh + 4)  # int8 values and a float32 scale per row of dh
