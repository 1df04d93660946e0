"""argparse types shared by the command-line tools: each names the rule it enforces."""

from __future__ import annotations

import argparse
import math

import torch


def int_at_least(lo: int):
    """An argparse type: an integer >= lo."""
    def parse(v: str) -> int:
        try:
            x = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
        if x < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {x}")
        return x
    return parse


def positive_float(v: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {v!r}")
    return x


def device_arg(v: str) -> str:
    """An argparse type: a torch device that exists here ("cpu", "cuda", "cuda:1")."""
    try:
        d = torch.device(v)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a device: {v!r}") from None
    if d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{v}: qgemv runs on cpu or cuda")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{v}: no CUDA GPU is available here")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{v}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return v
