"""The layer-by-layer driver (calibration/quantize.py) and the qgemv-quantize CLI."""

import json
import shutil

import pytest
import torch

from qgemv import checkpoint
from qgemv import formats
from qgemv.nn import QuantLinear

from qgemv.calibration.data import calibration_samples
from qgemv.calibration.quantize import quantize_causal_lm

from conftest import load_tiny, requires_smollm2


def test_true_sequential_stages_follow_the_layer():
    from qgemv.calibration.quantize import _sequential_stages

    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "extra.proj"]
    assert _sequential_stages(names) == [names[:3], ["self_attn.o_proj"], names[4:6], ["mlp.down_proj"],
                                         ["extra.proj"]]


def test_true_sequential_changes_later_stages_only(tiny_llama_dir):
    # o_proj's Hessian comes from the quantized q/k/v in true-sequential mode,
    # so its codes change; q/k/v (the first stage) see the same inputs either way.
    out = {}
    for ts in (False, True):
        model, tok = load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=4, seq_len=64, seed=0)
        quantize_causal_lm(model, formats.QuantConfig(4, 32), "gptq", samples, progress=False, true_sequential=ts)
        attn = model.model.layers[0].self_attn
        out[ts] = (attn.q_proj.qweight.clone(), attn.o_proj.qweight.clone())
    assert torch.equal(out[False][0], out[True][0])
    assert not torch.equal(out[False][1], out[True][1])


def test_shared_hessians_give_the_same_codes(tiny_llama_dir, monkeypatch):
    import qgemv.calibration.quantize as Q

    codes = {}
    for share in (True, False):
        monkeypatch.setattr(Q, "_SHARE_HESSIANS", share)
        model, tok = load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=4, seq_len=64, seed=0)
        quantize_causal_lm(model, formats.QuantConfig(4, 32), "gptq", samples, progress=False)
        codes[share] = {n: m.qweight.clone() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert codes[True].keys() == codes[False].keys() and len(codes[True]) > 0
    for n in codes[True]:
        assert torch.equal(codes[True][n], codes[False][n]), n


def test_bf16_forward_passes_keep_the_codes_close(tiny_llama_dir):
    # forward_dtype=bfloat16 runs the layers' matmuls in bf16 (autocast);
    # the Hessians and the weights being quantized stay fp32, so only
    # roundings near a tie may flip.  The hidden states between layers stay
    # fp32 and the quantized model is the same function type.
    cfg = formats.QuantConfig(4, 32, False)
    codes = {}
    for fd in (None, torch.bfloat16):
        model, tok = load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=4, seq_len=64, seed=0)
        quantize_causal_lm(model, cfg, "gptq", samples, act_order=True, progress=False, forward_dtype=fd)
        assert next(model.parameters()).dtype == torch.float32
        codes[fd] = {n: formats.unpack_int4(m.qweight, m.in_features) for n, m in model.named_modules()
                     if isinstance(m, QuantLinear)}
    same = sum(int((codes[None][n] == codes[torch.bfloat16][n]).sum()) for n in codes[None])
    total = sum(c.numel() for c in codes[None].values())
    assert 0.9 < same / total < 1.0, same / total  # close, and bf16 really was used
    with pytest.raises(ValueError, match="forward_dtype"):
        quantize_causal_lm(model, cfg, "gptq", samples, forward_dtype=torch.int8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["gptq", "awq_gptq"])
def test_calibration_on_the_gpu_matches_the_cpu(tiny_llama_dir, method):
    # device="cuda": each layer moves to the GPU for its Hessians, search and
    # GPTQ, and back.  fp32 sums in another order may flip a few roundings.
    cfg = formats.QuantConfig(4, 32, False)
    codes, logits = {}, {}
    ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(1))
    for dev in ("cpu", "cuda"):
        model, tok = load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=4, seq_len=64, seed=0)
        quantize_causal_lm(model, cfg, method, samples, act_order=True, progress=False, device=dev)
        assert next(model.parameters()).device.type == "cpu"  # layers come back
        codes[dev] = {n: formats.unpack_int4(m.qweight, m.in_features) for n, m in model.named_modules()
                      if isinstance(m, QuantLinear)}
        with torch.no_grad():
            logits[dev] = model(ids).logits
    same = sum(int((codes["cpu"][n] == codes["cuda"][n]).sum()) for n in codes["cpu"])
    total = sum(c.numel() for c in codes["cpu"].values())
    assert same / total > 0.98, same / total
    rel = ((logits["cuda"] - logits["cpu"]).norm() / logits["cpu"].norm()).item()
    assert rel < 0.05, rel


@pytest.mark.parametrize("method,cfg", [("rtn", formats.QuantConfig(8)), ("gptq", formats.QuantConfig(4, 32)),
                                        ("gptq", formats.QuantConfig(4)), ("awq", formats.QuantConfig(4, 32, False)),
                                        ("awq_gptq", formats.QuantConfig(4, 32, False))],
                         ids=["rtn-int8", "gptq-g32", "gptq-pc", "awq-g32a", "awq_gptq-g32a"])
def test_pipeline_save_load_round_trip(tiny_llama_dir, tmp_path, method, cfg):
    model, tok = load_tiny(tiny_llama_dir)
    ids = torch.randint(0, len(tok), (2, 24))
    with torch.no_grad():
        base = model(ids).logits
    samples = calibration_samples(tok, n=8, seq_len=64, seed=0)
    rep = quantize_causal_lm(model, cfg, method, samples, progress=False, batch_size=4)
    assert len(rep.converted) == 14 and "lm_head" in rep.skipped
    assert rep.peak_rss_mb > 0 and len(rep.per_layer) == (0 if method == "rtn" else 2)
    with torch.no_grad():
        out = model(ids).logits
    qc = checkpoint.quantization_config(model, method, {"samples": 8}, cfg, list(rep.skipped))
    checkpoint.save_quantized(model, tok, str(tmp_path / "q"), qc)
    loaded, tok2 = checkpoint.load_quantized(str(tmp_path / "q"), dtype=torch.float32)
    assert isinstance(loaded.model.layers[1].mlp.down_proj, QuantLinear)
    with torch.no_grad():
        out2 = loaded(ids).logits
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    assert tok2 is not None and len(tok2) == len(tok)
    # quantized but still the same function, roughly
    assert ((out - base).norm() / base.norm()).item() < 0.5


def test_cli_writes_a_complete_checkpoint(tiny_llama_dir, tmp_path):
    from qgemv.calibration import cli

    out = tmp_path / "q"
    rc = cli.main([tiny_llama_dir, "--bits", "4", "--group-size", "32", "--method", "gptq", "--samples", "4",
                   "--seq-len", "64", "--out", str(out), "--override", "down_proj=bits:8,group_size:none"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    for key in ("quant_method", "format_version", "bits", "group_size", "symmetric", "algorithm",
                "modules_not_converted", "calibration"):
        assert key in cfg, key
    assert cfg["quant_method"] == "qgemv" and cfg["algorithm"] == "gptq" and cfg["bits"] == 4
    assert cfg["calibration"]["samples"] == 4 and cfg["calibration"]["seq_len"] == 64
    assert cfg["calibration"]["forward_dtype"] == "float32"
    assert cfg["module_overrides"]["model.layers.0.mlp.down_proj"]["bits"] == 8
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()
    model, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
    assert model.model.layers[0].mlp.down_proj.bits == 8 and model.model.layers[0].mlp.up_proj.bits == 4
    assert cli.main([tiny_llama_dir, "--bits", "8", "--method", "rtn", "--out", str(out)]) == 2  # exists


def test_cli_keeps_the_source_float_dtype(tiny_llama_dir, tmp_path):
    """A bf16 source checkpoint gives bf16 embeddings / norms in the output (not the fp32 of calibration)."""
    from safetensors import safe_open

    from qgemv.calibration import cli

    model, tok = load_tiny(tiny_llama_dir)
    src = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(src)
    tok.save_pretrained(src)
    assert checkpoint.source_dtype(str(src)) == torch.bfloat16 and checkpoint.source_dtype(tiny_llama_dir) == torch.float32
    for flag, want in ((None, torch.bfloat16), ("float32", torch.float32)):
        out = tmp_path / f"q-{flag}"
        extra = ["--save-dtype", flag] if flag else []
        assert cli.main([str(src), "--bits", "8", "--method", "rtn", "--out", str(out)] + extra) == 0
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert f.get_tensor("model.embed_tokens.weight").dtype == want
            assert f.get_tensor("model.norm.weight").dtype == want
            assert f.get_tensor("model.layers.0.mlp.gate_up.fused.scales").dtype == torch.float16  # (fused)
            assert f.get_tensor("model.layers.0.mlp.gate_up.fused.qweight").dtype == torch.int8
        assert json.loads((out / "config.json").read_text())["dtype"] == str(want).replace("torch.", "")
        loaded, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
        with torch.no_grad():
            assert torch.isfinite(loaded(torch.randint(0, len(tok), (1, 8))).logits).all()


def test_group_fallback_is_recorded(tiny_llama_dir):
    model, tok = load_tiny(tiny_llama_dir)
    # hidden 64 / intermediate 128: g128 fits only down_proj (K = 128)
    rep = quantize_causal_lm(model, formats.QuantConfig(4, 128), "rtn", progress=False)
    assert model.model.layers[0].mlp.down_proj.group_size == 128
    assert model.model.layers[0].self_attn.q_proj.group_size == 64
    qc = checkpoint.quantization_config(model, "rtn", None, formats.QuantConfig(4, 128), list(rep.skipped))
    assert qc["module_overrides"]["model.layers.0.self_attn.q_proj"]["group_size"] == 64
    model2, _ = load_tiny(tiny_llama_dir)
    rep2 = quantize_causal_lm(model2, formats.QuantConfig(4, 128), "rtn", progress=False, group_fallback=False)
    assert "model.layers.0.self_attn.q_proj" in rep2.skipped


@requires_smollm2
@pytest.mark.slow
def test_smollm2_gptq_end_to_end_cpu(tmp_path):
    """The real model: GPTQ int4 g128 with a small calibration set, save, load, score 2 windows."""
    from qgemv.eval.ppl import Protocol, evaluate

    model, tok = checkpoint.load_float_model(str(checkpoint.default_model_path()))
    samples = calibration_samples(tok, n=4, seq_len=256, seed=0)
    rep = quantize_causal_lm(model, formats.QuantConfig(4, 128, False), "gptq", samples, progress=False, batch_size=4)
    assert len(rep.converted) == 210
    out = tmp_path / "smollm2-int4"
    checkpoint.save_quantized(model, tok, str(out), checkpoint.quantization_config(model, "gptq", {"samples": 4}, formats.QuantConfig(4, 128, False), list(rep.skipped)))
    ref, _ = checkpoint.load_float_model(str(checkpoint.default_model_path()))
    q, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
    r = evaluate({"ref": ref, "q": q}, tok, Protocol(ctx=256, windows=2), progress=False)["results"]
    assert 5 < r[0]["ppl"] < 60  # SmolLM2-135M on Wikipedia text: ~22 at ctx 512
    assert r[1]["ppl"] < 2 * r[0]["ppl"] and r[1]["top1_pct"] > 50
    shutil.rmtree(out)


def test_the_progress_bar_moves_within_the_first_layer(tiny_llama_dir, monkeypatch):
    """The bar shows fractions of a layer (statistics, then each solve), so its time estimate appears long
    before the first layer ends (on a 2-core CPU one GPTQ layer of SmolLM2 took up to 140 s under load)."""
    import tqdm.auto

    shown = []

    class Recorder:
        def __init__(self, iterable=None, *a, total=None, **k):
            self.n, self.total, self.iterable = 0, total, iterable

        def __iter__(self):  # other bars (calibration input capture) only pass through
            return iter(self.iterable)

        def update(self, *a):
            pass

        def refresh(self):
            shown.append(self.n)

        def set_postfix(self, *a, **k):
            shown.append(self.n)

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    model, tok = load_tiny(tiny_llama_dir)
    samples = calibration_samples(tok, n=4, seq_len=32, seed=0)
    quantize_causal_lm(model, formats.QuantConfig(4, 32), "gptq", samples, progress=True, true_sequential=True)
    first = [v for v in shown if v < 1]
    assert any(0 < v < 1 for v in first) and len(set(first)) >= 3, shown
    assert shown[-1] == 2  # two layers
