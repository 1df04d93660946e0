"""Streamed RTN quantization of a sharded checkpoint (qgemv.stream, qgemv-quantize --stream)."""

import json
import weakref

import pytest
import torch

from qgemv import checkpoint, stream
from qgemv.calibration import cli
from qgemv.formats import QuantConfig

from conftest import load_tiny

transformers = pytest.importorskip("transformers")


@pytest.fixture()
def sharded(tiny_llama_dir, tmp_path):
    """The tiny Llama (2 layers, 14 linears) in bf16 with its own lm_head, saved in small shards."""
    model, tok = load_tiny(tiny_llama_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone() * 0.5)
    d = tmp_path / "src"
    model.to(torch.bfloat16).save_pretrained(d, max_shard_size="40KB")
    tok.save_pretrained(d)
    assert len(checkpoint.checkpoint_files(d)) > 3
    return d


def test_streamed_checkpoint_equals_the_in_memory_one(sharded, tmp_path):
    common = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--method", "rtn"]
    assert cli.main(common + ["--out", str(tmp_path / "mem")]) == 0
    assert cli.main(common + ["--stream", "--shard-mb", "0.03", "--out", str(tmp_path / "st")]) == 0
    a, _ = checkpoint.read_checkpoint_tensors(tmp_path / "mem")
    b, _ = checkpoint.read_checkpoint_tensors(tmp_path / "st")
    assert len(checkpoint.checkpoint_files(tmp_path / "st")) > 1  # sharded, with an index
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    qa, qb = (json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("mem", "st"))
    for key in ("converted", "fused", "module_overrides", "modules_not_converted", "bits", "group_size", "symmetric"):
        assert qa[key] == qb[key], key
    assert qb["streamed"] is True and qa["fused"]
    model, tok = checkpoint.load_quantized(str(tmp_path / "st"), dtype=torch.float32)
    assert tok is not None


def test_at_most_one_projection_group_of_float_weights_is_held(sharded, tmp_path, monkeypatch):
    """Counted on the tensors themselves: every float linear weight read is tracked until it is freed."""
    alive, most = set(), [0]
    read = stream._read_linear

    def tracked(reader, name, lin):
        real = read(reader, name, lin)
        alive.add(name)
        weakref.finalize(real.weight, alive.discard, name)
        most[0] = max(most[0], len(alive))
        return real

    monkeypatch.setattr(stream, "_read_linear", tracked)
    rep = stream.quantize_rtn_streaming(str(sharded), str(tmp_path / "q"), QuantConfig(8), progress=False)
    assert len(rep["converted"]) == 4 + 2 * 2  # fused qkv and gate_up, o_proj and down_proj, per layer
    assert most[0] == 3 < 15  # q/k/v at most, of 14 linears and lm_head
    assert rep["most_float_linears_held"] <= 3 and "lm_head" in rep["skipped"]


def test_stream_refuses_what_it_does_not_do(sharded, tmp_path, capsys):
    common = [str(sharded), "--bits", "4", "--stream", "--out", str(tmp_path / "q")]
    assert cli.main(common + ["--method", "gptq"]) == 2
    assert "RTN only" in capsys.readouterr().err
    assert cli.main(common + ["--method", "rtn", "--rotate"]) == 2
    assert not (tmp_path / "q").exists()
