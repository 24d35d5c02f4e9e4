"""Print an ncu `--csv` metrics dump (one row per metric) as one line per profiled launch.

    ncu --csv --metrics a,b,c python3 some_probe.py > run.csv
    python bench/probe/ncu_table.py run.csv [--every 2 --offset 1]   # e.g. only each variant's second launch
"""
import argparse
import csv
import io
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--every", type=int, default=1, help="keep every k-th launch ...")
    p.add_argument("--offset", type=int, default=0, help="... starting at this one")
    args = p.parse_args()
    text = open(args.csv).read()
    start = text.find('"ID"')
    if start < 0:
        print("no ncu CSV rows in", args.csv)
        return 1
    launches, metrics = {}, []
    for row in csv.DictReader(io.StringIO(text[start:])):
        key = row["ID"]
        rec = launches.setdefault(key, {"kernel": row["Kernel Name"][:28], "grid": row["Grid Size"],
                                        "block": row["Block Size"]})
        rec[row["Metric Name"]] = row["Metric Value"]
        if row["Metric Name"] not in metrics:
            metrics.append(row["Metric Name"])
    rows = list(launches.values())[args.offset::args.every]
    short = [m.replace("__", ".").replace(".avg.pct_of_peak_sustained", "%").replace(".sum", "") for m in metrics]
    print(" | ".join(["kernel", "grid", "block"] + short))
    for r in rows:
        print(" | ".join([r["kernel"], r["grid"], r["block"]] + [r.get(m, "") for m in metrics]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
