"""The differential fuzzer's slice (tools/fuzz.py, on Hypothesis; `make fuzz` runs it for a
time budget): a derandomized, fixed number of cases on every instruction set the CPU runs, with
the known regressions as @example literals; and the fuzzer's self-test: references broken on
purpose must give findings, and a finding shrinks to a small case."""

import functools
import importlib.util
import pathlib
import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from conftest import require
from torch_masked_attn import ops

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "fuzz.py"


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("tma_tools_fuzz", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


fuzz = _load_fuzz()
# the names a finding's literal uses, for its @example line
Attention, Varlen, CrossEntropy = fuzz.Attention, fuzz.Varlen, fuzz.CrossEntropy
Mask, Padding, HeadMask, Sinks, Dropout, HFMask = (
    getattr(fuzz, n) for n in ("Mask", "Padding", "HeadMask", "Sinks", "Dropout", "HFMask")
)

# per ISA: about 10 s on a shared 2-core machine
EXAMPLES = {"attention": 100, "varlen": 60, "ce": 60}
ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(not ops.isa_available(isa), reason=f"this CPU does not run {isa}"))
    for isa in fuzz.ISAS
]
SLICE = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Small cases: one intra-op thread is faster, and keeps the slice short on a shared 2-core
    machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The regression cases: bfloat16 / float16 gradient findings that delta from the rounded out gave
# (1.05-5x beyond their bounds) and out_lo fixed (docs/design.md, section 4), the old fuzzer's
# seeds as literals (their values drawn anew).


@pytest.mark.parametrize("isa", ISAS)
@settings(SLICE, max_examples=EXAMPLES["varlen"])
@given(case=fuzz.varlen_cases())
# varlen bf16 GQA, window (1, 0), D=1 (avx2): dq 0.037 vs bound 0.0075
@example(
    case=Varlen(
        dtype="bf16",
        lq=(1, 0),
        lk=(63, 1),
        H=4,
        Hkv=2,
        D=1,
        Dv=32,
        layout=("htd", "htd", "contig"),
        window=(1, 0),
        scale=1.349,
        enable_gqa=True,
        seed=1,
    )
)
# varlen f16, window (61, 0), lse (avx2): dq 4.1e-3 vs 2.8e-3
@example(
    case=Varlen(
        dtype="f16",
        lq=(2,),
        lk=(2,),
        H=3,
        Hkv=3,
        D=33,
        Dv=33,
        layout=("pad2+1", "htd", "htd"),
        window=(61, 0),
        scale=0.785,
        lse=True,
        seed=2,
    )
)
# varlen bf16, Lq=1 (avx2): dq 7.5e-3 vs 7.1e-3
@example(
    case=Varlen(
        dtype="bf16", lq=(1,), lk=(5,), D=3, Dv=3, layout=("contig", "htd", "pad1+2"), window=(149, 115), seed=3
    )
)
# varlen f16 GQA, D=1 (scalar): dk 2.0e-3 vs 1.5e-3
@example(
    case=Varlen(
        dtype="f16",
        lq=(1,),
        lk=(47,),
        H=4,
        Hkv=2,
        D=1,
        Dv=77,
        layout=("pad1+2", "pad3+0", "contig"),
        window=(1, 0),
        enable_gqa=True,
        slack_k=4,
        seed=4,
    )
)
# every path at least once, whatever Hypothesis draws: empty sequences, tile edges, GQA, a causal
# window, softcap, sinks with their gradient, ALiBi per sequence, lse, views
@example(
    case=Varlen(
        dtype="bf16",
        lq=(0, 1, 64, 65, 3),
        lk=(5, 0, 64, 130, 3),
        H=4,
        Hkv=2,
        D=16,
        Dv=8,
        layout=("htd", "pad1+2", "contig"),
        window=(10, 0),
        enable_gqa=True,
        lse=True,
        slack_q=2,
        softcap=5.0,
        sinks=Sinks(values=(0.5, 1.0, -2.0, 7.0), grad=True),
        alibi=(
            (0.5, 0.25, 0.125, 0.0),
            (1.0, 0.5, 0.25, 0.125),
            (0.5, 0.5, 0.5, 0.5),
            (0.0, 0.0, 0.0, 0.0),
            (0.1, 0.2, 0.3, 0.4),
        ),
        seed=16,
    )
)
def test_fuzz_varlen(isa, case):
    fuzz.assert_clean(case, isa)


@pytest.mark.parametrize("isa", ISAS)
@settings(SLICE, max_examples=EXAMPLES["attention"])
@given(case=fuzz.attention_cases())
# sinks + ALiBi over 87 keys, outputs and gradients all denormal (about 5e-39): the kernels' exp
# gives 0 below float32's smallest normal, the rule's absolute floor (make fuzz SECONDS=600's finding)
@example(case=Attention(Lk=87, window=(None, 0), sinks=Sinks(), alibi=(1.0,)))
# bf16 float mask + causal window (scalar): dk 6.7e-3 vs 6.1e-3
@example(
    case=Attention(
        dtype="bf16",
        B=3,
        Lq=128,
        Lk=8,
        D=64,
        Dv=5,
        layout=("expand", "contig", "contig"),
        attn_mask=Mask(kind="float", shape="(B,1,Lq,Lk)", p=0.3),
        causal=True,
        window=(7, 6),
        seed=5,
    )
)
# f16 softcap + sinks (scalar): dk 1.7e-3 vs 1.5e-3
@example(
    case=Attention(
        dtype="f16",
        Lq=2,
        Lk=53,
        D=96,
        Dv=52,
        layout=("contig", "contig", "step"),
        causal=True,
        diagonal=51,
        scale=0.25,
        softcap=4.33,
        sinks=Sinks(values=(0.187,), dtype="f32", grad=True),
        seed=6,
    )
)
# bf16 sinks + need_weights, Lq=1 (scalar): dq 4.3e-3 vs 2.0e-3
@example(
    case=Attention(
        dtype="bf16",
        B=2,
        H=2,
        Hkv=2,
        Lq=1,
        Lk=63,
        D=3,
        Dv=81,
        layout=("swap", "blhd", "contig"),
        attn_mask=Mask(shape="(1,H,Lq,Lk)", p=0.3),
        causal=True,
        scale=0.398,
        need_weights=True,
        sinks=Sinks(values=(-0.426, -0.91), grad=True),
        seed=7,
    )
)
# d head_mask rounded to bf16 per batch entry, then summed over B in bf16 (now: rounded once)
# (avx2): dhm 7.7e-3 vs 3.4e-3
@example(
    case=Attention(
        dtype="bf16",
        B=2,
        Lq=8,
        Lk=4,
        D=119,
        Dv=2,
        layout=("contig", "contig", "step"),
        head_mask=HeadMask(values=(1.512,), grad=True),
        scale=1.478,
        need_weights=True,
        seed=8,
    )
)
# every path at least once, whatever Hypothesis draws: the decode kernel split between 4 work items with
# a kv head's 2 query heads stacked; 7 query heads a key head (Qwen's) at D = 80 and 16 over an int8
# cache at D = 128 (the register tiles' tails); the int8 cache; the HF backend with a sliding StructuredMask,
# padding, softcap and sinks; the 3-D sdpa drop-in with a float mask's gradient; masked_attention
# with every option and every gradient at once
@example(
    case=Attention(
        dtype="bf16",
        B=2,
        H=4,
        Hkv=2,
        Lq=3,
        Lk=1100,
        D=64,
        Dv=64,
        causal=True,
        diagonal=1097,
        return_lse=True,
        splits=4,
        seed=11,
    )
)
@example(
    case=Attention(
        dtype="bf16",
        H=14,
        Hkv=2,
        Lq=5,
        Lk=900,
        D=80,
        Dv=80,
        layout=("blhd", "blhd", "blhd"),
        causal=True,
        diagonal=895,
        splits=2,
        seed=14,
    )
)
@example(
    case=Attention(
        H=16,
        Lq=2,
        Lk=700,
        D=128,
        Dv=128,
        int8=True,
        softcap=20.0,
        splits=4,
        seed=15,
    )
)
@example(
    case=Attention(
        dtype="f16",
        B=2,
        H=2,
        Lq=5,
        Lk=600,
        D=32,
        Dv=32,
        layout=("blhd", "step", "pad1+2"),
        padding=Padding(lens=(600, 17)),
        int8=True,
        splits=2,
        seed=12,
    )
)
@example(
    case=Attention(
        dtype="bf16",
        B=2,
        H=2,
        Lq=7,
        Lk=70,
        D=16,
        Dv=16,
        call="hf",
        causal=True,
        softcap=1.0,
        sinks=Sinks(values=(0.5, -1.0), grad=True),
        hf_mask=HFMask(window=5, q_offset=63, padding=(70, 40)),
        seed=13,
    )
)
@example(
    case=Attention(
        H=3,
        Lq=65,
        Lk=64,
        D=8,
        Dv=8,
        call="sdpa3d",
        causal=True,
        seed=14,
        attn_mask=Mask(kind="float", shape="(1,H,Lq,Lk)", p=0.3, dtype="f32", grad=True),
    )
)
@example(
    case=Attention(
        B=2,
        H=4,
        Hkv=2,
        Lq=33,
        Lk=65,
        D=17,
        Dv=9,
        layout=("swap", "expand", "blhd"),
        attn_mask=Mask(kind="float", shape="(B,1,Lq,Lk)", p=0.1, transposed=True, grad=True),
        padding=Padding(lens=(65, 0), kind="float", grad=True),
        head_mask=HeadMask(values=((0.5, 1.0, 0.0, 1.5), (1.0, 1.0, 0.25, 2.0)), grad=True),
        need_weights=True,
        return_lse=True,
        window=(20, 3),
        softcap=5.0,
        sinks=Sinks(values=(0.1, 0.2, -0.3, 8.0), dtype="f32", grad=True),
        alibi=(0.5, 0.25, 0.125, 0.0625),
        dropout=Dropout(p=0.3, seed=(5, 7)),
        seed=15,
    )
)
# Issue 63 part 2 (rows a tile holds whole take the math path's delta) fixed these, once open:
# f32 dropout 0.62, Lq=1: dv 2.2e-5 vs bound 1.7e-5 (the old fuzzer's seed 3107736406743)
@example(
    case=Attention(
        B=3,
        H=2,
        Hkv=2,
        Lq=1,
        Lk=70,
        D=111,
        Dv=64,
        layout=("blhd", "step", "contig"),
        padding=Padding(lens=(70, 68, 0)),
        causal=True,
        scale=1.197,
        need_weights=True,
        dropout=Dropout(p=0.616, seed=(-413999919513616123, 1043348934591314898)),
        seed=99,
    )
)
# bf16 dropout over a single key: dk 3.9e-6 vs bound 1.8e-6 where the reference's are 0
@example(case=Attention(dtype="bf16", D=2, Dv=2, dropout=Dropout(p=0.1, seed=(3, 0)), seed=3))
# f16 over a single key with a small head mask: dq, dk 6.0e-8 (f16's smallest subnormal) vs 4e-9
@example(case=Attention(dtype="f16", B=2, D=2, Dv=2, head_mask=HeadMask(values=(0.001,))))
def test_fuzz_attention(isa, case):
    fuzz.assert_clean(case, isa)


@pytest.mark.parametrize("isa", ISAS)
@settings(SLICE, max_examples=EXAMPLES["ce"])
@given(case=fuzz.ce_cases())
@example(
    case=CrossEntropy(
        dtype="bf16",
        shape=(4, 3001, 3),
        layout="classlast",
        ignore_index=7,
        ignored=0.2,
        weight=True,
        label_smoothing=0.1,
        z_loss=0.01,
        softcap=2.0,
        seed=17,
    )
)
@example(
    case=CrossEntropy(
        dtype="f16",
        shape=(300,),
        layout="pad2+1",
        target="softmax",
        label_smoothing=0.2,
        reduction="sum",
        z_loss=0.0001,
        softcap=3.0,
        seed=18,
    )
)
def test_fuzz_cross_entropy(isa, case):
    fuzz.assert_clean(case, isa)


# Open findings of `make fuzz`, on the ISA that found them; strict xfail where found (torch 2.13), so
# that a fix shows up as an XPASS to move them out (the bound scales PyTorch's own error, which
# another torch computes differently: under 2.10 this one is inside its bound).
KNOWN_OPEN = [
    # f16, v expanded (zero batch stride) under GQA, every ISA: dv 6.6e-3 vs bound 3.6e-3, where
    # dv cancels to 0.89 from terms about 50 (the six (batch, head) parts are each rounded to f16
    # before autograd sums them; torch's own error happened to be 1.3e-3). make fuzz SECONDS=600's
    # finding; value-dependent, so it did not shrink (any smaller case draws other values)
    (
        "scalar",
        Attention(
            dtype="f16",
            B=2,
            H=3,
            Lq=136,
            Lk=2,
            call="hf",
            layout=("contig", "pad1+0", "expand"),
            attn_mask=Mask(),
            softcap=20.0,
            seed=80673,
        ),
    ),
]


@pytest.mark.parametrize("isa,case", KNOWN_OPEN, ids=[f"{i}-{n}" for n, (i, _) in enumerate(KNOWN_OPEN)])
@pytest.mark.xfail(strict=torch.__version__.startswith("2.13."), reason="known open fuzz finding")
def test_known_open_findings(isa, case):
    if not ops.isa_available(isa):
        pytest.skip(f"this CPU does not run {isa}")
    fuzz.assert_clean(case, isa)


def test_hf_backend_is_fuzzed():
    """The slice calls the Hugging Face backend (where the run has the hf group)."""
    require("transformers", import_it=False)
    assert fuzz.HF is not None, "torch_masked_attn.hf does not import"


def test_strategies_draw_every_option():
    """Hypothesis's draws come in clusters (it mutates what it drew before), so the slices also
    run an explicit example of each path; beyond those, the strategies draw every option: the
    decode kernel split between forced work items with a key head's query heads stacked (issue
    51), 7 and 16 query heads a key head (the decode tiles' tails, issue 64), other diagonals,
    the int8 cache, the sdpa drop-in and the HF backend, empty sequences, probability targets and
    the cross-entropy options."""
    att, var, ce = (fuzz.sample(fuzz.STRATEGIES[k](), n) for k, n in (("attention", 200), ("varlen", 60), ("ce", 60)))
    split = [c for c in att if c.splits in (2, 4, 16) and c.Lk > 512 and c.Lq <= 16]
    decodes = fuzz.sample(fuzz.attention_cases(decode=True), 40)
    options = {
        "split decodes, stacked heads": [c for c in split if c.H > c.Hkv],
        "decodes with 7 or 16 query heads a key head": [c for c in decodes if c.H // c.Hkv in (7, 16)],
        "diagonal": [c for c in att if c.diagonal],
        "int8": [c for c in att if c.int8],
        "sdpa": [c for c in att if c.call.startswith("sdpa")],
        "hf": [c for c in att if c.call == "hf"],
        "hf StructuredMask": [c for c in att if c.hf_mask is not None],
        "dropout": [c for c in att if c.dropout],
        "alibi": [c for c in att if c.alibi],
        "window": [c for c in att if c.window],
        "head mask": [c for c in att if c.head_mask],
        "key padding": [c for c in att if c.padding],
        "float mask + grad": [c for c in att if c.attn_mask and c.attn_mask.grad],
        "weights": [c for c in att if c.need_weights],
        "lse": [c for c in att if c.return_lse],
        "sinks": [c for c in att + var if c.sinks],
        "softcap": [c for c in att + var if c.softcap],
        "varlen window": [c for c in var if c.window != (-1, -1)],
        "empty sequence": [c for c in var if 0 in c.lq + c.lk],
        "probability targets": [c for c in ce if c.target != "class"],
        "z_loss": [c for c in ce if c.z_loss],
        "ce softcap": [c for c in ce if c.softcap],
        "label smoothing": [c for c in ce if c.label_smoothing],
    }
    counts = {name: len(got) for name, got in options.items()}
    assert all(counts.values()), counts


def test_replay_literal():
    """A finding's literal is the case: repr and parse_case round-trip, and --replay runs it."""
    drawn = fuzz.sample(fuzz.cases(), 60)
    assert all(fuzz.parse_case(repr(c)) == c for c in drawn)
    assert fuzz.main(["--replay", repr(drawn[-1]), "--isa", "scalar"]) == 0
    assert fuzz.main(["--replay", "Attention(Lk=2, seed=0)", "--isa", "scalar"]) == 0


# (what the reference gets wrong, the cases that it matters for), small cases
A, V = (functools.partial(fuzz.STRATEGIES[k], budget=500_000) for k in ("attention", "varlen"))
BROKEN = [
    ("causal", A(call="masked", causal=True, window=False)),  # (a window (., 0) is causal too)
    ("causal", A(call="masked", causal=False, window=False)),
    ("head_mask", A(call="masked", head_mask=True)),
    ("scale", A()),
    ("scale", A(call="sdpa")),
    ("window", A(call="masked", window=True)),
    ("diagonal", A(call="masked", causal=True, diagonal=True)),
    ("softcap", A(call="masked", softcap=1.0)),
    ("sinks", A(call="masked", sinks=True)),
    ("alibi", A(call="masked", alibi=True)),
    ("dropout", A(call="masked", dropout=True)),
    ("causal", A(call="masked", causal=True, window=False, decode=True, budget=12_000_000)),
    ("scale", A(call="masked", dtype="bf16", int8=True)),  # an 8-bit KV cache
    ("causal", A(call="masked", dtype="f32", int8=True, causal=True, window=False)),
    ("sinks", A(call="hf", sinks=True)),  # the HF backend passes them on
    ("causal", A(call="hf", causal=True)),
    ("window", V(window=(3, 0))),
    ("seqs", V(min_seqs=2)),
    ("sinks", V(sinks=True)),
    ("label_smoothing", fuzz.ce_cases(label_smoothing=0.3)),
    ("z_loss", fuzz.ce_cases(z_loss=0.05)),
    ("softcap", fuzz.ce_cases(softcap=2.0)),
]


@pytest.mark.parametrize("breaks,strategy", BROKEN, ids=[f"{b}-{n}" for n, (b, _) in enumerate(BROKEN)])
def test_broken_reference_is_caught(breaks, strategy):
    """Self-test: the tolerance is tight enough that a kernel with the wrong causal flag, no head
    mask, a wrong scale, a dropped window / diagonal / softcap / sink / ALiBi / dropout mask (also
    through the sdpa drop-in, the int8 cache, the HF backend and varlen) or a dropped
    cross-entropy option would be caught (here the reference is the wrong one)."""
    drawn = list({c.seed: c for c in fuzz.sample(strategy, 24)}.values())[:8]  # no two alike
    assert len(drawn) >= 6
    caught = [c for c in drawn if fuzz.check(c, "scalar", frozenset({breaks})).problems]
    # some draws cannot tell (one key per query, every key masked, C = 1, every target
    # ignored): most are caught; a blind check would catch none
    assert len(caught) >= 0.5 * len(drawn), f"caught {len(caught)} of {len(drawn)}"
    for c in drawn[-1:]:  # and with the right reference the same cases are clean
        fuzz.assert_clean(c, "scalar")


def test_finding_shrinks_to_a_small_case():
    """A finding is shrunk: with the causal flag flipped in the reference, Hypothesis's first
    failing case shrinks to one query and two keys, all else at its default, and the finding
    prints it with its replay line."""
    f = fuzz.search(fuzz.attention_cases(call="masked"), "scalar", max_examples=100, breaks=frozenset({"causal"}))
    assert f is not None
    c = f.result.case
    assert (c.B, c.H, c.Lq, c.Lk, c.D, c.Dv, c.dtype) == (1, 1, 1, 2, 1, 1, "f32"), repr(c)
    assert f'--replay "{c!r}" --isa scalar' in str(f) and f"@example(case={c!r})" in str(f)
