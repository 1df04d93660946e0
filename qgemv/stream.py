"""Deprecated name of :mod:`qgemv.safetensors_io` (sharded safetensors reader, resumable layer writer, run lock).

Importing it gives that module itself (so attributes set on one are seen on
the other) and a DeprecationWarning; it goes in a later release.
"""

import sys
import warnings

from . import safetensors_io as _module

warnings.warn("qgemv.stream is now qgemv.safetensors_io", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
