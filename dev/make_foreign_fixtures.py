"""Write tests/data/foreign/: tiny GPTQ and AWQ checkpoints packed by the producers' own code.

    pip download --no-deps auto-gptq==0.7.1 autoawq==0.2.9 -d /tmp/pkgs   (a wheel and an sdist)
    pip install --no-deps /tmp/pkgs/auto_gptq-0.7.1-*.whl; tar xzf /tmp/pkgs/autoawq-0.2.9.tar.gz -C /tmp/pkgs
    python dev/make_foreign_fixtures.py --awq-src /tmp/pkgs/autoawq-0.2.9
    python dev/make_foreign_fixtures.py --tp-only      (gptq_v1_actorder_tp, for tests/test_vllm.py)

Neither package imports under transformers 5 as a whole, so only their
packing modules are loaded: auto-gptq's ``qlinear_cuda_old.QuantLinear.pack``
(GPTQ v1: zero points stored minus one) by file path, and autoawq's
``WQLinear_GEMM.from_linear`` with its parent packages stubbed.  Each
directory holds config.json (a tiny Llama with the producer's
quantization_config), model.safetensors, and reference.safetensors: every
quantized linear's weight [out, in] as the producer itself dequantizes it
(auto-gptq's torch fallback in forward; autoawq's ``dequantize_gemm``), in
float16.  The act-order variant is packed by auto-gptq's ``qlinear_cuda``
(whose pack and dequantization follow ``g_idx``); the v2 variant is derived
from the v1 file the way GPTQModel converts it (each zero point + 1).  The tests (tests/test_importers.py) read them;
the files are small (about 500 KB in all), so they are committed.
"""

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "foreign"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def tiny_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False, torch_dtype="float16")


def load_file_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def qparams(w, bits, group, sym):
    """Round-to-nearest scales and integer zero points [N, ng] for w [N, K] (the producers take them as given)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    maxq = 2 ** bits - 1
    if sym:
        s = g.abs().amax(-1).clamp(min=1e-5) / ((maxq - 1) / 2)
        z = torch.full_like(s, (maxq + 1) / 2)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = (hi - lo).clamp(min=1e-5) / maxq
        z = torch.round(-lo / s).clamp(0, maxq)
    return s.half().float(), z


def write(name, model, quantized, qc, reference):
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.half().contiguous() for k, v in model.state_dict().items()
             if not any(k.startswith(f"model.layers.0.{m}.") for m in LINEARS)}
    state.update({k: v.contiguous() for k, v in quantized.items()})
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    if reference is not None:  # (a variant derived from another is checked against that one's reference)
        save_file({k: v.contiguous() for k, v in reference.items()}, str(d / "reference.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    print(name, sum(f.stat().st_size for f in d.iterdir()) // 1024, "KB")


def gptq_variants(model):
    gptq = load_file_module("qlinear_cuda_old", next(
        Path(importlib.util.find_spec("auto_gptq").submodule_search_locations[0]).glob(
            "nn_modules/qlinear/qlinear_cuda_old.py")))
    out = {}
    for name, bits, group, sym in (("gptq_v1_sym_g32", 4, 32, True), ("gptq_v1_asym_g32", 4, 32, False),
                                   ("gptq_v1_int8_channel", 8, -1, True), ("gptq_v1_asym_zero0", 4, 32, False)):
        quantized, reference = {}, {}
        torch.manual_seed(7)
        for m in LINEARS:
            lin = model.get_submodule(f"model.layers.0.{m}")
            k, n = lin.in_features, lin.out_features
            g = k if group == -1 else group
            s, z = qparams(lin.weight.data, bits, g, sym)
            if not sym and name != "gptq_v1_asym_zero0":
                z = z.clamp(min=1)  # a zero point of 0 breaks v1 storage: the asym_zero0 variant keeps one
            if name == "gptq_v1_asym_zero0":
                z[0, 0] = 0
            q = gptq.QuantLinear(bits, group, k, n, bias=False, use_cuda_fp16=False)
            q.pack(lin.float(), s, z, torch.arange(k, dtype=torch.int32) // g)
            q.g_idx = torch.arange(k, dtype=torch.int32) // g
            with torch.no_grad():  # the producer's own dequantization (torch fallback of forward)
                q.scales = q.scales.half()
                ref = q(torch.eye(k, dtype=torch.float16)).t()
            p = f"model.layers.0.{m}"
            quantized.update({f"{p}.qweight": q.qweight, f"{p}.qzeros": q.qzeros, f"{p}.scales": q.scales.half(),
                              f"{p}.g_idx": q.g_idx})
            reference[f"{p}.weight"] = ref.half()
        qc = dict(quant_method="gptq", bits=bits, group_size=group, sym=sym, desc_act=False,
                  checkpoint_format="gptq")
        out[name] = (quantized, qc, reference)
    return out


def gptq_actorder(model, bits=4, group=32):
    """Act-order (desc_act) asymmetric int4 g32, packed by auto-gptq's qlinear_cuda, whose pack and whose torch
    dequantization follow g_idx: column k belongs to group g_idx[k], ranked by a random "activation order"."""
    cuda = load_file_module("qlinear_cuda", next(
        Path(importlib.util.find_spec("auto_gptq").submodule_search_locations[0]).glob(
            "nn_modules/qlinear/qlinear_cuda.py")))
    quantized, reference = {}, {}
    g = torch.Generator().manual_seed(3)
    for m in LINEARS:
        lin = model.get_submodule(f"model.layers.0.{m}")
        k, n = lin.in_features, lin.out_features
        order = torch.randperm(k, generator=g)  # the quantization order of the columns
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group).to(torch.int32)
        w = lin.weight.data.float()
        wg = torch.stack([w[:, g_idx == i] for i in range(k // group)], 1)  # [N, ng, G], each group's columns
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo).clamp(min=1e-5) / (2 ** bits - 1)).half().float()
        z = torch.round(-lo / s).clamp(1, 2 ** bits - 1)
        q = cuda.QuantLinear(bits, group, k, n, bias=False)
        q.pack(lin.float(), s, z, g_idx)
        with torch.no_grad():
            q.scales = q.scales.half()
            ref = q(torch.eye(k, dtype=torch.float16)).t()
        p = f"model.layers.0.{m}"
        quantized.update({f"{p}.qweight": q.qweight, f"{p}.qzeros": q.qzeros, f"{p}.scales": q.scales.half(),
                          f"{p}.g_idx": q.g_idx.to(torch.int32)})
        reference[f"{p}.weight"] = ref.half()
    qc = dict(quant_method="gptq", bits=bits, group_size=group, sym=False, desc_act=True, checkpoint_format="gptq")
    return quantized, qc, reference


def v1_to_v2(qzeros, bits):
    """GPTQModel's conversion: every stored zero point + 1, nibble by nibble (no carries between them)."""
    per, mask = 32 // bits, (1 << bits) - 1
    w = qzeros.to(torch.int64) & 0xFFFFFFFF
    vals = [((w >> (bits * i)) & mask) for i in range(per)]
    out = torch.zeros_like(w)
    for i, v in enumerate(vals):
        out |= ((v + 1) & mask) << (bits * i)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def awq_variant(model, src):
    for pkg, sub in (("awq", "awq"), ("awq.utils", "awq/utils"), ("awq.modules", "awq/modules"),
                     ("awq.modules.linear", "awq/modules/linear")):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(Path(src) / sub)]
        sys.modules[pkg] = mod
    gemm = importlib.import_module("awq.modules.linear.gemm")
    packing = importlib.import_module("awq.utils.packing_utils")
    quantized, reference = {}, {}
    for m in LINEARS:
        lin = model.get_submodule(f"model.layers.0.{m}")
        s, z = qparams(lin.weight.data, 4, 32, False)
        q = gemm.WQLinear_GEMM.from_linear(lin.float(), 4, 32, scales=s.t().contiguous(), zeros=z.t().contiguous())
        ref = packing.dequantize_gemm(q.qweight, q.qzeros, q.scales, 4, 32)  # [K, N], the producer's own
        p = f"model.layers.0.{m}"
        quantized.update({f"{p}.qweight": q.qweight, f"{p}.qzeros": q.qzeros, f"{p}.scales": q.scales.half()})
        reference[f"{p}.weight"] = ref.t().half()
    qc = dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm")
    return quantized, qc, reference


def tp_config():
    """Large enough for two ranks (o_proj and down_proj split at 128 columns), weights varied enough (std 0.08)
    for greedy tokens that differ between prompts; vocabulary 320 covers tests/test_vllm.py's prompts."""
    import transformers

    return transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    tie_word_embeddings=False, initializer_range=0.08, bos_token_id=1,
                                    eos_token_id=2, torch_dtype="float16")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--awq-src", help="the unpacked autoawq-0.2.9 sdist (every fixture but --tp-only's)")
    ap.add_argument("--tp-only", action="store_true",
                    help="write only gptq_v1_actorder_tp (act-order g32 at two-rank shapes; needs auto-gptq only)")
    a = ap.parse_args()
    import transformers

    if a.tp_only:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(tp_config()).eval().half()
        quantized, qc, _ = gptq_actorder(model)
        write("gptq_v1_actorder_tp", model, quantized, qc, None)
        return
    if not a.awq_src:
        ap.error("--awq-src is required (or --tp-only)")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config()).eval().half()
    variants = gptq_variants(model)
    for name, (quantized, qc, reference) in variants.items():
        write(name, model, quantized, qc, None if name == "gptq_v1_asym_zero0" else reference)
    quantized, qc, reference = variants["gptq_v1_asym_g32"]
    v2 = {k: v1_to_v2(v, 4) if k.endswith(".qzeros") else v for k, v in quantized.items()}
    write("gptq_v2_asym_g32", model, v2, dict(qc, checkpoint_format="gptq_v2"), None)
    write("gptq_v1_actorder", model, *gptq_actorder(model))
    write("awq_gemm_g32", model, *awq_variant(model, a.awq_src))


if __name__ == "__main__":
    main()
