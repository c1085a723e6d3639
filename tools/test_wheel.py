"""make test-wheel: the built wheel installed into fresh virtual environments,
one per torch version, and the test suite run against that installed package,
never the checkout.

For each torch version (--torch, repeatable):

  build-wheel/venvs/torch-<version>/   a fresh venv (removed first): the wheel,
                                       torch==<version>, pytest, hypothesis, numpy; then
                                       transformers, tokenizers, accelerate
                                       (the Hugging Face tests) where pip can
                                       resolve them with that torch, else the
                                       suite runs --without hf (the group's
                                       tests skip, naming the option); always
                                       --without emulate (no bochscpu-python)
  a temporary directory                the checkout's tracked files except the
                                       package torch_masked_attn/ (tests/, and
                                       what tests read from the checkout: setup.py's
                                       C flags, csrc/ and benchmarks/ for the C
                                       harnesses, examples/demo.py, tools/fuzz.py,
                                       pyproject.toml's pytest settings); pytest
                                       runs there, so `import torch_masked_attn`
                                       can only find the venv's site-packages

Before the suite the import is checked from that directory, and after it the
module the tests used (sys.modules) is checked again; either pointing outside
the venv fails the run. torch==2.13.0 comes from this machine's disk; other
versions are PyPI's CUDA builds (several GB; pip's cache keeps the download).

  python tools/test_wheel.py dist/torch_masked_attn-*.whl --torch 2.13.0 --torch 2.10.0
  python tools/test_wheel.py WHEEL --torch 2.13.0 -- -k causal   # extra arguments go to pytest
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENVS = os.path.join(ROOT, "build-wheel", "venvs")
HF = ["transformers==5.23.0", "tokenizers==0.23.3", "accelerate==1.15.0"]

# Runs in the venv's python from the copy: pytest, then which torch_masked_attn the tests imported.
RUN_PYTEST = """\
import os, sys, pytest
site = sys.argv[1]
rc = pytest.main(sys.argv[2:])
mod = sys.modules.get("torch_masked_attn")
where = os.path.realpath(mod.__file__) if mod else None
print("torch_masked_attn used by the tests:", where)
if where is None or not where.startswith(site + os.sep):
    print("test-wheel: the tests did not use the installed wheel", file=sys.stderr)
    rc = rc or 3
sys.exit(int(rc))
"""


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, **kw)


def copy_checkout(dest):
    """The tracked files (working-tree content, as `make wheel` builds from), less the package."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for rel in files.decode().split("\0"):
        if not rel or rel.startswith("torch_masked_attn/") or not os.path.isfile(os.path.join(ROOT, rel)):
            continue
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))


def one_version(wheel, version, pytest_args):
    res = {"torch": version, "times": {}}
    venv = os.path.join(VENVS, f"torch-{version}")
    py = os.path.join(venv, "bin", "python")
    t0 = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", venv], check=True)
    pip = [py, "-m", "pip", "install", "-q", "--progress-bar", "off"]
    run([*pip, wheel, f"torch=={version}", "pytest", "hypothesis==6.170.27", "numpy"], check=True)
    hf = run([*pip, f"torch=={version}", *HF])
    res["hf"] = "installed" if hf.returncode == 0 else "not installable with this torch: run --without hf"
    # the emulated AVX-512 run needs bochscpu-python, a test dependency of the checkout's own venv
    without = ["--without", "emulate"] + ([] if hf.returncode == 0 else ["--without", "hf"])
    res["times"]["install"] = time.monotonic() - t0

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    site = os.path.realpath(site)
    with tempfile.TemporaryDirectory(prefix="tma-test-wheel-") as work:
        copy_checkout(work)
        probe = run(
            [
                py,
                "-c",
                "import torch, torch_masked_attn as t; print(t.__file__); print(torch.__version__); "
                "print(t.__version__)",
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        print(probe.stdout + probe.stderr, end="")
        if probe.returncode != 0:
            res["result"] = "import failed"
            return res
        path, torch_version, ours = probe.stdout.split()[:3]
        res["torch_installed"], res["package_version"] = torch_version, ours
        if not os.path.realpath(path).startswith(site + os.sep):
            res["result"] = f"imported from {path}, not the venv's site-packages {site}"
            return res
        res["imported_from"] = path
        t1 = time.monotonic()
        proc = subprocess.Popen(
            [py, "-c", RUN_PYTEST, site, "tests", "-q", "-rs", "-p", "no:cacheprovider", *without, *pytest_args],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        tail = []
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail = (tail + [line.rstrip("\n")])[-40:]
        rc = proc.wait()
        res["times"]["tests"] = time.monotonic() - t1
    summary = [ln for ln in tail if re.search(r"\d+ (passed|failed|error)", ln)]
    res["result"] = summary[-1].strip("= ") if summary else f"pytest exit {rc}, no summary line"
    res["rc"] = rc
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("--torch", action="append", required=True, help="a torch version (repeatable)")
    ap.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = ap.parse_args()
    wheel = os.path.abspath(args.wheel)
    results = []
    for version in args.torch:
        print(f"\n==== {os.path.basename(wheel)} with torch {version} ====", flush=True)
        results.append(one_version(wheel, version, args.pytest_args))
    print(f"\n==== test-wheel: {os.path.basename(wheel)} ====")
    ok = True
    for r in results:
        times = ", ".join(f"{k} {v:.0f} s" for k, v in r["times"].items())
        print(
            f"torch {r['torch']} ({r.get('torch_installed', '?')}): {r['result']}  [{times}]; "
            f"transformers/accelerate {r.get('hf', '?')}; package from {r.get('imported_from', '?')}"
        )
        ok = ok and r.get("rc") == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
