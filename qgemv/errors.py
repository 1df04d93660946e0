"""The errors qgemv's file I/O raises: each names the file, tensor or field and the rule it breaks."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match its config."""


class OutputDirError(ValueError):
    """An output directory that qgemv refuses to write or replace."""


__all__ = ["CheckpointError", "OutputDirError"]
