"""Tensor-parallel shards (qgemv.shard): assembled shards give the unsharded layer, or the split is refused by rule.

Column shards are concatenated, row shards summed in fp32, on the CPU reference (CUDA: the same ops)."""

import itertools

import pytest
import torch

import qgemv
from qgemv.shard import ShardError, column_range, row_range, shard_column, shard_row

FORMATS = {"int8": (8, None, True), "int4": (4, None, True), "int4g128a": (4, 128, False), "int4g32": (4, 32, True)}


def layer(fmt, n=256, k=1024, bias=True, seed=0):
    bits, group, sym = FORMATS[fmt]
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    return qgemv.QuantLinear.from_linear(lin, bits=bits, group_size=group, symmetric=sym)


def with_act_order(q, world, seed=1):
    """q with an act-order perm that keeps every rank's logical input range on whole groups of its own
    (groups shuffled within a rank's range, columns shuffled within a group: what per-shard act-order gives)."""
    g = q.config.group_size or 128
    k = q.in_features
    gen = torch.Generator().manual_seed(seed)
    perm = []
    per = k // world
    for r in range(world):
        for grp in torch.randperm(per // g, generator=gen).tolist():
            base = r * per + grp * g
            perm += (base + torch.randperm(g, generator=gen)).tolist()
    q.perm = torch.tensor(perm, dtype=torch.int64)
    return q


@pytest.mark.parametrize("fmt,world,act", list(itertools.product(FORMATS, [2, 4], [False, True])))
def test_shards_assemble_to_the_whole_layer(fmt, world, act):
    q = layer(fmt)
    if act:
        with_act_order(q, world)
    x = torch.randn(5, q.in_features)
    want = q(x)
    cols = torch.cat([shard_column(q, r, world)(x) for r in range(world)], -1)
    assert torch.allclose(cols, want, rtol=1e-5, atol=1e-5)
    parts = []
    for r in range(world):
        k0, k1 = row_range(q.in_features, q.config, r, world)
        s = shard_row(q, r, world)
        assert s.in_features == k1 - k0 and (s.bias is None) == (r > 0)
        parts.append(s(x[:, k0:k1]))
    assert torch.allclose(sum(parts), want, rtol=1e-4, atol=1e-4)


def test_splits_that_are_not_exact_are_refused():
    with pytest.raises(ShardError, match="whole 16-row panels .* multiple of 64"):
        column_range(200, 0, 4)
    q = layer("int4g128a", k=768)
    with pytest.raises(ShardError, match="768 does not split into 4 equal parts of whole 128-column blocks"):
        shard_row(q, 0, 4)
    with pytest.raises(ShardError, match="rank 2 of 2"):
        shard_column(q, 2, 2)
    q = layer("int4g128a")
    q.perm = torch.randperm(q.in_features, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ShardError, match="do not make up whole groups of 128"):
        shard_row(q, 0, 2)
    assert shard_column(q, 1, 2).perm is not None  # column shards keep the whole input's perm
