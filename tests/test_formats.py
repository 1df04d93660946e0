"""Packed formats: exact round trips, layout, edge cases."""

import itertools

import pytest
import torch

from qgemv import formats

SHAPES = [(1, 8), (7, 24), (16, 128), (33, 136), (5, 160), (64, 576), (3, 1544)]


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_int4_pack_unpack_exact(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = formats.pack_int4(q)
    assert packed.dtype == torch.int32
    assert packed.shape == (n, (k + 31) // 32 * 4)
    assert torch.equal(formats.unpack_int4(packed, k), q)


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_int8_pack_unpack_exact(n, k):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = formats.pack_int8(q)
    assert packed.shape == (n, (k + 15) // 16 * 16)
    assert torch.equal(formats.unpack_int8(packed, k), q)


def test_int4_layout_is_the_documented_one():
    # One row of 128 k + a 32-k tail: element k holds code k % 16.
    k = 160
    q = (torch.arange(k) % 16).to(torch.uint8)[None]
    words = formats.pack_int4(q)[0].to(torch.int64) & 0xFFFFFFFF
    # Stored position t*4 + j of the first block holds logical word 4j + t.
    for t, j in itertools.product(range(4), range(4)):
        w = int(words[t * 4 + j])
        logical = 4 * j + t
        for i, e in enumerate(formats.INT4_NIBBLE_ORDER):
            assert (w >> (4 * i)) & 0xF == (logical * 8 + e) % 16
    # Tail block: c = 1 sub-tile, position t*1 + 0 holds logical word 16 + t.
    for t in range(4):
        w = int(words[16 + t])
        for i, e in enumerate(formats.INT4_NIBBLE_ORDER):
            assert (w >> (4 * i)) & 0xF == ((16 + t) * 8 + e) % 16


@pytest.mark.parametrize("n", [16, 20, 5])
def test_panel_layout_is_the_documented_one(n):
    # int8 rows of Kp = 80: one full 64-byte tile and a 16-byte remainder.
    # Element (row, k) holds a value that names both, so positions can be read back.
    k = 80
    q = ((torch.arange(n)[:, None] * 7 + torch.arange(k)[None]) % 255 - 127).to(torch.int8)
    stored = formats.pack_int8(q).flatten()
    for row in range(n):
        p0 = row // formats.PANEL_ROWS * formats.PANEL_ROWS
        r, i = min(formats.PANEL_ROWS, n - p0), row - p0
        base = p0 * k
        for kk in (0, 5, 63):  # tile 0: at i * 64
            assert stored[base + i * 64 + kk] == q[row, kk]
        for kk in (64, 79):  # the remainder after all rows' tile 0: at r*64 + i*16
            assert stored[base + r * 64 + i * 16 + (kk - 64)] == q[row, kk]


def test_nibble_pairs_come_out_consecutive():
    # The kernel's (w >> 4i) & 0x000f000f trick must yield (e_2i, e_2i+1).
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 4], dtype=torch.uint8)
    w = int(formats.pack_int4(q)[0, 0]) & 0xFFFFFFFF
    pairs = [((w >> 4 * i) & 0xF, (w >> (4 * i + 16)) & 0xF) for i in range(4)]
    assert pairs == [(1, 2), (3, 4), (5, 6), (7, 8)]


CONFIGS = [
    formats.QuantConfig(8),
    formats.QuantConfig(4),
    formats.QuantConfig(4, 32),
    formats.QuantConfig(4, 64, False),
    formats.QuantConfig(4, 128),
    formats.QuantConfig(4, 128, False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_quantize_dequantize_error_bounded(cfg):
    w = torch.randn(48, 256)
    qw, s, z = formats.quantize(w, cfg)
    wd = formats.dequantize(qw, s, z, cfg, 256)
    # RTN error is at most half a step (plus fp16 rounding of the scale,
    # which moves every code's value by < 2^-11 relative).
    g = cfg.group_size or 256
    step = s.float().reshape(48, -1).repeat_interleave(g, dim=1)
    assert ((wd - w).abs() <= step * 0.5 + w.abs() * 2**-10 + 1e-7).all()
    # requantizing the dequantized weight with the same scales gives the same codes
    qw2 = formats.quantize_with_params(wd, s, z, cfg)
    assert torch.equal(qw2, qw)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_all_zero_row_gives_finite_scale_and_exact_zero(cfg):
    w = torch.randn(4, 128)
    w[2] = 0
    qw, s, z = formats.quantize(w, cfg)
    assert torch.isfinite(s.float()).all() and (s.float() > 0).all()
    wd = formats.dequantize(qw, s, z, cfg, 128)
    assert torch.equal(wd[2], torch.zeros(128))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_weight_is_a_named_error(bad):
    w = torch.randn(4, 64)
    w[1, 3] = bad
    with pytest.raises(ValueError, match=r"layers\.3\.mlp: weight contains 1 NaN or Inf"):
        formats.quantize_int8(w, name="layers.3.mlp")
    with pytest.raises(ValueError, match=r"q_proj: weight contains 1 NaN or Inf"):
        formats.quantize_int4(w, 32, name="q_proj")


def test_k_not_divisible_by_group_is_an_error():
    with pytest.raises(ValueError, match=r"in_features \(96\) must be divisible by group_size \(64\)"):
        formats.quantize_int4(torch.randn(4, 96), 64)


def test_k_not_multiple_of_8_is_an_error():
    with pytest.raises(ValueError, match="in_features must be a multiple of 8, got 12"):
        formats.quantize_int8(torch.randn(4, 12))
    with pytest.raises(ValueError, match="in_features must be a multiple of 8, got 20"):
        formats.quantize_int4(torch.randn(4, 20))


def test_bad_configs():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        formats.QuantConfig(3)
    with pytest.raises(ValueError, match="group_size must be one of"):
        formats.QuantConfig(4, 48)
    with pytest.raises(ValueError, match="asymmetric int4 needs a group_size"):
        formats.QuantConfig(4, None, False)


def test_bytes_per_weight_table():
    assert formats.QuantConfig(8).bytes_per_weight() == 1.0
    assert formats.QuantConfig(4).bytes_per_weight() == 0.5
    assert formats.QuantConfig(4, 128).bytes_per_weight() == 0.5 + 2 / 128
    assert formats.QuantConfig(4, 32, False).bytes_per_weight() == 0.5 + 3 / 32
    cfg = formats.QuantConfig(4, 64, False)
    qw, s, z = formats.quantize(torch.randn(40, 192), cfg)
    assert cfg.packed_bytes(40, 192) == formats.nbytes(qw, s, z)
