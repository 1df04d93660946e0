"""CPU decode benchmark: the engine on the embedded model (SmolLM2-135M) in float32 and in each qgemv format.

    python -m qgemv.eval.bench_cpu [--formats int8,int4,int4g128,int4g64a] [--new-tokens 32] [--out runs/bench_cpu]

For each variant: the float model loaded again, quantized by RTN (every
linear but lm_head; groups that do not divide K fall back as qgemv-quantize
does), one untimed warm-up generation, then the best of --repeats greedy
generations of --new-tokens tokens from one prompt.  Reported: decode tok/s
and its ratio to float32's in the same run (absolute times on a shared
machine are noise), and the extra memory of the CPU path's cached float32
weights.  Caveat: SmolLM2's GGUF stores its linears on a 4-bit g32 grid, so
this measures speed, not quality.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

FORMATS = {"int8": (8, None, True), "int4": (4, None, True), "int4g128": (4, 128, True), "int4g64a": (4, 64, False),
           "int4g32": (4, 32, True)}


def run(fmt, new_tokens: int, repeats: int, prompt: str) -> dict:
    import qgemv
    from qgemv import checkpoint

    model, tok = checkpoint.load_float_model(checkpoint.resolve_model("default"), dtype=torch.float32, device="cpu")
    model.generation_config.eos_token_id = None  # every run decodes the same number of steps
    extra = 0
    if fmt is not None:
        bits, group, sym = fmt
        qgemv.quantize_model(model, bits=bits, group_size=group, symmetric=sym)
    engine = qgemv.Engine(model, tok, max_seq_len=64 + new_tokens)
    engine.generate([prompt], max_new_tokens=4)  # warm-up (and, quantized, the cached float32 weights)
    if fmt is not None:
        extra = sum(m.cpu_weight_bytes for m in model.modules() if isinstance(m, qgemv.QuantLinear))
    best = None
    for _ in range(repeats):
        out = engine.generate([prompt], max_new_tokens=new_tokens)
        if best is None or out.decode_tokens_per_s > best.decode_tokens_per_s:
            best = out
    return {"decode_tok_s": best.decode_tokens_per_s, "steps": best.decode_steps, "cached_weight_mb": extra / 2**20,
            "text": best.texts[0]}


def main(argv=None) -> int:
    from qgemv._args import int_at_least, parser

    from .bench_gemv import command_line

    ap = parser("python -m qgemv.eval.bench_cpu", __doc__.split("\n")[0])
    ap.add_argument("--formats", default="int8,int4,int4g128,int4g64a", help=f"of {', '.join(FORMATS)}")
    ap.add_argument("--new-tokens", type=int_at_least(2), default=32)
    ap.add_argument("--repeats", type=int_at_least(1), default=3)
    ap.add_argument("--threads", type=int_at_least(1), default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="runs/bench_cpu", help="report path prefix (.json, .md)")
    args = ap.parse_args(argv)
    names = [f for f in args.formats.split(",") if f]
    bad = [f for f in names if f not in FORMATS]
    if bad:
        ap.error(f"--formats: unknown {bad}; known: {', '.join(FORMATS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = "The capital of France is"
    rows = {"float32": run(None, args.new_tokens, args.repeats, prompt)}
    for name in names:
        rows[name] = run(FORMATS[name], args.new_tokens, args.repeats, prompt)
    base = rows["float32"]["decode_tok_s"]
    lines = [f"# CPU decode, SmolLM2-135M, {datetime.date.today()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads",
             f"`{command_line('bench_cpu', argv)}`", "",
             "| variant | decode tok/s | × float32 | cached float32 weights (MB) |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / base:.2f} | "
                     f"{r['cached_weight_mb']:.0f} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command_line("bench_cpu", argv), "date": str(datetime.date.today()),
                   "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
