"""Compare two eval/bench_gemv.py JSON files (before / after a change): time ratio per row.

    python dev/ab_compare.py OLD.json NEW.json [--ms 1,16] [--tol 3]

Prints one line per (shape, M, variant) of the qgemv variants and the count
of rows outside +-tol percent; exit 0 either way (it reports, it does not gate).
"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--tol", type=float, default=3.0)
    a = ap.parse_args()
    ms = {int(m) for m in a.ms.split(",")}
    rows = lambda path: {(r["N"], r["K"], r["M"], r["variant"]): r["us"] for r in json.load(open(path))["rows"]}  # noqa: E731
    old, new = rows(a.old), rows(a.new)
    out, worst = [], []
    for key in sorted(set(old) & set(new)):
        n, k, m, v = key
        if m not in ms or v in ("fp16", "bf16", "tinygemm_g128", "torch_int8"):
            continue
        pct = 100.0 * (new[key] / old[key] - 1.0)
        out.append(f"{n}x{k} M={m:<2d} {v:10s} {old[key]:8.1f} {new[key]:8.1f} us  {pct:+5.1f}%")
        worst.append(pct)
    fp = [100.0 * (new[key] / old[key] - 1.0) for key in set(old) & set(new) if key[3] == "fp16" and key[2] in ms]
    print("\n".join(out))
    print(f"{len(worst)} qgemv rows, {sum(abs(p) > a.tol for p in worst)} outside +-{a.tol}%; "
          f"range {min(worst):+.1f}% .. {max(worst):+.1f}%; fp16 cuBLAS rows {min(fp):+.1f}% .. {max(fp):+.1f}% (noise)")


if __name__ == "__main__":
    main()
