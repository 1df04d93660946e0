"""End-to-end scale tuning of a quantized checkpoint against its float model.

    python -m calibration.e2e runs/q4 --out runs/q4-e2e [--reference default] [--steps 200]

GPTQ, AWQ and SignRound each fit one linear or one decoder layer to its own
float output.  This pass instead tunes every per-channel / per-group scale of
the whole quantized model at once, with the integer codes and zero points
fixed, so that its next-token distribution matches the float model's:

    loss = KL(p_float || p_quantized), mean over the tokens of a step's windows.

The float model's log-probabilities on the calibration windows are computed
once, before tuning (with ``--stream-teacher``, only the probe windows' are
stored; a training window's are computed at its step).  The scales are
trained in log space with Adam, ``--batch`` windows per step (default 1), in
a seeded order.  ``--device cuda`` runs the float model, the tuning and the
probes on the GPU.  A few further windows (``--probe``) are
held out, drawn from the last 10% of the calibration tokens, which no
training window touches: their KL is measured before the first step and every
``--eval-every`` steps, and the scales that gave the lowest probe KL are the
ones written (so the output is never worse than the input on the probe).
The checkpoint format does not change: only the fp16 ``scales`` tensors do
(and, with ``--code-lr``, the packed codes), and
``quantization_config.calibration.e2e`` records the settings and the probe KL
before and after.

``--code-lr LR`` lets the integer codes move too (the zero points stay
fixed): every weight gets a float offset in code units, trained with the
scales through a straight-through rounding, by gradient steps of LR x the
gradient / its RMS over the layer (:class:`CodeStep`; each code moves at most
one step, and stays in the format's range).  The probe-selected step's
rounded codes are written.

``--tune-norms`` also tunes the RMSNorm gains (as gain x exp(u), u trained
with the scales).  A gain multiplies one input column of every linear that
reads the norm, which per-row or per-group scales cannot express; the gains
are float tensors of the checkpoint, so this too leaves the format as it is.

The calibration windows come from the calibration split (disjoint from the
evaluation text), as in ``qgemv-quantize``.  ``--generated N`` adds N
training windows sampled from the float model itself (more, and more varied,
data than a small calibration text holds; tuning on a few hundred thousand
real tokens for many passes overfits them).  ``--ce-weight W`` adds W times
the windows' next-token cross-entropy to the KL (and to the probe score that
picks the written scales).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as Fn
from torch.nn.utils import parametrize

from qgemv import checkpoint as C
from qgemv import formats
from qgemv.nn import QuantLinear

from .data import PROBE_FRACTION, generated_windows, train_and_probe_windows


class _GainTuned(nn.Module):
    """Parametrization of an RMSNorm gain: weight = gain0 * exp(u), u trainable (starts at 0)."""

    def __init__(self, n: int):
        super().__init__()
        self.u = nn.Parameter(torch.zeros(n))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.u.exp().to(w.dtype)


def _norm_modules(model: nn.Module) -> list:
    """Every RMSNorm-like module (class name ending in RMSNorm, 1-D weight), in module order."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1]


class ScaleTuned(nn.Module):
    """A QuantLinear as integer codes (q - z) times trainable scales.

    codes: bfloat16 [N, K] (small integers, exact); log_s: float32 [N, G]
    (G = K / group, or 1 per channel), trainable.  forward(x [..., K]) ->
    [..., N] in x's dtype (or the autocast dtype).

    tune_codes: also train a float32 offset v [N, K] (in code units, starts
    at 0).  The forward uses round(clamp(codes + v)) with a straight-through
    gradient, the clamp keeping every stored code q = c + z inside the
    format's range; the zero points stay fixed.  write_back stores the rounded
    codes as well as the scales.
    """

    def __init__(self, q: QuantLinear, tune_codes: bool = False, tune_bias: bool = False):
        super().__init__()
        cfg, k = q.config, q.in_features
        ones = torch.ones_like(q.scales, dtype=torch.float16)
        codes = formats.dequantize(q.qweight, ones, q.zeros if not cfg.symmetric else None, cfg, k)
        self.group = k if cfg.group_size is None else cfg.group_size
        self.register_buffer("codes", codes.to(torch.bfloat16))
        s = q.scales.float().reshape(q.out_features, -1)
        if not torch.all(s > 0):
            raise ValueError(f"ScaleTuned: {q.out_features}x{k} layer has non-positive scales; cannot tune in log space")
        self.log_s = nn.Parameter(s.log())
        self.bias = q.bias
        self.quant = q
        # tune_bias: a float32 [N] offset added to the output (starts at 0)
        self.bias_delta = nn.Parameter(torch.zeros(q.out_features, device=s.device)) if tune_bias else None
        self.tune_codes = tune_codes
        if tune_codes:
            qmin, qmax = formats.code_range(cfg)
            if cfg.bits == 8:
                z = torch.zeros_like(s)
            elif cfg.symmetric:
                z = torch.full_like(s, 8.0)
            else:
                z = q.zeros.float().reshape(s.shape)
            self.register_buffer("zero", z)  # [N, G]; c = q - z must stay in [qmin - z, qmax - z]
            self.qrange = (qmin, qmax)
            self.v = nn.Parameter(torch.zeros(q.out_features, k, device=s.device))

    def _codes(self) -> torch.Tensor:
        """float32 [N, G, group] codes c = q - z used by the forward (rounded, straight-through)."""
        n, k = self.codes.shape
        c = self.codes.float().view(n, k // self.group, self.group)
        if not self.tune_codes:
            return c
        qmin, qmax = self.qrange
        z = self.zero[..., None]
        c = torch.clamp(c + self.v.view_as(c), qmin - z, qmax - z)
        return c + (c.round() - c).detach()

    def weight(self) -> torch.Tensor:
        n, k = self.codes.shape
        return (self._codes() * self.log_s.exp()[..., None]).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias
        if self.bias_delta is not None:
            b = self.bias_delta if b is None else b + self.bias_delta
        return Fn.linear(x, self.weight().to(x.dtype), None if b is None else b.to(x.dtype))

    @torch.no_grad()
    def write_back(self) -> int:
        """Store exp(log_s) in the QuantLinear's fp16 scales (same shape) and,
        with tune_codes, the rounded codes in its qweight; returns how many codes changed."""
        s = self.log_s.detach().exp().reshape(self.quant.scales.shape)
        s = s.clamp(max=float(torch.finfo(torch.float16).max)).to(torch.float16)
        if not torch.all(torch.isfinite(s) & (s > 0)):
            raise ValueError("ScaleTuned.write_back: a tuned scale is not a positive finite fp16 number")
        self.quant.scales.copy_(s)
        if self.bias_delta is not None:
            old = self.quant.bias
            new = self.bias_delta.detach() + (0.0 if old is None else old.float())
            dtype = old.dtype if old is not None else torch.float32
            if old is None:
                del self.quant.bias  # a plain None attribute; the tuned bias is a persistent buffer
                self.quant.register_buffer("bias", new.to(dtype))
            else:
                old.copy_(new.to(dtype))
        if not self.tune_codes:
            return 0
        n, k = self.codes.shape
        c = self._codes().round()
        changed = int((c.view(n, k) != self.codes.float()).sum())
        q = (c + self.zero[..., None]).view(n, k)
        cfg = self.quant.config
        packed = formats.pack_int8(q.to(torch.int8)) if cfg.bits == 8 else formats.pack_int4(q.to(torch.uint8))
        self.quant.qweight.copy_(packed.to(self.quant.qweight.device))
        return changed


class CodeStep(torch.optim.Optimizer):
    """Gradient steps on ScaleTuned code offsets, normalized per tensor.

    p -= lr * g / rms(g), then p is clamped to [-bound, bound] (bound = 1: a
    code moves at most one step from where it started).  Unlike Adam, whose
    per-element normalization moves every offset by about lr per step and so
    flips unimportant codes as fast as important ones (all at once after
    0.5 / lr steps), this moves each offset in proportion to its gradient, so
    the codes whose gradient is largest cross a rounding boundary first.
    """

    def __init__(self, params, lr: float, bound: float = 1.0):
        if lr <= 0 or bound <= 0:
            raise ValueError(f"CodeStep: lr and bound must be > 0, got {lr}, {bound}")
        super().__init__(params, {"lr": lr, "bound": bound})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                rms = p.grad.float().pow(2).mean().sqrt()
                if rms > 0:
                    p.sub_(p.grad * (group["lr"] / rms))
                p.clamp_(-group["bound"], group["bound"])


def _swap(model: nn.Module, make) -> list:
    """Replace every module m for which make(m) returns a module; returns [(parent, name, old, new)]."""
    swaps = []
    for name, mod in list(model.named_modules()):
        new = make(mod)
        if new is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        swaps.append((parent, child, mod, new))
    return swaps


def _kl(teacher_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student); teacher_logp, logits: [..., T, V] (same shape)."""
    lp_t = teacher_logp.float()
    lp_s = Fn.log_softmax(logits.float(), dim=-1)
    return (lp_t.exp() * (lp_t - lp_s)).sum(-1).mean()


def fast_bf16(device: str) -> bool:
    """Whether bf16 matmuls beat fp32 on ``device`` (always on CUDA; on a CPU, timed once).

    CPUs without native bf16 (no AVX512-BF16 / AMX) emulate it: a 2-core AMD
    EPYC here ran a 4096x576 @ 576x1536 bf16 product at 1.2 GFLOP/s against
    96 GFLOP/s in fp32, and an e2e step of SmolLM2 under bf16 autocast took 64 s
    (a whole fp32 run of 3 steps, model loading included, took 50 s).
    """
    if torch.device(device).type != "cpu":
        return True
    a, b = torch.randn(256, 576), torch.randn(576, 576)
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        x, y = a.to(dt), b.to(dt)
        x @ y  # warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            x @ y
        times[dt] = time.perf_counter() - t0
    return times[torch.bfloat16] < times[torch.float32]


def _autocast(dtype: torch.dtype, device_type: str = "cpu"):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


@torch.no_grad()
def teacher_logprobs(model: nn.Module, windows: torch.Tensor, progress: bool = True) -> torch.Tensor:
    """bfloat16 [n, L, V] log-probabilities of the float model on each window (fp32 forward)."""
    it = range(windows.shape[0])
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="float model", unit="window")
    return torch.cat([_window_logprobs(model, windows[i : i + 1]) for i in it])


@torch.no_grad()
def _window_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """bfloat16 [B, L, V] log-probabilities of ``model`` on windows ids [B, L]."""
    return Fn.log_softmax(model(ids).logits.float(), dim=-1).to(torch.bfloat16)


class StreamedTeacher:
    """The float model's log-probs, computed when asked for instead of stored.

    Stands in for the [n, L, V] tensor of :func:`teacher_logprobs`: the last
    ``probe`` windows' log-probs are computed once and kept (they are read at
    every evaluation); ``teacher[i]`` for a training window runs one fp32
    forward of ``model``.  Memory is O(probe) windows instead of O(n), so many
    more calibration windows fit (SmolLM2: 50 MB per stored window of 512 tokens).
    """

    def __init__(self, model: nn.Module, windows: torch.Tensor, probe: int, progress: bool = True):
        self.model, self.windows, self.first_probe = model, windows, windows.shape[0] - probe
        self.stored = teacher_logprobs(model, windows[self.first_probe :], progress)
        self.shape = torch.Size((*windows.shape, self.stored.shape[-1]))

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= self.first_probe:
            return self.stored[i - self.first_probe]
        return _window_logprobs(self.model, self.windows[i : i + 1])[0]

    def rows(self, idx: list) -> torch.Tensor:
        """[len(idx), L, V] log-probs of training windows idx, in one batched forward."""
        if any(i >= self.first_probe for i in idx):
            raise IndexError("StreamedTeacher.rows: probe windows are read one at a time with teacher[i]")
        return _window_logprobs(self.model, self.windows[idx])


def _teacher_rows(teacher, idx: list) -> torch.Tensor:
    """[len(idx), L, V] teacher log-probs of windows idx (a stored tensor or a StreamedTeacher)."""
    if isinstance(teacher, StreamedTeacher):
        return teacher.rows(idx)
    return teacher[torch.tensor(idx)]


def tune_scales(model: nn.Module, windows: torch.Tensor, teacher: torch.Tensor, probe: int = 4, steps: int = 200,
                lr: float = 1e-3, eval_every: int = 20, seed: int = 0, forward_dtype: torch.dtype = torch.bfloat16,
                progress: bool = True, tune_norms: bool = False, schedule: str = "constant",
                batch: int = 1, ce_weight: float = 0.0, code_lr: float = 0.0,
                time_limit: Optional[float] = None, bias_lr: float = 0.0) -> dict:
    """Tune the scales of every QuantLinear in ``model`` in place (module API unchanged afterwards).

    windows: int64 [n, L]; teacher: [n, L, V] log-probs of the float model on
    them (a tensor, or a :class:`StreamedTeacher`). The last ``probe`` windows
    are held out for selection; the rest are trained on, ``batch`` windows per
    step (one forward over [batch, L]; the loss is the mean KL of their tokens).
    The windows, teacher and model must be on one device; autocast follows it.
    ce_weight: add ce_weight x the next-token cross-entropy of the windows' own
    tokens to the training loss (0 = distillation only); the written scales
    are those with the lowest probe KL + ce_weight x probe CE.
    Returns a report: probe KL and cross-entropy before and after, the step
    that gave them (the lowest probe KL + ce_weight x CE, the training loss),
    the running train loss at each evaluation, and seconds.
    tune_norms: also tune every RMSNorm gain (multiplicatively, log space, same lr);
    the tuned gains stay in the model's float ``weight`` tensors.
    schedule: "constant" learning rates, or "cosine" (every lr decays along a
    half cosine from its value at step 1 to 0 at the last step).
    code_lr: > 0 also trains the integer codes (zero points fixed): each
    weight gets a float offset in code units, rounded with a straight-through
    gradient (:class:`ScaleTuned`) and moved by :class:`CodeStep` (a step of
    code_lr x gradient / its RMS over the layer, offsets within +-1, on the
    same schedule); the best step's rounded codes are written to the
    QuantLinears' qweight.  0 keeps the codes.
    bias_lr: > 0 also trains a float offset of every QuantLinear's output
    (a bias; Adam, step bias_lr), written as the module's ``bias`` buffer
    (created where there was none).  The checkpoint must then declare the
    biases: see :func:`declare_biases`.
    time_limit: seconds; once a step ends past it, the probe is measured one
    last time and training stops (the schedule is not shortened; the report's
    steps_done says where it stopped).  None: run all ``steps``.
    """
    n = windows.shape[0]
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"tune_scales: schedule must be 'constant' or 'cosine', got {schedule!r}")
    if code_lr < 0:
        raise ValueError(f"tune_scales: code_lr must be >= 0, got {code_lr}")
    if bias_lr < 0:
        raise ValueError(f"tune_scales: bias_lr must be >= 0, got {bias_lr}")
    if ce_weight < 0:
        raise ValueError(f"tune_scales: ce_weight must be >= 0, got {ce_weight}")
    if batch < 1 or batch > n - probe:
        raise ValueError(f"tune_scales: batch must be between 1 and the {n - probe} training windows, got {batch}")
    if not 0 < probe < n:
        raise ValueError(f"tune_scales: probe must be between 1 and n - 1 = {n - 1} windows, got {probe}")
    if teacher.shape[:2] != windows.shape:
        raise ValueError(f"tune_scales: teacher log-probs {list(teacher.shape)} do not match windows {list(windows.shape)}")
    swaps = _swap(model, lambda m: ScaleTuned(m, tune_codes=code_lr > 0, tune_bias=bias_lr > 0)
                  if isinstance(m, QuantLinear) else None)
    if not swaps:
        raise ValueError("tune_scales: the model has no QuantLinear modules")
    tuned = [new for *_, new in swaps]
    for p in model.parameters():
        p.requires_grad_(False)
    params = [t.log_s for t in tuned]
    norms = _norm_modules(model) if tune_norms else []
    if tune_norms and not norms:
        raise ValueError("tune_scales: tune_norms=True but the model has no RMSNorm modules")
    for m in norms:
        parametrize.register_parametrization(m, "weight", _GainTuned(m.weight.shape[0]))
        params.append(m.parametrizations.weight[0].u)
    groups = [{"params": params, "lr": lr}]
    if bias_lr > 0:
        groups.append({"params": [t.bias_delta for t in tuned], "lr": bias_lr})
        params = params + [t.bias_delta for t in tuned]
    opt = torch.optim.Adam(groups)
    decay = (lambda i: 0.5 * (1.0 + math.cos(math.pi * i / max(steps, 1)))) if schedule == "cosine" else (lambda i: 1.0)
    opts = [opt]
    if code_lr > 0:
        # each layer's offsets are their own group: CodeStep normalizes per tensor
        opts.append(CodeStep([{"params": [t.v]} for t in tuned], lr=code_lr))
        params = params + [t.v for t in tuned]
    for p in params:
        p.requires_grad_(True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in opts]
    train = list(range(n - probe))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()

    dev_type = windows.device.type

    def probe_kl() -> tuple:
        """(mean KL, mean next-token cross-entropy) over the probe windows."""
        kl = ce = 0.0
        with torch.no_grad(), _autocast(forward_dtype, dev_type):
            for i in range(n - probe, n):
                logits = model(windows[i : i + 1]).logits[0]
                kl += _kl(teacher[i], logits).item()
                ce += Fn.cross_entropy(logits[:-1].float(), windows[i, 1:]).item()
        return kl / probe, ce / probe

    def score(kl_ce: tuple) -> float:  # the training objective, on the probe
        return kl_ce[0] + ce_weight * kl_ce[1]

    t0 = time.time()
    model.eval()
    done = False
    try:
        start = probe_kl()
        best = (start, 0, [p.detach().clone() for p in params])
        history = [{"step": 0, "probe_kl": start[0], "probe_ce": start[1]}]
        it = range(1, steps + 1)
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, desc="e2e scales", unit="step")
        running, step = None, 0
        for step in it:
            idx = [train[order[((step - 1) * batch + j) % len(train)]] for j in range(batch)]
            target, ids = _teacher_rows(teacher, idx), windows[idx]
            with _autocast(forward_dtype, dev_type):
                logits = model(ids).logits
            loss = _kl(target, logits)
            if ce_weight:
                ce = Fn.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
                loss = loss + ce_weight * ce
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss.backward()
            for o, sc in zip(opts, scheds):
                o.step()
                sc.step()
            running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
            out_of_time = time_limit is not None and time.time() - t0 > time_limit
            if step % eval_every == 0 or step == steps or out_of_time:
                kl = probe_kl()
                history.append({"step": step, "probe_kl": kl[0], "probe_ce": kl[1], "train_loss_avg": running})
                if score(kl) < score(best[0]):
                    best = (kl, step, [p.detach().clone() for p in params])
                if progress:
                    it.set_postfix(train=f"{running:.4f}", probe=f"{kl[0]:.4f}", ce=f"{kl[1]:.3f}",
                                   best=f"{best[0][0]:.4f}@{best[1]}")
            if out_of_time:
                break
        with torch.no_grad():
            for p, b in zip(params, best[2]):
                p.copy_(b)
            codes_changed = sum(t.write_back() for t in tuned)
        done = True
    finally:
        for parent, child, old, _ in swaps:  # the QuantLinears go back, tuned or not
            setattr(parent, child, old)
        for m in norms:  # tuned gains are kept only when tuning finished; otherwise the originals come back
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=done)
    return {"probe_kl_start": start[0], "probe_kl_best": best[0][0], "probe_ce_start": start[1],
            "probe_ce_best": best[0][1], "best_step": best[1], "steps_done": step, "history": history,
            "seconds": time.time() - t0, "layers": len(tuned), "norms": len(norms), "batch": batch,
            "ce_weight": ce_weight, "code_lr": code_lr, "bias_lr": bias_lr, "codes_changed": codes_changed,
            "codes_total": sum(t.codes.numel() for t in tuned)}


_BIAS_FLAGS = ("attention_bias", "mlp_bias")  # Llama-style configs: one switch per block


def declare_biases(model: nn.Module) -> None:
    """Make ``model.config`` say that every attention and MLP projection has a bias.

    After ``tune_scales(..., bias_lr > 0)`` every QuantLinear has one; a
    checkpoint is rebuilt from its config, so the config must declare them or
    the loader would build the linears without.  Needs a config with
    ``attention_bias`` and ``mlp_bias`` (Llama and its relatives) and every
    linear of the decoder layers quantized (a float one would have no bias
    tensor); ValueError naming the rule otherwise.
    """
    check_bias_target(model)
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear) and mod.bias is None:
            raise ValueError(f"tuned biases: {name} has no bias (was it tuned with bias_lr > 0?)")
    for f in _BIAS_FLAGS:
        setattr(model.config, f, True)


def check_bias_target(model: nn.Module) -> None:
    """ValueError unless :func:`declare_biases` can work on ``model`` (checked before tuning,
    so a run is not lost at the end): a config with the bias switches, and no
    float linear inside the decoder layers."""
    cfg = model.config
    if not all(hasattr(cfg, f) for f in _BIAS_FLAGS):
        raise ValueError(f"tuned biases need a config with {' and '.join(_BIAS_FLAGS)} "
                         f"({type(cfg).__name__} has no such switches)")
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and ".layers." in f".{name}":
            raise ValueError(f"tuned biases need every decoder-layer linear quantized; {name} is not")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m calibration.e2e", description=__doc__.split("\n")[0])
    ap.add_argument("quantized", help="a qgemv checkpoint directory (qgemv-quantize --out)")
    ap.add_argument("--out", required=True, help="output directory (written atomically)")
    ap.add_argument("--reference", default="default",
                    help="the float model it was quantized from (HF directory, .gguf, or 'default': SmolLM2)")
    ap.add_argument("--calib", default="default", help="calibration text: 'default', a .txt/.json file, or hub:NAME")
    ap.add_argument("--samples", type=int, default=32, help="training windows (default 32)")
    ap.add_argument("--probe", type=int, default=4, help="held-out windows for choosing the best step (default 4)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam step on log(scale) (default 1e-3)")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="autocast dtype of the tuning forwards (the teacher runs in float32); auto: bfloat16 "
                         "on a GPU, and on a CPU where a timed bf16 matmul beats fp32, else float32")
    ap.add_argument("--tune-norms", action="store_true",
                    help="also tune the RMSNorm gains (per input column of the linears that read them)")
    ap.add_argument("--schedule", default="constant", choices=["constant", "cosine"],
                    help="learning-rate schedule: constant, or a half-cosine decay to 0 at the last step")
    ap.add_argument("--stream-teacher", action="store_true",
                    help="compute the float model's log-probs at each step instead of storing them for every "
                         "window (one more fp32 forward per step; memory no longer grows with --samples)")
    ap.add_argument("--batch", type=int, default=1,
                    help="training windows per step, in one forward (default 1; on a GPU 4-8 use it better)")
    ap.add_argument("--device", default="cpu", help="where the float model, the tuned model and the windows live")
    ap.add_argument("--generated", type=int, default=0,
                    help="add this many training windows sampled from the float model itself (temperature 1, "
                         "seeded; each starts at a token drawn from the calibration windows)")
    ap.add_argument("--ce-weight", type=float, default=0.0,
                    help="add this weight x the next-token cross-entropy of the training windows to the KL loss")
    ap.add_argument("--code-lr", type=float, default=0.0,
                    help="also train the integer codes (zero points fixed; each moves at most one step): offsets in "
                         "code units move by this x gradient / its RMS per layer, through a straight-through "
                         "rounding (default 0: codes fixed, scales only)")
    ap.add_argument("--bias-lr", type=float, default=0.0,
                    help="also train a float bias on every quantized linear's output (Adam step; default 0: off). "
                         "The checkpoint's config then declares attention and MLP biases (Llama-style models)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop after the first step that ends past this many seconds of tuning (the probe is "
                         "measured then and the best step so far is written); default: no limit")
    ap.add_argument("--overwrite", action="store_true")
    return ap


def main(argv: Optional[list] = None) -> int:
    import json
    from pathlib import Path

    args = build_parser().parse_args(argv)
    src = Path(args.quantized)
    if args.generated < 0:
        raise SystemExit(f"--generated must be >= 0, got {args.generated}")
    try:
        C.check_output_dir(args.out, args.overwrite, sources=[args.quantized])
    except (FileExistsError, ValueError) as e:
        print(f"calibration.e2e: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else None
    if cfg is None:
        raise SystemExit(f"{src}: no config.json (not a qgemv checkpoint)")
    t0 = time.time()
    if args.forward_dtype == "auto":
        args.forward_dtype = "bfloat16" if fast_bf16(args.device) else "float32"
    student, tok = C.load_quantized(str(src), dtype=torch.float32, device=args.device)
    if args.bias_lr > 0:
        try:
            check_bias_target(student)
        except ValueError as e:
            raise SystemExit(f"--bias-lr: {e}")
    if tok is None:
        raise SystemExit(f"{src}: the checkpoint has no tokenizer files")
    train, probe = train_and_probe_windows(tok, args.calib, args.samples, args.probe, args.seq_len, args.seed)
    ref, _ = C.load_float_model(C.resolve_model(args.reference), torch.float32, device=args.device)
    if args.generated:
        windows_on_gpu = torch.device(args.device).type == "cuda"
        g = torch.Generator().manual_seed(args.seed + 1)
        pool = train.flatten()
        first = pool[torch.randint(0, pool.numel(), (args.generated,), generator=g)]
        train = torch.cat([train, generated_windows(ref, first, args.seq_len, seed=args.seed + 1,
                                                        batch=256 if windows_on_gpu else 16)])
    windows = torch.cat([train, probe]).to(args.device)
    if args.stream_teacher:
        teacher = StreamedTeacher(ref, windows, args.probe)
    else:
        teacher = teacher_logprobs(ref, windows)
        del ref
    rep = tune_scales(student, windows, teacher, probe=args.probe, steps=args.steps, lr=args.lr,
                      eval_every=args.eval_every, seed=args.seed,
                      forward_dtype=getattr(torch, args.forward_dtype), tune_norms=args.tune_norms,
                      schedule=args.schedule, batch=args.batch, ce_weight=args.ce_weight, code_lr=args.code_lr,
                      time_limit=args.time_limit, bias_lr=args.bias_lr)
    qc = dict(cfg["quantization_config"])
    qc["algorithm"] = qc.get("algorithm", "?") + "+e2e"
    qc["calibration"] = dict(qc.get("calibration") or {})
    qc["calibration"]["e2e"] = {"reference": args.reference, "dataset": args.calib, "samples": args.samples,
                                "probe": args.probe, "seq_len": args.seq_len, "steps": args.steps,
                                "steps_done": rep["steps_done"], "lr": args.lr,
                                "seed": args.seed, "forward_dtype": args.forward_dtype, "schedule": args.schedule,
                                "stream_teacher": args.stream_teacher, "batch": args.batch,
                                "device": args.device, "generated": args.generated, "ce_weight": args.ce_weight,
                                "code_lr": args.code_lr, "codes_changed": rep["codes_changed"],
                                "bias_lr": args.bias_lr,
                                "probe_fraction": PROBE_FRACTION,
                                "tune_norms": args.tune_norms, "norms_tuned": rep["norms"],
                                "probe_kl_start": rep["probe_kl_start"], "probe_kl_best": rep["probe_kl_best"],
                                "probe_ce_start": rep["probe_ce_start"], "probe_ce_best": rep["probe_ce_best"],
                                "best_step": rep["best_step"]}
    float_dtype = C.source_dtype(str(src))
    if args.bias_lr > 0:
        declare_biases(student)
    student.to("cpu")
    C.save_quantized(student, tok, args.out, qc, overwrite=args.overwrite, extra_json={"e2e_report.json": rep},
                     float_dtype=float_dtype)
    codes = (f", {rep['codes_changed']} of {rep['codes_total']} codes changed" if args.code_lr > 0 else "")
    print(f"e2e tuning: {rep['layers']} layers, {rep['steps_done']} of {args.steps} steps, probe KL {rep['probe_kl_start']:.4f} -> "
          f"{rep['probe_kl_best']:.4f} (step {rep['best_step']}){codes}, {time.time() - t0:.0f} s, "
          f"peak RSS {C.peak_rss_mb():.0f} MB -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
