"""Quantized weight formats: quantize, pack, unpack, dequantize (pure torch).

Three formats, each a versioned, documented layout (``FORMAT_VERSION``):

========  ======================  ==========================================
name      codes                   tensors
========  ======================  ==========================================
int8      q in [-128, 127]        qweight int8 [N, round_up(K, 16)],
          w = q * s[n]            scales fp16 [N]
int4      q in [0, 15], zero 8    qweight int32 [N, round_up(K, 32) / 8],
          w = (q - 8) * s[n]      scales fp16 [N]
int4g     q in [0, 15]            qweight int32 as int4,
          w = (q - z) * s[n, g]   scales fp16 [N, K / G], zeros uint8
                                  [N, K / G] (asymmetric) or none
                                  (symmetric: z = 8), G in {32, 64, 128}
========  ======================  ==========================================

N is out_features, K is in_features.  K must be a multiple of 8 (a clear
error otherwise; rows are *not* padded to reach it).  Packed rows are padded
with zero codes up to the alignment above so that every row starts on a
16-byte boundary for the kernels' 128-bit loads; padding is never read as a
weight (the kernels zero the matching activations, the reference trims it).

Scales are fp16 for every activation dtype: the kernels apply them in fp32 to
partial sums, and fp16 keeps 3 more mantissa bits than bf16.  Scales are
clamped to at least 2**-24 (the smallest fp16 subnormal) so that they are
never zero; an all-zero row or group gets scale 1.0 and codes that decode to
exactly 0.

int4 packing (see :func:`pack_int4` for the drawing) interleaves nibbles for
a two-instruction int4 -> fp16x2 conversion and swizzles words so that each
GPU lane reads its 32 k of a 128-k tile with one 128-bit load.

Both packed layouts are then stored in *panels* (format version 2, see
:func:`to_panels`): rows are taken 16 at a time (the kernels' block of output
channels) and, inside a panel, the 64 bytes that each row holds of one k-tile
(128 k of int4, 64 k of int8) are stored next to each other, tile after tile.
A panel still occupies exactly the bytes of its rows, so tensor shapes are
those of the row-major layout; only the order inside each panel changes.  A
warp then streams 512 contiguous bytes per load instruction instead of 8
pieces of 64 bytes from 8 rows, which measured 10-30% faster on an H200
(BENCHMARKS.md).  Format version 1 checkpoints (row-major) are converted on
load by :func:`to_panels`.  Version 3 stores the same tensors as version 2
and may fuse q/k/v and gate/up into one packed weight each (the checkpoint's
``quantization_config["fused"]``; qgemv.checkpoint).  Version 4 widens int8
to the full code range [-128, 127]: compressed-tensors' symmetric int8 (the
W8A16 default of llm-compressor) uses -128, and the kernels decode it
exactly (q + 128 in a byte, then one subtraction).  qgemv's own quantizers
still write [-127, 127] (a symmetric grid), so version 3 readers would only
meet -128 in imported weights, which they refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

FORMAT_VERSION = 4

#: Output channels per panel (the GPU kernels' rows per block).
PANEL_ROWS = 16
#: Bytes of one row inside one k-tile of a panel.
TILE_ROW_BYTES = 64

#: Logical element (0..7 within a word of 8 k) stored in nibble i (bits 4i..4i+3).
INT4_NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP_SIZES = (32, 64, 128)
_MIN_SCALE = 2.0**-24
_MAX_SCALE = 65504.0


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def fallback_group_size(in_features: int, group_size: Optional[int]) -> Optional[int]:
    """``group_size`` if it divides in_features, else the largest smaller one of 128/64/32 that does.

    Returns None when no group size fits (or group_size is None: per channel).
    Used by quantize_model, fused projections and calibration when asked to
    fall back instead of skipping a layer (SmolLM2's K = 576 is not a multiple
    of 128).
    """
    if group_size is None or in_features % group_size == 0:
        return group_size
    return next((g for g in (128, 64, 32) if g < group_size and in_features % g == 0), None)


def check_weight(w: torch.Tensor, name: str = "weight", group_size: Optional[int] = None) -> None:
    """Validate a float weight [N, K] before quantization.

    Raises ValueError naming ``name`` and the rule: 2-D, floating point,
    finite, K % 8 == 0, and K % group_size == 0 when grouped.
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"{name}: weight must be a 2-D tensor [out_features, in_features]")
    if not w.is_floating_point():
        raise ValueError(f"{name}: weight must be floating point, got {w.dtype}")
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"{name}: weight must not be empty, got shape {tuple(w.shape)}")
    if k % 8 != 0:
        raise ValueError(
            f"{name}: in_features must be a multiple of 8, got {k} (the packed formats do not pad K to 8)"
        )
    if group_size is not None:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"{name}: group_size must be one of {GROUP_SIZES} or None, got {group_size}")
        if k % group_size != 0:
            raise ValueError(
                f"{name}: in_features ({k}) must be divisible by group_size ({group_size})"
            )
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"{name}: weight contains {bad} NaN or Inf value(s); cannot quantize")


class QuantizationWarning(UserWarning):
    """A weight that quantizes badly in the chosen format (e.g. too small for fp16 scales)."""


def _finish_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 scale -> fp16 scale with the documented clamping.

    Warns (QuantizationWarning, naming ``name``) when a non-zero row or group
    needs a scale below 2**-24, the smallest fp16: its codes then round to
    zero, so the weights it covers are lost.
    """
    if bool((scale > _MAX_SCALE).any()):
        raise ValueError(f"{name}: a quantization scale exceeds the fp16 range (weights too large)")
    tiny = int(((scale > 0) & (scale < _MIN_SCALE)).sum())
    if tiny:
        warnings.warn(f"{name}: {tiny} of {scale.numel()} scale groups need a scale below 2^-24, the smallest "
                      "fp16 value; their weights quantize to zero (keep this layer in float)",
                      QuantizationWarning, stacklevel=3)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(min=_MIN_SCALE).to(torch.float16)


def tiny_weight_groups(w: torch.Tensor, config: "QuantConfig") -> tuple:
    """(groups whose round-to-nearest scale underflows fp16, all groups) of w [N, K] in ``config``.

    Such a row or group is not all zero, yet its max |w| divided by the
    format's code range is below 2**-24, the smallest fp16 scale: every code
    rounds to 0 (e.g. a layer multiplied by 1e-8).  quantize_model and
    calibration keep layers with any such group in float and report them.
    """
    n, k = w.shape
    g = config.group_size or k
    wf = w.detach().float().reshape(n, k // g, g)
    if config.bits == 8 or config.symmetric:
        scale = wf.abs().amax(dim=2) / (127.0 if config.bits == 8 else 7.0)
    else:
        scale = (wf.amax(dim=2).clamp(min=0) - wf.amin(dim=2).clamp(max=0)) / 15.0
    return int(((scale > 0) & (scale < _MIN_SCALE)).sum()), scale.numel()


# --------------------------------------------------------------------------
# panels (format version 2): the row order both packed layouts are stored in
# --------------------------------------------------------------------------
def to_panels(rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Row-major packed rows [N, L] <-> the panel order of format version 2.

    ``rows`` is a packed qweight (int8 [N, Kp] or int32 [N, Kp/8]); a tile
    row is TILE_ROW_BYTES bytes, i.e. ``seg`` = 64 int8 or 16 int32 elements.
    For each panel of r = min(16, N - p) rows starting at row p, with
    nt = L // seg full tiles and e = L % seg elements left over::

        stored[p : p + r].flatten() =
            [tile 0: row p, row p+1, ..., row p+r-1] ... [tile nt-1: rows ...]
            [the last e elements of row p, of row p+1, ...]

    so element (row p + i, tile j, offset b) sits at j*r*seg + i*seg + b and
    the partial last tile at nt*r*seg + i*e + b.  ``inverse=True`` undoes it.
    Returns a new contiguous tensor of the same shape and dtype.
    """
    if rows.dim() != 2:
        raise ValueError(f"to_panels: expected a 2-D packed tensor, got {rows.dim()}-D")
    seg = TILE_ROW_BYTES // rows.element_size()
    n, length = rows.shape
    nt, e = divmod(length, seg)

    def permute(block: torch.Tensor) -> torch.Tensor:  # [P, r, L] -> [P, r, L]
        pn, r, _ = block.shape
        if not inverse:
            main = block[:, :, : nt * seg].reshape(pn, r, nt, seg).transpose(1, 2).reshape(pn, -1)
            edge = block[:, :, nt * seg :].reshape(pn, -1)
            return torch.cat([main, edge], 1).reshape(pn, r, length)
        flat = block.reshape(pn, -1)
        main = flat[:, : nt * r * seg].reshape(pn, nt, r, seg).transpose(1, 2).reshape(pn, r, nt * seg)
        edge = flat[:, nt * r * seg :].reshape(pn, r, e)
        return torch.cat([main, edge], 2)

    out = torch.empty_like(rows)
    full = n // PANEL_ROWS * PANEL_ROWS
    if full:
        out[:full] = permute(rows[:full].reshape(-1, PANEL_ROWS, length)).reshape(full, length)
    if full < n:
        out[full:] = permute(rows[full:][None])[0]
    return out.contiguous()


def take_packed_rows(qweight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 [n], any order, on any device) of a packed qweight, still packed: exact.

    A packed row's bytes depend only on that row's codes (the nibble order and
    the word swizzle work inside a row); only the 16-row panels mix rows.  So
    the panels are undone, the rows picked, and the result put in panels
    again: int8 [N, Kp] -> [n, Kp] or int32 [N, Kp / 8] -> [n, Kp / 8], on
    qweight's device, with no unpacking (a 7B q/k/v in ~25 ms on 2 CPU cores,
    against ~1 s through the codes).
    """
    return to_panels(to_panels(qweight, inverse=True)[rows.to(qweight.device)])


# --------------------------------------------------------------------------
# int8
# --------------------------------------------------------------------------
def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> qweight int8 [N, round_up(K, 16)] (zero padded, in panels)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack_int8: q must be a 2-D int8 tensor, got {q.dtype} {q.dim()}-D")
    n, k = q.shape
    out = torch.zeros(n, _round_up(k, 16), dtype=torch.int8, device=q.device)
    out[:, :k] = q
    return to_panels(out)


def unpack_int8(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int8`: int8 codes [N, in_features]."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"unpack_int8: qweight must be 2-D int8, got {qweight.dtype} {qweight.dim()}-D")
    if qweight.shape[1] != _round_up(in_features, 16):
        raise ValueError(
            f"unpack_int8: qweight has {qweight.shape[1]} columns, expected round_up({in_features}, 16)"
        )
    return to_panels(qweight, inverse=True)[:, :in_features].contiguous()


def quantize_int8(w: torch.Tensor, name: str = "weight"):
    """Symmetric per-output-channel int8.

    Args:
        w: float weight [N, K], K % 8 == 0.
    Returns:
        (qweight int8 [N, round_up(K, 16)], scales fp16 [N]); w ~= q * s[n].
    """
    check_weight(w, name)
    wf = w.detach().float()
    scales = _finish_scale(wf.abs().amax(dim=1) / 127.0, name)
    q = torch.round(wf / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return pack_int8(q), scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """int8 format -> float32 weight [N, in_features]."""
    return unpack_int8(qweight, in_features).float() * scales.float()[:, None]


# --------------------------------------------------------------------------
# int4
# --------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (uint8 values 0..15, K % 8 == 0) -> int32 [N, Kp / 8].

    Kp = round_up(K, 32); padding codes are 0.  Two steps:

    1. Nibble interleave.  Eight consecutive k (e0..e7) share one 32-bit word,
       stored so that masking the word with 0x000f000f after a shift by 4*i
       yields the consecutive pair (e_2i, e_2i+1) in the two 16-bit halves::

            bit 31                                              bit 0
            | e7 | e5 | e3 | e1 | e6 | e4 | e2 | e0 |
              n7   n6   n5   n4   n3   n2   n1   n0     (nibble index)

       i.e. nibble i holds element INT4_NIBBLE_ORDER[i] = (0,2,4,6,1,3,5,7)[i].

    2. Word swizzle.  A row is cut into blocks of 128 k = 16 words.  Lane t
       (0..3) of a GPU quad needs logical words t, 4+t, 8+t, 12+t (32 k from
       each of four 32-k sub-tiles) and should get them in one 16-byte load,
       so logical word 4*j + t is stored at position t*4 + j::

            logical:  w0  w1  w2  w3 | w4  w5  w6  w7 | w8 ... | w12 ... w15
            stored:   w0  w4  w8  w12| w1  w5  w9  w13| w2 ... | w3  ... w15
                      `-- lane 0 --' `-- lane 1 --'

       The last block of a row may hold c = (Kp % 128) / 32 < 4 sub-tiles;
       there logical word 4*j + t is stored at position t*c + j (the same rule
       with 4 replaced by c).

    3. Panels: the rows are stored in panels of 16 (:func:`to_panels`); a
       128-k block of a row (16 words, 64 bytes) is one tile row.
    """
    if q.dim() != 2 or q.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"pack_int4: q must be a 2-D integer tensor, got {q.dtype} {q.dim()}-D")
    n, k = q.shape
    if k % 8 != 0:
        raise ValueError(f"pack_int4: in_features must be a multiple of 8, got {k}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("pack_int4: codes must lie in [0, 15]")
    kp = _round_up(k, 32)
    codes = torch.zeros(n, kp, dtype=torch.int64, device=q.device)
    codes[:, :k] = q.to(torch.int64)
    codes = codes.view(n, kp // 8, 8)
    words = torch.zeros(n, kp // 8, dtype=torch.int64, device=q.device)
    for i, e in enumerate(INT4_NIBBLE_ORDER):
        words |= codes[:, :, e] << (4 * i)
    words = _swizzle_words(words, kp, inverse=False)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return to_panels(words.to(torch.int32))


def _swizzle_words(words: torch.Tensor, kp: int, inverse: bool) -> torch.Tensor:
    """Apply (or undo) the block word swizzle of :func:`pack_int4` on [N, Kp/8]."""
    n = words.shape[0]
    nfull = kp // 128
    c = (kp % 128) // 32
    main = words[:, : nfull * 16].reshape(n, nfull, 4, 4).transpose(-1, -2)
    parts = [main.reshape(n, nfull * 16)]
    if c:
        tail = words[:, nfull * 16 :]
        # forward: logical [j, t] -> stored [t, j]; inverse: stored [t, j] -> [j, t]
        shape = (n, 4, c) if inverse else (n, c, 4)
        parts.append(tail.reshape(shape).transpose(-1, -2).reshape(n, 4 * c))
    return torch.cat(parts, dim=1)


def unpack_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 [N, Kp/8] -> uint8 codes [N, in_features]."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"unpack_int4: qweight must be 2-D int32, got {qweight.dtype} {qweight.dim()}-D")
    n, kw = qweight.shape
    kp = kw * 8
    if kp != _round_up(in_features, 32):
        raise ValueError(
            f"unpack_int4: qweight has {kw} words per row, expected round_up({in_features}, 32) / 8"
        )
    words = to_panels(qweight, inverse=True).to(torch.int64) & 0xFFFFFFFF
    words = _swizzle_words(words, kp, inverse=True)
    codes = torch.empty(n, kp // 8, 8, dtype=torch.uint8, device=qweight.device)
    for i, e in enumerate(INT4_NIBBLE_ORDER):
        codes[:, :, e] = ((words >> (4 * i)) & 0xF).to(torch.uint8)
    return codes.view(n, kp)[:, :in_features].contiguous()


def quantize_int4(
    w: torch.Tensor, group_size: Optional[int] = None, symmetric: bool = True, name: str = "weight"
):
    """Round-to-nearest int4, per output channel or per group along K.

    Args:
        w: float weight [N, K], K % 8 == 0 (and K % group_size == 0).
        group_size: None for one scale per output channel, else 32, 64 or 128.
        symmetric: codes q - 8 in [-8, 7] with s = amax / 7 (zero point 8);
            asymmetric (group-wise only) uses the [min(w, 0), max(w, 0)] range,
            s = range / 15 and an integer zero point z in [0, 15].
    Returns:
        (qweight int32 [N, round_up(K, 32) / 8], scales fp16 [N] or [N, K/G],
        zeros uint8 [N, K/G] or None).
    """
    check_weight(w, name, group_size)
    if not symmetric and group_size is None:
        raise ValueError(f"{name}: asymmetric int4 needs a group_size (32, 64 or 128)")
    n, k = w.shape
    g = group_size or k
    wf = w.detach().float().reshape(n, k // g, g)
    if symmetric:
        scales = _finish_scale(wf.abs().amax(dim=2) / 7.0, name)
        q = torch.round(wf / scales.float()[..., None]).clamp_(-8, 7) + 8
        zeros = None
    else:
        lo = wf.amin(dim=2).clamp(max=0)
        hi = wf.amax(dim=2).clamp(min=0)
        scales = _finish_scale((hi - lo) / 15.0, name)
        zf = torch.round(-lo / scales.float()).clamp_(0, 15)
        q = (torch.round(wf / scales.float()[..., None]) + zf[..., None]).clamp_(0, 15)
        zeros = zf.to(torch.uint8)
    q = q.reshape(n, k).to(torch.uint8)
    if group_size is None:
        scales = scales.reshape(n)
    return pack_int4(q), scales.contiguous(), zeros


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    group_size: Optional[int],
    in_features: int,
) -> torch.Tensor:
    """int4 / int4g format -> float32 weight [N, in_features]."""
    q = unpack_int4(qweight, in_features).float()
    n, k = q.shape
    g = group_size or k
    q = q.view(n, k // g, g)
    s = scales.float().reshape(n, k // g, 1)
    z = zeros.float().reshape(n, k // g, 1) if zeros is not None else 8.0
    return ((q - z) * s).reshape(n, k)


# --------------------------------------------------------------------------
# A small description object, used by QuantLinear and checkpoints.
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantConfig:
    """bits (8 or 4), group_size (None = per channel), symmetric."""

    bits: int = 8
    group_size: Optional[int] = None
    symmetric: bool = True

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.bits == 8 and (self.group_size is not None or not self.symmetric):
            raise ValueError("int8 is symmetric per output channel only (group_size=None, symmetric=True)")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES} or None, got {self.group_size}")
        if not self.symmetric and self.group_size is None:
            raise ValueError("asymmetric int4 needs a group_size (32, 64 or 128)")

    @property
    def name(self) -> str:
        if self.bits == 8:
            return "int8"
        if self.group_size is None:
            return "int4"
        return f"int4g{self.group_size}{'' if self.symmetric else 'a'}"

    def bytes_per_weight(self) -> float:
        """Weight + scale (+ zero) bytes per weight, ignoring row padding."""
        if self.bits == 8:
            return 1.0
        if self.group_size is None:
            return 0.5
        return 0.5 + (2 + (0 if self.symmetric else 1)) / self.group_size

    def packed_bytes(self, out_features: int, in_features: int) -> int:
        if self.bits == 8:
            return out_features * (_round_up(in_features, 16) + 2)
        w = out_features * _round_up(in_features, 32) // 2
        if self.group_size is None:
            return w + 2 * out_features
        ng = in_features // self.group_size
        return w + out_features * ng * (2 + (0 if self.symmetric else 1))


def quantize(w: torch.Tensor, config: QuantConfig, name: str = "weight"):
    """Quantize w [N, K] in ``config``'s format -> (qweight, scales, zeros or None)."""
    if config.bits == 8:
        qw, s = quantize_int8(w, name)
        return qw, s, None
    return quantize_int4(w, config.group_size, config.symmetric, name)


def _params_for_range(wf: torch.Tensor, config: QuantConfig, shrink: float, name: str):
    """Scales / zeros of groups wf [N, ng, G] with their range shrunk by ``shrink``."""
    if config.bits == 8:
        return _finish_scale(wf.abs().amax(dim=2) * shrink / 127.0, name), None
    if config.symmetric:
        return _finish_scale(wf.abs().amax(dim=2) * shrink / 7.0, name), None
    lo = wf.amin(dim=2).clamp(max=0) * shrink
    hi = wf.amax(dim=2).clamp(min=0) * shrink
    s = _finish_scale((hi - lo) / 15.0, name)
    z = torch.round(-lo / s.float()).clamp_(0, 15).to(torch.uint8)
    return s, z


def _group_error(wf, s, z, config: QuantConfig, cw=None) -> torch.Tensor:
    """Squared RTN error per group of wf [N, ng, G] for scales s [N, ng].

    cw: optional non-negative weight per column, [ng, G] (e.g. diag of the
    layer's input Hessian: the error of column k costs E[x_k^2] in the output).
    """
    sf = s.float()[..., None]
    if config.bits == 8:
        q = torch.round(wf / sf).clamp(-127, 127)
        e = (q * sf - wf) ** 2
    else:
        zf = z.float()[..., None] if z is not None else 8.0
        q = (torch.round(wf / sf) + zf).clamp(0, 15)
        e = ((q - zf) * sf - wf) ** 2
    return (e * cw).sum(-1) if cw is not None else e.sum(-1)


def choose_params(w: torch.Tensor, config: QuantConfig, name: str = "weight", clip_grid: int = 0,
                  col_weight: Optional[torch.Tensor] = None):
    """Scales (and zero points) for w [N, K'] in ``config``.

    K' may be a single group (calibration computes group parameters one group
    at a time).  With ``clip_grid = 0`` these are the round-to-nearest values
    :func:`quantize` uses (the full range of each row or group).  With
    ``clip_grid = n`` the range of every group is also shrunk by factors
    1 - i / (2 n), i = 1..n (down to 0.5), and the factor with the smallest
    squared quantization error is kept per group (a clipping search).
    ``col_weight`` [K'] weights each column's squared error (calibration
    passes diag(H), the mean squared input of that column, so that clipping
    spares the columns that matter for the layer's output).
    Returns (scales fp16 [N] or [N, K'/G], zeros uint8 [N, K'/G] or None).
    """
    n, k = w.shape
    g = config.group_size or k
    wf = w.detach().float().reshape(n, k // g, g)
    cw = None
    if col_weight is not None:
        if col_weight.shape != (k,):
            raise ValueError(f"{name}: col_weight must have shape [{k}], got {tuple(col_weight.shape)}")
        cw = col_weight.detach().float().to(wf.device).clamp(min=0).reshape(k // g, g)
    s, z = _params_for_range(wf, config, 1.0, name)
    if clip_grid:
        best = _group_error(wf, s, z, config, cw)
        for i in range(1, clip_grid + 1):
            s2, z2 = _params_for_range(wf, config, 1.0 - i / (2.0 * clip_grid), name)
            err = _group_error(wf, s2, z2, config, cw)
            better = err < best
            best = torch.where(better, err, best)
            s = torch.where(better, s2, s)
            if z is not None:
                z = torch.where(better, z2, z)
    if config.group_size is None:
        s = s.reshape(n)
    return s.contiguous(), (z.contiguous() if z is not None else None)


def code_range(config: QuantConfig):
    """(qmin, qmax) of the stored integer codes."""
    return (-127, 127) if config.bits == 8 else (0, 15)


def dequantize(qweight, scales, zeros, config: QuantConfig, in_features: int) -> torch.Tensor:
    """Inverse of :func:`quantize` up to rounding: float32 [N, in_features]."""
    if config.bits == 8:
        return dequantize_int8(qweight, scales, in_features)
    return dequantize_int4(qweight, scales, zeros, config.group_size, in_features)


def quantize_with_params(
    w: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], config: QuantConfig
) -> torch.Tensor:
    """Integer codes of w [N, K] for given fp16 scales (and zeros) -> packed qweight.

    Used by calibration (GPTQ, AWQ), which choose scales themselves.
    """
    n, k = w.shape
    wf = w.detach().float()
    if config.bits == 8:
        q = torch.round(wf / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return pack_int8(q)
    g = config.group_size or k
    s = scales.float().reshape(n, k // g, 1)
    z = zeros.float().reshape(n, k // g, 1) if zeros is not None else 8.0
    q = (torch.round(wf.view(n, k // g, g) / s) + z).clamp_(0, 15)
    return pack_int4(q.reshape(n, k).to(torch.uint8))


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


__all__ = [
    "FORMAT_VERSION",
    "INT4_NIBBLE_ORDER",
    "GROUP_SIZES",
    "PANEL_ROWS",
    "TILE_ROW_BYTES",
    "QuantConfig",
    "to_panels",
    "fallback_group_size",
    "check_weight",
    "QuantizationWarning",
    "tiny_weight_groups",
    "pack_int8",
    "unpack_int8",
    "quantize_int8",
    "dequantize_int8",
    "pack_int4",
    "unpack_int4",
    "quantize_int4",
    "dequantize_int4",
    "quantize",
    "dequantize",
    "quantize_with_params",
    "choose_params",
    "code_range",
    "nbytes",
]
