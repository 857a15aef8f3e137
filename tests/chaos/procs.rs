//! Process inspection through /proc: liveness that survives pid reuse, the processes a
//! contender started (found by the marker variable in their environment), and signals.
//!
//! Times are wall-clock seconds (`CLOCK_REALTIME`) as `f64`, the clock the children's
//! `date +%s.%N` and PostgreSQL's `now()` use, so everything is comparable on one machine.

use std::time::{SystemTime, UNIX_EPOCH};

/// The marker every contender's leasectl gets in its environment, inherited by everything it
/// starts (unless a process scrubs its environment, which the children here do not).
pub const MARKER: &str = "CHAOS_ID";

pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// (state, ppid, start time in clock ticks since boot) of a process, or None when it is gone.
pub fn stat(pid: i32) -> Option<(char, i32, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some((
        f.first()?.chars().next()?,
        f.get(1)?.parse().ok()?,
        f.get(19)?.parse().ok()?,
    ))
}

/// Alive = exists and is not a zombie (a zombie can do no more work).
pub fn alive(pid: i32) -> bool {
    matches!(stat(pid), Some((st, _, _)) if st != 'Z' && st != 'X')
}

/// Wall-clock time at which a process started, from its start ticks and the boot time.
pub fn start_time(ticks: u64) -> f64 {
    static BOOT: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    let boot = *BOOT.get_or_init(|| {
        std::fs::read_to_string("/proc/stat")
            .unwrap()
            .lines()
            .find_map(|l| {
                l.strip_prefix("btime ")
                    .map(|v| v.trim().parse::<f64>().unwrap())
            })
            .unwrap()
    });
    // SAFETY: sysconf is always safe to call.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    boot + ticks as f64 / hz
}

pub fn signal(pid: i32, sig: i32) {
    // SAFETY: plain kill(2); a vanished pid is not an error here.
    unsafe { libc::kill(pid, sig) };
}

fn pids() -> impl Iterator<Item = i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
}

pub fn children_of(parent: i32) -> Vec<i32> {
    pids()
        .filter(|&p| matches!(stat(p), Some((_, pp, _)) if pp == parent))
        .collect()
}

/// Live processes whose environment has `CHAOS_ID=<value>` with value starting with `prefix`:
/// (pid, value, command line).
pub fn marked(prefix: &str) -> Vec<(i32, String, String)> {
    let me = std::process::id() as i32;
    let needle = format!("{MARKER}={prefix}");
    pids()
        .filter(|&p| p != me && alive(p))
        .filter_map(|p| {
            let env = std::fs::read(format!("/proc/{p}/environ")).ok()?;
            let var = env
                .split(|&b| b == 0)
                .find(|v| v.starts_with(needle.as_bytes()))?;
            let value = String::from_utf8_lossy(&var[MARKER.len() + 1..]).into_owned();
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            // Re-check: a zombie still shows its environment for a moment.
            alive(p).then_some((p, value, cmd.trim().to_owned()))
        })
        .collect()
}
