#!/usr/bin/env python3
"""Times whole commands against each other in alternating rounds, for a change too small to see
in the full benchmarks: two builds of leasectl, or one build with two commands.

    python3 bench/alternate.py --rounds 400 \\
        'OLD/leasectl --schema ab run --target t -- true' \\
        'target/release/leasectl --schema ab run --target t -- true'

Each round runs every command once, its order reversed every other round, so a drift in the
machine's load hits them alike. Printed for each: the median wall time of the whole process
(start to exit, output to /dev/null); for each command after the first, its median ÷ the first's
and the paired ratio (the median of the per-round ratios), which is steadier when the machine's
speed wanders during the run. The commands are split like a shell's words (no pipes or
variables); leading `NAME=value` words set that command's environment, as in a shell, without
the extra process an `env` prefix would time too; whatever they need (a migrated schema, a free target) is the caller's to set up. A
command that exits with another code than `--expect` (0 by default; 75 to time busy answers)
stops the script: a fast failure would otherwise pass for a fast run.

Where a command runs in its round changes what it measures: on a 2-core virtual machine a build
of leasectl ran 0.5 ms slower right after the other build than right after itself, which moved
the two builds' ratio by 3 % between the ratio of the medians and the paired one. So for each
command after the first, the paired ratio is also printed split by which of the two ran first in
the round, and `--pause MS` sleeps before every command, so that none runs on the heels of
another (the machine idles in between, as between two cron jobs).
"""

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300, help="rounds (default 300, at least 10)")
    p.add_argument("--expect", type=int, default=0, help="the exit code every run must have (default 0)")
    p.add_argument("--pause", type=float, default=0, metavar="MS", help="sleep this long before every command (default 0)")
    p.add_argument("commands", nargs="+", help="two or more commands, each one argument")
    args = p.parse_args()
    if len(args.commands) < 2 or args.rounds < 10:
        p.error("give two or more commands and at least 10 rounds")
    argvs = [shlex.split(c) for c in args.commands]
    envs = []
    for a in argvs:
        env = dict(os.environ)
        while a and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", a[0], re.S):
            k, v = a.pop(0).split('=', 1)
            env[k] = v
        envs.append(env)
    times = [[] for _ in argvs]
    with open(os.devnull, "w") as null:
        for r in range(args.rounds):
            order = range(len(argvs)) if r % 2 == 0 else reversed(range(len(argvs)))
            for i in order:
                if args.pause > 0:
                    time.sleep(args.pause / 1000)
                start = time.perf_counter()
                code = subprocess.run(argvs[i], stdout=null, env=envs[i]).returncode
                times[i].append(time.perf_counter() - start)
                if code != args.expect:
                    sys.exit(f"alternate.py: '{args.commands[i]}' exited {code}, not {args.expect}")
    first = statistics.median(times[0])
    for i, command in enumerate(args.commands):
        median = statistics.median(times[i])
        line = f"{median * 1000:9.3f} ms  {command}"
        if i > 0:
            ratios = [b / a for a, b in zip(times[0], times[i])]
            paired = statistics.median(ratios)
            # Even rounds run the commands in the given order, odd rounds in reverse.
            first_first = statistics.median(ratios[0::2])
            this_first = statistics.median(ratios[1::2])
            line += (
                f"\n{'':13}÷ the first: {median / first:.4f} (paired {paired:.4f}; "
                f"{first_first:.4f} in the rounds the first ran first, {this_first:.4f} in the others)"
            )
        print(line)


if __name__ == "__main__":
    main()
