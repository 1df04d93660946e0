"""QuantLinear and whole-model conversion."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from . import arch, formats, ops
from .formats import QuantConfig
from .weight import PackedWeight


class _StoredFormat:
    """``bits`` and ``group_size`` of a module's ``config`` (the QuantConfig it is stored in)."""

    @property
    def bits(self) -> int:
        return self.config.bits

    @property
    def group_size(self) -> Optional[int]:
        return self.config.group_size


class QuantLinear(_StoredFormat, nn.Module):
    """A drop-in ``nn.Linear`` whose weight is stored int8 or int4.

    Buffers (all persistent, so ``state_dict`` round-trips):
        qweight: int8 [N, round_up(K, 16)] or int32 [N, round_up(K, 32) / 8]
        scales:  float16 [N] (per channel) or [N, K / group_size]
        zeros:   uint8 [N, K / group_size] (asymmetric int4 only)
        bias:    [N] in the original linear's dtype (optional)
        perm:    int64 [K] (optional): the weight is stored with its input
                 columns permuted, W_stored = W[:, perm], and forward gathers
                 x[..., perm] first (act-order GPTQ checkpoints, whose groups
                 are contiguous only in that order; qgemv.importers)

    forward(x): x [..., K] (float16 / bfloat16 / float32; float64 is computed in
    float32) -> [..., N] in x.dtype.

    ``module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` / ``.double()`` cast the
    bias only: qweight and zeros are integers, and the scales stay float16
    (see ``_apply``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int = 8,
        group_size: Optional[int] = None,
        symmetric: bool = True,
        bias: bool = False,
        device=None,
        bias_dtype: torch.dtype = torch.float16,
    ):
        super().__init__()
        self.config = QuantConfig(bits, group_size, symmetric)
        if in_features % 8 != 0:
            raise ValueError(f"QuantLinear: in_features must be a multiple of 8, got {in_features}")
        if group_size is not None and in_features % group_size != 0:
            raise ValueError(
                f"QuantLinear: in_features ({in_features}) must be divisible by group_size ({group_size})"
            )
        self.in_features = in_features
        self.out_features = out_features
        n, k = out_features, in_features
        if bits == 8:
            qw = torch.zeros(n, (k + 15) // 16 * 16, dtype=torch.int8, device=device)
        else:
            qw = torch.zeros(n, (k + 31) // 32 * 4, dtype=torch.int32, device=device)
        ng = 0 if group_size is None else k // group_size
        self.register_buffer("qweight", qw)
        self.register_buffer(
            "scales", torch.ones((n,) if ng == 0 else (n, ng), dtype=torch.float16, device=device)
        )
        if not symmetric:
            self.register_buffer("zeros", torch.zeros(n, ng, dtype=torch.uint8, device=device))
        else:
            self.zeros = None
        if bias:
            self.register_buffer("bias", torch.zeros(n, dtype=bias_dtype, device=device))
        else:
            self.bias = None
        self.register_buffer("perm", None)  # a permuted input: set by whoever stores W[:, perm]

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        bits: int = 8,
        group_size: Optional[int] = None,
        symmetric: bool = True,
        name: str = "weight",
        device=None,
    ) -> "QuantLinear":
        """Round-to-nearest quantization of ``linear``.

        The weight is quantized on ``device`` (default: where it is) and the
        module is returned on the linear's own device.  A linear on the meta
        device gives a meta QuantLinear of the same format and shapes (a
        skeleton to load packed tensors into); it cannot be quantized elsewhere.
        """
        cfg = QuantConfig(bits, group_size, symmetric)
        if linear.weight.is_meta:
            if device is not None and torch.device(device).type != "meta":
                raise ValueError(f"{name}: the linear is on the meta device (no values): it cannot be quantized on "
                                 f"{device}; load its weights first")
            has_bias = linear.bias is not None
            return cls(linear.in_features, linear.out_features, bits, group_size, symmetric, bias=has_bias,
                       device="meta", bias_dtype=linear.bias.dtype if has_bias else torch.float16)
        w = linear.weight if device is None else linear.weight.to(device)
        qw, s, z = formats.quantize(w, cfg, name)
        dev = linear.weight.device
        z = z.to(dev) if z is not None else None
        return cls.from_quantized(linear, cfg, qw.to(dev), s.to(dev), z)

    @classmethod
    def from_quantized(cls, linear: nn.Linear, cfg: QuantConfig, qweight, scales, zeros) -> "QuantLinear":
        """Wrap already-packed tensors (from GPTQ / AWQ) with ``linear``'s bias."""
        has_bias = linear.bias is not None
        m = cls(
            linear.in_features,
            linear.out_features,
            cfg.bits,
            cfg.group_size,
            cfg.symmetric,
            bias=has_bias,
            device="meta",
            bias_dtype=linear.bias.dtype if has_bias else torch.float16,
        )
        m.qweight = qweight
        m.scales = scales
        if zeros is not None:
            m.zeros = zeros
        if has_bias:
            m.bias = linear.bias.detach().clone()
        return m

    @property
    def packed(self) -> PackedWeight:
        """The weight as a :class:`qgemv.PackedWeight` (the same tensors, not copies)."""
        return PackedWeight(self.qweight, self.scales, self.zeros, self.config, self.in_features, self.perm)

    @classmethod
    def from_packed(cls, w: PackedWeight, bias: Optional[torch.Tensor] = None) -> "QuantLinear":
        """A QuantLinear holding w's tensors (not copies), with an optional bias [N]."""
        c = w.config
        m = cls(w.in_features, w.out_features, c.bits, c.group_size, c.symmetric, bias=bias is not None,
                device="meta", bias_dtype=bias.dtype if bias is not None else torch.float16)
        m.qweight, m.scales = w.qweight, w.scales
        if w.zeros is not None:
            m.zeros = w.zeros
        if bias is not None:
            m.bias = bias
        if w.perm is not None:
            m.perm = w.perm
        return m

    def _apply(self, fn, recurse=True):
        # Module.to(dtype), .half(), .bfloat16(), .double() cast every floating
        # point buffer, and the fp16 scales are one: after model.to(torch.bfloat16)
        # each forward failed with "scales must be float16", and casting them
        # back would round them through bf16.  Seen as int16 for the duration,
        # the scales move between devices with the module but are never cast.
        self.__dict__["_checked_on"] = None
        self.__dict__.pop("_cpu_w", None)  # the CPU path's float32 weight: not carried to another device
        self._buffers["scales"] = self._buffers["scales"].view(torch.int16)
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers["scales"] = self._buffers["scales"].view(torch.float16)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this module multiplies x by (columns in x's order)."""
        w = formats.dequantize(self.qweight, self.scales, self.zeros, self.config, self.in_features)
        if self.perm is None:
            return w
        return w[:, torch.argsort(self.perm.to(w.device))]

    # The buffers are checked in full (shapes, dtypes, alignment: ops.check_*)
    # once, and again only after they change (assignment, load_state_dict,
    # .to()); each call then checks x alone, with a few attribute reads.  The
    # full Python checks cost microseconds per call, which an eager decode
    # loop or a host-bound benchmark sees; and on the CUDA path every check
    # must pass before the kernel's own C++ checks, whose exceptions ended the
    # process on torch 2.11 (see ops._precheck_cuda).
    _BUFFER_NAMES = ("qweight", "scales", "zeros", "bias", "perm")

    def __setattr__(self, name, value):
        if name in QuantLinear._BUFFER_NAMES:
            self.__dict__["_checked_on"] = None
        super().__setattr__(name, value)

    def _load_from_state_dict(self, *args, **kwargs):
        self.__dict__["_checked_on"] = None
        return super()._load_from_state_dict(*args, **kwargs)

    def _cpu_weight(self) -> torch.Tensor:
        """The dequantized float32 weight [N, K] the CPU reference computes, cached while qweight, scales and
        zeros are the same tensors at the same version (an in-place change or a new tensor drops it)."""
        key = tuple((t.data_ptr(), t._version, t.device) for t in (self.qweight, self.scales, self.zeros)
                    if t is not None)
        cached = self.__dict__.get("_cpu_w")
        if cached is None or cached[0] != key:
            w = formats.dequantize(self.qweight, self.scales, self.zeros, self.config, self.in_features)
            cached = (key, w.float())
            self.__dict__["_cpu_w"] = cached
        return cached[1]

    @property
    def cpu_weight_bytes(self) -> int:
        """Bytes of the float32 weight the CPU path keeps (0 before a CPU call, or after a buffer moved)."""
        cached = self.__dict__.get("_cpu_w")
        return 0 if cached is None else cached[1].numel() * cached[1].element_size()

    def _check_buffers(self, x: torch.Tensor) -> None:
        k = self.in_features
        ops.check_linear(x, self)
        if self.perm is not None:
            p = self.perm
            if p.dtype != torch.int64 or tuple(p.shape) != (k,) or p.device != x.device or not torch.equal(
                    torch.sort(p).values, torch.arange(k, device=p.device)):
                raise ValueError(f"QuantLinear: perm must be an int64 permutation of 0..{k - 1} on {x.device}, got "
                                 f"{p.dtype} {list(p.shape)} on {p.device}")
        # The ops take perm as int32 (the GEMV gathers x with it in its prologue); kept until a buffer changes.
        self.__dict__["_perm_i32"] = None if self.perm is None else self.perm.to(torch.int32).contiguous()
        if x.is_cuda:
            ops.check_cuda_pointers("QuantLinear", qweight=(self.qweight, 16), scales=(self.scales, 2))
        self.__dict__["_checked_on"] = x.device

    def forward_gathered(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for an x whose features are already in the stored order, ``input[..., perm]``
        (a caller that fused the act-order gather into the op producing x, as the generation engine does
        in its norm, :func:`qgemv.ops.add_rms_gather`); without a perm it is :meth:`forward`."""
        return self.forward(x, gathered=True)

    def forward(self, x: torch.Tensor, gathered: bool = False) -> torch.Tensor:
        """y [..., N] = x [..., K] @ W^T (+ bias), in x's dtype.

        gathered: x is already ``input[..., perm]`` (a caller that fused the
        act-order gather into the op producing x, as the generation engine
        does in its norm); without a perm it changes nothing.
        """
        k = self.in_features
        if x.dtype == torch.float64:  # a model cast with .double(): the ops run in fp32 at most
            return self.forward(x.float(), gathered).double()
        if not torch.compiler.is_compiling():
            if self.__dict__.get("_checked_on") != x.device:
                self._check_buffers(x)  # also x's dtype, width and device, with the full messages
            elif x.shape[-1] != k or x.dtype not in ops.FLOAT_DTYPES:
                self._check_buffers(x)  # raises, naming the rule
        perm = None  # (the engine's call with gathered=True: see forward_gathered)
        if self.perm is not None and not gathered:
            if torch.compiler.is_compiling():
                x = x.index_select(-1, self.perm)  # the compiler fuses the gather into x's producer
            else:
                perm = self.__dict__.get("_perm_i32")  # the op gathers (up to 8 tokens: inside the GEMV)
                if perm is None or perm.device != x.device:
                    self._check_buffers(x)
                    perm = self.__dict__["_perm_i32"]
        if x.device.type == "cpu" and not torch.compiler.is_compiling() and not (
                torch.is_grad_enabled() and self.scales.requires_grad):
            # The CPU reference dequantizes the whole weight on every call (38 s a decode step of SmolLM2
            # int4 g128 on 2 cores); the same float32 weight, kept until a buffer changes, gives the same
            # numbers at the float model's speed, for 4 bytes a weight of memory.
            y = ops.ref_matmul(x, self._cpu_weight(), perm)
        else:
            y = ops.linear(x, self, perm, checked=True)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        g = "per-channel" if self.group_size is None else f"group_size={self.group_size}"
        sym = "symmetric" if self.config.symmetric else "asymmetric"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, {g}, {sym}, bias={self.bias is not None}"
        )


@dataclass
class QuantizeReport:
    """What :func:`quantize_model` did."""

    converted: list = field(default_factory=list)  # qualified names
    skipped: dict = field(default_factory=dict)  # name -> reason
    bytes_before: int = 0  # weight bytes of the converted layers, before
    bytes_after: int = 0  # packed bytes (weights, scales, zeros) after
    seconds: float = 0.0

    def table(self) -> str:
        lines = [
            f"converted {len(self.converted)} linear layers, skipped {len(self.skipped)}",
            f"weight bytes {self.bytes_before / 1e6:.2f} MB -> {self.bytes_after / 1e6:.2f} MB"
            + (f" ({self.bytes_before / max(self.bytes_after, 1):.2f}x smaller)" if self.bytes_after else ""),
        ]
        for name, why in self.skipped.items():
            lines.append(f"  skipped {name}: {why}")
        return "\n".join(lines)


def _matches(name: str, patterns: Iterable[str]) -> Optional[str]:
    for p in patterns:
        if re.search(p, name):
            return p
    return None


_CONFIG_KEYS = ("bits", "group_size", "symmetric")


def check_rules(default: QuantConfig, skip: Iterable[str] = (), overrides: Optional[dict] = None) -> None:
    """ValueError naming the rule unless every skip pattern and override is usable.

    skip: regular expressions; overrides: {regex: {bits/group_size/symmetric: value}},
    each override merged into ``default`` must be a valid QuantConfig.  Run before
    any work, so that a bad rule is not found after half a model is quantized.
    """
    for p in skip:
        try:
            re.compile(p)
        except (re.error, TypeError) as e:
            raise ValueError(f"skip pattern {p!r} is not a regular expression: {e}") from None
    for p, kw in (overrides or {}).items():
        try:
            re.compile(p)
        except (re.error, TypeError) as e:
            raise ValueError(f"override pattern {p!r} is not a regular expression: {e}") from None
        if not isinstance(kw, dict) or any(k not in _CONFIG_KEYS for k in kw):
            raise ValueError(f"override {p!r}: expected a dict with keys from {_CONFIG_KEYS}, got {kw!r}")
        try:
            _merged(default, kw)
        except ValueError as e:
            raise ValueError(f"override {p!r}: {e}") from None


def _merged(default: QuantConfig, kw: dict) -> QuantConfig:
    d = dict(bits=default.bits, group_size=default.group_size, symmetric=default.symmetric)
    d.update(kw)
    return QuantConfig(**d)


def layer_format(name: str, linear: nn.Linear, default: QuantConfig, skip: Iterable[str] = (),
                 overrides: Optional[dict] = None, group_fallback: bool = False):
    """The format one linear is quantized in, or why it stays in float.

    The one rule shared by :func:`quantize_model` and calibration: a module
    whose qualified ``name`` matches a ``skip`` regex stays float; otherwise
    the first matching ``overrides`` regex (merged into ``default``) gives its
    format, else ``default``.  With ``group_fallback`` a group size that does
    not divide in_features becomes the largest of 128 / 64 / 32 that does.  A
    layer that still does not fit (K % 8, K % group), or whose weights are so
    small that a scale would underflow fp16 (:func:`formats.tiny_weight_groups`),
    stays float.  Returns (QuantConfig, None) or (None, reason).
    """
    pat = _matches(name, skip)
    if pat is not None:
        return None, f"matches skip pattern {pat!r}"
    cfg = default
    op = _matches(name, overrides or {})
    if op is not None:
        cfg = _merged(default, overrides[op])
    k = linear.in_features
    if group_fallback and cfg.group_size and k % cfg.group_size != 0:
        g = formats.fallback_group_size(k, cfg.group_size)
        if g is not None:
            cfg = QuantConfig(cfg.bits, g, cfg.symmetric)
    if k % 8 != 0 or (cfg.group_size and k % cfg.group_size != 0):
        return None, f"in_features={k} does not fit {cfg.name}"
    if not linear.weight.is_meta:
        tiny, total = formats.tiny_weight_groups(linear.weight, cfg)
        if tiny:
            return None, (f"weights too small for {cfg.name}: {tiny} of {total} scale groups would need a scale "
                          "below 2^-24 (the smallest fp16) and quantize to zero; kept in float")
    return cfg, None


def quantize_model(
    model: nn.Module,
    bits: int = 8,
    group_size: Optional[int] = None,
    symmetric: bool = True,
    skip: Iterable[str] = ("lm_head",),
    overrides: Optional[dict] = None,
    progress: bool = False,
    group_fallback: bool = False,
    device=None,
) -> QuantizeReport:
    """Replace every ``nn.Linear`` in ``model`` by a RTN :class:`QuantLinear`, in place.

    Args:
        bits, group_size, symmetric: the default format (see QuantConfig).
        skip: regular expressions searched in each module's qualified name;
            matching layers stay nn.Linear.
        overrides: {regex: dict(bits=..., group_size=..., symmetric=...)} for
            per-module formats (first match wins).
        progress: show a tqdm bar.
        group_fallback: when group_size does not divide a layer's in_features,
            use the largest of 128/64/32 that does instead of skipping it.
        device: quantize each weight on this device (e.g. "cuda"), one layer
            at a time; the packed tensors go back to the layer's own device.
            None: where the weight is.
    Layers that stay float, and why, are in the report (see :func:`layer_format`).
    Returns:
        A QuantizeReport (converted / skipped layers, bytes before and after).
    """
    t0 = time.time()
    report = QuantizeReport()
    skip = tuple(skip)
    default = QuantConfig(bits, group_size, symmetric)  # validate early, before touching the model
    check_rules(default, skip, overrides)
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    it = targets
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(targets, desc="quantize", unit="layer")
    for name, lin in it:
        cfg, why = layer_format(name, lin, default, skip, overrides, group_fallback)
        if cfg is None:
            report.skipped[name] = why
            continue
        q = QuantLinear.from_linear(lin, cfg.bits, cfg.group_size, cfg.symmetric, name=name, device=device)
        report.bytes_before += lin.weight.numel() * lin.weight.element_size()
        report.bytes_after += formats.nbytes(q.qweight, q.scales, q.zeros)
        set_submodule(model, name, q)
        report.converted.append(name)
    report.seconds = time.time() - t0
    return report


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


__all__ = ["QuantLinear", "QuantizeReport", "quantize_model", "layer_format", "check_rules", "set_submodule"]


# --------------------------------------------------------------------------
# Exact fusion: several linears that read the same input -> one module.
# --------------------------------------------------------------------------
def _same_perm(a: QuantLinear, b: QuantLinear) -> bool:
    return (a.perm is None and b.perm is None) or (
        a.perm is not None and b.perm is not None and torch.equal(a.perm, b.perm))


def _same_format(mods: Sequence[nn.Module]) -> bool:
    first = mods[0]
    return all(
        type(m) is type(first) and m.in_features == first.in_features and (m.bias is None) == (first.bias is None)
        and (not isinstance(m, QuantLinear) or (m.config == first.config and _same_perm(m, first)))
        and (isinstance(m, QuantLinear) or m.weight.dtype == first.weight.dtype)
        for m in mods
    )


def fuse_linears(mods: Sequence[nn.Module]) -> Optional[nn.Module]:
    """One module computing ``torch.cat([m(x) for m in mods], -1)``, or None where they cannot be fused.

    QuantLinears of one format (and one input permutation): their packed rows
    are taken out of the panel order, concatenated and put back (``formats.to_panels``), scales, zero
    points and biases concatenated: the result is exact, bit for bit.
    ``nn.Linear``s of one dtype: one ``nn.Linear`` over the concatenated
    weights.  Mixed kinds or formats: None (the caller calls each).
    """
    if not _same_format(mods):
        return None
    first = mods[0]
    k, n = first.in_features, sum(m.out_features for m in mods)
    bias = None if first.bias is None else torch.cat([m.bias.detach() for m in mods])
    if isinstance(first, QuantLinear):
        rows = torch.cat([formats.to_panels(m.qweight, inverse=True) for m in mods])
        fused = QuantLinear(k, n, first.bits, first.group_size, first.config.symmetric, bias=bias is not None,
                            device="meta", bias_dtype=bias.dtype if bias is not None else torch.float16)
        fused.qweight = formats.to_panels(rows)
        fused.scales = torch.cat([m.scales for m in mods])
        if first.zeros is not None:
            fused.zeros = torch.cat([m.zeros for m in mods])
        if bias is not None:
            fused.bias = bias
        if first.perm is not None:
            fused.perm = first.perm
        return fused
    if isinstance(first, nn.Linear):
        w = first.weight
        fused = nn.Linear(k, n, bias=bias is not None, device="meta", dtype=w.dtype)
        fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in mods]), requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias, requires_grad=False)
        return fused
    return None


# --------------------------------------------------------------------------
# Fused projections: one packed weight and one launch for q/k/v (and gate/up).
# --------------------------------------------------------------------------
class FusedQuantLinear(nn.Module):
    """Several linears that read the same input, packed as one QuantLinear.

    ``members`` keeps the original modules' API: each member is a
    :class:`FusedSlice` that stands where the original linear stood (q_proj,
    k_proj, ...).  The first member called with an input runs the one fused
    GEMV and caches the output; the others return their slice of it when they
    see the same input tensor (and recompute otherwise, so a changed call
    order costs speed, never correctness).  Slices are views of the fused
    output [..., sum(sizes)] (strided along the last dimension), not copies.
    """

    def __init__(self, fused: QuantLinear, sizes: list):
        super().__init__()
        self.fused = fused
        self.sizes = list(sizes)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._x = None
        self._y = None

    @classmethod
    def from_linears(cls, linears: list, bits: int, group_size: Optional[int], symmetric: bool = True,
                     name: str = "fused") -> "FusedQuantLinear":
        k = linears[0].in_features
        if any(lin.in_features != k for lin in linears):
            raise ValueError(f"{name}: fused linears must share in_features")
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError(f"{name}: fused linears must all have a bias or none")
        w = torch.cat([lin.weight.detach() for lin in linears], 0)
        big = nn.Linear(k, w.shape[0], bias=all(has_bias), device="meta")
        cfg = QuantConfig(bits, group_size, symmetric)
        qw, s, z = formats.quantize(w, cfg, name)
        q = QuantLinear.from_quantized(big, cfg, qw, s, z)
        if all(has_bias):
            q.bias = torch.cat([lin.bias.detach() for lin in linears], 0)
        return cls(q, [lin.out_features for lin in linears])

    def slice_output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self._x is not x:
            self._x = x
            self._y = self.fused(x)
        o = self.offsets[i]
        out = self._y[..., o : o + self.sizes[i]]  # a view: the fused output is never copied
        if i == len(self.sizes) - 1:  # last member: drop the cache
            self._x = self._y = None
        return out


class FusedSlice(_StoredFormat, nn.Module):
    """Stands in for one member linear of a FusedQuantLinear."""

    def __init__(self, parent: FusedQuantLinear, index: int):
        super().__init__()
        # a plain attribute (not a submodule): the parent is registered once, on the owner
        object.__setattr__(self, "_parent", parent)
        self.index = index
        self.in_features = parent.fused.in_features
        self.out_features = parent.sizes[index]

    @property
    def parent(self) -> "FusedQuantLinear":
        """The FusedQuantLinear this is a slice of (its ``fused`` QuantLinear holds the packed rows)."""
        return self._parent

    @property
    def config(self) -> QuantConfig:  # the format it is stored in: the fused weight's
        return self._parent.fused.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._parent.slice_output(self.index, x)

    def extra_repr(self) -> str:
        return f"slice {self.index} of fused {self._parent.fused.out_features}, out_features={self.out_features}"


FUSE_GROUPS = arch.FUSE_GROUPS  # owner attribute -> member linears, in the order the owner calls them


def fuse_llama_projections(model: nn.Module, bits: int = 8, group_size: Optional[int] = None,
                           symmetric: bool = True) -> int:
    """Replace q/k/v and gate/up of every Llama-style block with fused QuantLinears, in place.

    The attention and MLP modules keep their attributes (q_proj, ...), now
    FusedSlice modules over one packed weight stored as ``<owner>.qkv`` /
    ``<owner>.gate_up``.  Members that are ``nn.Linear`` are quantized
    (bits / group_size / symmetric); members that are QuantLinears of one
    format are fused exactly (:func:`fuse_linears`).  Returns the number of
    fused groups.  Run it before :func:`quantize_model` to quantize the rest.
    """
    count = 0
    for owner_name, owner in list(model.named_modules()):
        for fused_name, members in FUSE_GROUPS.items():
            lins = [getattr(owner, m, None) for m in members]
            if all(isinstance(m, QuantLinear) for m in lins):  # quantized already: their packed rows, exactly
                fused = fuse_linears(lins)
                if fused is None:
                    continue  # members of different formats stay apart
                f = FusedQuantLinear(fused, [m.out_features for m in lins])
            elif all(type(m) is nn.Linear for m in lins):
                g = formats.fallback_group_size(lins[0].in_features, group_size)
                f = FusedQuantLinear.from_linears(lins, bits, g, symmetric, name=f"{owner_name}.{fused_name}")
            else:
                continue
            setattr(owner, fused_name, f)
            for i, m in enumerate(members):
                setattr(owner, m, FusedSlice(f, i))
            count += 1
    return count


__all__ += ["FusedQuantLinear", "FusedSlice", "fuse_linears", "fuse_llama_projections"]
