"""QuantLinear and quantize_model on CPU (the reference path)."""

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as Fn

import qgemv

VARIANTS = [(8, None, True), (4, None, True), (4, 128, True), (4, 32, False)]
IDS = ["int8", "int4", "int4g128", "int4g32a"]


@pytest.mark.parametrize("bits,group,sym", VARIANTS, ids=IDS)
@pytest.mark.parametrize("bias", [False, True])
def test_quantlinear_matches_f_linear_on_dequantized_weight(bits, group, sym, bias):
    lin = nn.Linear(256, 40, bias=bias)
    q = qgemv.QuantLinear.from_linear(lin, bits, group, sym)
    x = torch.randn(2, 3, 5, 256)
    y = q(x)
    ref = Fn.linear(x, q.dequantize(), lin.bias)
    assert y.shape == (2, 3, 5, 40)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,group,sym", VARIANTS, ids=IDS)
def test_state_dict_round_trip(bits, group, sym, tmp_path):
    lin = nn.Linear(128, 24, bias=True)
    q = qgemv.QuantLinear.from_linear(lin, bits, group, sym)
    torch.save(q.state_dict(), tmp_path / "q.pt")
    q2 = qgemv.QuantLinear(128, 24, bits, group, sym, bias=True, bias_dtype=lin.bias.dtype)
    q2.load_state_dict(torch.load(tmp_path / "q.pt"))
    for k, v in q.state_dict().items():
        assert torch.equal(v, q2.state_dict()[k]), k
    x = torch.randn(4, 128)
    assert torch.equal(q(x), q2(x))


@pytest.mark.parametrize("bits,group,sym", [(8, None, True), (4, None, True), (4, 32, False)])
def test_the_cpu_path_keeps_the_references_numbers_and_follows_buffer_changes(bits, group, sym):
    lin = torch.nn.Linear(96, 40, bias=False)
    q = qgemv.QuantLinear.from_linear(lin, bits=bits, group_size=group, symmetric=sym)
    x = torch.randn(3, 96)

    def op():  # the raw op, without QuantLinear's CPU cache
        name, args = qgemv.ops.op_for(q)
        return getattr(torch.ops.qgemv, name)(x, *args, None)

    assert torch.equal(q(x), op())
    w = q.__dict__["_cpu_w"][1]
    assert torch.equal(q(x), op()) and q.__dict__["_cpu_w"][1] is w  # kept
    q.scales.mul_(2)  # in place: the cache must follow
    assert torch.equal(q(x), op())
    q.qweight = q.qweight.clone()  # a new tensor
    assert torch.equal(q(x), op()) and q.__dict__["_cpu_w"][1] is not w


def test_from_linear_on_the_meta_device_gives_a_meta_skeleton():
    lin = torch.nn.Linear(64, 48, bias=True, device="meta", dtype=torch.bfloat16)
    q = qgemv.QuantLinear.from_linear(lin, bits=4, group_size=32, symmetric=False)
    ref = qgemv.QuantLinear.from_linear(torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16), 4, 32, False)
    for name, t in q.state_dict().items():
        assert t.is_meta and t.shape == ref.state_dict()[name].shape and t.dtype == ref.state_dict()[name].dtype, name
    with pytest.raises(ValueError, match="on the meta device .* cannot be quantized on cpu"):
        qgemv.QuantLinear.from_linear(lin, bits=8, device="cpu")


def test_extra_repr():
    q = qgemv.QuantLinear.from_linear(nn.Linear(64, 8), 4, 32, False)
    assert "bits=4, group_size=32, asymmetric, bias=True" in repr(q)


def test_quantlinear_rejects_bad_shapes():
    with pytest.raises(ValueError, match="in_features must be a multiple of 8, got 12"):
        qgemv.QuantLinear(12, 4)
    with pytest.raises(ValueError, match=r"in_features \(96\) must be divisible by group_size \(64\)"):
        qgemv.QuantLinear(96, 4, 4, 64)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("bits,group,sym", VARIANTS[:3], ids=IDS[:3])
def test_quantize_model_llama_matches_dequantized_float_model(bits, group, sym):
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        base = model(ids).logits
    import copy

    qmodel = copy.deepcopy(model)
    if group == 128:
        group = 32  # hidden 64 / intermediate 160 are not multiples of 128
    report = qgemv.quantize_model(qmodel, bits=bits, group_size=group, symmetric=sym)
    # 2 layers x 7 linears converted, lm_head skipped
    assert len(report.converted) == 14 and list(report.skipped) == ["lm_head"]
    assert report.bytes_after < report.bytes_before
    assert isinstance(qmodel.model.layers[0].self_attn.q_proj, qgemv.QuantLinear)
    # The same network with each QuantLinear replaced by formats.linear on its dequantized weight.
    ref_model = copy.deepcopy(qmodel)
    for name, m in list(ref_model.named_modules()):
        if isinstance(m, qgemv.QuantLinear):
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            lin.weight.data = m.dequantize()
            qgemv.nn.set_submodule(ref_model, name, lin)
    with torch.no_grad():
        out = qmodel(ids).logits
        ref = ref_model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # and the quantized model is still close to the float one
    rel = ((out - base).norm() / base.norm()).item()
    assert rel < (0.02 if bits == 8 else 0.3), rel


def test_quantize_model_skip_and_overrides():
    model = _tiny_llama()
    report = qgemv.quantize_model(
        model, bits=8, skip=("lm_head", r"layers\.1\.mlp"), overrides={r"self_attn\.o_proj": dict(bits=4, group_size=32)}
    )
    assert "model.layers.1.mlp.down_proj" in report.skipped
    assert model.model.layers[0].self_attn.o_proj.bits == 4
    assert model.model.layers[0].self_attn.q_proj.bits == 8
    assert isinstance(model.model.layers[1].mlp.up_proj, nn.Linear)


def test_import_does_not_initialise_cuda():
    code = "import torch, qgemv; import sys; sys.exit(1 if torch.cuda.is_initialized() else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_info_cli_reports_backends():
    out = subprocess.run([sys.executable, "-m", "qgemv", "info"], capture_output=True, text=True, check=True).stdout
    assert "torch:" in out and "linear_int4_grouped" in out and "backend:" in out


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, None)])
def test_fused_projections_equal_unfused_quantized(bits, group):
    import copy

    model = _tiny_llama()
    fused = copy.deepcopy(model)
    n = qgemv.nn.fuse_llama_projections(fused, bits=bits, group_size=group)
    assert n == 4  # 2 layers x (qkv, gate_up)
    qgemv.quantize_model(fused, bits=bits, group_size=group)
    qgemv.quantize_model(model, bits=bits, group_size=group)
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.qkv, qgemv.nn.FusedQuantLinear) and isinstance(attn.q_proj, qgemv.nn.FusedSlice)
    ids = torch.randint(0, 128, (2, 9))
    x = torch.randn(2, 9, 64)
    # member outputs equal the separately quantized modules' outputs (per-channel/group
    # scales are per output row, so concatenating rows does not change any code)
    for name in ("q_proj", "k_proj", "v_proj"):
        torch.testing.assert_close(getattr(attn, name)(x), getattr(model.model.layers[0].self_attn, name)(x),
                                   rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_permuted_input():
    """perm: W stored as W[:, perm], x gathered as x[..., perm]; dequantize() gives W in x's order; a bad
    perm is refused; only linears with one perm fuse."""
    from qgemv.nn import fuse_linears

    lin = torch.nn.Linear(64, 48, bias=False)
    perm = torch.randperm(64)
    stored = torch.nn.Linear(64, 48, bias=False)
    stored.weight.data = lin.weight.data[:, perm]
    q = qgemv.QuantLinear.from_linear(stored, 4, 32, False)
    q.perm = perm
    x = torch.randn(3, 64)
    torch.testing.assert_close(q(x), x @ q.dequantize().t(), rtol=1e-5, atol=1e-5)
    assert (q.dequantize() - lin.weight).abs().max() < 0.2 * lin.weight.abs().max()  # W itself, not W[:, perm]
    other = qgemv.QuantLinear.from_linear(stored, 4, 32, False)
    other.perm = perm.clone()
    fused = fuse_linears([q, other])
    assert torch.equal(fused.perm, perm) and torch.equal(fused(x), torch.cat([q(x), other(x)], -1))
    other.perm = torch.randperm(64)
    assert fuse_linears([q, other]) is None
    q.perm = torch.zeros(64, dtype=torch.int64)
    with pytest.raises(ValueError, match="perm must be an int64 permutation"):
        q(x)
