"""qgemv inside vLLM: a quantization method that serves qgemv checkpoints on qgemv's ops.

Installed with ``pip install "qgemv[vllm]"``, which declares the entry point
``qgemv = qgemv.vllm_plugin:register`` in vLLM's ``vllm.general_plugins``
group; vLLM calls it in every process it starts, and then
``LLM(model=qdir)`` or ``vllm serve qdir`` picks the method from the
checkpoint's ``quantization_config.quant_method == "qgemv"``.

What it runs:
    * every qgemv format (int8; int4 per channel; int4 g32 / g64 / g128 with
      or without zero points), per-module overrides, modules left in float
      (vLLM's own float linear), act-order perms;
    * format versions 1-3, with q/k/v and gate/up stored fused (format 3) or
      as separate modules;
    * tensor parallelism: each rank builds its shard exactly with
      :mod:`qgemv.shard` (column-parallel on 16-row panels, row-parallel on
      group and k-block boundaries, GQA's replicated k/v heads), or refuses
      with the rule the shape breaks.  Nothing is padded.  A row-parallel
      layer whose act-order perm mixes the ranks' inputs within its groups
      (GPTQ desc_act checkpoints, converted) is split by stored groups
      instead, and each rank first gathers the whole input (one all-gather
      of tokens x K activations per call; :func:`qgemv.shard.shard_row_gathered`).

What it refuses, naming the module and the rule: MoE layers, a quantized
lm_head or embedding, a merged layer whose members are partly in float, a
shard that cannot be exact, a missing or malformed tensor.  GPTQ / AWQ /
compressed-tensors directories are not repacked inside vLLM: with
``quantization="qgemv"`` they are refused with the ``qgemv-convert`` command
that makes a qgemv checkpoint of them.

How a layer is built: vLLM hands each tensor of the checkpoint, unsharded, to
the parameter's loader (``qweight``, ``scales``, ``zeros``, ``perm``; for a
merged layer once per member, with the member's shard id).  Once a member's
tensors are all in, the loader checks them, builds the rank's shard as a
:class:`qgemv.QuantLinear` and drops the full tensors; after loading, the
members are fused into one QuantLinear where their formats and perms agree.
``apply`` calls it: qgemv's CUDA kernels on a GPU, its float32 reference on
a CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm.distributed import tensor_model_parallel_all_gather
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from . import arch, checkpoint, formats, shard
from .formats import QuantConfig
from .nn import QuantLinear, fuse_linears
from .weight import PackedWeight

# vLLM's merged layers -> (shard id, checkpoint member) in vLLM's output order,
# and qgemv's name for the fused module (format 3: "<owner>.qkv.fused").
_MEMBERS = {
    "qkv_proj": tuple(zip(("q", "k", "v"), arch.FUSE_GROUPS["qkv"])),
    "gate_up_proj": tuple(zip((0, 1), arch.FUSE_GROUPS["gate_up"])),
}
_FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
_TENSORS = ("qweight", "scales", "zeros", "perm")
_CONVERT_HINT = "convert it with `qgemv-convert SRC OUT` and serve OUT"


class _Member:
    """One checkpoint module that a vLLM layer loads: its name, format and whether it has a perm."""

    def __init__(self, shard_id, name: str, config: Optional[QuantConfig], permuted: bool, fused: bool):
        self.shard_id, self.name, self.config, self.permuted, self.fused = shard_id, name, config, permuted, fused

    def needs(self) -> set:
        need = {"qweight", "scales"}
        if self.config is not None and not self.config.symmetric:
            need.add("zeros")
        if self.permuted:
            need.add("perm")
        return need


@register_quantization_config("qgemv")
class QgemvVllmConfig(QuantizationConfig):
    """A qgemv checkpoint's ``quantization_config``, parsed and checked as :func:`qgemv.load_quantized` does."""

    def __init__(self, qc: dict):
        super().__init__()
        try:
            (self.version, self.default, self.overrides, converted, self.fused,
             self.permuted) = checkpoint.parse_quantization_config(qc, "the model")
        except checkpoint.CheckpointError as e:
            raise ValueError(f"qgemv: {e}") from None
        self.converted = set(converted)

    @classmethod
    def from_config(cls, config: dict) -> "QgemvVllmConfig":
        method = config.get("quant_method") if isinstance(config, dict) else None
        if method != "qgemv":
            raise ValueError(f"qgemv: the model's quantization_config is quant_method {method!r}, not a qgemv "
                             f"checkpoint; qgemv does not repack {method} weights inside vLLM: {_CONVERT_HINT}")
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # quantization="qgemv" on a GPTQ / AWQ / compressed-tensors directory reaches from_config, which
        # refuses it naming qgemv-convert (vLLM's own message would only say that the methods differ).
        return "qgemv" if user_quant == "qgemv" else None

    def get_name(self) -> str:
        return "qgemv"

    def get_supported_act_dtypes(self) -> list:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # sm_80: mma.sync on int4 / int8 dequantized tiles (csrc/gemv_mma.cuh)

    @staticmethod
    def get_config_filenames() -> list:
        return []  # the quantization_config block of config.json

    def get_checkpoint_weight_mapper(self):
        # format 3 stores q/k/v as "<owner>.qkv.fused.*" and gate/up as "<owner>.gate_up.fused.*";
        # vLLM's merged layers are "<owner>.qkv_proj" and "<owner>.gate_up_proj".
        from vllm.model_executor.models.utils import WeightsMapper

        return super().get_checkpoint_weight_mapper() | WeightsMapper(
            orig_to_new_substr={".qkv.fused.": ".qkv_proj.", ".gate_up.fused.": ".gate_up_proj."})

    def _format(self, name: str) -> Optional[QuantConfig]:
        return self.overrides.get(name, self.default) if name in self.converted else None

    def members(self, layer: nn.Module, prefix: str) -> list:
        """The checkpoint modules a vLLM layer at ``prefix`` loads, in its output order."""
        owner, _, attr = prefix.rpartition(".")
        if attr in _MEMBERS and isinstance(layer, (QKVParallelLinear, MergedColumnParallelLinear)):
            fused = f"{owner}.{_FUSED[attr]}"
            if fused in self.fused:
                name = f"{fused}.fused"
                return [_Member(None, name, self._format(name), name in self.permuted, True)]
            return [_Member(sid, f"{owner}.{m}", self._format(f"{owner}.{m}"), f"{owner}.{m}" in self.permuted, False)
                    for sid, m in _MEMBERS[attr]]
        return [_Member(None, prefix, self._format(prefix), prefix in self.permuted, False)]

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            members = self.members(layer, prefix)
            quantized = [m.config is not None for m in members]
            if not any(quantized):
                return UnquantizedLinearMethod()
            if not all(quantized):
                raise ValueError(f"qgemv: {prefix}: vLLM runs {', '.join(m.name for m in members)} as one layer, "
                                 f"but the checkpoint quantized only some of them; quantize all or none")
            return QgemvLinearMethod(self, prefix, members)
        kind = type(layer).__name__
        if "MoE" in kind or "Expert" in kind:
            raise ValueError(f"qgemv: {prefix} is a {kind} (mixture of experts), which qgemv does not run; "
                             f"qgemv serves dense Llama-family models")
        if prefix in self.converted:
            raise ValueError(f"qgemv: {prefix} is a {kind} stored quantized; the vLLM plugin quantizes linear "
                             f"layers only (keep embeddings and lm_head in float)")
        return None


class QgemvLinearMethod(LinearMethodBase):
    """One vLLM linear layer on qgemv: loads, shards and runs its QuantLinear(s)."""

    def __init__(self, config: QgemvVllmConfig, prefix: str, members: list):
        super().__init__()
        self.config, self.prefix, self.members = config, prefix, members
        self.by_id = {m.shard_id: m for m in members}

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list,
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        # Placeholders: each receives the checkpoint's whole tensor in its loader, which builds the rank's
        # shard itself (a packed int4 row-parallel shard is not a slice of the stored tensor).
        layer.qgemv_in_features = input_size
        layer.qgemv_pending = {}
        layer.qgemv_shards = {}
        names = set().union(*(m.needs() for m in self.members))
        for name in _TENSORS:
            if name in names:
                p = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
                set_weight_attrs(p, {"weight_loader": _Loader(self, layer, name)})
                layer.register_parameter(name, p)

    # -- loading ---------------------------------------------------------------
    def load(self, layer: nn.Module, tensor_name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        if shard_id not in self.by_id:
            ids = [m.shard_id for m in self.members]
            raise ValueError(f"qgemv: {self.prefix}.{tensor_name}: shard id {shard_id!r} is not one of {ids} "
                             f"(the checkpoint's modules for this layer: {[m.name for m in self.members]})")
        member = self.by_id[shard_id]
        got = layer.qgemv_pending.setdefault(shard_id, {})
        if tensor_name not in member.needs():
            raise ValueError(f"qgemv: {member.name}.{tensor_name}: the checkpoint's format for {member.name} "
                             f"({member.config.name}{', act-order' if member.permuted else ''}) has no such tensor")
        if tensor_name in got or shard_id in layer.qgemv_shards:
            raise ValueError(f"qgemv: {member.name}.{tensor_name} was loaded twice")
        got[tensor_name] = loaded
        if member.needs() <= set(got):
            layer.qgemv_shards[shard_id] = self._shard(layer, member, got, param.device)
            del layer.qgemv_pending[shard_id]

    def _whole(self, layer: nn.Module, member: _Member, t: dict) -> PackedWeight:
        """The member's unsharded weight from its checkpoint tensors, checked."""
        c, k = member.config, layer.qgemv_in_features
        qw = t["qweight"]
        if qw.dim() != 2:
            raise ValueError(f"qgemv: {member.name}.qweight has shape {list(qw.shape)}; qgemv stores a 2-d tensor")
        shell = QuantLinear(k, qw.shape[0], c.bits, c.group_size, c.symmetric, device="meta")
        for name in ("qweight", "scales", "zeros"):
            want = getattr(shell, name)
            if want is not None and tuple(t[name].shape) != tuple(want.shape):
                raise ValueError(f"qgemv: {member.name}.{name} has shape {list(t[name].shape)}, but a {c.name} "
                                 f"linear with in_features {k} and {qw.shape[0]} outputs stores {list(want.shape)}")
        state = {f"{member.name}.{n}": v for n, v in t.items()}
        try:
            checkpoint.check_quantized_tensors("the model", member.name, c, state, self.config.version)
        except checkpoint.CheckpointError as e:
            raise ValueError(f"qgemv: {e}") from None
        if member.permuted and tuple(t["perm"].shape) != (k,):
            raise ValueError(f"qgemv: {member.name}.perm has shape {list(t['perm'].shape)}, expected [{k}]")
        return PackedWeight(formats.to_panels(qw) if self.config.version == 1 else qw, t["scales"], t.get("zeros"),
                            c, k, t.get("perm"))

    def _rows(self, layer: nn.Module, member: _Member, n: int) -> list:
        """[(first, end)] rows of the member's stored weight (n rows) that this rank holds, in output order."""
        rank, world = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
        if isinstance(layer, (ReplicatedLinear, RowParallelLinear)) or world == 1:
            return [(0, n)]
        if isinstance(layer, QKVParallelLinear):
            hd, vd = layer.head_size, layer.v_head_size
            q_r, kv_r, v_r = layer.num_heads * hd, layer.num_kv_heads * hd, layer.num_kv_heads * vd
            kv_rank = rank // layer.num_kv_head_replicas
            parts = {"q": (0, rank * q_r, q_r),
                     "k": (layer.total_num_heads * hd, kv_rank * kv_r, kv_r),
                     "v": (layer.total_num_heads * hd + layer.total_num_kv_heads * hd, kv_rank * v_r, v_r)}
        elif isinstance(layer, MergedColumnParallelLinear):
            sizes = list(layer.output_sizes)
            parts = {i: (sum(sizes[:i]), rank * (s // world), s // world) for i, s in enumerate(sizes)}
        else:
            per = n // world
            return [(rank * per, (rank + 1) * per)]
        if member.shard_id is None:  # the members stored fused: every part from the one tensor
            return [(base + first, base + first + size) for base, first, size in parts.values()]
        _, first, size = parts[member.shard_id]
        return [(first, first + size)]

    def _shard(self, layer: nn.Module, member: _Member, t: dict, device) -> list:
        """This rank's QuantLinear(s) of one member: its rows (column parallel, one per fused part) or columns."""
        w = self._whole(layer, member, t)
        rank, world = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
        try:
            if isinstance(layer, RowParallelLinear) and world > 1 and shard.row_needs_gather(w, world, member.name):
                piece, index = shard.shard_row_gathered(w, rank, world, member.name)
                layer.qgemv_gather = index.to(device)  # every rank takes this branch (the same perm everywhere)
                pieces = [piece]
            elif isinstance(layer, RowParallelLinear) and world > 1:
                pieces = [w.shard_row(rank, world, member.name)]
            else:
                pieces = [w if (a, b) == (0, w.out_features) else w.take_rows(a, b, member.name)
                          for a, b in self._rows(layer, member, w.out_features)]
        except shard.ShardError as e:
            raise ValueError(f"qgemv: tensor parallel size {world}: {e}") from None
        return [QuantLinear.from_packed(p.to(device)) for p in pieces]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        missing = [f"{m.name}.{n}" for m in self.members if m.shard_id not in layer.qgemv_shards
                   for n in sorted(m.needs() - set(layer.qgemv_pending.get(m.shard_id, {})))]
        if missing:
            raise ValueError(f"qgemv: {self.prefix}: the checkpoint has no tensor(s) {missing}")
        pieces = [p for m in self.members for p in layer.qgemv_shards[m.shard_id]]
        fused = pieces[0] if len(pieces) == 1 else fuse_linears(pieces)
        layer.qgemv_linears = nn.ModuleList([fused] if fused is not None else pieces)
        for name in _TENSORS:  # the placeholders held nothing; the shards are the layer's weights now
            if name in layer._parameters:
                del layer._parameters[name]
        del layer.qgemv_pending, layer.qgemv_shards

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [tokens, K on this rank] -> [tokens, N on this rank] in x's dtype (plus bias)."""
        mods = layer.qgemv_linears
        gather = getattr(layer, "qgemv_gather", None)
        if gather is not None:  # a row-parallel shard by stored groups: the whole input, then its columns
            x = tensor_model_parallel_all_gather(x.contiguous(), dim=-1).index_select(-1, gather)
        y = mods[0](x) if len(mods) == 1 else torch.cat([m(x) for m in mods], dim=-1)
        return y if bias is None else y + bias.to(y.dtype)


class _Loader:
    """A placeholder parameter's weight_loader: (param, tensor[, shard_id]) -> QgemvLinearMethod.load."""

    def __init__(self, method: QgemvLinearMethod, layer: nn.Module, name: str):
        self.method, self.name = method, name
        object.__setattr__(self, "_layer", layer)

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.method.load(self._layer, self.name, param, loaded, shard_id)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: importing this module registered the method."""
    return None


__all__ = ["QgemvVllmConfig", "QgemvLinearMethod", "register"]
