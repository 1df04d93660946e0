"""End-to-end scale tuning of a quantized checkpoint against its float model.

    python -m qgemv.calibration.e2e runs/q4 --out runs/q4-e2e [--reference default] [--steps 200]

GPTQ and AWQ each fit one linear to its own float output.  This pass instead
tunes every per-channel / per-group scale of the whole quantized model at
once, with the integer codes and zero points fixed, so that its next-token
distribution matches the float model's:

    loss = KL(p_float || p_quantized), mean over the tokens of a step's windows.

The float model's log-probabilities on the calibration windows are computed
once, before tuning (with ``--stream-teacher``, only the probe windows' are
stored; a training window's are computed at its step).  The scales are
trained in log space with Adam, ``--batch`` windows per step (default 1), in
a seeded order.  ``--device cuda`` runs the float model, the tuning and the
probes on the GPU.  A few further windows (``--probe``) are held out, drawn
from the last 10% of the calibration tokens, which no training window
touches: their KL is measured before the first step and every
``--eval-every`` steps, and the scales that gave the lowest probe KL are the
ones written (so the output is never worse than the input on the probe).
The checkpoint format does not change: only the fp16 ``scales`` tensors do,
and ``quantization_config.calibration.e2e`` records the settings and the
probe KL before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as Fn

from qgemv import checkpoint, formats
from qgemv.nn import QuantLinear
from qgemv.text import load_text

from .._args import device_arg, int_at_least, positive_float
from .data import PROBE_FRACTION, train_and_probe_windows


class ScaleTuned(nn.Module):
    """A QuantLinear as fixed integer codes (q - z) times trainable scales.

    codes: bfloat16 [N, K] (small integers, exact); log_s: float32 [N, G]
    (G = K / group, or 1 per channel), trainable.  forward(x [..., K]) ->
    [..., N] in x's dtype (or the autocast dtype).
    """

    def __init__(self, q: QuantLinear):
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

    def weight(self) -> torch.Tensor:
        n, k = self.codes.shape
        c = self.codes.float().view(n, k // self.group, self.group)
        return (c * self.log_s.exp()[..., None]).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias
        return Fn.linear(x, self.weight().to(x.dtype), None if b is None else b.to(x.dtype))

    @torch.no_grad()
    def write_back(self) -> None:
        """Store exp(log_s) in the QuantLinear's fp16 scales (same shape)."""
        s = self.log_s.detach().exp().reshape(self.quant.scales.shape)
        s = s.clamp(max=float(torch.finfo(torch.float16).max)).to(torch.float16)
        if not torch.all(torch.isfinite(s) & (s > 0)):
            raise ValueError("ScaleTuned.write_back: a tuned scale is not a positive finite fp16 number")
        self.quant.scales.copy_(s)


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


@dataclass(frozen=True)
class TuneSettings:
    """How :func:`tune_scales` trains.

    Attributes:
        probe: the last ``probe`` windows are held out to choose the best step.
        steps, lr: Adam steps on log(scale), and their learning rate.
        eval_every: steps between probe evaluations (and the last step).
        seed: the training windows' order.
        forward_dtype: autocast dtype of the forward passes.
        schedule: "constant" learning rate, or "cosine" (decays along a half
            cosine from lr at step 1 to 0 at the last step).
        batch: training windows per step (one forward over [batch, L]; the
            loss is the mean KL of their tokens).
        time_limit: seconds; once a step ends past it, the probe is measured
            one last time and training stops (the report's steps_done says where).
    """

    probe: int = 4
    steps: int = 200
    lr: float = 1e-3
    eval_every: int = 20
    seed: int = 0
    forward_dtype: torch.dtype = torch.bfloat16
    schedule: str = "constant"
    batch: int = 1
    time_limit: Optional[float] = None

    def __post_init__(self):
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"tune_scales: schedule must be 'constant' or 'cosine', got {self.schedule!r}")

    def decay(self):
        """The learning-rate factor of step i (LambdaLR's function)."""
        if self.schedule == "cosine":
            return lambda i: 0.5 * (1.0 + math.cos(math.pi * i / max(self.steps, 1)))
        return lambda i: 1.0


def tune_scales(model: nn.Module, windows: torch.Tensor, teacher, settings: Optional[TuneSettings] = None, *,
                progress: bool = True, **fields) -> dict:
    """Tune the scales of every QuantLinear in ``model`` in place (module API unchanged afterwards).

    windows: int64 [n, L]; teacher: [n, L, V] log-probs of the float model on
    them (a tensor, or a :class:`StreamedTeacher`).  settings: a
    :class:`TuneSettings`, or its fields as keywords.  The windows, teacher
    and model must be on one device; autocast follows it.
    Returns a report: probe KL before and after, the step that gave the
    lowest probe KL (whose scales are written), the running train loss at
    each evaluation, and seconds.  On any error the QuantLinears are put back
    unchanged.
    """
    if settings is not None and fields:
        raise TypeError(f"tune_scales: settings were given; set {', '.join(sorted(fields))} on them instead")
    st = settings or TuneSettings(**fields)
    n = windows.shape[0]
    if st.batch < 1 or st.batch > n - st.probe:
        raise ValueError(f"tune_scales: batch must be between 1 and the {n - st.probe} training windows, "
                         f"got {st.batch}")
    if not 0 < st.probe < n:
        raise ValueError(f"tune_scales: probe must be between 1 and n - 1 = {n - 1} windows, got {st.probe}")
    if teacher.shape[:2] != windows.shape:
        raise ValueError(f"tune_scales: teacher log-probs {list(teacher.shape)} do not match windows {list(windows.shape)}")
    swaps = _swap(model, lambda m: ScaleTuned(m) if isinstance(m, QuantLinear) else None)
    if not swaps:
        raise ValueError("tune_scales: the model has no QuantLinear modules")
    tuned = [new for *_, new in swaps]
    for p in model.parameters():
        p.requires_grad_(False)
    params = [t.log_s for t in tuned]
    for p in params:
        p.requires_grad_(True)
    t0 = time.time()
    model.eval()
    try:
        rep = _train(model, windows, teacher, st, params, progress)
        with torch.no_grad():
            for t in tuned:
                t.write_back()
    finally:
        for parent, child, old, _ in swaps:  # the QuantLinears go back, tuned or not
            setattr(parent, child, old)
    return dict(rep, seconds=time.time() - t0, layers=len(tuned), batch=st.batch)


def _train(model: nn.Module, windows: torch.Tensor, teacher, st: TuneSettings, params: list, progress: bool) -> dict:
    """Adam on ``params`` (the log-scales), keeping the step of lowest probe KL; leaves that step's values in
    ``params``.  Returns the report's training part."""
    n, t0 = windows.shape[0], time.time()
    opt = torch.optim.Adam(params, lr=st.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, st.decay())
    train = list(range(n - st.probe))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(st.seed)).tolist()
    dev_type = windows.device.type

    def probe_kl() -> float:
        kl = 0.0
        with torch.no_grad(), _autocast(st.forward_dtype, dev_type):
            for i in range(n - st.probe, n):
                kl += _kl(teacher[i], model(windows[i : i + 1]).logits[0]).item()
        return kl / st.probe

    start = probe_kl()
    best = (start, 0, [p.detach().clone() for p in params])
    history = [{"step": 0, "probe_kl": start}]
    it = range(1, st.steps + 1)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="e2e scales", unit="step")
    running, step = None, 0
    for step in it:
        idx = [train[order[((step - 1) * st.batch + j) % len(train)]] for j in range(st.batch)]
        target, ids = _teacher_rows(teacher, idx), windows[idx]
        with _autocast(st.forward_dtype, dev_type):
            logits = model(ids).logits
        loss = _kl(target, logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        out_of_time = st.time_limit is not None and time.time() - t0 > st.time_limit
        if step % st.eval_every == 0 or step == st.steps or out_of_time:
            kl = probe_kl()
            history.append({"step": step, "probe_kl": kl, "train_loss_avg": running})
            if kl < best[0]:
                best = (kl, step, [p.detach().clone() for p in params])
            if progress:
                it.set_postfix(train=f"{running:.4f}", probe=f"{kl:.4f}", best=f"{best[0]:.4f}@{best[1]}")
        if out_of_time:
            break
    with torch.no_grad():
        for p, b in zip(params, best[2]):
            p.copy_(b)
    return {"probe_kl_start": start, "probe_kl_best": best[0], "best_step": best[1], "steps_done": step,
            "history": history}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m qgemv.calibration.e2e", description=__doc__.split("\n")[0])
    ap.add_argument("quantized", help="a qgemv checkpoint directory (qgemv-quantize --out)")
    ap.add_argument("--out", required=True, help="output directory (written atomically)")
    ap.add_argument("--reference", default="default",
                    help="the float model it was quantized from (HF directory, .gguf, or 'default': SmolLM2)")
    ap.add_argument("--calib", default="default", help="calibration text: 'default', a .txt/.json file, or hub:NAME")
    ap.add_argument("--samples", type=int_at_least(1), default=32, help="training windows (default 32)")
    ap.add_argument("--probe", type=int_at_least(1), default=4,
                    help="held-out windows for choosing the best step (default 4)")
    ap.add_argument("--seq-len", type=int_at_least(2), default=512)
    ap.add_argument("--steps", type=int_at_least(1), default=200)
    ap.add_argument("--lr", type=positive_float, default=1e-3, help="Adam step on log(scale) (default 1e-3)")
    ap.add_argument("--eval-every", type=int_at_least(1), default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="autocast dtype of the tuning forwards (the teacher runs in float32); auto: bfloat16 "
                         "on a GPU, and on a CPU where a timed bf16 matmul beats fp32, else float32")
    ap.add_argument("--schedule", default="constant", choices=["constant", "cosine"],
                    help="learning-rate schedule: constant, or a half-cosine decay to 0 at the last step")
    ap.add_argument("--stream-teacher", action="store_true",
                    help="compute the float model's log-probs at each step instead of storing them for every "
                         "window (one more fp32 forward per step; memory no longer grows with --samples)")
    ap.add_argument("--batch", type=int_at_least(1), default=1,
                    help="training windows per step, in one forward (default 1; on a GPU 4-8 use it better)")
    ap.add_argument("--device", type=device_arg, default="cpu",
                    help="where the float model, the tuned model and the windows live")
    ap.add_argument("--time-limit", type=positive_float, default=None,
                    help="stop after the first step that ends past this many seconds of tuning (the probe is "
                         "measured then and the best step so far is written); default: no limit")
    ap.add_argument("--overwrite", action="store_true")
    return ap


def main(argv: Optional[list] = None) -> int:
    """Exit 0 on success, 2 for bad input (checked before any model is loaded)."""
    args = build_parser().parse_args(argv)
    src = Path(args.quantized)
    try:
        checkpoint.check_output_dir(args.out, args.overwrite, sources=[args.quantized])
        if not checkpoint.is_qgemv_checkpoint(src):
            raise ValueError(f"{src}: not a qgemv checkpoint (no config.json with a qgemv quantization_config)")
        load_text(args.calib, "calib")
    except (FileExistsError, ValueError) as e:
        print(f"qgemv.calibration.e2e: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((src / "config.json").read_text())
    t0 = time.time()
    if args.forward_dtype == "auto":
        args.forward_dtype = "bfloat16" if fast_bf16(args.device) else "float32"
    student, tok = checkpoint.load_quantized(str(src), dtype=torch.float32, device=args.device)
    if tok is None:
        print(f"qgemv.calibration.e2e: {src}: the checkpoint has no tokenizer files", file=sys.stderr)
        return 2
    train, probe = train_and_probe_windows(tok, args.calib, args.samples, args.probe, args.seq_len, args.seed)
    ref, _ = checkpoint.load_float_model(checkpoint.resolve_model(args.reference), torch.float32, device=args.device)
    windows = torch.cat([train, probe]).to(args.device)
    if args.stream_teacher:
        teacher = StreamedTeacher(ref, windows, args.probe)
    else:
        teacher = teacher_logprobs(ref, windows)
        del ref
    settings = TuneSettings(probe=args.probe, steps=args.steps, lr=args.lr, eval_every=args.eval_every,
                            seed=args.seed, forward_dtype=getattr(torch, args.forward_dtype),
                            schedule=args.schedule, batch=args.batch, time_limit=args.time_limit)
    rep = tune_scales(student, windows, teacher, settings)
    qc = dict(cfg["quantization_config"])
    qc["algorithm"] = qc.get("algorithm", "?") + "+e2e"
    qc["calibration"] = dict(qc.get("calibration") or {})
    qc["calibration"]["e2e"] = {"reference": args.reference, "dataset": args.calib, "samples": args.samples,
                                "probe": args.probe, "seq_len": args.seq_len, "steps": args.steps,
                                "steps_done": rep["steps_done"], "lr": args.lr, "seed": args.seed,
                                "forward_dtype": args.forward_dtype, "schedule": args.schedule,
                                "stream_teacher": args.stream_teacher, "batch": args.batch, "device": args.device,
                                "probe_fraction": PROBE_FRACTION, "probe_kl_start": rep["probe_kl_start"],
                                "probe_kl_best": rep["probe_kl_best"], "best_step": rep["best_step"]}
    student.to("cpu")
    checkpoint.save_quantized(student, tok, args.out, qc, overwrite=args.overwrite,
                              extra_json={"e2e_report.json": rep}, float_dtype=checkpoint.source_dtype(str(src)))
    print(f"e2e tuning: {rep['layers']} layers, {rep['steps_done']} of {args.steps} steps, probe KL "
          f"{rep['probe_kl_start']:.4f} -> {rep['probe_kl_best']:.4f} (step {rep['best_step']}), "
          f"{time.time() - t0:.0f} s, peak RSS {checkpoint.peak_rss_mb():.0f} MB -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
