"""Decoder layers' linears as one persistent launch (issue 35, stage 1).

    chain = qgemv.persist.PersistentChain(layers)      # [(qkv, o, gate_up, down) PackedWeight, ...]
    y = chain(x)                                       # x [1, H] float16 -> [1, H] float16
    chain = qgemv.persist.PersistentChain(layers, norms=gains, eps=1e-5)   # with each layer's two RMSNorms

One kernel launch runs every linear of every layer: each block streams its
share of the next linear's weights into shared memory while the previous
linear's outputs are still being written, and every activation reads 0xffff
until it is written, so a block starts on an input as soon as the values it
reads are there (no kernel boundary, no grid barrier; csrc/persist_chain.cuh,
form 20; dev/PERSISTENT.md has the design and its measurements).

Each layer is the decode step's linears with their glue and a stand-in for
attention (o reads the first H outputs of q/k/v):

    q = qkv(n1(x));  h = o(q[:, :H]) + x;  a = silu(g) * u  for (g, u) = gate_up(n2(h));  x' = down(a) + h

where n1 and n2 are the layer's RMSNorms when ``norms`` is given (the
identity otherwise), computed inside the launch where each block reads the
linear's input: n(v) = round(gain * round(v * rsqrt(mean(v^2) + eps))), the
rounding of transformers' LlamaRMSNorm.  Every result is rounded to float16
as the per-op chain rounds it (:func:`reference` is that chain, one qgemv
kernel a linear).  gate_up holds gate's rows, then up's (a qgemv
checkpoint's fused gate/up).

Supported: int4 per channel, int4 G = 128 with or without zero points (no
act-order perm), float16 activations, one token, compute capability 9.x,
K % 128 == 0 and N % 16 == 0 (gate_up: % 32).  Not in the engine yet: no
RoPE or attention inside the launch (stage 2).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import _ext
from .weight import PackedWeight

FORMATS = ("int4", "int4g128", "int4g128a")
# The lab's best settings on the H200 (dev/PERSISTENT.md): 16 warps a block, 8 ring slots of 1 KB tiles a warp.
DEFAULT_WARPS = 16
DEFAULT_STAGES = 8

Layer = Tuple[PackedWeight, PackedWeight, PackedWeight, PackedWeight]
Norms = Tuple[torch.Tensor, torch.Tensor]  # a layer's (input, post-attention) RMSNorm gains, float16 [H]


class PersistError(ValueError):
    """A chain the persistent kernel cannot run; the message names the layer, the linear and the rule."""


def _module():
    mod = _ext.MODULE
    if mod is None or not hasattr(mod, "persist"):
        raise PersistError(f"qgemv.persist needs the CUDA extension built from this version ({_ext.REASON or 'stale build'})")
    return mod.persist


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """round(gain * round(x * rsqrt(mean(x^2) + eps))) over the last dim (float32 inside, as transformers'
    LlamaRMSNorm): x [..., H] float16, gain [H] float16 -> [..., H] float16."""
    xf = x.float()
    return gain * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference(layers: Sequence[Layer], x: torch.Tensor, norms: Optional[Sequence[Norms]] = None,
              eps: float = 1e-5) -> torch.Tensor:
    """The same chain one qgemv kernel a linear, with the glue in torch: x [1, H] float16 -> [1, H] float16."""
    from .ops import linear

    for li, (qkv, o, gate_up, down) in enumerate(layers):
        h_dim = o.out_features
        q = linear(rms_norm(x, norms[li][0], eps) if norms else x, qkv)
        h = linear(q[:, :h_dim], o) + x
        gu = linear(rms_norm(h, norms[li][1], eps) if norms else h, gate_up).float()
        inter = gu.shape[-1] // 2
        a = (torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]).half()
        x = linear(a, down) + h
    return x


def fuse_tiles(w: PackedWeight) -> torch.Tensor:
    """A G = 128 weight in the kernel's layout: each 1 KB tile of the packed codes (N / 16 panels x K / 128
    tiles, the panels' own order) followed by its 16 rows' scales (and zero points): uint8 on the CPU."""
    n, k = w.out_features, w.in_features
    if w.format not in ("int4g128", "int4g128a"):
        raise PersistError(f"fuse_tiles: format {w.format}, expected int4g128 or int4g128a")
    if n % 16 or k % 128:
        raise PersistError(f"fuse_tiles: N must be a multiple of 16 and K of 128, got {n} x {k}")
    if w.qweight.numel() != n * k // 8 or w.scales.numel() != n * (k // 128):
        raise PersistError(f"fuse_tiles: qweight / scales hold {w.qweight.numel()} / {w.scales.numel()} values, "
                           f"expected {n * k // 8} / {n * (k // 128)}")
    zeros = torch.empty(0, dtype=torch.uint8) if w.zeros is None else w.zeros.contiguous().cpu()
    # checked above, so the extension's own checks (which would raise out of C++) never fire
    return _module().fuse(w.qweight.contiguous().cpu(), w.scales.contiguous().cpu(), zeros, n, k)


def _format_of(w: PackedWeight, where: str) -> Tuple[int, bool]:
    if w.format not in FORMATS:
        raise PersistError(f"{where}: format {w.format} is not supported (supported: {', '.join(FORMATS)})")
    if w.perm is not None:
        raise PersistError(f"{where}: act-order weights (perm) are not supported")
    return (128 if w.config.group_size else 0), w.zeros is not None


class PersistentChain:
    """Every linear of ``layers`` in one persistent launch (module docstring: the chain it computes).

    Args:
        layers: per layer (qkv [Nqkv, H], o [H, H], gate_up [2 I, H], down [H, I]) as PackedWeight on one CUDA
            device, all in one of :data:`FORMATS`; Nqkv >= H; gate_up: gate's rows, then up's.
        warps: warps a block (1-16); stages: ring slots a warp (an even number above 2).
        blocks: the grid (default: one block an SM; more than fit at once is refused, never hung).
        norms: per layer (input, post-attention) RMSNorm gains, float16 [H] on the chain's device, or None (no
            norms), copied at construction (later changes to them are not seen); eps: their epsilon.
    The weights are re-laid for the kernel (G = 128: each 1 KB tile with its scales and zero points, on the
    CPU once); the chain keeps its own activation buffers, so calls on one chain must not overlap.
    """

    def __init__(self, layers: Sequence[Layer], *, warps: int = DEFAULT_WARPS, stages: int = DEFAULT_STAGES,
                 blocks: Optional[int] = None, norms: Optional[Sequence[Norms]] = None, eps: float = 1e-5):
        ps = _module()
        layers = [tuple(layer) for layer in layers]
        if not layers:
            raise PersistError("PersistentChain: no layers")
        fmt = None
        for li, layer in enumerate(layers):
            if len(layer) != 4:
                raise PersistError(f"layer {li}: expected 4 weights (qkv, o, gate_up, down), got {len(layer)}")
            for name, w in zip(("qkv", "o", "gate_up", "down"), layer):
                f = _format_of(w, f"layer {li} {name}")
                if fmt is None:
                    fmt = f
                elif f != fmt:
                    raise PersistError(f"layer {li} {name}: every weight must share one format, "
                                       f"got {w.format} after {layers[0][0].format}")
        qkv0, o0, gu0, down0 = layers[0]
        self.hidden, self.intermediate = o0.out_features, gu0.out_features // 2
        dev = qkv0.qweight.device
        h, i = self.hidden, self.intermediate
        for li, (qkv, o, gu, down) in enumerate(layers):
            shapes = {"qkv": (qkv, qkv.out_features, h), "o": (o, h, h), "gate_up": (gu, 2 * i, h),
                      "down": (down, h, i)}
            for name, (w, n, k) in shapes.items():
                if (name == "qkv" and (w.out_features < h or w.in_features != h)) or \
                        (name != "qkv" and (w.out_features, w.in_features) != (n, k)):
                    raise PersistError(f"layer {li} {name}: shape {w.out_features} x {w.in_features}, expected "
                                       f"{'>= ' + str(h) if name == 'qkv' else n} x {k}")
                if w.qweight.device != dev:
                    raise PersistError(f"layer {li} {name}: on {w.qweight.device}, the chain is on {dev}")
                step = 32 if name == "gate_up" else 16
                if w.out_features % step or w.in_features % 128:
                    raise PersistError(f"layer {li} {name}: {w.out_features} x {w.in_features}: N must be a "
                                       f"multiple of {step} and K of 128")
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
                    if not isinstance(g, torch.Tensor) or g.dtype != torch.float16 or g.shape != (h,) or \
                            g.device != dev:
                        raise PersistError(f"norms[{li}] {name}: must be float16 [{h}] on {dev}, got "
                                           f"{getattr(g, 'dtype', type(g).__name__)} "
                                           f"{list(getattr(g, 'shape', []))} on {getattr(g, 'device', '-')}")
            if not (eps > 0.0):
                raise PersistError(f"eps must be positive, got {eps}")
        self.group, self.zeros = fmt
        self.format = qkv0.format
        self.device = dev
        self.layers = len(layers)
        self.warps, self.stages = warps, stages
        self.eps = float(eps)
        self.has_norms = norms is not None
        if blocks is None:
            blocks = torch.cuda.get_device_properties(dev).multi_processor_count
        self.blocks = blocks

        def buf(n: int) -> torch.Tensor:  # two copies of n fp16 values, all 0xffff (not yet written)
            return torch.full((n,), -1, dtype=torch.int32, device=dev)

        self.input = torch.zeros(1, h, dtype=torch.float16, device=dev)
        self.output = torch.zeros(1, h, dtype=torch.float16, device=dev)
        self._keep = []  # every tensor the op table points at
        self._acts = []  # the activation buffers inside the launch (two fp16 copies each)
        self.weight_bytes = 0  # what one launch streams: the weights in the kernel's layout
        ops = []
        gains = []  # per op: its input's RMSNorm gain (a contiguous copy: 16-byte aligned) or 0
        x, x_plain = self.input, True
        for li, (qkv, o, gu, down) in enumerate(layers):
            last = li + 1 == len(layers)
            q, hh, a = buf(qkv.out_features), buf(h), buf(i)
            nxt = self.output if last else buf(h)
            self._keep += [q, hh, a, nxt]
            self._acts += [q, hh, a] + ([] if last else [nxt])
            ws = [self._weight(w) for w in (qkv, o, gu, down)]
            # (x, res, y, weight, scales, N, K, out, x_plain, res_plain, y_plain, x's copy stride)
            ops.append((x.data_ptr(), 0, q.data_ptr(), *ws[0], qkv.out_features, h, 0, x_plain, False, False, h))
            ops.append((q.data_ptr(), x.data_ptr(), hh.data_ptr(), *ws[1], h, h, 1, False, x_plain, False,
                        qkv.out_features))  # o reads q/k/v's first H outputs
            ops.append((hh.data_ptr(), 0, a.data_ptr(), *ws[2], 2 * i, h, 2, False, False, False, h))
            ops.append((a.data_ptr(), hh.data_ptr(), nxt.data_ptr(), *ws[3], h, i, 1, False, False, last, i))
            if norms is not None:
                g1, g2 = (n.contiguous().clone() for n in norms[li])
                self._keep += [g1, g2]
                gains += [g1.data_ptr(), 0, g2.data_ptr(), 0]
            x, x_plain = nxt, False
        err, table, sched, self.op_class, self.classes, self.sums, self.x_cap, self.smem = ps.plan(
            ops, self.group, self.zeros, blocks, warps, stages)
        if err:
            raise PersistError(f"PersistentChain: {err}")
        with torch.cuda.device(dev):  # the weights' GPU, not the current one
            why = ps.refusal(self.smem, self.group, self.zeros, blocks, warps, self.has_norms)
        if why:
            raise PersistError(f"PersistentChain: {why}")
        self._table = table.to(dev)
        self._schedule = sched.to(dev)
        self._sync = torch.zeros(len(ops) + 1, dtype=torch.int32, device=dev)
        self._norms = torch.tensor(gains, dtype=torch.int64).to(dev) if gains else None

    def _weight(self, w: PackedWeight) -> Tuple[int, int]:
        """(weight pointer, scales pointer) of one linear in the kernel's layout."""
        if self.group == 0:
            qw, s = w.qweight.contiguous(), w.scales.contiguous()
            self._keep += [qw, s]
            self.weight_bytes += qw.numel() * 4 + s.numel() * 2
            return qw.data_ptr(), s.data_ptr()
        fused = fuse_tiles(w).to(self.device)
        self._keep.append(fused)
        self.weight_bytes += fused.numel()
        return fused.data_ptr(), 0

    def run(self) -> None:
        """One launch on the current stream: :attr:`input` -> :attr:`output` (capturable in a CUDA graph)."""
        why = _module().launch(self._table, self._schedule, self._sync, self.group, self.zeros, self.blocks,
                               self.warps, self.stages, self.classes, self.sums, self.x_cap, self.smem,
                               self._norms.data_ptr() if self._norms is not None else 0, self.eps)
        if why:
            raise PersistError(f"PersistentChain: launch refused: {why}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, H] float16 on the chain's device -> [1, H] float16 (a new tensor)."""
        if x.dtype != torch.float16 or x.shape != (1, self.hidden) or x.device != self.device:
            raise PersistError(f"PersistentChain: x must be float16 [1, {self.hidden}] on {self.device}, got "
                               f"{x.dtype} {list(x.shape)} on {x.device}")
        self.input.copy_(x)
        self.run()
        return self.output.clone()
