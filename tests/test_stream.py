"""Streamed quantization of a sharded checkpoint, layer by layer (calibration/layerwise.py, qgemv-quantize --stream)."""

import json
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import qgemv
from qgemv import checkpoint
from qgemv.calibration import cli
from qgemv.calibration import layerwise as cstream
from qgemv.calibration.data import calibration_samples
from qgemv.formats import QuantConfig
from qgemv.safetensors_io import Reader

from conftest import load_tiny

transformers = pytest.importorskip("transformers")

GPTQ = ["--method", "gptq", "--act-order", "--samples", "6", "--seq-len", "24", "--batch-size", "4"]
AWQ = ["--method", "awq", "--samples", "6", "--seq-len", "24"]


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


def _same_checkpoints(a_dir, b_dir, keys_equal=True):
    a, _ = checkpoint.read_checkpoint_tensors(a_dir)
    b, _ = checkpoint.read_checkpoint_tensors(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    qa, qb = (json.loads((Path(d) / "config.json").read_text())["quantization_config"] for d in (a_dir, b_dir))
    for key in ("converted", "fused", "module_overrides", "modules_not_converted", "bits", "group_size", "symmetric",
                "algorithm"):
        assert qa[key] == qb[key], key
    return qa, qb


@pytest.mark.parametrize("method", [["--method", "rtn"], GPTQ, AWQ], ids=["rtn", "gptq-act-order", "awq"])
def test_streamed_checkpoint_equals_the_in_memory_one(sharded, tmp_path, method):
    common = [str(sharded), "--bits", "4", "--group-size", "32", "--asym"] + method
    assert cli.main(common + ["--out", str(tmp_path / "mem")]) == 0
    assert cli.main(common + ["--stream", "--out", str(tmp_path / "st")]) == 0
    assert len(checkpoint.checkpoint_files(tmp_path / "st")) == 3  # one shard per layer, one for the rest
    qa, qb = _same_checkpoints(tmp_path / "mem", tmp_path / "st")
    assert qb["streamed"] is True and qa["fused"]
    assert not (tmp_path / "st.partial").exists()
    report = json.loads((tmp_path / "st" / "quantize_report.json").read_text())
    assert report["most_float_layers_held"] == 1 and report["layers"] == 2
    if method is not GPTQ:
        return
    assert qb["calibration"]["act_order"] is True
    assert report["steps_seconds"]["hessian"] > 0 and report["steps_seconds"]["solve"] > 0
    model, tok = checkpoint.load_quantized(str(tmp_path / "st"), dtype=torch.float32)
    assert tok is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_streamed_gptq_on_cuda_agrees_with_the_in_memory_path(sharded, tmp_path):
    """On the GPU the streamed path computes layer 0's rotary tables there, the in-memory path on the CPU,
    so the two agree up to floating-point order: at least 98% of the dequantized weights are equal."""
    common = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--device", "cuda"] + GPTQ
    assert cli.main(common + ["--out", str(tmp_path / "mem")]) == 0
    assert cli.main(common + ["--stream", "--out", str(tmp_path / "st")]) == 0
    a, _ = checkpoint.load_quantized(str(tmp_path / "mem"), dtype=torch.float32)
    b, _ = checkpoint.load_quantized(str(tmp_path / "st"), dtype=torch.float32)
    same = total = 0
    for n, m in a.named_modules():
        if isinstance(m, qgemv.QuantLinear):
            wa, wb = m.dequantize(), b.get_submodule(n).dequantize()
            same, total = same + int((wa == wb).sum()), total + wa.numel()
    assert total > 0 and same / total >= 0.98, same / total
    report = json.loads((tmp_path / "st" / "quantize_report.json").read_text())
    assert report["peak_gpu_mb"] > 0 and report["device"] == "cuda"


def test_at_most_one_float_layer_is_alive(sharded, tmp_path, monkeypatch):
    """Counted on the memory itself: each layer's float parameter storages are tracked until they are freed."""
    seen, most = {}, [0]
    materialize = cstream._materialize

    def float_layers_alive():
        return sum(1 for refs in seen.values() if any(r() is not None for r in refs))

    def tracked(module, prefix, reader, device):
        out = materialize(module, prefix, reader, device)
        if ".layers." in prefix:
            seen[prefix] = [weakref.ref(p.untyped_storage()) for p in out.parameters()]
            most[0] = max(most[0], float_layers_alive())
        return out

    monkeypatch.setattr(cstream, "_materialize", tracked)
    model, tok = load_tiny(str(sharded))
    samples = calibration_samples(tok, "default", 4, 16, 0)
    del model
    rep = cstream.quantize_streaming(str(sharded), str(tmp_path / "q"), QuantConfig(4, 32, False), "gptq", samples,
                                     progress=False)
    assert most[0] == 1 and rep.most_float_layers_held == 1  # of 2 layers
    assert len(rep.converted) == 2 * 4 and "lm_head" in rep.skipped
    assert float_layers_alive() == 0


def test_resume_after_an_interruption_gives_the_same_checkpoint(sharded, tmp_path):
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym"] + GPTQ
    assert cli.main(args + ["--stream", "--out", str(tmp_path / "whole")]) == 0
    model, tok = load_tiny(str(sharded))
    samples = calibration_samples(tok, "default", 6, 24, 0)

    def stop(li):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cstream.quantize_streaming(str(sharded), str(tmp_path / "cut"), QuantConfig(4, 32, False), "gptq", samples,
                                   act_order=True, batch_size=4, progress=False, on_layer=stop,
                                   calibration=cli._calib_record(cli.build_parser().parse_args(
                                       args + ["--out", "x", "--seq-len", "24"])))
    assert not (tmp_path / "cut").exists()
    progress = json.loads((tmp_path / "cut.partial" / "progress.json").read_text())
    assert progress["done"] == [0]
    assert cli.main(args + ["--stream", "--out", str(tmp_path / "cut")]) == 2  # not without --resume
    assert cli.main(args + ["--stream", "--resume", "--out", str(tmp_path / "cut")]) == 0
    _same_checkpoints(tmp_path / "whole", tmp_path / "cut")
    report = json.loads((tmp_path / "cut" / "quantize_report.json").read_text())
    assert report["resumed_layers"] == [0]


def test_rtn_resume_reads_no_finished_layer_again(sharded, tmp_path, monkeypatch):
    """RTN needs no hidden states: a resumed run takes the finished layers' formats from their shard headers
    and reads only the layers still to do."""
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--method", "rtn", "--stream"]
    assert cli.main(args + ["--out", str(tmp_path / "whole")]) == 0

    def stop(li):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cstream.quantize_streaming(str(sharded), str(tmp_path / "cut"), QuantConfig(4, 32, False), "rtn",
                                   progress=False, on_layer=stop)
    read, materialize = [], cstream._materialize
    monkeypatch.setattr(cstream, "_materialize",
                        lambda m, prefix, *a: read.append(prefix) or materialize(m, prefix, *a))
    assert cli.main(args + ["--resume", "--out", str(tmp_path / "cut")]) == 0
    assert not any(p.startswith("model.layers.0.") for p in read) and "model.layers.1." in read
    _same_checkpoints(tmp_path / "whole", tmp_path / "cut")


def test_resume_after_kill_9(sharded, tmp_path):
    """A real SIGKILL of the CLI after its first layer is written; --resume then finishes it."""
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--stream"] + GPTQ
    assert cli.main(args + ["--out", str(tmp_path / "whole")]) == 0
    code = (
        "import os, signal, sys\n"
        "from qgemv import safetensors_io as stream\n"
        "from qgemv.calibration import cli\n"
        "write = stream.LayerWriter.write_unit\n"
        "def kill_after(self, unit, *a, **k):\n"
        "    write(self, unit, *a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "stream.LayerWriter.write_unit = kill_after\n"
        f"sys.exit(cli.main({args + ['--out', str(tmp_path / 'cut')]!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent)))
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert json.loads((tmp_path / "cut.partial" / "progress.json").read_text())["done"] == [0]
    assert cli.main(args + ["--resume", "--out", str(tmp_path / "cut")]) == 0
    _same_checkpoints(tmp_path / "whole", tmp_path / "cut")


def test_a_failure_before_any_finished_layer_leaves_nothing(sharded, tmp_path, monkeypatch):
    """A run that fails before finishing a layer leaves no work directory, and one that left an empty
    record (killed at that point) does not stand in a new run's way; one with a finished layer does."""
    def broken(*a, **k):
        raise RuntimeError("solver exploded")

    monkeypatch.setattr(cstream, "quantize_layer", broken)
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--stream", "--out", str(tmp_path / "q")]
    args += GPTQ
    with pytest.raises(RuntimeError, match="exploded"):
        cli.main(args)
    assert not (tmp_path / "q.partial").exists() and not (tmp_path / "q").exists()
    monkeypatch.undo()
    (tmp_path / "q.partial").mkdir()
    (tmp_path / "q.partial" / "progress.json").write_text(json.dumps({"fingerprint": {}, "done": []}))
    assert cli.main(args) == 0 and not (tmp_path / "q.partial").exists()


def test_a_crash_after_a_finished_layer_says_how_to_resume(sharded, tmp_path, monkeypatch, capsys):
    real, calls = cstream.quantize_layer, []

    def second_fails(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(cstream, "quantize_layer", second_fails)
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--stream", "--out", str(tmp_path / "q")]
    with pytest.raises(RuntimeError, match="simulated"):
        cli.main(args + GPTQ)
    err = capsys.readouterr().err
    assert "1 finished layer(s) are kept" in err and "--resume" in err
    monkeypatch.undo()
    assert cli.main(args + GPTQ + ["--resume"]) == 0


def test_a_second_run_on_the_same_out_waits_for_no_one(sharded, tmp_path, capsys):
    """While a run holds OUT.partial's lock, another run for OUT (fresh, --resume, RTN or GPTQ) is refused with
    exit 2 and touches nothing; once that process is gone (here: killed), its lock is taken over."""
    out = tmp_path / "q"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom qgemv.safetensors_io import RunLock\n"
         f"lock = RunLock({str(out)!r})\nprint('held', flush=True)\ntime.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "q.partial").mkdir()
        (tmp_path / "q.partial" / "progress.json").write_text(json.dumps({"fingerprint": {}, "done": []}))
        common = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--stream", "--out", str(out)]
        for extra in (["--method", "rtn"], GPTQ, ["--method", "rtn", "--resume"]):
            capsys.readouterr()
            assert cli.main(common + extra) == 2, extra
            assert f"another run (pid {holder.pid}) is writing" in capsys.readouterr().err
            assert (tmp_path / "q.partial" / "progress.json").exists() and not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert cli.main(common + ["--method", "rtn"]) == 0  # the dead run's lock is taken over
    assert out.is_dir() and not (tmp_path / "q.partial").exists() and not (tmp_path / "q.partial.lock").exists()
    deep = tmp_path / "new" / "dirs" / "q"  # an --out whose parents do not exist yet
    assert cli.main(common[:-1] + [str(deep), "--method", "rtn"]) == 0 and deep.is_dir()


def _interrupted_after_layer_0(sharded, tmp_path, monkeypatch, args):
    real, calls = cstream.quantize_layer, []

    def second_fails(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stopped (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(cstream, "quantize_layer", second_fails)
    with pytest.raises(RuntimeError, match="simulated"):
        cli.main(args)
    monkeypatch.undo()
    work = Path(str(args[args.index("--out") + 1]) + ".partial")
    assert json.loads((work / "progress.json").read_text())["done"] == [0]
    return work


@pytest.mark.parametrize("damage", ["truncated shard", "garbage resume file", "shard of another layer"])
def test_resume_recomputes_a_damaged_layer_and_names_its_file(sharded, tmp_path, monkeypatch, damage):
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--stream"] + GPTQ
    assert cli.main(args + ["--out", str(tmp_path / "whole")]) == 0
    work = _interrupted_after_layer_0(sharded, tmp_path, monkeypatch, args + ["--out", str(tmp_path / "cut")])
    shard = work / "model-00001-of-00003.safetensors"
    if damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:100])
        named = shard.name
    elif damage == "garbage resume file":
        (work / "unit-00000.resume.safetensors").write_bytes(b"\x07" * 64)
        named = "unit-00000.resume.safetensors"
    else:  # layer 0's shard under layer 1's name, recorded as done
        (work / "model-00002-of-00003.safetensors").write_bytes(shard.read_bytes())
        prog = json.loads((work / "progress.json").read_text())
        (work / "progress.json").write_text(json.dumps(dict(prog, done=[0, 1])))
        named = "model-00002-of-00003.safetensors"
    with pytest.warns(RuntimeWarning, match=f"{named}.*computed again"):
        assert cli.main(args + ["--resume", "--out", str(tmp_path / "cut")]) == 0
    _same_checkpoints(tmp_path / "whole", tmp_path / "cut")


@pytest.mark.parametrize("edit,rule", [
    (lambda p: p.update(done=5), "done is 5, not a list"),
    (lambda p: p.update(done=None), "done is None, not a list"),
    (lambda p: p.update(fingerprint=[1]), "fingerprint is list"),
    (lambda p: p.update(done=["0"]), "not a list of layer numbers"),
    ("rtn", "model-00001-of-00003.safetensors was written with other settings \\(.*method: 'gptq' then, 'rtn' now"),
], ids=["done-5", "done-null", "fingerprint-list", "done-str", "method-edited"])
def test_resume_refuses_a_tampered_record_before_any_work(sharded, tmp_path, monkeypatch, capsys, edit, rule):
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--stream"] + GPTQ
    work = _interrupted_after_layer_0(sharded, tmp_path, monkeypatch, args + ["--out", str(tmp_path / "cut")])
    prog = json.loads((work / "progress.json").read_text())
    again = args
    if edit == "rtn":  # the record edited to what an RTN run records, then resumed as RTN
        again = args[:7] + ["--method", "rtn"]
        seen = []

        class Stop(Exception):
            pass

        def record(out, units, fingerprint, resume=False):
            seen.append(json.loads(json.dumps(fingerprint, default=str)))
            raise Stop

        monkeypatch.setattr(cstream, "LayerWriter", record)
        with pytest.raises(Stop):
            cli.main(again + ["--out", str(tmp_path / "other")])
        monkeypatch.undo()
        prog["fingerprint"] = seen[0]
    else:
        edit(prog)
    (work / "progress.json").write_text(json.dumps(prog))
    capsys.readouterr()
    assert cli.main(again + ["--resume", "--out", str(tmp_path / "cut")]) == 2
    assert re.search(rule, capsys.readouterr().err)


def test_a_full_disk_is_exit_2_with_what_was_kept(sharded, tmp_path, monkeypatch, capsys):
    import errno

    from qgemv import safetensors_io as stream

    real, writes = stream.write_safetensors, []

    def second_write_fails(path, *a, **k):
        writes.append(path)
        if len(writes) == 3:  # layer 0's .resume file and shard, then layer 1's .resume file
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr(stream, "write_safetensors", second_write_fails)
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--stream", "--out", str(tmp_path / "q")]
    capsys.readouterr()
    assert cli.main(args + GPTQ) == 2
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "1 finished layer(s) are kept" in err and "--resume" in err
    assert not list((tmp_path / "q.partial").glob("*.tmp"))
    monkeypatch.undo()
    assert cli.main(args + GPTQ + ["--resume"]) == 0

    def full(*a, **k):
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                           "\"No space left on device\" })")

    monkeypatch.setattr(checkpoint, "save_tensors", full)
    assert cli.main([str(sharded), "--bits", "8", "--method", "rtn", "--out", str(tmp_path / "w")]) == 2
    assert "no space left on the device while writing" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]


def test_resume_refuses_other_settings(sharded, tmp_path, capsys):
    args = [str(sharded), "--bits", "4", "--group-size", "32", "--asym", "--stream", "--out", str(tmp_path / "q")]
    (tmp_path / "q.partial").mkdir()
    (tmp_path / "q.partial" / "progress.json").write_text(json.dumps(
        {"fingerprint": {"method": "gptq", "bits": 8}, "done": []}))
    capsys.readouterr()
    assert cli.main(args + ["--method", "rtn", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "bits" in err and "method" in err and "other settings" in err


def test_stream_refuses_what_it_does_not_do(sharded, tmp_path, capsys):
    common = [str(sharded), "--bits", "4", "--out", str(tmp_path / "q")]
    assert cli.main(common + ["--method", "rtn", "--stream", "--rotate"]) == 2
    assert cli.main(common + ["--method", "rtn", "--resume"]) == 2
    assert "add --stream" in capsys.readouterr().err
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def test_written_files_are_safetensors_and_lazy_tensors_load_one_at_a_time(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from qgemv.safetensors_io import Lazy, write_safetensors

    alive = []

    def big(seed):
        def load():
            assert not any(r() is not None for r in alive)  # the previous lazy tensor is gone
            t = torch.randn(64, 33, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
            alive.append(weakref.ref(t.untyped_storage()))
            return t
        return load

    ts = {"a": torch.randn(3, 5), "q": torch.randint(-5, 5, (4, 4), dtype=torch.int32),
          "odd": torch.ones(3, dtype=torch.uint8), "e": torch.zeros(0, 2, dtype=torch.float16),
          "lazy1": Lazy(torch.bfloat16, (64, 33), big(1)),
          "lazy2": Lazy(torch.bfloat16, (64, 33), big(2))}
    write_safetensors(tmp_path / "x.safetensors", ts, {"format": "pt", "v": 3})
    got = load_file(str(tmp_path / "x.safetensors"))
    assert sorted(got) == sorted(ts)
    for k, v in ts.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    for k, seed in (("lazy1", 1), ("lazy2", 2)):
        alive.clear()
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], big(seed)()), k
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "v": "3"}
    with pytest.raises(ValueError, match="announced"):
        write_safetensors(tmp_path / "y.safetensors", {"w": Lazy(torch.float32, (2,), lambda: torch.zeros(3))})


def test_reader_reads_without_mapping_and_names_a_truncated_tensor(tmp_path):
    from safetensors.torch import save_file

    ts = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int32), "c": torch.randn(4).to(torch.bfloat16),
          "e": torch.zeros(0, 3)}
    save_file(ts, str(tmp_path / "model.safetensors"))
    r = Reader(tmp_path)
    for k, v in ts.items():
        got = r.get(k)
        assert got.dtype == v.dtype and torch.equal(got, v), k
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "model.safetensors") - 4)
    with pytest.raises(checkpoint.CheckpointError, match="tensor"):
        Reader(tmp_path).get("c")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("method", [GPTQ, ["--method", "awq_gptq", "--samples", "6", "--seq-len", "24"]],
                         ids=["gptq", "awq_gptq"])
def test_streamed_qwen_equals_the_in_memory_one(tiny_llama_dir, tmp_path, family, method):
    """q/k/v biases (Qwen2, scaled by AWQ along with v_proj) and q/k norms (Qwen3) go through the
    streamed path, resumed mid-way, exactly as through the in-memory one."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    cfg = (transformers.Qwen2Config(**kw) if family == "qwen2"
           else transformers.Qwen3Config(head_dim=16, **kw))
    torch.manual_seed(7)
    model = (transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.Qwen3ForCausalLM)(cfg)
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        for layer in model.model.layers:
            layer.self_attn.v_proj.bias.data.normal_(0, 0.5)
    src = tmp_path / "src"
    model.to(torch.bfloat16).save_pretrained(src, max_shard_size="40KB")
    tok.save_pretrained(src)
    args = [str(src), "--bits", "4", "--group-size", "32", "--asym"] + method
    assert cli.main(args + ["--out", str(tmp_path / "mem")]) == 0

    def stop(li):
        raise KeyboardInterrupt

    parsed = cli.build_parser().parse_args(args + ["--out", str(tmp_path / "st"), "--stream"])
    samples = calibration_samples(tok, "default", 6, 24, 0)
    with pytest.raises(KeyboardInterrupt):
        cstream.quantize_streaming(str(src), str(tmp_path / "st"), QuantConfig(4, 32, False), parsed.method,
                                   samples, act_order=parsed.act_order, batch_size=parsed.batch_size,
                                   progress=False, on_layer=stop, calibration=cli._calib_record(parsed))
    assert cli.main(args + ["--stream", "--resume", "--out", str(tmp_path / "st")]) == 0
    _same_checkpoints(tmp_path / "mem", tmp_path / "st")


def test_the_old_module_names_still_import_with_a_warning():
    """qgemv.stream and qgemv.calibration.stream were renamed (two files of one name meant different things)."""
    import importlib
    import sys

    for old, new in (("qgemv.stream", "qgemv.safetensors_io"), ("qgemv.calibration.stream", "qgemv.calibration.layerwise")):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=new):
            mod = importlib.import_module(old)
        assert mod is importlib.import_module(new)
