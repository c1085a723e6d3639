"""The instruction-set switch: MASKED_ATTN_ISA is read once, an unknown
value raises naming it, ops.use_isa forces a variant and restores the one
before, and ops.isa_for names the variant a call gets."""

import os
import subprocess
import sys

import pytest
import torch

import torch_masked_attn as tma
from conftest import ISAS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(code, env):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}
    )


def test_unknown_isa_in_environment_raises_naming_it():
    r = _child(
        "import torch, torch_masked_attn as t\nq = torch.randn(1, 1, 2, 4)\n"
        "try:\n    t.functional.masked_attention(q, q, q)\nexcept RuntimeError as e:\n    print('RAISED', e)",
        {"MASKED_ATTN_ISA": "bogus"},
    )
    assert r.returncode == 0, r.stderr
    assert (
        "RAISED" in r.stdout
        and "bogus" in r.stdout
        and "scalar, avx2, avx512, amx, avx512bf16, neon, sve or svebf16" in r.stdout
    )


def test_environment_is_read_once_and_use_isa_forces():
    code = (
        "import os, torch, torch_masked_attn as t\n"
        "q = torch.randn(2, 2, 70, 24, generator=torch.Generator().manual_seed(1))\n"
        "a = t.functional.masked_attention(q, q, q, is_causal=True)\n"
        "os.environ['MASKED_ATTN_ISA'] = 'bogus'   # read once: ignored from now on\n"
        "b = t.functional.masked_attention(q, q, q, is_causal=True)\n"
        "with t.ops.use_isa('scalar'):\n    c = t.functional.masked_attention(q, q, q, is_causal=True)\n"
        "print(torch.equal(a, b), torch.equal(a, c))"
    )
    r = _child(code, {"MASKED_ATTN_ISA": "scalar"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]


def test_use_isa_rejects_unknown_and_restores():
    with pytest.raises(ValueError, match="one of"):
        with tma.ops.use_isa("sse9"):
            pass
    before = tma._library._clib.ma_isa_forced()
    with tma.ops.use_isa("scalar"):
        assert tma._library._clib.ma_isa_forced() == 0
    assert tma._library._clib.ma_isa_forced() == before


def _cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), "")
    except OSError:
        return ""


def test_isa_for_names_the_variant_a_call_gets():
    """isa_for: the forced variant, else the CPU's best (AMX only for bfloat16
    and float16, never for float32; avx512bf16 for bfloat16 on AMD's CPUs
    without AMX); a child process, so that no other test's forcing is in
    effect, and MASKED_ATTN_ISA set to each variant the CPU has."""
    code = (
        "import torch, torch_masked_attn as t\n"
        "print(*(t.ops.isa_for(d) for d in (torch.float32, torch.bfloat16, torch.float16)))"
    )
    have = [i for i in ISAS if tma.ops.isa_available(i)]
    fp32, bf16, fp16 = _child(code, {"MASKED_ATTN_ISA": ""}).stdout.split()
    assert fp32 == [i for i in ("avx512", "avx2", "scalar") if i in have][0]
    amd = _cpu_vendor() == "AuthenticAMD"  # VDPBF16PS at the FMA's rate: common/isa.c, ma_isa_best
    assert fp16 == ("amx" if "amx" in have else fp32)
    assert bf16 == ("amx" if "amx" in have else "avx512bf16" if amd and "avx512bf16" in have else fp32)
    for isa in have:
        assert _child(code, {"MASKED_ATTN_ISA": isa}).stdout.split() == [isa] * 3
    with pytest.raises(ValueError, match="dtype must be one of"):
        tma.ops.isa_for(torch.int32)
