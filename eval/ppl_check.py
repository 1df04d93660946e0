"""Perplexity regression check for anyone's CI.

    qgemv-ppl-check --reference MODEL --quantized QDIR [--max-ppl-increase 2%] [--max-kl 0.05] [--min-top1 95%]

Exit status:
  0  every threshold holds for every checkpoint;
  1  a threshold failed (each failure is printed with its margin), or a
     metric is not finite (NaN logits fail; they never pass);
  2  anything else: bad arguments or thresholds (NaN, infinite, negative,
     top-1 outside 0..100%), a missing, empty, binary, non-UTF-8 or
     too-short text, a directory that is not a qgemv checkpoint, a model
     that does not load, or an internal error (printed with its traceback).
Arguments, checkpoints and the text are all checked before either model
is loaded.  Each verdict prints Δppl with its paired, window-level standard
error, and warns when a limit lies within two standard errors of the
measured value (a verdict the noise could flip: use more --windows).
The evaluation protocol is eval/ppl.py's and is printed with the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path


def _threshold(what: str, hi: float = math.inf, pct: bool = False):
    """An argparse type: a finite number in [0, hi], optionally written with a % sign."""
    def parse(v: str) -> float:
        try:
            x = float(v.rstrip("%") if pct else v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a percentage like 2% or 2' if pct else 'a number'}, "
                                             f"got {v!r}") from None
        if not math.isfinite(x) or x < 0 or x > hi:
            rng = f"0..{hi:g}" if math.isfinite(hi) else ">= 0"
            raise argparse.ArgumentTypeError(f"{what} must be a finite number {rng}, got {v!r}")
        return x
    return parse


def _finite(*vals) -> bool:
    return all(v is not None and math.isfinite(v) for v in vals)


def check(result: dict, max_ppl_increase: float, max_kl: float, min_top1: float) -> list:
    """Failed thresholds of one quantized result, as human-readable lines.

    A metric that is not a finite number (NaN logits give NaN perplexity and
    KL) is itself a failure, whatever the thresholds.
    """
    fails = []
    for key, what in (("ppl", "perplexity"), ("delta_ppl_pct", "ppl increase"), ("kl", "KL"),
                      ("top1_pct", "top-1 agreement")):
        if not _finite(result.get(key)):
            fails.append(f"{what} is {result.get(key)} (not a finite number): the model's logits are not usable")
    if fails:
        return fails
    d = result["delta_ppl_pct"]
    if d > max_ppl_increase:
        fails.append(f"ppl increase {d:+.3f}% > allowed {max_ppl_increase:.3f}% (by {d - max_ppl_increase:.3f} points)")
    if result["kl"] > max_kl:
        fails.append(f"KL {result['kl']:.5f} > allowed {max_kl:.5f} (by {result['kl'] - max_kl:.5f})")
    if result["top1_pct"] < min_top1:
        fails.append(f"top-1 agreement {result['top1_pct']:.2f}% < required {min_top1:.2f}% "
                     f"(short by {min_top1 - result['top1_pct']:.2f} points)")
    return fails


def noise_note(result: dict, max_ppl_increase: float) -> str:
    """'Δppl +0.26% ± 0.19' and, when the limit is within two standard errors of it, a warning line."""
    d, se = result.get("delta_ppl_pct"), result.get("delta_ppl_se_pct")
    if not _finite(d):
        return ""
    text = f"Δppl {d:+.3f}%" + (f" ± {se:.3f} (paired s.e. over windows)" if _finite(se) else " (no s.e.: one window)")
    if _finite(se) and abs(max_ppl_increase - d) < 2 * se:
        text += (f"\n  warning: the limit {max_ppl_increase:.3f}% is within 2 standard errors of the measured "
                 f"{d:+.3f}%; noise could flip this verdict (use more --windows)")
    return text


def build_parser() -> argparse.ArgumentParser:
    from .._args import parser
    from .ppl import add_protocol_args

    ap = parser("qgemv-ppl-check", __doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, help="reference model: HF directory, .gguf, or 'default'")
    ap.add_argument("--quantized", required=True, nargs="+", help="qgemv checkpoint directory (or several)")
    ap.add_argument("--max-ppl-increase", type=_threshold("--max-ppl-increase", pct=True), default=2.0,
                    help="percent, >= 0 (default 2%%)")
    ap.add_argument("--max-kl", type=_threshold("--max-kl"), default=0.05, help="nats per token, >= 0 (default 0.05)")
    ap.add_argument("--min-top1", type=_threshold("--min-top1", hi=100.0, pct=True), default=95.0,
                    help="percent, 0..100 (default 95%%)")
    ap.add_argument("--out", default=None, help="optional report path prefix")
    add_protocol_args(ap)
    return ap


class _BadInput(Exception):
    pass


def _prepare(args):
    """Everything that can be checked before a model is loaded; returns (reference path, text, proto)."""
    from qgemv import checkpoint
    from qgemv.text import load_text

    from .ppl import prepare_windows, protocol_from

    for q in args.quantized:
        if not os.path.isdir(q) or not os.path.exists(os.path.join(q, "config.json")):
            raise _BadInput(f"{q}: not a checkpoint directory (no config.json)")
        if not checkpoint.is_qgemv_checkpoint(q):
            raise _BadInput(f"{q}: config.json has no qgemv quantization_config")
    proto = protocol_from(args)
    text = load_text(args.text, "eval")
    ref_path = checkpoint.resolve_model(args.reference)
    checkpoint.check_float_model(ref_path)
    for path in [ref_path] + list(args.quantized):
        n = checkpoint.max_positions(path)
        if n is not None and args.ctx > n:
            raise _BadInput(f"--ctx {args.ctx} exceeds the {n} positions of {path}")
    ref_vocab = _vocab_size(ref_path)
    for q in args.quantized:
        v = _vocab_size(q)
        if ref_vocab is not None and v is not None and v != ref_vocab:
            raise _BadInput(f"{q} has a vocabulary of {v} tokens, the reference {ref_path} {ref_vocab}: they were "
                            f"not made from the same model, so their token probabilities cannot be compared")
    tok = checkpoint.load_tokenizer(ref_path)
    windows = prepare_windows(tok, proto, text)  # raises for a text too short for the protocol
    return ref_path, windows, proto


def _vocab_size(path):
    """config.json's vocab_size of a model directory (None where it does not say)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    v = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size")) if isinstance(cfg, dict) else None
    return v if isinstance(v, int) else None


def main(argv=None) -> int:
    from qgemv.checkpoint import CheckpointError
    from qgemv.text import TextError

    from .ppl import evaluate, load_models, table, write_report

    args = build_parser().parse_args(argv)
    try:
        ref_path, windows, proto = _prepare(args)
        models, tok = load_models(ref_path, args.quantized, args.device)
        report = evaluate(models, tok, proto, batch=args.batch, device=args.device, progress=False, windows=windows)
    except (_BadInput, TextError, CheckpointError, FileNotFoundError, ValueError, OSError) as e:
        print(f"qgemv-ppl-check: {e}", file=sys.stderr)
        return 2
    except Exception:  # exit 1 means "a threshold failed" and nothing else
        traceback.print_exc()
        print("qgemv-ppl-check: internal error (exit 2, not a threshold failure)", file=sys.stderr)
        return 2
    if args.out:
        write_report(report, args.out)
    print(table(report))
    failed = False
    for r in report["results"][1:]:
        fails = check(r, args.max_ppl_increase, args.max_kl, args.min_top1)
        print(f"{'FAIL' if fails else 'pass'}: {r['name']}  {noise_note(r, args.max_ppl_increase)}")
        for f in fails:
            print(f"  {f}")
        failed |= bool(fails)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
