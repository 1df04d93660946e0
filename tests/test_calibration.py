"""Calibration: GPTQ / AWQ units, the layer-by-layer pipeline, checkpoints, the CLI."""

import json
import math
import os
import shutil

import pytest
import torch

from qgemv import checkpoint as C
from qgemv import formats as F
from qgemv.nn import QuantLinear

from calibration import awq
from calibration.data import calibration_samples
from calibration.gptq import Hessian, gptq_quantize
from calibration.quantize import quantize_causal_lm

from conftest import requires_smollm2


def _correlated(k=256, rows=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
    return torch.randn(rows, k, generator=g) @ A


@pytest.mark.parametrize("cfg", [F.QuantConfig(8), F.QuantConfig(4), F.QuantConfig(4, 64), F.QuantConfig(4, 32, False)],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(cfg, act_order):
    X = _correlated()
    W = torch.randn(96, 256) * 0.05
    h = Hessian(256)
    h.add(X[:1024])
    h.add(X[1024:])  # two batches: the running mean must equal one big batch
    ref = Hessian(256)
    ref.add(X)
    torch.testing.assert_close(h.H, ref.H, rtol=1e-4, atol=1e-4)
    qw, s, z, info = gptq_quantize(W, h.H, cfg, act_order=act_order)
    err_g = (X @ (F.dequantize(qw, s, z, cfg, 256) - W).t()).norm()
    qr, sr, zr = F.quantize(W, cfg)
    err_r = (X @ (F.dequantize(qr, sr, zr, cfg, 256) - W).t()).norm()
    # measured ~0.70x on this data; GPTQ must be clearly better than RTN
    assert err_g < 0.85 * err_r, (err_g, err_r)
    assert qw.dtype == qr.dtype and qw.shape == qr.shape and s.shape == sr.shape


def test_weighted_clip_search_spares_the_columns_that_matter():
    # Inputs whose columns differ up to 1000x in scale, mixed within every
    # group: a column's weight error costs E[x_k^2] (the Hessian diagonal) in
    # the output.  Measured: weighted 0.82-0.84x the unweighted search's error.
    torch.manual_seed(0)
    X = torch.randn(512, 256) * torch.logspace(-2, 1, 256)[torch.randperm(256)]
    W = torch.randn(64, 256) * 0.05
    cfg = F.QuantConfig(4, 64, False)
    hdiag = (X * X).mean(0)

    def out_err(s, z):
        qw = F.quantize_with_params(W, s, z, cfg)
        return (X @ (F.dequantize(qw, s, z, cfg, 256) - W).t()).norm().item()

    plain = out_err(*F.choose_params(W, cfg, clip_grid=20))
    weighted = out_err(*F.choose_params(W, cfg, clip_grid=20, col_weight=hdiag))
    assert weighted < 0.9 * plain, (weighted, plain)
    with pytest.raises(ValueError, match="col_weight must have shape"):
        F.choose_params(W, cfg, clip_grid=4, col_weight=hdiag[:10])


def test_true_sequential_stages_follow_the_layer():
    from calibration.quantize import _sequential_stages

    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "extra.proj"]
    assert _sequential_stages(names) == [names[:3], ["self_attn.o_proj"], names[4:6], ["mlp.down_proj"],
                                         ["extra.proj"]]


def test_true_sequential_changes_later_stages_only(tiny_llama_dir):
    # o_proj's Hessian comes from the quantized q/k/v in true-sequential mode,
    # so its codes change; q/k/v (the first stage) see the same inputs either way.
    out = {}
    for ts in (False, True):
        model, tok = _load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=4, seq_len=64, seed=0)
        quantize_causal_lm(model, F.QuantConfig(4, 32), "gptq", samples, progress=False, true_sequential=ts)
        attn = model.model.layers[0].self_attn
        out[ts] = (attn.q_proj.qweight.clone(), attn.o_proj.qweight.clone())
    assert torch.equal(out[False][0], out[True][0])
    assert not torch.equal(out[False][1], out[True][1])


def test_shared_hessians_give_the_same_codes(tiny_llama_dir, monkeypatch):
    import calibration.quantize as Q

    codes = {}
    for share in (True, False):
        monkeypatch.setattr(Q, "_SHARE_HESSIANS", share)
        model, tok = _load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=4, seq_len=64, seed=0)
        quantize_causal_lm(model, F.QuantConfig(4, 32), "gptq", samples, progress=False)
        codes[share] = {n: m.qweight.clone() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert codes[True].keys() == codes[False].keys() and len(codes[True]) > 0
    for n in codes[True]:
        assert torch.equal(codes[True][n], codes[False][n]), n


def test_bf16_forward_passes_keep_the_codes_close(tiny_llama_dir):
    # forward_dtype=bfloat16 runs the layers' matmuls in bf16 (autocast);
    # the Hessians and the weights being quantized stay fp32, so only
    # roundings near a tie may flip.  The hidden states between layers stay
    # fp32 and the quantized model is the same function type.
    cfg = F.QuantConfig(4, 32, False)
    codes = {}
    for fd in (None, torch.bfloat16):
        model, tok = _load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=4, seq_len=64, seed=0)
        quantize_causal_lm(model, cfg, "gptq", samples, act_order=True, progress=False, forward_dtype=fd)
        assert next(model.parameters()).dtype == torch.float32
        codes[fd] = {n: F.unpack_int4(m.qweight, m.in_features) for n, m in model.named_modules()
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
    cfg = F.QuantConfig(4, 32, False)
    codes, logits = {}, {}
    ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(1))
    for dev in ("cpu", "cuda"):
        model, tok = _load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=4, seq_len=64, seed=0)
        quantize_causal_lm(model, cfg, method, samples, act_order=True, progress=False, device=dev)
        assert next(model.parameters()).device.type == "cpu"  # layers come back
        codes[dev] = {n: F.unpack_int4(m.qweight, m.in_features) for n, m in model.named_modules()
                      if isinstance(m, QuantLinear)}
        with torch.no_grad():
            logits[dev] = model(ids).logits
    same = sum(int((codes["cpu"][n] == codes["cuda"][n]).sum()) for n in codes["cpu"])
    total = sum(c.numel() for c in codes["cpu"].values())
    assert same / total > 0.98, same / total
    rel = ((logits["cuda"] - logits["cpu"]).norm() / logits["cpu"].norm()).item()
    assert rel < 0.05, rel


def test_gptq_non_positive_definite_is_a_named_error():
    H = -torch.eye(64)
    with pytest.raises(ValueError, match=r"layers\.7\.mlp\.up_proj: the Hessian is not positive definite"):
        gptq_quantize(torch.randn(8, 64), H, F.QuantConfig(4), name="layers.7.mlp.up_proj")


def test_gptq_retries_with_more_damping():
    # rank-deficient H: plain Cholesky of H alone fails, dampening fixes it
    x = torch.randn(16, 64)
    H = x.t() @ x
    qw, s, z, info = gptq_quantize(torch.randn(8, 64), H, F.QuantConfig(4), damp=1e-9)
    assert info["damp"] > 1e-9


def test_awq_folding_keeps_the_float_function():
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(64, elementwise_affine=True)
    lins = [torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 48, bias=False)]
    x = torch.randn(256, 64) * torch.linspace(0.1, 5, 64)
    before = [lin(norm(x)) for lin in lins]
    s, alpha, ratio = awq.search_scales(norm(x).detach(), lins, [F.QuantConfig(4, 32)] * 2)
    assert ratio <= 1.0 and 0.0 <= alpha <= 1.0
    awq.apply_scales(norm, lins, s)
    after = [lin(norm(x)) for lin in lins]
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 2, 12, 20, 24, 48, 64, 576])
def test_hadamard_orders(n):
    from calibration.rotate import hadamard, random_rotation

    h = hadamard(n)
    assert h is not None and h.shape == (n, n) and set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h @ h.t(), n * torch.eye(n, dtype=torch.float64))
    q = random_rotation(n, seed=3)
    torch.testing.assert_close(q @ q.t(), torch.eye(n, dtype=torch.float64))


def test_random_rotation_without_a_hadamard_order_is_orthogonal():
    from calibration.rotate import hadamard, random_rotation

    assert hadamard(100) is None  # 100 = 4 * 25: not an order built here
    q = random_rotation(100, seed=1)
    torch.testing.assert_close(q.t() @ q, torch.eye(100, dtype=torch.float64))
    assert not torch.equal(q, random_rotation(100, seed=2))


def _random_norm_gains(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for name, m in model.named_modules():
        if name.endswith("norm") and hasattr(m, "weight"):
            m.weight.data = 0.2 + 2 * torch.rand(m.weight.shape, generator=g)


def test_rotation_keeps_the_float_function(tiny_llama_dir):
    from calibration.rotate import rotate_llama

    model, tok = _load_tiny(tiny_llama_dir)
    _random_norm_gains(model)  # a fold that ignored the gains would change the logits
    ids = torch.randint(0, len(tok), (2, 24))
    with torch.no_grad():
        before = model(ids).logits
    emb = model.model.embed_tokens.weight.detach().clone()
    info = rotate_llama(model, seed=0)
    assert info == {"residual": "hadamard", "head": "hadamard", "seed": 0}
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.allclose(model.model.embed_tokens.weight, emb)  # really rotated
    for name, m in model.named_modules():
        if name.endswith("norm"):
            assert torch.all(m.weight == 1), name
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_rotation_refuses_a_norm_with_bias_and_changes_nothing(tiny_llama_dir):
    from calibration.rotate import rotate_llama

    model, _ = _load_tiny(tiny_llama_dir)
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.post_attention_layernorm .*bias"):
        rotate_llama(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.config.tie_word_embeddings


def test_rotated_gptq_checkpoint_round_trip(tiny_llama_dir, tmp_path):
    model, tok = _load_tiny(tiny_llama_dir)
    _random_norm_gains(model)
    ids = torch.randint(0, len(tok), (2, 24))
    with torch.no_grad():
        base = model(ids).logits
    samples = calibration_samples(tok, n=8, seq_len=64, seed=0)
    rep = quantize_causal_lm(model, F.QuantConfig(4, 32, False), "gptq", samples, progress=False, batch_size=4,
                             act_order=True, rotate=True, rotate_seed=5)
    assert rep.rotation == {"residual": "hadamard", "head": "hadamard", "seed": 5}
    with torch.no_grad():
        out = model(ids).logits
    qc = C.quantization_config(model, "gptq", {"samples": 8}, F.QuantConfig(4, 32, False), list(rep.skipped),
                               rotation=rep.rotation)
    C.save_quantized(model, tok, str(tmp_path / "q"), qc)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["rotation"]["seed"] == 5
    loaded, _ = C.load_quantized(str(tmp_path / "q"), dtype=torch.float32)
    with torch.no_grad():
        out2 = loaded(ids).logits
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    assert ((out - base).norm() / base.norm()).item() < 0.5


def _load_tiny(tiny_llama_dir):
    return C.load_float_model(tiny_llama_dir)


@pytest.mark.parametrize("method,cfg", [("rtn", F.QuantConfig(8)), ("gptq", F.QuantConfig(4, 32)),
                                        ("gptq", F.QuantConfig(4)), ("awq", F.QuantConfig(4, 32, False)),
                                        ("awq_gptq", F.QuantConfig(4, 32, False))],
                         ids=["rtn-int8", "gptq-g32", "gptq-pc", "awq-g32a", "awq_gptq-g32a"])
def test_pipeline_save_load_round_trip(tiny_llama_dir, tmp_path, method, cfg):
    model, tok = _load_tiny(tiny_llama_dir)
    ids = torch.randint(0, len(tok), (2, 24))
    with torch.no_grad():
        base = model(ids).logits
    samples = calibration_samples(tok, n=8, seq_len=64, seed=0)
    rep = quantize_causal_lm(model, cfg, method, samples, progress=False, batch_size=4)
    assert len(rep.converted) == 14 and "lm_head" in rep.skipped
    assert rep.peak_rss_mb > 0 and len(rep.per_layer) == (0 if method == "rtn" else 2)
    with torch.no_grad():
        out = model(ids).logits
    qc = C.quantization_config(model, method, {"samples": 8}, cfg, list(rep.skipped))
    C.save_quantized(model, tok, str(tmp_path / "q"), qc)
    loaded, tok2 = C.load_quantized(str(tmp_path / "q"), dtype=torch.float32)
    assert isinstance(loaded.model.layers[1].mlp.down_proj, QuantLinear)
    with torch.no_grad():
        out2 = loaded(ids).logits
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    assert tok2 is not None and len(tok2) == len(tok)
    # quantized but still the same function, roughly
    assert ((out - base).norm() / base.norm()).item() < 0.5


def test_cli_writes_a_complete_checkpoint(tiny_llama_dir, tmp_path):
    from calibration import cli

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
    model, _ = C.load_quantized(str(out), dtype=torch.float32)
    assert model.model.layers[0].mlp.down_proj.bits == 8 and model.model.layers[0].mlp.up_proj.bits == 4
    assert cli.main([tiny_llama_dir, "--bits", "8", "--method", "rtn", "--out", str(out)]) == 2  # exists


def test_cli_keeps_the_source_float_dtype(tiny_llama_dir, tmp_path):
    """A bf16 source checkpoint gives bf16 embeddings / norms in the output (not the fp32 of calibration)."""
    from safetensors import safe_open

    from calibration import cli

    model, tok = _load_tiny(tiny_llama_dir)
    src = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(src)
    tok.save_pretrained(src)
    assert C.source_dtype(str(src)) == torch.bfloat16 and C.source_dtype(tiny_llama_dir) == torch.float32
    for flag, want in ((None, torch.bfloat16), ("float32", torch.float32)):
        out = tmp_path / f"q-{flag}"
        extra = ["--save-dtype", flag] if flag else []
        assert cli.main([str(src), "--bits", "8", "--method", "rtn", "--out", str(out)] + extra) == 0
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert f.get_tensor("model.embed_tokens.weight").dtype == want
            assert f.get_tensor("model.norm.weight").dtype == want
            assert f.get_tensor("model.layers.0.mlp.up_proj.scales").dtype == torch.float16
            assert f.get_tensor("model.layers.0.mlp.up_proj.qweight").dtype == torch.int8
        assert json.loads((out / "config.json").read_text())["dtype"] == str(want).replace("torch.", "")
        loaded, _ = C.load_quantized(str(out), dtype=torch.float32)
        with torch.no_grad():
            assert torch.isfinite(loaded(torch.randint(0, len(tok), (1, 8))).logits).all()


def test_interrupted_write_leaves_nothing_loadable(tiny_llama_dir, tmp_path, monkeypatch):
    import safetensors.torch

    model, tok = _load_tiny(tiny_llama_dir)
    quantize_causal_lm(model, F.QuantConfig(8), "rtn", progress=False)

    def boom(*a, **k):
        raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    out = tmp_path / "q"
    with pytest.raises(KeyboardInterrupt):
        C.save_quantized(model, tok, str(out), C.quantization_config(model, "rtn", None, F.QuantConfig(8), []))
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # the temporary directory is gone too


@pytest.fixture
def saved_int8(tiny_llama_dir, tmp_path):
    model, tok = _load_tiny(tiny_llama_dir)
    rep = quantize_causal_lm(model, F.QuantConfig(8), "rtn", progress=False)
    out = tmp_path / "q"
    C.save_quantized(model, tok, str(out), C.quantization_config(model, "rtn", None, F.QuantConfig(8), list(rep.skipped)))
    return out


def test_truncated_safetensors_is_a_clear_error(saved_int8):
    f = saved_int8 / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(C.CheckpointError, match="corrupt or truncated"):
        C.load_quantized(str(saved_int8))


def test_config_mismatch_is_a_clear_error(saved_int8):
    p = saved_int8 / "config.json"
    cfg = json.loads(p.read_text())
    cfg["quantization_config"]["bits"] = 4
    p.write_text(json.dumps(cfg))
    with pytest.raises(C.CheckpointError, match=r"qweight has shape .* but the config \(int4"):
        C.load_quantized(str(saved_int8))
    cfg["quantization_config"]["bits"] = 8
    cfg["quantization_config"]["format_version"] = 99
    p.write_text(json.dumps(cfg))
    with pytest.raises(C.CheckpointError, match="format_version 99 is not supported"):
        C.load_quantized(str(saved_int8))


def test_format_version_1_checkpoint_is_converted_on_load(tiny_llama_dir, saved_int8):
    import safetensors.torch

    ids = torch.randint(0, 200, (1, 12))
    model, _ = C.load_quantized(str(saved_int8), dtype=torch.float32)
    with torch.no_grad():
        want = model(ids).logits
    # Rewrite the checkpoint as version 1 wrote it: row-major packed rows.
    f = saved_int8 / "model.safetensors"
    state = safetensors.torch.load_file(str(f))
    for key in [k for k in state if k.endswith(".qweight")]:
        state[key] = F.to_panels(state[key], inverse=True)
    safetensors.torch.save_file(state, str(f), metadata={"format": "pt", "qgemv_format_version": "1"})
    p = saved_int8 / "config.json"
    cfg = json.loads(p.read_text())
    cfg["quantization_config"]["format_version"] = 1
    p.write_text(json.dumps(cfg))
    old, _ = C.load_quantized(str(saved_int8), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(old(ids).logits, want, rtol=0, atol=0)


def test_missing_config_is_a_clear_error(saved_int8):
    (saved_int8 / "config.json").unlink()
    with pytest.raises(C.CheckpointError, match="no config.json"):
        C.load_quantized(str(saved_int8))


def test_group_fallback_is_recorded(tiny_llama_dir):
    model, tok = _load_tiny(tiny_llama_dir)
    # hidden 64 / intermediate 128: g128 fits only down_proj (K = 128)
    rep = quantize_causal_lm(model, F.QuantConfig(4, 128), "rtn", progress=False)
    assert model.model.layers[0].mlp.down_proj.group_size == 128
    assert model.model.layers[0].self_attn.q_proj.group_size == 64
    qc = C.quantization_config(model, "rtn", None, F.QuantConfig(4, 128), list(rep.skipped))
    assert qc["module_overrides"]["model.layers.0.self_attn.q_proj"]["group_size"] == 64
    model2, _ = _load_tiny(tiny_llama_dir)
    rep2 = quantize_causal_lm(model2, F.QuantConfig(4, 128), "rtn", progress=False, group_fallback=False)
    assert "model.layers.0.self_attn.q_proj" in rep2.skipped


@requires_smollm2
def test_smollm2_gptq_end_to_end_cpu(tmp_path):
    """The real model: GPTQ int4 g128 with a small calibration set, save, load, score 2 windows."""
    from eval.ppl import Protocol, evaluate

    model, tok = C.load_float_model(str(C.default_model_path()))
    samples = calibration_samples(tok, n=4, seq_len=256, seed=0)
    rep = quantize_causal_lm(model, F.QuantConfig(4, 128, False), "gptq", samples, progress=False, batch_size=4)
    assert len(rep.converted) == 210
    out = tmp_path / "smollm2-int4"
    C.save_quantized(model, tok, str(out), C.quantization_config(model, "gptq", {"samples": 4}, F.QuantConfig(4, 128, False), list(rep.skipped)))
    ref, _ = C.load_float_model(str(C.default_model_path()))
    q, _ = C.load_quantized(str(out), dtype=torch.float32)
    r = evaluate({"ref": ref, "q": q}, tok, Protocol(ctx=256, windows=2), progress=False)["results"]
    assert 5 < r[0]["ppl"] < 60  # SmolLM2-135M on Wikipedia text: ~22 at ctx 512
    assert r[1]["ppl"] < 2 * r[0]["ppl"] and r[1]["top1_pct"] > 50
    shutil.rmtree(out)


@pytest.mark.parametrize("cfg", [F.QuantConfig(4, 32, False), F.QuantConfig(4), F.QuantConfig(8)],
                         ids=lambda c: c.name)
def test_signround_lowers_each_layers_output_error(tiny_llama_dir, cfg):
    """Method "signround" (calibration/signround.py): in every decoder layer the
    tuned rounding gives a smaller output error than round-to-nearest on the
    same probe tokens, and the exported codes reproduce the tuned weights."""
    from calibration.signround import LearnedRounding

    model, tok = _load_tiny(tiny_llama_dir)
    samples = calibration_samples(tok, n=8, seq_len=64, seed=0)
    rep = quantize_causal_lm(model, cfg, "signround", samples, progress=False, signround_steps=30, batch_size=4)
    for entry in rep.per_layer:
        sr = entry["info"]["signround"]
        assert sr["mse_tuned"] < sr["mse_start"], sr
    # export() is exact: dequantizing its codes gives fake()'s weights
    w = torch.randn(48, 64) * 0.05
    r = LearnedRounding(w, cfg)
    with torch.no_grad():
        r.v.uniform_(-0.5, 0.5)
        r.hi.uniform_(0.6, 1.0)
        r.lo.uniform_(0.6, 1.0)
    qw, s, z = r.export()
    torch.testing.assert_close(F.dequantize(qw, s, z, cfg, 64), r.fake().detach(), rtol=0, atol=1e-6)


def test_gptq_signround_starts_from_gptqs_codes(tiny_llama_dir):
    """Method "gptq_signround" tunes from GPTQ's weights on GPTQ's grid: with
    zero steps its codes are GPTQ's exactly; with steps no layer ends with a
    larger output error on the probe slice than GPTQ's codes give (the best
    parameters seen, the start included, are kept)."""
    cfg = F.QuantConfig(4, 32, False)
    codes = {}
    for method, steps in (("gptq", 0), ("gptq_signround", 0), ("gptq_signround", 30)):
        model, tok = _load_tiny(tiny_llama_dir)
        samples = calibration_samples(tok, n=8, seq_len=64, seed=0)
        rep = quantize_causal_lm(model, cfg, method, samples, progress=False, signround_steps=steps, batch_size=4,
                                 act_order=True)
        codes[(method, steps)] = model.model.layers[1].mlp.down_proj.qweight.clone()
        if method == "gptq_signround":
            for entry in rep.per_layer:
                sr = entry["info"]["signround"]
                assert sr["mse_tuned"] <= sr["mse_start"], sr
    assert torch.equal(codes[("gptq", 0)], codes[("gptq_signround", 0)])


def test_e2e_scale_tuning_lowers_the_kl_and_keeps_the_codes(tiny_llama_dir):
    """calibration/e2e.py: tuning only the scales against the float model's
    log-probs lowers the held-out KL; codes and zero points are untouched, the
    modules are QuantLinear again, and the written fp16 scales give the KL
    the report names (fp32 forwards, so the check is exact up to fp16 scales)."""
    from calibration.e2e import _kl, teacher_logprobs, tune_scales

    model, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=12, seq_len=64, seed=0)
    teacher = teacher_logprobs(model, windows, progress=False)
    quantize_causal_lm(model, F.QuantConfig(4, 32, False), "rtn", windows[:8], progress=False, batch_size=4)
    down = model.model.layers[1].mlp.down_proj
    before = {k: getattr(down, k).clone() for k in ("qweight", "zeros", "scales")}
    rep = tune_scales(model, windows, teacher, probe=4, steps=40, lr=3e-3, eval_every=10,
                      forward_dtype=torch.float32, progress=False)
    assert rep["probe_kl_best"] < 0.95 * rep["probe_kl_start"], rep
    assert rep["best_step"] > 0 and rep["layers"] == 14
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.scales.dtype == torch.float16
    assert torch.equal(down.qweight, before["qweight"]) and torch.equal(down.zeros, before["zeros"])
    assert not torch.equal(down.scales, before["scales"])
    with torch.no_grad():
        kl = sum(_kl(teacher[i], model(windows[i : i + 1]).logits[0]).item() for i in range(8, 12)) / 4
    assert kl == pytest.approx(rep["probe_kl_best"], rel=0.02)


def test_e2e_tune_norms_moves_the_gains_and_restores_them_on_failure(tiny_llama_dir):
    """--tune-norms: every RMSNorm gain is tuned with the scales and the written
    model gives the reported probe KL; a run that fails leaves gains, scales
    and modules as they were."""
    from calibration.e2e import _kl, teacher_logprobs, tune_scales

    model, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=12, seq_len=64, seed=0)
    teacher = teacher_logprobs(model, windows, progress=False)
    quantize_causal_lm(model, F.QuantConfig(4, 32, False), "rtn", windows[:8], progress=False, batch_size=4)
    norm = model.model.layers[0].post_attention_layernorm
    gain0 = norm.weight.detach().clone()
    scales0 = model.model.layers[0].mlp.up_proj.scales.clone()

    with pytest.raises(RuntimeError):  # vocabulary mismatch: fails in the first probe forward
        tune_scales(model, windows, teacher[..., :-1], probe=4, steps=4, tune_norms=True, progress=False)
    assert not hasattr(norm, "parametrizations") and torch.equal(norm.weight, gain0)
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    assert torch.equal(model.model.layers[0].mlp.up_proj.scales, scales0)

    rep = tune_scales(model, windows, teacher, probe=4, steps=40, lr=3e-3, eval_every=10,
                      forward_dtype=torch.float32, progress=False, tune_norms=True)
    n_layers = len(model.model.layers)
    assert rep["norms"] == 2 * n_layers + 1 and rep["best_step"] > 0
    assert rep["probe_kl_best"] < 0.95 * rep["probe_kl_start"], rep
    norm = model.model.layers[0].post_attention_layernorm
    assert not hasattr(norm, "parametrizations") and isinstance(norm.weight, torch.nn.Parameter)
    assert not torch.equal(norm.weight, gain0) and torch.equal(torch.sign(norm.weight), torch.sign(gain0))
    with torch.no_grad():
        kl = sum(_kl(teacher[i], model(windows[i : i + 1]).logits[0]).item() for i in range(8, 12)) / 4
    assert kl == pytest.approx(rep["probe_kl_best"], rel=0.02)


def test_e2e_streamed_teacher_equals_the_stored_one(tiny_llama_dir):
    """--stream-teacher computes the same log-probs as the stored tensor, so a
    cosine-schedule run with either gives bit-identical scales (and different
    ones from a constant schedule); a bad schedule name is an error."""
    from calibration.e2e import StreamedTeacher, teacher_logprobs, tune_scales

    ref, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=10, seq_len=48, seed=0)
    stored = teacher_logprobs(ref, windows, progress=False)
    streamed = StreamedTeacher(ref, windows, probe=3, progress=False)
    assert streamed.shape == stored.shape
    for i in (0, 6, 7, 9):  # training windows computed on demand, probe windows kept
        assert torch.equal(streamed[i], stored[i])
    scales = []
    for teacher, schedule in ((stored, "cosine"), (streamed, "cosine"), (stored, "constant")):
        model, _ = _load_tiny(tiny_llama_dir)
        quantize_causal_lm(model, F.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
        with pytest.raises(ValueError, match="schedule"):
            tune_scales(model, windows, teacher, probe=3, steps=2, schedule="linear", progress=False)
        rep = tune_scales(model, windows, teacher, probe=3, steps=12, lr=3e-3, eval_every=4,
                          forward_dtype=torch.float32, progress=False, schedule=schedule)
        assert rep["best_step"] > 0
        scales.append(model.model.layers[1].mlp.down_proj.scales.clone())
    assert torch.equal(scales[0], scales[1])
    assert not torch.equal(scales[0], scales[2])  # the decay changed the steps


def test_e2e_batched_steps(tiny_llama_dir):
    """--batch B: B windows per step in one forward. The streamed teacher's
    batched rows equal the stored ones, so both give bit-identical scales;
    a batched run lowers the probe KL, differs from a batch-1 run, and a batch
    larger than the training set is an error naming the rule."""
    from calibration.e2e import StreamedTeacher, _teacher_rows, teacher_logprobs, tune_scales

    ref, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=11, seq_len=40, seed=3)
    stored = teacher_logprobs(ref, windows, progress=False)
    streamed = StreamedTeacher(ref, windows, probe=3, progress=False)
    # one batched forward vs one window at a time: same log-probs up to bf16 rounding of fp32 noise
    diff = (_teacher_rows(streamed, [5, 0, 7]).float() - _teacher_rows(stored, [5, 0, 7]).float()).abs().max()
    assert diff < 0.05, diff
    with pytest.raises(IndexError):
        streamed.rows([1, 9])  # a probe window
    scales, reps = [], []
    for teacher, batch in ((stored, 3), (stored, 1)):
        model, _ = _load_tiny(tiny_llama_dir)
        quantize_causal_lm(model, F.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
        with pytest.raises(ValueError, match="batch must be between 1 and the 8 training windows"):
            tune_scales(model, windows, teacher, probe=3, steps=2, batch=9, progress=False)
        rep = tune_scales(model, windows, teacher, probe=3, steps=16, lr=3e-3, eval_every=4,
                          forward_dtype=torch.float32, progress=False, batch=batch)
        assert rep["batch"] == batch and rep["best_step"] > 0
        assert rep["probe_kl_best"] < 0.95 * rep["probe_kl_start"], rep
        scales.append(model.model.layers[1].mlp.down_proj.scales.clone())
    assert not torch.equal(scales[0], scales[1])


def test_e2e_probe_windows_are_held_out(tiny_llama_dir):
    """train_and_probe_windows: probe windows come from the last tokens of the
    calibration text and share no position with any training window, even when
    the training windows outnumber the text; seeded; too short a text is an error."""
    from calibration.data import train_and_probe_windows
    from qgemv.text import load_text

    _, tok = _load_tiny(tiny_llama_dir)
    ids = tok(load_text("default", "calib"), return_tensors="pt", add_special_tokens=False).input_ids[0]
    train, probe = train_and_probe_windows(tok, n_train=400, n_probe=6, seq_len=64, seed=5)
    assert train.shape == (400, 64) and probe.shape == (6, 64)
    cut = ids.numel() - max(int(ids.numel() * 0.1), 6 * 64 + 1)

    text_tail = ids[cut:]
    for w in probe:  # every probe window is a slice of the tail ...
        assert any(torch.equal(text_tail[s : s + 64], w) for s in range(text_tail.numel() - 63))
    head = ids[:cut]
    for w in train[:40]:  # ... and every training window a slice of the head
        assert any(torch.equal(head[s : s + 64], w) for s in range(head.numel() - 63))
    again, _ = train_and_probe_windows(tok, n_train=400, n_probe=6, seq_len=64, seed=5)
    assert torch.equal(again, train)
    with pytest.raises(ValueError, match="probe_fraction"):
        train_and_probe_windows(tok, n_train=4, n_probe=2, seq_len=64, probe_fraction=1.5)
    with pytest.raises(ValueError, match="too few"):
        train_and_probe_windows(tok, n_train=4, n_probe=2, seq_len=ids.numel() // 2)


def test_e2e_generated_windows_are_seeded_samples(tiny_llama_dir):
    """generated_windows: [n, L] windows that start with the given tokens,
    stay in the vocabulary, repeat with the seed, differ with another seed,
    and follow the model (its own samples score a lower loss under it than
    uniformly random tokens do)."""
    from calibration.data import generated_windows

    model, tok = _load_tiny(tiny_llama_dir)
    first = torch.tensor([5, 17, 17, 300, 42])
    a = generated_windows(model, first, 24, seed=1, batch=2, progress=False)
    b = generated_windows(model, first, 24, seed=1, batch=2, progress=False)
    c = generated_windows(model, first, 24, seed=2, batch=2, progress=False)
    assert a.shape == (5, 24) and a.dtype == torch.int64 and torch.equal(a[:, 0], first)
    assert torch.equal(a, b) and not torch.equal(a, c)
    v = model.config.vocab_size
    assert int(a.min()) >= 0 and int(a.max()) < v
    rand = torch.randint(0, v, a.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        def nll(x):
            return torch.nn.functional.cross_entropy(model(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).item()
        assert nll(a) < nll(rand)


def test_e2e_ce_weight(tiny_llama_dir):
    """ce_weight > 0 adds the windows' cross-entropy to the loss: other scales
    than pure distillation, selected by probe KL + ce_weight x probe CE; a
    negative weight is an error."""
    from calibration.e2e import teacher_logprobs, tune_scales

    ref, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=10, seq_len=40, seed=2)
    teacher = teacher_logprobs(ref, windows, progress=False)
    scales = []
    for w in (0.0, 1.0):
        model, _ = _load_tiny(tiny_llama_dir)
        quantize_causal_lm(model, F.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
        with pytest.raises(ValueError, match="ce_weight"):
            tune_scales(model, windows, teacher, probe=2, steps=2, ce_weight=-1.0, progress=False)
        rep = tune_scales(model, windows, teacher, probe=2, steps=10, lr=3e-3, eval_every=5,
                          forward_dtype=torch.float32, progress=False, batch=2, ce_weight=w)
        assert rep["ce_weight"] == w  # the written scales are the best by the training objective on the probe
        assert rep["probe_kl_best"] + w * rep["probe_ce_best"] <= rep["probe_kl_start"] + w * rep["probe_ce_start"]
        scales.append(model.model.layers[1].mlp.down_proj.scales.clone())
    assert not torch.equal(scales[0], scales[1])


@pytest.mark.parametrize("cfg", [F.QuantConfig(4, 32, False), F.QuantConfig(4, None, True)], ids=lambda c: c.name)
def test_e2e_code_tuning_moves_codes_in_range_and_writes_what_it_measured(tiny_llama_dir, cfg):
    """code_lr > 0: the integer codes move too (zero points fixed). Some codes
    change, every stored code stays in the format's range, the probe KL falls
    further than with the scales alone in the same steps, and the written
    QuantLinears (packed codes, fp16 scales) give the KL the report names."""
    from calibration.e2e import _kl, teacher_logprobs, tune_scales

    ref, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=12, seq_len=64, seed=0)
    teacher = teacher_logprobs(ref, windows, progress=False)
    reps, codes = {}, {}
    for code_lr in (0.0, 0.03):
        model, _ = _load_tiny(tiny_llama_dir)
        quantize_causal_lm(model, cfg, "rtn", windows[:8], progress=False, batch_size=4)
        down = model.model.layers[1].mlp.down_proj
        before = {k: getattr(down, k).clone() for k in ("qweight", "scales") + (("zeros",) if down.zeros is not None else ())}
        with pytest.raises(ValueError, match="code_lr"):
            tune_scales(model, windows, teacher, probe=4, steps=2, code_lr=-1.0, progress=False)
        rep = tune_scales(model, windows, teacher, probe=4, steps=40, lr=3e-3, eval_every=5,
                          forward_dtype=torch.float32, progress=False, code_lr=code_lr, schedule="cosine")
        reps[code_lr] = rep
        down = model.model.layers[1].mlp.down_proj
        assert isinstance(down, QuantLinear)
        if down.zeros is not None:
            assert torch.equal(down.zeros, before["zeros"])
        stored = F.unpack_int4(down.qweight, down.in_features)
        assert int(stored.min()) >= 0 and int(stored.max()) <= 15
        codes[code_lr] = (before["qweight"], down.qweight.clone())
        with torch.no_grad():
            kl = sum(_kl(teacher[i], model(windows[i : i + 1]).logits[0]).item() for i in range(8, 12)) / 4
        assert kl == pytest.approx(rep["probe_kl_best"], rel=0.02)
    assert reps[0.0]["codes_changed"] == 0 and torch.equal(*codes[0.0])
    moved = reps[0.03]
    assert moved["best_step"] > 0 and 0 < moved["codes_changed"] < moved["codes_total"], moved
    assert not torch.equal(*codes[0.03])
    assert moved["probe_kl_best"] < 0.97 * reps[0.0]["probe_kl_best"], (moved, reps[0.0])


@pytest.mark.parametrize("cfg", [F.QuantConfig(4, 32, False), F.QuantConfig(4, None, True), F.QuantConfig(8)],
                         ids=lambda c: c.name)
def test_scale_tuned_codes_fit_a_layer_better_than_scales_alone(cfg):
    """ScaleTuned(tune_codes=True) moved by CodeStep on one RTN int4 layer,
    trained to reproduce the float layer's outputs on correlated inputs: moving
    codes reaches a lower output error than moving only the scales in the same
    steps, no code moves more than one step, and write_back stores exactly the
    weight the module multiplied by."""
    from calibration.e2e import CodeStep, ScaleTuned

    x = _correlated(k=128, rows=1024, seed=1)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    y = x @ w.T
    errs = {}
    with pytest.raises(ValueError, match="lr and bound"):
        CodeStep([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    for tune_codes in (False, True):
        lin = torch.nn.Linear(128, 48, bias=False)
        lin.weight.data.copy_(w)
        q = QuantLinear.from_linear(lin, cfg.bits, cfg.group_size, symmetric=cfg.symmetric)
        unpack = F.unpack_int8 if cfg.bits == 8 else F.unpack_int4
        codes0 = unpack(q.qweight, 128).clone()
        t = ScaleTuned(q, tune_codes=tune_codes)
        opts = [torch.optim.Adam([t.log_s], lr=2e-3)] + ([CodeStep([t.v], lr=3e-3)] if tune_codes else [])
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.5 * (1 + math.cos(math.pi * i / 400))) for o in opts]
        for _ in range(400):
            loss = (t(x) - y).pow(2).mean()
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o, sc in zip(opts, scheds):
                o.step()
                sc.step()
        with torch.no_grad():
            w_used = t.weight().clone()
            changed = t.write_back()
        codes1 = unpack(q.qweight, 128)
        assert changed == int((codes1 != codes0).sum()) and (changed > 0) == tune_codes
        assert int((codes1.int() - codes0.int()).abs().max()) <= 1
        lo, hi = F.code_range(cfg)
        assert int(codes1.min()) >= lo and int(codes1.max()) <= hi
        assert torch.allclose(q.dequantize(), w_used, rtol=2e-3, atol=1e-6)  # fp16 scales
        errs[tune_codes] = (x @ q.dequantize().T - y).pow(2).mean().item()
    assert errs[True] < 0.8 * errs[False], errs


def test_soup_averages_log_scales_and_refuses_other_codes(tiny_llama_dir, tmp_path):
    """calibration.soup: two e2e runs (other seeds) of one start give a
    checkpoint whose scales are the geometric mean of theirs (up to fp16
    rounding) and whose other tensors are theirs; a checkpoint with other
    codes is an error naming the tensor, and nothing is written."""
    from calibration import soup
    from calibration.e2e import teacher_logprobs, tune_scales

    ref, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=10, seq_len=40, seed=2)
    teacher = teacher_logprobs(ref, windows, progress=False)
    dirs = []
    for seed, method in ((0, "rtn"), (1, "rtn"), (0, "gptq")):
        model, _ = _load_tiny(tiny_llama_dir)
        cfg = F.QuantConfig(4, 32, False)
        rep = quantize_causal_lm(model, cfg, method, windows[:6], progress=False, batch_size=3)
        tune_scales(model, windows, teacher, probe=2, steps=6, lr=1e-2, eval_every=100, seed=seed,
                    forward_dtype=torch.float32, progress=False)
        d = tmp_path / f"{method}{seed}"
        C.save_quantized(model, tok, str(d), C.quantization_config(model, method, {}, cfg, list(rep.skipped)))
        dirs.append(str(d))
    a, b = (C.load_quantized(d, dtype=torch.float32)[0] for d in dirs[:2])
    assert soup.main([dirs[0], dirs[1], "--out", str(tmp_path / "soup")]) == 0
    s, _ = C.load_quantized(str(tmp_path / "soup"), dtype=torch.float32)
    up_a, up_b, up_s = (m.model.layers[0].mlp.up_proj for m in (a, b, s))
    assert not torch.equal(up_a.scales, up_b.scales)
    want = (up_a.scales.float().log() + up_b.scales.float().log()).div(2).exp()
    assert torch.allclose(up_s.scales.float(), want, rtol=1e-3)
    assert torch.equal(up_s.qweight, up_a.qweight) and torch.equal(up_s.zeros, up_a.zeros)
    cfg = json.loads((tmp_path / "soup" / "config.json").read_text())["quantization_config"]
    assert cfg["algorithm"] == "rtn+soup" and cfg["calibration"]["soup"]["inputs"] == dirs[:2]
    with pytest.raises(SystemExit, match="differs between model 0 and model 1"):
        soup.main([dirs[0], dirs[2], "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit, match="at least two"):
        soup.main([dirs[0], "--out", str(tmp_path / "bad")])


def test_e2e_bias_tuning_round_trips_and_undeclared_biases_are_refused(tiny_llama_dir, tmp_path):
    """bias_lr > 0: every QuantLinear gets a trained output bias; the probe KL
    falls below the start; declare_biases makes the config say so, and the
    saved checkpoint loads with the biases and gives the same logits. The same
    tensors under a config without the switches are a load error naming them
    (they were dropped silently before)."""
    from calibration.e2e import check_bias_target, declare_biases, teacher_logprobs, tune_scales

    ref, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=10, seq_len=48, seed=1)
    teacher = teacher_logprobs(ref, windows, progress=False)
    model, _ = _load_tiny(tiny_llama_dir)
    cfg = F.QuantConfig(4, 32, False)
    qrep = quantize_causal_lm(model, cfg, "rtn", windows[:6], progress=False, batch_size=3)
    with pytest.raises(ValueError, match="bias_lr"):
        tune_scales(model, windows, teacher, probe=2, steps=2, bias_lr=-1.0, progress=False)
    with pytest.raises(ValueError, match="has no bias"):
        declare_biases(model)
    check_bias_target(model)  # a Llama config, every decoder linear quantized
    float_one = model.model.layers[0].mlp.up_proj
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(float_one.in_features, float_one.out_features, bias=False)
    with pytest.raises(ValueError, match="layers.0.mlp.up_proj is not"):
        check_bias_target(model)
    model.model.layers[0].mlp.up_proj = float_one
    rep = tune_scales(model, windows, teacher, probe=2, steps=20, lr=3e-3, eval_every=5, bias_lr=1e-4,
                      forward_dtype=torch.float32, progress=False)
    assert rep["best_step"] > 0 and rep["probe_kl_best"] < rep["probe_kl_start"] and rep["bias_lr"] == 1e-4
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.bias is not None and down.bias.abs().max() > 0
    assert "model.layers.1.mlp.down_proj.bias" in model.state_dict()
    declare_biases(model)
    assert model.config.attention_bias and model.config.mlp_bias
    qc = C.quantization_config(model, "rtn", {}, cfg, list(qrep.skipped))
    C.save_quantized(model, tok, str(tmp_path / "b"), qc)
    loaded, _ = C.load_quantized(str(tmp_path / "b"), dtype=torch.float32)
    assert torch.equal(loaded.model.layers[1].mlp.down_proj.bias, down.bias)
    with torch.no_grad():
        torch.testing.assert_close(loaded(windows[:2]).logits, model(windows[:2]).logits, rtol=1e-5, atol=1e-5)
    conf = json.loads((tmp_path / "b" / "config.json").read_text())
    conf["attention_bias"] = conf["mlp_bias"] = False
    (tmp_path / "b" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(C.CheckpointError, match="does not have"):
        C.load_quantized(str(tmp_path / "b"), dtype=torch.float32)


def test_e2e_time_limit_stops_early_and_writes_the_best(tiny_llama_dir):
    """time_limit: training stops after the first step past the limit, the probe
    is measured there, and the report says how many steps ran."""
    from calibration.e2e import teacher_logprobs, tune_scales

    model, tok = _load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=8, seq_len=32, seed=4)
    teacher = teacher_logprobs(model, windows, progress=False)
    quantize_causal_lm(model, F.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
    rep = tune_scales(model, windows, teacher, probe=2, steps=10_000, lr=3e-3, eval_every=1000,
                      forward_dtype=torch.float32, progress=False, time_limit=0.0)
    assert rep["steps_done"] == 1 and [h["step"] for h in rep["history"]] == [0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_e2e_on_cuda_matches_cpu(tiny_llama_dir):
    """tune_scales with the model, windows and teacher on the GPU (fp32 forwards)
    lands on the same scales and probe KL as on the CPU, up to fp32 reduction
    order (Adam moves a scale by about lr per step whatever the gradient's size,
    so a near-zero gradient of the other sign may move one scale by up to
    2 x lr x steps: the bound on the largest difference)."""
    from calibration.e2e import teacher_logprobs, tune_scales

    scales, kl = {}, {}
    for dev in ("cpu", "cuda"):
        model, tok = _load_tiny(tiny_llama_dir)
        windows = calibration_samples(tok, n=10, seq_len=48, seed=1)
        quantize_causal_lm(model, F.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
        ref, _ = _load_tiny(tiny_llama_dir)
        model, ref, windows = model.to(dev), ref.to(dev), windows.to(dev)
        teacher = teacher_logprobs(ref, windows, progress=False)
        rep = tune_scales(model, windows, teacher, probe=2, steps=8, lr=3e-3, eval_every=4,
                          forward_dtype=torch.float32, progress=False, batch=2)
        assert rep["probe_kl_best"] < rep["probe_kl_start"], rep
        scales[dev] = model.model.layers[1].mlp.down_proj.scales.float().cpu()
        kl[dev] = rep["probe_kl_best"]
    rel = ((scales["cuda"] - scales["cpu"]).abs() / scales["cpu"]).flatten()
    assert rel.median() < 1e-3 and rel.max() < 2 * 3e-3 * 8 + 1e-3, (rel.median(), rel.max())
    assert kl["cuda"] == pytest.approx(kl["cpu"], rel=1e-2)


def test_e2e_cli_writes_a_loadable_checkpoint(tiny_llama_dir, tmp_path):
    from calibration import cli, e2e

    src, out = tmp_path / "q", tmp_path / "q_e2e"
    assert cli.main([tiny_llama_dir, "--bits", "4", "--group-size", "32", "--asym", "--method", "rtn",
                     "--out", str(src)]) == 0
    assert e2e.main([str(src), "--out", str(out), "--reference", tiny_llama_dir, "--samples", "6", "--probe", "2",
                     "--seq-len", "48", "--steps", "6", "--eval-every", "3", "--tune-norms", "--stream-teacher",
                     "--schedule", "cosine", "--batch", "2", "--generated", "3", "--code-lr", "0.03",
                     "--time-limit", "600", "--bias-lr", "1e-5"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["algorithm"] == "rtn+e2e" and qc["calibration"]["e2e"]["steps"] == 6
    assert qc["calibration"]["e2e"]["tune_norms"] is True and qc["calibration"]["e2e"]["norms_tuned"] > 0
    assert qc["calibration"]["e2e"]["probe_kl_best"] <= qc["calibration"]["e2e"]["probe_kl_start"]
    assert qc["calibration"]["e2e"]["stream_teacher"] is True and qc["calibration"]["e2e"]["schedule"] == "cosine"
    assert qc["calibration"]["e2e"]["generated"] == 3 and qc["calibration"]["e2e"]["ce_weight"] == 0.0
    assert qc["calibration"]["e2e"]["code_lr"] == 0.03 and qc["calibration"]["e2e"]["steps_done"] == 6
    assert isinstance(qc["calibration"]["e2e"]["codes_changed"], int)
    assert qc["calibration"]["e2e"]["forward_dtype"] in ("float32", "bfloat16")  # "auto", resolved
    assert qc["calibration"]["e2e"]["bias_lr"] == 1e-5
    conf = json.loads((out / "config.json").read_text())
    assert conf["attention_bias"] is True and conf["mlp_bias"] is True
    assert json.loads((out / "e2e_report.json").read_text())["batch"] == 2
    assert (out / "e2e_report.json").exists()
    model, _ = C.load_quantized(str(out), dtype=torch.float32)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    start, _ = C.load_quantized(str(src), dtype=torch.float32)  # the tuned gains were written
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, start.model.layers[0].input_layernorm.weight)
    assert e2e.main([str(src), "--out", str(out), "--reference", tiny_llama_dir]) == 2  # exists, no --overwrite
