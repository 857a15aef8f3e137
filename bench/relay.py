#!/usr/bin/env python3
"""How fast `leasectl relay` moves outbox events, side by side with the SQL floor.

Run from anywhere, after `cargo build --release`:

    pip install pika nats-py 'psycopg[binary]'    # and optionally uvloop (a cheaper HTTP peer)
    python3 bench/relay.py [--quick] [--events 50000] [--rounds 5] [--bin target/release/leasectl] [--baseline OLD]

Needs a local PostgreSQL reachable like a bare `psql` (the libpq environment, else the local
socket as the current OS user; DATABASE_URL is ignored), `pgbench`, GNU time (/usr/bin/time, for
peak RSS; without it VmHWM is sampled from /proc), and for the broker sinks a
RabbitMQ on 127.0.0.1:5672 (guest/guest) and a NATS server with JetStream on 127.0.0.1:4222; a
broker that does not answer is reported "not available" and its line skipped. Python 3.11 with
pika (RabbitMQ: the test queue), nats-py (JetStream: count and delete the stream) and psycopg 3
(every SQL statement the script itself sends). Every measurement uses a fresh schema
bench_<random> (and a fresh exchange + queue or stream), dropped/deleted right after it.

Measured:

  throughput  `leasectl relay --once --batch 1000 --sink SINK` draining N events (≈200-byte JSON
              payloads; 1000 aggregates, and 100 and 1 aggregates for stdout; stdout also from
              an outbox that was never analyzed, beside the 1000-aggregate floor; `exec:true`,
              a process per event, with 5000 events) — wall time of the whole
              process, start to exit — against the floor: the relay's own claim statement (the
              CLAIM constant read from src/store/outbox/claim.rs, 1000 rows per statement, window 2000, max
              seq i64::MAX, reach 0: the relay looks past its window only while that finds something) run by `pgbench -M prepared` from one persistent connection,
              each in the transaction the relay opens for it (BEGIN_CLAIM's planner settings),
              until the table is empty, for each outbox shape (1000, 100, 1 aggregates). Each round fills a fresh schema (then VACUUM
              ANALYZE, except for the never-analyzed one) for every candidate, in an order rotated from round to round; the figures
              are medians over the rounds, and every ratio is relay/floor of the same rounds.
              Beside the 100-aggregate floor, a ceiling: a bare DELETE of the first 1000 events by
              ctid, RETURNING the claim's columns, committed asynchronously as the relay commits
              (pgbench again) — no window, no heads, no byte budget: what no claim of 1000 events
              per statement can beat; ceiling/floor bounds what relay/floor can reach.
              Sinks: stdout (to /dev/null), amqp (publisher confirms, a durable queue bound with
              `#`; once with the default message properties and once with `?properties=full`), nats (JetStream acks, file storage) and http (a multi-process keep-alive
              HTTP/1.1 peer started here, answering 204; only when the relay's http sink is built).
              Peak RSS and CPU time of each relay process come from GNU time (/usr/bin/time).
              Broker references in the same rounds: pika on one channel and nats-py, each with
              1000 acknowledged publishes in flight (Python clients: lower bounds of what the
              brokers take), pika also with `?properties=full`'s message properties, and each
              local broker's own CPU time per message.
  baseline    with --baseline OLD, every relay drain above is measured a second time in the same
              rounds with that build (e.g. the last release; bench/compare builds one), its schema
              made by its own `migrate`, and each line says this build ÷ the baseline.
  latency     a continuous `leasectl relay --sink stdout` and one persistent psycopg connection
              inserting one event per transaction, 5–10 ms apart; latency = from just before
              COMMIT is sent to the moment the relay's line arrives on its stdout pipe. Once with
              NOTIFY (default --poll 5s) and once with polling only (the inserts SET LOCAL
              leasectl.outbox_notified = 'on', which makes the trigger skip its NOTIFY;
              --poll 100ms). Reference, interleaved: the round trip of a trivial autocommit INSERT
              (one durable commit) on a second connection.
  table size  a continuous relay (stdout to /dev/null, --batch 1000) while the script inserts
              10k events per transaction and waits for each lot to be drained, up to 1M events;
              pg_total_relation_size of the outbox after the first 10k and after the last lot
              (each 1 s after the drain), the largest seen right after a drain, and the time it
              took. Stops after --size-budget seconds, or when one lot takes longer than
              --lot-timeout to drain (a stalled relay).
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    import psycopg
except ImportError:
    sys.exit("relay.py: needs psycopg 3: pip install 'psycopg[binary]' (and pika, nats-py for the brokers)")

REPO = Path(__file__).resolve().parent.parent
MAX_SEQ = 9223372036854775807
BATCH = 1000
# Events per drain for the `exec` sink (a process per event: a few thousand a second).
EXEC_EVENTS = 5000

GOAL_STDOUT_VS_FLOOR = 0.5
# This build ÷ the --baseline build on the stdout drain: at least as fast as the last release.
GOAL_VS_BASELINE = 1.0
GOAL_BROKER_EPS = 20_000
# Issue 12 §2: the relay keeps up with a plain client of the same broker (REF_WINDOW in flight).
GOAL_BROKER_VS_REF = 0.9
GOAL_P50_MS = 3.0
GOAL_P99_MS = 10.0
GOAL_RSS_MIB = 32.0
GOAL_SIZE_RATIO = 2.0

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2f"
NATS_URL = "nats://127.0.0.1:4222"

ENV = dict(os.environ)
ENV.pop("DATABASE_URL", None)
os.environ.pop("DATABASE_URL", None)


def die(msg):
    sys.exit(f"relay.py: {msg}")


# ----------------------------------------------------------------------------------------------
# PostgreSQL helpers


class Pg:
    """One persistent autocommit connection for the script's own statements."""

    def __init__(self):
        self.conn = psycopg.connect("", autocommit=True)

    def one(self, sql, params=None):
        row = self.conn.execute(sql, params).fetchone()
        return row[0] if row else None

    def run(self, sql, params=None):
        self.conn.execute(sql, params)


def quoted(schema):
    return f'"{schema}"'


def new_schema(leasectl):
    schema = "bench_" + secrets.token_hex(6)
    p = subprocess.run([*leasectl, "--schema", schema, "migrate"], capture_output=True, text=True, env=ENV)
    if p.returncode != 0:
        die(f"leasectl migrate exited {p.returncode}: {p.stderr.strip()}")
    return schema


def fill(pg, schema, n, aggregates, analyze=True):
    """N events over AGGREGATES aggregates in one statement, then VACUUM ANALYZE; without
    ANALYZE, autovacuum is kept off the table so that it is never analyzed (issue 9 §7)."""
    if not analyze:
        pg.run(f"ALTER TABLE {quoted(schema)}.outbox SET (autovacuum_enabled = off)")
    pg.run(
        f"INSERT INTO {quoted(schema)}.outbox (aggregate_type, aggregate_id, type, payload) "
        f"SELECT 'order', (g % {aggregates})::text, 'order.paid', "
        f"jsonb_build_object('n', g, 'pad', repeat('x', 150)) FROM generate_series(1, {n}) g"
    )
    if analyze:
        pg.run(f"VACUUM ANALYZE {quoted(schema)}.outbox")


def pending(pg, schema):
    return pg.one(f"SELECT count(*) FROM {quoted(schema)}.outbox")


def drop(pg, schema):
    pg.run(f"DROP SCHEMA IF EXISTS {quoted(schema)} CASCADE")


def real_binary(tool):
    """The executable behind `tool` on PATH when that is Debian's pg_wrapper (a Perl script)."""
    path = shutil.which(tool)
    if not path:
        return None
    if os.path.basename(os.path.realpath(path)) != "pg_wrapper":
        return path
    found = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{tool}"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in p.parent.parent.name.split(".")],
    )
    return str(found[-1]) if found else path


def claim_script(schema):
    """The relay's CLAIM statement in its transaction, as a pgbench script with :batch, :window,
    :maxseq, :reach and :bytes."""
    src = (REPO / "src/store/outbox/claim.rs").read_text()
    m = re.search(r'const CLAIM: &str = "(.*?)";', src, re.S)
    if not m:
        die("cannot find the CLAIM constant in src/store/outbox/claim.rs")
    sql = re.sub(r"--[^\n]*", "", m.group(1))
    # The order's placeholders (Order::claim_sql), as `--order insert` fills them: the floor is
    # the insert-order claim, the reference for both orders.
    sql = (
        sql.replace("{up_to}", "o.seq <= $3")
        .replace("{eligible}", "")
        .replace("{past}", "o.seq > (SELECT coalesce(max(seq), 0) FROM win1)")
        .replace("{firsts:win1}", "SELECT min(seq) AS seq FROM win1 GROUP BY aggregate_type, aggregate_id")
        .replace("{firsts:win2}", "SELECT min(seq) AS seq FROM win2 GROUP BY aggregate_type, aggregate_id")
    )
    sql = re.sub(r"\{key:(\w)\}", r"\1.seq", sql)
    # The shared predicates ({held}, …) are constants of src/store/mod.rs, spliced in by store::sql.
    shared = dict(re.findall(r'const (\w+): &str =\s*"(.*?)";', (REPO / "src/store/mod.rs").read_text(), re.S))
    # {not_held:X} and {agg_key:X} are for alias X ("A." in the constant), as store::sql does.
    for alias in "op":
        sql = sql.replace("{not_held:%s}" % alias, shared["NOT_HELD"].replace("A.", alias + ".")
                          .replace("{agg_key:A}", "{agg_key:%s}" % alias))
    for alias in "bop":
        sql = sql.replace("{agg_key:%s}" % alias, shared["AGG_KEY"].replace("A.", alias + "."))
    for name, text in shared.items():
        sql = sql.replace("{" + name.lower() + "}", text)
    if re.search(r"\{(?!s\})[\w:]+\}", sql):
        die("the CLAIM statement uses a placeholder bench/relay.py does not know; update it")
    sql = "\n".join(line.rstrip() for line in sql.splitlines() if line.strip())
    for param in ("$1", "$2", "$3", "$4", "$5", "$6", "$7", "$8"):
        if param not in sql:
            die(f"the CLAIM statement no longer uses {param}; update bench/relay.py")
    # $6, $7: a claim of the next batch while one is published excludes that one's events and
    # may come back empty; the floor is a plain claim: nothing excluded, the first event always.
    sql = sql.replace("$6", "'{}'::int8[]").replace("$7", "true")
    # $8: how much of the reach a look past the window takes in; one window, as the relay's first.
    sql = sql.replace("$8", ":window")
    sql = sql.replace("{s}", quoted(schema)).replace("$1", ":batch").replace("$2", ":window").replace("$3", ":maxseq").replace("$4", ":reach").replace("$5", ":bytes")
    # In the transaction the relay opens for it (BEGIN_CLAIM: its planner settings), one
    # command a line, since pgbench -M prepared prepares each command on its own.
    m = re.search(r'const BEGIN_CLAIM: &str = "(.*?)";', src, re.S)
    if not m:
        die("cannot find the BEGIN_CLAIM constant in src/store/outbox/claim.rs")
    begin = "".join(c.strip() + ";\n" for c in m.group(1).split(";") if c.strip())
    return begin + sql + ";\nCOMMIT;\n"


def ceiling_script(schema):
    """The ceiling of a claim (as a pgbench script): a bare DELETE of the first :batch live events
    by ctid, RETURNING what the relay's CLAIM returns, committed without waiting for the disk as
    the relay commits. No window, no heads, no held aggregates, no byte budget: what no claim
    of :batch events per statement can beat on the same outbox."""
    src = (REPO / "src/store/outbox/claim.rs").read_text()
    m = re.search(r'const CLAIM: &str = ".*?\n(RETURNING .*?)";', src, re.S)
    if not m:
        die("cannot find the CLAIM constant's RETURNING list in src/store/outbox/claim.rs")
    returning = m.group(1).replace("o.seq = ANY (ARRAY(SELECT seq FROM win2)) AS reached", "false AS reached")
    if "win2" in returning:
        die("the CLAIM statement's RETURNING list changed; update bench/relay.py's ceiling")
    q = quoted(schema)
    return (
        "BEGIN;\n"
        f"DELETE FROM {q}.outbox o WHERE o.ctid = ANY (ARRAY(SELECT ctid FROM {q}.outbox WHERE dead_at IS NULL "
        f"ORDER BY seq LIMIT :batch))\n" + " ".join(returning.split()) + ";\n"
        "SET LOCAL synchronous_commit = off;\nCOMMIT;\n"
    )


# ----------------------------------------------------------------------------------------------
# Processes


TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None


def run_measured(argv, stdout=subprocess.DEVNULL):
    """Runs argv to completion. Returns (exit code, wall seconds, peak RSS MiB, CPU s, stderr).

    Peak RSS comes from GNU time (`%M`), which forks a small process of its own: wait4() on a
    child that Python itself spawned reports the *Python* process's resident size (the child
    shares its memory until exec). Without /usr/bin/time, VmHWM is sampled from /proc instead.
    """
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as usage:
        prefix = [TIME, "-q", "-f", "%M %U %S", "-o", usage.name] if TIME else []
        start = time.perf_counter()
        p = subprocess.Popen(prefix + argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=err, env=ENV)
        hwm = 0
        if not TIME:
            while p.poll() is None:
                try:
                    hwm = max(hwm, proc_status_kib(p.pid, "VmHWM"))
                except (OSError, KeyError):
                    pass
                time.sleep(0.01)
        p.wait()
        wall = time.perf_counter() - start
        err.seek(0)
        text = err.read().decode(errors="replace").strip()
        if TIME:
            fields = usage.read().split()
            hwm, cpu = int(fields[-3]), float(fields[-2]) + float(fields[-1])
        else:
            cpu = float("nan")
    return p.returncode, wall, hwm / 1024, cpu, text


def proc_status_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def proc_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_process(p, what, timeout=30):
    if p.poll() is not None:
        return p.returncode
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"warning: {what} did not stop within {timeout}s after SIGTERM; killing it")
        p.kill()
        return p.wait()


def port_open(host, port):
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------
# RabbitMQ, NATS


class AmqpTarget:
    """A fresh durable topic exchange with a durable queue bound to it with `#`."""

    def __init__(self):
        import pika

        self.pika = pika
        tag = secrets.token_hex(6)
        self.exchange = f"bench.{tag}"
        self.queue = f"bench.{tag}"
        with self._channel() as ch:
            ch.exchange_declare(exchange=self.exchange, exchange_type="topic", durable=True)
            ch.queue_declare(queue=self.queue, durable=True)
            ch.queue_bind(queue=self.queue, exchange=self.exchange, routing_key="#")

    def _channel(self):
        conn = self.pika.BlockingConnection(self.pika.URLParameters(AMQP_URL))

        class Ctx:
            def __enter__(s):
                return conn.channel()

            def __exit__(s, *exc):
                conn.close()

        return Ctx()

    def sink(self):
        return f"{AMQP_URL}?exchange={self.exchange}"

    def count(self):
        with self._channel() as ch:
            return ch.queue_declare(queue=self.queue, passive=True).method.message_count

    def delete(self):
        with self._channel() as ch:
            ch.queue_delete(queue=self.queue)
            ch.exchange_delete(exchange=self.exchange)


class NatsTarget:
    """A fresh subject prefix and stream name; the relay creates the stream."""

    def __init__(self):
        tag = secrets.token_hex(6)
        self.subject = f"bench_{tag}"
        self.stream = f"BENCH_{tag.upper()}"

    def sink(self):
        return f"{NATS_URL}?subject={self.subject}&stream={self.stream}"

    def _js(self, op):
        import nats

        async def go():
            nc = await nats.connect(NATS_URL)
            try:
                return await op(nc.jetstream())
            finally:
                await nc.close()

        return asyncio.run(go())

    def count(self):
        async def op(js):
            return (await js.stream_info(self.stream)).state.messages

        return self._js(op)

    def delete(self):
        async def op(js):
            try:
                await js.delete_stream(self.stream)
            except Exception:  # not created (the relay failed before): nothing to delete
                pass

        self._js(op)


# What a plain client gets from the same broker on this machine: the ceiling the relay's broker
# figures are read against. Same message size, persistent/file-stored, acknowledged, but with up to
# REF_WINDOW publishes in flight (one channel / one connection) instead of one per aggregate.
REF_WINDOW = 1000
REF_BODY = json.dumps(
    {"id": "0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11", "aggregate_type": "order", "aggregate_id": "123",
     "type": "order.paid", "payload": {"n": 123, "pad": "x" * 150}, "created_at": "2026-01-01T00:00:00.000000Z"}
).encode()


def amqp_reference(n, same_props=False):
    """pika, one channel in confirm mode, REF_WINDOW persistent mandatory publishes in flight.

    same_props: with every property the relay sets (type, app_id, and the aggregate_type and
    aggregate_id headers), so the broker handles the same messages as from the relay."""
    import pika

    target = AmqpTarget()
    st = {"sent": 0, "acked": 0, "t0": 0.0, "t1": 0.0, "returned": 0}
    conn = None

    def props(i):
        if not same_props:
            return pika.BasicProperties(delivery_mode=2, message_id=str(i), content_type="application/json")
        return pika.BasicProperties(
            delivery_mode=2, message_id=str(i), content_type="application/json", type="order.paid",
            app_id="leasectl", headers={"aggregate_type": "order", "aggregate_id": str(i % 1000)},
        )

    def pump(ch):
        while st["sent"] < n and st["sent"] - st["acked"] < REF_WINDOW:
            ch.basic_publish(target.exchange, "order.paid", REF_BODY, props(st["sent"]), mandatory=True)
            st["sent"] += 1

    def on_ack(frame):
        st["acked"] = max(st["acked"], frame.method.delivery_tag)
        if st["acked"] >= n:
            if not st["t1"]:
                st["t1"] = time.perf_counter()
                conn.close()
        else:
            pump(ch_box[0])

    ch_box = []

    def on_channel(ch):
        ch_box.append(ch)
        ch.add_on_return_callback(lambda *a: st.__setitem__("returned", st["returned"] + 1))

        def confirmed(_):
            st["t0"] = time.perf_counter()
            pump(ch)

        ch.confirm_delivery(on_ack, callback=confirmed)

    try:
        conn = pika.SelectConnection(
            pika.URLParameters(AMQP_URL),
            on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
            on_open_error_callback=lambda c, e: die(f"amqp reference: {e}"),
            on_close_callback=lambda c, why: c.ioloop.stop(),
        )
        conn.ioloop.start()
        got = target.count()
        if got != n or st["returned"]:
            print(f"  amqp-ref: the queue holds {got} messages ({st['returned']} returned), expected {n}")
        return n / (st["t1"] - st["t0"])
    finally:
        target.delete()


def nats_reference(n):
    """nats-py, a file-storage stream, REF_WINDOW concurrent publishes each awaiting its ack."""
    import nats

    target = NatsTarget()

    async def go():
        nc = await nats.connect(NATS_URL)
        try:
            js = nc.jetstream()
            await js.add_stream(name=target.stream, subjects=[f"{target.subject}.>"], storage="file")
            subject = f"{target.subject}.order.paid"
            it = iter(range(n))

            async def worker():
                for i in it:
                    await js.publish(subject, REF_BODY, headers={"Nats-Msg-Id": f"ref-{i}"})

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(REF_WINDOW)))
            return n / (time.perf_counter() - t0)
        finally:
            await nc.close()

    try:
        rate = asyncio.run(go())
        got = target.count()
        if got != n:
            print(f"  nats-ref: the stream holds {got} messages, expected {n}")
        return rate
    finally:
        target.delete()


def jetstream_enabled():
    try:
        import nats
    except ImportError:
        return False

    async def go():
        nc = await nats.connect(NATS_URL, connect_timeout=1, max_reconnect_attempts=0)
        try:
            await nc.jetstream().account_info()
            return True
        finally:
            await nc.close()

    try:
        return asyncio.run(go())
    except Exception:
        return False


# ----------------------------------------------------------------------------------------------
# The HTTP peer: W forked processes, each an asyncio server on the same listening socket.

RESPONSE = b"HTTP/1.1 204 No Content\r\n\r\n"


def http_worker(sock, counts, slot):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    class Hook(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.buf = bytearray()

        def data_received(self, data):
            buf = self.buf
            buf += data
            answered = 0
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = bytes(buf[:end]).lower()
                length = 0
                i = head.find(b"\r\ncontent-length:")
                if i >= 0:
                    j = head.find(b"\r\n", i + 2)
                    length = int(head[i + 17 : j if j >= 0 else len(head)])
                elif b"\r\ntransfer-encoding:" in head:
                    counts[slot * 2 + 1] += 1  # not parsed: counted as an error
                    self.transport.close()
                    return
                if len(buf) < end + 4 + length:
                    break
                del buf[: end + 4 + length]
                answered += 1
            if answered:
                counts[slot * 2] += answered
                self.transport.write(RESPONSE * answered)

    async def serve():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Hook, sock=sock, backlog=1024)
        async with server:
            await server.serve_forever()

    try:
        import uvloop  # optional: about halves the peer's CPU per request

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


class HttpPeer:
    def __init__(self, workers):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        ctx = multiprocessing.get_context("fork")
        self.counts = ctx.Array("q", 2 * workers, lock=False)
        self.procs = [ctx.Process(target=http_worker, args=(self.sock, self.counts, i), daemon=True) for i in range(workers)]
        for p in self.procs:
            p.start()

    def url(self):
        return f"http://127.0.0.1:{self.port}/hook"

    def requests(self):
        return sum(self.counts[0::2])

    def errors(self):
        return sum(self.counts[1::2])

    def cpu(self):
        return sum(proc_cpu_seconds(p.pid) for p in self.procs)

    def close(self):
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
        self.sock.close()


# ----------------------------------------------------------------------------------------------
# Throughput


class Candidate:
    def __init__(self, name, aggregates, kind, label, analyze=True, events=None, order="insert", query="", binary=None):
        self.name, self.aggregates, self.kind, self.label = name, aggregates, kind, label
        self.analyze, self.events, self.order, self.query = analyze, events, order, query
        # The leasectl argv prefix to measure: None for --bin, else the --baseline build's.
        self.binary = binary
        self.rates, self.rss, self.cpu_us, self.broker_us = [], [], [], []

    def twin(self, binary):
        """The same drain with another build, measured in the same rounds."""
        t = Candidate(self.name + "@baseline", self.aggregates, self.kind, self.label + " — baseline build",
                      self.analyze, self.events, self.order, self.query, binary)
        t.of = self.name
        return t


def broker_pid(kind):
    """The local broker process (RabbitMQ's beam.smp, nats-server), to read its CPU time; or None."""
    name = {"amqp": "beam.smp", "nats": "nats-server"}.get(kind.split("-")[0])
    if not name or not shutil.which("pidof"):
        return None
    p = subprocess.run(["pidof", name], capture_output=True, text=True)
    pids = p.stdout.split()
    return int(pids[0]) if len(pids) == 1 else None


def measure(args, pg, cand, peer):
    """Like measure_one, adding the broker's CPU time per message where the broker is local."""
    pid = broker_pid(cand.kind)
    before = proc_cpu_seconds(pid) if pid else None
    rate = measure_one(args, pg, cand, peer)
    if rate and pid:
        try:
            cand.broker_us.append((proc_cpu_seconds(pid) - before) / args.events * 1e6)
        except OSError:
            pass
    return rate


def measure_one(args, pg, cand, peer):
    """One fresh schema, N events, one drain. Returns events/s (or None when it failed)."""
    if cand.kind in ("amqp-ref", "amqp-ref-props", "nats-ref"):
        rate = {
            "amqp-ref": lambda n: amqp_reference(n),
            "amqp-ref-props": lambda n: amqp_reference(n, same_props=True),
            "nats-ref": nats_reference,
        }[cand.kind](args.events)
        cand.rates.append(rate)
        return rate
    n = cand.events if cand.kind == "exec" else max(cand.events or 0, args.events)
    leasectl = cand.binary or args.leasectl
    schema = new_schema(leasectl)
    target = None
    try:
        fill(pg, schema, n, cand.aggregates, cand.analyze)
        if cand.kind in ("floor", "ceiling"):
            script = os.path.join(args.tmp, f"claim-{schema}.sql")
            with open(script, "w") as f:
                f.write(claim_script(schema) if cand.kind == "floor" else ceiling_script(schema))
            argv = [
                args.pgbench, "-n", "-M", "prepared", "-c", "1", "-t", str(-(-n // BATCH)),
                "-D", f"batch={BATCH}", "-D", f"window={2 * BATCH}", "-D", f"maxseq={MAX_SEQ}", "-D", "reach=0", "-D", f"bytes={16 << 20}", "-f", script,
            ]
        else:
            if cand.kind == "amqp":
                target = AmqpTarget()
                sink = target.sink() + cand.query
            elif cand.kind == "nats":
                target = NatsTarget()
                sink = target.sink()
            elif cand.kind == "http":
                sink = peer.url()
                before = (peer.requests(), peer.cpu())
            elif cand.kind == "exec":
                sink = "exec:true"
            else:
                sink = "stdout"
            argv = [*leasectl, "--schema", schema, "relay", "--once", "--batch", str(BATCH), "--sink", sink]
            if cand.order != "insert":
                argv += ["--order", cand.order]
        code, wall, rss, cpu, err = run_measured(argv)
        left = pending(pg, schema)
        if code != 0 or left != 0:
            print(f"  {cand.name}: exit {code}, {left} events left in the outbox; stderr: {err[-500:]}")
            return None
        if err and cand.kind not in ("floor", "ceiling"):
            print(f"  {cand.name}: stderr: {err[-300:]}")
        if target is not None:
            got = target.count()
            if got != n:
                print(f"  {cand.name}: the broker holds {got} messages, expected {n}")
        if cand.kind == "http":
            got = peer.requests() - before[0]
            used = peer.cpu() - before[1]
            if got < n:
                print(f"  {cand.name}: the peer answered {got} requests, expected {n}")
            cand.peer_cpu_us = getattr(cand, "peer_cpu_us", []) + [used / max(got, 1) * 1e6]
        rate = n / wall
        cand.rates.append(rate)
        if cand.kind not in ("floor", "ceiling"):
            cand.rss.append(rss)
            cand.cpu_us.append(cpu / n * 1e6)
        return rate
    finally:
        if target is not None:
            target.delete()
        drop(pg, schema)


def probe_sink(args, pg, sink, leasectl=None):
    """Delivers 3 events with `relay --once` (of `leasectl`, else --bin's build); returns None if
    that worked, else the error."""
    leasectl = leasectl or args.leasectl
    schema = new_schema(leasectl)
    try:
        fill(pg, schema, 3, 3)
        code, _, _, _, err = run_measured([*leasectl, "--schema", schema, "relay", "--once", "--sink", sink])
        if code != 0:
            return f"exit {code}: {err.splitlines()[-1] if err else ''}"
        if pending(pg, schema) != 0:
            return "events left in the outbox"
        return None
    finally:
        drop(pg, schema)


def baseline_takes(args, pg, cand):
    """Whether the --baseline build takes the sink options a candidate adds (`?properties=full`
    is newer than some baselines): a twin it refuses would fail in every round."""
    if not cand.query:
        return True
    target = AmqpTarget() if cand.kind == "amqp" else None
    try:
        why = probe_sink(args, pg, target.sink() + cand.query, args.base) if target else None
    finally:
        if target is not None:
            target.delete()
    if why:
        print(f"  {cand.name}@baseline: not measured, the baseline build refuses the sink ({why})")
    return why is None


def throughput(args, pg, peer):
    cands = [
        Candidate("floor", 1000, "floor", "SQL floor: CLAIM ×1000 rows, pgbench, 1 connection, 1000 aggregates"),
        Candidate("floor-1agg", 1, "floor", "SQL floor, 1 aggregate"),
        Candidate("floor-100agg", 100, "floor", "SQL floor, 100 aggregates"),
        Candidate(
            "ceiling-100agg", 100, "ceiling",
            "SQL ceiling: a bare DELETE of the first 1000 events by ctid, RETURNING the same columns, "
            "asynchronous commit (pgbench, 1 connection), 100 aggregates",
        ),
        Candidate("stdout", 1000, "stdout", "relay --once → stdout (/dev/null), 1000 aggregates"),
        Candidate("stdout-1agg", 1, "stdout", "relay --once → stdout, 1 aggregate"),
        # The drain the speed goals were first stated for: 10 events of each aggregate per
        # batch, so the plain claim checks the rest of its window for other aggregates' heads,
        # and the first claim's look past the window reads the whole backlog.
        Candidate("stdout-100agg", 100, "stdout", "relay --once → stdout, 100 aggregates"),
        # At least 100k events: with fewer the planner's guesses for a never-analyzed outbox
        # still fit in hash memory and the claim stayed fast even before issue 9 §7 was fixed.
        Candidate(
            "stdout-unanalyzed", 1000, "stdout",
            "relay --once → stdout, 1000 aggregates, ≥ 100k events, outbox never analyzed (autovacuum off)",
            analyze=False, events=100_000,
        ),
    ]
    if "commit" in args.orders:
        cands.append(Candidate("stdout-commit", 1000, "stdout", "relay --once --order commit → stdout, 1000 aggregates", order="commit"))
        cands.append(Candidate("stdout-1agg-commit", 1, "stdout", "relay --once --order commit → stdout, 1 aggregate", order="commit"))
    if args.amqp:
        cands.append(Candidate("amqp", 1000, "amqp", "relay --once → RabbitMQ (confirms, durable queue)"))
        cands.append(Candidate("amqp-ref", 0, "amqp-ref", f"reference: pika, 1 channel, {REF_WINDOW} confirms in flight"))
        cands.append(Candidate(
            "amqp-full", 1000, "amqp", "relay --once → RabbitMQ as above, `?properties=full`", query="&properties=full",
        ))
        cands.append(Candidate(
            "amqp-ref-props", 0, "amqp-ref-props",
            f"reference: pika as above, with `?properties=full`'s message properties (type, app_id, 2 headers)",
        ))
    if args.nats:
        cands.append(Candidate("nats", 1000, "nats", "relay --once → NATS JetStream (acks, file storage)"))
        cands.append(Candidate("nats-ref", 0, "nats-ref", f"reference: nats-py, {REF_WINDOW} acked publishes in flight"))
    if peer is not None:
        cands.append(Candidate("http", 1000, "http", f"relay --once → HTTP peer ({args.http_workers} processes, 204)"))
    # A process per event: what starting a child costs the relay (and `run`). Fewer events,
    # as it delivers a few thousand a second.
    cands.append(Candidate(
        "exec", 1000, "exec", f"relay --once → exec:true (a process per event), {EXEC_EVENTS} events",
        events=EXEC_EVENTS,
    ))
    cands = [c for c in cands if c.kind in ("floor", "ceiling") or c.name.split("-")[0] in args.sinks]
    if args.base:
        cands += [c.twin(args.base) for c in cands if c.kind in ("stdout", "amqp", "nats", "http", "exec") and baseline_takes(args, pg, c)]
    print(f"Throughput: {args.events} events per drain, {args.rounds} rounds of {len(cands)} candidates, rotated")
    for r in range(args.rounds):
        order = cands[r % len(cands) :] + cands[: r % len(cands)]
        line = []
        for c in order:
            rate = measure(args, pg, c, peer)
            line.append(f"{c.name} {rate / 1000:.1f}k" if rate else f"{c.name} FAILED")
        print(f"  round {r + 1}: " + ", ".join(line) + " events/s")
    return {c.name: c for c in cands}


# ----------------------------------------------------------------------------------------------
# Latency


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency(args, pg, notify):
    schema = new_schema(args.leasectl)
    q = quoted(schema)
    pg.run(f"CREATE TABLE {q}.ref (n int)")
    argv = [*args.leasectl, "--schema", schema, "relay", "--sink", "stdout", "--batch", str(BATCH)]
    if not notify:
        argv += ["--poll", "100ms"]
    relay = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    arrived = {}
    lengths = []
    cond = threading.Condition()

    def reader():
        for line in relay.stdout:
            t = time.perf_counter_ns()
            n = json.loads(line)["payload"]["n"]
            with cond:
                arrived[n] = t
                lengths.append(len(line) - 1)
                cond.notify_all()

    errlines = []
    threading.Thread(target=reader, daemon=True).start()
    threading.Thread(target=lambda: errlines.extend(relay.stderr), daemon=True).start()

    conn = psycopg.connect("", autocommit=False)
    ref = psycopg.connect("", autocommit=True)
    insert = f"INSERT INTO {q}.outbox (aggregate_type, aggregate_id, type, payload) VALUES ('order', %s, 'order.paid', %s)"
    pad = "x" * 150
    sent, lat, refs, commits = {}, [], [], []

    def one(n):
        with conn.cursor() as cur:
            if not notify:
                cur.execute("SET LOCAL leasectl.outbox_notified = 'on'")
            cur.execute(insert, (str(n % 1000), json.dumps({"n": n, "pad": pad})))
        t0 = time.perf_counter_ns()
        conn.commit()
        t1 = time.perf_counter_ns()
        sent[n] = t0
        return (t1 - t0) / 1e6

    def wait_for(n, patience=10.0):
        with cond:
            return cond.wait_for(lambda: n in arrived, timeout=patience)

    try:
        # Warm-up: the relay is up and listening, statements are prepared on both sides.
        for n in range(-20, 0):
            one(n)
            if not wait_for(n):
                die(f"latency: the relay did not publish a warm-up event within 10 s; stderr: {''.join(e.decode() for e in errlines)[-500:]}")
        for n in range(args.latency_events):
            time.sleep(random.uniform(0.005, 0.010))
            t = time.perf_counter_ns()
            ref.execute(f"INSERT INTO {q}.ref VALUES (%s)", (n,))
            refs.append((time.perf_counter_ns() - t) / 1e6)
            commits.append(one(n))
        if not wait_for(args.latency_events - 1, patience=10.0):
            print(f"  latency: the last event did not arrive within 10 s")
        with cond:
            for n in range(args.latency_events):
                if n in arrived:
                    lat.append((arrived[n] - sent[n]) / 1e6)
        missing = args.latency_events - len(lat)
        hwm = proc_status_kib(relay.pid, "VmHWM") / 1024
    finally:
        conn.close()
        ref.close()
        code = stop_process(relay, "the latency relay")
        drop(pg, schema)
    if code != 0:
        print(f"warning: the latency relay exited {code} after SIGTERM")
    if missing:
        print(f"warning: {missing} events never arrived")
    return {
        "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "max": max(lat) if lat else float("nan"),
        "ref_p50": pct(refs, 0.5), "ref_p99": pct(refs, 0.99),
        "commit_p50": pct(commits, 0.5), "commit_p99": pct(commits, 0.99),
        "n": len(lat), "hwm": hwm, "line": statistics.mean(lengths) if lengths else 0,
    }


# ----------------------------------------------------------------------------------------------
# Table size


def table_size(args, pg):
    schema = new_schema(args.leasectl)
    q = quoted(schema)
    relay = subprocess.Popen(
        [*args.leasectl, "--schema", schema, "relay", "--sink", "stdout", "--batch", str(BATCH)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
    )
    errlines = []
    threading.Thread(target=lambda: errlines.extend(relay.stderr), daemon=True).start()
    lot = 10_000
    lots = args.size_events // lot

    def sizes():
        return pg.conn.execute(
            f"SELECT pg_total_relation_size('{q}.outbox'), pg_relation_size('{q}.outbox'), "
            f"pg_indexes_size('{q}.outbox')"
        ).fetchone()

    first = last = None
    largest = 0
    drains = []
    done = 0
    started = time.perf_counter()
    budget = started + args.size_budget
    try:
        for i in range(lots):
            pg.run(
                f"INSERT INTO {q}.outbox (aggregate_type, aggregate_id, type, payload) "
                f"SELECT 'order', (g % 1000)::text, 'order.paid', jsonb_build_object('n', g, 'pad', repeat('x', 150)) "
                f"FROM generate_series({i * lot + 1}, {(i + 1) * lot}) g"
            )
            t = time.perf_counter()
            while pg.one(f"SELECT EXISTS (SELECT 1 FROM {q}.outbox)"):
                if relay.poll() is not None:
                    die(f"table size: the relay exited {relay.returncode}; "
                        f"stderr: {b''.join(errlines).decode(errors='replace')[-500:]}")
                if time.perf_counter() > budget or time.perf_counter() - t > args.lot_timeout:
                    break
                time.sleep(0.005)
            else:
                drains.append(time.perf_counter() - t)
                done += lot
                now = sizes()
                largest = max(largest, now[0])
                if args.verbose:
                    print(f"  lot {i + 1}: drained in {drains[-1]:.2f} s; right after: table + indexes {mib(now[0]):.2f} MiB "
                          f"(heap {mib(now[1]):.2f}, indexes {mib(now[2]):.2f})")
                if i == 0:
                    time.sleep(1)
                    first = sizes()
                continue
            left = pending(pg, schema)
            why = "--size-budget" if time.perf_counter() > budget else f"--lot-timeout {args.lot_timeout:g} s"
            print(f"  table size: stopped after {time.perf_counter() - started:.0f} s ({why}): lot {i + 1} of {lots} "
                  f"still had {left} of 10000 events; drains so far: median {statistics.median(drains or [0]):.2f} s, "
                  f"slowest {max(drains or [0]):.2f} s")
            done += lot - left
            break
        elapsed = time.perf_counter() - started
        time.sleep(1)
        last = sizes()
        hwm = proc_status_kib(relay.pid, "VmHWM") / 1024
        cpu = proc_cpu_seconds(relay.pid)
    finally:
        code = stop_process(relay, "the table-size relay")
        drop(pg, schema)
    if code != 0:
        print(f"warning: the table-size relay exited {code} after SIGTERM")
    return {"first": first, "last": last, "largest": largest, "elapsed": elapsed, "events": done,
            "complete": done == lots * lot, "hwm": hwm, "cpu": cpu, "drains": drains}


# ----------------------------------------------------------------------------------------------


def machine(pg):
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), Linux {platform.release()}, PostgreSQL {pg.one('SHOW server_version')}"


def verdict(ok):
    return "met" if ok else "**NOT met**"


def mib(b):
    return b / 1048576


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "target/release/leasectl"), help="leasectl binary")
    ap.add_argument("--events", type=int, help="events per throughput drain (default 50000; --quick 10000)")
    ap.add_argument("--rounds", type=int, help="throughput rounds (default 5; --quick 1)")
    ap.add_argument("--latency-events", type=int, help="events per latency mode (default 1000; --quick 200)")
    ap.add_argument("--size-events", type=int, help="events through the relay for the table size (default 1000000; --quick 100000)")
    ap.add_argument("--size-budget", type=float, default=180, help="seconds the table-size run may take at most (default 180)")
    ap.add_argument("--lot-timeout", type=float, default=30, help="seconds one 10k lot may take to drain before the table-size run stops (default 30)")
    ap.add_argument("--database-url", help="given to every leasectl invocation as --database-url (the script's own connections use the libpq defaults)")
    ap.add_argument("--http-workers", type=int, default=2, help="processes of the HTTP peer (default 2)")
    ap.add_argument("--order", default="insert", choices=["insert", "both"], help="both: also stdout with --order commit, beside the same floor (default insert)")
    ap.add_argument("--quick", action="store_true", help="a smaller run, for trying the script")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every table-size lot")
    ap.add_argument("--only", default="throughput,latency,size", help="comma-separated parts to run")
    ap.add_argument("--sinks", default="stdout,amqp,nats,http,exec", help="comma-separated sinks for the throughput part")
    ap.add_argument("--baseline", help="another leasectl build measured in the same rounds (bench/compare builds one)")
    args = ap.parse_args()
    q = args.quick
    args.events = args.events or (10_000 if q else 50_000)
    args.rounds = args.rounds or (1 if q else 5)
    args.latency_events = args.latency_events or (200 if q else 1000)
    args.size_events = args.size_events or (100_000 if q else 1_000_000)
    parts = set(args.only.split(","))
    args.sinks = set(args.sinks.split(","))
    args.orders = {"insert", "commit"} if args.order == "both" else {"insert"}
    if not Path(args.bin).is_file():
        die(f"{args.bin} not found; build it first: cargo build --release")
    args.leasectl = [args.bin] + (["--database-url", args.database_url] if args.database_url else [])
    if args.baseline and not Path(args.baseline).is_file():
        die(f"--baseline {args.baseline} not found")
    args.base = (
        [args.baseline] + (["--database-url", args.database_url] if args.database_url else []) if args.baseline else None
    )
    args.pgbench = real_binary("pgbench")
    if not args.pgbench:
        die("pgbench is not installed")
    sys.setswitchinterval(0.0005)  # the latency reader thread must not wait 5 ms for the GIL

    pg = Pg()
    version = subprocess.run([args.bin, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"{version}; {machine(pg)}")
    base_version = None
    if args.base:
        base_version = subprocess.run([args.baseline, "--version"], capture_output=True, text=True).stdout.strip()
        print(f"baseline: {base_version} ({args.baseline})")

    tmp = tempfile.TemporaryDirectory(prefix="leasectl-bench-")
    args.tmp = tmp.name
    peer = None
    try:
        args.amqp = args.nats = False
        if "throughput" in parts:
            try:
                import pika  # noqa: F401

                args.amqp = port_open("127.0.0.1", 5672)
            except ImportError:
                pass
            if not args.amqp:
                print("RabbitMQ: not available (pika not installed, or nothing on 127.0.0.1:5672)")
            args.nats = jetstream_enabled()
            if not args.nats:
                print("NATS: not available (nats-py not installed, or no JetStream on 127.0.0.1:4222)")
            peer = HttpPeer(args.http_workers)
            why = probe_sink(args, pg, peer.url())
            if why:
                print(f"HTTP sink: not measured ({why})")
                peer.close()
                peer = None
        res = throughput(args, pg, peer) if "throughput" in parts else None
        lat = pol = None
        if "latency" in parts:
            print(f"Latency: {args.latency_events} events one per transaction, 5-10 ms apart, with NOTIFY, then polling only")
            lat = latency(args, pg, notify=True)
            pol = latency(args, pg, notify=False)
        size = None
        if "size" in parts:
            print(f"Table size: {args.size_events} events in lots of 10k through a continuous relay")
            size = table_size(args, pg)
    finally:
        if peer is not None:
            peer.close()
        tmp.cleanup()

    med = statistics.median
    lines = [
        f"`leasectl relay` ({version}; {machine(pg)})",
        "",
        "| measure | figure | ratio | goal |",
        "|---|---:|---|---|",
    ]
    if res:
        # The floor of each outbox shape, by its number of aggregates.
        floors = {}
        for c in res.values():
            if c.kind == "floor":
                floors[c.aggregates] = med(c.rates) if c.rates else float("nan")
                lines.append(f"| {c.label} | {floors[c.aggregates] / 1000:.1f}k rows/s | (reference) | |")
        for c in res.values():
            if c.kind == "ceiling" and c.rates:
                r = med(c.rates) / floors.get(c.aggregates, float("nan"))
                lines.append(f"| {c.label} | {med(c.rates) / 1000:.1f}k rows/s | ceiling/floor = **{r:.2f}** "
                             "(what no claim of 1000 events per statement can beat) | |")
        refs = {k: med(res[k + "-ref"].rates) for k in ("amqp", "nats") if res.get(k + "-ref") and res[k + "-ref"].rates}
        for name, c in res.items():
            if c.kind in ("floor", "ceiling"):
                continue
            if c.binary is not None:
                if c.rates:
                    lines.append(f"| {c.label} ({base_version}) | {med(c.rates) / 1000:.1f}k events/s; peak RSS "
                                 f"{max(c.rss):.1f} MiB | (baseline) | |")
                continue
            if c.kind.endswith(("-ref", "-ref-props")):
                if c.rates:
                    b = f"; broker {med(c.broker_us):.0f} µs CPU/msg" if c.broker_us else ""
                    lines.append(f"| {c.label} | {med(c.rates) / 1000:.1f}k msgs/s{b} | (broker reference) | |")
                continue
            if not c.rates:
                lines.append(f"| {c.label} | FAILED | | |")
                continue
            rate = med(c.rates)
            ref = floors.get(c.aggregates, floors.get(1000, float("nan")))
            r = rate / ref
            extra = f"; {med(c.cpu_us):.1f} µs relay CPU/event, peak RSS {max(c.rss):.1f} MiB"
            if c.kind == "http":
                extra += f"; peer {med(c.peer_cpu_us):.0f} µs CPU/request"
            if c.broker_us:
                extra += f"; broker {med(c.broker_us):.0f} µs CPU/msg"
            if c.kind == "stdout":
                goal = f"≥ {GOAL_STDOUT_VS_FLOOR} × floor — {verdict(r >= GOAL_STDOUT_VS_FLOOR)}"
            elif c.kind in ("amqp", "nats"):
                goal = f"≥ {GOAL_BROKER_EPS // 1000}k/s — {verdict(rate >= GOAL_BROKER_EPS)}"
                same = res.get(c.kind + "-ref-props")
                if c.query and same is not None and same.rates:
                    # Not the goal's comparison: the reference sending the same messages.
                    goal = f"relay/{c.kind}-ref-props = **{rate / med(same.rates):.2f}** (the same properties)"
                    if c.kind in refs:
                        goal += f"; relay/{c.kind}-ref = {rate / refs[c.kind]:.2f}"
                elif c.kind in refs:
                    vs = rate / refs[c.kind]
                    goal += (f"; relay/{c.kind}-ref = **{vs:.2f}**, ≥ {GOAL_BROKER_VS_REF} — "
                             f"{verdict(vs >= GOAL_BROKER_VS_REF)}")
            else:
                goal = ""
            base = res.get(name + "@baseline")
            vs_base = ""
            if base is not None and base.rates:
                b = rate / med(base.rates)
                paired = med([x / y for x, y in zip(c.rates, base.rates) if y])
                vs_base = f"; ÷ baseline = **{b:.2f}** (per round {paired:.2f})"
                if c.kind == "stdout":
                    goal += f"; ≥ {GOAL_VS_BASELINE:g} × baseline — {verdict(b >= GOAL_VS_BASELINE)}"
            lines.append(f"| {c.label} | {rate / 1000:.1f}k events/s{extra} | relay/floor = **{r:.2f}**{vs_base} | {goal} |")
        spread = ", ".join(
            f"{n} {min(c.rates) / 1000:.1f}–{max(c.rates) / 1000:.1f}k" for n, c in res.items() if c.rates
        )
        lines.append(f"| range over the rounds | {spread} | | |")
        rss = [x for n in ("stdout", "amqp") if n in res for x in res[n].rss]
        if rss:
            lines.append(
                f"| relay peak RSS, 50k-event stdout and AMQP drains | {max(rss):.1f} MiB | | "
                f"≤ {GOAL_RSS_MIB:g} MiB — {verdict(max(rss) <= GOAL_RSS_MIB)} |"
            )
    if lat:
        lines.append(
            f"| latency commit → receipt, NOTIFY | p50 {lat['p50']:.2f} / p99 {lat['p99']:.2f} ms (max {lat['max']:.1f}) "
            f"| p50/ref = {lat['p50'] / lat['ref_p50']:.2f}, p99/ref p99 = {lat['p99'] / lat['ref_p99']:.2f} "
            f"| p50 ≤ {GOAL_P50_MS:g} — {verdict(lat['p50'] <= GOAL_P50_MS)}; p99 ≤ {GOAL_P99_MS:g} — {verdict(lat['p99'] <= GOAL_P99_MS)} |"
        )
        lines.append(
            f"| latency, polling only (--poll 100ms) | p50 {pol['p50']:.2f} / p99 {pol['p99']:.2f} ms (max {pol['max']:.1f}) | | (no goal) |"
        )
        lines.append(
            f"| reference: trivial autocommit INSERT round trip | p50 {lat['ref_p50']:.2f} / p99 {lat['ref_p99']:.2f} ms "
            f"| (the events' own COMMIT: p50 {lat['commit_p50']:.2f} / p99 {lat['commit_p99']:.2f} ms) | |"
        )
        lines.append(
            f"| continuous relay peak RSS (latency runs) | {max(lat['hwm'], pol['hwm']):.1f} MiB; event line {lat['line']:.0f} bytes | | |"
        )
    if size:
        f, l = size["first"] or (0, 0, 0), size["last"]
        r = f[0] and l[0] / f[0]
        what = f"{size['events'] // 1000}k events" + ("" if size["complete"] else " (stopped: the relay stalled)")
        ok = size["complete"] and r <= GOAL_SIZE_RATIO
        lines.append(
            f"| outbox table + indexes after 10k → after {what} | "
            f"{mib(f[0]):.2f} → {mib(l[0]):.2f} MiB (heap {mib(f[1]):.2f} → {mib(l[1]):.2f}, indexes "
            f"{mib(f[2]):.2f} → {mib(l[2]):.2f}), each 1 s after its drain "
            f"| after/10k = **{r:.2f}** | ≤ {GOAL_SIZE_RATIO:g} — {verdict(ok)} |"
        )
        lines.append(
            f"| largest table + indexes right after any drain (before the relay's next vacuum) | "
            f"{mib(size['largest']):.2f} MiB | largest/10k = {size['largest'] / f[0] if f[0] else float('nan'):.2f} | (no goal) |"
        )
        d = size["drains"] or [float("nan")]
        lines.append(
            f"| {size['events'] // 1000}k events inserted in lots of 10k and drained | {size['elapsed']:.1f} s "
            f"({size['events'] / size['elapsed'] / 1000:.1f}k events/s incl. inserts; a lot drained in median "
            f"{statistics.median(d):.2f} s, slowest {max(d):.2f} s); relay CPU {size['cpu']:.1f} s, "
            f"peak RSS {size['hwm']:.1f} MiB | | |"
        )
    print("\n----- summary (paste into docs/BENCHMARKS.md) -----")
    print("\n".join(lines))
    print("----- end of summary -----")


if __name__ == "__main__":
    main()
