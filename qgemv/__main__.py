"""``python -m qgemv info``: versions, CUDA availability, and which backend serves each op.

``python -m qgemv generate ...`` is ``qgemv-generate ...`` (qgemv.engine).
"""

import argparse
import json
import sys


def info() -> dict:
    import torch

    import qgemv
    from qgemv import _ext

    out = {
        "qgemv": qgemv.__version__,
        "format_version": qgemv.FORMAT_VERSION,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "backend": _ext.BACKEND,
        "reason": _ext.REASON,
        "ops": _ext.backend_info(),
    }
    if out["cuda_available"]:
        out["device"] = torch.cuda.get_device_name()
    else:  # building the extension would not help here
        out["reason"] = out["reason"].replace("; set QGEMV_JIT=1 to build it with ninja", "") + \
            " (no CUDA GPU here: the reference serves every op)"
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["generate"]:
        from .generate_cli import main as generate_main

        return generate_main(argv[1:])
    from ._args import parser

    ap = parser("python -m qgemv")
    ap.add_argument("command", choices=["info", "generate"])
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = ap.parse_args(argv)
    d = info()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    for k, v in d.items():
        if k == "ops":
            print("ops:")
            for name, where in v.items():
                print(f"  {name:22s} cpu: {where['cpu']:22s} cuda: {where['cuda']}")
        else:
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
