"""Compare eval/bench_gemv.py JSON files of two trees (before / after a change): time ratio per row.

    python dev/ab_compare.py OLD.json[,OLD2.json...] NEW.json[,NEW2.json...] [--ms 1,16] [--tol 3]

With several runs per tree (interleaved old, new, old, new), each row's time
is the fastest of that tree's runs, and the spread between runs of the same
tree is printed as the noise that the tolerance must be read against.
Prints one line per (shape, M, variant) of the qgemv variants and the count
of rows outside +-tol percent; exit 0 either way (it reports, it does not gate).
"""
import argparse
import json

SKIP = ("fp16", "bf16", "tinygemm_g128", "torch_int8")  # not qgemv's code


def rows(path):
    return {(r["N"], r["K"], r["M"], r["variant"]): r["us"] for r in json.load(open(path))["rows"]}


def best(paths):
    runs = [rows(p) for p in paths]
    keys = set.intersection(*(set(r) for r in runs))
    return {k: min(r[k] for r in runs) for k in keys}, runs


def pct(a, b):
    return 100.0 * (b / a - 1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--tol", type=float, default=3.0)
    a = ap.parse_args()
    ms = {int(m) for m in a.ms.split(",")}
    (old, old_runs), (new, new_runs) = best(a.old.split(",")), best(a.new.split(","))
    keys = sorted(k for k in set(old) & set(new) if k[2] in ms)
    out, worst = [], []
    for key in keys:
        n, k, m, v = key
        if v in SKIP:
            continue
        p = pct(old[key], new[key])
        out.append(f"{n}x{k} M={m:<2d} {v:10s} {old[key]:8.1f} {new[key]:8.1f} us  {p:+5.1f}%")
        worst.append(p)
    fp = [pct(old[key], new[key]) for key in keys if key[3] == "fp16"]
    print("\n".join(out))
    print(f"{len(worst)} qgemv rows, {sum(abs(p) > a.tol for p in worst)} outside +-{a.tol}%; "
          f"range {min(worst):+.1f}% .. {max(worst):+.1f}%; fp16 cuBLAS rows {min(fp):+.1f}% .. {max(fp):+.1f}% (noise)")
    for name, runs in (("old", old_runs), ("new", new_runs)):
        if len(runs) > 1:  # the same tree timed twice: the noise floor of one run
            same = [pct(runs[0][key], runs[1][key]) for key in keys if key[3] not in SKIP]
            print(f"{name} tree, run 2 vs run 1: {sum(abs(p) > a.tol for p in same)} of {len(same)} rows outside "
                  f"+-{a.tol}%, range {min(same):+.1f}% .. {max(same):+.1f}%")


if __name__ == "__main__":
    main()
