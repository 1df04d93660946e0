"""The qgemv operators: schemas, fakes, pure-torch references, Python wrappers.

Every op lives in the ``qgemv`` torch.library namespace:

* ``qgemv::linear_int8(Tensor x, Tensor qweight, Tensor scales, int in_features, Tensor? perm=None) -> Tensor``
* ``qgemv::linear_int4(Tensor x, Tensor qweight, Tensor scales, int in_features, Tensor? perm=None) -> Tensor``
* ``qgemv::linear_int4_grouped(Tensor x, Tensor qweight, Tensor scales,
  Tensor? zeros, int group_size, int in_features, Tensor? perm=None) -> Tensor``
* ``qgemv::sgemv(Tensor A, Tensor x, int kernel=0) -> Tensor``
* ``qgemv::add_rms_gather(Tensor x, Tensor delta, Tensor weight, Tensor perm, float eps) -> (Tensor, Tensor)``:
  the generation engine's residual add and RMSNorm with the normalized row
  gathered into an act-order linear's input order, in one kernel.
* ``qgemv::decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot, Tensor pad, float scale,
  int splits=0) -> Tensor``: the engine's per-op decode attention, one query
  token a sequence against its visible cache slots ``pad[b] .. slot`` only.
* ``qgemv::rope_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache,
  Tensor slot, Tensor pad, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, float scale,
  int splits=0) -> Tensor``: the token's q / k norms (Qwen3), its rotation
  and its cache write, then decode_attention, in one kernel.

``in_features`` is the K the weight was packed for.  The packed rows are
padded (to 16 k for int8, 32 k for int4), so the packed width alone cannot
tell K = 56 from K = 64: every op takes K and refuses an x whose last
dimension differs from it.

``perm`` (int32 [K], optional) is an act-order checkpoint's input order: the
op computes ``x[..., perm] @ W^T``.  The GEMV gathers x itself for up to 8
tokens while 4 (M + 1) K bytes of shared memory fit in 32 KB (one token up to
K = 4096, three up to 2048) on weights of at most 512 16-row panels (N <=
8192; csrc/qgemv.h, gemv_gathers); the other paths gather x first.  Its values are checked by the reference and by
the Python wrappers below, not by the CUDA op (that would synchronize); there
a bad index is clamped into [0, K), so it gives wrong outputs, never a read
outside x.

The reference below is registered for the CPU key and is what the tests
compare the CUDA kernels against.  The CUDA key is served by the compiled
extension (``qgemv._C``, registered from csrc/torch_bindings.cpp) and, when
that is missing, by the same reference (with one warning, see ``_ext``).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import formats

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Version of the schemas below; csrc/torch_bindings.cpp's kOpsVersion must equal it
#: for the compiled kernels to be registered (qgemv/_ext.py).
OPS_VERSION = 6

torch.library.define(
    "qgemv::linear_int8", "(Tensor x, Tensor qweight, Tensor scales, int in_features, Tensor? perm=None) -> Tensor")
torch.library.define(
    "qgemv::linear_int4", "(Tensor x, Tensor qweight, Tensor scales, int in_features, Tensor? perm=None) -> Tensor")
torch.library.define(
    "qgemv::linear_int4_grouped",
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int group_size, int in_features, "
    "Tensor? perm=None) -> Tensor",
)
torch.library.define("qgemv::sgemv", "(Tensor A, Tensor x, int kernel=0) -> Tensor")
torch.library.define("qgemv::add_rms_gather",
                     "(Tensor x, Tensor delta, Tensor weight, Tensor perm, float eps) -> (Tensor, Tensor)")
torch.library.define("qgemv::decode_attention",
                     "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot, Tensor pad, float scale, "
                     "int splits=0) -> Tensor")
torch.library.define("qgemv::rope_decode_attention",
                     "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot, Tensor pad, "
                     "Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, float scale, "
                     "int splits=0) -> Tensor")

#: Widest row qgemv::add_rms_gather takes (csrc/qgemv.h, kNormMaxWidth: the row sits in shared memory).
NORM_MAX_WIDTH = 16384
#: qgemv::decode_attention's limits (csrc/qgemv.h): head sizes, query heads a kv head, splits.
DECODE_ATTN_HEAD_DIMS = (64, 96, 128)
DECODE_ATTN_MAX_GROUP = 16
DECODE_ATTN_MAX_SPLITS = 64


# --------------------------------------------------------------------------
# Checks shared by the fakes and the references.  Messages name the tensor
# and the rule and match the CUDA side's TORCH_CHECKs.
# --------------------------------------------------------------------------
def _fail(op: str, msg: str):
    raise ValueError(f"qgemv.{op}: {msg}")


def _check_x(op: str, x: torch.Tensor, tensors: dict, in_features: int) -> int:
    if x.dtype not in FLOAT_DTYPES:
        _fail(op, f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        _fail(op, "x must have at least 1 dimension")
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            _fail(op, f"{name} must be on the same device as x ({x.device}), got {t.device}")
    if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0 or in_features % 8:
        _fail(op, f"in_features must be a positive multiple of 8, got {in_features!r}")
    if x.shape[-1] != in_features:
        _fail(op, f"x.shape[-1] must equal in_features ({in_features}), got {x.shape[-1]}")
    return in_features


def _check_qweight(op: str, qweight: torch.Tensor, dtype: torch.dtype, expected_cols: int, rule: str):
    if qweight.dtype != dtype:
        _fail(op, f"qweight must be {str(dtype).replace('torch.', '')}, got {qweight.dtype}")
    if qweight.dim() != 2:
        _fail(op, f"qweight must be 2-D, got {qweight.dim()}-D")
    if not qweight.is_contiguous():
        _fail(op, "qweight must be contiguous")
    if qweight.shape[1] != expected_cols:
        _fail(op, f"qweight.shape[1] must be {rule} = {expected_cols}, got {qweight.shape[1]}")


def _check_scales(op: str, scales: torch.Tensor, n: int, groups: int):
    if scales.dtype != torch.float16:
        _fail(op, f"scales must be float16, got {scales.dtype}")
    if not scales.is_contiguous():
        _fail(op, "scales must be contiguous")
    want = (n,) if groups == 0 else (n, groups)
    if tuple(scales.shape) != want:
        _fail(op, f"scales must have shape {list(want)}, got {list(scales.shape)}")


def _check_perm(op: str, perm: Optional[torch.Tensor], k: int) -> None:
    """perm's dtype, shape and layout (its device is _check_x's); not its values: see check_perm_values."""
    if perm is None:
        return
    if perm.dtype != torch.int32:
        _fail(op, f"perm must be int32, got {perm.dtype}")
    if tuple(perm.shape) != (k,):
        _fail(op, f"perm must have shape [{k}], got {list(perm.shape)}")
    if not perm.is_contiguous():
        _fail(op, "perm must be contiguous")


def check_perm_values(op: str, perm: Optional[torch.Tensor], k: int) -> None:
    """perm holds every index 0..k-1 once (reads perm: on a GPU, a synchronization)."""
    if perm is not None and not torch.equal(torch.sort(perm.long()).values, torch.arange(k, device=perm.device)):
        _fail(op, f"perm must be a permutation of 0..{k - 1}")


def check_linear_int8(x, qweight, scales, in_features, perm=None) -> None:
    op = "linear_int8"
    k = _check_x(op, x, {"qweight": qweight, "scales": scales, "perm": perm}, in_features)
    _check_qweight(op, qweight, torch.int8, (k + 15) // 16 * 16, "round_up(K, 16)")
    _check_scales(op, scales, qweight.shape[0], 0)
    _check_perm(op, perm, k)


def check_linear_int4(x, qweight, scales, in_features, zeros=None, group_size=0, op="linear_int4",
                      perm=None) -> None:
    k = _check_x(op, x, {"qweight": qweight, "scales": scales, "zeros": zeros, "perm": perm}, in_features)
    _check_qweight(op, qweight, torch.int32, (k + 31) // 32 * 4, "round_up(K, 32) / 8")
    groups = 0
    if op == "linear_int4_grouped":
        if isinstance(group_size, bool) or group_size not in formats.GROUP_SIZES:
            _fail(op, f"group_size must be 32, 64 or 128, got {group_size}")
        if k % group_size != 0:
            _fail(op, f"in_features ({k}) must be divisible by group_size ({group_size})")
        groups = k // group_size
    n = qweight.shape[0]
    _check_scales(op, scales, n, groups)
    if zeros is not None:
        if zeros.dtype != torch.uint8:
            _fail(op, f"zeros must be uint8, got {zeros.dtype}")
        if not zeros.is_contiguous():
            _fail(op, "zeros must be contiguous")
        if tuple(zeros.shape) != (n, groups):
            _fail(op, f"zeros must have shape [{n}, {groups}], got {list(zeros.shape)}")
    _check_perm(op, perm, k)


def check_sgemv(A, x, kernel) -> None:
    op = "sgemv"
    if A.dtype != torch.float32:
        _fail(op, f"A must be float32, got {A.dtype}")
    if x.dtype != torch.float32:
        _fail(op, f"x must be float32, got {x.dtype}")
    if A.dim() != 2:
        _fail(op, f"A must be 2-D [N, K], got {A.dim()}-D")
    if x.device != A.device:
        _fail(op, f"x must be on the same device as A ({A.device}), got {x.device}")
    if x.dim() != 1 or x.shape[0] != A.shape[1]:
        _fail(op, f"x must have shape [{A.shape[1]}], got {list(x.shape)}")
    if kernel not in (0, 1, 2, 3):
        _fail(op, f"kernel must be 0 (auto), 1 (k32), 2 (k128) or 3 (k16), got {kernel}")


def check_add_rms_gather(x, delta, weight, perm, eps) -> None:
    op = "add_rms_gather"
    if x.dtype not in FLOAT_DTYPES:
        _fail(op, f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        _fail(op, "x must have at least 1 dimension")
    h = x.shape[-1]
    if not 1 <= h <= NORM_MAX_WIDTH:
        _fail(op, f"x.shape[-1] must be in 1..{NORM_MAX_WIDTH}, got {h}")
    if delta.shape != x.shape:
        _fail(op, f"delta must have x's shape {list(x.shape)}, got {list(delta.shape)}")
    if delta.dtype != x.dtype:
        _fail(op, f"delta must have x's dtype {x.dtype}, got {delta.dtype}")
    if weight.dim() != 1 or weight.shape[0] != h:
        _fail(op, f"weight must have shape [{h}], got {list(weight.shape)}")
    if weight.dtype != x.dtype:
        _fail(op, f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    _check_perm(op, perm, h)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        _fail(op, f"eps must be a finite number >= 0, got {eps!r}")
    for name, t in (("delta", delta), ("weight", weight), ("perm", perm)):
        if t.device != x.device:
            _fail(op, f"{name} must be on the same device as x ({x.device}), got {t.device}")


def check_decode_attention(q, k_cache, v_cache, slot, pad, scale, splits=0, op="decode_attention") -> None:
    if q.dtype not in FLOAT_DTYPES:
        _fail(op, f"q must be float16 or bfloat16 (float32 on the CPU), got {q.dtype}")
    if q.dim() != 3:
        _fail(op, f"q must be [batch, heads, head_dim], got {list(q.shape)}")
    if k_cache.dim() != 4:
        _fail(op, f"k_cache must be [batch, kv_heads, max_seq, head_dim], got {list(k_cache.shape)}")
    B, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        _fail(op, f"k_cache must be [{B}, kv_heads, max_seq, {D}] (q's batch and head_dim), got "
                  f"{list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        _fail(op, f"v_cache must have k_cache's shape {list(k_cache.shape)}, got {list(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        _fail(op, f"k_cache and v_cache must have q's dtype {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    if not 1 <= B <= 65535:
        _fail(op, f"batch must be in 1..65535, got {B}")
    if D not in DECODE_ATTN_HEAD_DIMS:
        _fail(op, f"head_dim must be 64, 96 or 128, got {D}")
    if Hkv < 1 or H % Hkv or H // Hkv > DECODE_ATTN_MAX_GROUP:
        _fail(op, f"heads ({H}) must be kv_heads ({Hkv}) times 1..{DECODE_ATTN_MAX_GROUP}")
    if S < 1:
        _fail(op, f"max_seq must be >= 1, got {S}")
    if slot.dtype != torch.int64 or slot.numel() < 1:
        _fail(op, f"slot must be an int64 tensor of >= 1 element, got {slot.dtype} {list(slot.shape)}")
    if pad.dtype != torch.int64 or pad.dim() != 1 or pad.shape[0] != B:
        _fail(op, f"pad must be int64 [{B}], got {pad.dtype} {list(pad.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        _fail(op, f"scale must be a finite number > 0, got {scale!r}")
    if isinstance(splits, bool) or not isinstance(splits, int) or not 0 <= splits <= DECODE_ATTN_MAX_SPLITS:
        _fail(op, f"splits must be 0 (chosen) or 1..{DECODE_ATTN_MAX_SPLITS}, got {splits!r}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("slot", slot), ("pad", pad)):
        if t.device != q.device:
            _fail(op, f"{name} must be on the same device as q ({q.device}), got {t.device}")


def check_rope_decode_attention(q, k, v, k_cache, v_cache, slot, pad, cos, sin, q_norm, k_norm, eps, scale,
                                splits=0) -> None:
    op = "rope_decode_attention"
    check_decode_attention(q, k_cache, v_cache, slot, pad, scale, splits, op=op)
    B, _, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape) != (B, Hkv, D):
            _fail(op, f"{name} must be [{B}, {Hkv}, {D}] (the token's {name} heads), got {list(t.shape)}")
        if t.dtype != q.dtype:
            _fail(op, f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[0] < S or t.shape[1] != D:
            _fail(op, f"{name} must be [>= {S}, {D}] (a row a cache slot's position), got {list(t.shape)}")
        if t.dtype != q.dtype:
            _fail(op, f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if (q_norm is None) != (k_norm is None):
        _fail(op, "q_norm and k_norm must be given together")
    for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
        if t is not None and (t.dim() != 1 or t.shape[0] != D or t.dtype != q.dtype):
            _fail(op, f"{name} must be a contiguous [{D}] tensor of q's dtype {q.dtype}, got {t.dtype} "
                      f"{list(t.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        _fail(op, f"eps must be a finite number >= 0, got {eps!r}")
    for name, t in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("q_norm", q_norm), ("k_norm", k_norm)):
        if t is not None and t.device != q.device:
            _fail(op, f"{name} must be on the same device as q ({q.device}), got {t.device}")


# --------------------------------------------------------------------------
# References: dequantize in fp32, multiply in fp32, return x's dtype.
# --------------------------------------------------------------------------
def _check_ref_perm(op: str, perm, k: int) -> None:
    # On the CPU the values are checked; on a GPU (the reference standing in for a missing build) reading
    # them back would synchronize, which a CUDA-graph capture forbids: index_select's own bounds check stays.
    if perm is not None and perm.device.type == "cpu":
        check_perm_values(op, perm, k)


def ref_matmul(x: torch.Tensor, w: torch.Tensor, perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The references' product: x [..., K] (gathered by perm) @ w [N, K] (float32, dequantized) in float32,
    returned in x's dtype."""
    if perm is not None:
        x = x.index_select(-1, perm)
    y = x.to(torch.float32) @ w.t()
    return y.to(x.dtype)


def ref_linear_int8(x, qweight, scales, in_features, perm=None):
    """Reference for qgemv::linear_int8; x [..., K] -> [..., N] in x.dtype."""
    check_linear_int8(x, qweight, scales, in_features, perm)
    _check_ref_perm("linear_int8", perm, in_features)
    return ref_matmul(x, formats.dequantize_int8(qweight, scales, in_features), perm)


def ref_linear_int4(x, qweight, scales, in_features, perm=None):
    """Reference for qgemv::linear_int4 (per-channel, symmetric)."""
    check_linear_int4(x, qweight, scales, in_features, perm=perm)
    _check_ref_perm("linear_int4", perm, in_features)
    return ref_matmul(x, formats.dequantize_int4(qweight, scales, None, None, in_features), perm)


def ref_linear_int4_grouped(x, qweight, scales, zeros, group_size, in_features, perm=None):
    """Reference for qgemv::linear_int4_grouped."""
    check_linear_int4(x, qweight, scales, in_features, zeros, group_size, op="linear_int4_grouped", perm=perm)
    _check_ref_perm("linear_int4_grouped", perm, in_features)
    w = formats.dequantize_int4(qweight, scales, zeros, group_size, in_features)
    return ref_matmul(x, w, perm)


def ref_sgemv(A, x, kernel=0):
    """Reference for qgemv::sgemv: y[N] = A[N, K] @ x[K] in fp32."""
    check_sgemv(A, x, kernel)
    return A @ x


def ref_add_rms_gather(x, delta, weight, perm, eps):
    """Reference for qgemv::add_rms_gather: (s, (rms(s) * weight)[..., perm]) with s = x + delta.

    rms is transformers' LlamaRMSNorm, operation for operation: fp32
    statistics, the normalized value cast back to x's dtype, then the gain.
    """
    check_add_rms_gather(x, delta, weight, perm, eps)
    _check_ref_perm("add_rms_gather", perm, x.shape[-1])
    s = x + delta
    f = s.float()
    n = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return s, (weight * n).index_select(-1, perm)


def ref_decode_attention(q, k_cache, v_cache, slot, pad, scale, splits=0):
    """Reference for qgemv::decode_attention, in fp32: softmax(q k^T scale) v over each sequence's visible
    cache slots, pad[b] .. slot[0] (both clamped into the cache), each query head h against kv head
    h // (heads / kv_heads).  The slots outside are never read into the result (a NaN there stays out).
    splits only shapes the CUDA kernel's work.  Returns [batch, heads, head_dim] in q's dtype."""
    check_decode_attention(q, k_cache, v_cache, slot, pad, scale, splits)
    B, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    s = slot.reshape(-1)[:1].clamp(0, S - 1)  # a tensor: no read back, so a CUDA graph can hold it
    p = torch.minimum(pad.clamp(min=0), s)
    keys = torch.arange(S, device=q.device)
    visible = (keys[None] <= s) & (keys[None] >= p[:, None])  # [B, S]
    vis = visible[:, None, :, None]
    k = k_cache.float().masked_fill(~vis, 0.0).repeat_interleave(H // Hkv, dim=1)  # [B, H, S, D]
    v = v_cache.float().masked_fill(~vis, 0.0).repeat_interleave(H // Hkv, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v).to(q.dtype)


def ref_rope_decode_attention(q, k, v, k_cache, v_cache, slot, pad, cos, sin, q_norm, k_norm, eps, scale,
                              splits=0):
    """Reference for qgemv::rope_decode_attention: the token's query / key heads normalized by q_norm / k_norm
    when given (transformers' RMSNorm: fp32 statistics, rounded to the dtype, times the gain), rotated at
    position max(slot - pad[b], 0) (x cos + rotate_half(x) sin in fp32, rounded once), its key and value
    written into k_cache / v_cache at the slot (in place), then :func:`ref_decode_attention` with them."""
    check_rope_decode_attention(q, k, v, k_cache, v_cache, slot, pad, cos, sin, q_norm, k_norm, eps, scale, splits)
    S, D = k_cache.shape[2], q.shape[2]
    s = slot.reshape(-1)[:1].clamp(0, S - 1)
    pos = s - torch.minimum(pad.clamp(min=0), s)  # [B]

    def norm(x, w):
        if w is None:
            return x
        f = x.float()
        return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    c, sn = cos[pos].float()[:, None], sin[pos].float()[:, None]  # [B, 1, D]

    def rope(x):
        f = x.float()
        return (f * c + torch.cat((-f[..., D // 2:], f[..., :D // 2]), -1) * sn).to(x.dtype)

    k_cache.index_copy_(2, s, rope(norm(k, k_norm))[:, :, None])
    v_cache.index_copy_(2, s, v[:, :, None])
    return ref_decode_attention(rope(norm(q, q_norm)), k_cache, v_cache, slot, pad, scale, splits)


for _name, _ref in (
    ("linear_int8", ref_linear_int8),
    ("linear_int4", ref_linear_int4),
    ("linear_int4_grouped", ref_linear_int4_grouped),
    ("sgemv", ref_sgemv),
    ("add_rms_gather", ref_add_rms_gather),
    ("decode_attention", ref_decode_attention),
    ("rope_decode_attention", ref_rope_decode_attention),
):
    torch.library.impl(f"qgemv::{_name}", "cpu")(_ref)


# --------------------------------------------------------------------------
# Fakes: the same checks, then an empty result of the right shape.
# --------------------------------------------------------------------------
@torch.library.register_fake("qgemv::linear_int8")
def _fake_linear_int8(x, qweight, scales, in_features, perm=None):
    check_linear_int8(x, qweight, scales, in_features, perm)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.register_fake("qgemv::linear_int4")
def _fake_linear_int4(x, qweight, scales, in_features, perm=None):
    check_linear_int4(x, qweight, scales, in_features, perm=perm)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.register_fake("qgemv::linear_int4_grouped")
def _fake_linear_int4_grouped(x, qweight, scales, zeros, group_size, in_features, perm=None):
    check_linear_int4(x, qweight, scales, in_features, zeros, group_size, op="linear_int4_grouped", perm=perm)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.register_fake("qgemv::sgemv")
def _fake_sgemv(A, x, kernel=0):
    check_sgemv(A, x, kernel)
    return A.new_empty((A.shape[0],))


@torch.library.register_fake("qgemv::add_rms_gather")
def _fake_add_rms_gather(x, delta, weight, perm, eps):
    check_add_rms_gather(x, delta, weight, perm, eps)
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.register_fake("qgemv::decode_attention")
def _fake_decode_attention(q, k_cache, v_cache, slot, pad, scale, splits=0):
    check_decode_attention(q, k_cache, v_cache, slot, pad, scale, splits)
    return q.new_empty(q.shape)


@torch.library.register_fake("qgemv::rope_decode_attention")
def _fake_rope_decode_attention(q, k, v, k_cache, v_cache, slot, pad, cos, sin, q_norm, k_norm, eps, scale,
                                splits=0):
    check_rope_decode_attention(q, k, v, k_cache, v_cache, slot, pad, cos, sin, q_norm, k_norm, eps, scale, splits)
    return q.new_empty(q.shape)


REFERENCES = {
    "linear_int8": ref_linear_int8,
    "linear_int4": ref_linear_int4,
    "linear_int4_grouped": ref_linear_int4_grouped,
    "sgemv": ref_sgemv,
    "add_rms_gather": ref_add_rms_gather,
    "decode_attention": ref_decode_attention,
    "rope_decode_attention": ref_rope_decode_attention,
}


# --------------------------------------------------------------------------
# Python API.
# --------------------------------------------------------------------------
def check_cuda_pointers(op: str, **tensors) -> None:
    """The kernels load qweight with 16-byte accesses and scales as 2-byte halves.

    A view at another offset would fault inside the kernel ("misaligned
    address"), which poisons the CUDA context for the whole process.
    """
    for name, (t, align) in tensors.items():
        if t is not None and t.data_ptr() % align:
            _fail(op, f"{name} must start on a {align}-byte boundary (its data pointer is {t.data_ptr() % align} "
                      f"bytes past one, storage offset {t.storage_offset()} elements); pass {name}.clone()")


def _precheck_cuda(*tensors) -> bool:
    """Whether the wrapper runs the reference's checks itself before calling a CUDA kernel.

    On torch 2.11 (the lent H200) an exception thrown inside the extension's
    kernels killed the process with a segmentation fault instead of reaching
    Python (issue 20; not seen with torch 2.14 on the CPU build).  So for
    CUDA tensors every check the CPU path makes runs here first, in Python,
    with the same messages; the C++ checks stay behind them for direct
    torch.ops.qgemv calls.  Under torch.compile the fake kernel makes the same
    checks at trace time.
    """
    return any(t is not None and t.is_cuda for t in tensors) and not torch.compiler.is_compiling()


_PERM_DOC = """perm: optional int32 [K], a permutation of 0..K-1 (act-order): the op
            computes x[..., perm] @ W^T.  Checked here on every call (on a GPU
            that reads perm back); :class:`qgemv.QuantLinear` checks it once."""


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, in_features: int,
                perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for the int8 per-channel format.

    Args:
        x: [..., K] float16, bfloat16 or float32, K == in_features.
        qweight: int8 [N, round_up(K, 16)] from :func:`qgemv.formats.quantize_int8`.
        scales: float16 [N].
        in_features: K, the width the weight was packed for (a multiple of 8).
        {perm}
    Returns:
        [..., N] in x.dtype, accumulated in fp32.
    """
    if _precheck_cuda(x, qweight, scales, perm):
        check_linear_int8(x, qweight, scales, in_features, perm)
        check_perm_values("linear_int8", perm, in_features)
        check_cuda_pointers("linear_int8", qweight=(qweight, 16), scales=(scales, 2), perm=(perm, 16))
    return torch.ops.qgemv.linear_int8(x, qweight, scales, in_features, perm)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, in_features: int,
                perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for the int4 per-channel symmetric format.

    Args:
        x: [..., K] float16, bfloat16 or float32, K == in_features.
        qweight: int32 [N, round_up(K, 32) / 8] from :func:`qgemv.formats.quantize_int4`.
        scales: float16 [N].
        in_features: K, the width the weight was packed for (a multiple of 8).
        {perm}
    Returns:
        [..., N] in x.dtype, accumulated in fp32.
    """
    if _precheck_cuda(x, qweight, scales, perm):
        check_linear_int4(x, qweight, scales, in_features, perm=perm)
        check_perm_values("linear_int4", perm, in_features)
        check_cuda_pointers("linear_int4", qweight=(qweight, 16), scales=(scales, 2), perm=(perm, 16))
    return torch.ops.qgemv.linear_int4(x, qweight, scales, in_features, perm)


def linear_int4_grouped(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    group_size: int,
    in_features: int,
    perm: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y = x @ dequant(W)^T for the group-wise int4 format.

    Args:
        x: [..., K] float16, bfloat16 or float32, K == in_features.
        qweight: int32 [N, round_up(K, 32) / 8].
        scales: float16 [N, K / group_size].
        zeros: uint8 [N, K / group_size] zero points in [0, 15], or None for symmetric (zero 8).
        group_size: 32, 64 or 128, dividing K.
        in_features: K, the width the weight was packed for.
        {perm}
    Returns:
        [..., N] in x.dtype, accumulated in fp32.
    """
    if _precheck_cuda(x, qweight, scales, zeros, perm):
        check_linear_int4(x, qweight, scales, in_features, zeros, group_size, op="linear_int4_grouped", perm=perm)
        check_perm_values("linear_int4_grouped", perm, in_features)
        check_cuda_pointers("linear_int4_grouped", qweight=(qweight, 16), scales=(scales, 2), perm=(perm, 16))
    return torch.ops.qgemv.linear_int4_grouped(x, qweight, scales, zeros, group_size, in_features, perm)


for _f in (linear_int8, linear_int4, linear_int4_grouped):
    _f.__doc__ = _f.__doc__.replace("{perm}", _PERM_DOC)
_WRAPPERS = {f.__name__: f for f in (linear_int8, linear_int4, linear_int4_grouped)}


def op_for(w) -> tuple:
    """(op name, its arguments after x and before perm) for a packed weight w: the one place that maps a
    format to its op (int8 -> linear_int8, int4 per channel -> linear_int4, int4 groups -> linear_int4_grouped)."""
    c = w.config
    if c.bits == 8:
        return "linear_int8", (w.qweight, w.scales, w.in_features)
    if c.group_size is None:
        return "linear_int4", (w.qweight, w.scales, w.in_features)
    return "linear_int4_grouped", (w.qweight, w.scales, w.zeros, c.group_size, w.in_features)


def check_linear(x: torch.Tensor, w, perm: Optional[torch.Tensor] = None) -> None:
    """The checks of w's op (shapes, dtypes, devices; not perm's values), with its messages."""
    name, args = op_for(w)
    if name == "linear_int4_grouped":
        qweight, scales, zeros, group_size, k = args
        check_linear_int4(x, qweight, scales, k, zeros, group_size, op=name, perm=perm)
    else:
        (check_linear_int8 if name == "linear_int8" else check_linear_int4)(x, *args, perm=perm)


def linear(x: torch.Tensor, w, perm: Optional[torch.Tensor] = None, checked: bool = False) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T for a packed weight of any qgemv format.

    Args:
        x: [..., K] float16, bfloat16 or float32, K == w.in_features.
        w: a :class:`qgemv.PackedWeight` (or anything with its qweight, scales, zeros, config and
            in_features, such as a QuantLinear).
        perm: optional int32 [K]: compute x[..., perm] @ W^T (w.perm as int32; the caller passes it, so
            that a caller that gathered x already passes None).
        checked: the caller ran :func:`check_linear` on these tensors already (QuantLinear does, once per
            change of its buffers): call the op without the wrappers' per-call checks.
    Returns:
        [..., N] in x.dtype, accumulated in fp32.
    """
    name, args = op_for(w)
    op = getattr(torch.ops.qgemv, name) if checked else _WRAPPERS[name]
    return op(x, *args, perm)


def sgemv(A: torch.Tensor, x: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """fp32 y[N] = A[N, K] @ x[K] with the seed's warp-per-row kernels.

    kernel: "auto" (by K: k16 for K <= 16, k128 when K % 4 == 0 and the data
    are 16-byte aligned, else k32), or "k32", "k128", "k16" to force one.
    """
    codes = {"auto": 0, "k32": 1, "k128": 2, "k16": 3}
    if kernel not in codes:
        raise ValueError(f"qgemv.sgemv: kernel must be one of {sorted(codes)}, got {kernel!r}")
    if _precheck_cuda(A, x):
        check_sgemv(A, x, codes[kernel])
    return torch.ops.qgemv.sgemv(A, x, codes[kernel])


def add_rms_gather(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor,
                   eps: float, checked: bool = False) -> tuple:
    """Residual add and RMSNorm with the normalized row gathered by an act-order perm, in one kernel.

    Args:
        x, delta: [..., H] float16, bfloat16 or float32 (one dtype), 1 <= H <= 16384.
        weight: [H] in x's dtype, the norm's gain.
        perm: int32 [H], a permutation of 0..H-1 (checked on every call, which
            on a GPU reads it back).
        eps: the norm's epsilon, >= 0.
        checked: the caller has checked these inputs once already (the
            generation engine, whose perm is its QuantLinear's, checked at
            prefill): no checks, so the call can be captured in a CUDA graph.
    Returns:
        (s, y), both [..., H] in x's dtype: s = x + delta, and
        y = (weight * rms(s))[..., perm] with rms(s) = s / sqrt(mean(s^2) + eps)
        in fp32, cast to x's dtype before the gain (transformers' LlamaRMSNorm).
    """
    if not checked and _precheck_cuda(x, delta, weight, perm):  # (the CPU reference checks the same itself)
        check_add_rms_gather(x, delta, weight, perm, eps)
        check_perm_values("add_rms_gather", perm, x.shape[-1])
    return torch.ops.qgemv.add_rms_gather(x, delta, weight, perm, eps)


def _check_decode_attention_layout(q, k_cache, v_cache, op="decode_attention") -> None:
    """The CUDA kernel's layout rules (its own checks, in Python first: see _precheck_cuda)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        _fail(op, f"q must be float16 or bfloat16, got {q.dtype}")
    if q.stride(2) != 1:
        _fail(op, f"q's head_dim must be contiguous (stride 1), got strides {list(q.stride())}")
    D = q.shape[2]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        st = c.stride()
        if st[3] != 1 or st[2] != D or st[1] % 8 or st[0] % 8:
            _fail(op, f"{name} must have contiguous rows and batch / head strides that are multiples of 8, got "
                      f"strides {list(st)}")
        if c.data_ptr() % 16:
            _fail(op, f"{name} must start on a 16-byte boundary (pass a contiguous cache)")
    if v_cache.stride() != k_cache.stride():
        _fail(op, f"v_cache must have k_cache's strides {list(k_cache.stride())}, got {list(v_cache.stride())}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                     pad: torch.Tensor, scale: float, splits: int = 0, checked: bool = False) -> torch.Tensor:
    """One decode step's attention: each sequence's query token against its visible cache slots only.

    Args:
        q: [batch, heads, head_dim] float16 or bfloat16 (float32 on the CPU),
            the query rows after RoPE; head_dim 64, 96 or 128 and contiguous.
        k_cache, v_cache: [batch, kv_heads, max_seq, head_dim] in q's dtype,
            contiguous rows (the engine's per-layer cache views); heads must
            be kv_heads times 1..16 (query head h reads kv head
            h // (heads / kv_heads)).
        slot: int64, >= 1 element on q's device: element 0 is the step's
            cache slot, where its own key and value have been written.
        pad: int64 [batch] on q's device: sequence b's slots before pad[b]
            are left padding and not attended.
        scale: the softmax scale (head_dim ** -0.5 for Llama).
        splits: 0 chooses; 1..64 cuts each sequence's keys into that many
            shares merged by a second kernel (tests force it).
        checked: the caller has checked these inputs once already (the
            engine): no Python checks, so the call can sit in a CUDA graph.
    Returns:
        [batch, heads, head_dim] in q's dtype.  The CUDA kernel reads only
        slots pad[b] .. slot (slot and pad clamped into the cache), so its
        cost follows the context, not max_seq; fp32 softmax, the
        probabilities rounded to q's dtype before they meet V (flash
        attention's rounding).
    """
    if not checked and _precheck_cuda(q, k_cache, v_cache):  # (the CPU reference checks the same itself)
        check_decode_attention(q, k_cache, v_cache, slot, pad, scale, splits)
        _check_decode_attention_layout(q, k_cache, v_cache)
    return torch.ops.qgemv.decode_attention(q, k_cache, v_cache, slot, pad, scale, splits)


def rope_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor],
                          eps: float, scale: float, splits: int = 0, checked: bool = False) -> torch.Tensor:
    """One decode step's attention from the token's projections: what the engine's glue and
    :func:`decode_attention` did in two kernels, in one.

    Args:
        q: [batch, heads, head_dim], k / v: [batch, kv_heads, head_dim], the token's query, key and value
            heads as the q/k/v projection wrote them (before any norm or rotation); float16 or bfloat16
            (float32 on the CPU), head_dim contiguous, each starting on a 16-byte boundary with batch and
            head strides that are multiples of 8 (views of the fused projection's output are fine; k and v
            with the same strides).
        k_cache, v_cache: as :func:`decode_attention`; the token's rotated key and its value are written
            at the slot, in place.
        slot, pad, scale, splits, checked: as :func:`decode_attention`.
        cos, sin: [>= max_seq, head_dim] in q's dtype, contiguous: row p is the rotation at position p;
            sequence b's token sits at position max(slot - pad[b], 0).
        q_norm, k_norm: [head_dim] in q's dtype, both or neither: each query / key head's RMSNorm gain
            (Qwen3), applied before the rotation with epsilon ``eps``.
    Returns:
        [batch, heads, head_dim] in q's dtype.  The rotation is x cos + rotate_half(x) sin in fp32, rounded
        once to the dtype (as the engine's compiled glue computes it); the norms as transformers'
        RMSNorm.
    """
    if not checked and _precheck_cuda(q, k_cache, v_cache):
        check_rope_decode_attention(q, k, v, k_cache, v_cache, slot, pad, cos, sin, q_norm, k_norm, eps, scale,
                                    splits)
        op = "rope_decode_attention"
        _check_decode_attention_layout(q, k_cache, v_cache, op=op)
        if k.stride(2) != 1 or v.stride() != k.stride():
            _fail(op, f"k and v must have a contiguous head_dim and the same strides, got {list(k.stride())} and "
                      f"{list(v.stride())}")
        for name, t in (("q", q), ("k", k), ("v", v)):  # (16-byte loads of 8 dims)
            if t.data_ptr() % 16 or t.stride(0) % 8 or t.stride(1) % 8:
                _fail(op, f"{name} must start on a 16-byte boundary with batch / head strides that are multiples "
                          f"of 8, got strides {list(t.stride())}")
        for name, t in (("cos", cos), ("sin", sin), ("q_norm", q_norm), ("k_norm", k_norm)):
            if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
                _fail(op, f"{name} must be contiguous and start on a 16-byte boundary")
    return torch.ops.qgemv.rope_decode_attention(q, k, v, k_cache, v_cache, slot, pad, cos, sin, q_norm, k_norm,
                                                 eps, scale, splits)


__all__ = [
    "add_rms_gather",
    "decode_attention",
    "rope_decode_attention",
    "check_linear",
    "linear",
    "op_for",
    "linear_int8",
    "linear_int4",
    "linear_int4_grouped",
    "sgemv",
    "REFERENCES",
    "ref_linear_int8",
    "ref_linear_int4",
    "ref_linear_int4_grouped",
    "ref_sgemv",
    "ref_add_rms_gather",
    "ref_decode_attention",
    "ref_rope_decode_attention",
]
