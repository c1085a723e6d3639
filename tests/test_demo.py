"""The demo's training run, shortened: the model built on torch_masked_attn and
the one built on torch.nn, from identical weights on identical batches, agree
within float32 noise over the first 20 steps."""
import importlib.util
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "examples", "demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_demo_losses_agree_over_20_steps():
    demo = load_demo()
    hist, models = demo.train(steps=20, verbose=False)
    native, ours = hist["native"]["loss"], hist["ours"]["loss"]
    assert len(native) == len(ours) == 20
    assert native[-1] < native[0] - 0.1          # it trains
    for step, (a, b) in enumerate(zip(native, ours)):
        assert math.isfinite(b)
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), f"step {step}: native {a}, ours {b}"
