"""Deprecated name of :mod:`qgemv.calibration.layerwise` (qgemv-quantize --stream's layer-by-layer driver).

Importing it gives that module itself and a DeprecationWarning; it goes in a later release.
"""

import sys
import warnings

from . import layerwise as _module

warnings.warn("qgemv.calibration.stream is now qgemv.calibration.layerwise", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
