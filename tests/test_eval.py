"""Evaluation: ppl against a hand computation, KL / top-1 identities, the regression check."""

import math
import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from qgemv import checkpoint
from qgemv import formats

from qgemv.calibration.quantize import quantize_causal_lm
from qgemv.eval import ppl_check
from qgemv.eval.ppl import Protocol, evaluate, make_windows

from conftest import dev_module, requires_smollm2


def test_windows_follow_the_protocol():
    ids = torch.arange(100)
    w = make_windows(ids, Protocol(ctx=11, bos=True))  # 10 text tokens per window
    assert len(w) == 10 and torch.equal(w[3][0], torch.arange(30, 40)) and w[3][1] == 10
    w = make_windows(ids, Protocol(ctx=11, bos=True, stride=5))
    assert w[0][1] == 10 and all(n == 5 for _, n in w[1:])
    w = make_windows(ids, Protocol(ctx=11, windows=3, seed=1))
    assert len(w) == 3
    assert [t[0][0].item() for t in w] == [t[0][0].item() for t in make_windows(ids, Protocol(ctx=11, windows=3, seed=1))]
    with pytest.raises(ValueError, match="fewer than one window"):
        make_windows(torch.arange(5), Protocol(ctx=11))


def test_ppl_matches_hand_computation(tiny_llama_dir):
    model, tok = checkpoint.load_float_model(tiny_llama_dir)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    proto = Protocol(ctx=33, windows=0, bos=True)
    rep = evaluate({"m": model}, tok, proto, text=text, batch=3, progress=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 32 + 1, 32):
            x = torch.cat([torch.tensor([tok.bos_token_id]), ids[s : s + 32]])[None]
            lp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
            nll -= lp.gather(-1, x[0, 1:, None]).sum().item()
            n += 32
    r = rep["results"][0]
    assert r["tokens"] == n
    assert math.isclose(r["ppl"], math.exp(nll / n), rel_tol=1e-4)
    assert "BOS" in rep["protocol_text"]


def test_model_against_itself_has_zero_kl_and_full_agreement(tiny_llama_dir):
    model, tok = checkpoint.load_float_model(tiny_llama_dir)
    rep = evaluate({"a": model, "b": model}, tok, Protocol(ctx=64, windows=4), batch=2, progress=False)
    b = rep["results"][1]
    assert abs(b["kl"]) < 1e-6 and b["top1_pct"] == 100.0 and abs(b["delta_ppl_pct"]) < 1e-9
    assert b["delta_ppl_se_pct"] < 1e-9


def test_paired_se_of_delta_ppl():
    from qgemv.eval.ppl import Metrics

    ref, q = Metrics("ref"), Metrics("q")
    ref.win_nll = [(20.0, 10), (30.0, 10)]
    q.win_nll = [(21.0, 10), (33.0, 10)]  # per-window differences 1 and 3 nats over 10 tokens each
    ref.tokens = q.tokens = 20
    ref.nll_sum, q.nll_sum = 50.0, 54.0
    # mean log-ratio 0.2; window spread: ((1-2)^2 + (3-2)^2) * 2/1 = 4 -> s.e. of the mean 2/20
    assert math.isclose(q.paired_se(ref), 100 * math.exp(0.2) * 0.1, rel_tol=1e-12)
    assert math.isclose(q.summary(ref)["delta_ppl_pct"], 100 * (math.exp(0.2) - 1), rel_tol=1e-12)
    # the same shift in every window: Δppl is not zero, its spread is
    q.win_nll = [(22.0, 10), (32.0, 10)]
    assert q.paired_se(ref) == 0.0 and q.summary(ref)["delta_ppl_pct"] > 0
    q.win_nll = q.win_nll[:1]  # windows that do not line up give no s.e.
    assert q.paired_se(ref) is None and "delta_ppl_se_pct" not in q.summary(ref)


@pytest.fixture(scope="module")
def int4_checkpoint(tiny_llama_dir, tmp_path_factory):
    model, tok = checkpoint.load_float_model(tiny_llama_dir)
    rep = quantize_causal_lm(model, formats.QuantConfig(4), "rtn", progress=False)
    out = tmp_path_factory.mktemp("ck") / "int4"
    checkpoint.save_quantized(model, tok, str(out), checkpoint.quantization_config(model, "rtn", None, formats.QuantConfig(4), list(rep.skipped)))
    return str(out)


def test_check_exit_codes(tiny_llama_dir, int4_checkpoint, capsys):
    common = ["--reference", tiny_llama_dir, "--quantized", int4_checkpoint, "--ctx", "64", "--windows", "4"]
    # generous thresholds pass ...
    assert ppl_check.main(common + ["--max-ppl-increase", "1000%", "--max-kl", "100", "--min-top1", "0"]) == 0
    # ... a KL of exactly 0 is impossible for int4, so --max-kl 0 fails (exit 1) with its margin
    assert ppl_check.main(common + ["--max-ppl-increase", "1000%", "--max-kl", "0", "--min-top1", "0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "KL" in out and "> allowed 0.00000" in out
    assert ppl_check.main(["--reference", tiny_llama_dir, "--quantized", "/nonexistent/dir"]) == 2


def test_a_large_text_is_tokenized_once_in_pieces(tiny_llama_dir, monkeypatch):
    """Pieces cut at newlines give the whole text's tokens (whitespace-split tokenizer: no merge crosses a
    newline); a text over the limit is refused before any tokenizing; ppl-check tokenizes once."""
    from qgemv.eval import ppl

    _, tok = checkpoint.load_float_model(tiny_llama_dir)
    text = "".join(f"line {i} of the quick brown fox\n" for i in range(3000))
    whole = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    monkeypatch.setattr(ppl, "TOKENIZE_PIECE_CHARS", 1000)
    assert torch.equal(ppl.tokenize_text(tok, text), whole)
    monkeypatch.setattr(ppl, "MAX_TEXT_CHARS", 100)
    with pytest.raises(ValueError, match="more than the 0 M this tool reads"):
        ppl.tokenize_text(tok, text)


def test_check_tokenizes_once_and_names_a_vocabulary_mismatch(tiny_llama_dir, int4_checkpoint, tmp_path, capsys,
                                                              monkeypatch):
    import json

    from qgemv.eval import ppl

    calls = []
    real = ppl.tokenize_text
    monkeypatch.setattr(ppl, "tokenize_text", lambda *a: calls.append(1) or real(*a))
    common = ["--reference", tiny_llama_dir, "--ctx", "64", "--windows", "2", "--max-ppl-increase", "1000%",
              "--max-kl", "100", "--min-top1", "0"]
    assert ppl_check.main(common + ["--quantized", int4_checkpoint]) == 0 and len(calls) == 1
    other = tmp_path / "other"
    import shutil

    shutil.copytree(int4_checkpoint, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, vocab_size=cfg["vocab_size"] + 7)))
    capsys.readouterr()
    assert ppl_check.main(common + ["--quantized", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"has a vocabulary of {cfg['vocab_size'] + 7} tokens" in err and "internal error" not in err


def test_check_bad_arguments_exit_2():
    r = subprocess.run([sys.executable, "-m", "qgemv.eval.ppl_check", "--reference", "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "required" in r.stderr
    r = subprocess.run([sys.executable, "-m", "qgemv.eval.ppl_check", "--reference", "x", "--quantized", "y",
                        "--max-ppl-increase", "abc"], capture_output=True, text=True)
    assert r.returncode == 2 and "percentage" in r.stderr


@requires_smollm2
@pytest.mark.slow
def test_smollm2_int8_passes_the_check(tmp_path):
    """CI's real-model check: int8 RTN within 1% ppl of the float model on 3 windows."""
    from qgemv.calibration import cli

    out = tmp_path / "int8"
    assert cli.main(["default", "--bits", "8", "--method", "rtn", "--out", str(out)]) == 0
    rc = ppl_check.main(["--reference", "default", "--quantized", str(out), "--windows", "3",
                         "--max-ppl-increase", "1%", "--max-kl", "0.02", "--min-top1", "90%"])
    assert rc == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_evaluation_on_gpu_matches_cpu(tiny_llama_dir, int4_checkpoint):
    """--device cuda (qgemv kernels, fp16) scores like the CPU reference path (fp32)."""
    from qgemv.eval.ppl import load_models

    proto = Protocol(ctx=64, windows=4)
    m_cpu, tok = load_models(tiny_llama_dir, [int4_checkpoint], "cpu")
    r_cpu = evaluate(m_cpu, tok, proto, progress=False)["results"]
    m_gpu, _ = load_models(tiny_llama_dir, [int4_checkpoint], "cuda")
    r_gpu = evaluate(m_gpu, tok, proto, device="cuda", progress=False)["results"]
    for a, b in zip(r_cpu, r_gpu):
        assert a["tokens"] == b["tokens"]
        assert math.isclose(a["ppl"], b["ppl"], rel_tol=1e-2), (a, b)
    assert r_gpu[1]["top1_pct"] > 90


def test_ship_checkpoint_round_trip(tiny_llama_dir, tmp_path):
    """eval/ship_checkpoint.py: pack drops the embedding and cuts the rest into
    pieces; unpack restores it from the float model (SHA-256 checked) into a
    checkpoint whose every tensor equals the original's. A wrong reference, a
    missing piece or an existing OUT is an error that leaves no OUT behind."""
    from safetensors.torch import load_file, save_file

    from qgemv.calibration import cli
    S = dev_module("ship_checkpoint")

    src = tmp_path / "q"
    assert cli.main([tiny_llama_dir, "--bits", "4", "--group-size", "32", "--asym", "--method", "rtn",
                     "--out", str(src)]) == 0
    parts = S.pack(str(src), str(tmp_path / "p.part"), piece_mb=0.01)
    assert len(parts) > 2 and all(int(p.rsplit("part", 1)[1]) == i for i, p in enumerate(parts))
    out = S.unpack(str(tmp_path / "p.part"), str(tmp_path / "back"), reference=tiny_llama_dir)
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    model, _ = checkpoint.load_quantized(str(out), dtype=torch.float32)
    assert model.model.embed_tokens.weight.shape[0] == a["model.embed_tokens.weight"].shape[0]

    bad_ref = tmp_path / "bad_ref"
    bad_ref.mkdir()
    ref = load_file(str(sorted(Path(tiny_llama_dir).glob("*.safetensors"))[0]))
    ref["model.embed_tokens.weight"] = ref["model.embed_tokens.weight"] + 1e-3
    save_file(ref, str(bad_ref / "model.safetensors"))
    with pytest.raises(ValueError, match="differs"):
        S.unpack(str(tmp_path / "p.part"), str(tmp_path / "bad"), reference=str(bad_ref))
    assert not (tmp_path / "bad").exists()
    os.remove(parts[1])
    with pytest.raises(FileNotFoundError, match="pieces missing"):
        S.unpack(str(tmp_path / "p.part"), str(tmp_path / "bad"), reference=tiny_llama_dir)
    with pytest.raises(FileExistsError):
        S.unpack(str(tmp_path / "p.part"), str(out), reference=tiny_llama_dir)


def test_the_main_job_labels_a_recipe_by_what_was_stored(tmp_path):
    import json

    from qgemv.eval.main_job import stored_formats

    (tmp_path / "quantize_report.json").write_text(json.dumps(
        {"formats": {"a.q_proj": "int4g64a", "a.down_proj": "int4g128a", "b.q_proj": "int4g64a"}}))
    assert stored_formats(str(tmp_path)) == "1 x int4g128a, 2 x int4g64a"
    assert stored_formats(str(tmp_path / "missing")) == "(no quantize_report.json)"


def test_bench_chain_reads_the_activations_type_off_a_dependent_chains_name():
    from qgemv.eval import bench_chain

    assert bench_chain.dep_format("int4g128a") == ("int4g128a", torch.float16)
    assert bench_chain.dep_format("int4g128a_bf16") == ("int4g128a", torch.bfloat16)
    assert bench_chain.dep_format("bf16") == ("bf16", torch.bfloat16)
    assert bench_chain.dep_format("fp16") == ("fp16", torch.float16)
