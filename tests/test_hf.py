"""transformers integration (qgemv.hf): from_pretrained of a qgemv checkpoint gives load_quantized's model."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import qgemv
import qgemv.hf
from qgemv import checkpoint, formats
from qgemv.calibration.quantize import quantize_causal_lm

from conftest import load_tiny

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[(8, None, True), (4, 32, False)], ids=["int8", "int4g32a"])
def qdir(request, tiny_llama_dir, tmp_path_factory):
    bits, group, sym = request.param
    model, tok = load_tiny(tiny_llama_dir)
    cfg = formats.QuantConfig(bits, group, sym)
    rep = quantize_causal_lm(model, cfg, "rtn", progress=False)
    out = tmp_path_factory.mktemp("hf") / "q"
    checkpoint.save_quantized(model, tok, str(out), checkpoint.quantization_config(model, "rtn", None, cfg,
                                                                                   list(rep.skipped)))
    return str(out)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_from_pretrained_equals_load_quantized(qdir):
    assert qgemv.hf.register()
    ids = torch.randint(0, 300, (2, 16))
    ref, _ = checkpoint.load_quantized(qdir, dtype=torch.float32)
    got = transformers.AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32)
    names = [n for n, m in got.named_modules() if isinstance(m, qgemv.QuantLinear)]
    assert names == [n for n, m in ref.named_modules() if isinstance(m, qgemv.QuantLinear)] and names
    assert torch.equal(logits(ref, ids), logits(got, ids))
    assert got.hf_quantizer.is_compileable and not got.hf_quantizer.is_serializable()


@pytest.mark.parametrize("first", ["qgemv", "qgemv.hf"])
def test_import_qgemv_leaves_transformers_alone_and_from_pretrained_still_works(qdir, tmp_path, first):
    """In a fresh process: import qgemv does not import transformers; from_pretrained then loads QuantLinears
    (also when qgemv.hf, which imports transformers, is imported first); the model pickles; save_pretrained is
    refused with a logged pointer to save_quantized."""
    import subprocess
    import sys

    code = (
        "import pickle, sys\n"
        f"import {first}\n"
        "import qgemv\n"
        f"assert {first == 'qgemv.hf'} or 'transformers' not in sys.modules, 'import qgemv imported transformers'\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({qdir!r})\n"
        "assert isinstance(m.model.layers[0].mlp.down_proj, qgemv.QuantLinear)\n"
        "m2 = pickle.loads(pickle.dumps(m))\n"
        "assert type(m2.config.quantization_config).__name__ == 'QgemvConfig'\n"
        f"try:\n    m.save_pretrained({str(tmp_path / 'out')!r})\nexcept Exception as e:\n    print('refused:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused:" in r.stdout and "qgemv.checkpoint.save_quantized" in r.stderr


def test_from_pretrained_keeps_the_scales_float16(qdir):
    ref, _ = checkpoint.load_quantized(qdir, dtype=torch.bfloat16)
    got = transformers.AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.bfloat16)
    q = got.model.layers[0].self_attn.q_proj
    assert q.scales.dtype == torch.float16 and got.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(q.scales, ref.model.layers[0].self_attn.q_proj.scales)
    assert got.to(torch.float32).model.layers[0].self_attn.q_proj.scales.dtype == torch.float16


def test_the_engine_runs_a_from_pretrained_model(qdir):
    ref, tok = checkpoint.load_quantized(qdir, dtype=torch.float32)
    got = transformers.AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32)
    a = qgemv.generate(ref, tok, ["the history of the"], max_new_tokens=8)
    b = qgemv.generate(got, tok, ["the history of the"], max_new_tokens=8)
    assert a.tokens == b.tokens


def test_from_pretrained_refuses_a_missing_tensor(qdir, tmp_path):
    """transformers would load a missing tensor as zeros; the quantizer refuses the checkpoint first."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(qdir, bad)
    f = bad / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as h:
        meta = h.metadata()
    state = load_file(str(f))
    del state["model.layers.1.mlp.down_proj.scales"]
    save_file(state, str(f), metadata=meta)
    with pytest.raises(checkpoint.CheckpointError, match="model.layers.1.mlp.down_proj.scales is missing"):
        transformers.AutoModelForCausalLM.from_pretrained(str(bad), dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_from_pretrained_on_cuda_generates_load_quantizeds_tokens(qdir):
    """device_map="cuda", float16: the engine (CUDA kernels, graphs) on the from_pretrained model gives the
    tokens it gives on load_quantized's (same tensors, same kernels: exactly the same computation)."""
    ref, tok = checkpoint.load_quantized(qdir, device="cuda", dtype=torch.float16)
    got = transformers.AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float16, device_map="cuda")
    assert got.model.layers[0].mlp.down_proj.qweight.is_cuda
    a = qgemv.generate(ref, tok, ["the history of the", "a"], max_new_tokens=12)
    b = qgemv.generate(got, tok, ["the history of the", "a"], max_new_tokens=12)
    assert a.tokens == b.tokens and b.graphs


def test_a_fused_checkpoint_round_trips(tiny_llama_dir, tmp_path):
    """q/k/v and gate/up written as one packed weight each (format 3, quantization_config 'fused') load
    as FusedQuantLinears through load_quantized and from_pretrained, with the in-memory model's logits."""
    model, tok = load_tiny(tiny_llama_dir)
    cfg = formats.QuantConfig(4, 32, False)
    rep = quantize_causal_lm(model, cfg, "rtn", progress=False)
    assert qgemv.nn.fuse_llama_projections(model) == 4
    out = tmp_path / "fused"
    qc = checkpoint.quantization_config(model, "rtn", None, cfg, list(rep.skipped))
    assert qc["fused"]["model.layers.1.mlp.gate_up"] == ["gate_proj", "up_proj"]
    checkpoint.save_quantized(model, tok, str(out), qc)
    ids = torch.randint(0, 300, (2, 14))
    want = logits(model, ids)
    loaded, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for m in (loaded, hf):
        attn = m.model.layers[0].self_attn
        assert isinstance(attn.qkv, qgemv.nn.FusedQuantLinear) and isinstance(attn.k_proj, qgemv.nn.FusedSlice)
        assert torch.equal(logits(m, ids), want)
    engine = qgemv.Engine(hf, tok)
    assert engine.layers[1].gate_up.fused is hf.model.layers[1].mlp.gate_up.fused


def test_a_fused_entry_must_name_the_members_qgemv_fuses(tiny_llama_dir, tmp_path):
    import json

    model, tok = load_tiny(tiny_llama_dir)
    cfg = formats.QuantConfig(8)
    rep = quantize_causal_lm(model, cfg, "rtn", progress=False)
    qgemv.nn.fuse_llama_projections(model)
    out = tmp_path / "f"
    checkpoint.save_quantized(model, tok, str(out), checkpoint.quantization_config(model, "rtn", None, cfg,
                                                                                   list(rep.skipped)))
    c = json.loads((out / "config.json").read_text())
    c["quantization_config"]["fused"]["model.layers.0.self_attn.qkv"] = ["q_proj", "v_proj"]
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(checkpoint.CheckpointError, match=r"fused\['model.layers.0.self_attn.qkv'\]"):
        checkpoint.load_quantized(str(out))
