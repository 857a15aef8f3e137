#!/usr/bin/env python3
"""Delivery latency of `--order insert` against `--order commit` with several relays at work.

    pip install 'psycopg[binary]'
    python3 bench/order-latency.py [--bin target/release/leasectl] [--relays 2] [--events 600] [--rate 60]

With `--order commit` an event waits for every transaction older than its own, and that includes
the other relays' batch transactions (each holds an id from its claim's DELETE until it commits):
this measures what that costs. For each order, in a fresh schema: RELAYS continuous relays with an
`exec:` sink (each delivery a `sh` appending the time and the event id to a file, so a batch
takes a few ms per event), and one psycopg connection inserting one event per transaction at
RATE per second, noting the time of each COMMIT's answer. Latency = delivery time - commit time.
Orders alternate over ROUNDS; printed: p50 / p99 per order, and commit/insert ratios.
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parent.parent


def run_once(args, order, d):
    schema = "bench_lat_" + uuid.uuid4().hex[:10]
    subprocess.run([args.bin, "--schema", schema, "migrate"], check=True, stdout=subprocess.DEVNULL)
    out = os.path.join(d, f"{schema}.txt")
    sink = f"exec:printf '%s %s\\n' \"$(date +%s.%N)\" \"$LEASECTL_EVENT_ID\" >> '{out}'"
    relays = [
        subprocess.Popen([args.bin, "--schema", schema, "relay", "--sink", sink, "--order", order, "--poll", "1s"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(args.relays)
    ]
    committed = {}
    try:
        time.sleep(0.5)
        with psycopg.connect("", autocommit=False) as conn:
            for i in range(args.events):
                with conn.cursor() as cur:
                    cur.execute(
                        f'INSERT INTO "{schema}".outbox (aggregate_type, aggregate_id, type, payload) '
                        "VALUES ('order', %s, 'order.paid', %s) RETURNING id::text",
                        (str(i % 50), '{"n": %d}' % i),
                    )
                    eid = cur.fetchone()[0]
                conn.commit()
                committed[eid] = time.time()
                time.sleep(1 / args.rate)
        deadline = time.time() + 60
        got = {}
        while time.time() < deadline:
            got = {}
            if os.path.exists(out):
                for line in open(out):
                    parts = line.split()
                    if len(parts) == 2:
                        got.setdefault(parts[1], float(parts[0]))
            if len(got) >= len(committed):
                break
            time.sleep(0.2)
    finally:
        for r in relays:
            r.terminate()
            r.wait()
        with psycopg.connect("", autocommit=True) as c:
            c.execute("SET client_min_messages = warning")
            c.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return [max(0.0, got[e] - t) * 1000 for e, t in committed.items() if e in got], len(committed) - len(got)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "target/release/leasectl"))
    ap.add_argument("--relays", type=int, default=2)
    ap.add_argument("--events", type=int, default=600)
    ap.add_argument("--rate", type=float, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ.pop("DATABASE_URL", None)
    res = {"insert": [], "commit": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for order in (["insert", "commit"] if r % 2 == 0 else ["commit", "insert"]):
                lat, lost = run_once(args, order, d)
                res[order].append((pct(lat, 0.5), pct(lat, 0.99)))
                print(f"  round {r + 1}: --order {order}: p50 {pct(lat, 0.5):.1f} ms, p99 {pct(lat, 0.99):.1f} ms"
                      + (f", {lost} not delivered within 60 s" if lost else ""), flush=True)
    med = statistics.median
    p50 = {o: med(x[0] for x in v) for o, v in res.items()}
    p99 = {o: med(x[1] for x in v) for o, v in res.items()}
    print(f"\n{args.relays} relays, exec: sink, {args.events} events at {args.rate}/s, medians of {args.rounds} rounds:")
    for o in ("insert", "commit"):
        print(f"  --order {o}: p50 {p50[o]:.1f} ms, p99 {p99[o]:.1f} ms")
    print(f"  commit/insert: p50 {p50['commit'] / p50['insert']:.2f}, p99 {p99['commit'] / p99['insert']:.2f}")


if __name__ == "__main__":
    main()
