"""The one list of extension sources, shared by setup.py and the JIT loader.

Kept free of torch imports so that setup.py can read it before torch's build
helpers are set up.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
# An installed wheel carries the sources as package data (qgemv/csrc, see
# setup.py); a checkout (or an editable install) has them beside the package.
CSRC = next((d for d in (os.path.join(_HERE, "csrc"), os.path.join(os.path.dirname(_HERE), "csrc"))
             if os.path.isfile(os.path.join(d, "qgemv.h"))), os.path.join(os.path.dirname(_HERE), "csrc"))


def extension_sources(root: str = CSRC) -> list:
    """All .cu and .cpp files under csrc/, sorted (absolute paths)."""
    return sorted(
        os.path.join(root, f) for f in os.listdir(root) if f.endswith((".cu", ".cpp"))
    )


NVCC_FLAGS = ["-O3", "-lineinfo"]  # no fast-math: it flushes fp32 denormals
CXX_FLAGS = ["-O3"]  # the C++ standard is left to torch (C++20 from torch 2.13 on)


def torch_arch_list(archs: str) -> str:
    """QGEMV_CUDA_ARCHS -> TORCH_CUDA_ARCH_LIST: "9.0" becomes "9.0a".

    The Hopper prefill GEMM (csrc/gemm_wgmma.cu) uses wgmma, which exists only
    in the arch-specific sm_90a target; its machine code runs on every
    compute-capability-9.0 GPU (H100, H200).  The other kernels compile the
    same for sm_90a as for sm_90.
    """
    out = []
    for a in archs.replace(",", ";").split(";"):
        a = a.strip()
        if a:
            out.append("9.0a" if a == "9.0" else a)
    return ";".join(out)
