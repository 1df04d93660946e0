"""PackedWeight: one quantized weight in one of qgemv's formats, what it holds and what it costs.

The one description of a packed weight that the layers above share:
:class:`qgemv.QuantLinear` (``.packed`` / ``from_packed``), the vLLM plugin's
shards (``take_rows`` / ``shard_column`` / ``shard_row``, exact, in
:mod:`qgemv.shard`), and :func:`qgemv.ops.linear`, the one call that computes
with any format.  The tensors are the checkpoint's, not copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import formats
from .formats import QuantConfig


@dataclass
class PackedWeight:
    """A weight W [N, K] packed in ``config``'s format (qgemv/formats.py has the layouts).

    qweight: int8 [N, round_up(K, 16)] (int8) or int32 [N, round_up(K, 32) / 8] (int4), in 16-row panels.
    scales: float16 [N] (per channel) or [N, K / G].
    zeros: uint8 [N, K / G] (asymmetric int4) or None.
    config: bits, group size, symmetric.
    in_features: K (the packed rows are padded; K is not recoverable from their width).
    perm: int64 [K] or None: the columns are stored permuted, W_stored = W[:, perm] (act-order).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    config: QuantConfig
    in_features: int
    perm: Optional[torch.Tensor] = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def format(self) -> str:
        """The format's name: int8, int4, int4g128, int4g128a, ..."""
        return self.config.name

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tensors (weights, scales, zero points; not perm)."""
        return formats.nbytes(self.qweight, self.scales, self.zeros)

    def codes(self) -> torch.Tensor:
        """The integer codes [N, K] (int8 for int8, uint8 0..15 for int4), in stored column order."""
        unpack = formats.unpack_int8 if self.config.bits == 8 else formats.unpack_int4
        return unpack(self.qweight, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] that multiplies x (columns in x's order)."""
        w = formats.dequantize(self.qweight, self.scales, self.zeros, self.config, self.in_features)
        return w if self.perm is None else w[:, torch.argsort(self.perm.to(w.device))]

    def to(self, device) -> "PackedWeight":
        move = (lambda t: None if t is None else t.to(device))
        return PackedWeight(move(self.qweight), move(self.scales), move(self.zeros), self.config, self.in_features,
                            move(self.perm))

    # Tensor-parallel shards (exact, or refused with qgemv.shard.ShardError naming the rule).
    def take_rows(self, first: int, end: int, name: str = "linear") -> "PackedWeight":
        from . import shard

        return shard.take_rows(self, first, end, name)

    def shard_column(self, rank: int, world: int, name: str = "linear") -> "PackedWeight":
        from . import shard

        return shard.shard_column(self, rank, world, name)

    def shard_row(self, rank: int, world: int, name: str = "linear") -> "PackedWeight":
        from . import shard

        return shard.shard_row(self, rank, world, name)


__all__ = ["PackedWeight"]
