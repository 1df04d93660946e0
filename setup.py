"""Build qgemv, with its CUDA extension when nvcc and a CUDA build of torch are present.

Environment:
  QGEMV_CUDA_ARCHS       architectures, e.g. "8.0;9.0" (default "8.0;8.6;8.9;9.0"); 9.0 is
                         built as sm_90a, for the wgmma prefill GEMM
  QGEMV_SKIP_CUDA_BUILD  "1" skips the extension (the reference serves CUDA tensors)
  MAX_JOBS               parallel compile jobs (torch's build helper reads it)
"""

import os
import runpy
import shutil

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = runpy.run_path(os.path.join(HERE, "qgemv", "_sources.py"))

ext_modules = []
cmdclass = {}
if os.environ.get("QGEMV_SKIP_CUDA_BUILD") != "1":
    import torch
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

setup(
    name="qgemv",
    version="0.1.0",
    description="Weight-only int8/int4 GEMV kernels for LLM decode",
    packages=find_packages(include=["qgemv", "qgemv.*", "calibration", "calibration.*", "eval", "eval.*"]),
    python_requires=">=3.9",
    install_requires=["torch", "safetensors", "tqdm", "numpy"],
    extras_require={
        "models": ["transformers", "accelerate", "gguf", "datasets", "matplotlib"],
        "test": ["pytest"],
    },
    entry_points={
        "console_scripts": [
            "qgemv-quantize=calibration.cli:main",
            "qgemv-ppl=eval.ppl:main",
            "qgemv-ppl-check=eval.ppl_check:main",
        ]
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
