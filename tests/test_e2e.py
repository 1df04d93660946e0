"""End-to-end scale tuning (calibration/e2e.py)."""

import json

import pytest
import torch

from qgemv import checkpoint
from qgemv import formats
from qgemv.nn import QuantLinear

from qgemv.calibration.data import calibration_samples
from qgemv.calibration.quantize import quantize_causal_lm

from conftest import load_tiny


def test_e2e_scale_tuning_lowers_the_kl_and_keeps_the_codes(tiny_llama_dir):
    """calibration/e2e.py: tuning only the scales against the float model's
    log-probs lowers the held-out KL; codes and zero points are untouched, the
    modules are QuantLinear again, and the written fp16 scales give the KL
    the report names (fp32 forwards, so the check is exact up to fp16 scales)."""
    from qgemv.calibration.e2e import _kl, teacher_logprobs, tune_scales

    model, tok = load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=12, seq_len=64, seed=0)
    teacher = teacher_logprobs(model, windows, progress=False)
    quantize_causal_lm(model, formats.QuantConfig(4, 32, False), "rtn", windows[:8], progress=False, batch_size=4)
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


def test_e2e_streamed_teacher_equals_the_stored_one(tiny_llama_dir):
    """--stream-teacher computes the same log-probs as the stored tensor, so a
    cosine-schedule run with either gives bit-identical scales (and different
    ones from a constant schedule); a bad schedule name is an error."""
    from qgemv.calibration.e2e import StreamedTeacher, teacher_logprobs, tune_scales

    ref, tok = load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=10, seq_len=48, seed=0)
    stored = teacher_logprobs(ref, windows, progress=False)
    streamed = StreamedTeacher(ref, windows, probe=3, progress=False)
    assert streamed.shape == stored.shape
    for i in (0, 6, 7, 9):  # training windows computed on demand, probe windows kept
        assert torch.equal(streamed[i], stored[i])
    scales = []
    for teacher, schedule in ((stored, "cosine"), (streamed, "cosine"), (stored, "constant")):
        model, _ = load_tiny(tiny_llama_dir)
        quantize_causal_lm(model, formats.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
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
    from qgemv.calibration.e2e import StreamedTeacher, _teacher_rows, teacher_logprobs, tune_scales

    ref, tok = load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=11, seq_len=40, seed=3)
    stored = teacher_logprobs(ref, windows, progress=False)
    streamed = StreamedTeacher(ref, windows, probe=3, progress=False)
    # one batched forward vs one window at a time: same log-probs up to bf16 rounding of fp32 noise
    diff = (_teacher_rows(streamed, [5, 0, 7]).float() - _teacher_rows(stored, [5, 0, 7]).float()).abs().max()
    assert diff < 0.05, diff
    with pytest.raises(IndexError):
        streamed.rows([1, 9])  # a probe window
    scales = []
    for teacher, batch in ((stored, 3), (stored, 1)):
        model, _ = load_tiny(tiny_llama_dir)
        quantize_causal_lm(model, formats.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
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
    from qgemv.calibration.data import train_and_probe_windows
    from qgemv.text import load_text

    _, tok = load_tiny(tiny_llama_dir)
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


def test_e2e_time_limit_stops_early_and_writes_the_best(tiny_llama_dir):
    """time_limit: training stops after the first step past the limit, the probe
    is measured there, and the report says how many steps ran."""
    from qgemv.calibration.e2e import teacher_logprobs, tune_scales

    model, tok = load_tiny(tiny_llama_dir)
    windows = calibration_samples(tok, n=8, seq_len=32, seed=4)
    teacher = teacher_logprobs(model, windows, progress=False)
    quantize_causal_lm(model, formats.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
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
    from qgemv.calibration.e2e import teacher_logprobs, tune_scales

    scales, kl = {}, {}
    for dev in ("cpu", "cuda"):
        model, tok = load_tiny(tiny_llama_dir)
        windows = calibration_samples(tok, n=10, seq_len=48, seed=1)
        quantize_causal_lm(model, formats.QuantConfig(4, 32, False), "rtn", windows[:6], progress=False, batch_size=3)
        ref, _ = load_tiny(tiny_llama_dir)
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
    from qgemv.calibration import cli, e2e

    src, out = tmp_path / "q", tmp_path / "q_e2e"
    assert cli.main([tiny_llama_dir, "--bits", "4", "--group-size", "32", "--asym", "--method", "rtn",
                     "--out", str(src)]) == 0
    assert e2e.main([str(src), "--out", str(out), "--reference", tiny_llama_dir, "--samples", "6", "--probe", "2",
                     "--seq-len", "48", "--steps", "6", "--eval-every", "3", "--stream-teacher",
                     "--schedule", "cosine", "--batch", "2", "--time-limit", "600"]) == 0
    e = json.loads((out / "config.json").read_text())["quantization_config"]["calibration"]["e2e"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["algorithm"] == "rtn+e2e"
    assert e["steps"] == 6 and e["steps_done"] == 6 and e["probe_kl_best"] <= e["probe_kl_start"]
    assert e["stream_teacher"] is True and e["schedule"] == "cosine" and e["batch"] == 2
    assert e["forward_dtype"] in ("float32", "bfloat16")  # "auto", resolved
    assert json.loads((out / "e2e_report.json").read_text())["batch"] == 2
    model, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
    start, _ = checkpoint.load_quantized(str(src), dtype=torch.float32)
    q, q0 = model.model.layers[0].self_attn.qkv.fused, start.model.layers[0].self_attn.qkv.fused  # (fused: format 3)
    assert isinstance(q, QuantLinear) and torch.equal(q.qweight, q0.qweight) and not torch.equal(q.scales, q0.scales)
    assert e2e.main([str(src), "--out", str(out), "--reference", tiny_llama_dir]) == 2  # exists, no --overwrite
    assert e2e.main([tiny_llama_dir, "--out", str(tmp_path / "x"), "--reference", tiny_llama_dir]) == 2  # not qgemv
