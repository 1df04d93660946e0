"""The persistent chain's chunk loop in machine code, compared between kernels (no GPU needed).

    python dev/sass_loop.py FILE PATTERN_A [PATTERN_B] [--cuobjdump PATH] [--show N]

FILE: a cubin, an object or the extension's .so (sm_90a code); PATTERN: a substring of a kernel's mangled
name, e.g. ``chain_kernelILi4ELi128ELb1ELb1ELb0E6__half`` (int4 G = 128 with zero points, norms, fp16
activations) against ``...ELb0E13__nv_bfloat16`` (a decode kernel's name ends in ``Lb0E`` without the attention's
octet form, ``Lb1E`` with it).  For each kernel: the chunk loop (from the header of the
innermost loop holding every HMMA of the kernel to the first SYNCS.ARRIVE after it: the tile math and the
ring's refill) and its instruction count; with two kernels, whether the loops hold the same multiset of
opcodes, and how much of their order agrees (difflib's ratio over opcode sequences; 1.0 the same order).
Two kernels with the same multiset and another order differ only in ptxas's schedule, which on 2026-12-05
cost the int4 chain ~3 us a layer (dev/PERSISTENT.md).

--base FILE2: the spill screen, before device time: for every kernel of FILE whose name holds PATTERN_A (any
number of them), its local-memory instructions (LDL / STL: register spills at the 128-register cap) against the
same kernel's in FILE2, the build before a change.  The octet K / V fold of 2026-12-07 moved the chunk loop by one
instruction and spilled 40 more values beside it (LDL 7 -> 47): the engine ran 9-14% slower.

cuobjdump: --cuobjdump, else $CUOBJDUMP, else on PATH (this machine's nvcc has none; PyPI's
nvidia-cuda-cuobjdump wheel holds one in nvidia/cu13/bin).  Exit 2 for bad input.
"""
import argparse
import collections
import difflib
import os
import re
import shutil
import subprocess
import sys


def functions(path: str, tool: str) -> dict:
    out = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"sass_loop: {tool} -sass {path} failed: {out.stderr.strip()[:300]}")
    found = {}
    for part in re.split(r"\n\s*Function : ", out.stdout)[1:]:
        name, body = part.split("\n", 1)
        # each instruction: its address, its text, the high word of its encoding (the control bits)
        found[name.strip()] = [(int(a, 16), re.sub(r"\s+", " ", t.strip()), int(hi, 16)) for a, t, hi in re.findall(
            r"/\*([0-9a-f]{4,})\*/\s+([^;]*);\s*/\* 0x[0-9a-f]{16} \*/\s*/\* 0x([0-9a-f]{16}) \*/", body)]
    return found


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+ ", "", text).split(" ")[0]


def chunk_loop(ins: list) -> list:
    """The instructions of the innermost loop that holds every HMMA, up to the first SYNCS.ARRIVE after
    the last HMMA (the refill); [] when the kernel has no HMMA."""
    at = {a: n for n, (a, _, _) in enumerate(ins)}
    mma = [n for n, (_, t, _) in enumerate(ins) if "HMMA" in t]
    if not mma:
        return []
    best = None
    for n, (a, t, _) in enumerate(ins):
        m = re.search(r"BRA (?:[^,]*, )?0x([0-9a-f]+)", t)
        if m and n >= mma[-1]:
            head = at.get(int(m.group(1), 16))
            if head is not None and head <= mma[0] and (best is None or n - head < best[1] - best[0]):
                best = (head, n)
    if best is None:
        return []
    end = next((n for n in range(mma[-1], best[1] + 1) if "SYNCS.ARRIVE" in ins[n][1]), best[1])
    return [(t, hi) for _, t, hi in ins[best[0]:end + 1]]


def stalls(hi: int) -> int:
    """The stall count ptxas set in an instruction's control bits (cycles before the warp's next issue)."""
    return (hi >> 41) & 0xF


def spills(ins: list) -> tuple:
    """(LDL count, STL count) of a kernel: its loads from and stores to local memory."""
    ops = collections.Counter(opcode(t).split(".")[0] for _, t, _ in ins)
    return ops["LDL"], ops["STL"]


def spill_screen(new: dict, base: dict, pattern: str, new_file: str, base_file: str) -> int:
    """Print each kernel's spills in both builds; 1 when any kernel spills more in the new one, 2 when none
    matches."""
    names = sorted(n for n in new if pattern in n)
    if not names:
        print(f"sass_loop: pattern {pattern!r} matches no kernel of {new_file}", file=sys.stderr)
        return 2
    grew = 0
    print(f"LDL / STL, {base_file} -> {new_file}")
    for n in names:
        a = spills(base[n]) if n in base else None
        b = spills(new[n])
        flag = "" if a is None or sum(b) <= sum(a) else "  MORE"
        grew += bool(flag)
        print(f"  {'-' if a is None else f'{a[0]} / {a[1]}':>9} -> {b[0]} / {b[1]}{flag}  {n[:110]}")
    print(f"{grew} of {len(names)} kernels spill more")
    return 1 if grew else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("patterns", nargs="+", metavar="PATTERN")
    ap.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump"))
    ap.add_argument("--show", type=int, default=0, help="print the first N instructions of each loop")
    ap.add_argument("--base", metavar="FILE2", help="compare every matching kernel's spills with FILE2's")
    args = ap.parse_args(argv)
    if len(args.patterns) > 2:
        ap.error("at most two patterns")
    for f in [args.file] + ([args.base] if args.base else []):
        if not os.path.isfile(f):
            ap.error(f"{f}: no such file")
    if not args.cuobjdump:
        ap.error("no cuobjdump: pass --cuobjdump or set $CUOBJDUMP (pip download nvidia-cuda-cuobjdump has one)")
    funcs = functions(args.file, args.cuobjdump)
    if args.base:
        return spill_screen(funcs, functions(args.base, args.cuobjdump), args.patterns[0], args.file, args.base)
    loops = []
    for pat in args.patterns:
        names = [n for n in funcs if pat in n]
        if len(names) != 1:
            ap.error(f"pattern {pat!r} matches {len(names)} kernels of {args.file} (it must match one): "
                     + ", ".join(n[:90] for n in names[:6]))
        loop = chunk_loop(funcs[names[0]])
        if not loop:
            ap.error(f"{names[0][:90]}: no loop holding HMMAs")
        ops = collections.Counter(opcode(t) for t, _ in loop)
        print(f"{names[0]}\n  chunk loop: {len(loop)} instructions, {ops['HMMA.16816.F32']} HMMA, "
              f"{sum(v for k, v in ops.items() if k.startswith('LOP3') or k.startswith('SHF'))} LOP3/SHF; "
              f"stall cycles set by ptxas {sum(stalls(hi) for _, hi in loop)} (one warp's issue cycles without "
              f"scoreboard waits)")
        for t, hi in loop[:args.show]:
            print(f"    {stalls(hi):2d} {t}")
        loops.append([t for t, _ in loop])
    if len(loops) == 2:
        a, b = ([opcode(t) for t in lp] for lp in loops)
        ca, cb = collections.Counter(a), collections.Counter(b)
        diff = {k: (ca[k], cb[k]) for k in sorted(set(ca) | set(cb)) if ca[k] != cb[k]}
        same_pos = sum(x == y for x, y in zip(a, b))
        print(f"same multiset of opcodes: {'yes' if not diff else 'no ' + str(diff)}")
        print(f"order: difflib ratio {difflib.SequenceMatcher(None, a, b, autojunk=False).ratio():.3f}, "
              f"{same_pos} of {min(len(a), len(b))} positions hold the same opcode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
