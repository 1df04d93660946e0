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

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from qgemv import checkpoint, formats, outdir
from qgemv.formats import QuantConfig
from qgemv.nn import FUSE_GROUPS, QuantLinear, fuse_linears, set_submodule
from qgemv.safetensors_io import LayerWriter, Lazy, Reader

from .quantize import (CalibReport, Clock, LayerCalib, bar_at, layer_bar, layer_targets, make_method,
                       quantize_layer)
from .recipe import Recipe
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


def _outside_layers(model, reader: Reader, layers_path: str, recipe: Recipe, skipped: dict, device, float_dtype,
                    config) -> dict:
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
        c, why = recipe.layer_format(name, m)
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


@dataclass
class StreamOutput:
    """How a streamed run writes its checkpoint.

    Attributes:
        fuse: store q/k/v and gate/up fused where they share a format.
        float_dtype: dtype of the tensors kept in float (default: the source's).
        overwrite: replace an existing output directory.
        resume: continue the run whose work directory ``OUT.partial`` exists
            (the same recipe, samples and output settings required);
            otherwise such a directory is an error.
        calibration: recorded in quantization_config.
        tokenizer: saved with the checkpoint (default: the source's, loaded then).
        on_layer: called with each layer's index once it is written.
    """

    fuse: bool = True
    float_dtype: Optional[torch.dtype] = None
    overwrite: bool = False
    resume: bool = False
    calibration: Optional[dict] = None
    tokenizer: object = None
    on_layer: Optional[Callable[[int], None]] = None


@torch.no_grad()
def quantize_streaming(src, out, recipe, method: Optional[str] = None, samples: Optional[torch.Tensor] = None, *,
                       device: str = "cpu", progress: bool = True, output: Optional[StreamOutput] = None,
                       **fields) -> CalibReport:
    """Quantize the safetensors checkpoint directory ``src`` into the qgemv checkpoint ``out``, layer by layer.

    Args:
        recipe: a :class:`calibration.recipe.Recipe`, or a QuantConfig
            followed by ``method`` and the recipe's fields as keywords (as
            :func:`calibration.quantize.quantize_causal_lm` takes them);
            ``rotate`` is not streamed.
        samples: int64 [n, L] calibration tokens (every method but "rtn").
        device: where each layer, its Hessians and the hidden states live.
        output: a :class:`StreamOutput`, or its fields as keywords.

    Returns the CalibReport that is also written into the checkpoint as
    quantize_report.json: converted and skipped modules, per-layer seconds,
    seconds per step (read, forward, hessian, solve, write), total seconds,
    peak host RSS (MB), peak GPU memory (MB, CUDA only), layers resumed, and
    the most float decoder layers held at once (1).
    """
    out_fields = {k: fields.pop(k) for k in list(fields) if k in _OUTPUT_FIELDS}
    if output is not None and out_fields:
        raise TypeError(f"output= was given; set {', '.join(sorted(out_fields))} on the StreamOutput instead")
    output = output or StreamOutput(**out_fields)
    recipe = Recipe.of(recipe, method, **fields)
    if recipe.rotate:
        raise ValueError("a streamed run does not rotate (rotation needs the whole model in memory)")
    if recipe.calibrated and samples is None:
        raise ValueError(f"method {recipe.method!r} needs calibration samples")
    return _StreamRun(src, out, recipe, samples, device, output).run(progress)


_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(StreamOutput)}


class _StreamRun:
    """One streamed run: the meta model, the reader, the work directory's writer and the step clock."""

    def __init__(self, src, out, recipe: Recipe, samples, device, output: StreamOutput):
        checkpoint.require_transformers()
        self.src = Path(src)
        checkpoint.check_float_model(self.src)
        if self.src.is_file():
            raise checkpoint.CheckpointError(f"{src}: streaming reads a safetensors directory, not a .gguf file")
        out_p = checkpoint.check_output_dir(out, output.overwrite, sources=(src,))
        self.t0 = time.time()
        self.recipe, self.samples, self.device, self.output = recipe, samples, device, output
        self.float_dtype = output.float_dtype or checkpoint.source_dtype(str(self.src)) or torch.float32
        self.model, self.config = checkpoint.meta_model(self.src, torch.float32)  # computed in float32
        self.model.eval()
        self.reader = Reader(self.src)
        self.layers_path, self.layers = decoder_layers(self.model)
        fingerprint = dict(recipe.fingerprint(), source=str(self.src.resolve()), fuse=output.fuse,
                           float_dtype=str(self.float_dtype), device=torch.device(device).type,
                           samples=_samples_digest(samples), format_version=formats.FORMAT_VERSION)
        self.writer = LayerWriter(out_p, len(self.layers), fingerprint, resume=output.resume)
        self.report = CalibReport(method=recipe.method, format=recipe.cfg.name, device=str(device),
                                  layers=len(self.layers), resumed_layers=sorted(self.writer.done))

    def run(self, progress: bool) -> CalibReport:
        try:
            with outdir.terminate_raises():
                self._calibrate(progress)
                self._finish()
        except BaseException:
            if not self.writer.done:  # nothing finished: leave no work directory to resume or delete
                self.writer.discard()
            raise
        finally:
            self.writer.release()
        self.report.seconds = time.time() - self.t0
        return self.report

    def _calibrate(self, progress: bool) -> None:
        """Every decoder layer in turn: quantized and written, or (resumed) rebuilt from what was written."""
        r, n = self.recipe, len(self.layers)
        self.clock = Clock(self.device)
        self.cuda = torch.device(self.device).type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.algo = make_method(r) if r.calibrated else None
        self.fwd = forward_context(r.forward_dtype, self.device)
        self.held = [0, 0]  # float decoder layers alive now, most at once
        self.hidden = self.kwargs = None
        if self.algo is not None and len(self.writer.done) < n:
            with self.clock("forward"):
                base = self.model.get_submodule(self.layers_path.rpartition(".")[0])
                self.hidden, self.kwargs = _layer0_inputs(self.model, base, self.layers[0], self.reader,
                                                          self.config, self.src, self.samples, r.batch_size,
                                                          self.device)
        self.runner = layer_runner(self.kwargs or {}, self.fwd)
        self.last_needed = max((li for li in range(n) if li not in self.writer.done), default=-1)
        self.bar = layer_bar(n, f"{r.method} {r.cfg.name} (streamed)") if progress else None
        for li in range(n):
            self._layer(li)
        if self.bar is not None:
            self.bar.close()
        self.hidden = None

    def _layer(self, li: int) -> None:
        tl, rep, clock = time.time(), self.report, self.clock
        prefix = f"{self.layers_path}.{li}."
        resumed = li in self.writer.done
        # a finished layer is read again only when later layers need its outputs
        needed = not resumed or (self.hidden is not None and li < self.last_needed)
        if needed:
            with clock("read"):
                layer = _materialize(self.layers[li], prefix, self.reader, self.device)
            self.held[0] += 1
            self.held[1] = max(self.held)
        else:
            layer = self.layers[li]  # meta: its names and shapes give the format record
        targets = layer_targets(layer, prefix, self.recipe, rep.skipped)
        info = {}
        if resumed:  # rebuild its function from what was written
            if needed:
                tensors, exact = self.writer.read_unit(li)
                _restore_layer(layer, prefix, targets, tensors, exact)
                with clock("forward"):
                    advance(layer, self.hidden, self.kwargs, self.fwd)
            else:
                tensors = self.writer.unit_names(li)
            _shells(layer, prefix, targets, tensors, self.float_dtype)
        else:
            quantized, info = self._quantize(li, layer, prefix, targets)
            weights = {f"{n}.weight" for n in targets}
            exact = {n: p.detach() for n, p in layer.named_parameters() if n not in weights}
            with clock("write"):
                tensors = _pack_layer(layer, prefix, quantized, self.output.fuse, self.float_dtype)
                self.writer.write_unit(li, tensors, exact)
            quantized = tensors = exact = None
        self.layers[li] = layer.to("meta")
        layer = targets = None
        self.held[0] -= int(needed)
        rep.per_layer.append({"layer": li, "seconds": time.time() - tl, "resumed": resumed, "info": info})
        if self.bar is not None:
            post = {"rss": f"{checkpoint.peak_rss_mb():.0f}MB"}
            if self.cuda:
                post["gpu"] = f"{torch.cuda.max_memory_allocated(self.device) / 2**20:.0f}MB"
            self.bar.set_postfix(post)
        bar_at(self.bar, li + 1)
        if self.output.on_layer is not None and not resumed:
            self.output.on_layer(li)

    def _quantize(self, li: int, layer: nn.Module, prefix: str, targets: dict) -> tuple:
        """({name: QuantLinear} of the layer's targets, the method's info); advances the hidden states."""
        if self.algo is None:
            with self.clock("solve"):
                return {n: QuantLinear.from_linear(m, c.bits, c.group_size, c.symmetric, name=prefix + n,
                                                   device=self.device)
                        for n, (m, c) in targets.items()}, {}
        calib = LayerCalib(self.algo, self.hidden, self.kwargs, self.runner, self.fwd, self.device,
                           self.recipe.true_sequential, self.clock)
        pending, originals, info = quantize_layer(layer, prefix, targets, calib,
                                                  on_progress=lambda f: bar_at(self.bar, li + f))
        del originals  # the float weights: gone before the next layer is read
        if li < self.last_needed:
            with self.clock("forward"):
                advance(layer, self.hidden, self.kwargs, self.fwd)
        return {n: QuantLinear.from_quantized(m, c, qw, s, z) for n, m, c, qw, s, z in pending}, info

    def _finish(self) -> None:
        """The tensors outside the layers, config.json, the tokenizer and the report; then the directory."""
        rep, r = self.report, self.recipe
        with self.clock("write"):
            rest = _outside_layers(self.model, self.reader, self.layers_path, r, rep.skipped, self.device,
                                   self.float_dtype, self.config)
            cfg_json = self.config.to_dict()
            checkpoint.record_float_dtype(cfg_json, self.float_dtype)
            cfg_json["quantization_config"] = dict(
                checkpoint.quantization_config(self.model, r.method, self.output.calibration, r.cfg,
                                               sorted(rep.skipped)),
                source_model=str(self.src), streamed=True)
            try:
                tok = self.output.tokenizer
                if tok is None:
                    tok = checkpoint.load_tokenizer(str(self.src))
            except Exception as e:  # noqa: BLE001 - a model without a tokenizer still quantizes; it is reported
                tok, rep.tokenizer_error = None, f"{type(e).__name__}: {e}"
            steps = dict(self.clock.seconds)
            if "hessian" in steps:
                steps["forward"] = steps.get("forward", 0.0) - steps["hessian"]  # reported apart
            rep.steps_seconds = steps
            rep.peak_rss_mb = checkpoint.peak_rss_mb()
            rep.peak_gpu_mb = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.cuda else None
            rep.most_float_layers_held = self.held[1]
            rep.converted = sorted(n for n, m in self.model.named_modules() if isinstance(m, QuantLinear))
            rep.seconds = time.time() - self.t0
            self.writer.finish(rest, cfg_json, tok, {"quantize_report.json": _report_json(rep)})


def _report_json(rep: CalibReport) -> dict:
    """The streamed run's quantize_report.json (the report's fields that a streamed run fills)."""
    d = rep.to_json()
    for key in ("bytes_before", "bytes_after", "rotation"):
        d.pop(key, None)
    return d
