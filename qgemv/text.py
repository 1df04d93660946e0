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


def load_text(source: str, split: str) -> str:
    """The whole text of ``source`` as one string (documents joined by blank lines)."""
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
        return "\n\n".join(t for t in ds[col] if t)
    p = Path(source)
    if not p.exists():
        raise FileNotFoundError(f"text source not found: {source}")
    files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
    if not files:
        raise FileNotFoundError(f"{source}: no .txt files")
    if all(f.suffix == ".txt" for f in files):
        return "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    import datasets

    kind = "json" if files[0].suffix in (".json", ".jsonl") else "text"
    ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    col = "text" if "text" in ds.column_names else ds.column_names[0]
    return "\n\n".join(str(t) for t in ds[col] if t)
