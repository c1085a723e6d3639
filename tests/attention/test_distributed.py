"""Training as users run it: DistributedDataParallel and FSDP2 (gloo, 2
processes on this machine, CPU) on a small transformer built with our
modules, each checked against one process on the whole batch; and
torch.compile(fullgraph=True) of the whole model and loss, forward and
backward, against eager.

Attention dropout is 0 in the distributed tests; the last compile test sets
the attention's to 0.1 (compiled and eager draw the same masks from the same
seed)."""

import gc
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import torch_masked_attn as tma

V, E, H, L, B = 50, 32, 4, 12, 4
DROPOUT = 0.0


class SmallLM(nn.Module):
    """Embedding, two pre-norm encoder layers whose attention is ours (causal),
    an LM head; the loss is our CrossEntropyLoss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.pos = nn.Parameter(torch.randn(L, E) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(E, H, 2 * E, dropout=DROPOUT, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.head = nn.Linear(E, V)
        self.loss = tma.CrossEntropyLoss(ignore_index=-100)
        tma.replace_attention(self)

    def forward(self, idx, target):
        x = self.emb(idx) + self.pos[: idx.size(1)]
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1))
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.loss(self.head(x).flatten(0, 1), target.flatten())


def _data():
    g = torch.Generator().manual_seed(100)
    idx = torch.randint(0, V, (B, L), generator=g)
    target = torch.randint(0, V, (B, L), generator=g)
    return idx, target


def _model():
    torch.manual_seed(0)
    return SmallLM()


def _init(rank, world, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)


def _quiesce():
    """Before destroy_process_group: the model (DDP's reducer, FSDP's state)
    and the collectives' work objects it held are freed while the interpreter
    is whole (the steps ran in a function of their own, gc.collect() takes
    its cycles), and no rank tears gloo down while another still talks to it.
    Without this a worker aborted in two full runs ('terminate called
    without an active exception')."""
    gc.collect()
    dist.barrier()


def _ddp_steps(rank, world, out):
    model = nn.parallel.DistributedDataParallel(_model())
    idx, target = _data()
    n = B // world
    model(idx[rank * n : (rank + 1) * n], target[rank * n : (rank + 1) * n]).backward()
    if rank == 0:
        torch.save({k: p.grad for k, p in model.module.named_parameters()}, out)


def _fsdp_steps(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    n = B // world
    losses = []
    for _ in range(5):
        idx, target = _data()
        loss = model(idx[rank * n : (rank + 1) * n], target[rank * n : (rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = loss.detach().clone()
        dist.all_reduce(full)
        losses.append(full.item() / world)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"losses": losses, "state": state}, out)


def _worker(steps, rank, world, path, out):
    _init(rank, world, path)
    try:
        steps(rank, world, out)
        _quiesce()
    finally:
        dist.destroy_process_group()


def _ddp_worker(rank, world, path, out):
    _worker(_ddp_steps, rank, world, path, out)


def _fsdp_worker(rank, world, path, out):
    _worker(_fsdp_steps, rank, world, path, out)


def _spawn(worker):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        mp.spawn(worker, args=(2, os.path.join(d, "rendezvous"), out), nprocs=2, join=True)
        return torch.load(out)


def test_ddp_gradients_equal_single_process():
    grads = _spawn(_ddp_worker)
    model = _model()
    model(*_data()).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_fsdp2_trains_like_single_process():
    # SGD, not Adam: the key part of in_proj_bias has a gradient that is exactly 0 in exact
    # arithmetic (softmax ignores a per-row constant), so it holds rounding noise of ~1e-9 that
    # Adam would normalise into full-size steps differing between the runs
    res = _spawn(_fsdp_worker)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        loss = model(*_data())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # it trains
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(res["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def _compiled_vs_eager(attn_dropout):
    """One forward and backward of the whole model compiled (fullgraph) and
    eager, from the same seed; returns (loss compiled, loss eager, the two
    models) after asserting losses and every gradient equal."""
    torch._dynamo.reset()
    eager, compiled_model = _model(), _model()
    for layer in (*eager.layers, *compiled_model.layers):
        layer.self_attn.dropout = attn_dropout
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    idx, target = _data()
    torch.manual_seed(1)
    ref = eager(idx, target)
    ref.backward()
    torch.manual_seed(1)
    out = compiled(idx, target)
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for (k, p), q in zip(compiled_model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=k)
    return eager, idx, target, ref


def test_compile_fullgraph_whole_model_matches_eager():
    """Our attention (the packed self-attention node and its backward) and our
    cross-entropy inside one graph, no graph break, forward and backward."""
    _compiled_vs_eager(DROPOUT)


def test_compile_fullgraph_with_attention_dropout_matches_eager():
    """The kernels' dropout inside a compiled graph: the seed is drawn from the
    default generator by a traced op, so the compiled and eager runs draw the
    same masks from the same torch.manual_seed (attention dropout 0.1, the
    layers' other dropouts 0)."""
    eager, idx, target, ref = _compiled_vs_eager(0.1)
    torch.manual_seed(2)
    assert eager(idx, target).item() != ref.item()  # the dropout is live: another seed, another loss
