"""Streamed checkpoint I/O: read a (sharded) safetensors checkpoint tensor by tensor, write one layer at a time.

:class:`Reader` parses each file's header once and reads a tensor's bytes
with plain file reads when it is asked for: nothing is memory-mapped, so the
source's pages never count towards the process's resident memory.
:func:`write_safetensors` writes each tensor's bytes straight from its
storage, loading :class:`Lazy` ones one at a time.
:class:`LayerWriter` writes a checkpoint one unit (a decoder layer) per file
into a work directory ``OUT.partial`` beside ``OUT``, records each finished
unit in ``progress.json``, and renames the finished directory into place; an
interrupted run leaves the work directory, and a run with ``resume=True``
continues after its last finished unit.  calibration/layerwise.py drives both.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from . import formats
from .errors import CheckpointError, OutputDirError
from .outdir import current_umask, swap_in, write_side_files

INDEX_FILE = "model.safetensors.index.json"

SINGLE_FILE = "model.safetensors"


def read_json(path: Path, what: str) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {type(d).__name__}")
    return d


def _read_safetensors(path: Path) -> tuple:
    """(tensors, metadata) of one safetensors file; CheckpointError naming the file if it is unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except Exception as e:  # safetensors raises its own error types for bad headers / short files
        raise CheckpointError(f"{path}: cannot read safetensors file (corrupt or truncated?): {e}") from None


def checkpoint_files(path) -> list:
    """The safetensors files of a checkpoint directory, exactly as it names them (see :func:`shards`)."""
    return shards(path)[0]


def shards(path) -> tuple:
    """(safetensors files, the index's weight_map or None) of a checkpoint directory.

    ``model.safetensors``, or the files that ``model.safetensors.index.json``'s
    ``weight_map`` names (plain file names inside the directory).  Any other
    ``*.safetensors`` beside them (a backup, say) is never read.  Raises
    CheckpointError when neither exists, when both do, or for a bad index.
    """
    p = Path(path)
    index, single = p / INDEX_FILE, p / SINGLE_FILE
    if index.exists() and single.exists():
        raise CheckpointError(f"{path}: has both {SINGLE_FILE} and {INDEX_FILE}; keep one")
    if single.exists():
        return [single], None
    if not index.exists():
        raise CheckpointError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}")
    wm = read_json(index, "the shard index").get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{index}: needs a non-empty 'weight_map' object")
    files = []
    for name in wm.values():
        if not isinstance(name, str) or name != Path(name).name or name in ("", ".", ".."):
            raise CheckpointError(f"{index}: weight_map names {name!r}, not a plain file name in the directory")
        if name not in files:
            files.append(name)
    for name in files:
        if not (p / name).is_file():
            raise CheckpointError(f"{index}: names {name}, which is missing")
    return [p / n for n in files], wm


def read_checkpoint_tensors(path) -> tuple:
    """(tensors, metadata of each file) of a checkpoint directory (see :func:`checkpoint_files`).

    A key stored in two files, or stored in a file the index does not map it
    to, or mapped by the index but absent, is a CheckpointError.
    """
    files, wm = shards(path)
    state, metas, where = {}, {}, {}
    for f in files:
        tensors, meta = _read_safetensors(f)
        metas[f.name] = meta
        for k, t in tensors.items():
            if k in where:
                raise CheckpointError(f"{path}: tensor {k} is stored twice, in {where[k]} and {f.name}")
            if wm is not None and wm.get(k) != f.name:
                raise CheckpointError(f"{path}: tensor {k} is in {f.name}, but {INDEX_FILE} maps it to {wm.get(k)}")
            where[k] = f.name
            state[k] = t
    if wm is not None:
        absent = sorted(set(wm) - set(state))
        if absent:
            raise CheckpointError(f"{path}: {len(absent)} tensor(s) in {INDEX_FILE} are in no file, e.g. {absent[:3]}")
    return state, metas


def save_tensors(path: Path, state: dict, metadata: dict) -> None:
    """safetensors' save_file, then the file's mode from the umask (save_file creates files 0600)."""
    from safetensors.torch import save_file

    save_file(state, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


class Lazy(NamedTuple):
    """A tensor to be written that is produced only when its bytes are due: dtype, shape, load() -> tensor."""

    dtype: torch.dtype
    shape: tuple
    load: Callable[[], torch.Tensor]


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _header(path: Path, metadata: Optional[dict] = None) -> tuple:
    """({name: (dtype, shape, begin, end)}, offset of the data) of a safetensors file; CheckpointError if malformed.

    ``metadata``, if given, receives the file's ``__metadata__`` entries."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size
            if n <= 0 or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file size {size})")
            head = json.loads(f.read(n))
        if not isinstance(head, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the safetensors header ({type(e).__name__}: {e})") from None
    if metadata is not None and isinstance(head.get("__metadata__"), dict):
        metadata.update(head["__metadata__"])
    out, data = {}, size - 8 - n
    for name, v in head.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = _DTYPES[v["dtype"]], [int(d) for d in v["shape"]], v["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: unreadable header entry {v!r}") from None
        if not 0 <= a <= b <= data or b - a != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name}: byte range [{a}, {b}) does not fit {v['dtype']} {shape} "
                                  f"in {data} bytes of data")
        out[name] = (dtype, shape, a, b)
    return out, 8 + n


def write_safetensors(path, tensors: dict, metadata: Optional[dict] = None) -> None:
    """Write ``tensors`` ({name: tensor or Lazy}) as a safetensors file, one tensor in memory at a time.

    The header is computed from dtypes and shapes first; then each tensor's
    bytes are written straight from its storage (a Lazy one is loaded just
    before and dropped after), so no second copy of the data is made, as
    safetensors' own save_file would.
    """
    names = {v: k for k, v in _DTYPES.items()}
    head, offset = {}, 0
    for name, t in tensors.items():
        dtype, shape = t.dtype, tuple(t.shape)
        nbytes = math.prod(shape) * dtype.itemsize
        head[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        head["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                t = t.load()
            t = t.detach().to("cpu").contiguous()
            if t.dtype != _DTYPES[head[name]["dtype"]] or list(t.shape) != head[name]["shape"]:
                raise ValueError(f"{name}: produced {t.dtype} {list(t.shape)}, announced {head[name]['dtype']} "
                                 f"{head[name]['shape']}")
            if t.numel():
                f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())  # on disk before anything records the file as finished


class Reader:
    """The tensors of a checkpoint directory by name, read from disk when asked for (no mmap)."""

    def __init__(self, path):
        files, wm = shards(path)
        self.index, self.read = {}, set()
        for f in files:
            head, base = _header(f)
            for name, (dtype, shape, a, b) in head.items():
                if wm is None or wm.get(name) == f.name:
                    self.index[name] = (f, dtype, shape, base + a, b - a)
        for name, fname in (wm or {}).items():
            if name not in self.index:
                raise CheckpointError(f"{path}: the shard index puts {name} in {fname}, which does not hold it")

    def keys(self) -> list:
        return list(self.index)

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key`` on the CPU, in its stored dtype and shape."""
        if key not in self.index:
            raise CheckpointError(f"tensor {key} is missing from the source checkpoint")
        f, dtype, shape, start, nbytes = self.index[key]
        t = torch.empty(shape, dtype=dtype)
        if nbytes:
            with open(f, "rb") as fh:
                fh.seek(start)
                got = fh.readinto(t.view(-1).view(torch.uint8).numpy())
            if got != nbytes:
                raise CheckpointError(f"{f}: tensor {key}: read {got} of {nbytes} bytes (truncated file?)")
        self.read.add(key)
        return t


def read_file(path) -> dict:
    """Every tensor of one safetensors file, read through the checked header (CheckpointError names the file)."""
    head, base = _header(Path(path))
    out = {}
    with open(path, "rb") as fh:
        for name, (dtype, shape, a, b) in head.items():
            t = torch.empty(shape, dtype=dtype)
            if b > a:
                fh.seek(base + a)
                if fh.readinto(t.view(-1).view(torch.uint8).numpy()) != b - a:
                    raise CheckpointError(f"{path}: tensor {name}: the file ends early (truncated?)")
            out[name] = t
    return out


def partial_dir(out) -> Path:
    """``OUT.partial``: where a streamed write of ``out`` works until it is complete."""
    out = Path(out)
    return out.parent / (out.name + ".partial")


def finished_units(out) -> Optional[list]:
    """The units an interrupted run for ``out`` finished (from ``OUT.partial/progress.json``); None when
    there is no such run or its record is unreadable."""
    try:
        return list(json.loads((partial_dir(out) / "progress.json").read_text())["done"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_no_interrupted_run(out) -> None:
    """OutputDirError if ``OUT.partial`` holds an interrupted run's finished work (or an unreadable record of
    it), which only ``--resume`` may continue; a work directory that finished nothing is not such a run."""
    if partial_dir(out).exists() and finished_units(out) != []:
        raise OutputDirError(f"{partial_dir(out)} holds an interrupted run for {out}: pass --resume to continue "
                             f"it, or delete it to start over")


class RunLock:
    """An exclusive lock on the streamed write of ``out``: the file ``OUT.partial.lock`` held with flock.

    A second run for the same ``out`` is refused (OutputDirError naming the
    pid that holds it) while the first lives; the kernel drops the lock of a
    process that ended, however it ended, so a killed run's lock is simply
    taken over.  The file holds the owner's pid for the message.
    """

    def __init__(self, out):
        self.path = partial_dir(out).with_name(partial_dir(out).name + ".lock")
        self.path.parent.mkdir(parents=True, exist_ok=True)  # --out may name a directory not made yet
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~current_umask())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputDirError(f"another run (pid {owner}) is writing {out} through {partial_dir(out)}: "
                                     f"wait for it to end, or stop it") from None
            try:  # the file may have been removed (and made anew) by a run that finished in between
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd

    def release(self, remove: bool = False) -> None:
        """Drop the lock (idempotent); ``remove``: delete the lock file first (the run is complete)."""
        if self.fd is None:
            return
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None


class LayerWriter:
    """Writes a checkpoint into ``OUT.partial`` one unit at a time, resumably, then renames it to ``OUT``.

    ``fingerprint`` (a JSON-able dict of everything that decides the output:
    source, formats, method, calibration) is stored in ``progress.json``; a
    resumed run must present the same one.  Without ``resume`` an existing
    work directory is an error (it holds finished work); with it, the units
    already written are in :attr:`done`.
    """

    def __init__(self, out, units: int, fingerprint: dict, resume: bool = False):
        self.out, self.units = Path(out), units
        self.work = partial_dir(self.out)
        self.lock = RunLock(self.out)  # before anything in the work directory is read or removed
        try:
            self._open(fingerprint, resume)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, fingerprint: dict, resume: bool) -> None:
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))
        self.done = set()
        if not resume:
            check_no_interrupted_run(self.out)
            if self.work.exists():
                shutil.rmtree(self.work)  # an interrupted run that finished nothing: nothing to keep
        if self.work.exists():
            record = self.work / "progress.json"
            try:
                prog = json.loads(record.read_text())
                old, done = prog["fingerprint"], prog["done"]
                if not isinstance(old, dict):
                    raise TypeError(f"fingerprint is {type(old).__name__}, not an object")
                if not isinstance(done, list) or not all(type(u) is int and 0 <= u < self.units for u in done):
                    raise TypeError(f"done is {done!r}, not a list of layer numbers 0..{self.units - 1}")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise OutputDirError(f"{record} is unreadable ({type(e).__name__}: {e}); "
                                     f"delete {self.work} to start over") from None
            self._check_fingerprint(old, str(record))
            self.done = set()
            for u in sorted(done):
                if self._finished_shard_ok(u):
                    self.done.add(u)
        else:
            self.work.mkdir(parents=True)
            os.chmod(self.work, 0o777 & ~current_umask())
            self._save_progress()

    def _check_fingerprint(self, old: dict, where: str) -> None:
        differ = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
        if differ:
            what = "; ".join(f"{k}: {old.get(k)!r} then, {self.fingerprint.get(k)!r} now" for k in differ)
            raise OutputDirError(f"{where} was written with other settings ({what}); resume with the same ones, "
                                 f"or delete {self.work} to start over")

    def _finished_shard_ok(self, unit: int) -> bool:
        """Whether unit's shards (and its .resume file) can be resumed from: readable headers whose own record
        names this unit and these settings.  A damaged or missing file is named, and the layer recomputed;
        a shard written with other settings is refused (OutputDirError)."""
        import warnings

        for path in (self.work / self._name(unit), self.work / self._name(unit, ".resume")):
            if not path.exists() and path.name.startswith("unit-"):
                continue  # an RTN run writes no .resume file
            meta = {}
            try:
                _header(path, meta)
                own = json.loads(meta.get("qgemv_fingerprint", "null"))
                if meta.get("qgemv_unit") != str(unit) or not isinstance(own, dict):
                    raise CheckpointError(f"{path}: its record names layer {meta.get('qgemv_unit')!r}, not {unit}")
            except (CheckpointError, ValueError) as e:
                warnings.warn(f"qgemv: {e}; layer {unit} is computed again", RuntimeWarning, stacklevel=4)
                return False
            self._check_fingerprint(own, str(path))
        return True

    def _name(self, unit: int, kind: str = "") -> str:
        """Unit u's shard has its final name from the start (units + 1 shards: the last holds the rest)."""
        if kind:
            return f"unit-{unit:05d}{kind}.safetensors"
        return f"model-{unit + 1:05d}-of-{self.units + 1:05d}.safetensors"

    def _save_progress(self) -> None:
        tmp = self.work / "progress.json.tmp"
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "done": sorted(self.done)}, indent=1))
        os.replace(tmp, self.work / "progress.json")

    def _save(self, tensors: dict, name: str, unit: Optional[int] = None) -> None:
        tmp = self.work / (name + ".tmp")
        meta = {"format": "pt", "qgemv_format_version": formats.FORMAT_VERSION}
        if unit is not None:  # what resuming checks: which layer, written with which settings
            meta.update(qgemv_unit=unit, qgemv_fingerprint=json.dumps(self.fingerprint, sort_keys=True))
        try:
            write_safetensors(tmp, tensors, meta)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk, an interruption: no half-written file stays behind
            raise
        os.replace(tmp, self.work / name)

    def write_unit(self, unit: int, tensors: dict, resume_tensors: Optional[dict] = None) -> None:
        """Store one finished unit's checkpoint tensors (and, for resuming, tensors that only a resumed run
        reads back: :meth:`read_unit`), then record it as done."""
        if resume_tensors:
            self._save(resume_tensors, self._name(unit, ".resume"), unit)
        self._save(tensors, self._name(unit), unit)
        self.done.add(unit)
        self._save_progress()

    def read_unit(self, unit: int) -> tuple:
        """(checkpoint tensors, resume tensors) of a finished unit."""
        extra = self.work / self._name(unit, ".resume")
        return read_file(self.work / self._name(unit)), (read_file(extra) if extra.exists() else {})

    def unit_names(self, unit: int) -> set:
        """The tensor names a finished unit's shard holds (its header only)."""
        return set(_header(self.work / self._name(unit))[0])

    def finish(self, rest: dict, config_json: dict, tokenizer=None, extra_json=None) -> Path:
        """Write ``rest`` (the tensors outside the units; values may be :class:`Lazy`) as the last shard, the index, config.json and the
        tokenizer; rename the work directory to OUT (an existing OUT is replaced only once this is complete).

        The checkpoint has one shard per unit plus one for ``rest``
        (``model-0000i-of-0000n.safetensors``) and ``model.safetensors.index.json``.
        Returns OUT.
        """
        missing = [u for u in range(self.units) if u not in self.done]
        if missing:
            raise RuntimeError(f"{self.work}: units {missing[:5]} were never written")
        self._save(rest, self._name(self.units))
        weight_map = {}
        for u in range(self.units + 1):
            head, _ = _header(self.work / self._name(u))
            weight_map.update({k: self._name(u) for k in head})
        index = {"metadata": {"qgemv_format_version": formats.FORMAT_VERSION},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.work / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        write_side_files(self.work, tokenizer, extra_json)
        (self.work / "progress.json").unlink()
        for f in self.work.glob("unit-*"):
            f.unlink()
        (self.work / "config.json").write_text(json.dumps(config_json, indent=2, default=str))  # last
        swap_in(self.work, self.out)
        self.lock.release(remove=True)
        return self.out

    def discard(self) -> None:
        """Remove the work directory (a run that failed before finishing any unit)."""
        shutil.rmtree(self.work, ignore_errors=True)
        self.lock.release(remove=True)

    def release(self) -> None:
        """Drop the lock, keeping the work directory (an interrupted run that --resume continues)."""
        self.lock.release()
