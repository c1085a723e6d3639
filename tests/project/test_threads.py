"""Results independent of threads: Python threads calling at once and every
torch thread count give the single-threaded bits; the CPU count the
backward's key-chunk rule reads is the machine's within its container,
whatever the calling thread's affinity."""

import os
import subprocess
import sys
import threading

import pytest
import torch

import torch_masked_attn as tma

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _qkv(B=2, H=2, L=70, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(4)]


def _child(code, env):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}
    )


def _quota_cpus():
    """A container's CPU quota as Python reads it: cgroup v2 cpu.max, else v1's cfs quota."""

    def numbers(path):
        try:
            with open(path) as f:
                return [-1 if w == "max" else int(w) for w in f.read().split()[:2]]
        except (OSError, ValueError):
            return []

    v = numbers("/sys/fs/cgroup/cpu.max")
    if len(v) == 2:
        return -(-v[0] // v[1]) if v[0] > 0 and v[1] > 0 else 0
    q, p = numbers("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), numbers("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    return -(-q[0] // p[0]) if len(q) == 1 and len(p) == 1 and q[0] > 0 and p[0] > 0 else 0


def _cpuset_cpus():
    """The CPUs of the container's cgroup cpuset list ("0-3,8-11"), 0 where there is none."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        n = 0
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            n += int(hi or lo) - int(lo) + 1
        return n
    return 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity mask on this OS")
def test_cpu_count_is_the_machines_within_the_container():
    """ma_cpu_count (the backward's key-chunk rule reads it): the online CPUs,
    lowered to the container's cgroup cpuset and CPU quota, never the calling
    thread's affinity: a child whose main thread pins itself to one CPU
    before its first call (as OMP_PROC_BIND does) still sees the same count,
    so which thread asks first cannot change the results' bits."""
    want = os.cpu_count()
    for limit in (_cpuset_cpus(), _quota_cpus()):
        if 0 < limit < want:
            want = limit
    assert tma._library._clib.ma_cpu_count() == want
    code = (
        "import os, torch_masked_attn as t\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "print(t._library._clib.ma_cpu_count())"
    )
    r = _child(code, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(want)]


def _step(q, k, v, go, kpm):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = tma.functional.masked_attention(q, k, v, key_padding_mask=kpm, is_causal=True)
    out.backward(go)
    return [out.detach(), q.grad, k.grad, v.grad]


def test_python_threads_at_once_are_bitwise_single_threaded():
    q, k, v, go = _qkv(B=2, H=4, L=200, D=32)
    kpm = torch.arange(200)[None] >= torch.tensor([200, 130])[:, None]
    want = _step(q, k, v, go, kpm)
    results, errors = [None] * 4, []

    def work(i):
        try:
            for _ in range(5):
                results[i] = _step(q, k, v, go, kpm)
                assert all(torch.equal(a, b) for a, b in zip(results[i], want))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_thread_counts_give_bitwise_equal_results(n):
    q, k, v, go = _qkv(B=1, H=3, L=300, D=40, seed=3)
    kpm = torch.arange(300)[None] >= torch.tensor([250])[:, None]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = _step(q, k, v, go, kpm)
        torch.set_num_threads(n)
        got = _step(q, k, v, go, kpm)
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
