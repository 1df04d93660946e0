"""The k-local down's schedule on real shapes (dev/PERSISTENT.md, "Next device calls" item 1): no GPU needed.

    python dev/klocal_plan.py [--blocks 132] [--models llama2-7b,llama3-8b,llama3-70b]

Block b owns gate/up units [U b / G, U (b + 1) / G) (a unit: 16 rows of I, its gate and up panels), as the
launch's schedule gives whole units. Down's k-tile j (128 inputs, 8 units) is shared by the blocks whose units
it holds; they split its H / 16 panels in proportion to their units in it. For each model: each block's
gate/up and down bytes (int4: a 16 x 128 tile is 1 KB) against the even share, how many other blocks a block
waits for (the neighbours that made the rest of its k-tiles' inputs), and the fp32 partial sums it adds.
"""
import argparse
import sys

MODELS = {  # hidden H, intermediate I
    "llama2-7b": (4096, 11008),
    "llama3-8b": (4096, 14336),
    "qwen2.5-7b": (3584, 18944),
    "llama3-70b": (8192, 28672),
}


def plan(H: int, I: int, G: int) -> dict:
    units = I // 16
    ktiles = (I + 127) // 128
    own = [(units * b // G, units * (b + 1) // G) for b in range(G)]
    panels = H // 16
    gate_up = [2 * (u1 - u0) * (H // 128) for u0, u1 in own]  # 1 KB tiles: gate and up panels, H / 128 k-tiles
    down, waits, adds = [], [], []
    for b, (u0, u1) in enumerate(own):
        tiles = 0.0
        others = set()
        add = 0
        for j in range(u0 // 8, (u1 - 1) // 8 + 1 if u1 > u0 else u0 // 8):
            lo, hi = 8 * j, min(8 * j + 8, units)
            mine = max(0, min(u1, hi) - max(u0, lo))
            tiles += panels * mine / (hi - lo)
            add += round(panels * mine / (hi - lo)) * 16
            others |= {c for c, (v0, v1) in enumerate(own) if c != b and min(v1, hi) > max(v0, lo)}
        down.append(tiles)
        waits.append(len(others))
        adds.append(add)
    total = [g + d for g, d in zip(gate_up, down)]
    even = sum(total) / G
    return dict(units=units, ktiles=ktiles, gate_up=(min(gate_up), max(gate_up)), down=(min(down), max(down)),
                total=(min(total), max(total)), even=even, waits=(min(waits), max(waits)),
                adds=(min(adds), max(adds)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=132)
    ap.add_argument("--models", default="llama2-7b,llama3-8b,llama3-70b")
    a = ap.parse_args(argv)
    bad = [m for m in a.models.split(",") if m not in MODELS]
    if bad or a.blocks < 1:
        print(f"klocal_plan: unknown model {bad} (known: {', '.join(MODELS)}) or --blocks < 1", file=sys.stderr)
        return 2
    print(f"{a.blocks} blocks; KB of int4 tiles a block (min-max), the even share of gate/up + down, other blocks "
          f"waited for, fp32 partial sums added")
    for m in a.models.split(","):
        p = plan(*MODELS[m], a.blocks)
        print(f"{m:11s} units {p['units']:5d}  down k-tiles {p['ktiles']:4d}  gate/up {p['gate_up'][0]}-{p['gate_up'][1]}"
              f"  down {p['down'][0]:.0f}-{p['down'][1]:.0f}  both {p['total'][0]:.0f}-{p['total'][1]:.0f}"
              f" (even {p['even']:.0f}, +{100 * (p['total'][1] / p['even'] - 1):.1f}% at most)"
              f"  waits for {p['waits'][0]}-{p['waits'][1]}  adds {p['adds'][0]}-{p['adds'][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
