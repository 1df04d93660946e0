"""Generation engine: a static KV cache, prefill, and a decode step captured once per batch size in a CUDA graph.

    import qgemv
    model, tok = qgemv.checkpoint.load_quantized("runs/q4", device="cuda")
    out = qgemv.generate(model, tok, ["The capital of France is"], max_new_tokens=32)
    print(out.texts[0], out.decode_tokens_per_s)

    qgemv-generate runs/q4 --prompt "The capital of France is" --max-new-tokens 32

The engine reads a transformers causal LM of the Llama family (its modules
and their weights; transformers' own forward is never called): Llama 2/3
(with llama3 rope scaling), Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k
RMSNorm), SmolLM2 (tied embeddings), GQA throughout.  The linears may be
``nn.Linear`` (the fp16 / bf16 baseline) or :class:`qgemv.QuantLinear`; q/k/v
and gate/up are fused into one weight each (exact: the packed panels are
concatenated, no requantization), so each is one GEMV launch.

Per step the engine runs the decoder in plain torch ops around the linears:
RMSNorm, RoPE from the model's own rotary module (tabulated once for every
cache slot), the cache write, SDPA over the whole static cache with a mask,
SwiGLU.  Before an act-order projection the residual add, the RMSNorm and
the gather of its output into the projection's input order are one op,
``qgemv::add_rms_gather`` (one CUDA kernel).  On a GPU the decode step (one
token per sequence) is captured in a CUDA graph on its first use for each
batch size and replayed afterwards; on a CPU the same code runs eagerly on
the reference kernels.

Batches of prompts of different lengths are left-padded: every sequence
writes the same cache slot at each step, padded slots are masked out, and
each sequence's rotary positions start at 0 at its first real token, so a
sequence gets the tokens it gets alone (up to floating-point rounding of the
batched kernels).
"""

from __future__ import annotations

import contextlib
import math
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as Fn

from . import _ext, ops
from .arch import ARCHITECTURES, ATTN, DOWN, FUSE_GROUPS, IN_NORM, K_NORM, MLP, O, POST_NORM, Q_NORM
from .nn import FusedSlice, QuantLinear, fuse_linears

SUPPORTED_ARCHITECTURES = ARCHITECTURES
# rope types whose cos/sin depend only on the position (tabulated once); the
# "dynamic" and "longrope" types rescale with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The model is not one the engine can run (architecture, activation, rope type)."""


class _Projection:
    """Several linears on one input, as one call where they fuse; outputs are views of one tensor."""

    def __init__(self, mods: Sequence[nn.Module]):
        self.sizes = [m.out_features for m in mods]
        parents = {id(m.parent) for m in mods if isinstance(m, FusedSlice)}
        if len(parents) == 1 and all(isinstance(m, FusedSlice) and m.index == i for i, m in enumerate(mods)) \
                and mods[0].parent.sizes == self.sizes:
            self.fused = mods[0].parent.fused  # fused already (nn.fuse_llama_projections): its one module
        else:
            self.fused = fuse_linears(mods)
        self.mods = list(mods) if self.fused is None else None
        # An act-order input permutation of the one fused QuantLinear (int32): the engine gathers x inside
        # the norm that produces it (ops.add_rms_gather) and calls the linear's forward_gathered.  Its
        # values are checked by the QuantLinear on its first call (prefill), before any graph capture.
        perm = getattr(self.fused, "perm", None) if isinstance(self.fused, QuantLinear) else None
        self.perm = None if perm is None else perm.to(torch.int32).contiguous()

    def __call__(self, x: torch.Tensor, gathered: bool = False) -> list:
        if self.fused is None:
            return [m(x) for m in self.mods]
        y = self.fused.forward_gathered(x) if gathered and self.perm is not None else self.fused(x)
        return list(y.split(self.sizes, -1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, operation for operation: fp32 statistics, the normalized value cast back to
    x's dtype, then the gain: x [..., H], weight [H] -> [..., H]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it: x cos + rotate_half(x) sin, x [..., D], cos / sin broadcast to it."""
    d = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., d:], x[..., :d]), -1) * sin)


# The glue between the linears and attention: everything in a layer that is
# neither.  Eager, each function is several small kernels; on a GPU the decode
# step uses them through torch.compile (one or two fused kernels each,
# compiled once per batch size and shared by every layer; see _compiled_glue).
def glue_add_rms(x, delta, w, eps: float):
    """Residual add, then the next RMSNorm: (x + delta, rms(x + delta) * w)."""
    x = x + delta
    return x, rms_norm(x, w, eps)


def glue_add_rms_gather(x, delta, w, perm, eps: float):
    """glue_add_rms with the normalized output's features gathered by ``perm`` (an act-order linear's input
    order): (x + delta, (rms(x + delta) * w)[..., perm]).  The engine runs it as one kernel,
    qgemv::add_rms_gather (torch.compile makes two of it: the norm, then the gather); this eager form
    serves a norm weight of another dtype than the activations."""
    x = x + delta
    return x, rms_norm(x, w, eps).index_select(-1, perm)


def glue_attention_in(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm, k_norm, eps: float):
    """q/k RMSNorm (Qwen3), RoPE, and the cache write of k and v at ``slots``; returns q [B, H, T, D].

    q [B, T, H, D], k / v [B, T, Hkv, D] (views of the fused projection);
    cos / sin [B, 1, T, D]; k_cache / v_cache [B, Hkv, S, D], written in place.
    """
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    k_cache.index_copy_(2, slots, apply_rope(k.transpose(1, 2), cos, sin))
    v_cache.index_copy_(2, slots, v.transpose(1, 2))
    return apply_rope(q.transpose(1, 2), cos, sin)


def glue_swiglu(gate, up):
    return Fn.silu(gate) * up


EAGER_GLUE = dict(add_rms=glue_add_rms, attention_in=glue_attention_in, swiglu=glue_swiglu)
_COMPILED = {}  # pdl (bool) -> the glue's compiled functions


def _compiled_glue(pdl: bool = False) -> dict:
    """EAGER_GLUE through torch.compile (static shapes; compiled on first call per shape).  pdl: Triton kernels
    that take part in programmatic dependent launch (inductor's triton.enable_pdl: each waits for the kernel
    before it where it reads what that one wrote, and lets the next one launch early); compiled from copies of
    the functions, since dynamo keeps its compiled code on the function's code object."""
    if pdl not in _COMPILED:
        # one compile per (batch size, dtype, model width): more than dynamo's default of 8 in a process
        # that runs several models (the benchmark); past the limit it would fall back to eager silently
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 64))
        glue = {}
        for k, fn in EAGER_GLUE.items():
            if pdl:  # (pdl_refusal: this torch's inductor has triton.enable_pdl)
                fn = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                        fn.__closure__)
            glue[k] = torch.compile(fn, dynamic=False, fullgraph=True,
                                    options={"triton.enable_pdl": True} if pdl else None)
        _COMPILED[pdl] = glue
    return _COMPILED[pdl]


@dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: _Projection
    o_proj: nn.Module
    gate_up: _Projection
    down_proj: nn.Module
    q_norm: Optional[torch.Tensor] = None
    k_norm: Optional[torch.Tensor] = None


@dataclass
class Generation:
    """What :meth:`Engine.generate` returns.

    tokens: the new token ids of each prompt (stopped at EOS, which is
    included, or at a stop string); texts: their decoded text (a stop
    string and what follows it cut off; None without a tokenizer).
    """

    tokens: list
    texts: Optional[list]
    prompt_tokens: int
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float
    batch: int
    graphs: bool
    finish_reasons: list = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second over the decode steps, all sequences of the batch counted."""
        return self.batch * self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else float("nan")

    def summary(self) -> str:
        return (f"prefill: {self.prompt_tokens} tokens, {self.prefill_tokens_per_s:.1f} tok/s; "
                f"decode: {self.decode_steps} steps x batch {self.batch}, {self.ms_per_step:.2f} ms/step, "
                f"{self.decode_tokens_per_s:.1f} tok/s ({'CUDA graph' if self.graphs else 'eager'})")


def check_stop(stop) -> tuple:
    """The stop strings as a tuple: one str is one stop string; each must be a non-empty str."""
    if isinstance(stop, str):
        stop = (stop,)
    try:
        stop = tuple(stop)
    except TypeError:
        raise TypeError(f"stop must be a str or a sequence of str, got {type(stop).__name__}") from None
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__} {s!r}")
        if s == "":
            raise ValueError("an empty stop string would end every sequence at once; drop it")
    return stop


def printable_prefix(text: str, stop: Sequence[str]) -> int:
    """How much of ``text`` can be shown while it grows: up to the first stop string, and short of
    any tail that could still become one."""
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    if cut >= 0:
        return cut
    for start in range(max(0, len(text) - max((len(s) for s in stop), default=0) + 1), len(text)):
        if any(s.startswith(text[start:]) for s in stop):
            return start
    return len(text)


def _launch_linears(layer) -> tuple:
    """A decoder layer's four linears as the persistent launch runs them: (name, module) pairs."""
    return (("q/k/v", layer.qkv.fused), ("o_proj", layer.o_proj), ("gate/up", layer.gate_up.fused),
            ("down_proj", layer.down_proj))


def megakernel_refusal(engine: "Engine") -> str:
    """Why ``engine``'s batch-1 decode step cannot run as one persistent launch ("" when it can): the model
    first (checkable anywhere), then the GPU and the build."""
    from . import _ext, persist

    h, hk, d = engine.heads, engine.kv_heads, engine.head_dim
    if hk < 1 or h % hk or h // hk > 8:
        return f"{h} query heads over {hk} kv heads: needs at most 8 query heads a kv head"
    if d not in (32, 64, 128):
        return f"head_dim {d}: the launch runs 32, 64 or 128"
    fmt = None
    for i, L in enumerate(engine.layers):
        for name, m in _launch_linears(L):
            # fp16 / bf16 weights of the activations' type: the baseline's chain
            plain = type(m) is nn.Linear and m.weight.dtype == engine.dtype and m.weight.dtype in persist.DTYPES
            if not isinstance(m, QuantLinear) and not plain:
                what = type(m).__name__ if m is not None else "not fused"
                if isinstance(m, nn.Linear):
                    what += f" of {m.weight.dtype}"
                return (f"layer {i} {name}: {what}, not one qgemv QuantLinear or nn.Linear of the activations' "
                        f"type (the launch runs int4, int8, or float16 / bfloat16 weights)")
            if m.bias is not None and name != "q/k/v":  # q/k/v's (Qwen2's) is added in the launch
                return f"layer {i} {name}: a bias is not in the launch (only q/k/v's)"
            f = ("bf16" if m.weight.dtype == torch.bfloat16 else "fp16") if plain else m.packed.format
            if f not in persist.FORMATS:
                return f"layer {i} {name}: format {f}; the launch runs {', '.join(persist.FORMATS)}"
            if fmt is not None and f != fmt:
                return f"layer {i} {name}: format {f} after {fmt}; the launch runs one format"
            fmt = f
    if engine.dtype not in persist.DTYPES:
        return f"needs float16 or bfloat16 activations, the model runs {engine.dtype}"
    if engine.device.type != "cuda":
        return f"needs a CUDA device, the model is on {engine.device}"
    if torch.cuda.get_device_capability(engine.device)[0] != 9:
        return "needs compute capability 9.x (bulk copies, mbarriers)"
    if _ext.MODULE is None or not hasattr(_ext.MODULE, "persist"):
        return f"needs the CUDA extension built from this version ({_ext.REASON or 'stale build'})"
    return ""


def megakernel_copy_bytes(engine: "Engine") -> int:
    """Bytes of GPU memory the persistent launch adds beside the per-op path's weights: its own copy of every
    weight it cannot read as the per-op path stores it (q/k/v with its rows permuted for the rotation; fp16 /
    bf16 re-laid in panels; any K padded to whole tiles), and grouped int4's scales and zero points in tile order
    (16 (2 or 3) x 128 / G bytes a 1 KB tile of codes: 3-19% of the codes).  Other int4 / int8 codes are read
    in place."""
    from . import persist

    total = 0
    for L in engine.layers:
        for name, m in _launch_linears(L):
            if isinstance(m, QuantLinear):
                cfg, size = m.packed.config, m.packed.nbytes
                copied = name == "q/k/v" or m.in_features % persist.TILE_K[cfg.bits] != 0
                total += size if copied else 0
                if cfg.group_size:  # (N / 16) x (K / 128) tiles, K padded to whole tiles
                    tiles = m.out_features // 16 * -(-m.in_features // 128)
                    total += tiles * 16 * (128 // cfg.group_size) * (2 if cfg.symmetric else 3)
            elif m is not None:
                total += m.weight.numel() * m.weight.element_size()
    return total


def megakernel_memory_refusal(engine: "Engine", free: int) -> str:
    """Why the persistent launch's copy of the weights (:func:`megakernel_copy_bytes`) does not fit ``free``
    bytes of GPU memory with 512 MiB to spare ("" when it does)."""
    need = megakernel_copy_bytes(engine)
    if need + (512 << 20) <= free:
        return ""
    return (f"its copy of the weights in the launch's layout ({need / 2**30:.2f} GiB) does not fit the GPU's free "
            f"memory ({free / 2**30:.2f} GiB, 0.5 GiB kept spare)")


def decode_attention_refusal(engine: "Engine") -> str:
    """Why the engine's per-op decode step cannot run qgemv.ops.decode_attention's CUDA kernel ("" when it
    can): it needs a CUDA device of compute capability 8.0 or later with the compiled extension, float16 /
    bfloat16 activations, head_dim 64 / 96 / 128 and up to 16 query heads a kv head.  Elsewhere the step
    runs SDPA over the whole cache."""
    if engine.device.type != "cuda":
        return f"the model is on {engine.device}, not a CUDA device"
    if _ext.BACKEND not in ("aot", "jit"):
        return f"the CUDA extension is not loaded ({_ext.REASON})"
    if engine.dtype not in (torch.float16, torch.bfloat16):
        return f"activations are {engine.dtype}, not float16 or bfloat16"
    if engine.head_dim not in ops.DECODE_ATTN_HEAD_DIMS:
        return f"head_dim is {engine.head_dim}, not one of {ops.DECODE_ATTN_HEAD_DIMS}"
    if engine.heads % engine.kv_heads or engine.heads // engine.kv_heads > ops.DECODE_ATTN_MAX_GROUP:
        return (f"{engine.heads} query heads over {engine.kv_heads} kv heads: more than "
                f"{ops.DECODE_ATTN_MAX_GROUP} a kv head")
    cap = torch.cuda.get_device_capability(engine.device)
    if cap < (8, 0):
        return f"compute capability {cap[0]}.{cap[1]} (the kernel needs 8.0 or later)"
    return ""


def pdl_refusal(engine: "Engine") -> str:
    """Why ``engine``'s per-op decode step cannot run as programmatic dependent launches ("" when it can): a
    CUDA device of compute capability 9.0 or later with the compiled extension."""
    if engine.device.type != "cuda":
        return f"the model is on {engine.device}, not a CUDA device"
    if _ext.BACKEND not in ("aot", "jit"):
        return f"the CUDA extension is not loaded ({_ext.REASON})"
    cap = torch.cuda.get_device_capability(engine.device)
    if cap < (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (programmatic launches need 9.0 or later)"
    if engine.compile_glue:
        import torch._inductor.config as inductor

        if not hasattr(inductor.triton, "enable_pdl"):
            return f"torch {torch.__version__}'s inductor has no triton.enable_pdl (the compiled glue's part)"
    return ""


class Engine:
    """Runs a Llama-family transformers model with a static KV cache (see the module docstring).

    model: a ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``
    / ``Qwen3ForCausalLM`` whose linears are ``nn.Linear`` or ``QuantLinear``,
    on one device; activations run in its embedding's dtype (float16 /
    bfloat16 on a GPU, float32 on a CPU).  max_seq_len: cache slots (prompt
    plus new tokens; default the model's max_position_embeddings, capped at
    4096 and at a sliding window).  cuda_graphs: capture the decode step (on
    CUDA only; default True).  compile_glue: run the decode step's glue
    (norms, RoPE, cache write, SwiGLU) through torch.compile (on CUDA only;
    default True; eager, with one warning, if compiling fails).
    megakernel: run each batch-1 decode step's decoder layers as one
    persistent launch (:class:`qgemv.persist.PersistentChain` with its
    attention): float16 or bfloat16 activations, int4 / int8 weights in
    one of qgemv.persist.FORMATS (act-order too) or 16-bit weights of the
    activations' type (nn.Linear),
    biases on q/k/v only (Qwen2's), q/k norms (Qwen3's), compute capability
    9.x.  None (the default): wherever the model and the GPU allow it; True:
    asked for, so a refusal warns once; False: never.  Where it does not
    run, the per-op path does and ``megakernel_reason`` says why.  Prefill
    and batches above 1 stay per-op; the per-op decode step's attention
    reads each sequence's visible cache slots only
    (:func:`qgemv.ops.decode_attention`; attribute ``decode_attention``,
    True where its kernel runs, else SDPA over the whole cache).  The
    launch keeps its own copy of the weights it cannot read in place (:func:`megakernel_copy_bytes`: q/k/v,
    16-bit weights, grouped scales in tile order), built at the first
    batch-1 decode step, and falls back where that does not fit the GPU's
    free memory.
    """

    def __init__(self, model: nn.Module, tokenizer=None, max_seq_len: Optional[int] = None,
                 cuda_graphs: bool = True, compile_glue: bool = True, megakernel: Optional[bool] = None):
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch}: the engine runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        cfg = model.config
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch}: hidden_act {act!r} is not supported (silu only)")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{arch}: rope type {rope_type!r} depends on the sequence length; supported: {STATIC_ROPE_TYPES}")
        self.model, self.tokenizer, self.arch = model, tokenizer, arch
        inner = model.model
        self.embed = inner.embed_tokens
        self.vocab_size = self.embed.weight.shape[0]
        self.device, self.dtype = self.embed.weight.device, self.embed.weight.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        limit = getattr(cfg, "max_position_embeddings", 4096) or 4096
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None) or []
        if window and (arch == "MistralForCausalLM" or "sliding_attention" in layer_types):
            limit = min(limit, window)  # within the window, sliding attention is plain causal attention
        if max_seq_len is None:
            max_seq_len = min(limit, 4096)
        if not 1 < max_seq_len <= limit:
            raise ValueError(f"max_seq_len must be in 2..{limit} for this model "
                             f"(max_position_embeddings / sliding window), got {max_seq_len}")
        self.max_seq_len = int(max_seq_len)
        self.layers = []
        for layer in inner.layers:
            a, m = getattr(layer, ATTN), getattr(layer, MLP)
            qn, kn = getattr(a, Q_NORM, None), getattr(a, K_NORM, None)
            self.layers.append(_Layer(
                in_norm=getattr(layer, IN_NORM).weight, post_norm=getattr(layer, POST_NORM).weight,
                qkv=_Projection([getattr(a, n) for n in FUSE_GROUPS["qkv"]]), o_proj=getattr(a, O),
                gate_up=_Projection([getattr(m, n) for n in FUSE_GROUPS["gate_up"]]),
                down_proj=getattr(m, DOWN),
                q_norm=qn.weight if qn is not None else None, k_norm=kn.weight if kn is not None else None))
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head
        with torch.no_grad():
            slots = torch.arange(self.max_seq_len, device=self.device)[None]
            probe = torch.empty(0, device=self.device, dtype=self.dtype)
            cos, sin = inner.rotary_emb(probe, slots)  # [1, S, head_dim], in self.dtype
        self.cos, self.sin = cos[0], sin[0]
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.compile_glue = bool(compile_glue) and self.device.type == "cuda"
        # on where it can run, with the glue compiled (beside eager torch kernels it cost ~3%: the pdl property)
        self._pdl = self.compile_glue and not pdl_refusal(self)
        self._pdl_mode = 7  # the GEMVs' and decode_attention's set_gemv_pdl mode while pdl is on (0: the glue only)
        self._glue = _compiled_glue(self._pdl) if self.compile_glue else EAGER_GLUE
        self._decode_attention = not decode_attention_refusal(self)
        self._rope_attention = self._decode_attention and not self._rope_refusal()
        if megakernel not in (None, True, False):
            raise TypeError(f"megakernel: expected None, True or False, got {megakernel!r}")
        self._megakernel_asked = megakernel is True
        self.megakernel, self.megakernel_reason, self._chain = megakernel is not False, "", None
        if self.megakernel:
            why = megakernel_refusal(self)
            if why:
                self._megakernel_off(why)
        else:
            self.megakernel_reason = "megakernel=False"
        self._cache = {}  # batch -> (k [L, B, Hkv, S, D], v)
        self._graphs = {}  # batch (or (1, octets): _step_key) -> (graph, static inputs, static logits)
        self._pool = None
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    @property
    def decode_attention(self) -> bool:
        """Whether the per-op decode step runs qgemv.ops.decode_attention (each sequence's visible cache
        slots only) instead of SDPA over the whole cache: True wherever its kernel runs.  Settable (to
        compare the two; a batch size's CUDA graph keeps the one it was captured with); True where the
        kernel cannot run is refused with the reason."""
        return self._decode_attention

    @decode_attention.setter
    def decode_attention(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"decode_attention: expected True or False, got {on!r}")
        why = decode_attention_refusal(self) if on else ""
        if why:
            raise ValueError(f"decode_attention cannot run here: {why}")
        self._decode_attention = on

    @property
    def rope_attention(self) -> bool:
        """Whether the per-op decode step runs each layer's q / k norms, RoPE and cache write inside its attention
        kernel (qgemv.ops.rope_decode_attention: one kernel a layer where the glue and decode_attention are two;
        H100, batch 16, ms a step without -> with it: Llama-2-7B 5.064 -> 4.971, Llama-3-8B 3.995 -> 3.858).
        On wherever decode_attention runs and every q / k norm has the activations' dtype; settable (the A/B).
        A batch size's CUDA graph keeps the form it was captured with."""
        return self._rope_attention and self._decode_attention

    def _rope_refusal(self) -> str:
        why = decode_attention_refusal(self) or ("decode_attention is off" if not self._decode_attention else "")
        odd = [i for i, L in enumerate(self.layers) if L.q_norm is not None and
               (L.q_norm.dtype != self.dtype or L.k_norm.dtype != self.dtype)]
        if odd and not why:
            why = f"layer {odd[0]}'s q / k norm weights are not {self.dtype}"
        return why

    @rope_attention.setter
    def rope_attention(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"rope_attention: expected True or False, got {on!r}")
        why = self._rope_refusal() if on else ""
        if why:
            raise ValueError(f"rope_attention cannot run here: {why}")
        self._rope_attention = on

    @property
    def pdl(self) -> bool:
        """Whether the per-op decode step runs as programmatic dependent launches: the GEMVs and decode_attention
        (qgemv.set_gemv_pdl(7) while the step is captured or run) and the compiled glue's Triton kernels
        (inductor's triton.enable_pdl), so that each kernel launches while the one before it ends.  On by
        default where :func:`pdl_refusal` allows it (compute capability 9.0 or later, the extension loaded) and
        the glue is compiled: on the H100 it took 1-4% off a per-op step at batch 1 and 16 (BENCHMARKS.md,
        "Generation engine"); our kernels alone as programmatic launches among eager torch kernels cost 1-3%,
        so it is off where the glue is not compiled.  Settable (False: ordinary launches).  A batch size's CUDA
        graph keeps the mode it was captured with."""
        return self._pdl

    @pdl.setter
    def pdl(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"pdl: expected True or False, got {on!r}")
        why = pdl_refusal(self) if on else ""
        if why:
            raise ValueError(f"pdl cannot run here: {why}")
        self._pdl = on
        if self.compile_glue and self._glue is not EAGER_GLUE:
            self._glue = _compiled_glue(on)

    @contextlib.contextmanager
    def _launch_mode(self):
        """The step's kernels launched as the pdl property says (the GEMVs' and decode_attention's mode is
        process-wide: set here, the mode in force before restored after)."""
        if not self._pdl:
            yield
            return
        before = _ext.MODULE.gemv_pdl_flags()  # (0: the default, off)
        _ext.set_gemv_pdl(self._pdl_mode)
        try:
            yield
        finally:
            _ext.set_gemv_pdl(before or -1)

    # ---------------------------------------------------------------- model
    def _kv(self, batch: int):
        if batch not in self._cache:
            shape = (len(self.layers), batch, self.kv_heads, self.max_seq_len, self.head_dim)
            self._cache[batch] = (torch.zeros(shape, device=self.device, dtype=self.dtype),
                                  torch.zeros(shape, device=self.device, dtype=self.dtype))
        return self._cache[batch]

    def _megakernel_off(self, why: str) -> None:
        self.megakernel, self.megakernel_reason = False, why
        if self._megakernel_asked:  # the default falls back quietly; the reason stays in megakernel_reason
            warnings.warn(f"qgemv.engine: megakernel off, running the per-op path: {why}")

    def _megachain(self):
        """The batch-1 decode step's persistent launch (built on first use; None where it is refused)."""
        if self._chain is None and self.megakernel:
            from . import persist

            def weight(m):  # a QuantLinear's packed weight, or an fp16 / bf16 nn.Linear's weight tensor
                return m.packed if isinstance(m, QuantLinear) else m.weight.detach()

            k, v = self._kv(1)
            free = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device) - \
                torch.cuda.memory_allocated(self.device)  # the driver's free bytes and the allocator's idle ones
            why = megakernel_memory_refusal(self, free)
            if why:
                self._megakernel_off(why)
                return None
            try:
                bias = None  # Qwen2's q/k/v biases [layers, N], a zero row for a layer without one
                if any(L.qkv.fused.bias is not None for L in self.layers):
                    bias = torch.zeros(len(self.layers), self.layers[0].qkv.fused.out_features,
                                       dtype=self.dtype, device=self.device)
                    for row, L in zip(bias, self.layers):
                        if L.qkv.fused.bias is not None:
                            row.copy_(L.qkv.fused.bias)
                qn = kn = None  # Qwen3's per-head q / k RMSNorm gains [layers, head_dim]
                if self.layers[0].q_norm is not None:
                    qn = torch.stack([L.q_norm for L in self.layers]).to(self.dtype).contiguous()
                    kn = torch.stack([L.k_norm for L in self.layers]).to(self.dtype).contiguous()
                att = persist.Attention(self.heads, self.kv_heads, self.head_dim, self.cos, self.sin, k[:, 0], v[:, 0],
                                        scale=self.scale, qkv_bias=bias, q_norm=qn, k_norm=kn, qk_eps=self.eps)
                self._chain = persist.PersistentChain(
                    [tuple(weight(m) for m in (L.qkv.fused, L.o_proj, L.gate_up.fused, L.down_proj))
                     for L in self.layers],
                    norms=[(L.in_norm, L.post_norm) for L in self.layers], eps=self.eps, attention=att,
                    dtype=self.dtype, head=self._launch_head())
            except persist.PersistError as e:
                self._megakernel_off(str(e))
            except torch.OutOfMemoryError as e:  # the estimate missed: what was built is dropped
                self._chain = None
                torch.cuda.empty_cache()
                self._megakernel_off(f"out of GPU memory building it ({str(e).splitlines()[0]})")
        return self._chain

    def _launch_head(self):
        """The final norm, lm_head and greedy argmax for the launch (qgemv.persist.Head), or None where lm_head
        is not a bias-free nn.Linear of the activations' type (it then runs after the launch, per op)."""
        from . import persist

        lm, hidden = self.lm_head, self.norm.numel()
        w = getattr(lm, "weight", None)
        if type(lm) is not nn.Linear or lm.bias is not None or w is None or w.dtype != self.dtype or \
                self.norm.dtype != self.dtype or w.device != self.norm.device or w.dim() != 2 or \
                w.shape[1] != hidden or hidden % 8 or not w.is_contiguous() or w.data_ptr() % 16:
            return None
        return persist.Head(w.detach(), self.norm.detach(), self.eps)

    def _forward_megakernel(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """forward() for one token of one sequence through the persistent launch: logits [1, vocab] float32
        (with lm_head inside the launch: the launch's own buffer, rewritten by the next step)."""
        chain = self._chain
        chain.input.copy_(self.embed(ids)[0])
        chain.position.copy_(slots[-1:])  # the slot is the rotary position (one sequence: no padding)
        chain.run()
        if chain.head is not None:
            return chain.logits
        return self.lm_head(rms_norm(chain.output, self.norm, self.eps)).float()

    def _launch_token(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """The greedy token [1] the launch wrote with ``logits`` (its own logits buffer), else None."""
        chain = self._chain
        if chain is None or chain.head is None or logits.data_ptr() != chain.logits.data_ptr():
            return None
        return chain.token

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, slots: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] (float32) of the last position.

        ids: int64 [B, T], the tokens written to cache slots ``slots`` (int64
        [T], consecutive, on the device); pad: int64 [B], each sequence's
        count of left-padding slots (masked out; its rotary positions count
        from the first real token).  Static shapes for T = 1, so the decode
        step can be captured in a CUDA graph.  A batch-1 step through the persistent launch with lm_head
        inside it returns the launch's own logits buffer, which the next step rewrites.
        """
        B, T = ids.shape
        if B == 1 and T == 1 and self.megakernel and self._megachain() is not None:
            return self._forward_megakernel(ids, slots)
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        k_cache, v_cache = self._kv(B)
        decode_attn = T == 1 and self.decode_attention
        fused = decode_attn and self._rope_attention  # rope_decode_attention: the kernel rotates by position itself
        if not fused:
            pos = (slots[None, :] - pad[:, None]).clamp(min=0)  # [B, T] rotary positions
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, T, D]
        if not decode_attn:
            keys = torch.arange(self.max_seq_len, device=ids.device)
            q_slot = slots[None, :, None]  # [1, T, 1]
            # a key is visible to a query when it is at or before the query's slot and
            # past the sequence's padding; a padded query sees itself (its output is
            # never used, and an all-masked row would be NaN)
            visible = ((keys <= q_slot) & (keys >= pad[:, None, None])) | (keys == q_slot)  # [B, T, S]
            # additive, built once per step: a boolean mask would be converted in every layer's SDPA call
            mask = torch.zeros(visible.shape, device=ids.device, dtype=self.dtype).masked_fill_(~visible,
                                                                                                float("-inf"))
            mask = mask[:, None]
        g = self._glue if T == 1 else EAGER_GLUE  # prefill runs eager: no compile per prompt length
        x = self.embed(ids)
        delta = torch.zeros_like(x)
        for i, L in enumerate(self.layers):
            x, h = self._norm(g, x, delta, L.in_norm, L.qkv.perm)
            q, k, v = L.qkv(h, gathered=True)
            if fused:  # norms, rotation, cache write and attention: one kernel
                a = ops.rope_decode_attention(q.view(B, H, D), k.view(B, Hkv, D), v.view(B, Hkv, D), k_cache[i],
                                              v_cache[i], slots, pad, self.cos, self.sin, L.q_norm, L.k_norm,
                                              self.eps, self.scale, checked=True).view(B, T, H * D)
            else:
                q = g["attention_in"](q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D), cos, sin,
                                      k_cache[i], v_cache[i], slots, L.q_norm, L.k_norm, self.eps)
                if decode_attn:  # the visible slots only (its inputs: decode_attention_refusal)
                    a = ops.decode_attention(q[:, :, 0], k_cache[i], v_cache[i], slots, pad, self.scale,
                                             checked=True).view(B, T, H * D)
                else:
                    a = Fn.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=mask, scale=self.scale,
                                                        enable_gqa=H != Hkv).transpose(1, 2).reshape(B, T, H * D)
            x, h = self._norm(g, x, L.o_proj(a), L.post_norm, L.gate_up.perm)
            gate, up = L.gate_up(h, gathered=True)
            delta = L.down_proj(g["swiglu"](gate, up))
        x = x[:, -1] + delta[:, -1]
        return self.lm_head(rms_norm(x, self.norm, self.eps)).float()

    def _norm(self, g: dict, x, delta, w, perm):
        """(x + delta, the next projection's input): the RMSNorm, gathered by the projection's perm if any."""
        if perm is None:
            return g["add_rms"](x, delta, w, self.eps)
        if w.dtype == x.dtype:
            return ops.add_rms_gather(x, delta, w, perm, self.eps, checked=True)  # perm: checked at prefill
        return glue_add_rms_gather(x, delta, w, perm, self.eps)

    def _decode(self, ids: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor,
                position: Optional[int] = None) -> torch.Tensor:
        """One decode step (ids [B, 1]); through the batch size's CUDA graph where graphs are on.  position: the
        step's cache slot as a host int (slot's value), which picks the persistent launch's kernel at batch 1: the
        one without the attention's octet form (it spills nothing) until the form's rule can take a unit, then the
        one with it (a graph each); None takes the one with it wherever the plan built it."""
        with self._launch_mode():
            return self._decode_step(ids, slot, pad, position)

    def _step_key(self, B: int, position: Optional[int]):
        """The graph's key: B, or (1, octets) where the batch-1 launch has a kernel with the octet form; sets the
        launch's kernel for this step."""
        chain = self._megachain() if B == 1 and self.megakernel else None  # (built here on the first step)
        if chain is None or not chain.octets:
            return B
        chain.step_octets = True if position is None else chain.octets_at(position)
        return (B, chain.step_octets)

    def _decode_step(self, ids: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor,
                     position: Optional[int] = None) -> torch.Tensor:
        key = self._step_key(ids.shape[0], position)
        if self._glue is not EAGER_GLUE and key not in self._graphs:
            try:  # the first call per batch size compiles the glue
                self.forward(ids, slot, pad)
            except Exception as e:  # no working compiler here: eager glue, same results up to rounding
                warnings.warn(f"qgemv.engine: torch.compile of the decode glue failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); running it eagerly")
                self._glue = EAGER_GLUE
                self.compile_glue = False
                if self._pdl:  # (our kernels alone as programmatic launches: a loss; see the pdl property)
                    self._pdl = False
                    _ext.set_gemv_pdl(-1)  # (for this call too; _launch_mode restores the mode after it)
        if not self.cuda_graphs:
            return self.forward(ids, slot, pad)
        if key not in self._graphs:
            static = (ids.clone(), slot.clone(), pad.clone())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy inits and the modules' one-time checks stay out of the graph
                    self.forward(*static)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.forward(*static)
            self._graphs[key] = (graph, static, logits)
        graph, static, logits = self._graphs[key]
        for dst, src in zip(static, (ids, slot, pad)):
            dst.copy_(src)
        graph.replay()
        return logits

    # ----------------------------------------------------------- generation
    def prefill(self, seqs: list) -> tuple:
        """Left-pad token lists to one length T and run them into cache slots 0..T-1.

        Returns (logits [B, vocab] float32 of each sequence's last token, pad
        int64 [B]); the next token of every sequence goes to slot T.
        """
        T = max(len(s) for s in seqs)
        ids = torch.tensor([[0] * (T - len(s)) + s for s in seqs], device=self.device)
        pad = torch.tensor([T - len(s) for s in seqs], device=self.device)
        return self.forward(ids, torch.arange(T, device=self.device), pad), pad

    def encode(self, prompts) -> list:
        """prompts: strings (tokenized with the tokenizer's special tokens) or lists of token ids."""
        if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids or a tokenizer")
                if not p.strip():
                    raise ValueError(f"prompt {i} is empty")
                ids = self.tokenizer(p)["input_ids"]
            else:
                ids = [int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)]
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty (no tokens)")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:  # checked here: an out-of-range id is an IndexError on the CPU, a device assert on CUDA
                raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            out.append(ids)
        return out

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop: Sequence[str] = (),
                 on_token: Optional[Callable[[int, int], None]] = None) -> Generation:
        """Generate for one prompt or a batch (see :class:`Generation`).

        temperature 0: greedy (argmax); otherwise sampled from softmax(logits /
        temperature), restricted to the top_k tokens (0: all) and to the
        smallest set whose probability reaches top_p, with a generator seeded
        by ``seed``.  A sequence stops at an EOS token of the model, at one
        of the ``stop`` strings, or after max_new_tokens.  on_token(i, id) is
        called for every token of sequence i as it is produced.
        """
        stop = self._check_sampling(max_new_tokens, temperature, top_k, top_p, stop)
        seqs = self.encode(prompts)
        B, T = len(seqs), max(len(s) for s in seqs)
        if T + max_new_tokens > self.max_seq_len:
            raise ValueError(f"the longest prompt ({T} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                             f"cache ({self.max_seq_len} slots); shorten it or raise max_seq_len")
        dev = self.device
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

        sync()
        t0 = time.perf_counter()
        logits, pad = self.prefill(seqs)
        nxt = self._sample(logits, temperature, top_k, top_p, gen)
        sync()
        t_prefill = time.perf_counter() - t0

        out = [[] for _ in range(B)]
        done = [None] * B
        steps = 0
        t1 = time.perf_counter()
        slots = torch.arange(T, T + max_new_tokens, device=dev)  # the token fed at step j goes to slot T + j
        for step in range(max_new_tokens):
            # Start this step's tokens on their way to the host, queue the next decode step, and only
            # then wait for the tokens: the GPU runs step + 1 while the host applies the stop rules
            # (with a blocking read per step, the GPU idled for the host's turn every token).
            host, ready = nxt, None
            if dev.type == "cuda":
                host = nxt.to("cpu", non_blocking=True)  # into pinned memory
                ready = torch.cuda.Event()
                ready.record()
            last = step == max_new_tokens - 1
            if not last:
                logits = self._decode(nxt[:, None], slots[step:step + 1], pad, T + step)
                # greedy through the launch: its argmax (stream order keeps each step's token until its copies
                # below and in the next _decode have read it)
                following = self._launch_token(logits) if temperature == 0 else None
                if following is None:
                    following = self._sample(logits, temperature, top_k, top_p, gen)
            if ready is not None:
                ready.synchronize()
            for i, t in enumerate(host.tolist()):
                if done[i] is not None:
                    continue
                out[i].append(t)
                if on_token is not None:
                    on_token(i, t)
                if t in self.eos_ids:
                    done[i] = "eos"
                elif stop and any(s in self.tokenizer.decode(out[i]) for s in stop):
                    done[i] = "stop"
            if last or all(d is not None for d in done):
                break  # (a step queued past the end only wrote a cache slot)
            nxt = following
            steps += 1
        sync()
        t_decode = time.perf_counter() - t1
        return Generation(tokens=out, texts=self._texts(out, stop), prompt_tokens=sum(len(s) for s in seqs),
                          prefill_seconds=t_prefill, decode_steps=steps, decode_seconds=t_decode, batch=B,
                          graphs=self.cuda_graphs, finish_reasons=[d or "length" for d in done])

    def _check_sampling(self, max_new_tokens: int, temperature: float, top_k: int, top_p: float, stop):
        """generate()'s settings, refused naming the rule; returns the checked stop strings."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not (math.isfinite(temperature) and temperature >= 0) or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"need a finite temperature >= 0, 0 < top_p <= 1, top_k >= 0; "
                             f"got {temperature}, {top_p}, {top_k}")
        stop = check_stop(stop)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        return stop

    def _texts(self, out, stop):
        """Each sequence's text (special tokens dropped), cut at the first stop string; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        texts = []
        for toks in out:
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            texts.append(text[:cut] if cut >= 0 else text)
        return texts

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B]."""
        if temperature == 0:
            return logits.argmax(-1)
        logits = logits / temperature
        if top_k > 0:
            kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            srt, idx = logits.sort(-1, descending=True)
            cum = srt.softmax(-1).cumsum(-1)
            drop = cum - srt.softmax(-1) >= top_p  # keep the smallest prefix whose mass reaches top_p
            logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
        return torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]


def generate(model: nn.Module, tokenizer, prompts, max_new_tokens: int = 64, **kwargs) -> Generation:
    """Generate with the engine: ``Engine(model, tokenizer).generate(prompts, ...)``.

    The engine (its fused projections, a KV cache and a CUDA graph per batch
    size) is kept on the model, so later calls reuse it; after changing the
    model's modules or weights, build a new :class:`Engine` (its fused
    projections are copies).  ``max_seq_len`` / ``cuda_graphs`` /
    ``compile_glue`` / ``megakernel`` go to :class:`Engine`, the rest to
    :meth:`Engine.generate`.
    """
    ekw = {k: kwargs.pop(k) for k in ("max_seq_len", "cuda_graphs", "compile_glue", "megakernel") if k in kwargs}
    engine = model.__dict__.get("_qgemv_engine")
    if engine is None or engine.tokenizer is not tokenizer or any(getattr(engine, k) != v for k, v in ekw.items()):
        engine = Engine(model, tokenizer, **ekw)
        model.__dict__["_qgemv_engine"] = engine
    return engine.generate(prompts, max_new_tokens=max_new_tokens, **kwargs)


def __getattr__(name):
    # qgemv-generate's code moved to qgemv.generate_cli; the old names still resolve there
    if name in ("main", "load_for_generation"):
        from . import generate_cli

        return getattr(generate_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
