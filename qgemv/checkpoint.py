"""Quantized checkpoints: qgemv's safetensors directories out and back in.

The jobs around it have their own modules: :mod:`qgemv.outdir` (directories
that appear whole or not at all), :mod:`qgemv.float_model` (the float model
in), :mod:`qgemv.safetensors_io` (shard reading and writing).  Their public
names are importable from here too, as before.

* :func:`save_quantized` writes a quantized directory atomically: config.json
  with ``quantization_config``, model.safetensors (packed weights, scales,
  zeros; every other tensor as it was) and the tokenizer files.
* :func:`load_quantized` builds the model on the meta device, swaps in
  QuantLinear modules and loads the tensors with ``assign=True``, so weights
  are never held twice.

Checkpoint metadata: ``quantization_config.quant_method == "qgemv"`` and
``format_version`` (qgemv.formats.FORMAT_VERSION).  Version 1 checkpoints
(row-major packed weights) are reordered into panels on load; version 2 is
version 3 without fused projections; any other version is refused with a
clear error.  ``quantization_config["fused"]`` (version 3) maps each fused
projection, e.g. ``model.layers.0.self_attn.qkv``, to its member linears
(``["q_proj", "k_proj", "v_proj"]``): the checkpoint holds one QuantLinear
``<owner>.qkv.fused`` for them, loaded as a FusedQuantLinear with FusedSlice
members (qgemv.nn).  ``quantization_config["permuted"]`` (version 3) lists the
QuantLinears stored with permuted input columns, each with an int64 ``perm``
tensor (act-order imports; QuantLinear gathers x[..., perm] first).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from . import formats
from .formats import QuantConfig
from .errors import CheckpointError, OutputDirError
from .float_model import (CACHE_DIR, DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE, FLOAT_DTYPES, check_float_model,
                          default_gguf_file, default_model_dir, default_model_path, kept_float, load_float_model,
                          load_tokenizer, max_positions, require_transformers, resolve_model, source_dtype)
from .nn import FUSE_GROUPS, FusedQuantLinear, FusedSlice, QuantLinear, set_submodule
from .outdir import atomic_dir, check_output_dir, current_umask, is_disk_full, is_qgemv_checkpoint, write_side_files
from .safetensors_io import checkpoint_files, read_checkpoint_tensors, read_json, save_tensors
_READABLE_VERSIONS = (1, 2, 3, formats.FORMAT_VERSION)


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
        "fused": {n: list(FUSE_GROUPS[n.rpartition(".")[2]]) for n, m in model.named_modules()
                  if isinstance(m, FusedQuantLinear)},
        "permuted": sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.perm is not None),
        "module_overrides": modules,
        "calibration": calibration or {},
        "rotation": rotation,
    }


def record_float_dtype(cfg: dict, dtype: torch.dtype) -> None:
    """Make config.json (as a dict) declare ``dtype`` for the tensors kept in float."""
    cfg["dtype"] = str(dtype).replace("torch.", "")
    cfg.pop("torch_dtype", None)


def save_quantized(model: nn.Module, tokenizer, out_dir: str, qconfig: dict, overwrite: bool = False,
                   extra_json: Optional[dict] = None, float_dtype: Optional[torch.dtype] = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer to out_dir, atomically.

    Everything goes to a temporary sibling directory first and is renamed into
    place at the end, so an interrupted run leaves no directory that loads;
    with ``overwrite`` a previous checkpoint there is replaced only when the
    new one is complete (see :func:`atomic_dir`), and only a qgemv
    checkpoint may be replaced (:func:`check_output_dir`).
    ``extra_json`` ({file name: object}) adds reports to the same directory.
    ``float_dtype`` stores the tensors that stay in float (embeddings, norms,
    lm_head, biases) in that dtype, and config.json says so; None keeps the
    model's.  The packed weights, their fp16 scales and uint8 zero points are
    stored as they are.
    """
    if float_dtype not in (None, *FLOAT_DTYPES.values()):
        raise ValueError(f"float_dtype must be None, float32, float16 or bfloat16, got {float_dtype}")
    out = check_output_dir(out_dir, overwrite)
    with atomic_dir(out) as tmp:
        cfg = model.config.to_dict()
        cfg["quantization_config"] = qconfig
        if not cfg.get("architectures"):  # a model made with from_config has none; loaders (vLLM) need it
            cfg["architectures"] = [type(model).__name__]
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        if float_dtype is not None:
            state = {k: (v.to(float_dtype) if kept_float(k, v) else v) for k, v in state.items()}
            record_float_dtype(cfg, float_dtype)
        # tied weights (lm_head = embed_tokens) are stored once, as transformers does
        if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in state:
            state.pop("lm_head.weight")
        save_tensors(tmp / "model.safetensors", state,
                     {"format": "pt", "qgemv_format_version": str(formats.FORMAT_VERSION)})
        write_side_files(tmp, tokenizer, extra_json)
        # config.json last: a directory without it is never mistaken for a checkpoint
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return out

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def parse_quantization_config(qc, path) -> tuple:
    """(format_version, default QuantConfig, {module: QuantConfig} overrides, converted names) of a
    ``quantization_config`` block; CheckpointError naming the field for anything malformed."""
    where = f"{path}: config.json quantization_config"
    if not isinstance(qc, dict) or qc.get("quant_method") != "qgemv":
        raise CheckpointError(f"{path}: config.json has no qgemv quantization_config")
    version = qc.get("format_version")
    if isinstance(version, bool) or version not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: format_version {version!r} is not supported by this qgemv "
            f"(it reads format_version {', '.join(map(str, _READABLE_VERSIONS))})")

    def cfg_of(d, what):
        if not isinstance(d, dict):
            raise CheckpointError(f"{where}: {what} must be an object, got {d!r}")
        extra = sorted(set(d) - {"bits", "group_size", "symmetric"})
        if extra:
            raise CheckpointError(f"{where}: {what} has unknown key(s) {extra}")
        for key in ("bits", "group_size", "symmetric"):
            if key not in d:
                raise CheckpointError(f"{where}: {what} is missing {key!r}")
        bits, g, sym = d["bits"], d["group_size"], d["symmetric"]
        if isinstance(bits, bool) or not isinstance(bits, int) or not isinstance(sym, bool) or not (
                g is None or (isinstance(g, int) and not isinstance(g, bool))):
            raise CheckpointError(f"{where}: {what} needs bits: int, group_size: int or null, symmetric: bool; "
                                  f"got {d!r}")
        try:
            return QuantConfig(bits, g, sym)
        except ValueError as e:
            raise CheckpointError(f"{where}: {what}: {e}") from None

    default = cfg_of({k: qc[k] for k in ("bits", "group_size", "symmetric") if k in qc}, "the default format")
    overrides = qc.get("module_overrides") or {}
    if not isinstance(overrides, dict):
        raise CheckpointError(f"{where}: module_overrides must be an object")
    overrides = {name: cfg_of(d, f"module_overrides[{name!r}]") for name, d in overrides.items()}
    converted = qc.get("converted")
    if not isinstance(converted, list) or not all(isinstance(n, str) for n in converted):
        raise CheckpointError(f"{where}: 'converted' must be a list of module names")
    stray = sorted(set(overrides) - set(converted))
    if stray:
        raise CheckpointError(f"{where}: module_overrides names modules that are not converted: {stray[:3]}")
    fused = qc.get("fused") or {}
    if not isinstance(fused, dict):
        raise CheckpointError(f"{where}: 'fused' must be an object")
    for name, members in fused.items():
        kind = name.rpartition(".")[2]
        if kind not in FUSE_GROUPS or members != list(FUSE_GROUPS[kind]):
            raise CheckpointError(f"{where}: fused[{name!r}] = {members!r}; qgemv fuses "
                                  + ", ".join(f"<owner>.{k} = {list(v)}" for k, v in FUSE_GROUPS.items()))
        if f"{name}.fused" not in converted:
            raise CheckpointError(f"{where}: fused[{name!r}] has no converted module {name}.fused")
    permuted = qc.get("permuted") or []
    if not isinstance(permuted, list) or not set(permuted) <= set(converted):
        raise CheckpointError(f"{where}: 'permuted' must list converted modules, got {permuted!r}")
    return version, default, overrides, converted, fused, set(permuted)

_PACKED_DTYPES = {"qweight": (torch.int8, torch.int32), "scales": (torch.float16,), "zeros": (torch.uint8,)}


def check_quantized_tensors(path, name: str, c: QuantConfig, state: dict, version: Optional[int] = None) -> None:
    """dtypes, code / zero-point ranges and scales of one converted module's tensors (``version``: the
    checkpoint's format_version; int8 code -128 is refused before version 4)."""
    qw, sc = state[f"{name}.qweight"], state[f"{name}.scales"]
    want = torch.int8 if c.bits == 8 else torch.int32
    if qw.dtype != want:
        raise CheckpointError(f"{path}: {name}.qweight is {qw.dtype}, but {c.name} stores {want}")
    if sc.dtype != torch.float16:
        raise CheckpointError(f"{path}: {name}.scales is {sc.dtype}, but qgemv stores float16 scales")
    if c.bits == 8 and version is not None and version < 4 and qw.numel() and int(qw.min()) < -127:
        raise CheckpointError(f"{path}: {name}.qweight holds the int8 code -128, which format_version {version} "
                              f"does not (its int8 codes lie in [-127, 127]; version 4 widened them)")
    bad = ~(torch.isfinite(sc) & (sc > 0))
    if bool(bad.any()):
        example = float(sc[bad][0])
        raise CheckpointError(f"{path}: {name}.scales has {int(bad.sum())} value(s) that are not finite and "
                              f"positive (e.g. {example:g})")
    perm = state.get(f"{name}.perm")
    if perm is not None and (perm.dtype != torch.int64 or not torch.equal(torch.sort(perm).values,
                                                                           torch.arange(perm.numel(), device=perm.device))):
        raise CheckpointError(f"{path}: {name}.perm must be an int64 permutation of 0..{perm.numel() - 1}")
    if not c.symmetric:
        z = state[f"{name}.zeros"]
        if z.dtype != torch.uint8:
            raise CheckpointError(f"{path}: {name}.zeros is {z.dtype}, but qgemv stores uint8 zero points")
        if z.numel() and int(z.max()) > 15:
            raise CheckpointError(f"{path}: {name}.zeros holds {int(z.max())}; int4 zero points lie in [0, 15]")


def tokenizer_or_none(transformers, p: Path):
    """The checkpoint's tokenizer, or None with a printed warning saying why."""
    if not any((p / f).exists() for f in _TOKENIZER_FILES):
        warnings.warn(f"qgemv: {p} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); tokenizer is None",
                      RuntimeWarning, stacklevel=3)
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001 - a broken tokenizer must not hide the weights; it is reported
        warnings.warn(f"qgemv: {p}: the tokenizer files did not load ({type(e).__name__}: {e}); tokenizer is None",
                      RuntimeWarning, stacklevel=3)
        return None


def meta_model(path, dtype: Optional[torch.dtype] = None) -> tuple:
    """(model on the meta device, its transformers config without quantization_config) of a directory's config.json.

    The skeleton every loader fills: names and shapes without a byte of weight.
    CheckpointError when transformers cannot read the config.
    """
    transformers = require_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad config
        raise CheckpointError(f"{path}: transformers cannot read config.json ({type(e).__name__}: {e})") from None
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # the loaders' own business, not a transformers quantizer's
    kw = {} if dtype is None else {"dtype": dtype}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **kw)
    return model, config


def fuse_skeleton(model: nn.Module, name: str, c: QuantConfig, dtype: torch.dtype, path) -> None:
    """In a meta model, replace the members of fused projection ``name`` (e.g. ``...self_attn.qkv``) by
    FusedSlices of one FusedQuantLinear whose QuantLinear shell ``name.fused`` the tensors then fill."""
    owner_name, _, kind = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        raise CheckpointError(f"{path}: fused projection {name}: no module {owner_name} in the model config") from None
    lins = [getattr(owner, m, None) for m in FUSE_GROUPS[kind]]
    if not all(type(m) is nn.Linear for m in lins) or len({(m.in_features, m.bias is None) for m in lins}) != 1:
        raise CheckpointError(f"{path}: fused projection {name}: {owner_name}'s {', '.join(FUSE_GROUPS[kind])} are not "
                              f"linears with one in_features and bias setting")
    sizes = [m.out_features for m in lins]
    shell = QuantLinear(lins[0].in_features, sum(sizes), c.bits, c.group_size, c.symmetric,
                        bias=lins[0].bias is not None, device="meta", bias_dtype=dtype)
    f = FusedQuantLinear(shell, sizes)
    setattr(owner, kind, f)
    for i, m in enumerate(FUSE_GROUPS[kind]):
        setattr(owner, m, FusedSlice(f, i))


def checked_checkpoint(path, dtype: torch.dtype = torch.float16) -> tuple:
    """Everything :func:`load_quantized` checks, and what it builds before loading.

    Returns (model, state, config, version): ``model`` on the meta device with
    a QuantLinear shell in place of every converted linear (biases in
    ``dtype``), ``state`` the checked tensors (format-1 qweights already in
    panel order), ``config`` the transformers config without its
    quantization_config.  Raises CheckpointError naming the file, tensor or
    field (see :func:`load_quantized`).
    """
    require_transformers()  # the clear error before any reading
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json (not a qgemv checkpoint, or an interrupted write)")
    cfg = read_json(cfg_path, "config.json")
    version, default, overrides, converted, fused, permuted = parse_quantization_config(cfg.get("quantization_config"), path)
    state, metas = read_checkpoint_tensors(p)
    for fname, meta in metas.items():
        got = meta.get("qgemv_format_version")
        if got != str(version):
            raise CheckpointError(f"{path}: {fname} records qgemv_format_version {got!r}, but config.json says "
                                  f"format_version {version}: the file and the config do not belong together")

    model, config = meta_model(p, dtype)
    for name in fused:
        fuse_skeleton(model, name, overrides.get(f"{name}.fused", default), dtype, path)
    for name in converted:
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"{path}: converted module {name} does not exist in the model config") from None
        c = overrides.get(name, default)
        if isinstance(lin, QuantLinear):  # a fused projection's shell (fuse_skeleton)
            q = lin
        elif isinstance(lin, nn.Linear):
            q = QuantLinear(lin.in_features, lin.out_features, c.bits, c.group_size, c.symmetric,
                            bias=lin.bias is not None, device="meta", bias_dtype=dtype)
            set_submodule(model, name, q)
        else:
            raise CheckpointError(f"{path}: converted module {name} is a {type(lin).__name__}, not a linear layer")
        if name in permuted:
            q.perm = torch.empty(q.in_features, dtype=torch.int64, device="meta")
        for key in ("qweight", "scales") + (("zeros",) if not c.symmetric else ()) + (("perm",) if name in permuted
                                                                                          else ()):
            if f"{name}.{key}" not in state:
                raise CheckpointError(f"{path}: tensor {name}.{key} is missing")
            want = getattr(q, key).shape
            got = state[f"{name}.{key}"].shape
            if tuple(got) != tuple(want):
                raise CheckpointError(
                    f"{path}: {name}.{key} has shape {list(got)} but the config ({c.name}, "
                    f"in={lin.in_features}, out={lin.out_features}) needs {list(want)}"
                )
        check_quantized_tensors(path, name, c, state, version)
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
    return model, state, config, version


def rebuild_meta_buffers(model: nn.Module, config, path) -> None:
    """Rebuild the non-persistent buffers a file does not hold (rotary inv_freq) of a model loaded from meta."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if name.endswith("rotary_emb"):
                with torch.device("cpu"):  # the constructor's signature varies across versions
                    set_submodule(model, name, type(mod)(config=config))
            else:
                raise CheckpointError(f"{path}: module {name} still has uninitialised buffers")


# Readers of other checkpoint formats: (detect(path) -> a name or None,
# load(path, device, dtype) -> (model, tokenizer)), tried in order by
# load_quantized.  qgemv.importers adds the GPTQ / AWQ / compressed-tensors one.
_READERS: list = []


def register_reader(detect: Callable, load: Callable) -> None:
    """Let :func:`load_quantized` read another checkpoint format: ``detect(path)`` returns a name (or None
    for a directory it does not read) and ``load(path, device, dtype)`` returns (model, tokenizer)."""
    if (detect, load) not in _READERS:
        _READERS.append((detect, load))


def load_quantized(path: str, device: str = "cpu", dtype: torch.dtype = torch.float16):
    """(model, tokenizer) from a directory written by :func:`save_quantized`.

    The model is built on the meta device; QuantLinear modules replace the
    converted linears; tensors are loaded with ``assign=True``.  Non-quantized
    tensors are cast to ``dtype`` (float16 by default; use float32 on CPU for
    reference-accurate evaluation).

    Everything is checked before the model is returned, each failure a
    CheckpointError naming the file, tensor or field: config.json and its
    ``quantization_config``; exactly the files ``model.safetensors`` or its
    shard index name (:func:`read_checkpoint_tensors`); each file's
    ``qgemv_format_version`` against config.json; every tensor present, none
    extra, shapes and dtypes as the format says, int8 codes in [-127, 127] before format version 4,
    zero points in [0, 15], scales finite and positive.  A missing or broken
    tokenizer gives a warning and tokenizer None.

    A GPTQ, AWQ or compressed-tensors (pack-quantized) directory is read by
    :mod:`qgemv.importers` instead (a reader it registers, :func:`register_reader`) and
    repacked into qgemv's formats.
    """
    for detect, load in _READERS:  # GPTQ / AWQ / compressed-tensors (qgemv.importers): repacked as it loads
        if detect(path) is not None:
            return load(path, device, dtype)
    transformers = require_transformers()
    model, state, config, _ = checked_checkpoint(path, dtype)
    for k, v in state.items():
        if kept_float(k, v):
            state[k] = v.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    rebuild_meta_buffers(model, config, path)
    model = model.to(device).eval()
    return model, tokenizer_or_none(transformers, Path(path))


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB (Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


__all__ = [
    "CACHE_DIR",
    "DEFAULT_GGUF_NAME",
    "DEFAULT_GGUF_PACKAGE",
    "default_model_dir",
    "source_dtype",
    "current_umask",
    "is_disk_full",
    "CheckpointError",
    "OutputDirError",
    "check_output_dir",
    "is_qgemv_checkpoint",
    "checkpoint_files",
    "read_checkpoint_tensors",
    "default_gguf_file",
    "default_model_path",
    "resolve_model",
    "check_float_model",
    "max_positions",
    "load_tokenizer",
    "load_float_model",
    "quantization_config",
    "save_quantized",
    "meta_model",
    "checked_checkpoint",
    "parse_quantization_config",
    "check_quantized_tensors",
    "load_quantized",
    "register_reader",
    "fuse_skeleton",
    "record_float_dtype",
    "tokenizer_or_none",
    "rebuild_meta_buffers",
    "peak_rss_mb",
]
