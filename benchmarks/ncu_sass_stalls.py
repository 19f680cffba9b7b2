"""Nsight Compute's per-instruction warp-stall samples of one kernel, summed by SASS opcode and listed for the
hottest instructions: `ncu ... --section SourceCounters --section WarpStateStats -o REPORT python ...`, then

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv
    python benchmarks/ncu_sass_stalls.py SOURCE.csv [--top 40]

(the CSV's columns are found by name: the SASS text, "Warp Stall Sampling (All Samples)" and the
per-reason stall columns where the report has them).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if "Source" in line and "Sampling" in line)
    rows = list(csv.DictReader(lines[start:]))
    columns = list(rows[0].keys())
    print("columns:", columns)
    source = next(c for c in columns if c.strip('"') == "Source")
    samples = next(c for c in columns if "Warp Stall Sampling (All" in c)
    reasons = [c for c in columns if c.startswith("stall_") or "Stall" in c and c not in (samples,)]
    total = sum(_number(r[samples]) for r in rows) or 1.0
    by_opcode = collections.Counter()
    for r in rows:
        opcode = re.sub(r"^@!?U?P\w+\s+", "", r[source].strip()).split(" ")[0]
        by_opcode[opcode] += _number(r[samples])
    print(f"total samples {total:.0f}")
    for opcode, n in by_opcode.most_common(25):
        print(f"  {opcode:40s} {100 * n / total:5.1f}%")
    print("hottest instructions (address order kept in the index):")
    hot = sorted(enumerate(rows), key=lambda item: -_number(item[1][samples]))[: args.top]
    for index, r in sorted(hot):
        top_reasons = sorted(((_number(r[c]), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c.strip()} {v:.0f}" for v, c in top_reasons if v > 0)
        print(f"{index:5d} {100 * _number(r[samples]) / total:5.1f}%  {r[source].strip()[:70]:70s} {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
