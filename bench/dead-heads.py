#!/usr/bin/env python3
"""How much dead events ahead of the live ones slow `leasectl relay` down (issue 12 §5.9).

    pip install 'psycopg[binary]'
    python3 bench/dead-heads.py [--dead 300000] [--live 1000,10] [--batch 100] [--rounds 3]
                                [--order insert,commit] [--bin target/release/leasectl]

Needs a local PostgreSQL reachable like a bare `psql` (the libpq environment, else the local
socket as the current OS user; DATABASE_URL is ignored) and psycopg 3.

Each measurement uses a fresh schema bench_dead_<random>, migrated by the binary and dropped right
after: DEAD dead events (`dead_at` set, as the relay leaves an event it gave up on), each its own
aggregate, inserted first, then LIVE live events, each its own aggregate (≈200-byte JSON
payloads), then VACUUM ANALYZE. Measured: the wall time of `leasectl relay --once --batch BATCH
--sink stdout --order ORDER`, start to exit, draining the live events (its stdout is counted:
every live event must come out once, and the dead ones must all stay). The reference is the same
drain with no dead events, in the same round: candidates run in an order rotated from round to
round, and the figures are medians over the rounds. The ratio printed is drain time with DEAD
dead events ÷ drain time with none; the goal is at most 2 ×.

With --compare BIN, a second binary (say, one built before migration 0010) is measured the same
way in the same rounds, each with its own reference, and the two are compared drain by drain
(this ÷ compare; with --dead 0 that is what the change costs a drain with no dead events).
"""

import argparse
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:
    import psycopg
except ImportError:
    sys.exit("dead-heads.py: needs psycopg 3: pip install 'psycopg[binary]'")

REPO = Path(__file__).resolve().parent.parent
GOAL = 2.0
PAYLOAD = '{"n": 1, "pad": "' + "x" * 170 + '"}'


def fill(schema, dead, live):
    with psycopg.connect("", autocommit=True) as c:
        c.execute("SET client_min_messages = warning")
        if dead:
            c.execute(
                f'INSERT INTO "{schema}".outbox (aggregate_type, aggregate_id, type, payload,'
                "                               attempts, last_error, dead_at)"
                " SELECT 'order', 'dead-' || g, 'order.paid', %s::jsonb, 5, 'HTTP 500', now()"
                "   FROM generate_series(1, %s) g",
                (PAYLOAD, dead),
            )
        c.execute(
            f'INSERT INTO "{schema}".outbox (aggregate_type, aggregate_id, type, payload)'
            " SELECT 'order', 'live-' || g, 'order.paid', %s::jsonb FROM generate_series(1, %s) g",
            (PAYLOAD, live),
        )
        c.execute(f'VACUUM ANALYZE "{schema}".outbox')


def count(schema):
    with psycopg.connect("", autocommit=True) as c:
        return c.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0]


def drop(schema):
    with psycopg.connect("", autocommit=True) as c:
        c.execute("SET client_min_messages = warning")
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def drain(binary, dead, live, batch, order):
    """Seconds `relay --once` takes to deliver `live` events behind `dead` dead ones."""
    schema = "bench_dead_" + secrets.token_hex(4)
    subprocess.run([binary, "--schema", schema, "migrate"], check=True, stdout=subprocess.DEVNULL)
    try:
        fill(schema, dead, live)
        start = time.perf_counter()
        p = subprocess.run(
            [binary, "--schema", schema, "relay", "--once", "--batch", str(batch), "--sink", "stdout",
             "--order", order],
            capture_output=True, text=True,
        )
        wall = time.perf_counter() - start
        if p.returncode != 0:
            sys.exit(f"relay exited {p.returncode}: {p.stderr[-2000:]}")
        lines = p.stdout.count("\n")
        left = count(schema)
        if lines != live or left != dead:
            sys.exit(f"relay published {lines} of {live} live events and left {left} (expected the "
                     f"{dead} dead ones)")
        return wall
    finally:
        drop(schema)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "target/release/leasectl"))
    ap.add_argument("--compare", help="a second binary measured in the same rounds")
    ap.add_argument("--dead", type=int, default=300_000)
    ap.add_argument("--live", default="1000,10", help="live events behind them, comma-separated")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--order", default="insert,commit", help="insert, commit or both (comma-separated)")
    a = ap.parse_args()
    binaries = [("this", a.bin)] + ([("compare", a.compare)] if a.compare else [])
    lives = [int(x) for x in a.live.split(",")]
    orders = a.order.split(",")
    candidates = [(b, o, l, d) for b in binaries for o in orders for l in lives for d in sorted({0, a.dead})]
    times = {c: [] for c in candidates}
    for r in range(a.rounds):
        k = r % len(candidates)
        for c in candidates[k:] + candidates[:k]:
            (name, binary), order, live, dead = c
            times[c].append(drain(binary, dead, live, a.batch, order))
            print(f"  round {r + 1}: {name:7} --order {order:6} {live:6} live behind {dead:7} dead: "
                  f"{times[c][-1]:7.3f} s", flush=True)
    print(f"\nrelay --once --batch {a.batch} --sink stdout, median of {a.rounds} rounds "
          f"(reference: the same drain with no dead events, same binary, same rounds):")
    worst = 0.0
    for (name, binary) in binaries:
        print(f"  {name}: {binary}")
        for order in orders:
            for live in lives:
                ref = statistics.median(times[((name, binary), order, live, 0)])
                med = statistics.median(times[((name, binary), order, live, a.dead)])
                ratio = med / ref
                if name == "this":
                    worst = max(worst, ratio)
                print(f"    --order {order:6} {live:6} live: {ref:7.3f} s with none, {med:7.3f} s "
                      f"behind {a.dead} dead: {ratio:6.2f} ×")
    if a.compare:
        print("  this ÷ compare, the same drain:")
        for order in orders:
            for live in lives:
                for dead in sorted({0, a.dead}):
                    this = statistics.median(times[(binaries[0], order, live, dead)])
                    other = statistics.median(times[(binaries[1], order, live, dead)])
                    print(f"    --order {order:6} {live:6} live behind {dead:7} dead: {this / other:6.2f} ×")
    print(f"\nworst ratio of {a.bin}: {worst:.2f} × (goal: at most {GOAL:.0f} ×)")


if __name__ == "__main__":
    main()
