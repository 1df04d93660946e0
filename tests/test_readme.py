"""The README's Python quick start runs as written (on a CPU here, on the GPU where there is one)."""

import re
import subprocess
import sys
from pathlib import Path

from conftest import requires_smollm2

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@requires_smollm2
def test_the_quick_start_runs_as_written(tmp_path):
    code = quick_start()
    assert "quantize_model" in code and "generate" in code
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tok/s" in r.stdout and "Paris" in r.stdout, r.stdout[-2000:]
