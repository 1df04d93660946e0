"""Decoder layers' linears as one persistent launch (issue 35, stage 1).

    chain = qgemv.persist.PersistentChain(layers)      # [(qkv, o, gate_up, down) PackedWeight, ...]
    y = chain(x)                                       # x [1, H] float16 -> [1, H] float16 (or bfloat16: dtype=)
    chain = qgemv.persist.PersistentChain(layers, norms=gains, eps=1e-5)   # with each layer's two RMSNorms

One kernel launch runs every linear of every layer: each block streams its
share of the next linear's weights into shared memory while the previous
linear's outputs are still being written, and every activation reads 0xffff
until it is written, so a block starts on an input as soon as the values it
reads are there (no kernel boundary, no grid barrier; csrc/persist_chain.cuh,
form 20; dev/PERSISTENT.md has the design and its measurements).

    chain = qgemv.persist.PersistentChain(layers, norms=gains, attention=qgemv.persist.Attention(...))
    y = chain(x, position=slot)                        # the whole decoder at one token, its KV cache updated

Each layer is the decode step's linears with their glue and a stand-in for
attention (o reads the first H outputs of q/k/v):

    q = qkv(n1(x));  h = o(q[:, :H]) + x;  a = silu(g) * u  for (g, u) = gate_up(n2(h));  x' = down(a) + h

where n1 and n2 are the layer's RMSNorms when ``norms`` is given (the
identity otherwise), computed inside the launch where each block reads the
linear's input: n(v) = round(gain * round(v * rsqrt(mean(v^2) + eps))), the
rounding of transformers' LlamaRMSNorm.  Every result is rounded to float16 (bfloat16)
as the per-op chain rounds it (:func:`reference` is that chain, one qgemv
kernel a linear).  gate_up holds gate's rows, then up's (a qgemv
checkpoint's fused gate/up).

With ``attention`` (:class:`Attention`, stage 2) the stand-in is the real
attention: q/k/v's finishing rotates q and k (RoPE at the token's position,
a device scalar read by every launch, so one CUDA graph serves every step)
and writes k and v into the cache at that slot; then the blocks run the
attention over the cache in (kv head, context split) units and merge the
splits into o's input (:func:`attend` is its reference).

With ``head`` (:class:`Head`, needs ``norms``) the launch also runs the
model's end: the final RMSNorm of the last layer's output, lm_head (a 16-bit
weight of the activations' type, read in place) into :attr:`PersistentChain.logits`
(float32, each rounded to the activations' type as the per-op lm_head's
output is) and the greedy argmax into :attr:`PersistentChain.token` (the
lowest index of the largest logit, as torch.argmax).

Supported: int4 per channel, int4 G = 32, 64, 128 with or without zero
points, int8 (with act-order perms too: each such op gathers its input
inside the launch, K <= 32767), and float16 / bfloat16 weights (a tensor of
the activations' type [N, K] in place of a PackedWeight: the baseline's
chain, re-laid in 16-row panels of 64-byte tiles); float16 or bfloat16
activations (``dtype``: every buffer, gain, cache and rotary table in it;
bf16 inputs of int4 / int8 weights are staged as fp16 of x 2^e inside the
launch, exact for every value in fp16's range), one token, compute capability 9.x,
K % 8 == 0 and N % 16 == 0 (gate_up: % 32).  A K that is not a multiple of
the kernel's tile (128 int4, 64 int8, 32 fp16 inputs) is padded with zero
weights once, in the chain's copy (:func:`pad_inputs`); the launch reads the
padded inputs as zeros.  The engine runs it for batch-1 decode steps wherever
it can (``Engine(megakernel=None)``, the default; dev/PERSISTENT.md has its
measurements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _ext
from .weight import PackedWeight

FORMATS = ("int4", "int4g128", "int4g128a", "int4g64", "int4g64a", "int4g32", "int4g32a", "int8",
           "fp16", "bf16")  # "fp16" / "bf16": a float16 / bfloat16 [N, K] tensor, not a PackedWeight
DTYPES = (torch.float16, torch.bfloat16)  # the activations' types
# The lab's best settings on the H200 (dev/PERSISTENT.md): 16 warps a block, 8 ring slots of 1 KB tiles a warp.
DEFAULT_WARPS = 16
DEFAULT_STAGES = 8

Weight = Union[PackedWeight, torch.Tensor]  # a tensor: float16 / bfloat16 [N, K] weights
Layer = Tuple[Weight, Weight, Weight, Weight]
Norms = Tuple[torch.Tensor, torch.Tensor]  # a layer's (input, post-attention) RMSNorm gains [H], activations' type


class PersistError(ValueError):
    """A chain the persistent kernel cannot run; the message names the layer, the linear and the rule."""


@dataclass
class Attention:
    """The layers' attention inside the launch (stage 2 of issue 35): RoPE, the KV-cache write, attention.

    heads / kv_heads / head_dim: the model's (heads a multiple of kv_heads, at most 8 query heads a kv head and
    no more than the block's warps; head_dim 32, 64 or 128).  Every tensor is of the chain's activation type
    ("A": float16, or bfloat16 with ``PersistentChain(dtype=torch.bfloat16)``).  cos / sin: A [S, head_dim], the
    model's rotary tables (cos[p, f] == cos[p, f + head_dim / 2], as transformers' rotary modules make them);
    k_cache / v_cache: A [layers, kv_heads, S, head_dim], contiguous: the launch writes each layer's k (rotated)
    and v at the token's slot and reads slots 0..slot.  scale: the scores' scale (default head_dim ** -0.5);
    splits: the most cache splits a kv head (default blocks // kv_heads: one unit a block); the launch splits a
    context only past 8 positions a warp (one split of L positions: no merge across blocks).  qkv_bias: A
    [layers, (heads + 2 kv_heads) head_dim], contiguous, or None: each layer's q/k/v bias (Qwen2), in the
    natural row order, added to q/k/v's rounded output (and rounded) before the rotation, as the per-op linear
    adds it.  q_norm / k_norm: A [layers, head_dim], contiguous, or None (both): each layer's RMSNorm gain of
    every q / k head (Qwen3), applied before the rotation with epsilon ``qk_eps``.  per_warp: cache positions a
    warp of a unit before the launch splits a context across blocks (1..64, default 2): fewer split shorter
    contexts sooner, at the cost of the splits' merge.
    The token's slot is its rotary position (one sequence, no padding).
    """

    heads: int
    kv_heads: int
    head_dim: int
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: Optional[float] = None
    splits: Optional[int] = None
    qkv_bias: Optional[torch.Tensor] = None
    q_norm: Optional[torch.Tensor] = None
    k_norm: Optional[torch.Tensor] = None
    qk_eps: float = 1e-6
    per_warp: Optional[int] = None

    @property
    def max_seq(self) -> int:
        return self.cos.shape[0]


@dataclass
class Head:
    """The model's end inside the launch: the final RMSNorm, lm_head and the greedy argmax.

    weight: lm_head's weight, [vocab, H] of the chain's activation type, on the chain's device (no bias; K = H
    a multiple of 8; read in place when contiguous, else copied once); gain: the final RMSNorm's gain, [H] of that type; eps: its
    epsilon.  The launch writes logits (float32 [1, vocab]: round(weight @ n(x)) widened, n the norm as the
    layers' norms round it) and the token (int64 [1]: the lowest index of the largest logit).
    """

    weight: torch.Tensor
    gain: torch.Tensor
    eps: float = 1e-5


def rope_rows(heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The q/k/v rows' order in the launch (int64 [(heads + 2 kv_heads) head_dim]): permuted row i is natural
    row rope_rows[i].  Each 16-row panel of a q or k head holds 8 rotation pairs (rows 8j..8j+7 and
    head_dim/2 + 8j..+7 of the head), so that one panel's finishing rotates them; v keeps its order."""
    d, half = head_dim, head_dim // 2
    j = torch.arange(half // 8).repeat_interleave(16)
    r = torch.arange(16).repeat(half // 8)
    within = torch.where(r < 8, 8 * j + r, half + 8 * j + r - 8)
    qk = (torch.arange(heads + kv_heads)[:, None] * d + within[None, :]).reshape(-1)
    v = (heads + kv_heads) * d + torch.arange(kv_heads * d)
    return torch.cat([qk, v])


def permute_rows(w: Weight, rows: torch.Tensor) -> Weight:
    """w with its output rows in the order ``rows``, on w's device (exact; packed: :func:`qgemv.shard.gather_rows`,
    still packed)."""
    from .shard import gather_rows

    if isinstance(w, torch.Tensor):
        return w[rows.to(w.device)]
    return gather_rows(w, rows, "q/k/v")


def _shape(w: Weight) -> Tuple[int, int]:
    """(N, K) of a weight."""
    return (w.shape[0], w.shape[1]) if isinstance(w, torch.Tensor) else (w.out_features, w.in_features)


def _format_name(w: Weight) -> str:
    if isinstance(w, torch.Tensor):
        return "bf16" if w.dtype == torch.bfloat16 else "fp16"
    return w.format


def _linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x @ w^T: qgemv's kernel for a PackedWeight, torch's for float16 / bfloat16 weights."""
    from .ops import linear

    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w)
    return linear(x, w, None if w.perm is None else w.perm.to(device=x.device, dtype=torch.int32))


def attend(at: Attention, layer: int, qkv: torch.Tensor, position: int) -> torch.Tensor:
    """The reference for one layer's attention at ``position``: q/k/v output [1, (H + 2 Hkv) D] (float16 or
    bfloat16) -> [1, H D] of the same type; writes k (rotated) and v into at's caches at the position (float32
    math, as the kernel)."""
    from .engine import apply_rope  # the engine's RoPE, here in float32 and rounded once

    h, hk, d = at.heads, at.kv_heads, at.head_dim
    dt = qkv.dtype
    f = qkv[0].float()
    c, s = at.cos[position].float(), at.sin[position].float()
    qh, kh = f[:h * d].view(h, d), f[h * d:(h + hk) * d].view(hk, d)
    if at.q_norm is not None:  # Qwen3: each head's RMSNorm, rounded as transformers rounds it
        qh = rms_norm(qh.to(dt), at.q_norm[layer], at.qk_eps).float()
        kh = rms_norm(kh.to(dt), at.k_norm[layer], at.qk_eps).float()
    q = apply_rope(qh, c, s).to(dt)
    k = apply_rope(kh, c, s).to(dt)
    at.k_cache[layer, :, position] = k
    at.v_cache[layer, :, position] = f[(h + hk) * d:].view(hk, d).to(dt)
    keys = at.k_cache[layer, :, :position + 1].float()  # [Hkv, L, D]
    vals = at.v_cache[layer, :, :position + 1].float()
    scale = at.scale if at.scale is not None else d ** -0.5
    scores = torch.einsum("hgd,hld->hgl", q.float().view(hk, h // hk, d), keys) * scale
    return torch.einsum("hgl,hld->hgd", scores.softmax(-1), vals).reshape(1, h * d).to(dt)


# persist_chain.cuh's kChainAttnChunk (cache positions a chunk; the octet rule takes units of 4 chunks or more) and
# kChainAttnPerWarp (a unit's positions a warp by default)
_CHAIN_ATTN_CHUNK = 32
_CHAIN_ATTN_PER_WARP = 2


def _module():
    mod = _ext.MODULE
    if mod is None or not hasattr(mod, "persist"):
        raise PersistError(f"qgemv.persist needs the CUDA extension built from this version ({_ext.REASON or 'stale build'})")
    return mod.persist


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """round(gain * round(x * rsqrt(mean(x^2) + eps))) over the last dim (float32 inside, as transformers'
    LlamaRMSNorm): x [..., H], gain [H] (float16 or bfloat16, both one type) -> [..., H] of that type."""
    from .engine import rms_norm as engine_rms_norm

    return engine_rms_norm(x, gain, eps)


def reference(layers: Sequence[Layer], x: torch.Tensor, norms: Optional[Sequence[Norms]] = None,
              eps: float = 1e-5, attention: Optional[Attention] = None, position: int = 0) -> torch.Tensor:
    """The same chain one qgemv kernel a linear, with the glue in torch: x [1, H] float16 or bfloat16 -> [1, H]
    of x's type (every rounding to it).
    With ``attention``: each layer's attention at ``position`` (:func:`attend`; it writes the caches) between
    q/k/v and o, in the weights' natural row order."""
    for li, (qkv, o, gate_up, down) in enumerate(layers):
        q = _linear(rms_norm(x, norms[li][0], eps) if norms else x, qkv)
        if attention is not None and attention.qkv_bias is not None:
            q = q + attention.qkv_bias[li]
        a = attend(attention, li, q, position) if attention is not None else q[:, :_shape(o)[1]]
        h = _linear(a, o) + x
        gu = _linear(rms_norm(h, norms[li][1], eps) if norms else h, gate_up).float()
        inter = gu.shape[-1] // 2
        a = (torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]).to(x.dtype)
        x = _linear(a, down) + h
    return x


TILE_K = {4: 128, 8: 64, 16: 32}  # inputs a kernel tile covers, by weight bits


def pad_inputs(w: Weight, k: int) -> Weight:
    """w [N, K] with its inputs padded to k >= K by exact zero weights (the launch's tiles cover whole multiples
    of :data:`TILE_K`; it reads inputs K .. k - 1 as zeros): int4 per channel the code 8, grouped int4 the code 0
    with scale 0 (and zero point 0) in the padded groups (K a multiple of G, k of 128), int8 the code 0, fp16
    0.  An act-order perm stays as it is ([K]: the stored inputs it indexes are the first K).  w itself when
    k == K."""
    from . import formats

    n, kw = _shape(w)
    if k == kw:
        return w
    if k < kw:
        raise PersistError(f"pad_inputs: k {k} is below the weight's K {kw}")
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.pad(w, (0, k - kw))
    codes, bits, g = w.codes(), w.config.bits, w.config.group_size
    if bits == 8:
        return PackedWeight(formats.pack_int8(torch.nn.functional.pad(codes, (0, k - kw))), w.scales, None, w.config,
                            k, w.perm)
    if g and (kw % g or k % g):
        raise PersistError(f"pad_inputs: K {kw} and k {k} must be multiples of the group size {g}")
    fill = 0 if g else 8  # per channel: (8 - 8) * s == 0; grouped: the padded groups' scale is 0
    q = formats.pack_int4(torch.nn.functional.pad(codes, (0, k - kw), value=fill))
    if not g:
        return PackedWeight(q, w.scales, None, w.config, k, w.perm)
    extra = (k - kw) // g
    scales = torch.nn.functional.pad(w.scales, (0, extra))
    zeros = None if w.zeros is None else torch.nn.functional.pad(w.zeros, (0, extra))
    return PackedWeight(q, scales, zeros, w.config, k, w.perm)


def tile_meta(w: PackedWeight) -> torch.Tensor:
    """A grouped int4 weight's (G = 32, 64 or 128) scales and zero points in the kernel's tile order: for each 1
    KB tile of the packed codes (N / 16 panels x K / 128 tiles, the panels' own order, which the launch reads in
    place), its 16 rows' scales of the tile's 128 / G groups (for each row g < 8 and group i, rows g and g + 8),
    then their zero points in the same order (csrc/persist_chain.cuh, chain_meta).  uint8 [tiles x meta bytes],
    built on w's device by torch (the extension's ``fuse``, on the CPU, is the test's reference: its tiles are
    the codes, each followed by this meta)."""
    n, k = w.out_features, w.in_features
    g = w.config.group_size
    if w.config.bits != 4 or g not in (32, 64, 128):
        raise PersistError(f"tile_meta: format {w.format}, expected grouped int4 (G = 32, 64 or 128)")
    if n % 16 or k % 128:
        raise PersistError(f"tile_meta: N must be a multiple of 16 and K of 128, got {n} x {k}")
    if w.qweight.numel() != n * k // 8 or w.scales.numel() != n * (k // g):
        raise PersistError(f"tile_meta: qweight / scales hold {w.qweight.numel()} / {w.scales.numel()} values, "
                           f"expected {n * k // 8} / {n * (k // g)}")
    panels, tiles, gpt = n // 16, k // 128, 128 // g

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        """[N, K / G] -> [panels x tiles, 8 (g), gpt (i), 2 (rows g, g + 8)]: a tile's values in meta order."""
        return t.reshape(panels, 2, 8, tiles, gpt).permute(0, 3, 2, 4, 1).reshape(panels * tiles, 8, gpt, 2)

    parts = [per_tile(w.scales.contiguous().view(torch.int16)).contiguous().view(torch.uint8).reshape(
        panels * tiles, 32 * gpt)]
    if w.zeros is not None:
        parts.append(per_tile(w.zeros.contiguous()).reshape(panels * tiles, 16 * gpt))
    return torch.cat(parts, dim=1).reshape(-1)  # (16 gpt (2 or 3) bytes a tile: whole 16-byte units)


def norm_gain(gain: torch.Tensor, perm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An RMSNorm gain as the launch reads it: A [K + 8], the gain's K values (in ``perm``'s order when given:
    an act-order op's stored order), then max|gain| as an fp32 in the first 4 bytes of the last 16 (the
    hand-offs of bf16 activations bound the normed input by it, a constant of the chain; NaNs ignored).
    gain: A [K], K a multiple of 8; perm: int [K] or None."""
    k = gain.numel()
    out = torch.zeros(k + 8, dtype=gain.dtype, device=gain.device)
    out[:k] = gain if perm is None else gain[perm.long()]
    out[k:k + 2].view(torch.float32).fill_(float(gain.float().abs().nan_to_num(nan=0.0).max()))
    return out


def _dt(dtype: torch.dtype) -> str:
    """float16 / bfloat16: a dtype as the messages name it."""
    return str(dtype).replace("torch.", "")


def _format_of(w: Weight, where: str) -> Tuple[int, int, bool]:
    """(bits, group, zeros) of one weight: 4 and its group (0 per channel, 32, 64, 128) for int4; 8, 0 for int8;
    16, 0 for float16 / bfloat16."""
    if isinstance(w, torch.Tensor):
        if w.dtype not in DTYPES or w.dim() != 2:
            raise PersistError(f"{where}: a tensor weight must be float16 or bfloat16 [N, K] (fp16 / bf16 weights), "
                               f"got {w.dtype} {list(w.shape)}")
        return 16, 0, False
    if not isinstance(w, PackedWeight):
        raise PersistError(f"{where}: expected a PackedWeight or a float16 / bfloat16 tensor, got {type(w).__name__}")
    if w.format not in FORMATS:
        raise PersistError(f"{where}: format {w.format} is not supported (supported: {', '.join(FORMATS)})")
    if w.perm is not None and w.in_features > 32767:
        raise PersistError(f"{where}: act-order weights need K <= 32767 (the launch reads the perm as int16), "
                           f"got {w.in_features}")
    return w.config.bits, w.config.group_size or 0, w.zeros is not None


class PersistentChain:
    """Every linear of ``layers`` in one persistent launch (module docstring: the chain it computes).

    Args:
        layers: per layer (qkv [Nqkv, H], o [H, H], gate_up [2 I, H], down [H, I]) on one CUDA device, all in
            one of :data:`FORMATS`: PackedWeight (int4, int8), or float16 / bfloat16 tensors ("fp16" / "bf16", of
            the activations' type); Nqkv >= H; gate_up: gate's rows, then up's.
        warps: warps a block (1-16); stages: ring slots a warp (an even number above 2).
        blocks: the grid (default: one block an SM; more than fit at once is refused, never hung).
        norms: per layer (input, post-attention) RMSNorm gains, [H] of the activations' type on the chain's
            device, or None (no norms), copied at construction (later changes to them are not seen); eps: their
            epsilon.
        attention: the layers' attention inside the launch (:class:`Attention`; needs ``norms``): o reads the
            attention's output [heads x head_dim] instead of the stand-in, q/k/v's rows are re-ordered for the
            rotation (on the CPU once), and each launch reads the token's slot from :attr:`position`.
        dtype: the activations' type, torch.float16 or torch.bfloat16 (default: tensor weights' own type, else
            float16); input, output, norms and every attention tensor are of it.
        head: the final RMSNorm, lm_head and the greedy argmax after the last layer (:class:`Head`; needs
            ``norms``): each launch writes :attr:`logits` and :attr:`token`, and :attr:`output` still holds the
            last layer's output.
    The weights are re-laid for the kernel once, into copies the chain keeps on the GPU (grouped int4: each 1
    KB tile with its scales and zero points, built on the CPU; fp16: 16-row panels; q/k/v with attention: its
    rows in rotation order); int4 per channel and int8 are read as they lie.  The chain keeps its own
    activation buffers, so calls on one chain must not overlap.
    """

    def __init__(self, layers: Sequence[Layer], *, warps: int = DEFAULT_WARPS, stages: int = DEFAULT_STAGES,
                 blocks: Optional[int] = None, norms: Optional[Sequence[Norms]] = None, eps: float = 1e-5,
                 attention: Optional[Attention] = None, dtype: Optional[torch.dtype] = None,
                 head: Optional[Head] = None):
        ps = _module()
        layers = [tuple(layer) for layer in layers]
        if not layers:
            raise PersistError("PersistentChain: no layers")
        if dtype is None:
            w0 = layers[0][0] if layers[0] else None
            dtype = w0.dtype if isinstance(w0, torch.Tensor) and w0.dtype in DTYPES else torch.float16
        if dtype not in DTYPES:
            raise PersistError(f"PersistentChain: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        fmt = None
        for li, layer in enumerate(layers):
            if len(layer) != 4:
                raise PersistError(f"layer {li}: expected 4 weights (qkv, o, gate_up, down), got {len(layer)}")
            for name, w in zip(("qkv", "o", "gate_up", "down"), layer):
                f = _format_of(w, f"layer {li} {name}")
                if isinstance(w, torch.Tensor) and w.dtype != dtype:
                    raise PersistError(f"layer {li} {name}: a {w.dtype} weight with {dtype} activations (tensor "
                                       f"weights are of the activations' type)")
                if fmt is None:
                    fmt = f
                elif f != fmt:
                    raise PersistError(f"layer {li} {name}: every weight must share one format, "
                                       f"got {_format_name(w)} after {_format_name(layers[0][0])}")
        qkv0, o0, gu0, down0 = layers[0]
        self.hidden, self.intermediate = _shape(o0)[0], _shape(gu0)[0] // 2
        dev = qkv0.device if isinstance(qkv0, torch.Tensor) else qkv0.qweight.device
        h, i = self.hidden, self.intermediate
        at = attention
        o_in = h if at is None else at.heads * at.head_dim
        for li, (qkv, o, gu, down) in enumerate(layers):
            nqkv = _shape(qkv)[0] if at is None else (at.heads + 2 * at.kv_heads) * at.head_dim
            shapes = {"qkv": (qkv, nqkv, h), "o": (o, h, o_in), "gate_up": (gu, 2 * i, h),
                      "down": (down, h, i)}
            for name, (w, n, k) in shapes.items():
                wn, wk = _shape(w)
                loose = name == "qkv" and at is None  # the stand-in reads q/k/v's first H outputs
                if (loose and (wn < h or wk != h)) or (not loose and (wn, wk) != (n, k)):
                    raise PersistError(f"layer {li} {name}: shape {wn} x {wk}, expected "
                                       f"{'>= ' + str(h) if loose else n} x {k}")
                wdev = w.device if isinstance(w, torch.Tensor) else w.qweight.device
                if wdev != dev:
                    raise PersistError(f"layer {li} {name}: on {wdev}, the chain is on {dev}")
                step = 32 if name == "gate_up" else 16
                if wn % step or wk % 8:
                    raise PersistError(f"layer {li} {name}: {wn} x {wk}: N must be a "
                                       f"multiple of {step} and K of 8")
        if dev.type != "cuda":
            raise PersistError(f"PersistentChain: the weights must be on a CUDA device, got {dev}")
        if norms is not None:
            norms = [tuple(n) for n in norms]
            if len(norms) != len(layers):
                raise PersistError(f"norms: {len(norms)} pairs of gains for {len(layers)} layers")
            for li, pair in enumerate(norms):
                if len(pair) != 2:
                    raise PersistError(f"norms[{li}]: expected 2 gains (input, post-attention), got {len(pair)}")
                for name, g in zip(("input", "post-attention"), pair):
                    if not isinstance(g, torch.Tensor) or g.dtype != dtype or g.shape != (h,) or \
                            g.device != dev:
                        raise PersistError(f"norms[{li}] {name}: must be {_dt(dtype)} [{h}] on {dev}, got "
                                           f"{getattr(g, 'dtype', type(g).__name__)} "
                                           f"{list(getattr(g, 'shape', []))} on {getattr(g, 'device', '-')}")
            if not (eps > 0.0):
                raise PersistError(f"eps must be positive, got {eps}")
        if at is not None:
            if norms is None:
                raise PersistError("attention: needs the layers' norms (norms=)")
            self._check_attention(at, len(layers), dev, dtype)
        if head is not None:
            if norms is None:
                raise PersistError("head: needs the layers' norms (norms=)")
            self._check_head(head, h, dev, dtype)
        self.bits, self.group, self.zeros = fmt
        self.format = _format_name(qkv0)
        self.device = dev
        self.layers = len(layers)
        self.warps, self.stages = warps, stages
        self.eps = float(eps)
        self.has_norms = norms is not None
        if blocks is None:
            blocks = torch.cuda.get_device_properties(dev).multi_processor_count
        self.blocks = blocks

        def buf(n: int) -> torch.Tensor:  # two copies of n 16-bit values, all 0xffff (not yet written)
            return torch.full((n,), -1, dtype=torch.int32, device=dev)

        self.attention = at
        # the token's cache slot (its rotary position), read by every launch: set it before run() (in place
        # inside a CUDA graph)
        self.position = torch.zeros(1, dtype=torch.int32, device=dev)
        attns = []
        if at is not None:
            self.splits = at.splits or max(1, blocks // at.kv_heads)
            rows = rope_rows(at.heads, at.kv_heads, at.head_dim)
        self.input = torch.zeros(1, h, dtype=dtype, device=dev)
        self.output = torch.zeros(1, h, dtype=dtype, device=dev)
        self._keep = []  # every tensor the op table points at
        self._acts = []  # the activation buffers inside the launch (two 16-bit copies each)
        self.weight_bytes = 0  # what one launch streams: the weights in the kernel's layout
        ops = []
        gains = []  # per op: its input's RMSNorm gain (a contiguous copy: 16-byte aligned) or 0
        x, x_plain = self.input, True
        for li, (qkv, o, gu, down) in enumerate(layers):
            last = li + 1 == len(layers)
            nq = _shape(qkv)[0]
            q, hh, a = buf(nq), buf(h), buf(i)
            plain_out = last and head is None  # with a head, every block reads the last output inside the launch
            nxt = self.output if plain_out else buf(h)
            self._keep += [q, hh, a, nxt]
            self._acts += [q, hh, a] + ([] if plain_out else [nxt])
            if at is not None:
                qkv = permute_rows(qkv.to(dev), rows)
            kp = [self._padded_k(w) for w in (qkv, o, gu, down)]  # each weight's K in whole tiles
            ws = [self._weight(w, k) for w, k in zip((qkv, o, gu, down), kp)]
            pm = [self._perm(w) for w in (qkv, o, gu, down)]  # act-order: int16 [K] on the device, or None
            pp = [0 if p is None else p.data_ptr() for p in pm]
            # (x, res, y, weight, scales, N, K, out, x_plain, res_plain, y_plain, x's copy stride, role, attention,
            # input perm, padded K)
            role = (1, li) if at is not None else (0, -1)
            ops.append((x.data_ptr(), 0, q.data_ptr(), *ws[0], nq, h, 0, x_plain, False, False, h,
                        *role, pp[0], kp[0]))
            if at is None:  # o reads q/k/v's first H outputs
                ops.append((q.data_ptr(), x.data_ptr(), hh.data_ptr(), *ws[1], h, h, 1, False, x_plain, False,
                            nq, 0, -1, pp[1], kp[1]))
            else:  # o reads the attention's output
                att = buf(o_in)
                part = torch.zeros(ps.attn_part(at.heads, at.kv_heads, at.head_dim, self.splits),
                                   dtype=torch.float32, device=dev)
                count = torch.zeros(at.kv_heads, dtype=torch.int32, device=dev)
                qk = torch.zeros(2, 2 * (at.heads + at.kv_heads), dtype=torch.int32, device=dev)  # sums, counts
                self._keep += [att, part, count, qk]
                self._acts.append(att)
                ops.append((att.data_ptr(), x.data_ptr(), hh.data_ptr(), *ws[1], h, o_in, 1, False, x_plain, False,
                            o_in, 2, li, pp[1], kp[1]))
                attns.append((at.k_cache[li].data_ptr(), at.v_cache[li].data_ptr(), at.cos.data_ptr(),
                              at.sin.data_ptr(), part.data_ptr(), count.data_ptr(), at.heads, at.kv_heads,
                              at.head_dim, at.max_seq, self.splits,
                              at.scale if at.scale is not None else at.head_dim ** -0.5,
                              at.qkv_bias[li].data_ptr() if at.qkv_bias is not None else 0,
                              *((at.q_norm[li].data_ptr(), at.k_norm[li].data_ptr(), qk[0].data_ptr(),
                                 qk[1].data_ptr()) if at.q_norm is not None else (0, 0, 0, 0)), float(at.qk_eps),
                              int(at.per_warp or 0)))
            ops.append((hh.data_ptr(), 0, a.data_ptr(), *ws[2], 2 * i, h, 2, False, False, False, h, 0, -1, pp[2],
                        kp[2]))
            ops.append((a.data_ptr(), hh.data_ptr(), nxt.data_ptr(), *ws[3], h, i, 1, False, False, plain_out, i, 0,
                        -1, pp[3], kp[3]))
            if norms is not None:  # an act-order op reads its gain in its inputs' stored order
                g1, g2 = (norm_gain(n, p) for n, p in zip(norms[li], (pm[0], pm[2])))
                self._keep += [g1, g2]
                gains += [g1.data_ptr(), 0, g2.data_ptr(), 0]
            x, x_plain = nxt, False
        self.head = head
        self.logits = self.token = None
        self._head = None
        if head is not None:  # x: the last layer's output (two copies)
            vocab = head.weight.shape[0]
            self.logits = torch.zeros(1, vocab, dtype=torch.float32, device=dev)
            self.token = torch.zeros(1, dtype=torch.int64, device=dev)
            key = torch.zeros(1, dtype=torch.int64, device=dev)  # the argmax's key and count, left zero by each launch
            count = torch.zeros(1, dtype=torch.int32, device=dev)
            gain = norm_gain(head.gain.contiguous())
            w = head.weight.contiguous()
            self._keep += [key, count, gain, w]
            rec = ps.head_record(x.data_ptr(), h, gain.data_ptr(), float(head.eps), w.data_ptr(), vocab, h,
                                 self.logits.data_ptr(), self.output.data_ptr(), key.data_ptr(), count.data_ptr(),
                                 self.token.data_ptr())
            if rec.numel() == 0:
                raise PersistError(f"head: the record was refused (lm_head {list(w.shape)}, H = {h})")
            self._head = rec.to(dev)
        (err, table, sched, self.op_class, self.classes, self.sums, self.x_cap, self.stage, self.smem, attn,
         self.octets) = ps.plan(ops, self.group, self.zeros, blocks, warps, stages, attns, self.bits)
        if err:
            raise PersistError(f"PersistentChain: {err}")
        with torch.cuda.device(dev):  # the weights' GPU, not the current one
            why = ps.refusal(self.smem, self.group, self.zeros, blocks, warps, self.has_norms, at is not None,
                             self.bits, dtype == torch.bfloat16, self.octets)
        if why:
            raise PersistError(f"PersistentChain: {why}")
        # the kernel run() launches: with the octet form (self.octets: the plan's rule can take it) or without it,
        # which spills nothing (the engine picks per step: octets_at); the form knob as the plan read it
        self.step_octets = self.octets
        self._form = _ext.MODULE.testing.chain_attention_form() if at is not None else 0
        self._table = table.to(dev)
        self._schedule = sched.to(dev)
        self._sync = torch.zeros(len(ops) + 1, dtype=torch.int32, device=dev)
        self._norms = torch.tensor(gains, dtype=torch.int64).to(dev) if gains else None
        self._attn = attn.to(dev) if at is not None else None

    @staticmethod
    def _check_attention(at: Attention, layers: int, dev, dtype: torch.dtype) -> None:
        if not isinstance(at, Attention):
            raise PersistError(f"attention: expected a qgemv.persist.Attention, got {type(at).__name__}")
        hq, hk, d = at.heads, at.kv_heads, at.head_dim
        if not (hk >= 1 and hq >= hk and hq % hk == 0 and hq // hk <= 8):
            raise PersistError(f"attention: heads ({hq}) must be a multiple of kv_heads ({hk}), "
                               f"at most 8 query heads a kv head")
        if d not in (32, 64, 128):
            raise PersistError(f"attention: head_dim must be 32, 64 or 128, got {d}")
        s = at.cos.shape[0] if at.cos.dim() == 2 else -1
        for name, t, shape in (("cos", at.cos, (s, d)), ("sin", at.sin, (s, d)),
                               ("k_cache", at.k_cache, (layers, hk, s, d)), ("v_cache", at.v_cache, (layers, hk, s, d))):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or \
                    t.device != dev or not t.is_contiguous():
                raise PersistError(f"attention: {name} must be contiguous {_dt(dtype)} {list(shape)} on {dev}, got "
                                   f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))} on "
                                   f"{getattr(t, 'device', '-')}")
        if s < 1:
            raise PersistError("attention: the rotary tables hold no positions")
        if (at.q_norm is None) != (at.k_norm is None):
            raise PersistError("attention: q_norm and k_norm come together (Qwen3), or neither")
        for name, t in (("q_norm", at.q_norm), ("k_norm", at.k_norm)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != dtype or
                                  tuple(t.shape) != (layers, d) or t.device != dev or not t.is_contiguous()):
                raise PersistError(f"attention: {name} must be contiguous {_dt(dtype)} [{layers}, {d}] on {dev}, got "
                                   f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
        b, n = at.qkv_bias, (hq + 2 * hk) * d
        if b is not None and (not isinstance(b, torch.Tensor) or b.dtype != dtype or
                              tuple(b.shape) != (layers, n) or b.device != dev or not b.is_contiguous()):
            raise PersistError(f"attention: qkv_bias must be None or contiguous {_dt(dtype)} [{layers}, {n}] on {dev}, "
                               f"got {getattr(b, 'dtype', type(b).__name__)} {list(getattr(b, 'shape', []))} on "
                               f"{getattr(b, 'device', '-')}")
        if at.splits is not None and at.splits < 1:
            raise PersistError(f"attention: splits must be positive, got {at.splits}")
        if at.per_warp is not None and not 1 <= at.per_warp <= 64:
            raise PersistError(f"attention: per_warp must be None or 1..64, got {at.per_warp}")

    @staticmethod
    def _check_head(hd: Head, hidden: int, dev, dtype: torch.dtype) -> None:
        if not isinstance(hd, Head):
            raise PersistError(f"head: expected a qgemv.persist.Head, got {type(hd).__name__}")
        w, g = hd.weight, hd.gain
        if not isinstance(w, torch.Tensor) or w.dtype != dtype or w.dim() != 2 or w.shape[1] != hidden or \
                w.shape[0] < 1 or w.device != dev:
            raise PersistError(f"head: weight must be {_dt(dtype)} [vocab, {hidden}] on {dev}, got "
                               f"{getattr(w, 'dtype', type(w).__name__)} {list(getattr(w, 'shape', []))} on "
                               f"{getattr(w, 'device', '-')}")
        if w.is_contiguous() and w.data_ptr() % 16:
            raise PersistError("head: weight must start 16-byte aligned (its rows are read 16 bytes at a time)")
        if w.shape[0] >= 2 ** 31 - 1:
            raise PersistError(f"head: vocab must be below 2^31 - 1, got {w.shape[0]}")
        if not isinstance(g, torch.Tensor) or g.dtype != dtype or tuple(g.shape) != (hidden,) or g.device != dev:
            raise PersistError(f"head: gain must be {_dt(dtype)} [{hidden}] on {dev}, got "
                               f"{getattr(g, 'dtype', type(g).__name__)} {list(getattr(g, 'shape', []))} on "
                               f"{getattr(g, 'device', '-')}")
        if not (hd.eps > 0.0):
            raise PersistError(f"head: eps must be positive, got {hd.eps}")

    def _perm(self, w: Weight) -> Optional[torch.Tensor]:
        """An act-order weight's input perm as the kernel reads it (int16 [K] on the chain's device), or None."""
        if isinstance(w, torch.Tensor) or w.perm is None:
            return None
        p = w.perm.to(device=self.device, dtype=torch.int16).contiguous()
        self._keep.append(p)
        return p

    def _padded_k(self, w: Weight) -> int:
        """w's K rounded up to the kernel's whole tiles (128 int4, 64 int8 or 32 fp16 inputs)."""
        t = TILE_K[self.bits]
        return -(-_shape(w)[1] // t) * t

    def _weight(self, w: Weight, k: int) -> Tuple[int, int]:
        """(weight pointer, scales pointer) of one linear in the kernel's layout, its inputs padded to k
        (:meth:`_padded_k`, :func:`pad_inputs`)."""
        w = pad_inputs(w, k)
        if self.bits == 16:  # 16-row panels of 64-byte tiles, as qgemv packs int8 rows
            from .formats import to_panels

            panels = to_panels(w.detach().contiguous().view(torch.int16))
            self._keep.append(panels)
            self.weight_bytes += panels.numel() * 2
            return panels.data_ptr(), 0
        if self.group == 0:
            qw, s = w.qweight.contiguous(), w.scales.contiguous()  # int4 / int8 per channel: the packed panels
            self._keep += [qw, s]
            self.weight_bytes += qw.numel() * qw.element_size() + s.numel() * 2
            return qw.data_ptr(), s.data_ptr()
        # grouped: the packed codes read in place, their scales and zero points beside them in tile order
        qw, meta = w.qweight.contiguous(), tile_meta(w)  # on the weight's device, the chain's (checked above)
        self._keep += [qw, meta]
        self.weight_bytes += qw.numel() * qw.element_size() + meta.numel()
        return qw.data_ptr(), meta.data_ptr()

    def octets_at(self, position: int) -> bool:
        """Whether a launch at cache slot ``position`` (int) may take the attention's octet form, so needs the
        kernel with it: the plan asked for that kernel (:attr:`octets`) and the form is forced on, or under its rule a
        unit of the position + 1 cache positions reaches 128 of them (persist_chain.cuh, chain_attention: a unit
        holds at most ceil(L / splits) positions, splits = min(the chain's splits, ceil(L / (warps x per_warp)))).
        Where it is False the form cannot run, so the kernel without it does the same arithmetic and spills
        nothing."""
        if not self.octets or self._form == 0:  # (0: the form forced off, testing.set_chain_attention_form)
            return False
        if self._form == 1:
            return True
        L = int(position) + 1
        per = self.warps * (self.attention.per_warp or _CHAIN_ATTN_PER_WARP)
        splits = min(self.splits, -(-L // per))
        return -(-L // splits) >= 4 * _CHAIN_ATTN_CHUNK

    def run(self) -> None:
        """One launch on the current stream: :attr:`input` -> :attr:`output` (capturable in a CUDA graph); the
        kernel with the octet form where :attr:`step_octets` (set it from :meth:`octets_at`), else the one without."""
        if self.step_octets and not self.octets:
            raise PersistError("PersistentChain: step_octets is set, but the plan built no octet attention")
        why = _module().launch(self._table, self._schedule, self._sync, self.group, self.zeros, self.blocks,
                               self.warps, self.stages, self.classes, self.sums, self.x_cap, self.smem,
                               self._norms.data_ptr() if self._norms is not None else 0, self.eps,
                               self._attn.data_ptr() if self._attn is not None else 0,
                               self.position.data_ptr() if self._attn is not None else 0, self.bits, self.stage,
                               self.dtype == torch.bfloat16, self._head.data_ptr() if self._head is not None else 0,
                               bool(self.step_octets))
        if why:
            raise PersistError(f"PersistentChain: launch refused: {why}")

    def __call__(self, x: torch.Tensor, position: Optional[int] = None) -> torch.Tensor:
        """x [1, H] of the chain's dtype on its device -> [1, H] of that type (a new tensor); position: the token's
        cache slot (with attention: required, 0 <= position < the cache's length)."""
        if x.dtype != self.dtype or x.shape != (1, self.hidden) or x.device != self.device:
            raise PersistError(f"PersistentChain: x must be {_dt(self.dtype)} [1, {self.hidden}] on {self.device}, got "
                               f"{x.dtype} {list(x.shape)} on {x.device}")
        if self.attention is not None:
            if position is None or not 0 <= int(position) < self.attention.max_seq:
                raise PersistError(f"PersistentChain: position must be in 0..{self.attention.max_seq - 1} "
                                   f"(the cache's slots), got {position}")
            self.position.fill_(int(position))
        elif position is not None:
            raise PersistError("PersistentChain: position is for a chain with attention")
        self.input.copy_(x)
        self.run()
        return self.output.clone()
