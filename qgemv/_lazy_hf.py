"""Register quant_method "qgemv" with transformers when transformers' quantizer table is imported.

``import qgemv`` must not import transformers (about 11 s on a 2-core CPU, paid by every command and
subprocess), yet ``AutoModelForCausalLM.from_pretrained(qgemv_dir)`` must work after it.  So
:func:`install` registers at once when ``transformers.quantizers.auto`` is already imported, and
otherwise puts a finder on ``sys.meta_path`` that runs the registration (:func:`qgemv.hf.register`)
right after that module is first executed, from wherever the import comes.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

TARGET = "transformers.quantizers.auto"


def _register() -> None:
    mid_import = sys.modules.get(__package__ + ".hf")
    if mid_import is not None and not hasattr(mid_import, "register"):
        return  # qgemv.hf is being imported (it imports transformers' table): it registers at its own end
    try:
        from . import hf

        hf.register()
    except Exception as e:  # noqa: BLE001 - a transformers without this quantizer API must still import
        warnings.warn(f"qgemv: could not register quant_method 'qgemv' with transformers ({type(e).__name__}: {e}); "
                      f"load qgemv checkpoints with qgemv.checkpoint.load_quantized", RuntimeWarning, stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds TARGET through the other finders and runs the registration once its module has executed."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register()

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register now if transformers' quantizer table is loaded, else as soon as it is (idempotent)."""
    if TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
