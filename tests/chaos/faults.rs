//! The faults a round can inject into its victim — a holder whose command runs, chosen by the
//! round's scenario — or into what it depends on, and the invariants each round is checked
//! against.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// `kill -9` of the holder's leasectl.
    Kill9,
    /// `kill -9 -- -PGID` of the holder's leasectl's process group (what `timeout -s KILL` or a
    /// CI runner cancelling a step does).
    Kill9Group,
    /// `kill -9` of the command (the `sh` leasectl started), leaving its children behind.
    Kill9Child,
    /// SIGSTOP of the holder's leasectl until another holder has started, then SIGCONT.
    SigStop,
    /// `pg_ctl restart -m fast`.
    RestartFast,
    /// `pg_ctl restart -m immediate` (crash recovery).
    RestartImmediate,
    /// The server is stopped for longer than the TTL, then started.
    DbStop,
    /// The postmaster and all backends are SIGSTOPped for longer than the TTL (a hung host).
    DbFreeze,
    /// The proxy forwards nothing for longer than the TTL.
    BlackHole,
    /// The same, starting the moment a holder sends what it sends as its command starts — the
    /// preparation of its fenced save (`plan_cache_mode`) — and held from there: the database
    /// goes silent between the lease and the command's first heartbeat, at the statements a
    /// run then waits for (falling back to an ordinary black hole if no holder got that far
    /// before the fault is due).
    BlackHoleAtSave,
    /// The proxy closes every connection.
    Cut,
    /// leasectl's stderr is a pipe whose reader goes away mid-run (`2>&1 | head`, a dead log
    /// shipper); leasectl runs with `-v` so it has things to say.
    StderrPipe,
    /// leasectl's stdout is a pipe whose reader goes away, and the command then writes forever
    /// (`yes`): it must get SIGPIPE as it would without leasectl.
    StdoutPipe,
}

pub const ALL: [Fault; 13] = [
    Fault::Kill9,
    Fault::Kill9Group,
    Fault::Kill9Child,
    Fault::SigStop,
    Fault::RestartFast,
    Fault::RestartImmediate,
    Fault::DbStop,
    Fault::DbFreeze,
    Fault::BlackHole,
    Fault::BlackHoleAtSave,
    Fault::Cut,
    Fault::StderrPipe,
    Fault::StdoutPipe,
];

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill9 => "kill9",
            Fault::Kill9Group => "kill9-group",
            Fault::Kill9Child => "kill9-child",
            Fault::SigStop => "sigstop",
            Fault::RestartFast => "restart-fast",
            Fault::RestartImmediate => "restart-immediate",
            Fault::DbStop => "db-stop",
            Fault::DbFreeze => "db-freeze",
            Fault::BlackHole => "blackhole",
            Fault::BlackHoleAtSave => "blackhole-save",
            Fault::Cut => "cut",
            Fault::StderrPipe => "stderr-pipe",
            Fault::StdoutPipe => "stdout-pipe",
        }
    }

    /// Parses a comma-separated list of names (`LEASECTL_CHAOS_FAULTS`); `all` or empty = every
    /// fault. `restart` is short for both restarts.
    pub fn parse_list(s: &str) -> Result<Vec<Fault>, String> {
        let s = s.trim();
        if s.is_empty() || s == "all" {
            return Ok(ALL.to_vec());
        }
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "restart" {
                out.extend([Fault::RestartFast, Fault::RestartImmediate]);
                continue;
            }
            let f = ALL.iter().find(|f| f.name() == name).ok_or_else(|| {
                let names: Vec<_> = ALL.iter().map(|f| f.name()).collect();
                format!(
                    "unknown fault '{name}' (known: {}, restart, all)",
                    names.join(", ")
                )
            })?;
            out.push(*f);
        }
        Ok(out)
    }

    /// Faults during which the database (or the path to it) is silent for longer than the TTL.
    pub fn silences_db(self) -> bool {
        matches!(
            self,
            Fault::DbStop | Fault::DbFreeze | Fault::BlackHole | Fault::BlackHoleAtSave
        )
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Inv {
    /// No two commands of one target at once — steps of one lease included, the old command's
    /// SIGTERM grace included; with `--max-holders N`, never more than N (except while a
    /// supervisor is SIGSTOPped, and not at all after it resumes); the fenced register loses no
    /// update.
    I1,
    /// At most one stored result + event per fence; none stored after a later fence was granted.
    I2,
    /// A lost lease's whole process tree is dead before the database's expiry.
    I3,
    /// Every stored-outcome exit has exactly one run row (and every exit code is documented).
    I4,
    /// Fences strictly increase, across restarts; a child only ever sees a granted fence.
    I5,
    /// Nothing leasectl started is alive after it exited.
    I6,
    /// A stale token never acts: no heartbeat, renewal or step renews a lease that had already
    /// expired on the database clock.
    I7,
    /// FIFO: waiters of `--queue fifo` that were neither killed nor stopped start their commands
    /// in the order they joined.
    I8,
    /// Slots: at most one result per slot; a contender that finds its slot's run in progress
    /// records `skipped` and exits 0 at once.
    I9,
    /// leasectl exits within a bound (it never hangs, on a silent database or a broken pipe;
    /// a holder on an established connection within TTL + 1.5 s of the silence; a
    /// `--wait=DUR` waiter within DUR + 0.5 s).
    H,
}

pub const INVARIANTS: [Inv; 10] = [
    Inv::I1,
    Inv::I2,
    Inv::I3,
    Inv::I4,
    Inv::I5,
    Inv::I6,
    Inv::I7,
    Inv::I8,
    Inv::I9,
    Inv::H,
];

impl fmt::Display for Inv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}
