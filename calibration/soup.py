"""Average the scales of checkpoints that share their integer codes (a "soup").

    python -m calibration.soup runs/e2e_seed0 runs/e2e_seed1 runs/e2e_seed2 --out runs/soup

Several ``calibration.e2e`` runs from one start (same codes and zero points,
different seeds: other windows, another order) end at different scales.
Their geometric mean, each scale = exp(mean of log scale), usually fits the
float model better than any one of them: the runs' errors are partly
independent, and averaging cancels some of them.  Every other tensor (packed
codes, zero points, embeddings, norm gains, biases) must be identical in all
inputs; anything else is an error naming the tensor, and nothing is written.
The output is an ordinary qgemv checkpoint (written atomically) whose
``quantization_config.calibration.soup`` lists the inputs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional

import torch

from qgemv import checkpoint as C
from qgemv.nn import QuantLinear


def soup_scales(models: list) -> int:
    """Set the first model's QuantLinear scales to the geometric mean of all models' scales.

    models: loaded qgemv models with the same architecture, codes and zero
    points (fp16 scales [N] or [N, G], all > 0).  Every tensor other than the
    scales must be equal across the models (ValueError naming the first that
    is not).  Returns the number of scale tensors averaged; models[0] is
    changed in place, the others are only read.
    """
    if len(models) < 2:
        raise ValueError(f"soup_scales: needs at least 2 models, got {len(models)}")
    states = [m.state_dict() for m in models]
    keys = list(states[0])
    for i, s in enumerate(states[1:], 1):
        if list(s) != keys:
            extra = sorted(set(s) ^ set(keys))[:3]
            raise ValueError(f"soup_scales: model {i} has other tensors than model 0 (e.g. {extra})")
    scale_keys = {f"{name}.scales" for name, mod in models[0].named_modules() if isinstance(mod, QuantLinear)}
    if not scale_keys:
        raise ValueError("soup_scales: the models have no QuantLinear modules")
    for k in keys:
        if k in scale_keys:
            continue
        for i, s in enumerate(states[1:], 1):
            if s[k].shape != states[0][k].shape or not torch.equal(s[k], states[0][k]):
                raise ValueError(f"soup_scales: tensor {k} differs between model 0 and model {i} "
                                 "(only the scales may differ: the inputs must share their codes)")
    with torch.no_grad():
        for k in sorted(scale_keys):
            stacked = torch.stack([s[k].float() for s in states])
            if not torch.all(stacked > 0):
                raise ValueError(f"soup_scales: {k} has a non-positive scale; the geometric mean needs scales > 0")
            states[0][k].copy_(stacked.log().mean(0).exp().to(states[0][k].dtype))
    return len(scale_keys)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m calibration.soup", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="two or more qgemv checkpoint directories with the same codes")
    ap.add_argument("--out", required=True, help="output directory (written atomically)")
    ap.add_argument("--overwrite", action="store_true")
    return ap


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.checkpoints) < 2:
        raise SystemExit("calibration.soup: give at least two checkpoints")
    if Path(args.out).exists() and not args.overwrite:
        raise SystemExit(f"{args.out} exists (pass --overwrite to replace it)")
    t0 = time.time()
    cfg = json.loads((Path(args.checkpoints[0]) / "config.json").read_text())
    loaded = [C.load_quantized(p, dtype=torch.float32) for p in args.checkpoints]
    models = [m for m, _ in loaded]
    try:
        n = soup_scales(models)
    except ValueError as e:
        raise SystemExit(f"calibration.soup: {e}")
    qc = dict(cfg["quantization_config"])
    qc["algorithm"] = qc.get("algorithm", "?") + "+soup"
    qc["calibration"] = dict(qc.get("calibration") or {})
    qc["calibration"]["soup"] = {"inputs": [str(p) for p in args.checkpoints], "scale_tensors": n}
    float_dtype = C.source_dtype(args.checkpoints[0])
    C.save_quantized(models[0], loaded[0][1], args.out, qc, overwrite=args.overwrite, float_dtype=float_dtype)
    print(f"soup: geometric mean of {n} scale tensors over {len(models)} checkpoints, "
          f"{time.time() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
