#!/usr/bin/env python3
"""How soon a `leasectl run --wait` waiter starts its command after the holder's command ends,
directly (LISTEN/NOTIFY) and through a transaction-mode pooler (polling).

    python3 bench/wake-latency.py [--rounds 20] [--bin target/release/leasectl]
                                  [--pooler host=127.0.0.1 port=6433]

Each round: a holder runs `sh -c 'sleep 0.3; date > T0'` under the lease; a waiter, started
once the holder runs, waits with `--wait=30s` and runs `date > T1`. The figure is T1 - T0: the
holder's fenced save and release, the wake-up, the waiter's acquire and its command's start.
The same rounds with `--wait` against a free target give the reference (no wake-up at all), so
the difference is the wake-up itself. Without --pooler only the direct mode is measured.
Standard library only.
"""

import argparse
import os
import secrets
import statistics
import subprocess
import tempfile
import time


def now_cmd(path):
    return f"python3 -c 'import time; open(\"{path}\", \"w\").write(repr(time.time()))'"


def one_round(binary, url, schema, d):
    t0, t1, started = (os.path.join(d, n) for n in ("t0", "t1", "started"))
    for p in (t0, t1, started):
        if os.path.exists(p):
            os.unlink(p)
    base = [binary, "--schema", schema]
    if url:
        base += ["--database-url", url]
    holder = subprocess.Popen(base + ["run", "--target", "w", "--", "sh", "-c",
                                      f"touch {started}; sleep 0.3; {now_cmd(t0)}"])
    while not os.path.exists(started):
        time.sleep(0.005)
    waiter = subprocess.Popen(base + ["run", "--target", "w", "--wait=30s", "--", "sh", "-c",
                                      now_cmd(t1)])
    holder.wait()
    waiter.wait()
    return float(open(t1).read()) - float(open(t0).read())


def free_round(binary, url, schema, d):
    """The reference: the same commands one after the other, no waiting involved."""
    t0, t1 = os.path.join(d, "t0"), os.path.join(d, "t1")
    base = [binary, "--schema", schema]
    if url:
        base += ["--database-url", url]
    subprocess.run(base + ["run", "--target", "f", "--", "sh", "-c", now_cmd(t0)], check=True)
    subprocess.run(base + ["run", "--target", "f", "--wait=30s", "--", "sh", "-c", now_cmd(t1)],
                   check=True)
    return float(open(t1).read()) - float(open(t0).read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--bin", default="target/release/leasectl")
    ap.add_argument("--pooler", help="connection string of a transaction-mode pgbouncer")
    a = ap.parse_args()
    os.environ.pop("DATABASE_URL", None)
    modes = [("direct", None)] + ([("pooler", a.pooler)] if a.pooler else [])
    schema = "bench_wake_" + secrets.token_hex(4)
    with tempfile.TemporaryDirectory() as d:
        ref = {m: [] for m, _ in modes}
        wake = {m: [] for m, _ in modes}
        for _ in range(a.rounds):
            for m, url in modes:
                ref[m].append(free_round(a.bin, url, schema, d))
                wake[m].append(one_round(a.bin, url, schema, d))
        for m, _ in modes:
            r, w = statistics.median(ref[m]), statistics.median(wake[m])
            print(f"{m:7} waiter starts {w * 1000:6.1f} ms after the holder's command ends "
                  f"(median of {a.rounds}; p90 {sorted(wake[m])[int(a.rounds * 0.9) - 1] * 1000:.1f} ms); "
                  f"back-to-back reference {r * 1000:.1f} ms; ratio {w / r:.2f}")
    subprocess.run(["psql", "-qXc", f"DROP SCHEMA IF EXISTS {schema} CASCADE"],
                   stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
