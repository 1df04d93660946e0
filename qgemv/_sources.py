"""The one list of extension sources, shared by setup.py and the JIT loader.

Kept free of torch imports so that setup.py can read it before torch's build
helpers are set up.
"""

import os

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def extension_sources(root: str = CSRC) -> list:
    """All .cu and .cpp files under csrc/, sorted (absolute paths)."""
    return sorted(
        os.path.join(root, f) for f in os.listdir(root) if f.endswith((".cu", ".cpp"))
    )


NVCC_FLAGS = ["-O3", "-lineinfo"]  # no fast-math: it flushes fp32 denormals
CXX_FLAGS = ["-O3"]  # the C++ standard is left to torch (C++20 from torch 2.13 on)
