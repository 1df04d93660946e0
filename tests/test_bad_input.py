"""Bad input, as a new user would give it (issue 20): every case is refused with a
clear error naming the file, tensor or argument and the rule, exits 2 from the
command line, and loses nothing.  CPU only; the CUDA cases are in
test_bad_input_cuda.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qgemv
from qgemv import checkpoint, outdir
from qgemv import formats

from qgemv.calibration import cli
from qgemv.eval import ppl_check

from conftest import dev_module

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def float_model(tiny_llama_dir):
    return checkpoint.load_float_model(tiny_llama_dir)


def _save_int8(float_model, out) -> Path:
    import copy

    model, tok = float_model
    model = copy.deepcopy(model)
    rep = qgemv.quantize_model(model, bits=8)
    checkpoint.save_quantized(model, tok, str(out), checkpoint.quantization_config(model, "rtn", None, formats.QuantConfig(8), list(rep.skipped)))
    return Path(out)


@pytest.fixture
def q8(float_model, tmp_path):
    return _save_int8(float_model, tmp_path / "q8")


def _logits(path, ids):
    model, _ = checkpoint.load_quantized(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


# --------------------------------------------------------------------------
# 1. data loss and unsafe writes
# --------------------------------------------------------------------------
def test_overwrite_refuses_directories_that_are_not_qgemv_checkpoints(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    (tmp_path / "afile").write_text("mine")
    os.symlink(tmp_path / "work", tmp_path / "link")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    cases = {
        ".": "current directory or one of its ancestors",
        str(tmp_path): "current directory or one of its ancestors",
        str(tmp_path.parent): "current directory or one of its ancestors",
        "/": "current directory or one of its ancestors",
        str(home): "home directory",
        "work": "is not a qgemv checkpoint",
        "afile": "is not a directory",
        "link": "symbolic link",
        tiny_llama_dir: "holds the source model",
    }
    for out, rule in cases.items():
        with pytest.raises(checkpoint.OutputDirError, match=rule):
            checkpoint.check_output_dir(out, overwrite=True, sources=[tiny_llama_dir])
    with pytest.raises(FileExistsError, match="--overwrite"):
        checkpoint.check_output_dir("work", overwrite=False)
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine" and (tmp_path / "afile").exists()


@pytest.mark.parametrize("out", [".", "WORK", "SOURCE", "FILE", "LINK"])
def test_cli_overwrite_refusals_exit_2_before_any_work(out, tmp_path, monkeypatch, tiny_llama_dir):
    """qgemv-quantize MODEL --out . --overwrite deleted the working directory; now
    it and every other non-checkpoint target exit 2 before the model is loaded."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "WORK").mkdir()
    (tmp_path / "WORK" / "keep.txt").write_text("x")
    (tmp_path / "FILE").write_text("x")
    os.symlink(tmp_path / "WORK", tmp_path / "LINK")
    loaded = []
    monkeypatch.setattr(checkpoint, "load_float_model", lambda *a, **k: loaded.append(1))
    target = tiny_llama_dir if out == "SOURCE" else out
    assert cli.main([tiny_llama_dir, "--bits", "8", "--method", "rtn", "--out", target, "--overwrite"]) == 2
    assert not loaded
    assert (tmp_path / "WORK" / "keep.txt").exists() and (Path(tiny_llama_dir) / "config.json").exists()


def test_cli_refuses_an_unwritable_out_before_loading(tmp_path, monkeypatch, tiny_llama_dir):
    loaded = []
    monkeypatch.setattr(checkpoint, "load_float_model", lambda *a, **k: loaded.append(1))
    (tmp_path / "f").write_text("a file, so nothing can be created under it")
    assert cli.main([tiny_llama_dir, "--bits", "8", "--method", "rtn", "--out", str(tmp_path / "f" / "q")]) == 2
    if os.geteuid() != 0:  # root writes through permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        assert cli.main([tiny_llama_dir, "--bits", "8", "--method", "rtn", "--out", str(ro / "q")]) == 2
    assert not loaded


def test_overwrite_replaces_a_checkpoint_by_rename(q8, float_model, monkeypatch):
    """Replacing is by rename: on a failure between moving the old checkpoint aside
    and renaming the new one in, the old one comes back, whole."""
    ids = torch.randint(0, 200, (1, 8))
    before = sorted(p.name for p in q8.iterdir())
    want = _logits(q8, ids)
    real = os.rename
    calls = []

    def flaky(a, b):
        calls.append((a, b))
        if len(calls) == 2:  # old -> aside succeeded; new -> out fails
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(os, "rename", flaky)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_quantized(*_requant(float_model), str(q8), _qc(), overwrite=True)
    monkeypatch.setattr(os, "rename", real)
    assert sorted(p.name for p in q8.iterdir()) == before
    torch.testing.assert_close(_logits(q8, ids), want, rtol=0, atol=0)
    assert [p.name for p in q8.parent.iterdir() if p.name.startswith(".")] == []


def _requant(float_model):
    import copy

    model, tok = float_model
    model = copy.deepcopy(model)
    qgemv.quantize_model(model, bits=4, group_size=32)
    return model, tok


def _qc():
    return {"quant_method": "qgemv", "format_version": formats.FORMAT_VERSION, "bits": 4, "group_size": 32,
            "symmetric": True, "converted": [], "module_overrides": {}}


def test_interrupt_while_writing_leaves_the_old_checkpoint_and_no_temporaries(q8, float_model, monkeypatch):
    import safetensors.torch as st

    ids = torch.randint(0, 200, (1, 8))
    want = _logits(q8, ids)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_quantized(*_requant(float_model), str(q8), _qc(), overwrite=True)
    assert [p.name for p in q8.parent.iterdir() if p.name.startswith(".")] == []
    torch.testing.assert_close(_logits(q8, ids), want, rtol=0, atol=0)


def test_sigterm_during_the_save_cleans_up(tmp_path, tiny_llama_dir):
    """SIGTERM while save_quantized writes: the temporary directory is removed and
    the process exits 143; nothing is left beside --out."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        import safetensors.torch as st
        from qgemv import checkpoint, formats
        import qgemv
        model, tok = checkpoint.load_float_model({tiny_llama_dir!r})
        qgemv.quantize_model(model, bits=8)
        real = st.save_file
        def slow(*a, **k):
            real(*a, **k)
            print("writing", flush=True)
            time.sleep(30)
        st.save_file = slow
        checkpoint.save_quantized(model, tok, {str(tmp_path / "q")!r}, {{"quant_method": "qgemv"}})
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_stale_temporaries_of_killed_runs_are_removed_or_restored(q8, float_model):
    """SIGKILL leaves .NAME.tmp-PID-* (and, between the two renames, .NAME.old-PID-*):
    the next write of that --out removes a dead writer's temporaries, and renames
    a dead writer's .old directory back when --out itself is missing."""
    parent = q8.parent
    dead = 2**22 + 12345  # above the default pid_max: no such process
    assert not outdir._pid_alive(dead)
    (parent / f".q8.tmp-{dead}-abc").mkdir()
    (parent / f".q8.tmp-{dead}-abc" / "model.safetensors").write_bytes(b"x" * 100)
    legacy = parent / ".q8.tmp-xyz123"  # an earlier qgemv's name, no pid, older than this run
    legacy.mkdir()
    os.utime(legacy, (outdir._RUN_STARTED - 60, outdir._RUN_STARTED - 60))
    alive = parent / f".q8.tmp-{os.getppid()}-busy"  # a live writer's: left alone
    alive.mkdir()
    checkpoint.save_quantized(*_requant(float_model), str(q8), _qc(), overwrite=True)
    assert sorted(p.name for p in parent.iterdir() if p.name.startswith(".")) == [alive.name]
    alive.rmdir()
    # killed between the renames: out is gone, the old checkpoint is aside
    os.rename(q8, parent / f".q8.old-{dead}-zz")
    with pytest.warns(RuntimeWarning, match="the previous checkpoint .* is restored"):
        outdir.clean_stale(q8)
    assert (q8 / "config.json").exists() and not (parent / f".q8.old-{dead}-zz").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_directories_follow_the_umask(float_model, tmp_path, umask):
    old = os.umask(umask)
    try:
        out = checkpoint.save_quantized(*_requant(float_model), str(tmp_path / "q"), _qc())
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask


def test_ship_unpack_refuses_a_manifest_that_writes_outside_out(tmp_path, tiny_llama_dir):
    import io
    import tarfile

    S = dev_module("ship_checkpoint")

    evil = tmp_path / "evil"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in ((S.PAYLOAD, b""), (S.MANIFEST, json.dumps({"file": "../escaped.safetensors",
                                                                        "dropped": {}}).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    Path(f"{evil}0").write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="not a plain file name inside OUT"):
        S.unpack(str(evil), str(tmp_path / "out" / "ck"), reference=tiny_llama_dir)
    assert not (tmp_path / "out" / "escaped.safetensors").exists() and not (tmp_path / "out" / "ck").exists()


# --------------------------------------------------------------------------
# 2. silent wrong answers
# --------------------------------------------------------------------------
def test_a_stray_safetensors_file_is_never_read(q8):
    ids = torch.randint(0, 200, (1, 8))
    want = _logits(q8, ids)
    state = load_file(str(q8 / "model.safetensors"))
    state = {k: (v * 7 if v.is_floating_point() else v) for k, v in state.items()}
    save_file(state, str(q8 / "model_backup.safetensors"), metadata={"qgemv_format_version": str(formats.FORMAT_VERSION)})  # sorts after model.
    torch.testing.assert_close(_logits(q8, ids), want, rtol=0, atol=0)


def _rewrite(q8, edit, meta=None):
    f = q8 / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata=meta or {"format": "pt", "qgemv_format_version": str(formats.FORMAT_VERSION)})


KEY = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case,edit,rule", [
    ("float32 qweight", lambda s: s.update({f"{KEY}.qweight": s[f"{KEY}.qweight"].float()}), "qweight is torch.float32"),
    ("zero scale", lambda s: s[f"{KEY}.scales"].view(-1)[3].fill_(0), "not finite and positive"),
    ("nan scale", lambda s: s[f"{KEY}.scales"].view(-1)[3].fill_(float("nan")), "not finite and positive"),
    ("negative scale", lambda s: s[f"{KEY}.scales"].view(-1)[3].fill_(-1), "not finite and positive"),
    ("fp32 scales", lambda s: s.update({f"{KEY}.scales": s[f"{KEY}.scales"].float()}), "scales is torch.float32"),
    ("extra tensor", lambda s: s.update({"model.extra": torch.zeros(3)}), "the config's model does not have"),
    ("missing tensor", lambda s: s.pop("model.norm.weight"), "missing"),
])
def test_load_refuses_bad_tensors(q8, case, edit, rule):
    _rewrite(q8, edit)
    with pytest.raises(checkpoint.CheckpointError, match=rule):
        checkpoint.load_quantized(str(q8))


def test_load_refuses_zero_points_out_of_range(float_model, tmp_path):
    import copy

    model, tok = float_model
    model = copy.deepcopy(model)
    qgemv.quantize_model(model, bits=4, group_size=32, symmetric=False)
    out = tmp_path / "q4"
    checkpoint.save_quantized(model, tok, str(out), checkpoint.quantization_config(model, "rtn", None, formats.QuantConfig(4, 32, False), []))
    _rewrite(out, lambda s: s[f"{KEY}.zeros"].view(-1)[0].fill_(255))
    with pytest.raises(checkpoint.CheckpointError, match="zero points lie in"):
        checkpoint.load_quantized(str(out))


def _edit_qconfig(q8, edit) -> None:
    p = q8 / "config.json"
    cfg = json.loads(p.read_text())
    edit(cfg["quantization_config"])
    p.write_text(json.dumps(cfg))


def test_load_refuses_a_file_whose_format_version_differs_from_the_config(q8):
    """A panel-order file labelled 1 in config.json loaded and gave wrong logits."""
    _edit_qconfig(q8, lambda q: q.update(format_version=1))
    with pytest.raises(checkpoint.CheckpointError, match=f"records qgemv_format_version '{formats.FORMAT_VERSION}', but config.json says format_version 1"):
        checkpoint.load_quantized(str(q8))


def test_sharded_checkpoints_load_exactly_the_indexed_files(q8):
    ids = torch.randint(0, 200, (1, 8))
    want = _logits(q8, ids)
    state = load_file(str(q8 / "model.safetensors"))
    keys = sorted(state)
    half = len(keys) // 2
    parts = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    meta = {"format": "pt", "qgemv_format_version": str(formats.FORMAT_VERSION)}
    for name, ks in parts.items():
        save_file({k: state[k] for k in ks}, str(q8 / name), metadata=meta)
    (q8 / "model.safetensors").unlink()
    index = {"weight_map": {k: n for n, ks in parts.items() for k in ks}}
    (q8 / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.testing.assert_close(_logits(q8, ids), want, rtol=0, atol=0)
    # a key stored in both shards
    second = load_file(str(q8 / "model-00002-of-00002.safetensors"))
    second[keys[0]] = state[keys[0]]
    save_file(second, str(q8 / "model-00002-of-00002.safetensors"), metadata=meta)
    with pytest.raises(checkpoint.CheckpointError, match="stored twice|maps it to"):
        checkpoint.load_quantized(str(q8))
    # an index naming a path outside the directory
    index["weight_map"][keys[0]] = "../elsewhere.safetensors"
    (q8 / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(checkpoint.CheckpointError, match="not a plain file name"):
        checkpoint.load_quantized(str(q8))
    (q8 / "model.safetensors.index.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="no model.safetensors and no"):
        checkpoint.load_quantized(str(q8))


@pytest.mark.parametrize("edit,rule", [
    (lambda q: q.pop("bits"), "missing 'bits'"),
    (lambda q: q.update(bits="4"), "needs bits: int"),
    (lambda q: q.update(bits=3), "bits must be 4 or 8"),
    (lambda q: q.update(group_size="128"), "needs bits: int"),
    (lambda q: q.update(module_overrides={KEY: {"bits": 4, "group_size": 32, "symmetric": True, "foo": 1}}),
     "unknown key"),
    (lambda q: q.update(module_overrides=[1]), "module_overrides must be an object"),
    (lambda q: q.update(converted="all"), "'converted' must be a list"),
    (lambda q: q["converted"].append("model.norm"), "model.norm is a .*RMSNorm, not a linear layer"),
    (lambda q: q["converted"].append("model.nothing"), "does not exist in the model config"),
    (lambda q: q.update(format_version="2"), "format_version '2' is not supported"),
])
def test_malformed_quantization_config_is_a_checkpoint_error(q8, edit, rule):
    _edit_qconfig(q8, edit)
    with pytest.raises(checkpoint.CheckpointError, match=rule):
        checkpoint.load_quantized(str(q8))


def test_config_json_that_is_not_an_object(q8):
    (q8 / "config.json").write_text("[1, 2]")
    with pytest.raises(checkpoint.CheckpointError, match="must be a JSON object"):
        checkpoint.load_quantized(str(q8))


def test_a_missing_or_broken_tokenizer_is_reported(q8):
    (q8 / "tokenizer.json").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="tokenizer files did not load"):
        _, tok = checkpoint.load_quantized(str(q8))
    assert tok is None
    for f in checkpoint._TOKENIZER_FILES:
        if (q8 / f).exists():
            (q8 / f).unlink()
    with pytest.warns(RuntimeWarning, match="no tokenizer files"):
        checkpoint.load_quantized(str(q8))


def test_tiny_weights_stay_in_float_and_are_reported(float_model):
    import copy

    model = copy.deepcopy(float_model[0])
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1e-8)
    for bits, group in ((8, None), (4, None), (4, 32)):
        m = copy.deepcopy(model)
        rep = qgemv.quantize_model(m, bits=bits, group_size=group)
        name = "model.layers.0.mlp.up_proj"
        assert name not in rep.converted and "quantize to zero" in rep.skipped[name], rep.skipped
        assert isinstance(m.get_submodule(name), torch.nn.Linear)
    with pytest.warns(formats.QuantizationWarning, match="up_proj: .* scale groups need a scale below 2\\^-24"):
        formats.quantize(model.model.layers[0].mlp.up_proj.weight, formats.QuantConfig(8), name="up_proj")


def test_calibration_keeps_tiny_layers_in_float(float_model):
    import copy

    from qgemv.calibration.quantize import quantize_causal_lm

    model = copy.deepcopy(float_model[0])
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(1e-8)
    samples = torch.randint(0, 200, (2, 16))
    rep = quantize_causal_lm(model, formats.QuantConfig(4, 32), "gptq", samples, progress=False)
    assert "quantize to zero" in rep.skipped["model.layers.1.self_attn.o_proj"]


@pytest.mark.parametrize("cast", ["bfloat16", "half", "double", "float"])
def test_casting_a_quantized_model_keeps_its_packed_buffers(float_model, cast):
    import copy

    model = copy.deepcopy(float_model[0])
    qgemv.quantize_model(model, bits=4, group_size=32, symmetric=False)
    q = model.model.layers[0].self_attn.q_proj
    scales, qweight, zeros = q.scales.clone(), q.qweight.clone(), q.zeros.clone()
    ids = torch.randint(0, 200, (1, 6))
    with torch.no_grad():
        want = model(ids).logits
    getattr(model, cast)()
    assert q.scales.dtype == torch.float16 and torch.equal(q.scales, scales)
    assert torch.equal(q.qweight, qweight) and torch.equal(q.zeros, zeros)
    with torch.no_grad():
        got = model(ids).logits
    tol = {"bfloat16": 0.15, "half": 0.05}.get(cast, 1e-4)
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol


def test_a_stale_extension_falls_back_instead_of_aborting():
    """An extension built for other op schemas used to abort the process at import
    (its static registration hit a schema mismatch); now it is refused by version."""
    from qgemv import _ext

    class Stale:
        OPS_VERSION = 1

        def register_kernels(self):
            raise AssertionError("must not be called")

    with pytest.raises(RuntimeError, match="built for op schema version 1, this qgemv defines version"):
        _ext._register(Stale(), "qgemv._C")


# --------------------------------------------------------------------------
# 4. the regression gate
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gate_args(tiny_llama_dir, tmp_path_factory, float_model):
    out = _save_int8(float_model, tmp_path_factory.mktemp("gate") / "q8")
    return ["--reference", tiny_llama_dir, "--quantized", str(out), "--ctx", "64", "--windows", "3"]


@pytest.mark.parametrize("flags", [
    ["--max-ppl-increase", "nan"], ["--max-ppl-increase", "inf"], ["--max-ppl-increase=-1%"],
    ["--max-kl", "nan"], ["--max-kl", "inf"], ["--max-kl=-0.1"],
    ["--min-top1", "nan"], ["--min-top1", "101%"], ["--min-top1=-5"],
    ["--ctx", "1"], ["--batch", "0"], ["--windows", "-1"], ["--ctx", "abc"], ["--device", "tpu"],
])
def test_gate_rejects_bad_thresholds_and_protocols(gate_args, flags):
    with pytest.raises(SystemExit) as e:
        ppl_check.main(gate_args + flags)
    assert e.value.code == 2


def test_gate_rejects_a_ctx_beyond_the_model(gate_args):
    assert ppl_check.main(gate_args + ["--ctx", "100000"]) == 2


@pytest.mark.parametrize("content,rule", [
    (None, "not found"), (b"", "empty"), (b"   \n\n", "empty"), (b"\x00\x01binary\x00", "binary"),
    (b"caf\xe9 au lait", "not UTF-8"), (b"too short", "fewer than one window"),
])
def test_gate_rejects_bad_text_before_loading_models(gate_args, tmp_path, monkeypatch, capsys, content, rule):
    f = tmp_path / "t.txt"
    if content is not None:
        f.write_bytes(content)
    monkeypatch.setattr(checkpoint, "load_float_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(checkpoint, "load_quantized", lambda *a, **k: pytest.fail("a model was loaded"))
    assert ppl_check.main(gate_args + ["--text", str(f)]) == 2
    assert rule in capsys.readouterr().err


def test_gate_rejects_a_directory_that_is_not_a_checkpoint(tiny_llama_dir, tmp_path):
    assert ppl_check.main(["--reference", tiny_llama_dir, "--quantized", tiny_llama_dir]) == 2
    assert ppl_check.main(["--reference", str(tmp_path / "none"), "--quantized", tiny_llama_dir]) == 2


def test_nan_logits_fail_the_gate_and_the_report_stays_json(gate_args, tmp_path, capsys):
    """A checkpoint whose logits are NaN gave ppl and KL nan, which never counted
    as failures: with --min-top1 0 it passed."""
    q = Path(gate_args[3])
    bad = tmp_path / "nan"
    import shutil

    shutil.copytree(q, bad)
    _rewrite(bad, lambda s: s["model.norm.weight"].fill_(float("nan")))
    args = gate_args[:3] + [str(bad)] + gate_args[4:]
    rc = ppl_check.main(args + ["--max-ppl-increase", "1000%", "--max-kl", "100", "--min-top1", "0",
                                "--out", str(tmp_path / "rep")])
    assert rc == 1
    assert "not a finite number" in capsys.readouterr().out
    rep = json.loads((tmp_path / "rep.json").read_text())  # no bare NaN
    assert rep["results"][1]["ppl"] is None


def test_gate_prints_the_standard_error_and_warns_near_the_limit(gate_args, capsys):
    assert ppl_check.main(gate_args + ["--max-kl", "100", "--min-top1", "0"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("pass:"))
    assert "±" in line and "paired s.e." in line
    d = float(line.split("Δppl ")[1].split("%")[0])  # printed to 0.001 points: the true value may be 0.0005 above
    assert ppl_check.main(gate_args + ["--max-kl", "100", "--min-top1", "0", "--max-ppl-increase",
                                       f"{max(d, 0) + 1e-3}%"]) == 0
    assert "within 2 standard errors" in capsys.readouterr().out


def test_gate_internal_errors_exit_2_not_1(gate_args, monkeypatch):
    from qgemv.eval import ppl

    def broken(*a, **k):
        raise TypeError("a bug")

    monkeypatch.setattr(ppl, "evaluate", broken)
    assert ppl_check.main(gate_args) == 2


# --------------------------------------------------------------------------
# 5. qgemv-quantize input handling
# --------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [
    ["--override", "foo"], ["--override", "mlp=bits:3"], ["--override", "mlp=bits:x"],
    ["--override", "mlp=color:red"], ["--override", "mlp=symmetric:maybe"], ["--skip", "["],
    ["--samples", "0"], ["--samples", "-3"], ["--seq-len", "0"], ["--batch-size", "0"],
    ["--calib", "/nonexistent.txt"], ["--damp", "nan"], ["--clip-grid", "-1"], ["--device", "cuda:9"],
    ["--bits", "3"], ["--group-size", "96"], ["--asym"],
])
def test_cli_validates_arguments_before_loading(tiny_llama_dir, tmp_path, monkeypatch, flags):
    monkeypatch.setattr(checkpoint, "load_float_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = [tiny_llama_dir, "--method", "gptq", "--out", str(tmp_path / "q")] + flags
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    assert rc == 2


def test_cli_names_a_corrupt_model_file(tiny_llama_dir, tmp_path, capsys):
    import shutil

    src = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    assert cli.main([str(src), "--bits", "8", "--method", "rtn", "--out", str(tmp_path / "q")]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    f.write_bytes(b"\xff" * 64)
    assert cli.main([str(src), "--bits", "8", "--method", "rtn", "--out", str(tmp_path / "q")]) == 2
    shutil.copy(Path(tiny_llama_dir) / "model.safetensors", f)
    (src / "config.json").write_text("[1, 2]")
    assert cli.main([str(src), "--bits", "8", "--method", "rtn", "--out", str(tmp_path / "q")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_rtn_honours_the_device(float_model, monkeypatch):
    """--device with --method rtn was silently ignored; quantize_model(device=...) now
    quantizes each weight there (checked here through the device the weight is sent to)."""
    import copy

    seen = []
    real = formats.quantize

    def spy(w, cfg, name="weight"):  # the meta device stands in for a GPU: shapes only
        seen.append(w.device.type)
        return real(torch.randn(w.shape), cfg, name)

    monkeypatch.setattr(formats, "quantize", spy)
    qgemv.quantize_model(copy.deepcopy(float_model[0]), bits=8, device="meta")
    assert seen and set(seen) == {"meta"}


# --------------------------------------------------------------------------
# 6. packaging traps
# --------------------------------------------------------------------------
def test_import_from_the_parent_of_a_checkout_named_qgemv(tmp_path):
    """From the parent directory of a checkout named qgemv, `import qgemv` found the
    checkout as an empty namespace package (no QuantLinear)."""
    os.symlink(ROOT, tmp_path / "qgemv")
    code = "import qgemv, sys; print(qgemv.QuantLinear.__name__, qgemv.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("QuantLinear ")
