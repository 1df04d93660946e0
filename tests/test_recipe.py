"""The calibration recipe (calibration/recipe.py) and the report both drivers return: CPU only, no model."""

import dataclasses
import warnings

import pytest
import torch

from qgemv.calibration.quantize import CalibReport
from qgemv.calibration.recipe import Recipe
from qgemv.formats import QuantConfig


def test_the_older_spelling_builds_the_same_recipe():
    cfg = QuantConfig(4, 32, False)
    r = Recipe.of(cfg, "awq_gptq", damp=0.05, act_order=True, clip_grid=7, batch_size=3, skip=["lm_head"],
                  overrides={"down": {"bits": 8}}, forward_dtype=torch.bfloat16)
    assert r == Recipe(cfg, "awq_gptq", damp=0.05, act_order=True, clip_grid=7, batch_size=3, skip=("lm_head",),
                       overrides={"down": {"bits": 8}}, forward_dtype=torch.bfloat16)
    assert r.skip == ("lm_head",) and isinstance(r.skip, tuple)
    assert Recipe.of(cfg).method == "gptq" and Recipe.of(cfg, skip=None).skip == ("lm_head", "embed")
    assert Recipe.of(r) is r


def test_bad_recipes_name_the_argument_and_the_rule():
    cfg = QuantConfig(4, 128)
    with pytest.raises(TypeError, match="dampening"):
        Recipe.of(cfg, "gptq", dampening=0.1)
    with pytest.raises(TypeError, match="act_order.*on the Recipe"):
        Recipe.of(Recipe(cfg), act_order=True)
    with pytest.raises(TypeError, match="method.*on the Recipe"):
        Recipe.of(Recipe(cfg), "awq")
    with pytest.raises(TypeError, match="QuantConfig"):
        Recipe.of("int4g128", "gptq")
    with pytest.raises(TypeError, match="Recipe.cfg"):
        Recipe(cfg="int4")
    with pytest.raises(ValueError, match="method must be one of"):
        Recipe(cfg, "sparsegpt")
    with pytest.raises(ValueError, match="forward_dtype must be"):
        Recipe(cfg, forward_dtype=torch.int8)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            Recipe(cfg, batch_size=bad)


def test_the_fingerprint_holds_every_field_that_decides_the_codes():
    base = Recipe(QuantConfig(4, 64, False), "gptq")
    fp = base.fingerprint()
    # the keys a streamed run's progress.json has held since resuming began (beside the output's own)
    assert set(fp) == {"bits", "group_size", "symmetric", "skip", "overrides", "method", "damp", "act_order",
                       "clip_grid", "true_sequential", "forward_dtype", "batch_size", "group_fallback"}
    changed = dict(cfg=QuantConfig(4, 32, False), method="awq", damp=0.02, act_order=True, clip_grid=5,
                   true_sequential=True, forward_dtype=torch.float16, batch_size=2, skip=("x",),
                   overrides={"y": {"bits": 8}}, group_fallback=False)
    for name, value in changed.items():
        assert dataclasses.replace(base, **{name: value}).fingerprint() != fp, name
    assert Recipe(QuantConfig(4, 64, False), "gptq").fingerprint() == fp


def test_one_report_type_with_a_deprecated_dict_spelling():
    rep = CalibReport(method="gptq", format="int4g128a", layers=2, resumed_layers=[0], steps_seconds={"read": 1.0})
    assert rep.to_json()["resumed_layers"] == [0] and rep.to_json()["format"] == "int4g128a"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert rep["layers"] == 2
    assert any(issubclass(w.category, DeprecationWarning) and "report.layers" in str(w.message) for w in caught)
    with pytest.raises(KeyError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep["no_such_field"]


def test_scale_tuning_settings_are_one_value_too():
    from qgemv.calibration.e2e import TuneSettings, tune_scales

    windows, teacher = torch.zeros(6, 4, dtype=torch.int64), torch.zeros(6, 4, 8)
    with pytest.raises(TypeError, match="probe.*on them"):
        tune_scales(None, windows, teacher, TuneSettings(), probe=3)
    with pytest.raises(TypeError, match="stepz"):
        tune_scales(None, windows, teacher, stepz=3)
    with pytest.raises(ValueError, match="schedule must be 'constant' or 'cosine'"):
        TuneSettings(schedule="linear")
    with pytest.raises(ValueError, match="batch must be between 1 and the 2 training windows"):
        tune_scales(None, windows, teacher, probe=4, batch=3)
    decay = TuneSettings(schedule="cosine", steps=10).decay()
    assert decay(0) == 1.0 and abs(decay(10)) < 1e-12 and TuneSettings().decay()(7) == 1.0
