"""The generation engine (qgemv.engine): greedy tokens against transformers' generate(), batching,
sampling, fusion, the CLI and its errors; on a GPU, the CUDA kernels (graphs on and off) against the CPU."""

import copy
import subprocess
import sys
import warnings

import pytest
import torch

import qgemv
from qgemv.engine import Engine, UnsupportedModelError
from qgemv.nn import fuse_linears

from conftest import requires_cuda, requires_smollm2

transformers = pytest.importorskip("transformers")

# One tiny random config per supported family, each with what sets it apart.
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama3-rope-tied": ("LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32))),
    "mistral": ("MistralForCausalLM", dict(sliding_window=128)),
    "qwen2-bias": ("Qwen2ForCausalLM", {}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", dict(head_dim=32)),
}
FORMATS = {"float": None, "int8": (8, None), "int4g32": (4, 32), "int4g32a": (4, 32, False)}


def tiny(family: str, seed: int = 0, **extra):
    arch, kw = FAMILIES[family]
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    base.update(kw)
    base.update(extra)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg_cls(**base)).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens in both engines
    return model


def hf_greedy(model, ids: list, n: int) -> list:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers_generate(family, fmt):
    model = tiny(family)
    if FORMATS[fmt] is not None:
        bits, group, *sym = FORMATS[fmt]
        qgemv.quantize_model(model, bits=bits, group_size=group, symmetric=sym[0] if sym else True)
    prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(model, max_seq_len=64)
    assert engine.layers[0].qkv.fused is not None and engine.layers[0].gate_up.fused is not None
    out = engine.generate([prompt], max_new_tokens=16)
    assert out.tokens[0] == hf_greedy(model, prompt, 16)
    assert out.decode_steps == 15 and out.finish_reasons == ["length"]


@pytest.mark.parametrize("family", ["llama", "qwen3-qk-norm"])
def test_a_batch_gives_each_sequence_its_tokens_alone(family):
    model = tiny(family)
    qgemv.quantize_model(model, bits=4, group_size=32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (11, 3, 7)]
    engine = Engine(model, max_seq_len=48)
    both = engine.generate(prompts, max_new_tokens=12)
    for i, p in enumerate(prompts):
        assert both.tokens[i] == engine.generate([p], max_new_tokens=12).tokens[0], f"sequence {i}"
    assert both.batch == 3 and both.prompt_tokens == 21


def test_fused_projections_are_exact():
    """fuse_linears concatenates packed panels (no requantization): outputs equal the members', bit for bit."""
    for bits, group, sym in [(8, None, True), (4, None, True), (4, 32, False)]:
        lins = [torch.nn.Linear(64, n, bias=True) for n in (48, 16, 40)]  # 40: a partial last panel
        q = [qgemv.QuantLinear.from_linear(lin, bits, group, sym) for lin in lins]
        fused = fuse_linears(q)
        x = torch.randn(3, 64)
        assert torch.equal(fused(x), torch.cat([m(x) for m in q], -1)), (bits, group, sym)
    lins = [torch.nn.Linear(64, n) for n in (8, 24)]
    assert torch.equal(fuse_linears(lins)(x), torch.cat([m(x) for m in lins], -1))
    mixed = [qgemv.QuantLinear.from_linear(lins[0], 8), lins[1]]
    assert fuse_linears(mixed) is None  # the engine then calls each


def test_fuse_llama_projections_on_a_quantized_model_is_exact_and_the_engine_uses_it():
    """fuse_llama_projections fuses QuantLinear members exactly; the engine then runs the fused module itself."""
    model = tiny("qwen2-bias")  # q/k/v with biases
    qgemv.quantize_model(model, bits=4, group_size=32, symmetric=False)
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        before = model(ids).logits
    assert qgemv.nn.fuse_llama_projections(model) == 4  # qkv and gate_up in each of 2 layers
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, qgemv.nn.FusedSlice) and attn.qkv.fused.config.group_size == 32
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    engine = Engine(model, max_seq_len=48)
    assert engine.layers[0].qkv.fused is attn.qkv.fused
    prompt = ids[0].tolist()
    assert engine.generate([prompt], max_new_tokens=8).tokens[0] == hf_greedy(model, prompt, 8)


def test_sampling_is_seeded_and_reduces_to_greedy():
    model = tiny("llama")
    engine = Engine(model, max_seq_len=48)
    p = [[5, 6, 7, 8]]
    greedy = engine.generate(p, max_new_tokens=10).tokens
    a = engine.generate(p, max_new_tokens=10, temperature=1.0, seed=7).tokens
    assert a == engine.generate(p, max_new_tokens=10, temperature=1.0, seed=7).tokens
    assert a != engine.generate(p, max_new_tokens=10, temperature=1.0, seed=8).tokens
    assert engine.generate(p, max_new_tokens=10, temperature=0.7, top_k=1, seed=1).tokens == greedy
    assert engine.generate(p, max_new_tokens=10, temperature=0.7, top_p=1e-6, seed=1).tokens == greedy


def test_stops_at_eos_and_at_stop_strings(tiny_llama_dir):
    from qgemv import checkpoint

    model, tok = checkpoint.load_float_model(tiny_llama_dir)
    engine = Engine(model, tok, max_seq_len=64)
    free = engine.generate(["the history of"], max_new_tokens=12)
    first = free.tokens[0][0]
    engine.eos_ids = {first}
    out = engine.generate(["the history of"], max_new_tokens=12)
    assert out.tokens[0] == [first] and out.finish_reasons == ["eos"] and out.decode_steps == 0
    engine.eos_ids = set()
    text = free.texts[0]
    stop = text.strip()[:3]
    if stop:
        out = engine.generate(["the history of"], max_new_tokens=12, stop=[stop])
        assert out.finish_reasons == ["stop"] and stop not in out.texts[0]


def test_errors_name_the_rule(tiny_llama_dir):
    from qgemv import checkpoint

    model, tok = checkpoint.load_float_model(tiny_llama_dir)
    engine = Engine(model, tok, max_seq_len=32)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate(["a prompt", "  "], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the cache"):
        engine.generate([list(range(30))], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(["a"], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_seq_len must be in"):
        Engine(model, tok, max_seq_len=10**6)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture GPT2LMHeadModel"):
        Engine(gpt2)


def test_bad_sampling_and_stop_arguments_are_refused_up_front(tiny_llama_dir):
    from qgemv import checkpoint

    model, tok = checkpoint.load_float_model(tiny_llama_dir)
    engine = Engine(model, tok, max_seq_len=32)
    for t in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="finite temperature"):
            engine.generate(["a"], max_new_tokens=2, temperature=t)
    with pytest.raises(ValueError, match="empty stop string"):
        engine.generate(["a"], max_new_tokens=2, stop=[""])
    with pytest.raises(TypeError, match="stop strings must be str"):
        engine.generate(["a"], max_new_tokens=2, stop=[3])
    vocab = engine.vocab_size
    for bad in (-1, vocab):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            engine.generate([[1, bad]], max_new_tokens=2)


def test_a_plain_str_stop_is_one_stop_string():
    from qgemv.engine import check_stop, printable_prefix

    assert check_stop("si") == ("si",) and check_stop(["a", "b"]) == ("a", "b")
    # growing text: nothing of a stop string, nor what follows it, is shown
    assert printable_prefix("Paris is", ["is"]) == len("Par")
    assert printable_prefix("The capital i", ["is"]) == len("The capital ")
    assert printable_prefix("The capital", ["is"]) == len("The capital")
    assert printable_prefix("abc", []) == 3


def test_generate_reuses_the_engine_kept_on_the_model():
    model = tiny("llama")
    a = qgemv.generate(model, None, [[1, 2, 3]], max_new_tokens=4, max_seq_len=32)
    engine = model.__dict__["_qgemv_engine"]
    b = qgemv.generate(model, None, [[1, 2, 3]], max_new_tokens=4, max_seq_len=32)
    assert model.__dict__["_qgemv_engine"] is engine and a.tokens == b.tokens


@requires_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("bits,group", [(8, None), (4, 128)])
def test_smollm2_greedy_equals_transformers(bits, group):
    from qgemv import checkpoint

    model, tok = checkpoint.load_float_model(checkpoint.resolve_model("default"))
    qgemv.quantize_model(model, bits=bits, group_size=group)
    prompt = "The capital of France is"
    ids = tok(prompt)["input_ids"]
    model.generation_config.eos_token_id = None
    out = Engine(model, tok, max_seq_len=64).generate([prompt], max_new_tokens=10)
    assert out.tokens[0] == hf_greedy(model, ids, 10)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "qgemv", "generate", *args], capture_output=True, text=True,
                          timeout=600)


@requires_smollm2
def test_cli_generates_from_default():
    r = run_cli("default", "--prompt", "The capital of France is", "--max-new-tokens", "8", "--device", "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "decode: 7 steps" in r.stderr


def test_cli_refuses_bad_input(tmp_path, tiny_llama_dir):
    assert run_cli(tiny_llama_dir, "--prompt", " ", "--device", "cpu").returncode == 2
    assert run_cli(tiny_llama_dir, "--prompt", "x", "--max-new-tokens", "0").returncode == 2
    r = run_cli(str(tmp_path / "missing"), "--prompt", "x", "--device", "cpu")
    assert r.returncode == 2 and "missing" in r.stderr
    r = run_cli(tiny_llama_dir, "--prompt", "word " * 40, "--max-seq-len", "16", "--device", "cpu")
    assert r.returncode == 2 and "exceeds the cache" in r.stderr
    r = run_cli(tiny_llama_dir, "--prompt", "x", "--stop", "", "--device", "cpu")
    assert r.returncode == 2 and "empty stop string" in r.stderr
    r = subprocess.run([sys.executable, "-m", "qgemv", "generate", tiny_llama_dir, "--prompt", b"caf\xe9", "--device",
                        "cpu"], capture_output=True, timeout=600)
    assert r.returncode == 2 and b"not valid UTF-8" in r.stderr, r.stderr[-2000:]


def test_cli_one_prompt_never_prints_its_stop_string(tiny_llama_dir):
    free = run_cli(tiny_llama_dir, "--prompt", "the history of", "--max-new-tokens", "12", "--device", "cpu")
    assert free.returncode == 0, free.stderr[-2000:]
    text = free.stdout.rstrip("\n")
    stop = text.strip()[2:4]
    assert len(stop) == 2
    r = run_cli(tiny_llama_dir, "--prompt", "the history of", "--max-new-tokens", "12", "--device", "cpu",
                "--stop", stop)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.rstrip("\n") == text[:text.find(stop)]


def forced_logits(engine, prompts, forced):
    """Logits [B, n, vocab] of the engine fed the prompts, then the token lists ``forced`` (teacher forcing)."""
    logits, pad = engine.prefill(prompts)
    out = [logits.clone()]
    T = max(len(p) for p in prompts)
    slot = torch.empty(1, dtype=torch.long, device=engine.device)
    tokens = torch.tensor(forced, device=engine.device)
    for j in range(tokens.shape[1] - 1):
        slot.fill_(T + j)
        out.append(engine._decode(tokens[:, j:j + 1], slot, pad).clone())  # the CUDA graph where it is on
    return torch.stack(out, 1).cpu()


@requires_cuda
@pytest.mark.parametrize("bits,group,sym", [(8, None, True), (4, None, True), (4, 128, False)])
def test_cuda_kernels_give_the_cpu_reference_logits(bits, group, sym):
    """The engine on the GPU (qgemv kernels; CUDA graph and compiled glue, or both off), fed the CPU
    reference's greedy tokens, gives the CPU's logits within fp16 rounding and the same argmax wherever
    the CPU's top-2 margin is above fp16 noise.

    Free-running token equality would test the noise instead: fp16 activations round hidden states
    to 1e-3 relative, and random models have many steps whose top-2 margin is that small."""
    model = tiny("llama", seed=0, hidden_size=256, intermediate_size=512, vocab_size=512, initializer_range=0.02)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits of about 25
    qgemv.quantize_model(model, bits=bits, group_size=group, symmetric=sym)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 4)]
    cpu = Engine(model, max_seq_len=64)
    want = cpu.generate(prompts, max_new_tokens=16).tokens
    ref = forced_logits(cpu, prompts, want)
    assert torch.equal(ref.argmax(-1), torch.tensor(want))  # teacher forcing reproduces the free run
    top = ref.topk(2, -1).values
    clear = (top[..., 0] - top[..., 1]) > 0.25  # ten times the fp16 error seen on these logits
    assert clear.float().mean() > 0.5
    gpu_model = copy.deepcopy(model).half().cuda()
    for graphs, compiled in ((True, True), (False, False)):
        engine = Engine(gpu_model, max_seq_len=64, cuda_graphs=graphs, compile_glue=compiled)
        got = forced_logits(engine, prompts, want)
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, f"graphs={graphs}, compiled={compiled}: relative logit error {err:.2e}"
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear]), f"graphs={graphs}, compiled={compiled}"
        assert len(engine._graphs) == int(graphs) and engine.compile_glue == compiled


@pytest.mark.parametrize("knob,bad", [("decode_attention", 1), ("rope_attention", "yes"), ("pdl", 1)])
def test_gpu_only_step_knobs_are_off_and_refused_on_the_cpu(knob, bad):
    """decode_attention, rope_attention and pdl: off on the CPU (float32, head_dim 16); True is refused with the
    reason, a non-bool with a TypeError, False (the per-op / SDPA step) is allowed."""
    engine = Engine(tiny("llama"), max_seq_len=32)
    assert getattr(engine, knob) is False
    with pytest.raises(ValueError, match=f"{knob} cannot run here: the model is on cpu"):
        setattr(engine, knob, True)
    with pytest.raises(TypeError, match="expected True or False"):
        setattr(engine, knob, bad)
    setattr(engine, knob, False)


@requires_cuda
@pytest.mark.parametrize("heads,kv_heads,hidden", [(4, 2, 256), (8, 1, 512), (4, 4, 512), (9, 3, 576)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_gives_the_sdpa_steps_logits(heads, kv_heads, hidden, dtype):
    """The per-op decode step through qgemv.ops.decode_attention (each sequence's visible cache slots
    only) against the same engine with SDPA over the whole cache: prompts of three lengths (left
    padding), teacher-forced for 24 steps, graphs and compiled glue on (head_dim 64 / 128, GQA 1-8)."""
    model = tiny("llama", seed=4, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 intermediate_size=512, vocab_size=512, initializer_range=0.02)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    qgemv.quantize_model(model, bits=4, group_size=128, symmetric=False)
    model = model.to(device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(hidden)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (13, 5, 30)]
    fast = Engine(model, max_seq_len=96, megakernel=False)
    if not fast.decode_attention:
        pytest.skip("decode_attention's kernel does not run here (extension or compute capability)")
    sdpa = Engine(model, max_seq_len=96, megakernel=False)
    sdpa.decode_attention = False
    want = sdpa.generate(prompts, max_new_tokens=24).tokens
    ref, got = forced_logits(sdpa, prompts, want), forced_logits(fast, prompts, want)
    err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    assert err < (1e-2 if dtype == torch.float16 else 4e-2), f"relative logit error {err:.2e}"
    assert len(fast._graphs) == 1


@requires_cuda
@pytest.mark.parametrize("family,heads,kv_heads", [("llama", 4, 2), ("llama", 8, 8), ("qwen3-qk-norm", 4, 2),
                                                   ("qwen2-bias", 4, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_attention_gives_the_two_kernel_steps_logits(family, heads, kv_heads, dtype):
    """The per-op decode step with each layer's norms, rotation and cache write inside its attention kernel
    (Engine.rope_attention) against the glue + decode_attention step: prompts of three lengths (left padding),
    teacher-forced for 24 steps, graphs and compiled glue on; batch 1 too (per-op: megakernel off)."""
    model = tiny(family, seed=6, hidden_size=64 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 intermediate_size=512, vocab_size=512, initializer_range=0.02,
                 **(dict(head_dim=64) if family == "qwen3-qk-norm" else {}))  # (decode_attention's head sizes)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    qgemv.quantize_model(model, bits=4, group_size=64, symmetric=False)
    model = model.to(device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(heads)
    one = Engine(model, max_seq_len=96, megakernel=False)
    if not one.decode_attention:
        pytest.skip("decode_attention's kernel does not run here (extension or compute capability)")
    assert one.rope_attention  # (the default wherever decode_attention runs)
    two = Engine(model, max_seq_len=96, megakernel=False)
    two.rope_attention = False
    for lengths in ((13, 5, 30), (9,)):
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
        want = two.generate(prompts, max_new_tokens=24).tokens
        ref, got = forced_logits(two, prompts, want), forced_logits(one, prompts, want)
        err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        assert err < (1e-2 if dtype == torch.float16 else 4e-2), f"{lengths}: relative logit error {err:.2e}"


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pdl_gives_the_ordinary_launches_tokens_and_logits(dtype):
    """The per-op decode step as programmatic dependent launches (Engine.pdl, the default where it can run:
    each kernel may start while the one before it ends) against ordinary launches on the same weights: prompts
    of three lengths and one alone, teacher-forced for 24 steps, graphs and compiled glue on; the launch mode
    is restored after.  With the glue left eager, pdl is off by default."""
    model = tiny("llama", seed=8, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=512, initializer_range=0.02)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    qgemv.quantize_model(model, bits=4, group_size=128, symmetric=False)
    model = model.to(device="cuda", dtype=dtype)
    fast = Engine(model, max_seq_len=96, megakernel=False)
    why = qgemv.engine.pdl_refusal(fast)
    if why:
        assert fast.pdl is False
        pytest.skip(why)
    assert fast.pdl is True
    assert Engine(model, max_seq_len=96, megakernel=False, compile_glue=False).pdl is False
    plain = Engine(model, max_seq_len=96, megakernel=False)
    plain.pdl = False
    g = torch.Generator().manual_seed(8)
    for lengths in ((13, 5, 30), (9,)):
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
        want = plain.generate(prompts, max_new_tokens=24).tokens
        assert fast.generate(prompts, max_new_tokens=24).tokens == want, lengths
        ref, got = forced_logits(plain, prompts, want), forced_logits(fast, prompts, want)
        err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        assert err < 1e-3, f"{lengths}: relative logit error {err:.2e}"
    assert qgemv._ext.MODULE.gemv_pdl_flags() == 0  # (the library's default again)


def test_bench_generate_runs_its_engine_rows_on_cpu(tmp_path):
    """The generation benchmark's pieces on the CPU with its tiny shapes: rows and the three outputs."""
    from qgemv.eval import bench_generate as bg

    rows = []
    variants = ("fp16", "int8", "int4g128a", "int4g128a_act", "int4g128a_act_sep")
    for variant in variants:
        model = bg.prepare(bg.build_model("tiny", device="cpu").float(), variant)
        if variant.startswith("int4g128a_act"):  # the act-order variants: permuted inputs, shared per projection
            a = model.model.layers[0].self_attn
            assert a.q_proj.perm is a.v_proj.perm and not torch.equal(a.q_proj.perm, torch.arange(128))
            assert model.model.layers[0].mlp.down_proj.perm is None
        rows += bg.run_engine(model, "tiny", variant, [1, 2], prompt=12, gen=6, read_gbps=1000.0, breakdown=())
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for v in variants for b in (1, 2)]
    assert all(r["ms_per_step"] > 0 and r["decode_tokens_per_s"] > 0 and 0 < r["floor_share"] < 1 for r in rows)
    assert rows[0]["weight_MB"] > rows[2]["weight_MB"] > rows[4]["weight_MB"]  # fp16 > int8 > int4 bytes
    # the step floor adds K and V at the mean context (12 + 6 / 2 positions): tiny's 2 layers x 2 kv heads x 32
    # dims, float32 here, per sequence
    cfg = bg.MODELS["tiny"]
    per_seq = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 32 * 4 * 15
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 32
    for r in rows:
        assert r["kv_MB"] == pytest.approx(per_seq * r["batch"] / 1e6)
        assert r["step_floor_share"] == pytest.approx(r["floor_share"] * (1 + r["kv_MB"] / r["weight_MB"]))
    out = str(tmp_path / "bg")
    bg.write_outputs(dict(date="today", gpu="cpu", torch=torch.__version__, command="test", rows=rows,
                          baselines={"hf_static_compiled_fp16": {"error": "RuntimeError: x"}}), out)
    md = open(out + ".md").read()
    assert md.count("| tiny |") == 10 and "RuntimeError: x" in md and "step floor" in md


def test_bench_generate_builds_a_large_model_quantized_a_layer_at_a_time():
    """llama3-70b's path (its fp16 weights exceed one GPU) on tiny shapes: every decoder linear quantized as it
    is drawn, q/k/v and gate/up fused without a copy, nothing left on the meta device, seeded, the engine runs
    it; variants that need the float model are refused."""
    from qgemv.eval import bench_generate as bg
    from qgemv.nn import FusedQuantLinear, QuantLinear

    model = bg.build_streamed("tiny", "int4g128a", device="cpu")
    assert all(t.device.type == "cpu" for t in list(model.parameters()) + list(model.buffers()))
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.qkv, FusedQuantLinear) and isinstance(layer.mlp.gate_up, FusedQuantLinear)
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(lin, QuantLinear) and lin.packed.format == "int4g128a"
        assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    w = model.model.embed_tokens.weight.float()
    assert abs(w.std().item() - model.config.initializer_range) < 2e-3 and type(model.lm_head) is torch.nn.Linear
    again = bg.build_streamed("tiny", "int4g128a", device="cpu")
    assert torch.equal(again.model.layers[1].mlp.down_proj.packed.qweight,
                       model.model.layers[1].mlp.down_proj.packed.qweight)
    rows = bg.run_engine(model.float(), "tiny", "int4g128a", [1], prompt=12, gen=6, read_gbps=1000.0, breakdown=())
    assert rows[0]["decode_tokens_per_s"] > 0
    for variant in ("fp16", "int4g128a_act"):
        with pytest.raises(SystemExit, match=f"variant {variant} needs the float model"):
            bg.build_streamed("tiny", variant, device="cpu")


# ---- the persistent decode launch (Engine(megakernel=True), issue 35 stage 2) ----

@pytest.mark.parametrize("case,why", [
    ("float", "layer 0 q/k/v: Linear of torch.float32, not one qgemv QuantLinear or nn.Linear of the activations' "
              "type (the launch runs int4, int8, or float16 / bfloat16 weights)"),
    ("qwen2-bias", "needs float16 or bfloat16 activations, the model runs torch.float32"),  # the bias runs in it
    ("o-bias", "layer 0 o_proj: a bias is not in the launch (only q/k/v's)"),
    ("qwen3-qk-norm", "needs float16 or bfloat16 activations, the model runs torch.float32"),  # so do q/k norms
    ("act-order", "needs float16 or bfloat16 activations, the model runs torch.float32"),  # and act-order
    ("bf16", "needs a CUDA device, the model is on cpu"),  # bfloat16 activations pass
    ("cpu", "needs a CUDA device, the model is on cpu"),
    ("head_dim 16", "head_dim 16: the launch runs 32, 64 or 128"),
])
def test_megakernel_names_why_it_is_off_and_the_per_op_path_runs(case, why):
    from qgemv.engine import megakernel_refusal

    family = "qwen2-bias" if case == "qwen2-bias" else "qwen3-qk-norm" if case == "qwen3-qk-norm" else "llama"
    extra = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8 if case == "head_dim 16" else 4)
    if case == "o-bias":
        extra["attention_bias"] = True
    model = tiny(family, **extra)
    if case != "float":
        qgemv.quantize_model(model, bits=4, group_size=None)
    if case == "act-order":
        a = model.model.layers[0].self_attn
        perm = torch.randperm(128)
        for lin in (a.q_proj, a.k_proj, a.v_proj):
            lin.perm = perm
    if case in ("bf16", "cpu"):  # the weights pass: the activations' dtype, then the device decide
        model = model.to(torch.bfloat16 if case == "bf16" else torch.float16)
    prompt = [5, 17, 42, 7]
    with pytest.warns(UserWarning, match="megakernel off, running the per-op path: " + why.replace("(", r"\(")
                      .replace(")", r"\)").replace(".", r"\.")):
        engine = Engine(model, max_seq_len=32, megakernel=True)
    assert not engine.megakernel and engine.megakernel_reason == why
    assert megakernel_refusal(engine) == why
    if case not in ("bf16", "cpu"):  # the per-op path runs: the same tokens as an engine that never asked for it
        plain = Engine(model, max_seq_len=32, megakernel=False)
        assert engine.generate([prompt], max_new_tokens=5).tokens == plain.generate([prompt], max_new_tokens=5).tokens


needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                                reason="needs a compute-capability-9 GPU")


def megakernel_pair(model, plen, n):
    """(per-op engine, megakernel engine, their logits [1, n, vocab]) for a random prompt of plen tokens and
    the per-op engine's n greedy tokens after it, fed to both (teacher forcing)."""
    prompt = [torch.randint(0, 512, (plen,), generator=torch.Generator().manual_seed(plen)).tolist()]
    per_op = Engine(model, max_seq_len=128, megakernel=False)
    want = per_op.generate(prompt, max_new_tokens=n).tokens
    ref = forced_logits(per_op, prompt, want)
    mk = Engine(model, max_seq_len=128, megakernel=True)
    return per_op, mk, ref, forced_logits(mk, prompt, want)


def check_megakernel_logits(model):
    """Teacher-forced (as test_cuda_kernels_give_the_cpu_reference_logits): the persistent launch's logits
    against the per-op engine's on the same GPU weights, up to contexts at the cache's end, and the same
    argmax wherever the per-op top-2 margin is clear of the activations' rounding noise (bfloat16 keeps 3
    mantissa bits fewer than float16: measured on the H100 2026-12-05, relative errors ~1e-2 against ~1.2e-3
    and no argmax differing at margins of 0.25, so 3x / 2x fp16's tolerances)."""
    bf16 = model.model.embed_tokens.weight.dtype == torch.bfloat16
    for plen, n in ((9, 24), (100, 28)):  # the second fills the cache (max_seq_len 128) up to slot 126
        per_op, mk, ref, got = megakernel_pair(model, plen, n)
        assert mk.megakernel and mk._chain is not None, mk.megakernel_reason
        assert mk._chain.dtype == model.model.embed_tokens.weight.dtype
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < (3e-2 if bf16 else 1e-2), f"prompt {plen}: relative logit error {err:.2e}"
        top = ref.topk(2, -1).values
        clear = (top[..., 0] - top[..., 1]) > (0.5 if bf16 else 0.25)
        assert clear.float().mean() > 0.5
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
        # and the cache it wrote is the per-op engine's, up to the same rounding: the slots the forced steps
        # wrote (the per-op engine's greedy run may stop at the config's EOS before n tokens; past its last
        # forced step the per-op cache still holds what that run wrote, which the launch never saw)
        used = slice(0, plen + got.shape[1] - 1)
        for a, b in zip(mk._kv(1), per_op._kv(1)):
            assert (a[..., used, :].float() - b[..., used, :].float()).abs().max() <= \
                (8e-2 if bf16 else 2e-2) * b[..., used, :].float().abs().max() + 1e-3


@needs_sm90
@requires_smollm2
@pytest.mark.parametrize("bits,group,sym", [(8, None, True), (4, 64, False)])
def test_megakernel_smollm2_gives_the_cpu_engines_text(bits, group, sym):
    """The real SmolLM2-135M (hidden 576, 9 query heads over 3 kv heads, intermediate 1536, 30 layers) through
    the launch on the GPU gives the float32 CPU engine's greedy text (issue 35), and, fed the CPU's tokens
    (teacher forcing), its argmax wherever the CPU's top-2 margin is clear of fp16 noise over 30 layers.
    int4 at G = 64: 576 is not a multiple of 128, and the launch runs one format."""
    from qgemv import checkpoint

    model, tok = checkpoint.load_float_model(checkpoint.resolve_model("default"))
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    qgemv.quantize_model(model, bits=bits, group_size=group, symmetric=sym)
    prompt = "The capital of France is"
    cpu = Engine(model, tok, max_seq_len=96)
    free = cpu.generate([prompt], max_new_tokens=12)
    ids = [tok(prompt)["input_ids"]]
    want = cpu.generate(ids, max_new_tokens=40).tokens
    ref = forced_logits(cpu, ids, want)
    mk = Engine(copy.deepcopy(model).half().cuda(), tok, max_seq_len=96, megakernel=True)
    assert mk.megakernel, mk.megakernel_reason
    assert mk.generate([prompt], max_new_tokens=12).texts == free.texts
    assert mk._chain is not None  # the decode steps ran through the launch
    got = forced_logits(mk, ids, want)
    top = ref.topk(2, -1).values
    clear = (top[..., 0] - top[..., 1]) > 0.5
    assert clear.float().mean() > 0.5
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@needs_sm90
@requires_smollm2
def test_megakernel_smollm2_bf16_gives_the_per_op_engines_logits():
    """The real SmolLM2-135M in bfloat16 (int4 G = 64 with zero points; 576 and 1536 are not multiples of 128)
    through the launch's bf16 path against the bf16 per-op engine on the same GPU weights
    (check_megakernel_logits: teacher-forced logits, argmaxes where the margin is clear, the caches)."""
    from qgemv import checkpoint

    model, _ = checkpoint.load_float_model(checkpoint.resolve_model("default"))
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    qgemv.quantize_model(model, bits=4, group_size=64, symmetric=False)
    check_megakernel_logits(model.to(torch.bfloat16).cuda())


def megakernel_model(family, heads, kv_heads, fmt, seed=1, hidden_size=256, intermediate_size=512):
    """A small model of real structure, its lm_head sharpened (clear argmaxes) and its q/k/v biases (if any)
    of a trained model's size; fmt: (bits, group, symmetric) for quantize_model, or None (float16)."""
    model = tiny(family, seed=seed, hidden_size=hidden_size, intermediate_size=intermediate_size, vocab_size=512,
                 initializer_range=0.02, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 max_position_embeddings=128)
    model.config.eos_token_id = None  # the engine falls back to the config's EOS (2): run every forced step
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
        for layer in model.model.layers:  # (tiny's init leaves the biases zero and the q/k norm gains one)
            for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if lin.bias is not None:
                    lin.bias.normal_(0, 0.5)
    if fmt is not None:
        bits, group, sym = fmt
        qgemv.quantize_model(model, bits=bits, group_size=group, symmetric=sym)
    return model


@needs_sm90
@pytest.mark.parametrize("fmt", [(4, None, True), (4, 128, True), (4, 128, False), (4, 64, True), (4, 32, False),
                                 (8, None, True), None])  # None: fp16 weights
@pytest.mark.parametrize("family,heads,kv_heads", [("llama", 4, 1), ("llama", 4, 4), ("llama", 8, 1), ("llama", 2, 2),
                                                   ("qwen2-bias", 4, 2), ("qwen3-qk-norm", 4, 2)])  # GQA 4, 1, 8, 2
def test_megakernel_gives_the_per_op_engines_logits(fmt, family, heads, kv_heads):
    """Every format the launch runs, GQA 1 / 4 / 8, head_dim 32 / 64 / 128; Qwen2: its q/k/v biases in the
    launch (check_megakernel_logits)."""
    check_megakernel_logits(megakernel_model(family, heads, kv_heads, fmt).half().cuda())


@needs_sm90
@pytest.mark.parametrize("fmt", [(4, None, True), (4, 128, False), (4, 32, False), (8, None, True), None])
@pytest.mark.parametrize("family,heads,kv_heads", [("llama", 4, 1), ("qwen2-bias", 4, 2), ("qwen3-qk-norm", 4, 2)])
def test_megakernel_bf16_gives_the_per_op_engines_logits(fmt, family, heads, kv_heads):
    """bfloat16 models (Llama-3's and Qwen's own type) through the launch with bfloat16 activations: int4 / int8
    inputs staged as fp16 of x 2^e inside it, bf16 weights (None) in bf16 MMAs (check_megakernel_logits)."""
    check_megakernel_logits(megakernel_model(family, heads, kv_heads, fmt).to(torch.bfloat16).cuda())


@needs_sm90
def test_megakernel_default_runs_bf16_models_through_the_launch():
    model = megakernel_model("llama", 4, 2, (4, 128, False)).to(torch.bfloat16).cuda()
    engine = Engine(model, max_seq_len=32)
    assert engine.megakernel and engine.megakernel_reason == ""
    engine.generate([[3, 4, 5]], max_new_tokens=3)
    assert engine._chain is not None and engine._chain.dtype == torch.bfloat16


@needs_sm90
@pytest.mark.parametrize("fmt,heads,hidden,inter", [(f, 5, 320, 832) for f in ((4, None, True), (4, 32, False),
                                                                             (4, 64, True), (8, None, True), None)]
                         + [((4, 64, False), 7, 448, 1216), (None, 7, 448, 1216)])
def test_megakernel_odd_groups_and_sizes(fmt, heads, hidden, inter):
    """GQA groups of 5 and 7 (Qwen2.5-7B's 28 / 4) over one kv head, head_dim 64, and hidden / intermediate
    sizes that are not multiples of 128 (as SmolLM2's 576 and 1536 are not): the launch's copies of the int4
    weights padded to whole 128-input tiles.  With 16 warps a block a group of 5 or 7 leaves warps without a
    query head; these found the race of 2026-12-05 (the next K/V chunk copied over rows still being summed,
    at contexts of 65 and more)."""
    model = megakernel_model("llama", heads, 1, fmt, hidden_size=hidden, intermediate_size=inter)
    check_megakernel_logits(model.half().cuda())


@needs_sm90
@pytest.mark.parametrize("fmt", [(4, 64, False), (8, None, True)])
@pytest.mark.parametrize("hidden,heads,kv_heads,inter", [(896, 14, 2, 1216), (2880, 45, 9, 1536),
                                                         (5120, 40, 8, 1280)])
def test_megakernel_real_hidden_sizes(fmt, hidden, heads, kv_heads, inter):
    """The hidden sizes issue 35 names, with their models' head shapes: 896 (Qwen2-0.5B: 14 query heads of 64
    over 2 kv heads, GQA 7), 2880 (45 heads of 64 over 9, GQA 5; not a multiple of 128, so the int4 copies pad
    it to whole tiles) and 5120 (Qwen2.5-14B: 40 heads of 128 over 8, GQA 5); intermediate sizes kept small
    (1216 is not a multiple of 128 either), int4 G = 64 with zero points (G = 128 does not divide 2880) and
    int8 (check_megakernel_logits)."""
    model = megakernel_model("llama", heads, kv_heads, fmt, hidden_size=hidden, intermediate_size=inter)
    check_megakernel_logits(model.half().cuda())


@needs_sm90
@pytest.mark.parametrize("fmt", [(4, 128, False), (4, None, True), (8, None, True)])
def test_megakernel_runs_act_order_weights(fmt):
    """GPTQ desc_act weights: a random input perm shared by q/k/v, one for o, one shared by gate/up and one for
    down (the engine gathers them per op; the launch inside each op's input preparation)."""
    model = megakernel_model("llama", 4, 2, fmt, seed=3)
    gen = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for group in ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj), (m.down_proj,)):
            perm = torch.randperm(group[0].in_features, generator=gen)
            for lin in group:
                lin.perm = perm
    check_megakernel_logits(model.half().cuda())


@needs_sm90
def test_megakernel_picks_the_kernel_without_the_octet_form_below_the_rule():
    """GQA 4: the batch-1 steps take the launch's kernel without the octet form (it spills nothing; the same
    arithmetic there) until a unit reaches the form's 128 positions, then the one with it: a CUDA graph each."""
    model = megakernel_model("llama", 4, 1, (4, 128, False)).half().cuda()
    engine = Engine(model, max_seq_len=128, megakernel=True)
    engine.generate([list(range(1, 10))], max_new_tokens=6)
    chain = engine._chain
    assert chain is not None and chain.octets, engine.megakernel_reason
    assert set(engine._graphs) == {(1, False)} and not chain.step_octets
    far = 128 * chain.splits  # every unit of the context holds 128 positions or more
    assert engine._step_key(1, far) == (1, True) and chain.step_octets
    assert engine._step_key(1, 100) == (1, False) and not chain.step_octets
    assert engine._step_key(1, None) == (1, True)  # no position: the kernel the plan built


@needs_sm90
def test_megakernel_engine_leaves_batches_to_the_per_op_path():
    model = tiny("llama", seed=2, hidden_size=256, intermediate_size=512, vocab_size=512, initializer_range=0.02)
    qgemv.quantize_model(model, bits=4, group_size=128, symmetric=False)
    model = model.half().cuda()
    prompts = [[3, 4, 5, 6], [7, 8]]
    mk = Engine(model, max_seq_len=32, megakernel=True)
    plain = Engine(model, max_seq_len=32, megakernel=False)
    assert mk.generate(prompts, max_new_tokens=6).tokens == plain.generate(prompts, max_new_tokens=6).tokens
    assert mk._chain is None  # never built: no batch-1 step ran


def test_cli_megakernel_falls_back_with_its_reason(tiny_llama_dir):
    r = run_cli(tiny_llama_dir, "--prompt", "the history of", "--max-new-tokens", "4", "--device", "cpu",
                "--megakernel", "on")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "megakernel off, running the per-op path:" in r.stderr and r.stdout.strip()
    quiet = run_cli(tiny_llama_dir, "--prompt", "the history of", "--max-new-tokens", "4", "--device", "cpu")
    assert quiet.returncode == 0 and "megakernel" not in quiet.stderr, quiet.stderr[-2000:]
    assert quiet.stdout == r.stdout


@pytest.mark.parametrize("bits,group,sym", [(4, None, True), (4, 128, True), (4, 128, False), (4, 32, False),
                                            (8, None, True)])
def test_megakernel_counts_the_weights_it_copies(bits, group, sym):
    """The launch's extra GPU memory: q/k/v always (its rows permuted for the rotation), float16 weights, and
    grouped int4's scales (and zero points) in tile order: 16 x 128 / G x 2 (3) bytes a 1 KB tile of codes;
    codes are otherwise read in place.  A refusal names the bytes and the free memory."""
    from qgemv.engine import megakernel_copy_bytes, megakernel_memory_refusal

    model = tiny("llama", hidden_size=128, intermediate_size=256)
    qgemv.quantize_model(model, bits=bits, group_size=group, symmetric=sym)
    engine = Engine(model, max_seq_len=32)
    mods = [(L.qkv.fused, L.o_proj, L.gate_up.fused, L.down_proj) for L in engine.layers]
    meta = 0 if group is None else 16 * (128 // group) * (2 if sym else 3)  # bytes a tile
    want = sum(ms[0].packed.nbytes + sum(m.out_features // 16 * (m.in_features // 128) * meta for m in ms)
               for ms in mods)
    assert megakernel_copy_bytes(engine) == want > 0
    assert megakernel_memory_refusal(engine, want + (512 << 20)) == ""
    why = megakernel_memory_refusal(engine, want + (511 << 20))
    assert why.startswith("its copy of the weights in the launch's layout (") and "0.5 GiB kept spare" in why
    floats = Engine(tiny("llama", hidden_size=128, intermediate_size=256).half(), max_seq_len=32)
    assert megakernel_copy_bytes(floats) == sum(p.numel() * 2 for L in floats.layers for m in
                                                (L.qkv.fused, L.o_proj, L.gate_up.fused, L.down_proj)
                                                for p in [m.weight])


def test_megakernel_default_runs_where_allowed_and_falls_back_quietly():
    """Engine's default (megakernel=None): on where the model and GPU allow it; elsewhere the per-op path with
    its reason in megakernel_reason and no warning; megakernel=False names itself; anything else is refused."""
    from qgemv.engine import megakernel_refusal

    model = tiny("llama", hidden_size=128, intermediate_size=256)
    qgemv.quantize_model(model, bits=4, group_size=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine(model, max_seq_len=32)
    why = megakernel_refusal(engine)
    assert why and engine.megakernel_reason == why and not engine.megakernel  # float32 on the CPU
    off = Engine(model, max_seq_len=32, megakernel=False)
    assert not off.megakernel and off.megakernel_reason == "megakernel=False"
    with pytest.raises(TypeError, match="megakernel: expected None, True or False, got 'yes'"):
        Engine(model, max_seq_len=32, megakernel="yes")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        gpu = Engine(copy.deepcopy(model).half().cuda(), max_seq_len=32)
        assert gpu.megakernel and gpu.megakernel_reason == "", gpu.megakernel_reason
        gpu.generate([[3, 4, 5]], max_new_tokens=3)
        assert gpu._chain is not None  # the batch-1 steps ran through the launch
