"""Perplexity, KL-divergence and top-1 agreement of quantized models vs a reference.

    qgemv-ppl --model default --quantized runs/int8 runs/int4 --windows 8 --out runs/ppl

Protocol (printed and stored in every report):
  * the text is tokenized once without special tokens;
  * it is cut into windows of ctx - 1 tokens (non-overlapping, or starting
    every --stride tokens); each window is fed as [BOS] + window when the
    tokenizer has a BOS token, and every window token is scored (predicted
    from BOS and the window tokens before it);
  * with --stride, only the last `stride` tokens of each window after the
    first are scored, so no token is scored twice;
  * --windows N scores a seeded random subset of N windows (all by default);
  * ppl = exp(mean token NLL); its standard error is ppl * std(NLL) / sqrt(n)
    (delta method over tokens, which are treated as independent);
  * KL is mean over scored tokens of KL(p_ref || p_quant) in nats; top-1
    agreement is the share of scored tokens whose argmax matches the reference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

import torch

from .._args import default_device, device_arg, int_at_least, parser


@dataclass
class Protocol:
    text: str = "default"
    ctx: int = 512
    stride: int = 0  # 0 = non-overlapping windows
    windows: int = 0  # 0 = all
    seed: int = 0
    bos: bool = True

    def describe(self) -> str:
        w = "all" if not self.windows else f"{self.windows} seeded (seed {self.seed})"
        s = "non-overlapping" if not self.stride else f"stride {self.stride}"
        return (f"text={self.text} (evaluation split), ctx={self.ctx}, {s} windows, {w}, "
                f"{'[BOS] + ' if self.bos else ''}{self.ctx - (1 if self.bos else 0)} text tokens per window, "
                "every new token scored")


@dataclass
class Metrics:
    name: str
    tokens: int = 0
    nll_sum: float = 0.0
    nll_sq: float = 0.0
    kl_sum: float = 0.0
    top1: int = 0
    win_nll: list = field(default_factory=list)  # per window: (NLL sum, tokens), for the paired s.e.
    extra: dict = field(default_factory=dict)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / max(self.tokens, 1))

    @property
    def ppl_se(self) -> float:
        n = max(self.tokens, 1)
        mean = self.nll_sum / n
        var = max(self.nll_sq / n - mean * mean, 0.0)
        return self.ppl * math.sqrt(var / n)

    def paired_se(self, ref: "Metrics"):
        """Standard error of Δppl in percent points, from per-window paired NLL differences.

        Tokens inside a window are correlated, windows much less so: the difference of the two
        models' NLL sums is taken per window and its spread across windows gives the s.e. of the
        mean log-ratio (ratio estimator, token-weighted); the delta method maps it to Δppl %.
        None with fewer than 2 windows or when the windows do not line up.
        """
        w = len(self.win_nll)
        if w < 2 or len(ref.win_nll) != w:
            return None
        n = sum(t for _, t in self.win_nll)
        diffs = [(a - b, t) for (a, t), (b, _) in zip(self.win_nll, ref.win_nll)]
        dbar = sum(d for d, _ in diffs) / n
        var = sum((d - t * dbar) ** 2 for d, t in diffs) * w / (w - 1)
        return 100.0 * math.exp(dbar) * math.sqrt(var) / n

    def summary(self, ref: "Metrics" = None) -> dict:
        d = {"name": self.name, "tokens": self.tokens, "ppl": self.ppl, "ppl_se": self.ppl_se}
        if ref is not None and ref is not self:
            d["delta_ppl_pct"] = 100.0 * (self.ppl / ref.ppl - 1.0)
            se = self.paired_se(ref)
            if se is not None:
                d["delta_ppl_se_pct"] = se
            d["kl"] = self.kl_sum / max(self.tokens, 1)
            d["top1_pct"] = 100.0 * self.top1 / max(self.tokens, 1)
        elif ref is self:
            d.update(delta_ppl_pct=0.0, kl=0.0, top1_pct=100.0)
        d.update(self.extra)
        return d


def make_windows(ids: torch.Tensor, proto: Protocol):
    """[(window token ids, number of trailing tokens to score)] per the protocol.

    Raises ValueError when the text holds no whole window, or fewer windows
    than ``proto.windows`` asks for.
    """
    span = proto.ctx - (1 if proto.bos else 0)
    if span < 1 or proto.stride < 0:
        raise ValueError(f"ctx={proto.ctx} and stride={proto.stride} leave no tokens to score")
    out = []
    if not proto.stride:
        for s in range(0, ids.numel() - span + 1, span):
            out.append((ids[s : s + span], span))
    else:
        first = True
        for s in range(0, ids.numel() - span + 1, proto.stride):
            out.append((ids[s : s + span], span if first else min(proto.stride, span)))
            first = False
    if not out:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of {span}")
    if proto.windows > len(out):
        raise ValueError(f"text gives {len(out)} windows of {span} tokens, fewer than the {proto.windows} asked for")
    if proto.windows and proto.windows < len(out):
        g = torch.Generator().manual_seed(proto.seed)
        pick = sorted(torch.randperm(len(out), generator=g)[: proto.windows].tolist())
        out = [out[i] for i in pick]
    return out


#: Texts are tokenized in pieces of about this many characters, cut after a newline: one call over a
#: 100 MB text took 20 GB of memory (the fast tokenizer's offsets and encodings); in pieces the
#: memory is the token ids (8 bytes a token).  A text of up to one piece is tokenized whole, as before.
TOKENIZE_PIECE_CHARS = 1 << 20
#: Larger texts are refused: the protocol scores a few windows, and tokenizing more is only waiting.
MAX_TEXT_CHARS = 256 << 20


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """int64 [T] token ids of ``text`` without special tokens, in pieces of TOKENIZE_PIECE_CHARS cut at newlines."""
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"the text has {len(text) / 2**20:.0f} M characters, more than the {MAX_TEXT_CHARS >> 20} M "
                         f"this tool reads; pass a smaller file (the protocol scores --windows windows of --ctx tokens)")
    parts, start = [], 0
    while start < len(text):
        end = min(len(text), start + TOKENIZE_PIECE_CHARS)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        ids = tokenizer(text[start:end], return_tensors="pt", add_special_tokens=False).input_ids[0]
        parts.append(ids.to(torch.int64))
        start = end
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def prepare_windows(tokenizer, proto: Protocol, text: str):
    """Tokenize ``text`` and cut it per the protocol; returns (windows, BOS id or None).

    A tokenizer without a BOS token turns ``proto.bos`` off.
    """
    ids = tokenize_text(tokenizer, text)
    bos = tokenizer.bos_token_id if proto.bos else None
    if proto.bos and bos is None:
        proto.bos = False
    return make_windows(ids, proto), bos


@torch.no_grad()
def evaluate(models: dict, tokenizer, proto: Protocol, text: str = None, batch: int = 4, device: str = "cpu",
             progress: bool = True, windows=None) -> dict:
    """Score every model in ``models`` ({name: model}, first = reference) in lockstep.

    windows: what :func:`prepare_windows` returned for this protocol, if the
    caller has it already (the text is then not tokenized again).
    Returns {"protocol": ..., "results": [summary per model]}.
    """
    from qgemv.text import load_text

    if windows is None:
        if text is None:
            text = load_text(proto.text, "eval")
        windows = prepare_windows(tokenizer, proto, text)
    wins, bos = windows
    names = list(models)
    metrics = {n: Metrics(n) for n in names}
    it = range(0, len(wins), batch)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="ppl", unit="batch")
    for b in it:
        chunk = wins[b : b + batch]
        x = torch.stack([w for w, _ in chunk])
        if proto.bos:
            x = torch.cat([torch.full((x.shape[0], 1), bos, dtype=x.dtype), x], 1)
        x = x.to(device)
        # position t predicts token t+1: logits[:, :-1] vs x[:, 1:] (with BOS every window token is a target)
        tgt = x[:, 1:]
        mask = torch.zeros_like(tgt, dtype=torch.bool)
        for i, (_, n_score) in enumerate(chunk):
            mask[i, tgt.shape[1] - n_score :] = True
        ref_lp = None
        for n in names:
            logits = models[n](x).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1)
            tok_nll = (-lp.gather(-1, tgt[..., None])[..., 0]).double() * mask
            win_sum, win_n = tok_nll.sum(1), mask.sum(1)
            m = metrics[n]
            m.win_nll += list(zip(win_sum.tolist(), win_n.tolist()))
            m.tokens += int(win_n.sum())
            m.nll_sum += float(win_sum.sum())
            m.nll_sq += float((tok_nll ** 2).sum())
            if ref_lp is None:
                ref_lp = lp
                ref_top = lp.argmax(-1)
            else:
                kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)[mask]
                m.kl_sum += float(kl.double().sum())
                m.top1 += int((lp.argmax(-1) == ref_top)[mask].sum())
            del logits, lp
    ref = metrics[names[0]]
    return {"protocol": asdict(proto), "protocol_text": proto.describe(),
            "results": [metrics[n].summary(ref) for n in names]}


def _fmt_se(se) -> str:
    return f"{se:6.2f}" if se is not None else f"{'-':>6s}"


def table(report: dict) -> str:
    """Text table; the second +-se is Δppl's paired, window-level standard error (percent points)."""
    lines = [f"protocol: {report['protocol_text']}", "",
             f"{'model':34s} {'tokens':>7s} {'ppl':>9s} {'+-se':>7s} {'dppl%':>8s} {'+-se':>6s} {'KL':>8s} {'top1%':>7s}"]
    for r in report["results"]:
        lines.append(f"{r['name'][:34]:34s} {r['tokens']:7d} {r['ppl']:9.3f} {r['ppl_se']:7.3f} "
                     f"{r.get('delta_ppl_pct', 0):+8.2f} {_fmt_se(r.get('delta_ppl_se_pct'))} "
                     f"{r.get('kl', 0):8.4f} {r.get('top1_pct', 100):7.2f}")
    return "\n".join(lines)


def bar_chart(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = report["results"]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rs)), 4))
    ax.bar(range(len(rs)), [r["ppl"] for r in rs], yerr=[r["ppl_se"] for r in rs], capsize=4,
           color=["#888"] + ["#3a7"] * (len(rs) - 1))
    for i, r in enumerate(rs):
        ax.text(i, r["ppl"] + r["ppl_se"], f"{r.get('delta_ppl_pct', 0):+.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rs)))
    ax.set_xticklabels([r["name"] for r in rs], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("perplexity (+- s.e.)")
    ax.set_title("qgemv: perplexity vs the unquantized model", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _json_safe(obj):
    """``obj`` with every non-finite float replaced by None, so that the JSON stays valid (no bare NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_report(report: dict, out: str) -> None:
    """<out>.json (non-finite numbers written as null), <out>.txt and, with matplotlib, <out>.png."""
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(_json_safe(report), f, indent=1, allow_nan=False)
    with open(out + ".txt", "w") as f:
        f.write(table(report) + "\n")
    try:
        bar_chart(report, out + ".png")
    except ImportError:
        pass


def load_models(reference: str, quantized: list, device: str):
    """{name: model} with the reference first, and its tokenizer."""
    from qgemv import checkpoint

    ref_path = checkpoint.resolve_model(reference)
    dtype = torch.float32 if device == "cpu" else torch.float16
    ref, tok = checkpoint.load_float_model(ref_path, dtype=dtype, device=device)
    models = {f"reference ({os.path.basename(str(ref_path).rstrip('/'))})": ref}
    for q in quantized:
        m, _ = checkpoint.load_quantized(q, device=device, dtype=dtype)
        models[os.path.basename(q.rstrip("/"))] = m
    return models, tok


def add_protocol_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--text", default="default",
                    help="'default' (embedded Wikipedia sample), a .txt/.json file or directory, or hub:NAME[:CONFIG[:SPLIT]]")
    ap.add_argument("--ctx", type=int_at_least(2), default=512, help="tokens per window, BOS included (>= 2)")
    ap.add_argument("--stride", type=int_at_least(0), default=0, help="sliding-window stride (0 = non-overlapping)")
    ap.add_argument("--windows", type=int_at_least(0), default=8, help="seeded random subset of windows (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-bos", action="store_true", help="do not prepend BOS to each window")
    ap.add_argument("--batch", type=int_at_least(1), default=4)
    ap.add_argument("--device", type=device_arg, default=None, help="default: cuda when available, else cpu")


def protocol_from(args) -> Protocol:
    """The Protocol of parsed arguments; ValueError for combinations no single flag rules out."""
    if args.device is None:
        args.device = default_device()
    proto = Protocol(text=args.text, ctx=args.ctx, stride=args.stride, windows=args.windows, seed=args.seed,
                     bos=not args.no_bos)
    span = proto.ctx - (1 if proto.bos else 0)
    if proto.stride > span:
        raise ValueError(f"--stride {proto.stride} is longer than a window's {span} text tokens")
    return proto


def main(argv=None) -> int:
    from qgemv.checkpoint import CheckpointError
    from qgemv.text import TextError, load_text

    ap = parser("qgemv-ppl", "perplexity / KL / top-1 vs a reference model")
    ap.add_argument("--model", default="default", help="reference model: HF directory, .gguf, or 'default'")
    ap.add_argument("--quantized", nargs="*", default=[], help="qgemv checkpoint directories")
    ap.add_argument("--out", default="runs/ppl", help="report path prefix (.json, .txt, .png)")
    add_protocol_args(ap)
    args = ap.parse_args(argv)
    try:
        proto = protocol_from(args)
        text = load_text(args.text, "eval")
        models, tok = load_models(args.model, args.quantized, args.device)
        report = evaluate(models, tok, proto, text=text, batch=args.batch, device=args.device)
    except (TextError, CheckpointError, FileNotFoundError, ValueError, OSError) as e:
        print(f"qgemv-ppl: {e}", file=sys.stderr)
        return 2
    write_report(report, args.out)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
