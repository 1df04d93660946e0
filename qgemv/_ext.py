"""Loading the CUDA extension: AOT module, then JIT build if asked, then the reference.

Order:
1. ``qgemv._C``, built ahead of time by ``setup.py``.
2. If ``QGEMV_JIT=1``: a ninja build of csrc/ through
   ``torch.utils.cpp_extension.load`` (cached under torch's extension dir).
3. Otherwise the pure-torch reference serves the CUDA key too; the first CUDA
   call through it logs one warning that says why.

Nothing here initialises CUDA: loading a shared library that links the CUDA
runtime does not create a context.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from . import ops

log = logging.getLogger("qgemv")

#: "aot", "jit" or "reference"
BACKEND = "reference"
#: Why the backend is what it is (shown by ``python -m qgemv info``).
REASON = ""
#: The loaded extension module (None on the reference backend).
MODULE = None
_warned = False


def _try_aot():
    import importlib

    return importlib.import_module("qgemv._C")


def _try_jit():
    from torch.utils import cpp_extension

    from ._sources import CSRC, CXX_FLAGS, NVCC_FLAGS, extension_sources, torch_arch_list

    archs = os.environ.get("QGEMV_CUDA_ARCHS")
    if archs:
        os.environ["TORCH_CUDA_ARCH_LIST"] = torch_arch_list(archs)
    return cpp_extension.load(
        name="qgemv_jit_C",
        sources=extension_sources(),
        extra_cflags=CXX_FLAGS,
        extra_cuda_cflags=NVCC_FLAGS,
        extra_include_paths=[CSRC],
        verbose=os.environ.get("QGEMV_JIT_VERBOSE") == "1",
    )


def _register_reference_for_cuda():
    def wrap(name, ref):
        def cuda_fallback(*args):
            global _warned
            if not _warned:
                _warned = True
                warnings.warn(
                    f"qgemv: CUDA extension not available ({REASON}); "
                    "CUDA tensors use the slow pure-torch reference",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return ref(*args)

        torch.library.impl(f"qgemv::{name}", "cuda")(cuda_fallback)

    for name, ref in ops.REFERENCES.items():
        wrap(name, ref)


def _register(module, what: str) -> None:
    """Register ``module``'s CUDA kernels if it was built for these op schemas.

    Raises RuntimeError naming the mismatch (a build older or newer than this
    qgemv's ops.py) or the dispatcher's complaint.
    """
    built = getattr(module, "OPS_VERSION", None)
    if built != ops.OPS_VERSION:
        raise RuntimeError(f"{what} was built for op schema version {built}, this qgemv defines version "
                           f"{ops.OPS_VERSION}: rebuild it (pip install ., or python setup.py build_ext --inplace)")
    module.register_kernels()


def load() -> str:
    """Pick the backend once; returns BACKEND."""
    global BACKEND, REASON, MODULE
    if not torch.version.cuda:
        BACKEND, REASON = "reference", f"torch {torch.__version__} is a CPU-only build"
    else:
        try:
            mod = _try_aot()
            _register(mod, "qgemv._C")
            MODULE = mod
            BACKEND, REASON = "aot", "qgemv._C (built by setup.py)"
        except (ImportError, RuntimeError) as e:
            REASON = f"qgemv._C not usable: {e}"
            if os.environ.get("QGEMV_JIT") == "1":
                try:
                    mod = _try_jit()
                    _register(mod, "the JIT build")
                    MODULE = mod
                    BACKEND, REASON = "jit", "built from csrc/ with ninja (QGEMV_JIT=1)"
                except Exception as e2:  # a failed compile must not break import
                    REASON += f"; JIT build failed: {e2}"
            else:
                REASON += "; set QGEMV_JIT=1 to build it with ninja"
    if BACKEND == "reference":
        _register_reference_for_cuda()
        log.info("qgemv: using the reference backend: %s", REASON)
    return BACKEND


#: Valid modes of set_gemv_pdl: -1 the default (off), 0 off, 1 launch, + 2 L2 prefetch, + 4 early release.
GEMV_PDL_MODES = (-1, 0, 1, 3, 5, 7)


def set_gemv_pdl(mode: int = 7) -> None:
    """Launch the GEMV kernels (M <= 16 tokens) as programmatic dependent launches (Hopper and later).

    The GEMV may then start while the kernel before it finishes: it prefetches the
    start of its weights into L2 (mode bit 2), lets the next kernel launch early
    (bit 4), and waits for the kernel before it before it reads x or writes y.
    ``qgemv.ops.decode_attention`` / ``rope_decode_attention`` follow the same
    setting (bit 2: the first K / V rows of each block into L2 before the wait).
    It pays off only when the kernels around the GEMVs take part too: with
    ``TORCHINDUCTOR_ENABLE_PDL=1`` (torch.compile'd glue) a Llama-2-7B decode
    step on the H200 went from 2.27 to 2.16 ms/token (int4, batch 1); with
    ordinary torch kernels around it, every mode cost about 2.8%. So it is off
    by default; ``qgemv.Engine`` turns it on inside its decode step, whose
    compiled glue takes part (``Engine.pdl``; BENCHMARKS.md, "Generation engine").

    mode: 7 (all), 1 / 3 / 5 (parts), 0 off, -1 the default. Process-wide; it
    takes effect at the next launch (a CUDA graph keeps the mode it was
    captured with). No effect on the reference backend or below compute
    capability 9.0.
    """
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in GEMV_PDL_MODES:
        raise ValueError(f"qgemv.set_gemv_pdl: mode must be one of {GEMV_PDL_MODES}, got {mode!r}")
    if MODULE is not None:
        MODULE.set_gemv_pdl(mode)


def backend_info() -> dict:
    """Which backend serves each op on each device, and why."""
    cuda = "CUDA kernels" if BACKEND in ("aot", "jit") else "pure-torch reference"
    return {
        name: {"cpu": "pure-torch reference", "cuda": cuda} for name in ops.REFERENCES
    }
