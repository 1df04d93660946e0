"""Quantize a (sharded) safetensors checkpoint one decoder layer at a time: RTN, GPTQ, AWQ, without the float model.

    qgemv-quantize MODEL_DIR --stream --method gptq --act-order --bits 4 --group-size 128 --asym \\
        --device cuda --out q4          # add --resume to continue an interrupted run

The model is a meta-device skeleton of its config.json.  Each decoder
layer's tensors are read from the shards when its turn comes
(:class:`qgemv.safetensors_io.Reader`), in float32, onto ``device``; the layer is
calibrated and quantized exactly as the in-memory path does it
(:func:`calibration.quantize.quantize_layer`), written as one shard
(:class:`qgemv.safetensors_io.LayerWriter`) and dropped.  What stays alive: one
float layer, its Hessians, and the hidden states of the calibration samples
(n x L x hidden in float32, on ``device``).  The embeddings are read once to
make layer 0's inputs; lm_head and the final norm only at the end.

Resuming: each finished layer is recorded in ``OUT.partial/progress.json``.
A resumed run rebuilds the hidden states by running the finished layers
again on their stored codes (the same dequantized weights, and the exact
float32 norms and biases, kept in a side file until the end), so it gives
the checkpoint of an uninterrupted run on the same device.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from qgemv import checkpoint, formats, outdir
from qgemv.formats import QuantConfig
from qgemv.nn import FUSE_GROUPS, QuantLinear, fuse_linears, layer_format, set_submodule
from qgemv.safetensors_io import LayerWriter, Lazy, Reader

from .quantize import METHODS, Clock, bar_at, layer_bar, layer_targets, make_method, quantize_layer
from .walker import advance, catch_layer0_inputs, decoder_layers, forward_context, layer_runner


def _materialize(module: nn.Module, prefix: str, reader: Reader, device) -> nn.Module:
    """Give a meta-device module its float32 parameters from the checkpoint, on ``device``."""
    module.to_empty(device=device)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(reader.get(prefix + n))
        for n, b in module.named_buffers():
            key = prefix + n
            if key in reader.index:
                b.copy_(reader.get(key))
            else:
                raise checkpoint.CheckpointError(f"{prefix}{n}: a buffer the checkpoint does not hold")
    return module


def _layer0_inputs(model, base: nn.Module, layer0: nn.Module, reader: Reader, config, src, samples, batch_size,
                   device) -> tuple:
    """(hidden states entering decoder layer 0, one float32 tensor per batch, and its keyword arguments)."""
    emb = model.get_input_embeddings()
    key = next(n for n, m in model.named_modules() if m is emb) + ".weight"
    _materialize(emb, key[: -len("weight")], reader, device)
    checkpoint.rebuild_meta_buffers(model, config, src)  # rotary inv_freq
    rotary = [(n, m) for n, m in base.named_modules() if n.endswith("rotary_emb")]
    for n, m in rotary:
        set_submodule(base, n, m.to(device))
    try:
        return catch_layer0_inputs(lambda ids: base(input_ids=ids.to(device), use_cache=False), layer0, samples,
                                    batch_size, device)
    finally:
        emb.to("meta")


def _shell(lin: nn.Module, c: QuantConfig) -> QuantLinear:
    """A QuantLinear of lin's shape in format c on the meta device (for the quantization_config record)."""
    return QuantLinear(lin.in_features, lin.out_features, c.bits, c.group_size, c.symmetric,
                       bias=lin.bias is not None, device="meta")


def _quant_tensors(name: str, q: QuantLinear, float_dtype) -> dict:
    """A QuantLinear's checkpoint tensors under ``name`` (its bias cast to float_dtype)."""
    return {f"{name}.{key}": (t.to(float_dtype) if key == "bias" else t)
            for key in ("qweight", "scales", "zeros", "bias") if (t := getattr(q, key)) is not None}


def _fused_name(n: str) -> Optional[str]:
    """``owner.qkv`` / ``owner.gate_up`` for a member of a fusable group, else None."""
    owner, _, child = n.rpartition(".")
    kind = next((k for k, ms in FUSE_GROUPS.items() if child in ms), None)
    return None if kind is None else (f"{owner}.{kind}" if owner else kind)


def _members(whole: str) -> list:
    owner, _, kind = whole.rpartition(".")
    return [f"{owner}.{m}" if owner else m for m in FUSE_GROUPS[kind]]


def _pack_layer(layer: nn.Module, prefix: str, quantized: dict, fuse: bool, float_dtype) -> dict:
    """The layer's checkpoint tensors: its QuantLinears (q/k/v and gate/up fused where they share a
    format), and every other parameter cast to ``float_dtype``.  Puts meta shells into ``layer``."""
    tensors, done = {}, set()
    for whole in dict.fromkeys(filter(None, map(_fused_name, quantized))) if fuse else ():
        names = _members(whole)
        fused = fuse_linears([quantized[n] for n in names]) if all(n in quantized for n in names) else None
        if fused is not None:
            tensors.update(_quant_tensors(f"{prefix}{whole}.fused", fused, float_dtype))
            checkpoint.fuse_skeleton(layer, whole, fused.config, float_dtype, prefix)
            done.update(names)
    for n, q in quantized.items():
        if n not in done:
            tensors.update(_quant_tensors(prefix + n, q, float_dtype))
            set_submodule(layer, n, _shell(q, q.config))
    for n, p in layer.named_parameters():  # norms, float linears (the QuantLinear shells hold none)
        if not p.is_meta:
            tensors[prefix + n] = p.detach().to(float_dtype)
    return tensors


def _restore_layer(layer: nn.Module, prefix: str, targets: dict, tensors: dict, exact: dict) -> None:
    """Put a finished layer's quantized function back into its float module: each target's weight is
    dequantized from the stored codes, every other parameter comes from the exact float32 copy."""
    fused_rows = {}
    for n, (m, cfg) in targets.items():
        whole = _fused_name(n)
        key = f"{prefix}{whole}.fused" if whole and f"{prefix}{whole}.fused.qweight" in tensors else prefix + n
        if key not in fused_rows:
            w = formats.dequantize(tensors[f"{key}.qweight"], tensors[f"{key}.scales"], tensors.get(f"{key}.zeros"),
                                   cfg, m.in_features)
            members = _members(whole) if key != prefix + n else [n]
            fused_rows[key] = dict(zip(members, w.split([targets[x][0].out_features for x in members])))
        with torch.no_grad():
            m.weight.copy_(fused_rows[key][n])
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if n in exact:
                p.copy_(exact[n])


def _shells(layer: nn.Module, prefix: str, targets: dict, names: set, float_dtype) -> None:
    """Meta QuantLinear shells (fused as the stored tensor ``names`` say) in place of a resumed layer's targets."""
    for n, (m, c) in targets.items():
        whole = _fused_name(n)
        if whole and f"{prefix}{whole}.fused.qweight" in names:
            if type(layer.get_submodule(n)) is nn.Linear:  # the group's first member: fuse it once
                checkpoint.fuse_skeleton(layer, whole, c, float_dtype, prefix)
        else:
            set_submodule(layer, n, _shell(m, c))


def _outside_layers(model, reader: Reader, layers_path: str, cfg, skip, overrides, group_fallback, skipped: dict,
                    device, float_dtype, config) -> dict:
    """The tensors outside the decoder layers: linears there (lm_head) by the rules (RTN when quantized;
    a tied lm_head stays the embeddings'), everything else (embeddings, final norm) cast to float_dtype."""
    rest = {}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, m in list(model.named_modules()):
        if type(m) is not nn.Linear or name.startswith(layers_path + "."):
            continue
        if tied and f"{name}.weight" not in reader.index:
            skipped[name] = "tied to the embeddings"
            continue
        c, why = layer_format(name, m, cfg, skip, overrides, group_fallback)
        if why:
            skipped[name] = why
            continue
        real = _materialize(m, name + ".", reader, device)
        q = QuantLinear.from_linear(real, c.bits, c.group_size, c.symmetric, name=name, device=device)
        rest.update(_quant_tensors(name, q, float_dtype))
        set_submodule(model, name, _shell(q, c))
        m.to("meta")
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    for key in reader.keys():
        if key.startswith(layers_path + ".") or key in rest or key.rpartition(".")[0] in quantized:
            continue
        _, dtype, shape, _, _ = reader.index[key]
        cast = float_dtype if dtype.is_floating_point else dtype
        # read when its bytes are written: the embeddings and lm_head are never in memory together
        rest[key] = Lazy(cast, tuple(shape), lambda key=key, cast=cast: reader.get(key).to(cast))
    return rest


def _samples_digest(samples: Optional[torch.Tensor]) -> Optional[str]:
    if samples is None:
        return None
    return hashlib.sha256(samples.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


@torch.no_grad()
def quantize_streaming(src, out, cfg: QuantConfig, method: str = "gptq", samples: Optional[torch.Tensor] = None,
                       skip=(r"lm_head", r"embed"), overrides: Optional[dict] = None, damp: float = 0.01,
                       act_order: bool = False, clip_grid: int = 20, batch_size: int = 8, device: str = "cpu",
                       fuse: bool = True, float_dtype: Optional[torch.dtype] = None, true_sequential: bool = False,
                       forward_dtype: Optional[torch.dtype] = None, group_fallback: bool = True,
                       overwrite: bool = False, resume: bool = False, calibration: Optional[dict] = None,
                       progress: bool = True, on_layer: Optional[Callable[[int], None]] = None,
                       tokenizer=None) -> dict:
    """Quantize the safetensors checkpoint directory ``src`` into the qgemv checkpoint ``out``, layer by layer.

    Args:
        cfg, skip, overrides, group_fallback: each linear's format, as
            :func:`qgemv.nn.layer_format` decides it.
        method: one of METHODS ("rtn" needs no samples).
        samples: int64 [n, L] calibration tokens (gptq / awq / awq_gptq).
        damp, act_order, clip_grid, true_sequential, forward_dtype,
            batch_size: as in :func:`calibration.quantize.quantize_causal_lm`.
        device: where each layer, its Hessians and the hidden states live.
        float_dtype: dtype of the tensors kept in float (default: the source's).
        resume: continue the run whose work directory ``OUT.partial`` exists
            (same settings required); otherwise such a directory is an error.
        calibration: recorded in quantization_config.
        tokenizer: saved with the checkpoint (default: the source's, loaded here).
        on_layer: called with each layer's index once it is written.

    Returns a report: converted and skipped modules, per-layer seconds,
    seconds per step (read, forward, hessian, solve, write), total seconds,
    peak host RSS (MB), peak GPU memory (MB, CUDA only), layers resumed, and
    the most float decoder layers held at once (1).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "rtn" and samples is None:
        raise ValueError(f"method {method!r} needs calibration samples")
    checkpoint.require_transformers()
    src_p = Path(src)
    checkpoint.check_float_model(src_p)
    if src_p.is_file():
        raise checkpoint.CheckpointError(f"{src}: streaming reads a safetensors directory, not a .gguf file")
    out_p = checkpoint.check_output_dir(out, overwrite, sources=(src,))
    t0 = time.time()
    if float_dtype is None:
        float_dtype = checkpoint.source_dtype(str(src_p)) or torch.float32
    skip = tuple(skip)
    model, config = checkpoint.meta_model(src_p, torch.float32)  # computed in float32, as in memory
    model.eval()
    reader = Reader(src_p)
    layers_path, layers = decoder_layers(model)
    base = model.get_submodule(layers_path.rpartition(".")[0])
    fingerprint = dict(source=str(src_p.resolve()), bits=cfg.bits, group_size=cfg.group_size,
                       symmetric=cfg.symmetric, skip=list(skip), overrides=overrides or {}, method=method,
                       damp=damp, act_order=act_order, clip_grid=clip_grid, true_sequential=true_sequential,
                       forward_dtype=str(forward_dtype or torch.float32), batch_size=batch_size, fuse=fuse,
                       float_dtype=str(float_dtype), group_fallback=group_fallback,
                       device=torch.device(device).type, samples=_samples_digest(samples),
                       format_version=formats.FORMAT_VERSION)
    writer = LayerWriter(out_p, len(layers), fingerprint, resume=resume)
    try:
        resumed = sorted(writer.done)
        clock = Clock(device)
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        algo = make_method(method, damp, act_order, clip_grid,
                           tf32_hessian=forward_dtype in (torch.bfloat16, torch.float16)) if method != "rtn" else None
        fwd = forward_context(forward_dtype, device)
        skipped, per_layer, held = {}, [], [0, 0]
        hidden = kwargs = None
        if algo is not None and len(writer.done) < len(layers):
            with clock("forward"):
                hidden, kwargs = _layer0_inputs(model, base, layers[0], reader, config, src_p, samples, batch_size,
                                                device)
        run = layer_runner(kwargs or {}, fwd)
        last_needed = max((li for li in range(len(layers)) if li not in writer.done), default=-1)

        bar = layer_bar(len(layers), f"{method} {cfg.name} (streamed)") if progress else None

        with outdir.terminate_raises():
            for li in range(len(layers)):
                tl = time.time()
                prefix = f"{layers_path}.{li}."
                # a finished layer is read again only when later layers need its outputs
                needed = li not in writer.done or (hidden is not None and li < last_needed)
                if needed:
                    with clock("read"):
                        layer = _materialize(layers[li], prefix, reader, device)
                    held[0] += 1
                    held[1] = max(held)
                else:
                    layer = layers[li]  # meta: its names and shapes give the format record
                targets = layer_targets(layer, prefix, cfg, skip, overrides, group_fallback, skipped)
                info = {}
                if li in writer.done:  # resumed: rebuild its function from what was written
                    if needed:
                        tensors, exact = writer.read_unit(li)
                        _restore_layer(layer, prefix, targets, tensors, exact)
                        with clock("forward"):
                            advance(layer, hidden, kwargs, fwd)
                    else:
                        tensors = writer.unit_names(li)
                    _shells(layer, prefix, targets, tensors, float_dtype)
                else:
                    if algo is None:
                        with clock("solve"):
                            quantized = {n: QuantLinear.from_linear(m, c.bits, c.group_size, c.symmetric,
                                                                    name=prefix + n, device=device)
                                         for n, (m, c) in targets.items()}
                    else:
                        pending, originals, info = quantize_layer(
                            layer, prefix, targets, algo, hidden, kwargs, run, fwd, device, true_sequential, clock,
                            on_progress=lambda f, li=li: bar_at(bar, li + f))
                        del originals  # the float weights: gone before the next layer is read
                        if li < last_needed:
                            with clock("forward"):
                                advance(layer, hidden, kwargs, fwd)
                        quantized = {n: QuantLinear.from_quantized(m, c, qw, s, z) for n, m, c, qw, s, z in pending}
                        pending = None
                    weights = {f"{n}.weight" for n in targets}
                    exact = {n: p.detach() for n, p in layer.named_parameters() if n not in weights}
                    with clock("write"):
                        tensors = _pack_layer(layer, prefix, quantized, fuse, float_dtype)
                        writer.write_unit(li, tensors, exact)
                    quantized = tensors = exact = None
                layers[li] = layer.to("meta")
                layer = targets = None
                held[0] -= int(needed)
                per_layer.append({"layer": li, "seconds": time.time() - tl, "resumed": li in resumed, "info": info})
                if bar is not None:
                    post = {"rss": f"{checkpoint.peak_rss_mb():.0f}MB"}
                    if cuda:
                        post["gpu"] = f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f}MB"
                    bar.set_postfix(post)
                bar_at(bar, li + 1)
                if on_layer is not None and li not in resumed:
                    on_layer(li)
            if bar is not None:
                bar.close()
            hidden = None
            with clock("write"):
                rest = _outside_layers(model, reader, layers_path, cfg, skip, overrides, group_fallback, skipped,
                                       device, float_dtype, config)
                cfg_json = config.to_dict()
                checkpoint.record_float_dtype(cfg_json, float_dtype)
                cfg_json["quantization_config"] = dict(
                    checkpoint.quantization_config(model, method, calibration, cfg, sorted(skipped)),
                    source_model=str(src), streamed=True)
                try:
                    tok = tokenizer if tokenizer is not None else checkpoint.load_tokenizer(str(src_p))
                    tok_error = None
                except Exception as e:  # noqa: BLE001 - a model without a tokenizer still quantizes; it is reported
                    tok, tok_error = None, f"{type(e).__name__}: {e}"
                steps = dict(clock.seconds)
                if "hessian" in steps:
                    steps["forward"] = steps.get("forward", 0.0) - steps["hessian"]  # reported apart
                report = dict(method=method, format=cfg.name, device=str(device), layers=len(layers),
                              resumed_layers=resumed, steps_seconds=steps, per_layer=per_layer,
                              peak_rss_mb=checkpoint.peak_rss_mb(),
                              peak_gpu_mb=torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
                              most_float_layers_held=held[1], tokenizer_error=tok_error, skipped=skipped,
                              converted=sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear)))
                report["seconds"] = time.time() - t0
                writer.finish(rest, cfg_json, tok, {"quantize_report.json": report})
    except BaseException:
        if not writer.done:  # nothing finished: leave no work directory to resume or delete
            writer.discard()
        raise
    finally:
        writer.release()
    report["seconds"] = time.time() - t0
    return report
