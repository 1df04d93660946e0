"""Move a qgemv checkpoint between machines in small pieces, without its embedding.

    python dev/ship_checkpoint.py pack DIR PREFIX [--piece-mb 15]
    python dev/ship_checkpoint.py unpack PREFIX OUT [--reference default]

A tuned SmolLM2 int4 checkpoint is about 170 MB, two thirds of it the float
token embedding, which quantization leaves untouched.  ``pack`` writes the
checkpoint minus the tensors named by ``--drop`` (default: the embedding) as
one tar.gz cut into PREFIX0, PREFIX1, ... of at most ``--piece-mb`` MB, with a
manifest giving each dropped tensor's dtype, shape and SHA-256.  ``unpack``
joins the pieces, takes each dropped tensor from the float model it was
quantized from (``--reference``), checks its SHA-256 against the manifest and
writes the full checkpoint directory, atomically (a failed unpack leaves no
OUT).  This is how checkpoints tuned on the lent GPU came back for the CPU
evaluation (BENCHMARKS.md); the GPU machine returns at most 16 MB per file.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import torch

MANIFEST = "ship_manifest.json"
PAYLOAD = "ship_tensors.safetensors"


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def pack(src: str, prefix: str, drop=("model.embed_tokens.weight",), piece_mb: float = 15.0) -> list:
    """Write ``src`` (a qgemv checkpoint directory) minus ``drop`` as pieces PREFIX0..; returns their paths.

    A sharded checkpoint travels as one ``model.safetensors`` (its shards merged, the index left out)."""
    from safetensors.torch import load_file, save

    from qgemv import checkpoint as C

    step = int(piece_mb * 1e6)
    if step <= 0:
        raise ValueError(f"piece_mb must be > 0, got {piece_mb}")
    src_p = Path(src)
    files = C.checkpoint_files(src_p)
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    dropped = {}
    for key in drop:
        if key not in state:
            raise KeyError(f"{src}: no tensor {key!r} to drop")
        t = state.pop(key)
        dropped[key] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "sha256": _sha256(t)}
    manifest = {"file": "model.safetensors", "dropped": dropped}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add(PAYLOAD, save(state, metadata={"format": "pt"}))
        add(MANIFEST, json.dumps(manifest, indent=1).encode())
        merged = set(files) | {src_p / "model.safetensors.index.json"}
        for f in sorted(src_p.iterdir()):
            if f.is_file() and f not in merged:
                add(f.name, f.read_bytes())
    data = buf.getvalue()
    out = []
    for i in range(0, len(data), step):
        p = Path(f"{prefix}{i // step}")
        p.write_bytes(data[i : i + step])
        out.append(str(p))
    return out


def unpack(prefix: str, out: str, reference: str = "default") -> Path:
    """Join PREFIX0.. into the checkpoint directory ``out``, the dropped tensors taken from ``reference``."""
    from safetensors.torch import load, load_file, save_file

    from qgemv import checkpoint as C
    from qgemv import formats

    out_p = C.check_output_dir(out)
    parts = [p for p in glob.glob(glob.escape(prefix) + "*") if p[len(prefix):].isdigit()]
    parts.sort(key=lambda p: int(p[len(prefix):]))
    if not parts or [int(p[len(prefix):]) for p in parts] != list(range(len(parts))):
        raise FileNotFoundError(f"{prefix}0, {prefix}1, ...: pieces missing (found {parts})")
    data = b"".join(Path(p).read_bytes() for p in parts)
    ref_path = Path(C.resolve_model(reference))
    ref_files = sorted(ref_path.glob("*.safetensors")) if ref_path.is_dir() else []
    if not ref_files:
        raise FileNotFoundError(f"{reference}: the reference must be a safetensors model directory")
    with C.atomic_dir(out_p) as tmp:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")
        manifest = json.loads((tmp / MANIFEST).read_text())
        name = manifest.get("file") if isinstance(manifest, dict) else None
        if not isinstance(name, str) or name in ("", ".", "..") or name != Path(name).name or "\\" in name:
            raise ValueError(f"{prefix}: the manifest's file {name!r} is not a plain file name inside OUT")
        state = load((tmp / PAYLOAD).read_bytes())
        ref = {}
        for f in ref_files:
            ref.update(load_file(str(f)))
        for key, meta in manifest["dropped"].items():
            if key not in ref:
                raise KeyError(f"reference {reference} has no tensor {key!r}")
            t = ref[key].to(getattr(torch, meta["dtype"])).contiguous()
            if list(t.shape) != meta["shape"] or _sha256(t) != meta["sha256"]:
                raise ValueError(f"{key}: the reference's tensor differs from the one packed "
                                 f"(shape {list(t.shape)} vs {meta['shape']}, or its SHA-256)")
            state[key] = t
        save_file(state, str(tmp / manifest["file"]),
                  metadata={"format": "pt", "qgemv_format_version": str(formats.FORMAT_VERSION)})
        (tmp / PAYLOAD).unlink()
        (tmp / MANIFEST).unlink()
    return out_p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python dev/ship_checkpoint.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="checkpoint directory -> pieces PREFIX0, PREFIX1, ...")
    p.add_argument("src")
    p.add_argument("prefix")
    p.add_argument("--drop", action="append", default=None, help="tensor to leave out (default: the embedding)")
    p.add_argument("--piece-mb", type=float, default=15.0)
    u = sub.add_parser("unpack", help="pieces + the reference float model -> checkpoint directory")
    u.add_argument("prefix")
    u.add_argument("out")
    u.add_argument("--reference", default="default", help="the float model (safetensors directory or 'default')")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        parts = pack(args.src, args.prefix, tuple(args.drop or ("model.embed_tokens.weight",)), args.piece_mb)
        total = sum(Path(q).stat().st_size for q in parts)
        print(f"packed {args.src}: {total / 1e6:.1f} MB in {len(parts)} pieces ({args.prefix}0..)")
    else:
        unpack(args.prefix, args.out, args.reference)
        print(f"unpacked {args.out}: dropped tensors restored from {args.reference}, SHA-256 checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
