"""Calibration samples: N windows of L tokens, drawn with a seed."""

from __future__ import annotations

import torch

from qgemv.text import load_text

PROBE_FRACTION = 0.1  # share of the calibration tokens that only probe windows are drawn from


def _token_ids(tokenizer, source: str) -> torch.Tensor:
    """int64 [T]: the calibration split of ``source``, tokenized without special tokens."""
    return tokenizer(load_text(source, "calib"), return_tensors="pt", add_special_tokens=False).input_ids[0]


def calibration_samples(tokenizer, source: str = "default", n: int = 128, seq_len: int = 512,
                        seed: int = 0) -> torch.Tensor:
    """int64 [n, seq_len] token windows from the calibration split of ``source``.

    Windows start at seeded random offsets in the tokenized text (they may
    overlap when the text is short).  Raises ValueError if the text has fewer
    than seq_len + 1 tokens.
    """
    ids = _token_ids(tokenizer, source)
    if ids.numel() <= seq_len:
        raise ValueError(f"calibration text has {ids.numel()} tokens, need more than seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (n,), generator=g)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


def train_and_probe_windows(tokenizer, source: str = "default", n_train: int = 128, n_probe: int = 8,
                            seq_len: int = 512, seed: int = 0, probe_fraction: float = PROBE_FRACTION):
    """(train int64 [n_train, seq_len], probe int64 [n_probe, seq_len]) from disjoint token ranges.

    The tokenized calibration split is cut once: the last ``probe_fraction``
    of its tokens (at least n_probe * seq_len + 1) hold the probe windows, the
    rest the training windows, each drawn at seeded random offsets in its own
    range.  A probe window therefore shares no token position with any
    training window, however many training windows are drawn, so a probe KL
    measures generalization, not recall.  Raises ValueError when the text is
    too short for both ranges.
    """
    if not 0.0 < probe_fraction < 1.0:
        raise ValueError(f"probe_fraction must be in (0, 1), got {probe_fraction}")
    ids = _token_ids(tokenizer, source)
    n_tok = ids.numel()
    cut = n_tok - max(int(n_tok * probe_fraction), n_probe * seq_len + 1)
    if cut <= seq_len or n_tok - cut <= seq_len:
        raise ValueError(f"calibration text has {n_tok} tokens: too few for a training range and a held-out "
                         f"probe range of at least {n_probe} x {seq_len} + 1 tokens")
    g = torch.Generator().manual_seed(seed)
    train_starts = torch.randint(0, cut - seq_len, (n_train,), generator=g)
    probe_span = n_tok - cut - seq_len
    if probe_span >= n_probe * seq_len:  # room for non-overlapping probe windows: spread them evenly
        probe_starts = cut + torch.arange(n_probe) * (probe_span // n_probe)
    else:
        probe_starts = cut + torch.randint(0, probe_span, (n_probe,), generator=g)
    train = torch.stack([ids[s : s + seq_len] for s in train_starts.tolist()]) if n_train else ids.new_zeros(0, seq_len)
    probe = torch.stack([ids[s : s + seq_len] for s in probe_starts.tolist()])
    return train, probe
