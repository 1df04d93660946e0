"""qgemv-generate: text from a checkpoint or a float model with qgemv's engine (:class:`qgemv.Engine`).

``load_for_generation`` resolves what the command line names (a qgemv / GPTQ /
AWQ / compressed-tensors checkpoint, a float model quantized by RTN with
``--bits``, or ``default``); ``main`` parses the arguments, streams one
prompt's text as it grows, and exits 2 on bad input.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from .engine import Engine, check_stop, printable_prefix

def load_for_generation(spec: str, device: str, dtype: torch.dtype, bits: Optional[int] = None,
                        group_size: Optional[int] = None, asym: bool = False):
    """(model, tokenizer, what) for a qgemv / GPTQ / AWQ / compressed-tensors checkpoint, a float model
    (quantized by RTN when ``bits``), or ``default``."""
    from . import checkpoint, importers

    foreign = importers.detect(spec)
    if checkpoint.is_qgemv_checkpoint(spec) or foreign:
        if bits is not None:
            raise ValueError(f"{spec} is a quantized checkpoint (drop --bits)")
        model, tok = checkpoint.load_quantized(spec, device=device, dtype=dtype)
        return model, tok, f"{foreign or 'qgemv'} checkpoint {spec}"
    path = checkpoint.resolve_model(spec)
    model, tok = checkpoint.load_float_model(path, dtype=dtype, device=device)
    if bits is None:
        return model, tok, f"{spec} ({str(dtype).replace('torch.', '')})"
    from .nn import quantize_model

    report = quantize_model(model, bits=bits, group_size=group_size, symmetric=not asym)
    g = f" g{group_size}" if group_size else ""
    return model, tok, f"{spec} quantized by RTN to int{bits}{g}{' asym' if asym else ''} ({len(report.converted)} linears)"


def main(argv=None) -> int:
    from ._args import device_arg, int_at_least, parser

    ap = parser(
        "qgemv-generate",
        description="Generate text with qgemv's engine (static KV cache, CUDA-graph decode, qgemv kernels).")
    ap.add_argument("model", help="a qgemv, GPTQ, AWQ or compressed-tensors checkpoint, a Hugging Face directory "
                                  "or .gguf file, or 'default'")
    ap.add_argument("--prompt", action="append", required=True,
                    help="a prompt; repeat for a batch (prompts may differ in length)")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--top-k", type=int_at_least(0), default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="a stop string; repeatable")
    ap.add_argument("--bits", type=int, choices=(4, 8), help="quantize a float model by RTN first")
    ap.add_argument("--group-size", type=int, choices=(32, 64, 128))
    ap.add_argument("--asym", action="store_true", help="int4 with zero points (with --group-size)")
    ap.add_argument("--device", type=device_arg, default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                    help="activations (default: float16 on CUDA, float32 on CPU)")
    ap.add_argument("--max-seq-len", type=int_at_least(2), default=None, help="cache slots (prompt + new tokens; default: the model's positions, at most 4096)")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graph)")
    ap.add_argument("--megakernel", choices=("auto", "on", "off"), default="auto",
                    help="batch-1 decode steps as one persistent launch (float16 or bfloat16 activations; "
                         "int4, int8 or 16-bit weights; compute capability 9.x). "
                         "auto (default): wherever allowed; on: a refusal prints its one-line reason; off: never")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("float16" if device.startswith("cuda") else "float32"))
    if args.group_size and args.bits != 4:
        ap.error("--group-size needs --bits 4")
    if args.asym and not args.group_size:
        ap.error("--asym needs --group-size")
    if not (args.temperature >= 0 and 0 < args.top_p <= 1):
        ap.error(f"need --temperature >= 0 and 0 < --top-p <= 1, got {args.temperature} and {args.top_p}")
    for i, p in enumerate(args.prompt):
        if not p.strip():
            ap.error(f"--prompt {i + 1} is empty")
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as lone surrogates
            ap.error(f"--prompt {i + 1} is not valid UTF-8 text")
    try:
        check_stop(args.stop)
    except ValueError as e:
        ap.error(f"--stop: {e}")
    try:
        model, tok, what = load_for_generation(args.model, device, dtype, args.bits, args.group_size, args.asym)
        engine = Engine(model, tok, max_seq_len=args.max_seq_len, cuda_graphs=not args.no_graphs,
                        megakernel={"auto": None, "on": True, "off": False}[args.megakernel])
    except (FileNotFoundError, ValueError) as e:  # CheckpointError and UnsupportedModelError are ValueErrors
        print(f"qgemv-generate: {e}", file=sys.stderr)
        return 2
    print(f"# {what} on {device}", file=sys.stderr)
    single = len(args.prompt) == 1
    streamed, shown = [], [""]

    def on_token(_i, t):  # one prompt: print the text as it grows, never a stop string or what follows it
        streamed.append(t)
        text = tok.decode(streamed, skip_special_tokens=True)
        text = text[:printable_prefix(text, args.stop)]
        if len(text) > len(shown[0]) and text.startswith(shown[0]):
            print(text[len(shown[0]):], end="", flush=True)
            shown[0] = text

    try:
        out = engine.generate(args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                              args.seed, args.stop, on_token=on_token if single else None)
    except ValueError as e:
        print(f"qgemv-generate: {e}", file=sys.stderr)
        return 2
    if single:
        final = out.texts[0]  # the held-back tail (cut at a stop string)
        print(final[len(shown[0]):] if final.startswith(shown[0]) else "", flush=True)
    else:
        for i, (p, t) in enumerate(zip(args.prompt, out.texts)):
            print(f"[{i}] {p}{t}")
    print(f"# {out.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
