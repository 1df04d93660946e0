"""Generation benchmark: qgemv's engine (qgemv.engine) on random weights of real shapes, against transformers.

    python -m qgemv.eval.bench_generate --out runs/bench_generate
    python -m qgemv.eval.bench_generate --models llama2-7b --batches 1 --variants fp16,int4g128a --no-hf

Models (transformers LlamaForCausalLM, random weights, on the GPU):
  llama2-7b : 32 layers, hidden 4096, 32 heads (MHA), FFN 11008, vocab 32000;
  llama3-8b : 32 layers, hidden 4096, 32 heads, 8 KV heads (GQA), FFN 14336, vocab 128256;
  llama3-70b: 80 layers, hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256 (built quantized a
              layer at a time: int4 / int8 variants only, without act-order).
Variants: fp16 and bf16 (nn.Linear, cuBLAS), int8, int4 per channel, int4 g128
with zero points (the GPTQ / AWQ format); every linear but lm_head converted
by RTN; q/k/v and gate/up fused by the engine in every variant.  ``int4_mk``,
``int4g128a_mk``, ``int8_mk`` and ``fp16_mk``: the same weights with
``Engine(megakernel=True)``, each batch-1 decode step's decoder layers as one
persistent launch.  ``int4g128a_bf16`` / ``int4g128a_bf16_mk`` / ``bf16_mk``:
the model in bfloat16 (its activations; the launch stages int4 inputs as
fp16 of x 2^e).

For each (model, variant, batch): B prompts of --prompt random tokens, then
--gen new tokens greedily (EOS ignored), after one untimed warm-up that
compiles the glue and captures the batch size's CUDA graph.  Reported:
prefill tok/s, decode ms/step and tok/s (all sequences), and the weight
floor: weight bytes (all linears, lm_head included) / the read ceiling
measured in this run, as a share of the step, and the step floor (issue
35's): the weights plus the K / V a step must read at the run's mean
context.  At batch 1 (or the sizes in --breakdown-batches) the step's GPU
time is also split by kernel kind
(torch.profiler over eager steps of the same kernels): qgemv GEMVs, cuBLAS,
attention, the rest; the graph's time past their sum is gaps.

Against, in the same run (llama2-7b, batch 1, fp16): transformers'
``generate()`` eager with its dynamic cache, and its static cache with
``torch.compile(mode="reduce-overhead")`` (the error is reported if it fails);
and ``bench_decode``'s fp16 and int4 g128 steps (--decode-ref).
Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import sys
import time

import torch

import qgemv
from qgemv.engine import Engine

from .bench_decode import kernel_breakdown, weight_bytes
from .bench_gemv import Timer, command_line, gemv_gather_off, read_ceiling

MODELS = {
    "llama2-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000),
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, rope_theta=500000.0),
    "llama3-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=512),  # for the CPU test of this script
}
# models whose float weights exceed the GPU: built and quantized a decoder layer at a time (build_streamed)
STREAMED = {"llama3-70b"}
VARIANTS = {"fp16": None, "bf16": None, "int8": (8, None, True), "int4": (4, None, True),
            "int4g128a": (4, 128, False), "int4g128a_act": (4, 128, False), "int4g128a_act_sep": (4, 128, False),
            "int4g128a_act_first": (4, 128, False), "int4_mk": (4, None, True), "int4g128a_mk": (4, 128, False),
            "int8_mk": (8, None, True), "fp16_mk": None,
            "bf16_mk": None, "int4g128a_bf16": (4, 128, False), "int4g128a_bf16_mk": (4, 128, False),
            "int4g128a_sdpa": (4, 128, False), "int4g128a_da2": (4, 128, False), "int4g128a_da3": (4, 128, False),
            "int4g128a_da4": (4, 128, False), "int4g128a_norope": (4, 128, False), "int4g128a_nopdl": (4, 128, False),
            "int4g128a_pdlg": (4, 128, False), "int4g128a_pdl5": (4, 128, False), "int4g128a_mk_f0": (4, 128, False),
            **{f"{b}_mk_p{s}{n}": spec for b, spec in (("int4g128a", (4, 128, False)), ("int4", (4, None, True)),
                                                       ("int8", (8, None, True)), ("fp16", None))
               for n in (0, 4, 8, 16, 24, 32) for s in ("", "m") if n or not s}}
# int4g128a_sdpa: the per-op decode step's attention through SDPA over the whole cache (engine.decode_attention
# off), the path before qgemv.ops.decode_attention
# int4g128a_da2 / _da3 / _da4: decode_attention with 2 / 3 / 4 K-V tiles a block forced, not its rule's count
# (testing.set_decode_attention_stages; dev/decode_attn_probe.py --stages times one layer's call)
# int4g128a_norope: each layer's q / k norms, rotation and cache write in the glue's kernel before decode_attention
# (Engine.rope_attention off), not inside the attention kernel (qgemv.ops.rope_decode_attention)
# int4g128a_nopdl: the per-op step as ordinary launches (Engine.pdl off; on by default: the GEMVs, decode_attention
# and the compiled glue as programmatic dependent launches); int4g128a_pdlg: the compiled glue's kernels only
# (the GEMVs' and decode_attention's set_gemv_pdl mode 0); int4g128a_pdl5: their mode 5 (no L2 prefetch before
# the wait) in place of 7
# *_mk: the same weights with Engine(megakernel=True): each batch-1 decode step as one persistent launch
# (qgemv.persist, issue 35); other batches run per-op.  *_mk_f0: the launch's attention a warp a cache position
# everywhere (testing.set_chain_attention_form(0), the form before 2026-12-07) in place of its rule (an octet of
# lanes a position where a kv head has 4 query heads or more and a unit 128 positions or more)
# *_mk_pN / *_mk_pmN: each warp of the launch asks L2 for its walk's next N tiles past its ring at every layer's
# attention, before the block's units (pN) or after them (pmN): testing.set_chain_attention_prefetch(N / -N) in
# place of its rule (persist.h: 16 after the units where a kv head has one query head, else none); *_mk_p0: none
# int4g128a_act: int4 g128a with act-order input permutations as an imported GPTQ checkpoint has them after
# qgemv.importers (one random perm shared by q/k/v, one by o, one by gate/up; down_proj's folded into gate/up's
# rows); the engine gathers q/k/v's and gate/up's inputs inside its RMSNorm glue, and o_proj's GEMV gathers its
# own.  int4g128a_act_sep: every projection's GEMV gathers its own input (none in the norm).
# int4g128a_act_first: as int4g128a_act, with o_proj's input gathered by its own kernel first
# (qgemv._C.testing.set_gemv_gather(False)), the path before the GEMV gathered.


def build_model(name: str, layers: int = 0, device: str = "cuda"):
    """A random-weight LlamaForCausalLM of the named shapes in fp16 (transformers' initialization, seeded)."""
    import transformers

    kw = dict(MODELS[name])
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = transformers.LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **kw)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_streamed(name: str, variant: str, layers: int = 0, device: str = "cuda"):
    """A random-weight LlamaForCausalLM of the named shapes in ``variant``'s format, built a decoder layer at a
    time: each layer's float weights are drawn on ``device`` (N(0, initializer_range), norms 1, seeded), its
    q/k/v and gate/up quantized into one fused weight each (qgemv.nn.fuse_llama_projections: the engine uses
    them without a copy) and its other linears by quantize_model, before the next layer is drawn.  So a model
    whose fp16 weights do not fit the GPU fits once quantized (llama3-70b int4 g128: ~40 GB).  Variants that
    need the whole float model (fp16 / bf16 weights, the act-order ones) are refused."""
    import transformers

    from qgemv.nn import fuse_llama_projections

    q = VARIANTS[variant]
    if q is None or "_act" in variant:
        raise SystemExit(f"bench_generate: {name} is built quantized a layer at a time; variant {variant} needs "
                         f"the float model (choose an int4 / int8 variant without act-order)")
    bits, group, sym = q
    kw = dict(MODELS[name])
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = transformers.LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **kw)
    dt = torch.bfloat16 if "_bf16" in variant else torch.float16
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg).eval()
        rotary = type(model.model.rotary_emb)(cfg).to(device)  # (its inv_freq is computed, not a weight)
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator(device=device).manual_seed(0)

    def draw(mod):  # mod's own tensors onto the device: weights N(0, std), norm gains 1, biases 0
        mod.to_empty(device=device, recurse=False)
        for pname, t in mod.named_parameters(recurse=False):
            with torch.no_grad():
                if pname == "weight" and t.dim() == 2:
                    t.normal_(0.0, cfg.initializer_range, generator=gen)
                else:
                    t.fill_(1.0 if pname == "weight" else 0.0)

    for mod in (model.model.embed_tokens, model.model.norm, model.lm_head):
        draw(mod)
    model.model.rotary_emb = rotary
    for layer in model.model.layers:
        for mod in layer.modules():
            draw(mod)
        fuse_llama_projections(layer, bits=bits, group_size=group, symmetric=sym)
        qgemv.quantize_model(layer, bits=bits, group_size=group, symmetric=sym)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prepare(model, variant: str):
    q = VARIANTS[variant]
    if variant.split("_")[0] == "bf16" or "_bf16" in variant:  # bf16 activations (and bf16 weights unquantized)
        model = model.to(torch.bfloat16)
    if q is not None:
        bits, group, sym = q
        qgemv.quantize_model(model, bits=bits, group_size=group, symmetric=sym)
    if variant.startswith("int4g128a_act"):
        g = torch.Generator().manual_seed(1)
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            for group_of in ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj]):
                perm = torch.randperm(group_of[0].in_features, generator=g).to(group_of[0].qweight.device)
                for lin in group_of:
                    lin.perm = perm
    return model


def kv_bytes_per_step(engine, batch: int, context: float) -> float:
    """Bytes of K and V a decode step must read at least: every layer's keys and values of `context` positions
    for each of `batch` sequences, in the cache's dtype.  The timed steps of a run with P prompt and G new
    tokens read P + 1 .. P + G - 1 positions each: their mean is P + G / 2."""
    itemsize = torch.empty(0, dtype=engine.dtype).element_size()
    return 2.0 * len(engine.layers) * engine.kv_heads * engine.head_dim * itemsize * context * batch


@contextlib.contextmanager
def testing_knob(name: str, value: int | None):
    """qgemv._C.testing's set_<name>(value) inside the with block, the value <name>() had before after it (e.g.
    set_decode_attention_stages: K / V tiles a decode_attention block)."""
    mod = qgemv._ext.MODULE
    if mod is None:
        raise SystemExit(f"needs the compiled extension: {qgemv._ext.REASON}")
    before = getattr(mod.testing, name)()
    getattr(mod.testing, "set_" + name)(value)
    try:
        yield
    finally:
        getattr(mod.testing, "set_" + name)(before)


MK_VARIANT = re.compile(r"_mk(_f0|_pm?\d+)?$")  # the variants that decode through the launch


def mk_prefetch(variant: str) -> int | None:
    """The launch's attention prefetch a variant forces: N of *_mk_pN, -N of *_mk_pmN, else None (the rule)."""
    m = re.search(r"_mk_p(m?)(\d+)$", variant)
    return None if m is None else (-1 if m.group(1) else 1) * int(m.group(2))


def run_engine(model, mname, variant, batches, prompt, gen, read_gbps, breakdown) -> list:
    """One engine's rows, a row a batch size; breakdown: the batch sizes whose step is also profiled."""
    ctx = (gemv_gather_off() if variant == "int4g128a_act_first"
           else testing_knob("decode_attention_stages", int(variant[-1])) if variant[:-1].endswith("_da")
           else testing_knob("chain_attention_form", 0) if variant.endswith("_mk_f0")
           else testing_knob("chain_attention_prefetch", mk_prefetch(variant)) if mk_prefetch(variant) is not None
           else contextlib.nullcontext())
    with ctx:
        return _run_engine(model, mname, variant, batches, prompt, gen, read_gbps, breakdown)


def _run_engine(model, mname, variant, batches, prompt, gen, read_gbps, breakdown) -> list:
    rows = []
    wb = weight_bytes(model)
    engine = Engine(model, max_seq_len=prompt + gen + 8, megakernel=MK_VARIANT.search(variant) is not None)
    if variant.endswith("_sdpa"):
        engine.decode_attention = False
    if variant.endswith("_norope"):
        engine.rope_attention = False
    if variant.endswith("_nopdl"):
        engine.pdl = False
    elif variant.endswith(("_pdlg", "_pdl5")):
        engine._pdl_mode = 0 if variant.endswith("_pdlg") else 5
    if variant == "int4g128a_act_sep":  # the projections gather their own inputs
        for L in engine.layers:
            L.qkv.perm = L.gate_up.perm = None
    engine.eos_ids = set()
    vocab = model.config.vocab_size
    for b in batches:
        ids = torch.randint(0, vocab, (b, prompt), generator=torch.Generator().manual_seed(b)).tolist()
        engine.generate(ids, max_new_tokens=3)  # compile the glue, capture this batch size's graph
        out = engine.generate(ids, max_new_tokens=gen)
        ms = out.ms_per_step
        floor_ms = wb / (read_gbps * 1e9) * 1e3
        kv = kv_bytes_per_step(engine, b, prompt + gen / 2)
        row = dict(model=mname, variant=variant, batch=b, prompt=prompt, gen=gen,
                   prefill_tokens_per_s=out.prefill_tokens_per_s, ms_per_step=ms,
                   decode_tokens_per_s=out.decode_tokens_per_s, weight_MB=wb / 1e6, floor_share=floor_ms / ms,
                   kv_MB=kv / 1e6, step_floor_share=(wb + kv) / (read_gbps * 1e9) * 1e3 / ms,
                   graphs=out.graphs, compiled_glue=engine.compile_glue,
                   megakernel=engine.megakernel and b == 1, megakernel_off=engine.megakernel_reason,
                   decode_attention=engine.decode_attention,
                   pdl=engine.pdl)
        if b in breakdown:
            dev = engine.device
            tok = torch.ones(b, 1, dtype=torch.long, device=dev)
            slot = torch.tensor([prompt], device=dev)
            pad = torch.zeros(b, dtype=torch.long, device=dev)
            step = engine.forward
            kinds, kernels = kernel_breakdown(lambda: step(tok, slot, pad), per_kernel=True)
            row["kernel_us_per_step"] = kinds
            row["kernels_per_step"] = kernels  # name -> [launches per step, us per step], the 25 costliest
            row["launches_per_step"] = sum(n for n, _ in kernels.values())
            row["gaps_us_per_step"] = ms * 1e3 - sum(kinds.values())
        rows.append(row)
        print(f"{mname:9s} {variant:9s} b={b:<2d} prefill {row['prefill_tokens_per_s']:8.0f} tok/s  "
              f"decode {ms:6.3f} ms/step {row['decode_tokens_per_s']:8.1f} tok/s  floor {100 * row['floor_share']:4.1f}%"
              f" (with the KV cache {100 * row['step_floor_share']:4.1f}%)"
              + ("  kernels(us): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["kernel_us_per_step"].items(),
                                                                               key=lambda kv: -kv[1]))
                 + f", gaps {row['gaps_us_per_step']:.0f}; {row['launches_per_step']} kernels (top 25)"
                 if "kernel_us_per_step" in row else ""), flush=True)
    del engine
    return rows


def hf_baselines(model, prompt: int, gen: int) -> dict:
    """transformers generate() on the fp16 model, batch 1: eager (dynamic cache), then static cache + compile."""
    out = {}
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device="cuda")

    def timed(n, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.no_grad():
        timed(2)
        t1, tn = timed(1), timed(gen + 1)
        out["hf_eager_fp16"] = dict(ms_per_step=1e3 * (tn - t1) / gen, tokens_per_s=gen / (tn - t1))
        try:
            fwd = model.forward
            model.forward = torch.compile(fwd, mode="reduce-overhead", fullgraph=True)
            kw = dict(cache_implementation="static")
            timed(4, **kw)
            t1, tn = timed(1, **kw), timed(gen + 1, **kw)
            out["hf_static_compiled_fp16"] = dict(ms_per_step=1e3 * (tn - t1) / gen, tokens_per_s=gen / (tn - t1))
        except Exception as e:  # reported, not fatal: the point of the comparison
            out["hf_static_compiled_fp16"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            model.forward = fwd
    for k, v in out.items():
        print(f"{k}: {v}", flush=True)
    return out


def write_outputs(result: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    rows = result["rows"]
    lines = [f"{result['date']}, {result['gpu']}, torch {result['torch']}, `{result['command']}`", "",
             "| model | variant | batch | prefill tok/s | decode ms/step | decode tok/s | × fp16 | weight floor | "
             "step floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {(r["model"], r["batch"]): r["ms_per_step"] for r in rows if r["variant"] == "fp16"}
    for r in rows:
        x = base.get((r["model"], r["batch"]), float("nan")) / r["ms_per_step"]
        lines.append(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['prefill_tokens_per_s']:.0f} | "
                     f"{r['ms_per_step']:.3f} | {r['decode_tokens_per_s']:.1f} | {x:.2f} | {100 * r['floor_share']:.0f}% | "
                     f"{100 * r['step_floor_share']:.0f}% |")
    for k, v in result.get("baselines", {}).items():
        if "error" in v:
            lines.append(f"\n{k}: " + v["error"].replace("\n", " "))
        elif "ms_per_step" in v:
            lines.append(f"\n{k}: {v['ms_per_step']:.3f} ms/step, {1e3 / v['ms_per_step']:.1f} tok/s (batch 1)")
        else:  # bench_decode: one entry per variant
            lines.append(f"\n{k}: " + ", ".join(f"{n} {r['ms_per_step']:.3f} ms/step" for n, r in v.items()))
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted({(r["model"], r["batch"]) for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    wdt = 0.8 / max(len(variants), 1)
    for j, v in enumerate(variants):
        ax.bar([i + j * wdt for i in range(len(keys))],
               [next((r["decode_tokens_per_s"] for r in rows if (r["model"], r["batch"]) == k and r["variant"] == v), 0)
                for k in keys], wdt, label=v)
    ax.set_xticks([i + 0.4 - wdt / 2 for i in range(len(keys))])
    ax.set_xticklabels([f"{m}\nbatch {b}" for m, b in keys], fontsize=8)
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"qgemv engine, {result['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama2-7b,llama3-8b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the real model (a quick look)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers generate() baselines")
    ap.add_argument("--decode-ref", action="store_true", help="also run bench_decode's 7b step at batch 1")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--breakdown-batches", default="1",
                    help="batch sizes whose step is profiled kernel by kernel (torch.profiler), e.g. 1,16")
    ap.add_argument("--out", default="runs/bench_generate")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_generate: no CUDA GPU; nothing to measure")
        return 0
    for v in args.variants.split(","):
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}; choose from {', '.join(VARIANTS)}")
    ceiling = read_ceiling(Timer())
    try:
        batches = [int(b) for b in args.batches.split(",")]
        breakdown = {int(b) for b in args.breakdown_batches.split(",")}
    except ValueError:
        ap.error(f"--batches / --breakdown-batches: comma-separated integers, got {args.batches!r} / "
                 f"{args.breakdown_batches!r}")
    rows, baselines = [], {}
    result = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  command=command_line("bench_generate", argv),
                  ceiling=ceiling, rows=rows, baselines=baselines)
    for mname in args.models.split(","):
        for variant in args.variants.split(","):
            model = (build_streamed(mname, variant, args.layers) if mname in STREAMED
                     else prepare(build_model(mname, args.layers), variant))
            rows += run_engine(model, mname, variant, batches, args.prompt, args.gen, ceiling["read_GBps"],
                               set() if args.no_breakdown else breakdown)
            if variant == "fp16" and mname == "llama2-7b" and not args.no_hf:
                baselines.update(hf_baselines(model, args.prompt, args.gen))
            del model
            torch.cuda.empty_cache()
            write_outputs(result, args.out)  # after every variant: a run cut short keeps what it measured
    if args.decode_ref:
        from . import bench_decode

        ref = bench_decode.run_model("7b", bench_decode.MODELS["7b"], [1], ceiling["read_GBps"], prompt=args.prompt,
                                     gen=args.gen)
        baselines["bench_decode_7b"] = {r["variant"]: dict(ms_per_step=r["ms_per_token"]) for r in ref}
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
