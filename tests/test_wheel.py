"""The installed product, outside the checkout: build a wheel (CPU build), install it
into a fresh virtual environment, and run the user's commands from an empty
directory.  This catches what only a checkout has: data files, JIT sources,
console scripts, modules that reach the checkout through sys.path."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_smollm2

ROOT = Path(__file__).resolve().parent.parent


def _venv_with_my_packages(venv: Path, env) -> Path:
    """A fresh virtual environment that sees exactly this interpreter's packages (its site directories, by a
    .pth file, after the venv's own), not the machine's base Python; returns its python."""
    import site
    import sysconfig

    _run([sys.executable, "-m", "venv", str(venv)], venv.parent, env)
    py = venv / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], venv.parent, env).strip()
    mine = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    Path(purelib, "callers_packages.pth").write_text("\n".join(dict.fromkeys(mine)) + "\n")
    return py


def _run(cmd, cwd, env, timeout=900):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@requires_smollm2
@pytest.mark.slow
def test_wheel_installs_and_runs_from_an_empty_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["QGEMV_SKIP_CUDA_BUILD"] = "1"
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dist),
          str(ROOT)], tmp_path, env)
    wheel = next(dist.glob("qgemv-*.whl"))
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True).stdout
    assert "qgemv/data/enwiki_eval.txt" in names and "qgemv/csrc/qgemv.h" in names and "qgemv/calibration/cli.py" in names
    assert "\neval/" not in names and "\ncalibration/" not in names and "dev/" not in names

    venv = tmp_path / "venv"
    # the heavy dependencies (torch, transformers) come from this interpreter's site-packages;
    # qgemv itself only from the wheel (--force-reinstall puts it into the venv)
    py = _venv_with_my_packages(venv, env)
    bindir = venv / "bin"
    _run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)], tmp_path, env)
    # An editable install of the checkout in the base environment would serve
    # whatever the wheel lacks (qgemv._C, say) through its import hook; the
    # venv drops that hook, so only the wheel's files can be found.
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env).strip()
    Path(site, "sitecustomize.py").write_text(
        "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'ditable' not in repr(f)]\n")
    work = tmp_path / "empty"
    work.mkdir()
    where = _run([py, "-c", "import qgemv, qgemv.calibration.cli, qgemv._sources as s; "
                  "print(qgemv.__file__); print(qgemv.calibration.cli.__file__); print(s.CSRC)"], work, env)
    for line in where.split():
        assert line.startswith(str(venv)), f"{line} is not the installed copy"
    out = _run([py, "-m", "qgemv", "info"], work, env)
    assert "backend: reference" in out  # a CPU wheel: no qgemv._C, from anywhere
    if shutil.which("nvcc") and torch.version.cuda:  # the JIT build from the sources the wheel carries
        jit_env = dict(env, QGEMV_JIT="1", QGEMV_CUDA_ARCHS="9.0", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
                       CUDA_HOME=env.get("CUDA_HOME", "/usr/local/cuda"))
        assert "backend: jit" in _run([py, "-m", "qgemv", "info"], work, jit_env)
    _run([bindir / "qgemv-quantize", "default", "--bits", "8", "--method", "rtn", "--out", "q8"], work, env)
    assert (work / "q8" / "config.json").exists()
    out = _run([bindir / "qgemv-ppl-check", "--reference", "default", "--quantized", "q8", "--windows", "2",
                "--max-ppl-increase", "2%", "--max-kl", "0.05", "--min-top1", "90%"], work, env)
    assert "pass: q8" in out
    out = _run([bindir / "qgemv-generate", "q8", "--prompt", "The capital of France is", "--max-new-tokens", "3",
                "--device", "cpu"], work, env)
    assert out.strip()  # the streamed text
    assert "--out" in _run([bindir / "qgemv-convert", "--help"], work, env)
    # the streamed path (one shard per decoder layer, through OUT.partial) from the wheel
    _run([bindir / "qgemv-quantize", "default", "--bits", "8", "--method", "rtn", "--stream", "--out", "q8s"], work,
         env)
    assert (work / "q8s" / "model.safetensors.index.json").exists() and not (work / "q8s.partial").exists()
    assert "--model" in _run([py, "-m", "qgemv.eval.bench_chain", "--help"], work, env)
    assert sorted(p.name for p in work.iterdir()) == ["q8", "q8s"]


@pytest.mark.slow
def test_the_readme_install_line_works_in_a_fresh_venv(tmp_path):
    """pip install ".[hf]" exactly as the README writes it (pip's isolated build, no torch in it), then
    python -m qgemv info from an empty directory."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(ln for ln in readme.splitlines() if ln.startswith("pip install \".[hf]\""))
    import shlex

    cmd = shlex.split(line.split("#")[0])
    assert cmd == ["pip", "install", ".[hf]"], cmd
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    py = _venv_with_my_packages(tmp_path / "venv", env)
    _run([py, "-m", *cmd], ROOT, env)  # the venv's pip, in the checkout
    work = tmp_path / "empty"
    work.mkdir()
    where = _run([py, "-c", "import qgemv; print(qgemv.__file__)"], work, env).strip()
    assert where.startswith(str(tmp_path / "venv")), where
    out = _run([py, "-m", "qgemv", "info"], work, env)
    assert "backend: reference" in out and "qgemv: 0.1.0" in out


def test_missing_transformers_is_a_clear_error(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from qgemv.calibration import cli\n"
            f"sys.exit(cli.main(['default', '--bits', '8', '--method', 'rtn', '--out', {str(tmp_path / 'q')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "qgemv[hf]" in r.stderr, r.stderr
