"""What every command-line tool shares: --version, defaults stated in --help, the default device, info's advice."""

import subprocess
import sys

import pytest
import torch

COMMANDS = {
    "qgemv-quantize": "qgemv.calibration.cli",
    "qgemv-ppl": "qgemv.eval.ppl",
    "qgemv-ppl-check": "qgemv.eval.ppl_check",
    "qgemv-convert": "qgemv.importers",
    "python -m qgemv": "qgemv",
}


@pytest.mark.parametrize("prog,module", list(COMMANDS.items()), ids=list(COMMANDS))
def test_version(prog, module):
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(prog + " "), r.stdout + r.stderr


def test_help_states_the_defaults():
    from qgemv.calibration import cli

    text = cli.build_parser().format_help()
    for opt, default in (("--bits", "4"), ("--method", "gptq"), ("--samples", "128"), ("--damp", "0.01"),
                         ("--device", "cpu"), ("--clip-grid", "20"), ("--seed", "0")):
        after = text[text.index(f"  {opt} "):]
        assert f"(default: {default})" in " ".join(after.split()[:40]), opt


def test_ppl_defaults_to_the_gpu_when_there_is_one():
    import argparse

    from qgemv.eval.ppl import add_protocol_args, protocol_from

    ap = argparse.ArgumentParser()
    add_protocol_args(ap)
    args = ap.parse_args([])
    protocol_from(args)
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the advice is right where a GPU is present")
def test_info_gives_no_build_advice_without_a_gpu():
    from qgemv.__main__ import info

    reason = info()["reason"]
    assert "QGEMV_JIT" not in reason and "no CUDA GPU here" in reason


def test_qgemv_generate_lives_in_generate_cli_and_the_old_names_resolve():
    """The CLI moved out of engine.py (issue 34); qgemv.engine.main / load_for_generation still work."""
    from qgemv import engine, generate_cli

    assert engine.main is generate_cli.main and engine.load_for_generation is generate_cli.load_for_generation
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        engine.nothing
