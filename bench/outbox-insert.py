#!/usr/bin/env python3
"""What the outbox's NOTIFY trigger costs applications: insert rate of concurrent autocommit writers.

    python3 bench/outbox-insert.py [--clients 8] [--seconds 8] [--rounds 3]
                                   [--bin target/release/leasectl] [--baseline OLD]

Needs `psql` and `pgbench` reaching a local PostgreSQL like a bare `psql` (the libpq
environment; DATABASE_URL is ignored). Standard library only.

Each run is `pgbench -n -M prepared -c CLIENTS -j CLIENTS -T SECONDS` with one statement per
transaction (autocommit): an INSERT of one event (≈200-byte JSON payload, 1000 aggregates) into
a fresh schema's outbox, in one of these modes, rotated from round to round:

  always   the trigger as it was up to schema version 3: a NOTIFY for every statement
  marked   the trigger as it is (migration 0007): a NOTIFY only while a relay holds the idle mark;
           no relay running, so none
  off      the trigger disabled (ALTER TABLE … DISABLE TRIGGER): the same inserts, no NOTIFY
  pre0009  `marked` without what migration 0009 adds to every insert (the index on (xid, seq) and
           the pg_current_xact_id() default; the column stays, with a constant default): the
           reference for what `--order commit`'s bookkeeping costs applications
  pre0010  `marked` without what migration 0010 adds to every insert (the partial index
           outbox_live on seq; outbox_commit_order on (xid, seq) as migration 0009 made it, not
           partial): the reference for what skipping dead events costs applications
  always+relay, marked+relay, off+relay
           the same with a continuous `leasectl relay --sink stdout` (to /dev/null, --poll 1s)
           draining the outbox meanwhile, which is how the table is used

  MODE@baseline
           with --baseline OLD: MODE in a schema that build made (its migrations, its trigger,
           its relay), measured in the same rounds; `marked` and `marked+relay` get one each by
           default, and each is printed as this build ÷ the baseline

Printed: inserts per second (median over the rounds) per mode, and the ratios to `off` in the
same setting (with or without the relay), which is the figure issue 12 §5.7 asks for (≥ 0.8);
`marked` is compared with `pre0010` (else `pre0009`) when that mode ran.
"""

import argparse
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

OLD_TRIGGER = """
DROP TRIGGER outbox_notify ON {s}.outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON {s}.outbox FOR EACH STATEMENT
    WHEN (current_setting('leasectl.outbox_notified', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION {s}.outbox_notify();
"""


def psql(sql):
    subprocess.run(["psql", "-qX", "-v", "ON_ERROR_STOP=1", "-c", "SET client_min_messages = warning", "-c", sql], check=True,
                   stdout=subprocess.DEVNULL)


def scalar(sql):
    return subprocess.run(["psql", "-qXAt", "-c", sql], check=True, capture_output=True,
                          text=True).stdout.strip()


def fresh_schema(binary, trigger):
    schema = "bench_ins_" + secrets.token_hex(4)
    subprocess.run([binary, "--schema", schema, "migrate"], check=True, stdout=subprocess.DEVNULL)
    if trigger == "always":
        psql(OLD_TRIGGER.format(s=schema))
    elif trigger == "off":
        psql(f"ALTER TABLE {schema}.outbox DISABLE TRIGGER outbox_notify")
    elif trigger == "pre0009":
        psql(f"DROP INDEX {schema}.outbox_commit_order; "
             f"ALTER TABLE {schema}.outbox ALTER COLUMN xid SET DEFAULT '0'")
    elif trigger == "pre0010":
        psql(f"DROP INDEX {schema}.outbox_live; DROP INDEX {schema}.outbox_commit_order; "
             f"CREATE INDEX outbox_commit_order ON {schema}.outbox (xid, seq)")
    return schema


def pgbench(script, clients, seconds):
    out = subprocess.run(["pgbench", "-n", "-M", "prepared", "-c", str(clients), "-j",
                          str(clients), "-T", str(seconds), "-f", script],
                         check=True, capture_output=True, text=True).stdout
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
    if not m:
        sys.exit(f"cannot read pgbench's output:\n{out}")
    return float(m.group(1))


def one_run(a, d, mode):
    mode, _, which = mode.partition("@")
    binary = a.baseline if which == "baseline" else a.bin
    trigger, _, relayed = mode.partition("+")
    schema = fresh_schema(binary, trigger)
    script = os.path.join(d, "insert.sql")
    with open(script, "w") as f:
        f.write("\\set aid random(1, 1000)\n"
                f"INSERT INTO {schema}.outbox (aggregate_type, aggregate_id, type, payload) "
                "VALUES ('order', :aid, 'order.paid', "
                f"'{{\"n\": 1, \"pad\": \"{'x' * 150}\"}}');\n")
    relay = None
    try:
        if relayed:
            relay = subprocess.Popen([binary, "--schema", schema, "relay", "--sink", "stdout",
                                      "--poll", "1s"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # connected and listening (a late start only costs the relay)
        rate = pgbench(script, a.clients, a.seconds)
        left = None
        if relay:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                left = int(scalar(f"SELECT count(*) FROM {schema}.outbox"))
                if left == 0:
                    break
                time.sleep(0.2)
            if left:
                print(f"warning: {mode}: {left} events still in the outbox 60 s after the run")
        return rate
    finally:
        if relay:
            relay.terminate()
            relay.wait()
        psql(f"DROP SCHEMA {schema} CASCADE")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/leasectl")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="always,marked,off,always+relay,marked+relay,off+relay")
    ap.add_argument("--baseline", help="another leasectl build measured in the same rounds (bench/compare builds one)")
    a = ap.parse_args()
    os.environ.pop("DATABASE_URL", None)
    modes = a.modes.split(",")
    if a.baseline:
        if not os.path.isfile(a.baseline):
            sys.exit(f"outbox-insert: --baseline {a.baseline} not found")
        modes += [m + "@baseline" for m in ("marked", "marked+relay") if m in modes and m + "@baseline" not in modes]
    elif any(m.endswith("@baseline") for m in modes):
        sys.exit("outbox-insert: a MODE@baseline needs --baseline")
    rates = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for m in order:
                rates[m].append(one_run(a, d, m))
                print(f"  round {r + 1}: {m:22} {rates[m][-1]:8.0f} inserts/s", flush=True)
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"\n{a.clients} autocommit writers, {a.seconds} s per run, median of {a.rounds} rounds:")
    for m in modes:
        if m.endswith("@baseline"):
            print(f"  {m:22} {med[m]:8.0f} inserts/s  (baseline)")
            continue
        if m + "@baseline" in med:
            print(f"  {m:22} {med[m]:8.0f} inserts/s  {med[m] / med[m + '@baseline']:.2f} × baseline")
            continue
        ref = "off+relay" if m.endswith("+relay") else "off"
        for pre in ("pre0010", "pre0009"):
            if m.startswith("marked") and m.replace("marked", pre) in med:
                ref = m.replace("marked", pre)
                break
        ratio = f"{med[m] / med[ref]:.2f} × {ref}" if ref in med and m != ref else ""
        print(f"  {m:22} {med[m]:8.0f} inserts/s  {ratio}")


if __name__ == "__main__":
    main()
