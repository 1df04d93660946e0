"""transformers integration: ``from_pretrained`` of a qgemv checkpoint returns a model with QuantLinear modules.

    import qgemv                                   # registers quant_method "qgemv"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("runs/q4", dtype=torch.float16, device_map="cuda")
    out = qgemv.generate(model, tokenizer, ["Hello"])   # the engine's speed (generate() works too, eagerly)

``import qgemv`` does not import transformers: it registers quant_method
"qgemv" the moment transformers' quantizer table is imported (or at once,
if it already was; :func:`qgemv._lazy_hf`), which imports this module.  The
quantizer loads pre-quantized checkpoints only (quantize with
``qgemv-quantize`` or :func:`qgemv.quantize_model`) and checks the
checkpoint exactly as :func:`qgemv.checkpoint.load_quantized` does, before
transformers reads a tensor: every tensor present, none extra, shapes,
dtypes, code and zero-point ranges, scales finite and positive, file format
versions.  (transformers would load a missing tensor as zeros without a
word.)  The checks read the checkpoint once more than loading needs.

Traps handled here: from_pretrained's ``dtype`` reaches the quantizer only
through ``update_dtype`` (captured there for the biases); the scales stay
float16 whatever the dtype (the shells' buffers are float16, which
transformers keeps, and ``QuantLinear._apply`` keeps them float16 under
``model.to(dtype)``); ``is_compileable`` is True.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers.quantizers import auto as qauto
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .nn import FusedQuantLinear, FusedSlice, QuantLinear

log = logging.getLogger("transformers.quantizers.qgemv")  # under transformers' own logger and its handler


# Both classes live at module level so that a loaded model (its config holds a QgemvConfig, the model its
# quantizer) can be pickled and copied.
class QgemvConfig(QuantizationConfigMixin):
    """The ``quantization_config`` block of a qgemv checkpoint, kept as written (see checkpoint.quantization_config)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("quant_method", "qgemv")
        self._fields = dict(kwargs)
        for k, v in kwargs.items():
            setattr(self, k, v)

    def to_dict(self) -> dict:
        return dict(self._fields)


class QgemvHfQuantizer(HfQuantizer):
    """Loads qgemv checkpoints (pre-quantized only) into QuantLinear modules."""

    requires_calibration = True

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.dtype = None
        self.version = None
        self.converted = ()

    def update_dtype(self, dtype):
        self.dtype = dtype  # from_pretrained's dtype reaches the quantizer only here
        return dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from . import checkpoint

        if not checkpoint_files:
            raise checkpoint.CheckpointError("qgemv: from_pretrained gave the quantizer no checkpoint files")
        path = Path(checkpoint_files[0]).parent
        dtype = self.dtype if isinstance(self.dtype, torch.dtype) else model.dtype
        skeleton, state, _, self.version = checkpoint.checked_checkpoint(path, dtype)
        del state  # checked; transformers reads the tensors itself
        self.converted = [n for n, m in skeleton.named_modules() if isinstance(m, QuantLinear)]
        # move every replaced module over: QuantLinears, and fused projections with their slices
        # (a fused projection's own QuantLinear, <owner>.qkv.fused, travels with it)
        for name, mod in list(skeleton.named_modules()):
            parent, _, child = name.rpartition(".")
            if isinstance(mod, (QuantLinear, FusedQuantLinear, FusedSlice)) and not isinstance(
                    skeleton.get_submodule(parent) if parent else skeleton, FusedQuantLinear):
                setattr(model.get_submodule(parent) if parent else model, child, mod)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        from . import checkpoint, formats

        for name in self.converted:
            q = model.get_submodule(name)
            if any(t is not None and t.is_meta for t in (q.qweight, q.scales, q.zeros, q.bias, q.perm)):
                raise checkpoint.CheckpointError(f"qgemv: {name} was not loaded by from_pretrained")
            if self.version == 1:  # format 1 stored rows in order: into panels, as load_quantized does
                q.qweight = formats.to_panels(q.qweight)
        return model

    def is_serializable(self, **kwargs) -> bool:
        # transformers refuses save_pretrained then and points to its logger: say there what to call
        log.warning("qgemv: save_pretrained cannot write a qgemv checkpoint (each file records its format "
                    "version); save with qgemv.checkpoint.save_quantized(model, tokenizer, out_dir, "
                    "model.config.quantization_config.to_dict())")
        return False

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> bool:
    """Register qgemv's quantization config and HfQuantizer with transformers (idempotent); True."""
    if "qgemv" not in qauto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        qauto.register_quantization_config("qgemv")(QgemvConfig)
    if "qgemv" not in qauto.AUTO_QUANTIZER_MAPPING:
        qauto.register_quantizer("qgemv")(QgemvHfQuantizer)
    return True


register()  # importing this module registers (so does qgemv._lazy_hf, once transformers' table is imported)
