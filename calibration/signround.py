"""Rounding learned per decoder layer with signed gradient descent (SignRound).

After the idea of Cheng et al., "Optimize Weight Rounding via Signed Gradient
Descent for the Quantization of LLMs" (2023): every weight gets a rounding
offset v in [-0.5, 0.5] added before rounding, and every row / group a
factor on each end of its range (a clipping range); all of them are tuned to
make the *decoder layer's* output with quantized weights match its output
with float weights, on the calibration activations, by signed gradient steps
(rounding passes gradients straight through).  Unlike GPTQ, which minimises
each linear layer's own output error, this sees the attention softmax and the
SwiGLU between the linears.

The codes that come out are ordinary qgemv codes: the exported scales and zero
points are the tuned range's, rounded to fp16 / uint8 exactly as
formats.quantize_with_params will read them.
"""

from __future__ import annotations

import torch

from qgemv import formats
from qgemv.formats import QuantConfig


def _ste_round(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward."""
    return x + (torch.round(x) - x).detach()


class LearnedRounding:
    """Tunable quantization of one weight W [N, K] in format ``cfg``.

    Parameters: ``v`` [N, K] rounding offsets (clamped to [-0.5, 0.5]) and the
    range factors ``hi`` / ``lo`` [N, groups] (clamped to [0.5, 1]; symmetric
    formats use ``hi`` only, on max |w|).  At v = 0 and factors 1 this is
    round-to-nearest over the full range, formats.quantize's choice.
    """

    def __init__(self, weight: torch.Tensor, cfg: QuantConfig, name: str = "weight",
                 scales: torch.Tensor | None = None, zeros: torch.Tensor | None = None):
        formats.check_weight(weight, name, cfg.group_size)
        self.cfg, self.name = cfg, name
        self.w = weight.detach().float()
        n, k = self.w.shape
        self.g = cfg.group_size or k
        ng = k // self.g
        self.v = torch.zeros(n, k, device=self.w.device, requires_grad=True)
        self.hi = torch.ones(n, ng, device=self.w.device, requires_grad=True)
        self.lo = torch.ones(n, ng, device=self.w.device, requires_grad=True)
        # The range the factors scale: the weights' own (round-to-nearest), or
        # the grid of given scales / zeros (then v = 0 reproduces the codes of
        # a weight that lies on that grid, such as GPTQ's dequantized one).
        wg = self.w.reshape(n, ng, self.g)
        if scales is None:
            self.top = wg.abs().amax(-1)
            self.bot = wg.amin(-1).clamp(max=0)
            self.top_asym = wg.amax(-1).clamp(min=0)
        else:
            s0 = scales.detach().float().reshape(n, ng)
            q_top = 127.0 if cfg.bits == 8 else 7.0
            self.top = s0 * q_top
            z0 = zeros.detach().float().reshape(n, ng) if zeros is not None else torch.full_like(s0, 8.0)
            self.bot = -z0 * s0
            self.top_asym = (15.0 - z0) * s0

    def parameters(self):
        ps = [self.v, self.hi]
        if self.cfg.bits == 4 and not self.cfg.symmetric:
            ps.append(self.lo)
        return ps

    def _scales_zeros(self):
        """(scale, zero) per group [N, ng, 1] as fp32, differentiable in hi / lo;
        the scale is rounded to fp16 and the zero to an integer (straight-through)."""
        cfg = self.cfg
        asym = cfg.bits == 4 and not cfg.symmetric
        if asym:
            lo = self.bot * self.lo
            s = (self.top_asym * self.hi - lo) / 15.0
        else:
            s = self.top * self.hi / (127.0 if cfg.bits == 8 else 7.0)
        s = s.clamp(min=torch.finfo(torch.float16).tiny)
        s = s + (s.to(torch.float16).float() - s).detach()
        if asym:
            z = _ste_round(-lo / s).clamp(0, 15)
        else:
            z = torch.zeros_like(s) if cfg.bits == 8 else torch.full_like(s, 8.0)
        return s[..., None], z[..., None]

    def _dequant(self, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        n, k = self.w.shape
        wg = self.w.reshape(n, k // self.g, self.g)
        qmin, qmax = formats.code_range(self.cfg)
        q = (_ste_round(wg / s + self.v.reshape_as(wg)) + z).clamp(qmin, qmax)
        return ((q - z) * s).reshape(n, k)

    def fake(self) -> torch.Tensor:
        """The dequantized weight [N, K] for the current parameters (differentiable)."""
        return self._dequant(*self._scales_zeros())

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One signed gradient step, then the clamps; clears the gradients."""
        for p in self.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad.sign())
                p.grad = None
        self.v.clamp_(-0.5, 0.5)
        self.hi.clamp_(0.5, 1.0)
        self.lo.clamp_(0.5, 1.0)

    @torch.no_grad()
    def export(self):
        """(qweight, scales fp16, zeros uint8 or None) in qgemv's format."""
        n = self.w.shape[0]
        s, z = self._scales_zeros()
        deq = self._dequant(s, z)
        scales = s[..., 0].to(torch.float16)
        zeros = None
        if self.cfg.bits == 4 and not self.cfg.symmetric:
            zeros = z[..., 0].to(torch.uint8)
        if self.cfg.group_size is None:
            scales = scales.reshape(n)
        # deq = (q - z) * s exactly, so re-quantizing it with (s, z) returns q.
        return formats.quantize_with_params(deq, scales, zeros, self.cfg), scales.contiguous(), zeros


def tune_layer(layer, targets: dict, inputs: list, kwargs: dict, steps: int, lr: float | None = None,
               tokens_per_step: int = 2048, seed: int = 0, fwd=None, start: dict | None = None):
    """Tune every linear in ``targets`` ({name: (module, cfg)}) of one decoder layer.

    inputs: the layer's calibration inputs (a list of [B, L, H] batches);
    the target is the same layer's output with its float weights.  start:
    optional {name: (weight, scales, zeros)} to tune from instead of the
    float weight on its own range, e.g. GPTQ's dequantized weight and its
    grid, whose codes v = 0 then reproduces.  Each step
    takes a random slice of about ``tokens_per_step`` tokens (whole
    sequences).  lr defaults to 1 / steps (0.1 / steps with ``start``),
    decayed linearly to 0.
    Returns ({name: (qweight, scales, zeros)}, info with the probe slice's
    output MSE at the start (round-to-nearest of the start weights) and
    after tuning).
    """
    import contextlib

    from torch.func import functional_call

    fwd = fwd or contextlib.nullcontext
    start = start or {}
    rounding = {}
    for n, (m, c) in targets.items():
        w, s0, z0 = start.get(n, (m.weight, None, None))
        rounding[n] = LearnedRounding(w, c, n, s0, z0)
    with torch.no_grad(), fwd():
        refs = []
        for x in inputs:
            o = layer(x, **kwargs)
            refs.append((o[0] if isinstance(o, tuple) else o).detach())
    seqs = [(bi, si) for bi, x in enumerate(inputs) for si in range(x.shape[0])]
    per_step = max(1, tokens_per_step // inputs[0].shape[1])
    gen = torch.Generator().manual_seed(seed)
    # From round-to-nearest, steps of 1/steps (SignRound's choice: the offsets
    # can cross the whole [-0.5, 0.5] once).  From GPTQ's codes, a tenth of
    # that: on a tiny Llama larger steps never beat the start (BENCHMARKS.md).
    if lr is None:
        lr = (0.1 if start else 1.0) / max(steps, 1)
    for p in layer.parameters():  # gradients flow to the rounding parameters only
        p.requires_grad_(False)

    def loss_on(pick):
        xs = torch.cat([inputs[b][s : s + 1] for b, s in pick])
        ys = torch.cat([refs[b][s : s + 1] for b, s in pick])
        weights = {f"{n}.weight": r.fake() for n, r in rounding.items()}
        with fwd():
            out = functional_call(layer, weights, (xs,), kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return torch.nn.functional.mse_loss(out.float(), ys.float())

    # Parameters are judged on a fixed probe slice every `every` steps; the
    # best seen (the start included) are kept, so tuning never ends worse
    # than its start on the probe.
    probe = [seqs[i] for i in torch.randperm(len(seqs), generator=gen)[:per_step].tolist()]

    def snapshot():
        return {n: [p.detach().clone() for p in (r.v, r.hi, r.lo)] for n, r in rounding.items()}

    with torch.no_grad():
        before = best = float(loss_on(probe))
    kept = snapshot()
    every = max(1, steps // 10)
    for it in range(steps):
        pick = [seqs[i] for i in torch.randperm(len(seqs), generator=gen)[:per_step].tolist()]
        with torch.enable_grad():  # the calibration driver runs under no_grad
            loss_on(pick).backward()
        for r in rounding.values():
            r.step(lr * (1.0 - it / steps))
        if (it + 1) % every == 0 or it + 1 == steps:
            with torch.no_grad():
                cur = float(loss_on(probe))
            if cur < best:
                best, kept = cur, snapshot()
    with torch.no_grad():
        for n, r in rounding.items():
            for p, v in zip((r.v, r.hi, r.lo), kept[n]):
                p.copy_(v)
    return {n: r.export() for n, r in rounding.items()}, {"mse_start": before, "mse_tuned": best}
