"""Output directories that appear whole or not at all.

:func:`atomic_dir` yields a temporary sibling of the output; on success it
is renamed into place (:func:`swap_in`), on any failure, Ctrl-C or SIGTERM
it is removed and the output is as it was.  :func:`check_output_dir` checks
before any work that a directory may be written or replaced;
:func:`clean_stale` removes what killed writers left behind.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

from .errors import OutputDirError

_RUN_STARTED = time.time()  # "older than this run", for temporary directories left by earlier runs


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask would race)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_stale(out: Path) -> None:
    """Remove what interrupted writes of ``out`` left beside it.

    Temporary directories are named ``.NAME.tmp-PID-*`` (a write in progress)
    and ``.NAME.old-PID-*`` (the previous checkpoint, moved aside while the new
    one is renamed in).  One whose PID is dead, or whose name carries no PID
    and that is older than this run (written by an earlier qgemv), is stale:
    a stale ``.old`` directory is renamed back to ``out`` when ``out`` is
    missing (the write was killed between the two renames), else removed.
    """
    parent = out.parent
    if not parent.is_dir():
        return
    for kind in ("old", "tmp"):  # old first: it may have to become out again
        prefix = f".{out.name}.{kind}-"
        for d in sorted(parent.glob(glob.escape(prefix) + "*")):
            if not d.is_dir() or d.is_symlink():
                continue
            pid = d.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit():
                if int(pid) == os.getpid() or _pid_alive(int(pid)):
                    continue
            elif d.stat().st_mtime >= _RUN_STARTED:
                continue
            if kind == "old" and not os.path.lexists(out):
                os.rename(d, out)
                warnings.warn(f"qgemv: {out} was being replaced when its writer died; the previous "
                              f"checkpoint ({d.name}) is restored", RuntimeWarning, stacklevel=3)
            else:
                shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def terminate_raises():
    """Within the block SIGTERM raises SystemExit(143), so that cleanup code runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def swap_in(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``.  An existing ``out`` is moved aside first and deleted only once
    the new one is in place; if anything fails in between, it is moved back, whole."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out: Path):
    """Yield a temporary sibling directory of ``out``; on success it replaces ``out``.

    The new directory is renamed in and any previous ``out`` moved aside
    first, then deleted (:func:`swap_in`).  On any error, Ctrl-C or SIGTERM
    the temporary directory is removed and ``out`` is as it was.  Stale
    temporaries of earlier, killed runs are removed first (:func:`clean_stale`).
    The directory gets the permissions of the umask (mkdtemp's are 0700).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        with terminate_raises():
            os.chmod(tmp, 0o777 & ~current_umask())
            yield tmp
            swap_in(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` reports a full disk (an OSError with ENOSPC, or safetensors' error that quotes it)."""
    import errno

    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def is_qgemv_checkpoint(path) -> bool:
    """True when ``path`` is a directory whose config.json says ``quant_method: "qgemv"``."""
    cfg = Path(path) / "config.json"
    try:
        d = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    qc = d.get("quantization_config") if isinstance(d, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == "qgemv"


def check_output_dir(out, overwrite: bool = False, sources=()) -> Path:
    """Check, before any work, that ``out`` can receive a checkpoint; returns it as a Path.

    A missing ``out`` is fine if its nearest existing ancestor is a writable
    directory (probed by creating and removing a directory there).  An
    existing ``out`` needs ``overwrite``, and even then may only be a qgemv
    checkpoint directory (:func:`is_qgemv_checkpoint`): never a file or a
    symbolic link, the current directory or one of its ancestors, the home
    directory, ``/``, or a directory holding one of ``sources`` (the model
    being quantized).  Raises FileExistsError or OutputDirError naming the rule.
    """
    out = Path(out)
    if str(out).strip() == "":
        raise OutputDirError("the output directory must not be empty")
    if os.path.lexists(out):
        if not overwrite:
            raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
        if out.is_symlink():
            raise OutputDirError(f"{out} is a symbolic link; refusing to replace it")
        if not out.is_dir():
            raise OutputDirError(f"{out} is not a directory; refusing to replace it")
        real = out.resolve()
        cwd = Path.cwd().resolve()
        if real == cwd or real in cwd.parents:
            raise OutputDirError(f"{out} is the current directory or one of its ancestors; refusing to replace it")
        if real == Path.home().resolve() or real.parent == real:
            raise OutputDirError(f"{out} is the home directory or /; refusing to replace it")
        for src in sources:
            if src is None:
                continue
            s = Path(src).resolve()
            if s == real or real in s.parents:
                raise OutputDirError(f"{out} holds the source model {src}; refusing to replace it")
        if not is_qgemv_checkpoint(out):
            raise OutputDirError(f"{out} is not a qgemv checkpoint (no config.json with quantization_config."
                                 "quant_method 'qgemv'); --overwrite replaces only qgemv checkpoints")
    anc = out.absolute().parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise OutputDirError(f"{out}: {anc} is not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=anc)
        os.rmdir(probe)
    except OSError as e:
        raise OutputDirError(f"{out}: cannot create directories in {anc} ({e.strerror})") from None
    return out


def write_side_files(directory: Path, tokenizer, extra_json: Optional[dict]) -> None:
    """The tokenizer's files and the reports ({file name: JSON-able object}) beside a checkpoint's tensors."""
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    for fname, obj in (extra_json or {}).items():
        (directory / fname).write_text(json.dumps(obj, indent=1, default=str))


__all__ = ["OutputDirError", "atomic_dir", "check_output_dir", "clean_stale", "current_umask", "is_disk_full",
           "is_qgemv_checkpoint", "swap_in", "terminate_raises", "write_side_files"]
