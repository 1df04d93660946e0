"""Calibration samples: N windows of L tokens, drawn with a seed."""

from __future__ import annotations

import torch

from qgemv.text import load_text


def calibration_samples(tokenizer, source: str = "default", n: int = 128, seq_len: int = 512,
                        seed: int = 0) -> torch.Tensor:
    """int64 [n, seq_len] token windows from the calibration split of ``source``.

    Windows start at seeded random offsets in the tokenized text (they may
    overlap when the text is short).  Raises ValueError if the text has fewer
    than seq_len + 1 tokens.
    """
    text = load_text(source, "calib")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() <= seq_len:
        raise ValueError(f"calibration text has {ids.numel()} tokens, need more than seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (n,), generator=g)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
