"""A seeded slice of the differential fuzzer (tools/fuzz.py, `make fuzz`) on
every instruction set the CPU runs, and the fuzzer's self-test: a reference
broken on purpose must give findings."""

import importlib.util
import pathlib
import sys

import pytest
import torch

from torch_masked_attn import ops

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "fuzz.py"


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("tma_tools_fuzz", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


fuzz = _load_fuzz()

CASES_PER_ISA = 300  # attention, cross-entropy and varlen in turn
MASTER_SEED = 18  # 17 draws KNOWN_OPEN's first case on AVX2

# Open findings of `make fuzz`, replayed on the ISA that found
# them; strict xfail, so a fix shows up as an XPASS to move them out. Within
# 1.1-1.2x of the bound, where the bound's PyTorch term is small:
KNOWN_OPEN = [
    ("avx2", 3107736406743),  # f32 dropout 0.62, Lq=1: dv 7.1e-5 vs bound 6.2e-5 (P's exp error, scaled)
]
# bfloat16/float16 gradient findings of `make fuzz` that delta from the rounded out
# gives (1.05-5x beyond their bounds) and out_lo fixes (docs/design.md, section 4),
# kept as regression cases:
FIXED = [
    ("avx2", 423093423758),  # varlen bf16 GQA, window (1, 0), D=1: dq 0.037 vs bound 0.0075
    ("avx2", 1288928299952),  # varlen f16, window (61, 0), lse: dq 4.1e-3 vs 2.8e-3
    ("avx2", 1889813388011),  # varlen bf16, Lq=1: dq 7.5e-3 vs 7.1e-3
    ("scalar", 582500290004),  # varlen f16 GQA, D=1: dk 2.0e-3 vs 1.5e-3
    ("scalar", 1118489222058),  # bf16 float mask + causal window: dk 6.7e-3 vs 6.1e-3
    ("scalar", 3198878986431),  # f16 softcap + sinks: dk 1.7e-3 vs 1.5e-3
    ("scalar", 663280712130),  # bf16 sinks + need_weights, Lq=1: dq 4.3e-3 vs 2.0e-3
    # d head_mask rounded to bf16 per batch entry, then summed over B in bf16 (now: rounded once)
    ("avx2", 2241842038638),  # bf16, head_mask (H,) + grad, need_weights: dhm 7.7e-3 vs 3.4e-3
]


@pytest.fixture(autouse=True)
def _one_thread():
    """Small cases: one intra-op thread is faster, and keeps the slice under a
    minute on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("isa", fuzz.ISAS)
def test_fuzz_slice(isa):
    if not ops.isa_available(isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    st = fuzz.fuzz([isa], cases=CASES_PER_ISA, master=MASTER_SEED, log=None)
    assert sum(st.cases[isa].values()) == CASES_PER_ISA
    assert not st.findings, f"{len(st.findings)} findings:\n" + "\n".join(map(str, st.findings))


def test_case_is_replayable():
    """A case is determined by its seed alone: the same seed gives the same
    draw and the same comparison, whatever ran before."""
    seeds = [s for _, s in zip(range(4), fuzz.case_seeds(MASTER_SEED))]
    assert [fuzz.kind_of(s) for s in seeds] == [fuzz.DEFAULT_KINDS[i % len(fuzz.DEFAULT_KINDS)] for i in range(4)]
    first = [fuzz.run_case(s)[0].lines for s in seeds]
    assert [fuzz.run_case(s)[0].lines for s in reversed(seeds)] == first[::-1]
    assert fuzz.main(["--replay", str(seeds[1]), "--isa", "scalar"]) == 0


# (kind, what the reference gets wrong, what the draw must include for it to matter)
BROKEN = [
    ("attention", "causal", {"is_causal": True}),
    ("attention", "causal", {"is_causal": False}),
    ("attention", "head_mask", {"head_mask": True}),
    ("attention", "scale", {}),
    ("attention", "window", {"window": True, "hf": False}),
    ("attention", "diagonal", {"diagonal_draw": True, "is_causal": True, "hf": False, "sdpa": False}),
    ("attention", "softcap", {"softcap": True, "softcap_value": 1.0}),
    ("attention", "sinks", {"sinks": True}),
    ("attention", "dropout", {"dropout": True, "dropout_p": 0.3, "hf": False}),
    ("attention", "scale", {"int8": True, "hf": False, "sdpa": False}),  # an 8-bit KV cache
    ("attention", "causal", {"int8": True, "hf": False, "sdpa": False, "is_causal": True}),
    ("attention", "sinks", {"sinks": True, "hf": True}),  # the HF backend passes them on
    ("attention", "causal", {"hf": True, "is_causal": True}),
    ("varlen", "window", {"window": (3, 0)}),
    ("varlen", "seqs", {}),
    ("ce", "label_smoothing", {"label_smoothing": 0.3}),
    ("ce", "z_loss", {"z_loss": 0.05}),
    ("ce", "softcap", {"softcap": 2.0}),
]


@pytest.mark.parametrize("kind,breaks,force", BROKEN, ids=[f"{k}-{b}-{f}" for k, b, f in BROKEN])
def test_broken_reference_is_caught(kind, breaks, force):
    """Self-test: the tolerance is tight enough that a kernel with the wrong
    causal flag, no head mask, a wrong scale, a dropped window / softcap /
    sink / dropout mask (also through the HF backend) or a dropped
    cross-entropy option would be caught (here the reference is the wrong one)."""
    if force.get("hf") and fuzz._HF is None:
        pytest.skip("transformers is not installed (the HF backend)")
    if kind not in fuzz.DEFAULT_KINDS:
        pytest.skip(f"this build has no {kind}")
    seeds = [len(fuzz.KINDS) * (1000 + i) + fuzz.KINDS.index(kind) for i in range(20)]
    results = [fuzz.run_case(s, "scalar", frozenset({breaks}), force) for s in seeds]
    caught = [s for s, (_, f) in zip(seeds, results) if f is not None]
    # some draws cannot tell (one key per query, every key masked, C = 1, every
    # target ignored): 70-90% are caught; a blind check would catch none
    assert len(caught) >= 0.5 * len(seeds), f"caught {len(caught)} of {len(seeds)}"
    # and the same cases with the right reference are clean
    for s in seeds[:4]:
        _, f = fuzz.run_case(s, "scalar", frozenset(), force)
        assert f is None, str(f)


def _replay_clean(isa, seed):
    """Replays fuzz case `seed` on `isa`; asserts it has no finding."""
    if not ops.isa_available(isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    if fuzz.kind_of(seed) not in fuzz.DEFAULT_KINDS:
        pytest.skip("this build lacks the kind")
    _, f = fuzz.run_case(seed, isa)
    assert f is None, str(f)


@pytest.mark.parametrize("isa,seed", FIXED, ids=[f"{i}-{s}" for i, s in FIXED])
def test_fixed_findings(isa, seed):
    _replay_clean(isa, seed)


@pytest.mark.parametrize("isa,seed", KNOWN_OPEN, ids=[f"{i}-{s}" for i, s in KNOWN_OPEN])
# strict on the torch that found them: the bound scales PyTorch's own error, which another
# torch computes differently (under 2.10 the f32 dropout case is inside its bound)
@pytest.mark.xfail(strict=torch.__version__.startswith("2.13."), reason="known open fuzz finding")
def test_known_open_findings(isa, seed):
    _replay_clean(isa, seed)


def test_slice_draws_split_and_stacked_decodes():
    """The slice runs the decode kernel over several key chunks, split between forced work
    items, with a key head's query heads stacked as one block of rows (issue 51)."""
    seeds = [s for _, s in zip(range(CASES_PER_ISA), fuzz.case_seeds(MASTER_SEED))]
    drawn = [fuzz.draw(s) for s in seeds if fuzz.kind_of(s) == "attention"]
    dec = [c for c in drawn if c["decode"] and c["Lk"] > 512 and c["Lq"] <= 16]
    split = [c for c in dec if c["splits"] in (2, 4, 16)]
    stacked = [c for c in split if c["H"] > c["Hkv"]]
    assert len(split) >= 5 and len(stacked) >= 3, (len(dec), len(split), len(stacked))


def test_slice_draws_other_diagonals():
    """The slice calls masked_attention with diagonal= (bottom-right and other offsets) under
    is_causal and windows."""
    seeds = [s for _, s in zip(range(CASES_PER_ISA), fuzz.case_seeds(MASTER_SEED))]
    drawn = [fuzz.draw(s) for s in seeds if fuzz.kind_of(s) == "attention"]
    diag = [c for c in drawn if c["diagonal"]]
    assert len(diag) >= 8 and any(c["diagonal"] == c["Lk"] - c["Lq"] for c in diag), len(diag)
