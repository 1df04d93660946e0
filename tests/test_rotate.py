"""calibration/rotate.py: Hadamard orders, and rotations that keep the float function."""

import json

import pytest
import torch

from qgemv import checkpoint
from qgemv import formats

from qgemv.calibration.data import calibration_samples
from qgemv.calibration.quantize import quantize_causal_lm

from conftest import load_tiny


@pytest.mark.parametrize("n", [1, 2, 12, 20, 24, 48, 64, 576])
def test_hadamard_orders(n):
    from qgemv.calibration.rotate import hadamard, random_rotation

    h = hadamard(n)
    assert h is not None and h.shape == (n, n) and set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h @ h.t(), n * torch.eye(n, dtype=torch.float64))
    q = random_rotation(n, seed=3)
    torch.testing.assert_close(q @ q.t(), torch.eye(n, dtype=torch.float64))


def test_random_rotation_without_a_hadamard_order_is_orthogonal():
    from qgemv.calibration.rotate import hadamard, random_rotation

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
    from qgemv.calibration.rotate import rotate_llama

    model, tok = load_tiny(tiny_llama_dir)
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
    from qgemv.calibration.rotate import rotate_llama

    model, _ = load_tiny(tiny_llama_dir)
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.post_attention_layernorm .*bias"):
        rotate_llama(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.config.tie_word_embeddings


def test_rotated_gptq_checkpoint_round_trip(tiny_llama_dir, tmp_path):
    model, tok = load_tiny(tiny_llama_dir)
    _random_norm_gains(model)
    ids = torch.randint(0, len(tok), (2, 24))
    with torch.no_grad():
        base = model(ids).logits
    samples = calibration_samples(tok, n=8, seq_len=64, seed=0)
    rep = quantize_causal_lm(model, formats.QuantConfig(4, 32, False), "gptq", samples, progress=False, batch_size=4,
                             act_order=True, rotate=True, rotate_seed=5)
    assert rep.rotation == {"residual": "hadamard", "head": "hadamard", "seed": 5}
    with torch.no_grad():
        out = model(ids).logits
    qc = checkpoint.quantization_config(model, "gptq", {"samples": 8}, formats.QuantConfig(4, 32, False), list(rep.skipped),
                               rotation=rep.rotation)
    checkpoint.save_quantized(model, tok, str(tmp_path / "q"), qc)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["rotation"]["seed"] == 5
    loaded, _ = checkpoint.load_quantized(str(tmp_path / "q"), dtype=torch.float32)
    with torch.no_grad():
        out2 = loaded(ids).logits
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    assert ((out - base).norm() / base.norm()).item() < 0.5
