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


class _Parser(argparse.ArgumentParser):
    """--help states every option's default (argparse's own default-showing formatter skips options without
    a help text, and prints "None" and "False")."""

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        text = action.help or ""
        shown = action.option_strings and not any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if shown and "%(default)" not in text and "default" not in text:
            action.help = f"{text} (default: %(default)s)".lstrip()
        return action


def parser(prog: str, description: str = None) -> argparse.ArgumentParser:
    """An ArgumentParser for a qgemv command: defaults in --help, and --version."""
    from importlib import metadata

    try:
        version = metadata.version("qgemv")
    except metadata.PackageNotFoundError:  # a checkout that is not installed
        version = "unknown (not installed)"
    ap = _Parser(prog=prog, description=description)
    ap.add_argument("--version", action="version", version=f"%(prog)s {version}")
    return ap


def default_device() -> str:
    """"cuda" where a CUDA GPU is available, else "cpu" (the commands' default --device)."""
    return "cuda" if torch.cuda.is_available() else "cpu"
