"""GPTQ, AWQ and compressed-tensors checkpoints read into qgemv's formats (qgemv.importers, qgemv-convert).

The GPTQ and AWQ files in tests/data/foreign were packed by auto-gptq 0.7.1 and autoawq 0.2.9 themselves
(dev/make_foreign_fixtures.py), each with the producer's own dequantization of every linear beside it; the
compressed-tensors checkpoints are written here by compressed-tensors' ModelCompressor."""

import json
import shutil
import warnings
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qgemv
from qgemv import checkpoint, importers
from qgemv.formats import QuantConfig

transformers = pytest.importorskip("transformers")
DATA = Path(__file__).parent / "data" / "foreign"


def load(d):
    rep = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "qgemv: .* has no tokenizer files")  # the fixtures carry none
        model, _ = importers.load(d, "cpu", torch.float32, rep)
    return model, rep


@pytest.mark.parametrize("name,ref,fmt", [
    ("gptq_v1_sym_g32", "gptq_v1_sym_g32", QuantConfig(4, 32, True)),
    ("gptq_v1_asym_g32", "gptq_v1_asym_g32", QuantConfig(4, 32, False)),
    ("gptq_v2_asym_g32", "gptq_v1_asym_g32", QuantConfig(4, 32, False)),
    ("gptq_v1_int8_channel", "gptq_v1_int8_channel", QuantConfig(8)),
    ("awq_gemm_g32", "awq_gemm_g32", QuantConfig(4, 32, False)),
    ("gptq_v1_actorder", "gptq_v1_actorder", QuantConfig(4, 32, False)),
])
def test_weights_equal_the_producers_dequantization(name, ref, fmt, monkeypatch):
    """Every linear's weight (q - z) * s, rounded to float16 as the producer computes it, equals the
    producer's own dequantization bit for bit; lm_head stays float.  (Checked before the MLP permutation
    fold, which reorders gate/up rows: test_down_proj_perm_folds_into_gate_and_up.)"""
    monkeypatch.setattr(importers, "fold_mlp_perms", lambda model: [])
    model, rep = load(DATA / name)
    want = load_file(str(DATA / ref / "reference.safetensors"))
    assert len(rep["converted"]) == len(want) == 7 and rep["kept_float"] == ["lm_head"]
    for key, w in want.items():
        q = model.get_submodule(key[: -len(".weight")])
        assert q.config == fmt
        assert torch.equal(q.dequantize().half(), w), key
    assert rep["max_scale_change"] == 0.0  # float16 scales in the file: nothing rounded


def test_act_order_is_stored_with_a_permuted_input_that_round_trips(tmp_path):
    """Act-order GPTQ: the columns sorted by group and x gathered by perm give the producer's outputs; the
    perm survives qgemv-convert (format 3 'permuted') and from_pretrained, and fuses with q/k/v's shared perm
    only where the perms agree."""
    model, _ = load(DATA / "gptq_v1_actorder")
    want = load_file(str(DATA / "gptq_v1_actorder" / "reference.safetensors"))
    q = model.get_submodule("model.layers.0.self_attn.o_proj")
    assert q.perm is not None and not torch.equal(q.perm, torch.arange(q.in_features))
    x = torch.randn(3, q.in_features)
    ref = x @ want["model.layers.0.self_attn.o_proj.weight"].float().t()
    torch.testing.assert_close(q(x), ref, rtol=1e-3, atol=1e-3)
    out = tmp_path / "q"
    assert run_convert(str(DATA / "gptq_v1_actorder"), "--out", str(out)).returncode == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.o_proj" in qc["permuted"]
    assert "model.layers.0.mlp.down_proj" not in qc["permuted"]  # folded into gate/up
    assert not qc["fused"]  # every linear has its own random order here: nothing shares a perm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        a = model(ids).logits
        assert torch.equal(back(ids).logits, a) and torch.equal(hf(ids).logits, a)


def test_down_proj_perm_folds_into_gate_and_up(monkeypatch):
    """down_proj's act-order gather is folded into gate_proj's and up_proj's rows: no perm left on
    down_proj, gate/up hold the producer's rows in its order, and the logits are bit-identical."""
    model, rep = load(DATA / "gptq_v1_actorder")
    want = load_file(str(DATA / "gptq_v1_actorder" / "reference.safetensors"))
    assert rep["folded_perms"] == ["model.layers.0.mlp.down_proj"]
    monkeypatch.setattr(importers, "fold_mlp_perms", lambda model: [])
    unfolded, _ = load(DATA / "gptq_v1_actorder")
    perm = unfolded.model.layers[0].mlp.down_proj.perm
    mlp = model.model.layers[0].mlp
    assert mlp.down_proj.perm is None and perm is not None
    for m in ("gate_proj", "up_proj"):
        w = want[f"model.layers.0.mlp.{m}.weight"]
        assert torch.equal(getattr(mlp, m).dequantize().half(), w[perm]), m
    ids = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, unfolded(ids).logits)


def test_act_order_groups_must_be_equal(tmp_path):
    def uneven(state):
        g = state["model.layers.0.mlp.up_proj.g_idx"].clone()
        g[(g == 0).nonzero()[0]] = 1  # group 1 gets 33 columns, group 0 31
        state["model.layers.0.mlp.up_proj.g_idx"] = g

    d = edited(tmp_path, "gptq_v1_actorder", tensors=uneven)
    with pytest.raises(importers.ForeignCheckpointError, match="does not give every group 32 columns"):
        load(d)


def test_load_quantized_and_the_engine_read_them():
    model, tok = checkpoint.load_quantized(str(DATA / "awq_gemm_g32"), dtype=torch.float32)
    assert isinstance(model.model.layers[0].mlp.up_proj, qgemv.QuantLinear) and tok is None
    model.generation_config.eos_token_id = None
    ids = [3, 1, 4, 1, 5]
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert qgemv.generate(model, None, [ids], max_new_tokens=6).tokens[0] == hf


@pytest.mark.parametrize("name,rule", [
    ("gptq_v1_asym_zero0", "zero point of 0, stored as -1"),
])
def test_refused_with_the_reason(name, rule):
    with pytest.raises(importers.ForeignCheckpointError, match=rule):
        load(DATA / name)


def edited(tmp_path, name, config=None, tensors=None):
    d = tmp_path / name
    shutil.copytree(DATA / name, d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_file(str(d / "model.safetensors"))
        tensors(state)
        save_file(state, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("case,config,tensors,rule", [
    ("bits 3", lambda q: q.update(bits=3), None, "GPTQ bits 3"),
    ("unknown format", lambda q: q.update(checkpoint_format="marlin"), None, "checkpoint_format 'marlin'"),
    ("missing g_idx", lambda q: q.update(desc_act=True),
     lambda s: s.pop("model.layers.0.mlp.up_proj.g_idx"), "g_idx is missing, and desc_act is true"),
    ("missing scales", None, lambda s: s.pop("model.layers.0.mlp.up_proj.scales"), "scales is missing"),
    ("inconsistent shape", None,
     lambda s: s.update({"model.layers.0.mlp.up_proj.qzeros": s["model.layers.0.mlp.up_proj.qzeros"][:1]}),
     "has shape \\[1, 8\\], expected \\[2, 8\\]"),
    ("group size 48", lambda q: q.update(group_size=48), None, "group_size 48 does not divide"),
    ("group size 0", lambda q: q.update(group_size=0), None, "group_size 0 is not a positive integer"),
    ("group size text", lambda q: q.update(group_size="abc"), None, "group_size 'abc' is not a positive integer"),
    ("g_idx -1", None, lambda s: s["model.layers.0.mlp.up_proj.g_idx"].__setitem__(0, -1),
     "g_idx holds -1..1; group indices must lie in \\[0, 2\\)"),
    ("g_idx huge", None, lambda s: s["model.layers.0.mlp.up_proj.g_idx"].__setitem__(0, 2 ** 30),
     "group indices must lie in"),
    ("qweight as int8", None, lambda s: s.update({"model.layers.0.mlp.up_proj.qweight":
                                                   s["model.layers.0.mlp.up_proj.qweight"].to(torch.int8)}),
     "qweight is int8; packed words must be int32 or uint32"),
    ("qzeros as float", None, lambda s: s.update({"model.layers.0.mlp.up_proj.qzeros":
                                                   s["model.layers.0.mlp.up_proj.qzeros"].float()}),
     "qzeros is float32; packed words"),
    ("bias without a slot", None, lambda s: s.update({"model.layers.0.mlp.up_proj.bias": torch.zeros(64)}),
     "up_proj.bias, but the model's model.layers.0.mlp.up_proj has no bias"),
])
def test_bad_gptq_files_are_refused(tmp_path, case, config, tensors, rule):
    d = edited(tmp_path, "gptq_v1_sym_g32", config, tensors)
    with pytest.raises(importers.ForeignCheckpointError, match=rule):
        load(d)


def test_a_bias_of_the_wrong_shape_is_refused(tmp_path):
    def biased(state):  # a model whose attention has biases (attention_bias), one of them of the wrong shape
        state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(1)

    d = edited(tmp_path, "gptq_v1_sym_g32", tensors=biased)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, attention_bias=True)))
    with pytest.raises(importers.ForeignCheckpointError, match=r"q_proj.bias has shape \[1\], expected \[64\]"):
        load(d)


@pytest.mark.parametrize("case,config,rule", [
    ("no group_size", lambda a: a.pop("group_size"), "strategy 'group' needs a group_size"),
    ("group_size 0", lambda a: a.update(group_size=0), "group_size 0 is not a positive integer"),
    ("group_size null", lambda a: a.update(group_size=None), "strategy 'group' needs a group_size"),
])
def test_bad_compressed_tensors_configs_are_refused(tmp_path, case, config, rule):
    d = Path(ct_checkpoint(str(tmp_path / "ct"), 4, "group", 32, True))
    cfg = json.loads((d / "config.json").read_text())
    config(next(iter(cfg["quantization_config"]["config_groups"].values()))["weights"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(importers.ForeignCheckpointError, match=rule):
        load(d)


def test_bad_compressed_tensors_patterns_and_shapes_are_refused(tmp_path):
    d = Path(ct_checkpoint(str(tmp_path / "ct"), 4, "group", 32, True))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["re:(["]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(importers.ForeignCheckpointError, match=r"'re:\(\[' is not a valid regular expression"):
        load(d)
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    (d / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(d / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight_shape"
    state[key] = torch.tensor([[1, 2]])
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(importers.ForeignCheckpointError, match=r"weight_shape is \[1, 2\]"):
        load(d)


def test_unknown_awq_version_is_refused(tmp_path):
    d = edited(tmp_path, "awq_gemm_g32", lambda q: q.update(version="gemv"))
    with pytest.raises(importers.ForeignCheckpointError, match="AWQ version 'gemv'"):
        load(d)


def run_convert(*args):
    return subprocess.run([sys.executable, "-m", "qgemv.importers", *args], capture_output=True, text=True,
                          timeout=300)


def test_convert_writes_a_qgemv_checkpoint_with_the_same_model(tmp_path):
    out = tmp_path / "q"
    r = run_convert(str(DATA / "gptq_v1_asym_g32"), "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "7 linears repacked, 1 kept float" in r.stdout
    assert checkpoint.is_qgemv_checkpoint(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "qgemv" and qc["algorithm"] == "import:gptq"
    src, _ = load(DATA / "gptq_v1_asym_g32")
    with pytest.warns(RuntimeWarning, match="no tokenizer"):
        dst, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
    ids = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        assert torch.equal(src(ids).logits, dst(ids).logits)


def test_convert_refuses_bad_input_with_exit_2(tmp_path, tiny_llama_dir):
    r = run_convert(tiny_llama_dir, "--out", str(tmp_path / "q"))  # a float model
    assert r.returncode == 2 and "not a GPTQ, AWQ or compressed-tensors checkpoint" in r.stderr
    r = run_convert(str(DATA / "gptq_v1_asym_zero0"), "--out", str(tmp_path / "q"))
    assert r.returncode == 2 and "zero point of 0" in r.stderr and not (tmp_path / "q").exists()
    (tmp_path / "taken").mkdir()
    r = run_convert(str(DATA / "gptq_v1_asym_g32"), "--out", str(tmp_path / "taken"))
    assert r.returncode == 2 and "exists (pass overwrite=True / --overwrite" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ compressed-tensors
def ct_checkpoint(d, bits, strategy, group, symmetric):
    """A tiny Llama quantized and saved by compressed-tensors itself (pack-quantized)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = group
    qc = QuantizationConfig.model_validate({"config_groups": {"g0": {"targets": ["Linear"], "weights": weights}},
                                            "ignore": ["lm_head"], "format": "pack-quantized"})
    apply_quantization_config(model, qc)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and getattr(mod, "quantization_scheme", None) is not None:
            n, k = mod.weight.shape
            g = k if strategy == "channel" else group
            w = mod.weight.data.reshape(n, k // g, g)
            s, z = calculate_qparams(w.amin(-1), w.amax(-1), mod.quantization_scheme.weights)
            mod.weight_scale.data.copy_(s.reshape(mod.weight_scale.shape))
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.data.copy_(z.reshape(mod.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(d)
    compressor.update_config(d)
    assert ct.__version__
    return d


@pytest.mark.parametrize("bits,strategy,group,symmetric,fmt", [
    (4, "group", 128, True, QuantConfig(4, 128, True)),
    (4, "group", 32, False, QuantConfig(4, 32, False)),
    (4, "channel", None, True, QuantConfig(4, None, True)),
    (4, "channel", None, False, QuantConfig(4, 128, False)),  # one scale and zero per row, repeated per 128
], ids=["sym-g128", "asym-g32", "sym-channel", "asym-channel"])
def test_compressed_tensors_logits_equal_its_own_decompressor(tmp_path, bits, strategy, group, symmetric, fmt):
    d = ct_checkpoint(str(tmp_path / "ct"), bits, strategy, group, symmetric)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        d, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False), dtype=torch.float32)
    model, rep = load(d)
    assert model.get_submodule("model.layers.0.mlp.down_proj").config == fmt and rep["kept_float"] == ["lm_head"]
    # the only difference: compressed-tensors keeps float32 scales, qgemv float16 (relative 2^-11 at most)
    assert 0 < rep["max_scale_change"] < 2 ** -11
    for name in rep["converted"]:
        w = ref.get_submodule(name).weight
        err = (model.get_submodule(name).dequantize() - w).abs().max() / w.abs().max()
        assert err < 2 ** -10, name
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 2e-3


def test_compressed_tensors_int8_with_the_code_minus_128_loads_exactly(tmp_path):
    """compressed-tensors' symmetric int8 uses codes -128..127 (llm-compressor's W8A16 default); qgemv's int8
    format holds the full range since format version 4, and qgemv-convert writes such a checkpoint."""
    d = ct_checkpoint(str(tmp_path / "ct"), 8, "channel", None, True)
    model, _ = load(d)
    codes = [m.qweight for m in model.modules() if isinstance(m, qgemv.QuantLinear)]
    assert codes and min(int(c.min()) for c in codes) == -128  # the fixture's absmax weights take -128
    out = tmp_path / "q"
    assert run_convert(d, "--out", str(out)).returncode == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format_version"] == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
    saved = [m.qweight for m in back.modules() if isinstance(m, qgemv.QuantLinear)]
    assert min(int(c.min()) for c in saved) == -128  # kept through qgemv-convert (which fuses q/k/v, gate/up)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():  # the float tensors went through the converter's save dtype
        a, b = model(ids).logits, back(ids).logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 2e-3


def test_a_format_3_checkpoint_with_the_int8_code_minus_128_is_refused(tmp_path, tiny_llama_dir):
    """Format version 3 promised int8 codes in [-127, 127]: a version 3 file holding -128 is corrupt."""
    from safetensors.torch import save_file

    model, tok = checkpoint.load_float_model(tiny_llama_dir)
    rep = qgemv.quantize_model(model, bits=8)
    qc = checkpoint.quantization_config(model, "rtn", None, QuantConfig(8), rep.skipped)
    out = checkpoint.save_quantized(model, tok, str(tmp_path / "q"), qc)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 3
    (out / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(out / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.qweight"][0, 0] = -128
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "qgemv_format_version": "3"})
    with pytest.raises(checkpoint.CheckpointError, match="int8 code -128, which format_version 3 does not"):
        checkpoint.load_quantized(str(out))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gptq_v1_sym_g32", "gptq_v1_asym_g32", "gptq_v1_int8_channel", "awq_gemm_g32",
                                  "gptq_v1_actorder"])
def test_imported_layers_on_cuda_equal_the_reference(name, tmp_path):
    """Each imported linear on the CUDA kernels (fp16; act-order: the gathered input) against the CPU
    reference in fp32, for 1..40 rows; then the format-3 checkpoint qgemv-convert writes (fused where the
    formats agree, 'permuted' where act-order) loads on the GPU with the same logits."""
    ref_model, _ = load(DATA / name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpu_model, _ = importers.load(DATA / name, "cuda", torch.float16)
    n_checked = 0
    for n, m in ref_model.named_modules():
        if not isinstance(m, qgemv.QuantLinear):
            continue
        g = gpu_model.get_submodule(n)
        for rows in (1, 5, 16, 40):
            x = torch.randn(rows, m.in_features)
            want = m(x)
            got = g(x.half().cuda()).float().cpu()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
        n_checked += 1
    assert n_checked >= 5
    out_dir = tmp_path / "q"
    assert run_convert(str(DATA / name), "--out", str(out_dir)).returncode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv, _ = checkpoint.load_quantized(str(out_dir), device="cuda", dtype=torch.float16)
    ids = torch.randint(0, 32, (2, 9), device="cuda")
    with torch.no_grad():
        a, b = gpu_model(ids).logits.float(), conv(ids).logits.float()
    torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2 * float(a.abs().max()))


def test_the_engine_gathers_act_order_inputs_in_its_norm():
    """q/k/v and gate/up that share an act-order perm are fused with it; the engine then gathers their
    input inside the RMSNorm and calls the fused GEMV with gathered=True: the same greedy tokens and
    step logits as transformers' generate() on the same model."""
    model, _ = load(DATA / "gptq_v1_actorder")
    for owner, members in ((model.model.layers[0].self_attn, ("q_proj", "k_proj", "v_proj")),
                           (model.model.layers[0].mlp, ("gate_proj", "up_proj"))):
        first = getattr(owner, members[0])
        for m in members[1:]:
            getattr(owner, m).perm = first.perm.clone()  # another model, but one whose members share a perm
    assert qgemv.nn.fuse_llama_projections(model) == 2
    assert model.model.layers[0].self_attn.qkv.fused.perm is not None
    model.generation_config.eos_token_id = None
    engine = qgemv.Engine(model, None)
    assert engine.layers[0].qkv.perm is not None and engine.layers[0].gate_up.perm is not None
    ids = [3, 1, 4, 1, 5, 9, 2]
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    assert engine.generate([ids], max_new_tokens=8).tokens[0] == hf
