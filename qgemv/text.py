"""Text sources shared by calibration and evaluation.

A source is one of:
  * "default" / "enwiki": the embedded Wikipedia sample for the given split
    (qgemv/data/enwiki_{calib,eval}.txt; the two share no article);
  * a path to a local .txt / .json / .jsonl file (or a directory of .txt);
  * "hub:NAME[:CONFIG[:SPLIT]]" for users who are online, through `datasets`
    (e.g. hub:wikitext:wikitext-2-raw-v1:test).
Local files and hub names are read through `datasets` when it is installed;
plain .txt files also work without it.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def embedded_text(split: str) -> str:
    if split not in ("calib", "eval"):
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}")
    return (DATA / f"enwiki_{split}.txt").read_text(encoding="utf-8")


class TextError(ValueError):
    """A text source that is missing, empty, binary or not UTF-8."""


def _read_utf8(f: Path) -> str:
    try:
        data = f.read_bytes()
    except OSError as e:
        raise TextError(f"{f}: cannot read ({e.strerror})") from None
    if b"\x00" in data[:1 << 20]:
        raise TextError(f"{f}: looks binary (NUL bytes); expected UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TextError(f"{f}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def load_text(source: str, split: str) -> str:
    """The whole text of ``source`` as one string (documents joined by blank lines).

    Raises TextError (a ValueError) naming the file for a source that is
    missing, empty, binary or not UTF-8.
    """
    if source in (None, "", "default", "enwiki"):
        return embedded_text(split)
    if source.startswith("hub:"):
        parts = source[4:].split(":")
        name = parts[0]
        config = parts[1] if len(parts) > 1 and parts[1] else None
        hsplit = parts[2] if len(parts) > 2 else ("train" if split == "calib" else "test")
        import datasets

        ds = datasets.load_dataset(name, config, split=hsplit)
        col = "text" if "text" in ds.column_names else ds.column_names[0]
        return _non_empty("\n\n".join(t for t in ds[col] if t), source)
    p = Path(source)
    if not p.exists():
        raise TextError(f"text source not found: {source}")
    files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
    if not files:
        raise TextError(f"{source}: no .txt files")
    if all(f.suffix == ".txt" for f in files):
        return _non_empty("\n\n".join(_read_utf8(f) for f in files), source)
    for f in files:
        _read_utf8(f)  # a clear error before datasets parses it
    import datasets

    kind = "json" if files[0].suffix in (".json", ".jsonl") else "text"
    try:
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a malformed file
        raise TextError(f"{source}: cannot be read as {kind} ({type(e).__name__}: {e})") from None
    col = "text" if "text" in ds.column_names else ds.column_names[0]
    return _non_empty("\n\n".join(str(t) for t in ds[col] if t), source)


def _non_empty(text: str, source: str) -> str:
    if not text.strip():
        raise TextError(f"{source}: the text is empty")
    return text
