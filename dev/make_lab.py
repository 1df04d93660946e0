"""Make an edited copy of csrc/ for a kernel-lab A/B (dev/lab_ab.sh).

The product build has no tuning switches; a lab variant is a copy of csrc/
with a few lines changed.  Each edit below must match exactly once, so a
variant that no longer applies to today's csrc/ fails here, not on the GPU.

    python dev/make_lab.py rt4 lab_rt4      # four row tiles a warp at 9..16 tokens
    python dev/make_lab.py wide0 lab_wide0  # two row tiles at 9..16 tokens on every N
    VARIANTS="new=csrc: rt4=lab_rt4: w0=lab_wide0:" bash dev/lab_ab.sh --ms 16
"""
import shutil
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# variant -> [(file, old, new)]
EDITS = {
    # The GEMV with four 16-row panels a warp for 9..16 tokens where two are
    # used today (int4 per channel and G = 128, from kWideMinPanels panels):
    # x (16 tokens x K) is read once per 64 rows instead of 32.
    "rt4": [
        ("instances.h", "  X(4, 0, false, 2, 2, false)   \\\n",
         "  X(4, 0, false, 2, 2, false)   \\\n  X(4, 0, false, 2, 4, false)   \\\n"),
        ("instances.h", "  X(4, 128, false, 2, 2, false) \\\n",
         "  X(4, 128, false, 2, 2, false) \\\n  X(4, 128, false, 2, 4, false) \\\n"),
        ("instances.h", "  X(4, 128, true, 2, 2, false)\n",
         "  X(4, 128, true, 2, 2, false) \\\n  X(4, 128, true, 2, 4, false)\n"),
        ("gemv_mma.cuh",
         "  const int rt = nt == 2 && num_panels(p.N) >= tuning::kWideMinPanels &&\n"
         "                         gemv_row(kBits, p.group_size, zeros, 2, 2) != 0\n"
         "                     ? 2\n"
         "                     : 1;\n",
         "  const bool wide = nt == 2 && num_panels(p.N) >= tuning::kWideMinPanels;\n"
         "  const int rt = wide && gemv_row(kBits, p.group_size, zeros, 2, 4) != 0   ? 4\n"
         "                 : wide && gemv_row(kBits, p.group_size, zeros, 2, 2) != 0 ? 2\n"
         "                                                                           : 1;\n"),
        # one block of 8 warps a SM may hold 255 registers a thread
        ("gemv_mma.cuh",
         "                                   : 65536 / (kMaxWarps * 32 * tuning::kGemvMinBlocksPerSm);\n",
         "                                   : kRT == 4 ? 255 : 65536 / (kMaxWarps * 32 * tuning::kGemvMinBlocksPerSm);\n"),
    ],
    # Two row tiles at 9..16 tokens on every N (o and down too: x halved).
    "wide0": [
        ("tuning.h", "constexpr int kWideMinPanels = 512;\n", "constexpr int kWideMinPanels = 0;\n"),
    ],
}


def main(argv):
    if len(argv) != 3 or argv[1] not in EDITS:
        print(f"usage: python dev/make_lab.py {{{'|'.join(EDITS)}}} OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[2])
    if out.resolve() == CSRC:
        print("make_lab: OUT_DIR must not be csrc/ itself", file=sys.stderr)
        return 2
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(CSRC, out)
    for name, old, new in EDITS[argv[1]]:
        path = out / name
        text = path.read_text()
        if text.count(old) != 1:
            print(f"make_lab: {argv[1]}: {name}: the edited text occurs {text.count(old)} times, not once "
                  f"(csrc/ changed; update dev/make_lab.py):\n{old}", file=sys.stderr)
            shutil.rmtree(out)
            return 1
        path.write_text(text.replace(old, new))
    print(f"{out}: csrc/ with the {argv[1]} edits ({len(EDITS[argv[1]])})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
