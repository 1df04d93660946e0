"""Tensor-parallel shards of a QuantLinear: which rows, columns, groups and perm entries rank r of P holds.

Importable without vLLM or any serving engine; a serving adapter calls these
when it loads a checkpoint onto P ranks.  Every shard is exact (the same codes,
scales and zero points, repacked) or refused with the rule it breaks; nothing
is padded.

Column parallel (the output split, y = [y_0 | ... | y_{P-1}]): rank r holds
output rows [r N/P, (r+1) N/P), which must be whole 16-row panels.  An input
permutation (act-order) applies to the whole input and is kept by every rank.

Row parallel (the input split, y = sum_r x_r @ W_r^T, each rank holding the
input columns [r K/P, (r+1) K/P) of the logical input): the split must fall
on group boundaries and, for int4, on the 128-k blocks the packer swizzles
words in (int8: 64-k tiles).  The bias stays on rank 0 so that the sum adds
it once.  With an act-order perm (storage column s holds logical column
perm[s]) rank r needs the stored columns whose logical index lies in its
range; that is exact only when they make up whole groups, and then the rank
gets those groups and a local perm.  A checkpoint whose groups straddle the
ranks' ranges (the case other runtimes compute wrongly) is refused by
``shard_row``; ``shard_row_gathered`` splits it exactly another way: rank r
holds the stored columns [r K/P, (r+1) K/P) (whole groups) and the logical
input indices they need, and computes from the whole input (the ranks' input
slices gathered first, one all-gather of M x K activations per call).
``row_needs_gather`` says which of the two a layer needs, the same answer on
every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import formats
from .nn import QuantLinear
from .weight import PackedWeight


class ShardError(ValueError):
    """A linear that cannot be split exactly as asked; the message names the rule."""


def _check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ShardError(f"rank {rank} of {world}: need world >= 1 and 0 <= rank < world")


def column_range(out_features: int, rank: int, world: int, name: str = "linear") -> tuple:
    """(first, end) output rows of rank's column-parallel shard: equal parts of whole 16-row panels."""
    _check_rank(rank, world)
    part, rest = divmod(out_features, world)
    if rest or part % formats.PANEL_ROWS:
        raise ShardError(f"{name}: out_features {out_features} does not split into {world} equal parts of whole "
                         f"{formats.PANEL_ROWS}-row panels (needs a multiple of {formats.PANEL_ROWS * world})")
    return rank * part, (rank + 1) * part


def row_step(config: formats.QuantConfig) -> int:
    """The granularity a row-parallel split of K must respect: the group and the format's k block."""
    block = 128 if config.bits == 4 else 64
    g = config.group_size or 1
    return block * g // _gcd(block, g)


def row_range(in_features: int, config: formats.QuantConfig, rank: int, world: int, name: str = "linear") -> tuple:
    """(first, end) input columns of rank's row-parallel shard: equal parts on group and k-block boundaries."""
    _check_rank(rank, world)
    part, rest = divmod(in_features, world)
    step = row_step(config)
    if rest or part % step:
        raise ShardError(f"{name}: in_features {in_features} does not split into {world} equal parts of whole "
                         f"{step}-column blocks (the {config.name} format's groups and k blocks; needs a multiple "
                         f"of {step * world})")
    return rank * part, (rank + 1) * part


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _split(q) -> tuple:
    """(PackedWeight, bias or None, whether q is a QuantLinear) of a QuantLinear or a PackedWeight."""
    if isinstance(q, QuantLinear):
        return q.packed, q.bias, True
    if isinstance(q, PackedWeight):
        return q, None, False
    raise TypeError(f"expected a QuantLinear or a PackedWeight, got {type(q).__name__}")


def _result(w: PackedWeight, codes: torch.Tensor, scales, zeros, perm, bias, module: bool):
    """The shard, packed again, as the kind the caller passed (a QuantLinear keeps its part of the bias)."""
    pack = formats.pack_int8 if w.config.bits == 8 else formats.pack_int4
    out = PackedWeight(pack(codes.contiguous()), scales.contiguous(), None if zeros is None else zeros.contiguous(),
                       w.config, codes.shape[1], None if perm is None else perm.contiguous())
    if not module:
        return out
    return QuantLinear.from_packed(out, None if bias is None else bias.detach().clone())


def take_rows(q, first: int, end: int, name: str = "linear"):
    """Output rows [first, end) of q (a QuantLinear or a PackedWeight; the same kind back): exact.

    The whole input (and perm) stays.  Both ends must lie on 16-row panel
    boundaries (or be out_features): a column-parallel rank's part, or one
    member of a fused q/k/v weight.
    """
    w, bias, module = _split(q)
    n = w.out_features
    if not (0 <= first < end <= n) or first % formats.PANEL_ROWS or (end % formats.PANEL_ROWS and end != n):
        raise ShardError(f"{name}: output rows [{first}, {end}) of {n} are not whole {formats.PANEL_ROWS}-row panels "
                         f"(a shard of the stored weight starts and ends on a multiple of {formats.PANEL_ROWS})")
    rows = torch.arange(first, end, device=w.qweight.device)
    return _picked(w, formats.take_packed_rows(w.qweight, rows), rows, bias, module)


def gather_rows(q, rows: torch.Tensor, name: str = "linear"):
    """Output rows ``rows`` (int64 [n], any order: a permutation re-orders q) of q, the same kind back: exact.
    The whole input (and perm) stays."""
    w, bias, module = _split(q)
    rows = rows.to(torch.int64)
    if rows.dim() != 1 or rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= w.out_features:
        raise ShardError(f"{name}: rows must be a non-empty 1-D index of output rows in [0, {w.out_features})")
    return _picked(w, formats.take_packed_rows(w.qweight, rows), rows, bias, module)


def _picked(w: PackedWeight, qweight: torch.Tensor, rows: torch.Tensor, bias, module: bool):
    """w's rows ``rows`` whose packed weight is already ``qweight``: scales, zero points and bias follow."""
    pick = (lambda t: None if t is None else t[rows.to(t.device)].contiguous())
    out = PackedWeight(qweight, pick(w.scales), pick(w.zeros), w.config, w.in_features,
                       None if w.perm is None else w.perm.clone())
    if not module:
        return out
    return QuantLinear.from_packed(out, None if bias is None else pick(bias).detach())


def shard_column(q, rank: int, world: int, name: str = "linear"):
    """Rank's column-parallel shard of q: output rows column_range(...), the whole input (and perm)."""
    r0, r1 = column_range(q.out_features, rank, world, name)
    return take_rows(q, r0, r1, name)


def _rank_columns(w: PackedWeight, k0: int, k1: int) -> tuple:
    """(the stored columns the logical inputs [k0, k1) feed, in stored order; whether they are whole groups)."""
    perm = w.perm.to(torch.int64)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    cols = torch.sort(inv[k0:k1]).values
    g = w.config.group_size
    if g is None:  # per channel: any set of columns shares each row's one scale
        return cols, True
    blocks = cols.view(-1, g)
    return cols, bool((blocks[:, 0] % g == 0).all()) and torch.equal(
        blocks, blocks[:, :1] + torch.arange(g, device=cols.device))


def row_needs_gather(q, world: int, name: str = "linear") -> bool:
    """Whether a row-parallel split of q over ``world`` ranks needs ``shard_row_gathered``: q has an act-order
    perm and some rank's logical inputs are not whole stored groups.  Every rank gets the same answer (the
    gathered form is a collective: all ranks must take it together)."""
    w, _, _ = _split(q)
    if w.perm is None or world == 1:
        return False
    return not all(_rank_columns(w, *row_range(w.in_features, w.config, r, world, name))[1] for r in range(world))


def shard_row_gathered(q, rank: int, world: int, name: str = "linear") -> tuple:
    """Rank's row-parallel shard of a permuted q that needs the whole input: (shard, index).

    The shard (the kind q is, without a perm) holds the stored columns
    row_range(...) of q, whole groups with their scales and zero points; index
    (int64 [K / world]) holds the logical input columns they multiply.  Rank r's
    partial product is ``x_full[..., index] @ shard^T``, x_full [.., K] being
    the whole logical input; the ranks' partial products sum to q(x_full).  A
    QuantLinear's bias stays on rank 0.
    """
    w, bias, module = _split(q)
    if w.perm is None:
        raise ShardError(f"{name}: has no act-order perm; use shard_row")
    k0, k1 = row_range(w.in_features, w.config, rank, world, name)
    g = w.config.group_size
    scales = w.scales if g is None else w.scales[:, k0 // g:k1 // g]
    zeros = None if w.zeros is None else (w.zeros if g is None else w.zeros[:, k0 // g:k1 // g])
    shard = _result(w, w.codes()[:, k0:k1], scales, zeros, None, bias if rank == 0 else None, module)
    return shard, w.perm.to(torch.int64)[k0:k1].clone()


def shard_row(q, rank: int, world: int, name: str = "linear"):
    """Rank's row-parallel shard of q: the columns of its input range row_range(...) (see the module doc).
    A QuantLinear's bias stays on rank 0."""
    w, bias, module = _split(q)
    k0, k1 = row_range(w.in_features, w.config, rank, world, name)
    g = w.config.group_size
    codes = w.codes()
    bias = bias if rank == 0 else None
    if w.perm is None:
        cols = torch.arange(k0, k1, device=codes.device)
        local_perm = None
    else:
        cols, whole = _rank_columns(w, k0, k1)
        if not whole:
            raise ShardError(f"{name}: act-order perm puts the logical inputs [{k0}, {k1}) of rank {rank} of {world} "
                             f"in stored columns that do not make up whole groups of {g}; a row-parallel shard "
                             f"of this checkpoint needs other ranks' inputs: use shard_row_gathered (the whole "
                             f"input on every rank), run it unsharded, or fold the perm into the layer that "
                             f"produces its input")
        local_perm = w.perm.to(torch.int64)[cols] - k0
    if g is None:
        scales, zeros = w.scales, w.zeros
    else:
        groups = torch.unique_consecutive(cols // g)
        scales = w.scales[:, groups]
        zeros = None if w.zeros is None else w.zeros[:, groups]
    return _result(w, codes[:, cols], scales, zeros, local_perm, bias, module)
