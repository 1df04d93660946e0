"""A calibration recipe: everything that decides the codes, in one value.

Both drivers take one: :func:`calibration.quantize.quantize_causal_lm` (the
model in memory) and :func:`calibration.layerwise.quantize_streaming` (a
checkpoint directory, layer by layer).  A streamed run's resume fingerprint
is its recipe's :meth:`Recipe.fingerprint` plus what the output adds (the
source, the samples' digest, the output's dtype and fusion).

    from calibration.recipe import Recipe
    r = Recipe(QuantConfig(4, 128, False), "gptq", act_order=True)
    quantize_causal_lm(model, r, samples=tokens)

The drivers also take the older spelling, a QuantConfig followed by the
method and the recipe's fields as keywords (``Recipe.of``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from qgemv.formats import QuantConfig
from qgemv.nn import layer_format

METHODS = ("rtn", "gptq", "awq", "awq_gptq")
FORWARD_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Recipe:
    """How to quantize a causal LM.

    Attributes:
        cfg: the default format (each linear's own comes from
            :func:`qgemv.nn.layer_format`: ``skip``, ``overrides``,
            ``group_fallback``).
        method: "rtn" (no calibration data), "gptq", "awq", or "awq_gptq"
            (AWQ's scales folded in first, then GPTQ on the scaled weights).
        damp: GPTQ's dampening, a fraction of the Hessian's mean diagonal.
        act_order: GPTQ in order of decreasing Hessian diagonal (the
            checkpoint stores the permutation).
        clip_grid: clipping search for GPTQ's and AWQ's scales (points of
            formats.choose_params, weighted by each input column's mean
            square); RTN uses the plain min/max range.
        true_sequential: GPTQ quantizes q/k/v, o, gate/up, down in that
            order, each with Hessians taken after the earlier ones are
            quantized (opt-in: on SmolLM2 int4 it cost up to 1.8x the time
            and changed the perplexity only within noise, BENCHMARKS.md).
        forward_dtype: run the calibration forward passes under autocast to
            torch.bfloat16 or torch.float16; None runs them in the model's
            dtype.  Weights, Hessians (fp32) and hidden states keep theirs.
        batch_size: calibration sequences per forward pass.
        skip: regexes of module names left in float.
        overrides: regex -> dict(bits=..., group_size=..., symmetric=...).
        group_fallback: a linear whose in_features the group does not
            divide falls back to per-channel int4 (else it stays float).
        rotate, rotate_seed: first rotate the residual stream and each
            attention head's values by seeded random Hadamard matrices
            (calibration/rotate.py; in-memory driver only).
    """

    cfg: QuantConfig = field(default_factory=lambda: QuantConfig(4, 128, False))
    method: str = "gptq"
    damp: float = 0.01
    act_order: bool = False
    clip_grid: int = 20
    true_sequential: bool = False
    forward_dtype: Optional[torch.dtype] = None
    batch_size: int = 8
    skip: tuple = (r"lm_head", r"embed")
    overrides: dict = field(default_factory=dict)
    group_fallback: bool = True
    rotate: bool = False
    rotate_seed: int = 0

    def __post_init__(self):
        if not isinstance(self.cfg, QuantConfig):
            raise TypeError(f"Recipe.cfg must be a qgemv.formats.QuantConfig, got {type(self.cfg).__name__}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.forward_dtype not in FORWARD_DTYPES:
            raise ValueError(f"forward_dtype must be None, float32, bfloat16 or float16, got {self.forward_dtype}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        object.__setattr__(self, "skip", tuple(self.skip))
        object.__setattr__(self, "overrides", dict(self.overrides or {}))

    @classmethod
    def of(cls, recipe, method: Optional[str] = None, **fields) -> "Recipe":
        """A Recipe as given, or one built from a QuantConfig, the method and the recipe's fields by name.

        Raises TypeError for a field that is not the recipe's, or for fields
        given beside a finished Recipe.
        """
        if isinstance(recipe, Recipe):
            if method is not None or fields:
                extra = sorted(fields) + (["method"] if method is not None else [])
                raise TypeError(f"a Recipe was given; set {', '.join(extra)} on the Recipe instead "
                                f"(dataclasses.replace(recipe, ...))")
            return recipe
        if not isinstance(recipe, QuantConfig):
            raise TypeError(f"expected a calibration.Recipe or a qgemv.formats.QuantConfig, "
                            f"got {type(recipe).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; a recipe has "
                            f"{', '.join(sorted(names - {'cfg'}))}")
        if fields.get("skip") is None:
            fields.pop("skip", None)
        return cls(cfg=recipe, method=method or "gptq", **fields)

    def layer_format(self, name: str, module) -> tuple:
        """(QuantConfig, None) for the linear ``name``, or (None, why it stays float): the recipe's format,
        skip, overrides and group fallback, as :func:`qgemv.nn.layer_format` applies them."""
        return layer_format(name, module, self.cfg, self.skip, self.overrides, self.group_fallback)

    @property
    def calibrated(self) -> bool:
        """Whether the method needs calibration samples (every method but RTN)."""
        return self.method != "rtn"

    def fingerprint(self) -> dict:
        """What decides the codes, as JSON values (a resumed run must match it)."""
        return dict(bits=self.cfg.bits, group_size=self.cfg.group_size, symmetric=self.cfg.symmetric,
                    skip=list(self.skip), overrides=self.overrides, method=self.method, damp=self.damp,
                    act_order=self.act_order, clip_grid=self.clip_grid, true_sequential=self.true_sequential,
                    forward_dtype=str(self.forward_dtype or torch.float32), batch_size=self.batch_size,
                    group_fallback=self.group_fallback)
