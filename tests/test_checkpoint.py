"""Quantized checkpoints: interrupted writes, corrupt files, config mismatches, format version 1."""

import json
import os

import pytest
import torch

from qgemv import checkpoint
from qgemv import formats

from qgemv.calibration.quantize import quantize_causal_lm

from conftest import load_tiny


def test_interrupted_write_leaves_nothing_loadable(tiny_llama_dir, tmp_path, monkeypatch):
    import safetensors.torch

    model, tok = load_tiny(tiny_llama_dir)
    quantize_causal_lm(model, formats.QuantConfig(8), "rtn", progress=False)

    def boom(*a, **k):
        raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    out = tmp_path / "q"
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_quantized(model, tok, str(out), checkpoint.quantization_config(model, "rtn", None, formats.QuantConfig(8), []))
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # the temporary directory is gone too


@pytest.fixture
def saved_int8(tiny_llama_dir, tmp_path):
    model, tok = load_tiny(tiny_llama_dir)
    rep = quantize_causal_lm(model, formats.QuantConfig(8), "rtn", progress=False)
    out = tmp_path / "q"
    checkpoint.save_quantized(model, tok, str(out), checkpoint.quantization_config(model, "rtn", None, formats.QuantConfig(8), list(rep.skipped)))
    return out


def test_every_file_gets_the_umask_mode(saved_int8):
    want = 0o666 & ~checkpoint.current_umask()
    modes = {f.name: f.stat().st_mode & 0o777 for f in saved_int8.iterdir()}
    assert modes["model.safetensors"] == want and set(modes.values()) == {want}, modes


def test_truncated_safetensors_is_a_clear_error(saved_int8):
    f = saved_int8 / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or truncated"):
        checkpoint.load_quantized(str(saved_int8))


def test_config_mismatch_is_a_clear_error(saved_int8):
    p = saved_int8 / "config.json"
    cfg = json.loads(p.read_text())
    cfg["quantization_config"]["bits"] = 4
    p.write_text(json.dumps(cfg))
    with pytest.raises(checkpoint.CheckpointError, match=r"qweight has shape .* but the config \(int4"):
        checkpoint.load_quantized(str(saved_int8))
    cfg["quantization_config"]["bits"] = 8
    cfg["quantization_config"]["format_version"] = 99
    p.write_text(json.dumps(cfg))
    with pytest.raises(checkpoint.CheckpointError, match="format_version 99 is not supported"):
        checkpoint.load_quantized(str(saved_int8))


def test_format_version_1_checkpoint_is_converted_on_load(tiny_llama_dir, saved_int8):
    import safetensors.torch

    ids = torch.randint(0, 200, (1, 12))
    model, _ = checkpoint.load_quantized(str(saved_int8), dtype=torch.float32)
    with torch.no_grad():
        want = model(ids).logits
    # Rewrite the checkpoint as version 1 wrote it: row-major packed rows.
    f = saved_int8 / "model.safetensors"
    state = safetensors.torch.load_file(str(f))
    for key in [k for k in state if k.endswith(".qweight")]:
        state[key] = formats.to_panels(state[key], inverse=True)
    safetensors.torch.save_file(state, str(f), metadata={"format": "pt", "qgemv_format_version": "1"})
    p = saved_int8 / "config.json"
    cfg = json.loads(p.read_text())
    cfg["quantization_config"]["format_version"] = 1
    p.write_text(json.dumps(cfg))
    old, _ = checkpoint.load_quantized(str(saved_int8), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(old(ids).logits, want, rtol=0, atol=0)


def test_missing_config_is_a_clear_error(saved_int8):
    (saved_int8 / "config.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="no config.json"):
        checkpoint.load_quantized(str(saved_int8))
