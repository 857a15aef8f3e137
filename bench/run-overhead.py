#!/usr/bin/env python3
"""What wrapping a command in `leasectl run` costs, side by side with references.

Run from anywhere, after `cargo build --release`:

    python3 bench/run-overhead.py [--rounds 100] [--bin target/release/leasectl] [--baseline OLD]

Candidates, each measured as the wall time of one whole process (start to exit):

  leasectl   leasectl --schema S run --target t -- true   (connect, migrate check, acquire,
             run `true`, fenced save of run + outbox event, release)
  psql       psql -qAtc 'select 1'                        (connect, one query)
  psql-bin   the same, calling the psql executable directly, when `psql` on PATH is Debian's
             pg_wrapper (a Perl script that adds ~25 ms of its own before psql even starts)
  flock      flock -n FILE true                           (a local lock file, no network)
  etcdctl    etcdctl lock NAME true                       (against --etcd-endpoint if given, else
             an etcd the script starts itself on spare ports, with a temporary data directory,
             stopped at the end; left out when neither etcd nor etcdctl is installed)

  floor      bench/floor/run_floor.c, built here with `cc`: the least a PostgreSQL-coordinated run
             can do — one connection start, one acquiring statement (a durable commit), the
             spawn of `true`, one statement saving the result under the fence and releasing
             (a durable commit), nothing else. What no client of the same database can beat;
             left out without a C compiler, or where the local socket asks for a password.

  baseline   OLD --schema S2 run --target t -- true         (with --baseline: another build, e.g.
             the last release, in a schema of its own, since an older binary refuses a schema
             migrated by a newer one; its holding memory is measured as leasectl's is; both
             builds once more with `sleep 0.005` for `true`, a command of a few milliseconds;
             and the baseline's `--version`, `migrate` and `run --no-event` beside leasectl's
             below, so that each build runs as often in a round as the other — a process is
             slower right after one of the other build's than after one of its own)

Every round runs each candidate once, in an order shuffled afresh each round (seeded, so a rerun
with the same candidates runs the same orders), so drift in the machine's load hits all of them
alike, and no candidate always runs right after the same other one: with orders rotated from
round to round, `run --no-event` always came right after `migrate` and `run` right after `run
--no-event`, and the breakdown showed the outbox event making the run 0.27 ms *faster*, where
the two alternated alone give 0.98 × the other way round. Three more leasectl invocations run in the same rounds to
show where a run's time goes: `--version` (process start only), `migrate` (start + connect +
schema check) and `run --no-event` (a run without the outbox insert). Then: the latency of a *busy* answer (a second
`leasectl run` on a target another leasectl holds, exit 75), interleaved with psql the same way,
and the resident memory of the holding leasectl process: VmRSS / VmHWM from /proc while it
holds, and its peak RSS as GNU `/usr/bin/time -v` reports it when it exits (the holder runs
under GNU time when that is installed; Debian package `time`).

leasectl and psql both reach PostgreSQL the way a bare `psql` does: the libpq environment, else
the local socket as the current OS user (DATABASE_URL is removed from the environment so both
take the same path). All rows go to a fresh schema bench_<random>, dropped at the end.
Standard library only.
"""

import argparse
import json
import os
import platform
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GOAL_VS_PSQL = 0.35  # leasectl run / psql 'select 1'
GOAL_VS_ETCD = 0.5  # leasectl run / etcdctl lock
GOAL_RSS_MIB = 8.0  # resident memory of a holding leasectl
GOAL_VS_BASELINE = 0.9  # leasectl run / the same with the --baseline build


def env_without_database_url():
    env = dict(os.environ)
    env.pop("DATABASE_URL", None)
    return env


ENV = env_without_database_url()
# What the timed commands get: the same, plus ETCDCTL_API=3 for etcdctl (the default of etcdctl
# 3.4 and later; older ones would otherwise speak the v2 API, which has no `lock`).
RUN_ENV = dict(ENV, ETCDCTL_API="3")


def timed(argv, expect=0):
    """Runs argv to completion; returns its wall time in ms. Fails loudly on a surprise exit code."""
    start = time.perf_counter_ns()
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=RUN_ENV)
    elapsed = (time.perf_counter_ns() - start) / 1e6
    if p.returncode != expect:
        sys.exit(
            f"run-overhead: {' '.join(argv)} exited {p.returncode}, expected {expect}: "
            f"{p.stderr.decode(errors='replace').strip()}"
        )
    return elapsed


def psql(sql, check=True):
    return subprocess.run(
        ["psql", "-XqAt", "-v", "ON_ERROR_STOP=1", "-c", sql],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=ENV,
        check=check,
    ).stdout.strip()


def port_open(host, port):
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def median(xs):
    return statistics.median(xs)


def interleaved(candidates, rounds):
    """candidates: list of (name, argv, expected exit). Returns {name: [ms, ...]}."""
    times = {name: [] for name, _, _ in candidates}
    shuffle = random.Random(len(candidates) * 1000 + rounds).shuffle
    for _ in range(rounds):
        order = list(candidates)
        shuffle(order)
        for name, argv, expect in order:
            times[name].append(timed(argv, expect))
    return times


def proc_status_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def wait_until_held(leasectl, target, holder, patience=30.0):
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        if holder.poll() is not None:
            sys.exit(f"run-overhead: the holder exited early with {holder.returncode}")
        p = subprocess.run(leasectl + ["status", "--json"], capture_output=True, env=ENV)
        if p.returncode == 0:
            doc = json.loads(p.stdout)
            if any(t["target"] == target and t["state"] == "held" for t in doc["targets"]):
                return
        time.sleep(0.05)
    sys.exit(f"run-overhead: '{target}' was not held within {patience}s")


def spare_port():
    """A TCP port nothing listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """A single-node etcd of our own: spare client and peer ports, a temporary data directory
    (on the same disk as the system's temporary files), stopped and removed by `stop`."""

    def __init__(self, binary, workdir):
        self.client_port, self.peer_port = spare_port(), spare_port()
        while self.peer_port == self.client_port:
            self.peer_port = spare_port()
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.log = open(os.path.join(workdir, "etcd.log"), "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                "--name", "bench",
                "--data-dir", os.path.join(workdir, "etcd-data"),
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"bench={peer}",
                "--initial-cluster-state", "new",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=ENV,
        )

    def wait_ready(self, etcdctl, patience=30.0):
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"run-overhead: etcd exited {self.proc.returncode} at start; see {self.log.name}")
            p = subprocess.run(
                [etcdctl, f"--endpoints={self.endpoint}", "--dial-timeout=1s", "endpoint", "health"],
                capture_output=True,
                env=RUN_ENV,
            )
            if p.returncode == 0:
                return
            time.sleep(0.1)
        sys.exit(f"run-overhead: etcd did not become healthy within {patience}s; see {self.log.name}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def gnu_time():
    """/usr/bin/time if it is GNU time (it understands -v), else None."""
    path = "/usr/bin/time"
    if not os.access(path, os.X_OK):
        return None
    p = subprocess.run([path, "-v", "true"], capture_output=True, text=True)
    return path if p.returncode == 0 and "Maximum resident set size" in p.stderr else None


def child_pid(pid, patience=10.0):
    """The one child of `pid` (GNU time's leasectl), once it has started."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = f.read().split()
        except OSError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    sys.exit(f"run-overhead: GNU time (pid {pid}) started no command within {patience}s")


def max_rss_kib(report):
    for line in report.splitlines():
        if "Maximum resident set size" in line:
            return int(line.rsplit(":", 1)[1])
    return None


def real_psql():
    """The psql executable behind `psql` on PATH, if that is Debian's pg_wrapper; else None."""
    path = shutil.which("psql")
    if not path or os.path.basename(os.path.realpath(path)) != "pg_wrapper":
        return None
    # pg_wrapper runs the newest installed client unless ~/.postgresqlrc says otherwise.
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/psql"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in p.parent.parent.name.split(".")],
    )
    return str(found[-1]) if found else None


def holding_rss(leasectl, binary, timer, workdir):
    """(VmRSS, VmHWM, peak RSS by GNU time or None) in MiB of `leasectl run` holding a lease."""
    report = os.path.join(workdir, f"holder-{os.getpid()}-{secrets.token_hex(3)}.time")
    holder = subprocess.Popen(
        ([timer, "-v", "-o", report] if timer else []) + leasectl + ["run", "--target", "rss", "--", "sleep", "60"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )
    pid = child_pid(holder.pid) if timer else holder.pid
    try:
        wait_until_held(leasectl, "rss", holder)
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        if comm != binary.name[:15]:
            sys.exit(f"run-overhead: pid {pid} is {comm!r}, not {binary.name}")
        rss = proc_status_kib(pid, "VmRSS") / 1024
        hwm = proc_status_kib(pid, "VmHWM") / 1024
    finally:
        os.kill(pid, signal.SIGTERM)
        holder.wait(timeout=30)
    peak = None
    if timer:
        with open(report) as f:
            kib = max_rss_kib(f.read())
        peak = kib / 1024 if kib else None
    return rss, hwm, peak


def build_floor(workdir, schema):
    """Builds bench/floor/run_floor.c and makes its tables in SCHEMA; returns its argv prefix,
    or None (with the reason printed) when it cannot be built or cannot connect."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        print("floor: not available (no C compiler)")
        return None
    exe = os.path.join(workdir, "run_floor")
    p = subprocess.run([cc, "-O2", "-o", exe, str(REPO / "bench/floor/run_floor.c")], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"floor: not available (cc failed: {p.stderr.strip()[:200]})")
        return None
    psql(
        f'CREATE SCHEMA "{schema}";'
        f'CREATE TABLE "{schema}".floor_leases (target text PRIMARY KEY, token text, fence int8 NOT NULL,'
        f" heartbeat_at timestamptz NOT NULL);"
        f'CREATE TABLE "{schema}".floor_runs (target text NOT NULL, fence int8 NOT NULL, exit_code int4,'
        f" finished_at timestamptz NOT NULL, PRIMARY KEY (target, fence))"
    )
    p = subprocess.run([exe, schema, "t", "true"], capture_output=True, text=True, env=RUN_ENV)
    if p.returncode != 0:
        print(f"floor: not available (exit {p.returncode}: {p.stderr.strip()})")
        return None
    return [exe, schema, "t"]


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "postgres": psql("SHOW server_version"),
    }


def ratio(a, b):
    return a / b if b else float("nan")


def verdict(value, goal):
    return "met" if value <= goal else "NOT met"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=100, help="interleaved rounds (default 100, at least 30)")
    ap.add_argument("--bin", default=str(REPO / "target/release/leasectl"), help="leasectl binary")
    ap.add_argument(
        "--baseline",
        help="another leasectl build (e.g. the last release) measured in the same rounds; bench/compare builds one",
    )
    ap.add_argument(
        "--etcd-endpoint",
        help="an etcd to measure etcdctl against (host:port); default: start one on spare ports",
    )
    args = ap.parse_args()
    if args.rounds < 30:
        sys.exit("run-overhead: --rounds must be at least 30")
    binary = Path(args.bin)
    if not binary.is_file():
        sys.exit(f"run-overhead: {binary} not found; build it first: cargo build --release")
    baseline = Path(args.baseline) if args.baseline else None
    if baseline and not baseline.is_file():
        sys.exit(f"run-overhead: --baseline {baseline} not found")
    for tool in ("psql", "flock"):
        if not shutil.which(tool):
            sys.exit(f"run-overhead: {tool} is not installed")

    schema = "bench_" + secrets.token_hex(6)
    leasectl = [str(binary), "--schema", schema]
    base_schema = schema + "_base"
    base = [str(baseline), "--schema", base_schema] if baseline else None
    floor_schema = schema + "_floor"
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout.strip()
    base_version = (
        subprocess.run([str(baseline), "--version"], capture_output=True, text=True).stdout.strip() if baseline else None
    )
    info = machine()
    print(f"{version}; PostgreSQL {info['postgres']}; {info['nproc']} cores ({info['cpu']}); Linux {info['kernel']}")
    if baseline:
        print(f"baseline: {base_version} ({baseline}), schema {base_schema}")
    print(f"schema {schema}, {args.rounds} interleaved rounds\n")

    holder = None
    etcd_server = None
    tmp = tempfile.TemporaryDirectory(prefix="leasectl-bench-")
    try:
        lockfile = os.path.join(tmp.name, "lock")
        candidates = [
            ("leasectl", leasectl + ["run", "--target", "t", "--", "true"], 0),
            ("psql", ["psql", "-qAtc", "select 1"], 0),
            ("flock", ["flock", "-n", lockfile, "true"], 0),
        ]
        if base:
            candidates.append(("baseline", base + ["run", "--target", "t", "--", "true"], 0))
            # A command that runs a few milliseconds, as real ones do: what leasectl does while
            # it runs (planning the save) is then off the path; with `true` it is not.
            candidates.append(("sleep", leasectl + ["run", "--target", "t", "--", "sleep", "0.005"], 0))
            candidates.append(("baseline-sleep", base + ["run", "--target", "t", "--", "sleep", "0.005"], 0))
        floor = build_floor(tmp.name, floor_schema)
        if floor:
            candidates.append(("floor", floor + ["true"], 0))
        psql_bin = real_psql()
        if psql_bin:
            candidates.append(("psql-bin", [psql_bin, "-qAtc", "select 1"], 0))
            print(f"psql on PATH is Debian's pg_wrapper (Perl); psql-bin = {psql_bin}")
        etcdctl = shutil.which("etcdctl")
        endpoint = None
        if not etcdctl:
            print("etcd: not available (no etcdctl; Debian package etcd-client)")
        elif args.etcd_endpoint:
            host, _, port = args.etcd_endpoint.rpartition(":")
            if not port.isdigit() or not port_open(host or "127.0.0.1", int(port)):
                sys.exit(f"run-overhead: nothing answers on --etcd-endpoint {args.etcd_endpoint}")
            endpoint = args.etcd_endpoint
        elif shutil.which("etcd"):
            etcd_server = Etcd(shutil.which("etcd"), tmp.name)
            etcd_server.wait_ready(etcdctl)
            endpoint = etcd_server.endpoint
            print(f"etcd: started on {endpoint} (peer port {etcd_server.peer_port}, data in {tmp.name})")
        else:
            print("etcd: not available (no etcd server to start; Debian package etcd-server)")
        etcd = endpoint is not None
        if etcd:
            candidates.append(
                ("etcdctl", [etcdctl, f"--endpoints={endpoint}", "lock", f"leasectl-bench-{schema}", "true"], 0)
            )

        breakdown = [
            ("version", [str(binary), "--version"], 0),
            ("migrate", leasectl + ["migrate"], 0),
            ("no-event", leasectl + ["run", "--target", "t", "--no-event", "--", "true"], 0),
        ]
        if base:
            # The same invocations of the baseline, so that each build runs as often per round as
            # the other: a process that runs right after one of the other build's measured about
            # 0.5 ms slower than right after one of its own (caches; docs/BENCHMARKS.md), and with
            # five of leasectl's to two of the baseline's in each round, the baseline more often
            # followed leasectl and the ratio favoured leasectl by about 3 %. A twin the baseline
            # build does not take (an option it predates) is left out.
            for name, argv, expect in list(breakdown):
                twin = [str(baseline)] + argv[1:] if name == "version" else base + argv[len(leasectl):]
                probe = subprocess.run(twin, stdin=subprocess.DEVNULL, capture_output=True, env=RUN_ENV)
                if probe.returncode == expect:
                    breakdown.append(("baseline-" + name, twin, expect))
                else:
                    print(f"baseline: `{name}` left out of the rounds (exit {probe.returncode})")

        # Warm-up: creates the schema (migrations), fills the page cache, opens every binary once.
        for _, argv, expect in candidates + breakdown:
            timed(argv, expect)

        times = interleaved(candidates + breakdown, args.rounds)
        med = {name: median(xs) for name, xs in times.items()}
        print("Run overhead (median wall time of the whole process, ms):")
        for name, _, _ in candidates:
            xs = times[name]
            print(f"  {name:9} median {med[name]:7.2f}   min {min(xs):7.2f}   max {max(xs):7.2f}")
        print("Where leasectl run's time goes (same rounds, medians, ms):")
        print(f"  process start (leasectl --version)              {med['version']:7.2f}")
        print(f"  + connect and schema check (leasectl migrate)   {med['migrate'] - med['version']:+7.2f}")
        print(f"  + acquire, run `true`, fenced save, release     {med['no-event'] - med['migrate']:+7.2f}   (run --no-event: {med['no-event']:.2f})")
        print(f"  + the outbox event in the save                  {med['leasectl'] - med['no-event']:+7.2f}   (run: {med['leasectl']:.2f})")
        if all(f"baseline-{n}" in med for n in ("version", "migrate", "no-event")):
            print("The same for the baseline build:")
            print(f"  process start (--version)                       {med['baseline-version']:7.2f}")
            print(f"  + connect and schema check (migrate)            {med['baseline-migrate'] - med['baseline-version']:+7.2f}")
            print(f"  + acquire, run `true`, fenced save, release     {med['baseline-no-event'] - med['baseline-migrate']:+7.2f}   (run --no-event: {med['baseline-no-event']:.2f})")
            print(f"  + the outbox event in the save                  {med['baseline'] - med['baseline-no-event']:+7.2f}   (run: {med['baseline']:.2f})")

        # Busy answer: a holder keeps the lease; every contender is turned away with 75.
        timer = gnu_time()
        time_report = os.path.join(tmp.name, "holder.time")
        holder = subprocess.Popen(
            ([timer, "-v", "-o", time_report] if timer else [])
            + leasectl
            + ["run", "--target", "busy", "--", "sleep", "60"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=ENV,
        )
        holder_pid = child_pid(holder.pid) if timer else holder.pid
        wait_until_held(leasectl, "busy", holder)
        with open(f"/proc/{holder_pid}/comm") as f:
            comm = f.read().strip()
        if comm != binary.name[:15]:
            sys.exit(f"run-overhead: pid {holder_pid} is {comm!r}, not {binary.name}")
        busy_candidates = [
            ("busy", leasectl + ["run", "--target", "busy", "--", "true"], 75),
            ("psql", ["psql", "-qAtc", "select 1"], 0),
        ]
        if psql_bin:
            busy_candidates.append(("psql-bin", [psql_bin, "-qAtc", "select 1"], 0))
        busy_times = interleaved(busy_candidates, args.rounds)
        busy = median(busy_times["busy"])
        busy_psql = median(busy_times["psql"])
        busy_psql_bin = median(busy_times["psql-bin"]) if psql_bin else None
        rss_mib = proc_status_kib(holder_pid, "VmRSS") / 1024
        hwm_mib = proc_status_kib(holder_pid, "VmHWM") / 1024
        os.kill(holder_pid, signal.SIGTERM)
        code = holder.wait(timeout=30)
        holder = None
        if code != 143:
            print(f"warning: the holder exited {code} after SIGTERM, expected 143")
        peak_kib = None
        if timer:
            with open(time_report) as f:
                peak_kib = max_rss_kib(f.read())
        peak_mib = peak_kib / 1024 if peak_kib else None

        base_rss = None
        if base:
            base_rss = holding_rss(base, baseline, timer, tmp.name)
            print(f"Holding baseline: VmRSS {base_rss[0]:.2f} MiB, VmHWM {base_rss[1]:.2f} MiB"
                  + (f", peak {base_rss[2]:.2f} MiB" if base_rss[2] is not None else ""))

        same = f"psql {busy_psql:.2f} ms" + (f", psql-bin {busy_psql_bin:.2f} ms" if psql_bin else "")
        print(f"\nBusy answer (exit 75): median {busy:.2f} ms ({same} in the same rounds)")
        print(f"Holding leasectl (pid of leasectl, not its child): VmRSS {rss_mib:.2f} MiB, VmHWM {hwm_mib:.2f} MiB")
        if peak_mib is not None:
            print(f"  GNU time -v, maximum resident set size over its whole life: {peak_mib:.2f} MiB")
        else:
            print("  GNU time: not installed (Debian package time); peak RSS from /proc only")

        r_psql = ratio(med["leasectl"], med["psql"])
        r_flock = ratio(med["leasectl"], med["flock"])
        r_busy = ratio(busy, busy_psql)
        lines = [
            f"leasectl run overhead, {args.rounds} interleaved rounds, medians "
            f"({version}, PostgreSQL {info['postgres']}, {info['nproc']} cores, {info['cpu']})",
            "",
            "| measure | median | ratio | goal |",
            "|---|---:|---|---|",
            f"| `leasectl run --target t -- true` | {med['leasectl']:.2f} ms | | |",
            f"| `psql -qAtc 'select 1'` (psql on PATH) | {med['psql']:.2f} ms | leasectl/psql = **{r_psql:.3f}** "
            f"| ≤ {GOAL_VS_PSQL} — {verdict(r_psql, GOAL_VS_PSQL)} |",
        ]
        if psql_bin:
            r_bin = ratio(med["leasectl"], med["psql-bin"])
            lines.append(
                f"| `{psql_bin} -qAtc 'select 1'` (no Perl wrapper) | {med['psql-bin']:.2f} ms "
                f"| leasectl/psql-bin = **{r_bin:.3f}** | ≤ {GOAL_VS_PSQL} — {verdict(r_bin, GOAL_VS_PSQL)} |"
            )
        lines.append(f"| `flock -n FILE true` | {med['flock']:.2f} ms | leasectl/flock = {r_flock:.2f} | (reference only) |")
        def vs_base(mine, theirs):
            """This build ÷ the baseline: the ratio of the medians, and the median of the rounds' ratios."""
            paired = median([a / b for a, b in zip(times[mine], times[theirs]) if b])
            return ratio(med[mine], med[theirs]), paired

        if base:
            r_base, paired = vs_base("leasectl", "baseline")
            lines.append(
                f"| baseline `run --target t -- true` ({base_version}) | {med['baseline']:.2f} ms "
                f"| leasectl/baseline = **{r_base:.3f}** (paired, per round: {paired:.3f}) "
                f"| ≤ {GOAL_VS_BASELINE} — {verdict(r_base, GOAL_VS_BASELINE)} |"
            )
            r_sleep, paired = vs_base("sleep", "baseline-sleep")
            lines.append(
                f"| `run --target t -- sleep 0.005`, this build / baseline | {med['sleep']:.2f} / "
                f"{med['baseline-sleep']:.2f} ms | leasectl/baseline = **{r_sleep:.3f}** (paired, per round: {paired:.3f}) "
                f"| (a command of a few ms) |"
            )
        if etcd:
            r_etcd = ratio(med["leasectl"], med["etcdctl"])
            lines.append(
                f"| `etcdctl lock NAME true` | {med['etcdctl']:.2f} ms | leasectl/etcdctl = **{r_etcd:.3f}** "
                f"| ≤ {GOAL_VS_ETCD} — {verdict(r_etcd, GOAL_VS_ETCD)} |"
            )
        else:
            lines.append(f"| `etcdctl lock NAME true` | not available | | ≤ {GOAL_VS_ETCD} — not measured |")
        if floor:
            r_floor = ratio(med["leasectl"], med["floor"])
            vs = []
            if base:
                vs.append(f"floor/baseline = {ratio(med['floor'], med['baseline']):.3f}")
            if etcd:
                vs.append(f"floor/etcdctl = {ratio(med['floor'], med['etcdctl']):.3f}")
            lines.append(
                f"| the floor (bench/floor/run_floor.c: connect, acquire, spawn `true`, save; two durable commits) "
                f"| {med['floor']:.2f} ms | leasectl/floor = **{r_floor:.3f}**"
                + ("; " + ", ".join(vs) if vs else "")
                + " | (what no client can beat) |"
            )
        lines += [
            f"| leasectl --version / migrate / run --no-event | {med['version']:.2f} / {med['migrate']:.2f} / "
            f"{med['no-event']:.2f} ms | (breakdown) | |",
            f"| busy answer (`run` on a held target, exit 75) | {busy:.2f} ms | busy/psql = {r_busy:.3f}"
            + (f", busy/psql-bin = {ratio(busy, busy_psql_bin):.3f}" if psql_bin else "")
            + f" ({same} in the same rounds) | |",
            f"| holding leasectl, VmRSS / VmHWM (/proc) / peak RSS (GNU time -v) | {rss_mib:.2f} / {hwm_mib:.2f} / "
            + (f"{peak_mib:.2f}" if peak_mib is not None else "n/a")
            + f" MiB | | ≤ {GOAL_RSS_MIB:g} MiB — "
            + verdict(max(rss_mib, hwm_mib, peak_mib or 0), GOAL_RSS_MIB)
            + " |",
        ]
        if base_rss:
            b_peak = base_rss[2]
            lines.append(
                f"| holding baseline, VmRSS / VmHWM / peak RSS | {base_rss[0]:.2f} / {base_rss[1]:.2f} / "
                + (f"{b_peak:.2f}" if b_peak is not None else "n/a")
                + f" MiB | leasectl/baseline peak = {ratio(peak_mib or hwm_mib, b_peak or base_rss[1]):.2f} | |"
            )
        print("\n----- summary (paste into docs/BENCHMARKS.md) -----")
        print("\n".join(lines))
        print("----- end of summary -----")
    finally:
        if holder is not None and holder.poll() is None:
            os.kill(holder_pid, signal.SIGTERM)
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
        if etcd_server is not None:
            etcd_server.stop()
        psql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE', check=False)
        if base:
            psql(f'DROP SCHEMA IF EXISTS "{base_schema}" CASCADE', check=False)
        psql(f'DROP SCHEMA IF EXISTS "{floor_schema}" CASCADE', check=False)
        tmp.cleanup()


if __name__ == "__main__":
    main()
