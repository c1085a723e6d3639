"""The Hugging Face path in ten lines: a small random Llama (nothing downloaded) on "masked_attn",
its loss through the fused linear-cross-entropy, one training step, then greedy generation."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import torch_masked_attn.hf  # registers attn_implementation="masked_attn"

cfg = LlamaConfig(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="masked_attn")
torch_masked_attn.hf.apply(model)  # fused linear-cross-entropy loss
ids = torch.randint(1, 1000, (4, 32))
mask = (torch.arange(32) >= torch.tensor([[0], [5], [9], [0]])).long()  # left padding
out = model.train()(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
out.loss.backward()  # out.logits is None: never built
new = model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
print(f"loss {out.loss.item():.3f}; generated {new[:, 32:].tolist()}")
