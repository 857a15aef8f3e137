//! A throw-away PostgreSQL cluster of the suite's own, so that faults may restart, stop and
//! freeze it without touching the machine's database.
//!
//! `initdb`/`pg_ctl` come from the Debian packages (`/usr/lib/postgresql/<version>/bin`). It lives
//! in a temp dir, listens on 127.0.0.1 on a spare port (and on a unix socket in the temp dir), with
//! trust authentication. PostgreSQL refuses to run as root, so under root every server command runs
//! as the `postgres` OS user (`runuser`) and the temp dir is handed to that user. Dropping the
//! cluster thaws it and stops it with `pg_ctl stop -m immediate`, whatever state it is in.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::procs;

pub struct Cluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    as_postgres: bool,
    frozen: Vec<i32>,
}

/// The newest `/usr/lib/postgresql/<version>/bin` that has `initdb` and `pg_ctl`.
pub fn find_bin() -> Result<PathBuf, String> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("/usr/lib/postgresql: {e} (install the postgresql package)"))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("pg_ctl").exists()).then_some((v, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, b)| b)
        .ok_or_else(|| "no /usr/lib/postgresql/*/bin with initdb and pg_ctl".to_owned())
}

fn spare_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("cannot bind 127.0.0.1:0 to find a spare port")
}

impl Cluster {
    /// initdb + start. Errors are set-up failures (the caller decides whether that may skip).
    pub fn start() -> Result<Cluster, String> {
        let bin = find_bin()?;
        let as_postgres = nix::unistd::geteuid().is_root();
        let dir = tempfile::Builder::new()
            .prefix("leasectl-chaos-pg.")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        if as_postgres {
            let pg = nix::unistd::User::from_name("postgres")
                .ok()
                .flatten()
                .ok_or("running as root but there is no `postgres` OS user")?;
            nix::unistd::chown(dir.path(), Some(pg.uid), Some(pg.gid))
                .map_err(|e| format!("chown {}: {e}", dir.path().display()))?;
        }
        let mut c = Cluster {
            dir,
            bin,
            port: 0,
            as_postgres,
            frozen: Vec::new(),
        };
        let data = c.data();
        let out = c.pg(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ],
        );
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        // A spare port can be taken between our probe and the server's bind: try a few.
        let mut last = String::new();
        for _ in 0..5 {
            c.port = spare_port();
            let conf = format!(
                "\n# leasectl chaos suite\nlisten_addresses = '127.0.0.1'\nport = {}\n\
                 unix_socket_directories = '{}'\nmax_connections = 200\n\
                 # No OS crash is simulated, only server crashes: the page cache keeps what\n\
                 # fsync would have made durable, so skipping fsync changes no outcome.\n\
                 fsync = off\nfull_page_writes = off\nsynchronous_commit = on\n\
                 log_min_messages = warning\n",
                c.port,
                c.dir.path().display()
            );
            std::fs::write(data.join("postgresql.auto.conf"), conf)
                .map_err(|e| format!("postgresql.auto.conf: {e}"))?;
            match c.ctl(&["start"]) {
                Ok(()) => return Ok(c),
                Err(e) => last = e,
            }
        }
        Err(format!("pg_ctl start failed: {last}"))
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// The libpq connection string that reaches the cluster directly.
    pub fn conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// Runs a server program (as `postgres` when we are root), from `/` so the checkout's
    /// permissions do not matter.
    fn pg(&self, program: &str, args: &[&str]) -> Output {
        let exe = self.bin.join(program);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        cmd.args(args)
            .current_dir("/")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()))
    }

    /// `pg_ctl -D data -l log -w -t 60 <args>`.
    fn ctl(&self, args: &[&str]) -> Result<(), String> {
        let data = self.data();
        let log = self.log_path();
        let mut all = vec![
            "-D",
            data.to_str().unwrap(),
            "-l",
            log.to_str().unwrap(),
            "-w",
            "-t",
            "60",
        ];
        all.extend_from_slice(args);
        let out = self.pg("pg_ctl", &all);
        if out.status.success() {
            Ok(())
        } else {
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(15).collect();
            Err(format!(
                "pg_ctl {args:?}: {}{}\n--- server log (last lines, newest first) ---\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                tail.join("\n")
            ))
        }
    }

    /// Restart with shutdown mode `fast` (clean) or `immediate` (crash recovery on start).
    pub fn restart(&self, mode: &str) {
        self.ctl(&["restart", "-m", mode]).unwrap();
    }

    pub fn stop(&self) {
        self.ctl(&["stop", "-m", "fast"]).unwrap();
    }

    pub fn start_again(&self) {
        self.ctl(&["start"]).unwrap();
    }

    fn postmaster_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// SIGSTOP the postmaster and every backend: the server accepts TCP connections (the kernel
    /// does) but never answers — what a hung host looks like to a client.
    pub fn freeze(&mut self) {
        let Some(pm) = self.postmaster_pid() else {
            return;
        };
        procs::signal(pm, libc::SIGSTOP);
        let mut pids = vec![pm];
        pids.extend(procs::children_of(pm));
        for &p in &pids[1..] {
            procs::signal(p, libc::SIGSTOP);
        }
        self.frozen = pids;
    }

    pub fn thaw(&mut self) {
        // Backends first, the postmaster last, so it never sees a stopped child as hung.
        for &p in self.frozen.iter().rev() {
            procs::signal(p, libc::SIGCONT);
        }
        self.frozen.clear();
    }

    /// Waits until the server accepts a TCP connection (after a restart it may still recover).
    pub fn wait_ready(&self, patience: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < patience {
            let out = self.pg(
                "pg_isready",
                &["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()],
            );
            if out.status.success() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.thaw();
        let _ = self.ctl(&["stop", "-m", "immediate"]);
    }
}
