"""Round-to-nearest quantization of a (sharded) safetensors checkpoint, streamed one projection group at a time.

    qgemv-quantize MODEL_DIR --method rtn --stream --bits 4 --group-size 128 --asym --device cuda --out runs/q4

The float model is never built: the module names and shapes come from a
meta-device model of the config, and each linear's weight is read from its
shard (safetensors reads by key) when its turn comes, quantized on ``device``
and packed.  q/k/v and gate/up of one format are read together and fused
(format 3), so at most one such group of float weights is held at once;
embeddings, norms and skipped linears are copied through (cast to
``float_dtype``, default the source's dtype).  The output is written in shards of at most ``shard_mb``
(``model-0000i-of-0000n.safetensors`` and its index, or one
``model.safetensors``), atomically like every qgemv checkpoint.  The tensors
equal those of the in-memory path (``qgemv-quantize --method rtn``), bit for
bit.  GPTQ / AWQ streaming (calibration activations layer by layer) and
resuming an interrupted run are not built.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from . import checkpoint, formats
from .formats import QuantConfig
from .nn import FUSE_GROUPS, FusedQuantLinear, FusedSlice, QuantLinear, fuse_linears, layer_format, set_submodule


class _Reader:
    """Tensors of a checkpoint directory by name, each file opened once (safetensors reads lazily by key)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files, wm = checkpoint._shards(path)
        self.handles = {f.name: safe_open(str(f), framework="pt") for f in files}
        self.where = dict(wm) if wm is not None else {k: files[0].name for k in self.handles[files[0].name].keys()}
        self.read = set()

    def get(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise checkpoint.CheckpointError(f"tensor {key} is missing from the source checkpoint")
        self.read.add(key)
        return self.handles[self.where[key]].get_tensor(key)


class _Writer:
    """Collects output tensors and writes a shard whenever shard_mb is reached."""

    def __init__(self, out: Path, shard_mb: float):
        self.out, self.limit, self.pending, self.size, self.files, self.weight_map = out, shard_mb * 1e6, {}, 0, [], {}

    def add(self, key: str, t: torch.Tensor) -> None:
        self.pending[key] = t.detach().to("cpu").contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= self.limit:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.out / name),
                  metadata={"format": "pt", "qgemv_format_version": str(formats.FORMAT_VERSION)})
        self.files.append(name)
        self.weight_map.update({k: name for k in self.pending})
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        if len(self.files) == 1:
            (self.out / self.files[0]).rename(self.out / "model.safetensors")
            return
        n = len(self.files)
        final = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(self.files)}
        for old, new in final.items():
            (self.out / old).rename(self.out / new)
        index = {"metadata": {"qgemv_format_version": formats.FORMAT_VERSION},
                 "weight_map": {k: final[f] for k, f in sorted(self.weight_map.items())}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def quantize_rtn_streaming(src: str, out: str, default: QuantConfig, skip=(r"lm_head", r"embed"),
                           overrides: Optional[dict] = None, device: str = "cpu", fuse: bool = True,
                           float_dtype: Optional[torch.dtype] = None, shard_mb: float = 4000,
                           overwrite: bool = False, progress: bool = True) -> dict:
    """RTN-quantize the safetensors checkpoint ``src`` into the qgemv checkpoint ``out``, streamed.

    ``skip`` / ``overrides`` / ``default`` choose each linear's format as
    :func:`qgemv.nn.layer_format` does (groups that do not divide K fall back
    to 128 / 64 / 32).  Returns a report: converted and skipped modules,
    seconds, peak RSS (MB), the number of files written, the largest number
    of float linear weights held at once, and why the tokenizer was not
    copied (None when it was).
    """
    checkpoint._require_transformers()  # the clear error before any reading
    src_p = Path(src)
    checkpoint.check_float_model(src_p)
    if src_p.is_file():
        raise checkpoint.CheckpointError(f"{src}: streaming reads a safetensors directory, not a .gguf file")
    out_p = checkpoint.check_output_dir(out, overwrite, sources=(src,))
    t0 = time.time()
    if float_dtype is None:
        float_dtype = checkpoint.source_dtype(str(src_p)) or torch.float32
    model, config = checkpoint.meta_model(src_p)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    reader = _Reader(src_p)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    skipped, most_held = {}, 0

    owners = {}
    for name, lin in linears:
        owner, _, child = name.rpartition(".")
        owners.setdefault(owner, []).append(child)
    with checkpoint._atomic_dir(out_p) as tmp:
        writer = _Writer(tmp, shard_mb)

        def emit(prefix: str, q: QuantLinear) -> None:
            for key in ("qweight", "scales", "zeros", "bias"):
                t = getattr(q, key)
                if t is not None:
                    writer.add(f"{prefix}.{key}", t.to(float_dtype) if key == "bias" else t)

        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(linears), desc=f"rtn {default.name} (streamed)", unit="linear")
        done = set()
        for name, lin in linears:
            if name in done:
                continue
            owner, _, child = name.rpartition(".")
            group = next(((kind, members) for kind, members in FUSE_GROUPS.items()
                          if child == members[0] and all(m in owners.get(owner, ()) for m in members)), None)
            names = [f"{owner}.{m}" if owner else m for m in group[1]] if group and fuse else [name]
            reals, cfgs = {}, {}
            for n in names:  # a projection group's float weights: the most this holds at once
                if tied and n == "lm_head":
                    cfg, why = None, "tied to the embeddings"
                else:
                    reals[n] = _read_linear(reader, n, model.get_submodule(n))
                    cfg, why = layer_format(n, reals[n], default, skip, overrides, group_fallback=True)
                if cfg is None:
                    skipped[n] = why
                cfgs[n] = cfg
            most_held = max(most_held, len(reals))
            quantized = {}
            for n, real in reals.items():
                if n in skipped:  # stays float: the file's tensors, cast like every float tensor
                    for key in (f"{n}.weight",) + ((f"{n}.bias",) if real.bias is not None else ()):
                        writer.add(key, reader.get(key).to(float_dtype))
                    continue
                c = cfgs[n]
                quantized[n] = QuantLinear.from_linear(real, c.bits, c.group_size, c.symmetric, name=n, device=device)
            fused = fuse_linears(list(quantized.values())) if len(names) > 1 and len(quantized) == len(names) else None
            if fused is not None:
                kind = group[0]
                emit(f"{owner}.{kind}.fused", fused)
                f = FusedQuantLinear(_meta_shell(fused), [quantized[n].out_features for n in names])
                set_submodule(model, f"{owner}.{kind}" if owner else kind, f)
                for i, n in enumerate(names):
                    set_submodule(model, n, FusedSlice(f, i))
            else:
                for n, q in quantized.items():
                    emit(n, q)
                    set_submodule(model, n, _meta_shell(q))
            done.update(names)
            reals = quantized = fused = real = None  # the group's float weights go before the next is read
            if bar is not None:
                bar.update(len(names))
        if bar is not None:
            bar.close()
        for key in sorted(set(reader.where) - reader.read):  # embeddings, norms: copied through
            t = reader.get(key)
            writer.add(key, t.to(float_dtype) if t.is_floating_point() else t)
        writer.finish()
        cfg_json = config.to_dict()
        cfg_json["dtype"] = str(float_dtype).replace("torch.", "")
        cfg_json.pop("torch_dtype", None)
        cfg_json["quantization_config"] = dict(
            checkpoint.quantization_config(model, "rtn", None, default, sorted(skipped)), source_model=str(src),
            streamed=True)
        try:
            tok = checkpoint.load_tokenizer(str(src_p))
            tok.save_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 - a model without a tokenizer still quantizes; it is reported
            skipped_tok = f"{type(e).__name__}: {e}"
        else:
            skipped_tok = None
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, default=str))  # last: see save_quantized
    return dict(converted=sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear)),
                skipped=skipped, seconds=time.time() - t0, peak_rss_mb=checkpoint.peak_rss_mb(),
                files=len(writer.files), most_float_linears_held=most_held, tokenizer_error=skipped_tok)


def _read_linear(reader: _Reader, name: str, lin: nn.Linear) -> nn.Linear:
    """Linear ``name`` with its weights read from the checkpoint in float32 (as the in-memory path loads them)."""
    real = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
    real.weight = nn.Parameter(reader.get(f"{name}.weight").float(), requires_grad=False)
    if lin.bias is not None:
        real.bias = nn.Parameter(reader.get(f"{name}.bias").float(), requires_grad=False)
    return real


def _meta_shell(q: QuantLinear) -> QuantLinear:
    """A QuantLinear of q's shape and format on the meta device (for the quantization_config record)."""
    return QuantLinear(q.in_features, q.out_features, q.bits, q.group_size, q.config.symmetric,
                       bias=q.bias is not None, device="meta")
