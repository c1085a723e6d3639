"""Continuous batching end to end: transformers' generate_batch on "masked_attn" against its
own CPU routes (CB "sdpa", CB "paged|eager") and padded generate(), on a tiny random Llama
(2 layers, hidden 256, 4 heads on 2 KV heads, vocab 1000), 16 requests, 32 new tokens, greedy,
page size 256, the manager kept between calls (persistent_manager=True, as a server keeps it).
Each (prompt range, implementation) runs in a process of its own, which reports
tokens/s (median of 3 runs after a warm-up run) and its peak resident memory above what it held
once the model was built (ru_maxrss). Every implementation's tokens are checked against
masked_attn's.

    .venv/bin/python benchmarks/cb_throughput.py [--ranges 20-100,400-800,1200-2000] [--out FILE] [--record]

--record merges the rows into this machine's record, benchmarks/results_<machine>.json
(benchmarks/record.py): case cb-<prompts> against CB "sdpa", cb-<prompts>-paged against
CB "paged|eager", cb-<prompts>-generate against padded generate(); tokens/s, ratio = ours / theirs.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

IMPLS = ["masked_attn", "sdpa", "paged|eager", "generate"]
N_REQ, NEW = 16, 32


def child(impl, lo, hi):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import torch_masked_attn.hf as hf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 1000, (int(n),), generator=g).tolist()
        for n in torch.randint(lo, hi + 1, (N_REQ,), generator=g)
    ]
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    if impl == "generate":
        model.set_attn_implementation("sdpa")
    else:
        model.set_attn_implementation(impl)
    if impl == "masked_attn":
        hf.apply(model)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def run():
        if impl == "generate":  # one left-padded batch
            width = max(map(len, prompts))
            ids = torch.zeros(N_REQ, width, dtype=torch.long)
            mask = torch.zeros(N_REQ, width, dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, generation_config=gc)
            return [out[i, width:].tolist() for i in range(N_REQ)]
        # persistent_manager: the manager and its cache live across calls, as in a server (a fresh
        # manager costs every implementation the same ~0.6 s of cache allocation and gc per call)
        res = model.generate_batch(
            prompts,
            generation_config=gc,
            progress_bar=False,
            persistent_manager=True,
            continuous_batching_config=ContinuousBatchingConfig(page_size=256),
        )
        done = sorted(res.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))  # ids go on across calls
        return [o.generated_tokens for o in done]

    tokens = run()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "tok_s": N_REQ * NEW / statistics.median(times),
                "times": times,
                "peak_mb": (peak - base) / 1024,
                "tokens": tokens,
            }
        )
    )


CASE_SUFFIX = {"sdpa": "", "paged|eager": "-paged", "generate": "-generate"}


def record_rows(results, date):
    """The record's rows (benchmarks/record.py) of a run's results: masked_attn against each other route."""
    rows = []
    for rng, row in results["cases"].items():
        ours = row.get("masked_attn", {})
        for impl, suffix in CASE_SUFFIX.items():
            other = row.get(impl, {})
            if "tok_s" not in ours or "tok_s" not in other:
                continue
            r = {
                "case": f"cb-{rng}{suffix}",
                "date": date,
                "native": "CB " + impl if impl != "generate" else "padded generate",
                "unit": "tok/s",
                "native_ms": round(other["tok_s"], 1),
                "ours_ms": round(ours["tok_s"], 1),
                "ratio": round(ours["tok_s"] / other["tok_s"], 4),
                "peak_mb_native": round(other["peak_mb"], 1),
                "peak_mb_ours": round(ours["peak_mb"], 1),
                "source": "cb_throughput.py",
            }
            if other.get("tokens") != ours.get("tokens"):
                r["note"] = "tokens differ from masked_attn's"
            rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranges", default="20-100,400-800,1200-2000")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "cb_throughput.json"))
    ap.add_argument("--record", action="store_true", help="merge into benchmarks/results_<machine>.json")
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], int(a.child[1]), int(a.child[2]))
        return
    import torch

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
        platform.processor(),
    )
    print(
        f"# continuous batching, tiny Llama, {N_REQ} requests x {NEW} new tokens; {cpu}, "
        f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}"
    )
    print(
        "| prompts | "
        + " | ".join(f"{i} tok/s" for i in a.impls.split(","))
        + " | masked_attn / CB sdpa | peak MB masked_attn / CB sdpa | same tokens |"
    )
    print("|---|" + "---:|" * (len(a.impls.split(",")) + 3))
    results = {"cpu": cpu, "threads": torch.get_num_threads(), "cases": {}}
    for rng in a.ranges.split(","):
        lo, hi = rng.split("-")
        row = {}
        for impl in a.impls.split(","):
            p = subprocess.run([sys.executable, __file__, "--child", impl, lo, hi], capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            row[impl] = json.loads(line[-1]) if line else {"error": p.stderr[-2000:]}
        results["cases"][rng] = row
        ours = row.get("masked_attn", {})
        same = all(r.get("tokens") == ours.get("tokens") for r in row.values() if "tokens" in r)
        cells = [f"{row[i]['tok_s']:.0f}" if "tok_s" in row[i] else "error" for i in a.impls.split(",")]
        sd = row.get("sdpa", {})
        ratio = f"{ours['tok_s'] / sd['tok_s']:.2f}" if "tok_s" in ours and "tok_s" in sd else ""
        mem = f"{ours['peak_mb']:.0f} / {sd['peak_mb']:.0f}" if "peak_mb" in ours and "peak_mb" in sd else ""
        print(f"| {rng} | " + " | ".join(cells) + f" | {ratio} | {mem} | {'yes' if same else 'NO'} |", flush=True)
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    if a.record:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import record

        import bench_machine

        info = bench_machine.cpu_info()
        path = record.merge(
            bench_machine.machine_key(info),
            info["cpu_model"],
            torch.get_num_threads(),
            torch.__version__,
            record_rows(results, record.today()),
        )
        print(f"recorded in {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
