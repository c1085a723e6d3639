"""One vLLM engine run for tests/decode/test_vllm.py and benchmarks/vllm_generate.py: a process of its
own (vLLM starts its engine in new processes; a run with our backend and one without must not
share a process's plugin state).

    python tests/decode/vllm_run.py '<json spec>' out.json

The spec: model (a directory saved with save_pretrained), dtype, prompts (lists of token ids),
max_tokens, logprobs (top-k per generated token, 0: none), prompt_logprobs (k: the prompt
tokens' log-probabilities too), rounds (how many times the prompts are generated, or a list of
each round's overrides of the spec: a later round reads the prefix cache, unless it asks for
prompt log-probabilities), and the engine's options (engine: block_size,
max_num_batched_tokens, ...). Whether our backend runs is the environment's MASKED_ATTN_VLLM,
set by the caller. Writes {tokens, logprobs, top, prompt_logprobs, cached, backends, seconds}: per round and prompt
the generated ids, their log-probabilities, each step's top-k (id, log-prob) pairs, the prompt's,
the prompt tokens read from the prefix cache; the attention
implementations the workers' layers run (their class names); the generate calls' wall time.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _impls(model) -> list[str]:
    """The classes of the attention implementations of a worker's model (runs in the worker)."""
    return sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl") and hasattr(m, "attn_backend")})


def _engine(spec: dict):
    from vllm import LLM

    options = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": 128,
        "max_model_len": 4096,
        "kv_cache_memory_bytes": 1 << 30,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "seed": 0,
    }
    options.update(spec.get("engine", {}))
    return LLM(model=spec["model"], dtype=spec["dtype"], **options)


def _round(llm, spec: dict) -> dict:
    from vllm import SamplingParams

    k, pk = spec.get("logprobs", 0), spec.get("prompt_logprobs", 0)
    params = SamplingParams(
        max_tokens=spec["max_tokens"],
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprobs=k or None,
        prompt_logprobs=pk or None,
    )
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens, chosen, top, prompt = [], [], [], []
    for o in outs:
        if pk:  # the prompt's tokens' log-probabilities (teacher-forced), from the second on
            ids = o.prompt_token_ids
            prompt.append([lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], ids[1:])])
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        if k:
            steps = [sorted(lp.items(), key=lambda kv: -kv[1].logprob) for lp in c.logprobs]
            chosen.append([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            top.append([[[i, p.logprob] for i, p in s[:k]] for s in steps])
    cached = [o.num_cached_tokens or 0 for o in outs]
    return {
        "tokens": tokens,
        "logprobs": chosen,
        "top": top,
        "prompt_logprobs": prompt,
        "cached": cached,
        "seconds": seconds,
    }


def run(spec: dict) -> dict:
    llm = _engine(spec)
    rounds = spec.get("rounds", 1)
    rounds = [{}] * rounds if isinstance(rounds, int) else rounds
    rounds = [_round(llm, {**spec, **r}) for r in rounds]
    import vllm_run  # by name, not __main__'s: the workers import it (PYTHONPATH holds this directory)

    backends = sorted({name for names in llm.apply_model(vllm_run._impls) for name in names})
    return {
        "tokens": [r["tokens"] for r in rounds],
        "logprobs": [r["logprobs"] for r in rounds],
        "top": [r["top"] for r in rounds],
        "prompt_logprobs": [r["prompt_logprobs"] for r in rounds],
        "cached": [r["cached"] for r in rounds],
        "seconds": [r["seconds"] for r in rounds],
        "backends": backends,
    }


if __name__ == "__main__":  # vLLM's engine processes import this file anew: run only as the script
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends _impls to the workers
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    result = run(json.loads(sys.argv[1]))
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
