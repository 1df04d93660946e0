"""Tensor-parallel shards (qgemv.shard): assembled shards give the unsharded layer, or the split is refused by rule.

Column shards are concatenated, row shards summed in fp32, on the CPU reference (CUDA: the same ops)."""

import itertools

import pytest
import torch

from torch import nn

import qgemv
from qgemv import formats, shard
from qgemv.formats import QuantConfig
from qgemv.nn import QuantLinear
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


@pytest.mark.parametrize("fmt,world", [("int4g128a", 2), ("int4g32", 4), ("int4", 2), ("int8", 4)])
def test_a_perm_that_mixes_the_ranks_inputs_is_split_by_stored_groups_over_the_whole_input(fmt, world):
    """A random act-order perm (GPTQ desc_act) mixes every rank's logical inputs inside its groups: shard_row
    refuses it, row_needs_gather says so on every rank, and the gathered shards (stored groups, logical indices
    into the whole input) sum to the layer; a perm that keeps ranks apart needs no gather."""
    q = layer(fmt)
    q.perm = torch.randperm(q.in_features, generator=torch.Generator().manual_seed(7))
    grouped = q.config.group_size is not None
    assert shard.row_needs_gather(q, world) == grouped  # per channel: any column set is exact without a gather
    x = torch.randn(3, q.in_features)
    want = q(x)
    parts = []
    for r in range(world):
        s, index = shard.shard_row_gathered(q, r, world)
        k0, k1 = row_range(q.in_features, q.config, r, world)
        assert s.perm is None and s.in_features == k1 - k0 and index.shape == (k1 - k0,)
        assert torch.equal(index, q.perm[k0:k1]) and (s.bias is None) == (r > 0)
        parts.append(s(x[:, index]))
    assert torch.allclose(sum(parts), want, rtol=1e-4, atol=1e-4)
    if grouped:
        with pytest.raises(ShardError, match="use shard_row_gathered"):
            shard_row(q, 0, world)
    assert not shard.row_needs_gather(with_act_order(layer(fmt), world), world)
    assert not shard.row_needs_gather(layer(fmt), world)
    with pytest.raises(ShardError, match="has no act-order perm"):
        shard.shard_row_gathered(layer(fmt), 0, world)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4g64a"])
def test_packed_weight_is_the_quant_linear_s_weight(fmt):
    """QuantLinear.packed / from_packed round-trip the same tensors; ops.linear computes what forward does;
    the shards of a PackedWeight are the weights of the QuantLinear's shards."""
    cfg = {"int8": QuantConfig(8), "int4": QuantConfig(4), "int4g64a": QuantConfig(4, 64, False)}[fmt]
    q = QuantLinear.from_linear(nn.Linear(256, 64), cfg.bits, cfg.group_size, cfg.symmetric)
    q.perm = torch.randperm(256)
    w = q.packed
    assert w.format == fmt and w.out_features == 64 and w.in_features == 256 and w.qweight is q.qweight
    assert w.nbytes == formats.nbytes(q.qweight, q.scales, q.zeros)
    assert torch.equal(w.dequantize(), q.dequantize())
    x = torch.randn(3, 256)
    back = QuantLinear.from_packed(w, q.bias)
    assert torch.equal(back(x), q(x))
    assert torch.allclose(qgemv.ops.linear(x, w, w.perm.to(torch.int32)) + q.bias, q(x), rtol=1e-5, atol=1e-5)
    for rank in range(2):
        a, b = w.shard_column(rank, 2), shard.shard_column(q, rank, 2)
        assert isinstance(a, qgemv.PackedWeight) and torch.equal(a.qweight, b.qweight) and torch.equal(a.perm, b.perm)
    with pytest.raises(shard.ShardError, match="whole 16-row panels"):
        w.take_rows(8, 32)



@pytest.mark.parametrize("fmt", list(FORMATS) + ["int4g64a"])
def test_row_gathers_keep_each_row_s_codes(fmt):
    """gather_rows / take_rows pick packed rows without unpacking: every picked row's codes, scales, zero points
    and bias are the source row's, for odd N and K (a partial last panel, a partial last 128-k block), rows in
    any order and repeated, and the result packs as pack_int4 / pack_int8 would pack those codes."""
    bits, group, sym = FORMATS.get(fmt, (4, 64, False))
    torch.manual_seed(5)
    k = {128: 384, 64: 320}.get(group, 352)  # int4g128: whole 128-k blocks; the others a partial last one
    q = qgemv.QuantLinear.from_linear(torch.nn.Linear(k, 100), bits=bits, group_size=group, symmetric=sym)
    q.perm = torch.randperm(k)
    w = q.packed
    codes = w.codes()
    rows = torch.randint(0, 100, (37,))
    for got, pick in ((shard.gather_rows(w, rows), rows), (shard.take_rows(w, 16, 100), torch.arange(16, 100))):
        assert torch.equal(got.codes(), codes[pick]) and torch.equal(got.scales, w.scales[pick])
        assert (got.zeros is None) == (w.zeros is None) and (got.zeros is None or torch.equal(got.zeros, w.zeros[pick]))
        assert torch.equal(got.perm, w.perm) and got.in_features == k
        pack = formats.pack_int8 if bits == 8 else formats.pack_int4
        assert torch.equal(got.qweight, pack(codes[pick]))
    module = shard.gather_rows(q, rows)
    assert torch.equal(module.bias, q.bias[rows]) and torch.equal(module.qweight, shard.gather_rows(w, rows).qweight)
    with pytest.raises(ShardError, match=r"rows must be a non-empty 1-D index of output rows in \[0, 100\)"):
        shard.gather_rows(w, torch.tensor([0, 100]))


# -- the GPU: every rank's shard of real layers on qgemv's CUDA ops ------------------------------------
REAL = {  # (N, K, how a TP layer splits it) of Llama-3-8B and Llama-3-70B
    "8b.qkv": (6144, 4096, "column"), "8b.o": (4096, 4096, "row"), "8b.gate_up": (28672, 4096, "column"),
    "8b.down": (4096, 14336, "row"), "70b.qkv": (10240, 8192, "column"), "70b.o": (8192, 8192, "row"),
    "70b.gate_up": (57344, 8192, "column"), "70b.down": (8192, 28672, "row"),
}


def _random_packed(cfg, n, k, act, world):
    """Random codes, scales and zero points of format cfg on the GPU; with ``act`` a perm that row shards can
    take (whole groups shuffled inside each rank's part of K, columns shuffled inside the groups)."""
    dev = "cuda"
    if cfg.bits == 8:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
        qw = formats.pack_int8(codes)
    else:
        qw = formats.pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev))
    ng = 1 if cfg.group_size is None else k // cfg.group_size
    s = (torch.rand(n, ng, device=dev) * 2e-3 + 5e-4).half()
    s = s[:, 0].contiguous() if cfg.group_size is None else s
    z = None if cfg.symmetric else torch.randint(0, 16, (n, ng), dtype=torch.uint8, device=dev)
    perm = None
    if act == "mixed":  # GPTQ desc_act: groups mix the ranks' inputs (row shards gather the whole input)
        perm = torch.randperm(k, device=dev)
    elif act:
        g, part = cfg.group_size or 128, k // world
        groups = torch.cat([torch.randperm(part // g, device=dev) + r * (part // g) for r in range(world)])
        perm = torch.cat([grp * g + torch.randperm(g, device=dev) for grp in groups.tolist()])
    return qgemv.PackedWeight(qw, s, z, cfg, k, perm)


def _run(w, x):
    return qgemv.ops.linear(x, w, None if w.perm is None else w.perm.to(torch.int32)).float()


def assembled(w, x, name, world):
    """Every rank's shard of w (layer ``name`` of REAL) run on x and put together as TP would: column shards
    concatenated, row shards (with the gathered input where act-order mixes the ranks' inputs) summed in fp32."""
    if REAL[name][2] == "column":
        return torch.cat([_run(w.shard_column(r, world, name), x) for r in range(world)], dim=-1)
    if shard.row_needs_gather(w, world, name):
        got = 0
        for r in range(world):
            piece, index = shard.shard_row_gathered(w, r, world, name)
            got = got + _run(piece, x[:, index])
        return got
    k = x.shape[-1]
    return sum(_run(w.shard_row(r, world, name), x[:, r * k // world:(r + 1) * k // world]) for r in range(world))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(REAL))
@pytest.mark.parametrize("fmt,act", [("int8", False), ("int4", False), ("int4g128a", False), ("int4g32", False),
                                     ("int4g128a", True), ("int8", True), ("int4g128a", "mixed")])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_cuda_shards_of_llama_3_layers_assemble_to_the_layer(name, fmt, act, world):
    """Simulated TP: each rank's shard on qgemv's CUDA ops; column shards concatenated and row shards summed in
    fp32 equal the unsharded layer (to fp32 accumulation order: the shards' GEMVs split K differently)."""
    n, k, _ = REAL[name]
    torch.manual_seed(0)
    w = _random_packed(QuantConfig(*FORMATS[fmt]), n, k, act, world)
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        whole = _run(w, x)
        got = assembled(w, x, name, world)
        scale = whole.abs().max().item()
        torch.testing.assert_close(got, whole, rtol=0, atol=4e-3 * scale)
