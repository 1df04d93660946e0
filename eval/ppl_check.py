"""Perplexity regression check for anyone's CI.

    qgemv-ppl-check --reference MODEL --quantized QDIR [--max-ppl-increase 2%] [--max-kl 0.05] [--min-top1 95%]

Exit status: 0 when every threshold holds, 1 when any fails (each failure is
printed with its margin), 2 for bad arguments or missing / unreadable files.
The evaluation protocol is eval/ppl.py's and is printed with the result.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pct(v: str) -> float:
    try:
        return float(v.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage like 2% or 2, got {v!r}")


def check(result: dict, max_ppl_increase: float, max_kl: float, min_top1: float) -> list:
    """Failed thresholds of one quantized result, as human-readable lines."""
    fails = []
    d = result["delta_ppl_pct"]
    if d > max_ppl_increase:
        fails.append(f"ppl increase {d:+.3f}% > allowed {max_ppl_increase:.3f}% (by {d - max_ppl_increase:.3f} points)")
    if result["kl"] > max_kl:
        fails.append(f"KL {result['kl']:.5f} > allowed {max_kl:.5f} (by {result['kl'] - max_kl:.5f})")
    if result["top1_pct"] < min_top1:
        fails.append(f"top-1 agreement {result['top1_pct']:.2f}% < required {min_top1:.2f}% "
                     f"(short by {min_top1 - result['top1_pct']:.2f} points)")
    return fails


def main(argv=None) -> int:
    from eval.ppl import add_protocol_args, evaluate, load_models, protocol_from, table, write_report

    ap = argparse.ArgumentParser(prog="qgemv-ppl-check", description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, help="reference model: HF directory, .gguf, or 'default'")
    ap.add_argument("--quantized", required=True, nargs="+", help="qgemv checkpoint directory (or several)")
    ap.add_argument("--max-ppl-increase", type=_pct, default=2.0, help="percent (default 2%%)")
    ap.add_argument("--max-kl", type=float, default=0.05, help="nats per token (default 0.05)")
    ap.add_argument("--min-top1", type=_pct, default=95.0, help="percent (default 95%%)")
    ap.add_argument("--out", default=None, help="optional report path prefix")
    add_protocol_args(ap)
    args = ap.parse_args(argv)
    for q in args.quantized:
        if not os.path.isdir(q) or not os.path.exists(os.path.join(q, "config.json")):
            print(f"qgemv-ppl-check: {q}: not a checkpoint directory (no config.json)", file=sys.stderr)
            return 2
    try:
        models, tok = load_models(args.reference, args.quantized, args.device)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"qgemv-ppl-check: {e}", file=sys.stderr)
        return 2
    report = evaluate(models, tok, protocol_from(args), batch=args.batch, device=args.device, progress=False)
    if args.out:
        write_report(report, args.out)
    print(table(report))
    failed = False
    for r in report["results"][1:]:
        fails = check(r, args.max_ppl_increase, args.max_kl, args.min_top1)
        status = "FAIL" if fails else "pass"
        print(f"{status}: {r['name']}")
        for f in fails:
            print(f"  {f}")
        failed |= bool(fails)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
