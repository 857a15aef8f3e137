#!/usr/bin/env python3
"""Peak RSS of `leasectl relay --once` draining big events, with and without a byte bound.

    python3 bench/batch-bytes.py [--bin target/release/leasectl] [--events 30] [--mb 10] [--rounds 2]

Each round fills a fresh schema (through `psql`, the libpq defaults) with N events of M MB of
JSON text each (hex digits, which PostgreSQL's compression barely shrinks), all of one
`--batch 100` batch's reach, then drains it with `relay --once --sink stdout > /dev/null` under GNU
time (`%M`, peak RSS) — once with `--batch-bytes 1GiB` (no bound in practice: the behaviour before
`--batch-bytes` existed) and once with the default 16MiB, in an order alternated per round. The
reference is the unbounded drain of the same round: the ratio is bounded/unbounded.
"""

import argparse
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def psql(sql):
    subprocess.run(["psql", "-qX", "-v", "ON_ERROR_STOP=1", "-c", "SET client_min_messages = warning", "-c", sql],
                   check=True, stdout=subprocess.DEVNULL)


def drain(binary, schema, bound):
    with open("/dev/null", "w") as null:
        start = time.perf_counter()
        p = subprocess.run(
            ["/usr/bin/time", "-f", "%M", binary, "--schema", schema, "relay", "--once", "--sink", "stdout",
             "--batch", "100", "--batch-bytes", bound],
            stdout=null, stderr=subprocess.PIPE, text=True,
        )
        wall = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit(f"relay exited {p.returncode}: {p.stderr}")
    return int(p.stderr.strip().splitlines()[-1]) / 1024, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "target/release/leasectl"))
    ap.add_argument("--events", type=int, default=30)
    ap.add_argument("--mb", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    chunks = args.mb * 1_000_000 // 32
    results = {"1GiB": [], "16MiB": []}
    for r in range(args.rounds):
        order = ["1GiB", "16MiB"] if r % 2 == 0 else ["16MiB", "1GiB"]
        for bound in order:
            schema = "bench_" + uuid.uuid4().hex[:12]
            subprocess.run([args.bin, "--schema", schema, "migrate"], check=True, stdout=subprocess.DEVNULL)
            try:
                psql(
                    f'INSERT INTO "{schema}".outbox (aggregate_type, aggregate_id, type, payload) '
                    f"SELECT 'blob', (i % 4)::text, 'blob', "
                    f"to_jsonb((SELECT string_agg(md5(i::text || ':' || j::text), '') "
                    f"FROM generate_series(1, {chunks}) j)) FROM generate_series(1, {args.events}) i"
                )
                rss, wall = drain(args.bin, schema, bound)
                results[bound].append((rss, wall))
                print(f"  round {r + 1}: --batch-bytes {bound}: peak RSS {rss:.0f} MiB, {wall:.1f} s", flush=True)
            finally:
                psql(f'DROP SCHEMA "{schema}" CASCADE')
    med = statistics.median
    ref = med(x[0] for x in results["1GiB"])
    got = med(x[0] for x in results["16MiB"])
    print(f"\n{args.events} × {args.mb} MB events, medians of {args.rounds} rounds:")
    print(f"| --batch-bytes | peak RSS | wall | ratio to unbounded |")
    print(f"|---|---:|---:|---:|")
    for bound, label in (("1GiB", "1GiB (unbounded, as before)"), ("16MiB", "16MiB (default)")):
        rss = med(x[0] for x in results[bound])
        wall = med(x[1] for x in results[bound])
        print(f"| {label} | {rss:.0f} MiB | {wall:.1f} s | {rss / ref:.2f} |")
    print(f"\nbounded/unbounded peak RSS: {got / ref:.2f}")


if __name__ == "__main__":
    main()
