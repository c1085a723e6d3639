"""Hugging Face's Trainer with TrainingArguments(bf16=True, use_cpu=True): a
small Llama trains through attn_implementation="masked_attn" + hf.apply on
padded batches and on packed ones (DataCollatorWithFlattening), and its losses
track the same run on transformers' "sdpa" within bf16 noise.

bf16=True on the CPU is torch.autocast("cpu", dtype=torch.bfloat16) around the
forward: the rotary embedding leaves q and k in float32 while v is bfloat16,
which the attention op must take as F.sdpa does under autocast
(docs/design.md, "Autocast")."""

import copy

import pytest
import torch

from conftest import require

transformers = require("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from transformers import (  # noqa: E402
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

import torch_masked_attn.hf as hf  # noqa: E402

V, PAD = 96, 0
STEPS = 8


class _Docs(torch.utils.data.Dataset):
    """Sequences of different lengths that a model can learn: arithmetic
    progressions modulo the vocabulary, random start and step (a fixed draw)."""

    def __init__(self, n=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, 30, (n,), generator=g).tolist()
        starts = torch.randint(0, V - 3, (n,), generator=g).tolist()
        steps = torch.randint(1, 4, (n,), generator=g).tolist()
        self.docs = [[3 + (s + i * d) % (V - 3) for i in range(n_)] for n_, s, d in zip(lengths, starts, steps)]

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return {"input_ids": self.docs[i], "labels": self.docs[i]}


def _pad_collate(features):
    """Right padding, attention_mask, labels -100 on the padding."""
    L = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), L), PAD)
    mask = torch.zeros(len(features), L, dtype=torch.long)
    for b, f in enumerate(features):
        n = len(f["input_ids"])
        ids[b, :n] = torch.tensor(f["input_ids"])
        mask[b, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train(model, collate, tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        bf16=True,
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=3e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Docs(), data_collator=collate)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("batches", ["padded", "packed"])
def test_trainer_bf16_tracks_sdpa(batches, tmp_path):
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    ours = copy.deepcopy(ref)
    ref.set_attn_implementation("sdpa")
    ours.set_attn_implementation("masked_attn")
    hf.apply(ours)
    collate = _pad_collate if batches == "padded" else DataCollatorWithFlattening(return_position_ids=True)
    ref_losses = _train(ref, collate, tmp_path / "sdpa")
    our_losses = _train(ours, collate, tmp_path / "ours")
    assert len(our_losses) == len(ref_losses) == STEPS
    assert all(torch.isfinite(torch.tensor(our_losses)))
    # bf16 noise: the two runs' products round differently in bf16 (relative 2^-8 per
    # element), and the differences grow with the updates; float32 runs agree to 3e-6
    for step, (a, b) in enumerate(zip(our_losses, ref_losses)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: ours {a:.5f}, sdpa {b:.5f}"
    assert our_losses[-1] < our_losses[0]  # it trains
