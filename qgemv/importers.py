"""Checkpoints written by other tools, read into qgemv's formats: GPTQ, AWQ and compressed-tensors.

    model, tok = qgemv.checkpoint.load_quantized("some-gptq-model")     # any of them, repacked on load
    qgemv-convert some-gptq-model --out runs/q4                           # repacked once, a qgemv checkpoint

Each quantized linear is decoded to its integer codes q, zero points z and
scales s (w = (q - z) * s), checked, and stored in the qgemv format that
holds it exactly:

- int4, groups of 32 / 64 / 128: the same groups; symmetric when every
  zero point is 8 (GPTQ sym, compressed-tensors symmetric), else with zero
  points;
- int4 with larger groups (a multiple of 128, e.g. 256) or per channel with
  zero points: groups of 128 (or 64 / 32, whichever divides K) that repeat
  the scale and zero point: the same weights, exactly;
- int4 per channel, symmetric: qgemv's per-channel int4;
- int8 per channel, symmetric (zero point 128): qgemv's int8, codes q - 128,
  codes in [-128, 127] (compressed-tensors' symmetric int8 uses -128; format version 4);
- scales are converted to float16; a scale that is not finite and positive
  after that is refused, and the largest relative change is reported.

Act-order GPTQ (a ``g_idx`` other than ``k // group_size``) is stored with
its input columns sorted by group and a ``perm`` that the QuantLinear applies
to x (one gather of K elements per token).  In the Llama-family MLPs the
down_proj's permutation is folded into gate_proj's and up_proj's output rows
instead (:func:`fold_mlp_perms`: the same function, no gather).

Refused, each with an error that says why: a ``g_idx`` whose groups are not
all ``group_size`` columns, int8 with groups or zero points, bits other than 4 and 8, group
sizes that are not a multiple of 32, GPTQ v1 asymmetric zero points that
the v1 "zero - 1" storage corrupted (a zero point of 0 is stored as -1,
whose sign bits overwrite the neighbouring nibbles), AWQ versions other
than "gemm".  Linears the checkpoint stores unquantized (lm_head, the
``ignore`` / ``modules_to_not_convert`` lists) stay float.
"""

from __future__ import annotations

import json
import re
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from . import formats
from . import checkpoint
from .errors import CheckpointError
from .formats import QuantConfig
from .nn import QuantLinear, fuse_llama_projections, set_submodule

METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's nibble i holds column 8c + AWQ_ORDER[i]


class ForeignCheckpointError(CheckpointError):
    """A third-party checkpoint qgemv cannot represent or that is malformed (names the tensor and the rule)."""


def detect(path) -> Optional[str]:
    """The quant_method of a directory's config.json if it is one this module reads, else None."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        qc = json.loads(cfg.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if method in METHODS else None


# --------------------------------------------------------------------------
# Bit unpacking
# --------------------------------------------------------------------------
def unpack_words(words: torch.Tensor, bits: int, dim: int, count: int, order=None) -> torch.Tensor:
    """int32 words packed along ``dim``, ``32 // bits`` values per word, lowest bits first -> int64 values.

    ``order``: value i of a word is element ``order[i]`` of its 32/bits block
    (AWQ); default the identity.  The result has ``count`` elements along dim.
    """
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w.movedim(dim, -1)
    vals = torch.stack([(w >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], -1)  # [..., words, per]
    if order is not None:
        vals = vals[..., torch.argsort(torch.tensor(order))]
    vals = vals.reshape(*w.shape[:-1], w.shape[-1] * per)[..., :count]
    return vals.movedim(-1, dim)


# --------------------------------------------------------------------------
# One decoded linear -> a QuantLinear
# --------------------------------------------------------------------------
@dataclass
class Decoded:
    """One linear as integers: w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]."""

    name: str
    bits: int
    q: torch.Tensor  # int64 [N, K], 0 .. 2^bits - 1
    z: torch.Tensor  # int64 [N, ng]
    s: torch.Tensor  # float [N, ng]
    group: int  # G (K for per channel)
    bias: Optional[torch.Tensor] = None
    perm: Optional[torch.Tensor] = None  # int64 [K]: q holds W[:, perm]'s codes (act-order)


def _fp16_scales(d: Decoded) -> tuple:
    s16 = d.s.to(torch.float16)
    bad = ~(torch.isfinite(s16) & (s16 > 0))
    if bool(bad.any()):
        raise ForeignCheckpointError(f"{d.name}: {int(bad.sum())} scale(s) are not finite and positive as float16 "
                           f"(e.g. {float(d.s[bad][0]):g}); qgemv stores float16 scales")
    change = ((s16.float() - d.s.float()).abs() / d.s.float().abs()).max().item() if d.s.numel() else 0.0
    return s16, change


def to_quant_linear(d: Decoded, k: int, dtype: torch.dtype) -> tuple:
    """(QuantLinear holding exactly d's weights, largest relative change of a scale by float16 rounding)."""
    n = d.q.shape[0]
    if d.q.shape[1] != k or k % d.group != 0:
        raise ForeignCheckpointError(f"{d.name}: codes of shape {list(d.q.shape)} and group size {d.group} do not fit "
                           f"in_features {k}")
    s16, change = _fp16_scales(d)
    per_channel = d.group == k
    if d.bits == 8:
        if not per_channel or not bool((d.z == 128).all()):
            raise ForeignCheckpointError(f"{d.name}: int8 with groups or zero points other than 128; qgemv's int8 is "
                               f"symmetric per channel")
        codes = d.q - 128  # -128..127: qgemv's int8 holds the full range since format version 4
        cfg = QuantConfig(8)
        qw, sc, zz = formats.pack_int8(codes.to(torch.int8)), s16[:, 0].contiguous(), None
    elif d.bits == 4:
        symmetric = bool((d.z == 8).all())
        if per_channel and symmetric:
            g = None
        else:
            g = next((c for c in (128, 64, 32) if d.group % c == 0 and k % c == 0), None)
            if g is None:
                raise ForeignCheckpointError(f"{d.name}: group size {d.group} with in_features {k}: qgemv's groups are "
                                   f"32, 64 or 128 and must divide both")
        if g is None:
            sc = s16[:, 0].contiguous()
            zz = None
        else:
            rep = d.group // g  # each source group becomes `rep` qgemv groups with the same scale and zero
            sc = s16.repeat_interleave(rep, 1).contiguous()
            zz = None if symmetric else d.z.repeat_interleave(rep, 1).to(torch.uint8).contiguous()
        cfg = QuantConfig(4, g, symmetric)
        qw = formats.pack_int4(d.q.to(torch.uint8))
    else:
        raise ForeignCheckpointError(f"{d.name}: {d.bits}-bit weights; qgemv stores 4 and 8 bits")
    q = QuantLinear.from_quantized(nn.Linear(k, n, bias=d.bias is not None, device="meta", dtype=dtype), cfg, qw,
                                   sc, zz)
    if d.bias is not None:
        q.bias = d.bias.to(dtype)
    if d.perm is not None:
        q.perm = d.perm.contiguous()
    return q, change


# --------------------------------------------------------------------------
# The three formats
# --------------------------------------------------------------------------
def _take(state: dict, key: str, used: set) -> torch.Tensor:
    if key not in state:
        raise ForeignCheckpointError(f"tensor {key} is missing")
    used.add(key)
    return state[key]


def _take_packed(state: dict, key: str, used: set) -> torch.Tensor:
    """A tensor of packed 32-bit words: int32 or uint32, nothing else (a cast copy would decode as garbage)."""
    t = _take(state, key, used)
    if t.dtype not in (torch.int32, torch.uint32):
        raise ForeignCheckpointError(f"tensor {key} is {str(t.dtype).replace('torch.', '')}; packed words must be "
                                     f"int32 or uint32")
    return t


def _take_int(state: dict, key: str, used: set) -> torch.Tensor:
    t = _take(state, key, used)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ForeignCheckpointError(f"tensor {key} is {str(t.dtype).replace('torch.', '')}; expected integers")
    return t


def _group_size(value, k: int, name: str, key: str = "group_size") -> int:
    """A config's group size: -1 or None is per channel (k); otherwise a positive integer dividing k."""
    if value in (-1, None):
        return k
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ForeignCheckpointError(f"{name}: quantization_config {key} {value!r} is not a positive integer "
                                     f"(or -1 for one group per row)")
    if k % value:
        raise ForeignCheckpointError(f"{name}: group_size {value} does not divide in_features {k}")
    return value


def _pattern_matches(pattern: str, name: str) -> bool:
    """compressed-tensors' target / ignore rule: the module name itself, or 're:' and a regular expression."""
    if not isinstance(pattern, str):
        raise ForeignCheckpointError(f"quantization_config: a target or ignore entry {pattern!r} is not a string")
    if not pattern.startswith("re:"):
        return pattern == name
    try:
        return re.search(pattern[3:], name) is not None
    except re.error as e:
        raise ForeignCheckpointError(f"quantization_config: {pattern!r} is not a valid regular expression ({e})") \
            from None


def _group_order(g_idx: torch.Tensor, group: int, k: int, name: str) -> Optional[torch.Tensor]:
    """None when g_idx is k // group; else the permutation that makes the groups contiguous (act-order).

    Act-order GPTQ assigns input column k to group g_idx[k] in the order it
    quantized them; sorted by group (stably), the columns form contiguous
    groups of ``group`` again, so the weight is stored as W[:, perm] and x is
    gathered as x[..., perm] at run time (QuantLinear.perm).
    """
    g_idx = g_idx.to(torch.int64)
    want = torch.arange(k, dtype=torch.int64) // group
    if g_idx.shape != (k,):
        raise ForeignCheckpointError(f"{name}.g_idx has shape {list(g_idx.shape)}, expected [{k}]")
    if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group):
        raise ForeignCheckpointError(f"{name}.g_idx holds {int(g_idx.min())}..{int(g_idx.max())}; group indices "
                                     f"must lie in [0, {k // group})")
    if torch.equal(g_idx, want):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], want):  # some group holds other than group_size columns
        raise ForeignCheckpointError(f"{name}.g_idx does not give every group {group} columns (counts "
                                     f"{torch.bincount(g_idx).tolist()[:8]}...); qgemv stores equal groups")
    return perm


def decode_gptq(name: str, state: dict, used: set, qc: dict, k: int, n: int) -> Decoded:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise ForeignCheckpointError(f"{name}: GPTQ bits {bits!r}; qgemv reads 4 and 8")
    group = _group_size(qc.get("group_size", 128), k, name)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ForeignCheckpointError(f"GPTQ checkpoint_format {fmt!r}; qgemv reads 'gptq' (v1) and 'gptq_v2'")
    ng = k // group
    qweight, qzeros = (_take_packed(state, f"{name}.{t}", used) for t in ("qweight", "qzeros"))
    scales = _take(state, f"{name}.scales", used)
    per = 32 // bits
    for t, want in ((qweight, (k // per, n)), (qzeros, (ng, math.ceil(n / per))), (scales, (ng, n))):
        if tuple(t.shape) != want:
            raise ForeignCheckpointError(f"{name}: a GPTQ tensor has shape {list(t.shape)}, expected {list(want)} "
                               f"(bits {bits}, group_size {group}, in {k}, out {n})")
    perm = None
    if f"{name}.g_idx" in state:
        perm = _group_order(_take_int(state, f"{name}.g_idx", used), group, k, name)
    elif qc.get("desc_act"):
        raise ForeignCheckpointError(f"{name}.g_idx is missing, and desc_act is true")
    q = unpack_words(qweight, bits, 0, k).t()  # [N, K]
    stored = unpack_words(qzeros, bits, 1, n).t()  # [N, ng]
    if fmt == "gptq":
        if bits == 4 and not qc.get("sym", True) and bool((stored == 15).any()):
            raise ForeignCheckpointError(
                f"{name}.qzeros: a GPTQ v1 asymmetric checkpoint with a zero point of 0, stored as -1: its sign "
                f"bits overwrote the neighbouring zero points in the same word, and tools that read it disagree. "
                f"Re-export it as checkpoint_format 'gptq_v2' (GPTQModel), or quantize with qgemv-quantize")
        z = (stored + 1) & ((1 << bits) - 1)
    else:
        z = stored
    if perm is not None:
        q = q[:, perm]  # the groups contiguous; scales and zero points are per group already
    bias = state.get(f"{name}.bias")
    if bias is not None:
        used.add(f"{name}.bias")
    return Decoded(name, bits, q, z, scales.t().float(), group, bias, perm)


def decode_awq(name: str, state: dict, used: set, qc: dict, k: int, n: int) -> Decoded:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ForeignCheckpointError(f"AWQ version {qc.get('version')!r}; qgemv reads 'gemm'")
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise ForeignCheckpointError(f"{name}: AWQ bits {bits!r}; qgemv reads 4")
    key = "group_size" if "group_size" in qc else "q_group_size"
    group = _group_size(qc.get(key, 128), k, name, key)
    ng = k // group
    qweight, qzeros = (_take_packed(state, f"{name}.{t}", used) for t in ("qweight", "qzeros"))
    scales = _take(state, f"{name}.scales", used)
    for t, want in ((qweight, (k, n // 8)), (qzeros, (ng, n // 8)), (scales, (ng, n))):
        if tuple(t.shape) != want:
            raise ForeignCheckpointError(f"{name}: an AWQ tensor has shape {list(t.shape)}, expected {list(want)} "
                               f"(group_size {group}, in {k}, out {n})")
    q = unpack_words(qweight, 4, 1, n, AWQ_ORDER).t()
    z = unpack_words(qzeros, 4, 1, n, AWQ_ORDER).t()
    if qc.get("zero_point", True) is False:
        z = torch.full_like(z, 8)
    bias = state.get(f"{name}.bias")
    if bias is not None:
        used.add(f"{name}.bias")
    return Decoded(name, 4, q, z, scales.t().float(), group, bias)


def _ct_weights_args(qc: dict, name: str) -> Optional[dict]:
    """The weights' quantization args of the config group that targets linear ``name`` (None: not quantized)."""
    for pattern in qc.get("ignore") or []:
        if _pattern_matches(pattern, name):
            return None
    for group in (qc.get("config_groups") or {}).values():
        targets = group.get("targets") or []
        if any(t == "Linear" or _pattern_matches(t, name) for t in targets):
            return group.get("weights")
    return None


def decode_compressed(name: str, state: dict, used: set, qc: dict, k: int, n: int) -> Optional[Decoded]:
    if f"{name}.weight_packed" not in state:
        return None
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ForeignCheckpointError(f"compressed-tensors format {fmt!r}; qgemv reads 'pack-quantized'")
    args = _ct_weights_args(qc, name)
    if args is None:
        raise ForeignCheckpointError(f"{name}: has weight_packed but no config group targets it")
    bits, typ, strategy = args.get("num_bits"), args.get("type", "int"), args.get("strategy")
    if bits not in (4, 8) or typ != "int":
        raise ForeignCheckpointError(f"{name}: {typ}{bits} weights; qgemv reads int4 and int8")
    if strategy == "channel":
        group = k
    elif strategy == "group":
        if args.get("group_size") is None:
            raise ForeignCheckpointError(f"{name}: strategy 'group' needs a group_size in its quantization args")
        group = _group_size(args["group_size"], k, name)
    else:
        raise ForeignCheckpointError(f"{name}: quantization strategy {strategy!r}; qgemv reads 'group' and 'channel'")
    ng = k // group
    packed, scale = _take_packed(state, f"{name}.weight_packed", used), _take(state, f"{name}.weight_scale", used)
    if f"{name}.weight_shape" in state:
        shape = _take_int(state, f"{name}.weight_shape", used).reshape(-1).tolist()
        if shape != [n, k]:
            raise ForeignCheckpointError(f"{name}.weight_shape is {shape}, but the model's linear is [{n}, {k}]")
    off = 1 << (bits - 1)
    if tuple(packed.shape) != (n, math.ceil(k * bits / 32)) or tuple(scale.shape) != (n, ng):
        raise ForeignCheckpointError(f"{name}: weight_packed {list(packed.shape)} / weight_scale {list(scale.shape)} do not "
                           f"fit [{n}, {k}] with {ng} group(s) of {bits} bits")
    q = unpack_words(packed, bits, 1, k)  # stored q + 2^(b-1): already the unsigned code
    if args.get("symmetric", True):
        z = torch.full((n, ng), off, dtype=torch.int64)
    else:
        zp = _take_packed(state, f"{name}.weight_zero_point", used)
        if tuple(zp.shape) != (math.ceil(n * bits / 32), ng):
            raise ForeignCheckpointError(f"{name}.weight_zero_point has shape {list(zp.shape)}, expected "
                               f"[{math.ceil(n * bits / 32)}, {ng}] (packed along out_features)")
        z = unpack_words(zp, bits, 0, n)  # stored zp + 2^(b-1): the zero point of the unsigned codes
    bias = state.get(f"{name}.bias")
    if bias is not None:
        used.add(f"{name}.bias")
    return Decoded(name, bits, q, z, scale.float(), group, bias)


# --------------------------------------------------------------------------
# Whole checkpoints
# --------------------------------------------------------------------------
def load(path, device: str = "cpu", dtype: torch.dtype = torch.float16, report: Optional[dict] = None):
    """(model, tokenizer) of a GPTQ / AWQ / compressed-tensors directory, with QuantLinear modules.

    ``report`` (a dict), if given, receives the method, the converted module
    names, the kept-float linears and the largest relative scale change.
    """
    transformers = checkpoint.require_transformers()
    p = Path(path)
    method = detect(p)
    if method is None:
        raise ForeignCheckpointError(f"{path}: config.json names no quantization this module reads ({', '.join(METHODS)})")
    raw = json.loads((p / "config.json").read_text(encoding="utf-8"))
    qc = raw["quantization_config"]
    state, _ = checkpoint.read_checkpoint_tensors(p)
    model, config = checkpoint.meta_model(p, dtype)
    used, converted, kept, worst = set(), [], [], 0.0
    decode = {"gptq": decode_gptq, "awq": decode_awq, "compressed-tensors": decode_compressed}[method]
    for name, lin in list(model.named_modules()):
        if not isinstance(lin, nn.Linear):
            continue
        if method != "compressed-tensors" and f"{name}.qweight" not in state:
            kept.append(name)
            continue
        try:
            d = decode(name, state, used, qc, lin.in_features, lin.out_features)
        except ForeignCheckpointError as e:
            raise ForeignCheckpointError(f"{path}: {e}") from None
        if d is None:
            kept.append(name)
            continue
        if d.bias is not None and lin.bias is None:
            raise ForeignCheckpointError(f"{path}: tensor {name}.bias, but the model's {name} has no bias "
                                         f"({config.model_type}'s config)")
        if d.bias is not None and tuple(d.bias.shape) != (lin.out_features,):
            raise ForeignCheckpointError(f"{path}: tensor {name}.bias has shape {list(d.bias.shape)}, expected "
                                         f"[{lin.out_features}] (out_features)")
        q, change = to_quant_linear(d, lin.in_features, dtype)
        worst = max(worst, change)
        set_submodule(model, name, q)
        converted.append(name)
    if not converted:
        raise ForeignCheckpointError(f"{path}: no quantized linear found ({method})")
    float_state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k not in used}
    model_keys = {k for k, v in model.state_dict().items() if v.is_meta}  # all but the repacked linears
    if getattr(config, "tie_word_embeddings", False):
        model_keys.discard("lm_head.weight")
    missing = sorted(model_keys - set(float_state))
    if missing:
        raise ForeignCheckpointError(f"{path}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    extra = sorted(set(float_state) - model_keys)
    if extra:
        raise ForeignCheckpointError(f"{path}: {len(extra)} tensor(s) this reader does not understand, e.g. {extra[:3]}")
    model.load_state_dict(float_state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    checkpoint.rebuild_meta_buffers(model, config, path)
    folded = fold_mlp_perms(model)
    if report is not None:
        report.update(method=method, converted=converted, kept_float=kept, max_scale_change=worst,
                      folded_perms=folded)
    return model.to(device).eval(), checkpoint.tokenizer_or_none(transformers, p)


# MLPs that compute down(act(gate(x)) * up(x)) with an elementwise act, as transformers defines them
_GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


def fold_mlp_perms(model: nn.Module) -> list:
    """Fold each permuted down_proj's input order into gate_proj's and up_proj's output rows, in place.

    down_proj stored as W[:, perm] needs h[perm], where h = act(gate(x)) *
    up(x) is elementwise in gate's and up's outputs: with their rows (codes,
    scales, zero points, bias) in perm order they produce h[perm] themselves,
    so down_proj drops its gather and the model computes the same numbers, bit
    for bit.  Only the MLP classes of _GATED_MLPS are folded.  Returns the
    folded down_proj names.
    """
    folded = []
    for name, mlp in model.named_modules():
        if type(mlp).__name__ not in _GATED_MLPS:
            continue
        down, gate, up = (getattr(mlp, a, None) for a in ("down_proj", "gate_proj", "up_proj"))
        if not isinstance(down, QuantLinear) or down.perm is None:
            continue
        if not all(type(m) in (QuantLinear, nn.Linear) for m in (gate, up)):
            continue
        for m in (gate, up):
            _permute_rows(m, down.perm.to(torch.int64))
        down.perm = None
        folded.append(f"{name}.down_proj" if name else "down_proj")
    return folded


def _permute_rows(m: nn.Module, idx: torch.Tensor) -> None:
    """Reorder a linear's output rows: m(x) becomes m(x)[..., idx]."""
    with torch.no_grad():
        if isinstance(m, QuantLinear):
            rows = formats.to_panels(m.qweight, inverse=True)
            m.qweight = formats.to_panels(rows[idx.to(rows.device)].contiguous())
            m.scales = m.scales[idx.to(m.scales.device)].contiguous()
            if m.zeros is not None:
                m.zeros = m.zeros[idx.to(m.zeros.device)].contiguous()
            if m.bias is not None:
                m.bias = m.bias[idx.to(m.bias.device)].contiguous()
        else:
            m.weight = nn.Parameter(m.weight[idx.to(m.weight.device)].contiguous(), requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(m.bias[idx.to(m.bias.device)].contiguous(), requires_grad=False)


def main(argv=None) -> int:
    """qgemv-convert SRC --out DST: a GPTQ / AWQ / compressed-tensors checkpoint as a qgemv checkpoint."""
    import sys

    from ._args import parser

    ap = parser("qgemv-convert", main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("src", help="a GPTQ, AWQ or compressed-tensors (pack-quantized) Hugging Face directory")
    ap.add_argument("--out", required=True, help="the qgemv checkpoint directory to write")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it is a qgemv checkpoint")
    args = ap.parse_args(argv)
    try:
        out = checkpoint.check_output_dir(args.out, args.overwrite, sources=(args.src,))
        if detect(args.src) is None:
            raise ForeignCheckpointError(f"{args.src}: not a GPTQ, AWQ or compressed-tensors checkpoint (config.json's "
                               f"quantization_config.quant_method)")
        rep = {}
        model, tok = load(args.src, "cpu", torch.float16, rep)
    except (checkpoint.CheckpointError, checkpoint.OutputDirError, FileNotFoundError, FileExistsError) as e:
        print(f"qgemv-convert: {e}", file=sys.stderr)
        return 2
    first = model.get_submodule(rep["converted"][0]).config
    fuse_llama_projections(model)  # q/k/v and gate/up of one format: one packed weight each, exactly
    qcfg = checkpoint.quantization_config(model, f"import:{rep['method']}", None, first, rep["kept_float"])
    try:
        checkpoint.save_quantized(model, tok, str(out), qcfg, overwrite=args.overwrite)
    except Exception as e:
        if not checkpoint.is_disk_full(e):
            raise
        print(f"qgemv-convert: no space left on the device while writing {out} (nothing of it was kept; free some "
              f"space and run again)", file=sys.stderr)
        return 2
    print(f"{args.src} ({rep['method']}): {len(rep['converted'])} linears repacked, {len(rep['kept_float'])} kept "
          f"float; largest relative scale change by float16 rounding {rep['max_scale_change']:.2e}; wrote {out}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())


checkpoint.register_reader(detect, load)  # load_quantized reads these formats too
