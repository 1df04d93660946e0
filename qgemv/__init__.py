"""qgemv: weight-only int8 / int4 GEMV kernels for LLM decode.

    import qgemv
    lin = qgemv.QuantLinear.from_linear(torch.nn.Linear(4096, 4096), bits=4, group_size=128)
    report = qgemv.quantize_model(model, bits=8)
    out = qgemv.generate(model, tokenizer, ["Once upon a time"], max_new_tokens=32)

Importing qgemv never initialises CUDA and does not import transformers; once transformers'
quantizer table is imported, quant_method "qgemv" is registered with it, so that
``AutoModelForCausalLM.from_pretrained(qgemv_dir)`` loads QuantLinear modules (qgemv.hf,
qgemv._lazy_hf).
"""

from . import formats, ops  # noqa: F401  (ops defines the torch.library schemas)
from . import _ext

_ext.load()

from ._ext import set_gemv_pdl  # noqa: E402
from .formats import FORMAT_VERSION, QuantConfig  # noqa: E402
from .weight import PackedWeight  # noqa: E402
from .nn import QuantLinear, QuantizeReport, quantize_model  # noqa: E402
from .ops import linear_int4, linear_int4_grouped, linear_int8, sgemv  # noqa: E402
from .engine import Engine, Generation, generate  # noqa: E402
from . import importers  # noqa: E402,F401  (registers the GPTQ / AWQ / compressed-tensors reader of load_quantized)
from . import _lazy_hf  # noqa: E402

_lazy_hf.install()  # from_pretrained of qgemv checkpoints, once transformers is imported

__version__ = "0.1.0"

__all__ = [
    "PackedWeight",
    "FORMAT_VERSION",
    "QuantConfig",
    "QuantLinear",
    "QuantizeReport",
    "quantize_model",
    "Engine",
    "Generation",
    "generate",
    "linear_int8",
    "linear_int4",
    "linear_int4_grouped",
    "sgemv",
    "set_gemv_pdl",
    "formats",
    "ops",
]
