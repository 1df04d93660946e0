"""Quantize a causal LM layer by layer with RTN, GPTQ or AWQ-style scaling.

Only one decoder layer's weights, its calibration activations and its
Hessians are alive at once (the hidden states of all samples between layers
are kept: n x L x hidden floats):

1. run the embeddings once and catch the inputs of decoder layer 0;
2. for each layer: collect what the method needs from its linears (input
   Hessians for GPTQ, input activations for AWQ) while running the float
   layer; quantize its linears; run the quantized layer to produce the next
   layer's inputs, so later layers calibrate on the errors of earlier ones.

The model may live on the CPU and each layer is moved to ``device`` in turn.
``device="cuda"`` runs each layer's Hessians, searches and GPTQ on the GPU;
a test checks it against the CPU path on a tiny Llama (run on the H200: over
98% identical codes, logits within 5%).  The SmolLM2 numbers in
BENCHMARKS.md are from the CPU path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from qgemv import arch, formats
from qgemv.checkpoint import peak_rss_mb
from qgemv.nn import QuantLinear, QuantizeReport, check_rules, quantize_model, set_submodule

from . import awq
from .recipe import METHODS, Recipe
from .walker import StopForward, advance, catch_layer0_inputs, decoder_layers, forward_context, layer_runner
from .gptq import GPTQ


@dataclass
class CalibReport(QuantizeReport):
    """What a calibration run did: both drivers return one (the streamed run also writes it, as JSON, into
    the checkpoint's quantize_report.json)."""

    method: str = "rtn"
    format: str = ""  # the recipe's default format, QuantConfig.name
    device: str = "cpu"
    layers: int = 0
    peak_rss_mb: float = 0.0
    per_layer: list = field(default_factory=list)  # dicts with layer, seconds, info (streamed: resumed)
    rotation: Optional[dict] = None  # rotate.rotate_llama's record, if the model was rotated
    # streamed runs only
    resumed_layers: list = field(default_factory=list)
    steps_seconds: dict = field(default_factory=dict)  # read, forward, hessian, solve, write
    peak_gpu_mb: Optional[float] = None
    most_float_layers_held: int = 0
    tokenizer_error: Optional[str] = None

    def to_json(self) -> dict:
        """The report as JSON values."""
        return dataclasses.asdict(self)

    def __getitem__(self, key: str):
        """Deprecated: the streamed driver used to return a dict; read the attributes instead."""
        warnings.warn("CalibReport[key] is deprecated; use the attribute (report.%s)" % key, DeprecationWarning,
                      stacklevel=2)
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return getattr(self, key)


# Linears with the same input tensor share one Hessian (off only in a test
# that checks the shared one gives the same result).
_SHARE_HESSIANS = True

# Execution order of a Llama-style decoder layer's linears (by attribute name).
_SEQUENTIAL_STAGES = arch.STAGES


def _sequential_stages(names: list) -> list:
    """Split a layer's linear names into stages in execution order; unknown names form a last stage."""
    stages, left = [], list(names)
    for group in _SEQUENTIAL_STAGES:
        stage = [n for n in left if n.rsplit(".", 1)[-1] in group]
        if stage:
            stages.append(stage)
            left = [n for n in left if n not in stage]
    if left:
        stages.append(left)
    return stages


def make_method(recipe: Recipe):
    """The method object of a calibrated recipe (protocol: calibration.gptq.GPTQ)."""
    tf32 = recipe.forward_dtype in (torch.bfloat16, torch.float16)
    if recipe.method == "gptq":
        return GPTQ(recipe.damp, recipe.act_order, recipe.clip_grid, tf32)
    if recipe.method == "awq":
        return awq.AWQ(recipe.clip_grid)
    if recipe.method == "awq_gptq":
        return awq.AWQThenGPTQ(GPTQ(recipe.damp, recipe.act_order, recipe.clip_grid, tf32))
    raise ValueError(f"{recipe.method!r} is not a calibrated method ({METHODS[1:]})")


def _collect(layer, stage: list, targets: dict, hidden: list, kwargs: dict, new_stats, device, fwd, stop: bool,
             prefix: str, clock=None) -> tuple:
    """Feed each stage linear's input of every batch to a statistic (new_stats(k, device)).

    Linears fed by the very same tensor (q/k/v; gate/up) share one statistic:
    decided on the first batch by identity of the input and checked on every
    later one.  With ``stop`` each pass ends once the stage has its inputs.
    Returns ({owner name: statistic}, {linear name: owner name}).
    """
    stats, owner, cur, seen = {}, {}, {}, set()

    def collect(n, x):
        cur[n] = x
        if n not in owner:
            twin = next((m for m in seen if cur.get(m) is x), None) if _SHARE_HESSIANS else None
            owner[n] = owner[twin] if twin is not None else n
            if owner[n] == n:
                stats[n] = new_stats(targets[n][0].in_features, device)
        elif owner[n] != n and cur.get(owner[n]) is not x:
            raise RuntimeError(f"{prefix}{n}: its input stopped being {owner[n]}'s input")
        if owner[n] == n:
            if clock is None:
                stats[n].add(x)
            else:
                with clock("hessian"):  # counted inside "forward" too; reports subtract it
                    stats[n].add(x)
        seen.add(n)
        if stop and len(seen) == len(stage):
            raise StopForward  # the rest of the layer is not needed for this stage

    hooks = [targets[n][0].register_forward_hook(lambda mod, inp, out, n=n: collect(n, inp[0])) for n in stage]
    try:
        for x in hidden:
            seen.clear()
            cur.clear()
            try:
                with fwd():
                    layer(x, **kwargs)
            except StopForward:
                pass
    finally:
        for h in hooks:
            h.remove()
    return stats, owner


class Clock:
    """Seconds per step ("forward", "hessian", "solve", ...), synchronizing CUDA around each timed block."""

    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = {}

    @contextlib.contextmanager
    def __call__(self, step: str):
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - t


def layer_targets(layer: nn.Module, prefix: str, recipe: Recipe, skipped: dict) -> dict:
    """{linear name in the layer: (module, QuantConfig)} by the recipe's rules; skipped ones go into ``skipped``
    with why."""
    targets = {}
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            lcfg, why = recipe.layer_format(prefix + name, m)
            if why:
                skipped[prefix + name] = why
            else:
                targets[name] = (m, lcfg)
    return targets


@dataclass
class LayerCalib:
    """What every decoder layer's quantization shares within one run.

    algo: a make_method object; hidden: the current layer's calibration
    inputs, one [b, L, hidden] tensor per batch (advanced in place from layer
    to layer); kwargs: the layer's other call arguments (walker); run:
    run(layer, hidden) runs a layer on them (walker.layer_runner); fwd: the
    forward context (dtype, autocast); device: where the layer is solved;
    true_sequential: each stage's statistics taken with the earlier stages
    quantized; clock: seconds per step.
    """

    algo: object
    hidden: list
    kwargs: dict
    run: object
    fwd: object
    device: object
    true_sequential: bool = False
    clock: Clock = field(default_factory=Clock)


def quantize_layer(layer, prefix: str, targets: dict, calib: LayerCalib, on_progress=None) -> tuple:
    """Quantize one float decoder layer's target linears ({name: (module, QuantConfig)}) with ``calib.algo``.

    Returns (pending, originals, info): pending lists (name, module,
    QuantConfig, qweight, scales, zeros) per target; each target's weight is
    left as its dequantized codes (so running the layer now gives the next
    layer's inputs) and ``originals`` holds the float weights it replaced.
    on_progress(fraction): called as the layer's work goes on (each stage's
    statistics half of its share, its solves the other half), so that a
    progress bar has an estimate long before the first layer ends.
    """
    algo, hidden, clock = calib.algo, calib.hidden, calib.clock
    report = on_progress or (lambda f: None)
    pending, originals = [], {}

    def swap_in(n, m, lcfg, qw, s, z):  # the target's float weight out, its dequantized codes in
        originals[n] = m.weight.data
        m.weight.data = formats.dequantize(qw, s, z, lcfg, m.in_features).to(m.weight.dtype)

    with clock("solve"):  # AWQ's scale search (GPTQ: nothing)
        pre = algo.before(layer, targets, hidden, calib.run)
    info = dict(getattr(algo, "info", {}))
    # True-sequential: q/k/v, then o, then gate/up, then down, each stage's
    # statistics collected with the earlier stages already quantized, so
    # o_proj sees the inputs the quantized model gives it.
    stages = _sequential_stages(list(targets)) if calib.true_sequential else [list(targets)]
    for si, stage in enumerate(stages):
        stats, owner = {}, {}
        share = 1.0 / len(stages)
        if algo.new_stats is not None:
            with clock("forward"):
                stats, owner = _collect(layer, stage, targets, hidden, calib.kwargs, algo.new_stats, calib.device,
                                        calib.fwd, stop=si + 1 < len(stages), prefix=prefix, clock=clock)
        report(share * (si + 0.5))
        # Linears of one format sharing a statistic (q/k/v; gate/up) are solved together where the method can.
        batches = {}
        for n in stage:
            key = (owner[n], targets[n][1]) if owner and hasattr(algo, "quantize_many") else (n, None)
            batches.setdefault(key, []).append(n)
        for bi, ((key, _), names) in enumerate(batches.items()):
            mods = [targets[n][0] for n in names]
            lcfg = targets[names[0]][1]
            stat = stats[owner[names[0]]] if owner else pre.get(names[0])
            with clock("solve"):
                if len(names) > 1:
                    results = algo.quantize_many([prefix + n for n in names], [m.weight for m in mods], lcfg, stat)
                else:
                    results = [algo.quantize(prefix + names[0], mods[0].weight, lcfg, stat)]
            for n, m, (qw, s, z, inf) in zip(names, mods, results):
                if inf:
                    info[n] = inf
                pending.append((n, m, lcfg, qw, s, z))
                if len(stages) > 1:
                    swap_in(*pending[-1])
            report(share * (si + 0.5 + 0.5 * (bi + 1) / len(batches)))
        del stats
    # The next layer's inputs come from the quantized layer, run on the
    # dequantized weights as dense nn.Linear (the same function as
    # QuantLinear's reference, without unpacking on every call).
    for item in pending:
        if item[0] not in originals:
            swap_in(*item)
    return pending, originals, info


def layer_bar(layers: int, desc: str):
    """A tqdm bar over decoder layers that shows fractions of a layer (bar_at from quantize_layer's
    on_progress), so its time estimate appears after the first statistics, not after the first layer."""
    from tqdm.auto import tqdm

    return tqdm(total=layers, desc=desc, unit="layer",
                bar_format="{l_bar}{bar}| {n:.1f}/{total} layers [{elapsed}<{remaining}{postfix}]")


def bar_at(bar, position: float) -> None:
    """Move a layer_bar (or None) to ``position`` layers."""
    if bar is not None:
        bar.n = position
        bar.refresh()


@torch.no_grad()
def quantize_causal_lm(model: nn.Module, recipe, method: Optional[str] = None, samples: Optional[torch.Tensor] = None,
                       *, device: str = "cpu", progress: bool = True, **fields) -> CalibReport:
    """Quantize ``model``'s linear layers in place, layer by layer; returns a CalibReport.

    Args:
        recipe: a :class:`calibration.recipe.Recipe`, or a QuantConfig
            followed by ``method`` and the recipe's fields as keywords
            (``Recipe.of``: damp, act_order, clip_grid, batch_size, skip,
            overrides, group_fallback, true_sequential, forward_dtype,
            rotate, rotate_seed).
        samples: int64 [n, L] calibration tokens (every method but "rtn").
        device: where each decoder layer is quantized (the model may stay on
            the CPU; each layer is moved in turn).
    """
    recipe = Recipe.of(recipe, method, **fields)
    check_rules(recipe.cfg, recipe.skip, recipe.overrides)
    if recipe.calibrated and samples is None:
        raise ValueError(f"method {recipe.method!r} needs calibration samples")
    t0 = time.time()
    rotation = None
    if recipe.rotate:
        from .rotate import rotate_llama

        rotation = rotate_llama(model, seed=recipe.rotate_seed)
    if not recipe.calibrated:
        base = quantize_model(model, recipe.cfg.bits, recipe.cfg.group_size, recipe.cfg.symmetric,
                              skip=recipe.skip, overrides=recipe.overrides, progress=progress,
                              group_fallback=recipe.group_fallback, device=device)
        rep = CalibReport(**vars(base))
        rep.method, rep.format, rep.device = recipe.method, recipe.cfg.name, str(device)
        rep.peak_rss_mb, rep.rotation = peak_rss_mb(), rotation
        return rep
    rep = CalibReport(method=recipe.method, format=recipe.cfg.name, device=str(device), rotation=rotation)
    layers_path, layers = decoder_layers(model)
    rep.layers = len(layers)
    _outside_layers_rtn(model, layers_path, recipe, rep)
    model_device = next(model.parameters()).device
    hidden, kwargs = catch_layer0_inputs(lambda ids: model(ids.to(model_device), use_cache=False), layers[0],
                                          samples, recipe.batch_size, device)
    fwd = forward_context(recipe.forward_dtype, device)
    run = layer_runner(kwargs, fwd)
    calib = LayerCalib(make_method(recipe), hidden, kwargs, run, fwd, device, recipe.true_sequential)
    bar = layer_bar(len(layers), f"{recipe.method} {recipe.cfg.name}") if progress else None
    for li in range(len(layers)):
        tl = time.time()
        layer = layers[li].to(device)
        prefix = f"{layers_path}.{li}."
        targets = layer_targets(layer, prefix, recipe, rep.skipped)
        pending, originals, info = quantize_layer(layer, prefix, targets, calib,
                                                  on_progress=lambda f, li=li: bar_at(bar, li + f))
        advance(layer, hidden, kwargs, fwd)  # the next layer's inputs, in place
        for n, m, lcfg, qw, s, z in pending:
            m.weight.data = originals[n]
            _count(rep, m, qw, s, z)
            set_submodule(layer, n, QuantLinear.from_quantized(m, lcfg, qw, s, z))
            rep.converted.append(prefix + n)
        layers[li] = layer.to(model_device)
        rep.per_layer.append({"layer": li, "seconds": time.time() - tl, "info": info})
        bar_at(bar, li + 1)
        if bar is not None:
            bar.set_postfix(rss=f"{peak_rss_mb():.0f}MB")
    if bar is not None:
        bar.close()
    rep.seconds = time.time() - t0
    rep.peak_rss_mb = peak_rss_mb()
    return rep


def _outside_layers_rtn(model: nn.Module, layers_path: str, recipe: Recipe, rep: CalibReport) -> None:
    """Linears outside the decoder layers (lm_head, ...): the skip rules, else RTN, in place."""
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and not name.startswith(layers_path + "."):
            lcfg, why = recipe.layer_format(name, m)
            if why:
                rep.skipped[name] = why
            else:
                q = QuantLinear.from_linear(m, lcfg.bits, lcfg.group_size, lcfg.symmetric, name=name)
                _count(rep, m, q.qweight, q.scales, q.zeros)
                set_submodule(model, name, q)
                rep.converted.append(name)


def _count(rep, lin, qw, s, z) -> None:
    rep.bytes_before += lin.weight.numel() * lin.weight.element_size()
    rep.bytes_after += formats.nbytes(qw, s, z)
