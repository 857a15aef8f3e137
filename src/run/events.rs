//! The command's own outbox events (`LEASECTL_EVENTS`).
//!
//! The command gets the path of a fresh file (mode 0600, in a directory of its own, mode
//! 0700) and may append JSON lines `{"aggregate_type", "aggregate_id", "type", "payload"}` to
//! it (`leasectl emit` writes one with validation). leasectl reads the file once the command
//! is done and inserts its events in the fenced save's transaction, after the run's own
//! event and in file order — so they exist if and only if the run's result was stored by the
//! current holder. It is all or nothing: a malformed line, or a file over `--events-limit`,
//! stores the run with the error and none of the events (kept raw in `runs.events`), and the
//! run exits 65. A `lost` run keeps them raw too, for the operator.
//!
//! A leasectl that is SIGKILLed cannot remove its directory. So the directory also holds a
//! `lock` file that the owner keeps `flock`ed (not inherited by the command: close-on-exec), and
//! every new run sweeps the directories of the same user whose lock nobody holds — their owner is
//! gone, whatever pid namespace it ran in — once they are older than [`SWEEP_AFTER`] (a directory
//! that young may be one whose owner has not locked it yet).

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::fcntl::{Flock, FlockArg};

use serde_json::{Map, Value};

/// The environment variable naming the file.
pub const VAR: &str = "LEASECTL_EVENTS";

/// The keys of one line, all required, none other allowed.
const KEYS: [&str; 4] = ["aggregate_type", "aggregate_id", "type", "payload"];

/// The prefix of the directories under the temporary directory.
const PREFIX: &str = "leasectl-events-";

/// How old an unlocked directory must be before a sweep removes it.
const SWEEP_AFTER: Duration = Duration::from_secs(60);

/// The file and its private directory, removed when dropped.
pub struct EventsFile {
    dir: PathBuf,
    path: PathBuf,
    /// Held while we live: tells a sweep that the directory is in use.
    _lock: Flock<File>,
}

/// What the command left in the file.
pub enum JobEvents {
    /// No line at all.
    None,
    /// Valid lines, as a JSON array of their objects (in file order), and the raw bytes.
    Valid(Value, Vec<u8>),
    /// Refused (why), with the raw bytes read (at most the limit).
    Refused(String, Vec<u8>),
}

impl EventsFile {
    /// Creates the directory, its lock and the empty file under the temporary directory, after
    /// sweeping the directories that SIGKILLed runs left behind.
    pub fn create() -> io::Result<EventsFile> {
        let tmp = std::env::temp_dir();
        sweep(&tmp);
        let dir = tmp.join(format!(
            "{PREFIX}{}-{:016x}",
            std::process::id(),
            fastrand::u64(..)
        ));
        DirBuilder::new().mode(0o700).create(&dir)?;
        match fill(&dir) {
            Ok((path, lock)) => Ok(EventsFile {
                dir,
                path,
                _lock: lock,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and checks what the command wrote, reading at most `limit + 1` bytes.
    pub fn read(&self, limit: usize) -> JobEvents {
        let mut raw = Vec::new();
        let read =
            File::open(&self.path).and_then(|f| f.take(limit as u64 + 1).read_to_end(&mut raw));
        if let Err(e) = read {
            return JobEvents::Refused(format!("cannot read {VAR}: {e}"), raw);
        }
        if raw.len() > limit {
            raw.truncate(limit);
            return JobEvents::Refused(
                format!("{VAR} holds more than --events-limit ({limit} bytes)"),
                raw,
            );
        }
        match parse(&raw) {
            Ok(events) if events.is_empty() => JobEvents::None,
            Ok(events) => JobEvents::Valid(Value::Array(events), raw),
            Err(why) => JobEvents::Refused(why, raw),
        }
    }
}

impl Drop for EventsFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_file(self.dir.join("lock"));
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The locked `lock` file and the empty events file in a new directory.
fn fill(dir: &Path) -> io::Result<(PathBuf, Flock<File>)> {
    let lock = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dir.join("lock"))?;
    let lock = Flock::lock(lock, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| e)?;
    let path = dir.join("events.jsonl");
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    Ok((path, lock))
}

/// Removes this user's event directories under `tmp` whose owner is gone: older than
/// [`SWEEP_AFTER`], with a lock file nobody holds (or none: a directory from before the lock).
/// Best effort: a directory that cannot be read or removed is left alone.
fn sweep(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    let uid = nix::unistd::geteuid().as_raw();
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(PREFIX) {
            continue;
        }
        let dir = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&dir) else {
            continue;
        };
        let old = meta
            .modified()
            .ok()
            .and_then(|m| SystemTime::now().duration_since(m).ok())
            .is_some_and(|age| age >= SWEEP_AFTER);
        if !meta.is_dir() || meta.uid() != uid || !old {
            continue;
        }
        let abandoned = match File::open(dir.join("lock")) {
            // Ours to remove only while we hold its lock (closing the file releases it).
            Ok(f) => Flock::lock(f, FlockArg::LockExclusiveNonblock).is_ok(),
            Err(e) => e.kind() == io::ErrorKind::NotFound,
        };
        if abandoned {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Every non-empty line as a checked event object; the first bad line is the error.
pub fn parse(raw: &[u8]) -> Result<Vec<Value>, String> {
    let text = std::str::from_utf8(raw).map_err(|e| format!("{VAR} is not UTF-8: {e}"))?;
    let mut events = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line)
            .map_err(|e| format!("{VAR} line {}: not JSON ({e})", i + 1))?;
        let Value::Object(object) = value else {
            return Err(format!("{VAR} line {}: not a JSON object", i + 1));
        };
        check(&object).map_err(|e| format!("{VAR} line {}: {e}", i + 1))?;
        events.push(Value::Object(object));
    }
    Ok(events)
}

/// One event object: the four keys, the first three non-empty strings.
pub fn check(object: &Map<String, Value>) -> Result<(), String> {
    if let Some(extra) = object.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(format!(
            "unknown key '{extra}' (expected {})",
            KEYS.join(", ")
        ));
    }
    for key in &KEYS[..3] {
        match object.get(*key) {
            Some(Value::String(s)) if !s.is_empty() => {}
            Some(_) => return Err(format!("'{key}' must be a non-empty string")),
            None => return Err(format!("'{key}' is missing")),
        }
    }
    if !object.contains_key("payload") {
        return Err("'payload' is missing".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_checked_all_or_nothing() {
        let ok = br#"{"aggregate_type":"invoice","aggregate_id":"7","type":"invoice.sent","payload":{"n":1}}

{"aggregate_type":"export","aggregate_id":"x","type":"export.ready","payload":null}
"#;
        assert_eq!(parse(ok).unwrap().len(), 2);
        for (bad, why) in [
            (&b"{\"aggregate_type\":\"a\"}"[..], "line 1: 'aggregate_id' is missing"),
            (b"not json", "line 1: not JSON"),
            (b"[1]", "line 1: not a JSON object"),
            (
                b"{\"aggregate_type\":\"a\",\"aggregate_id\":\"\",\"type\":\"t\",\"payload\":1}",
                "'aggregate_id' must be a non-empty string",
            ),
            (
                b"{\"aggregate_type\":\"a\",\"aggregate_id\":\"i\",\"type\":\"t\",\"payload\":1,\"x\":2}",
                "unknown key 'x'",
            ),
            (b"\xff", "not UTF-8"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
    }

    #[test]
    fn the_file_is_private_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let f = EventsFile::create().unwrap();
        let mode = std::fs::metadata(f.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let dir = f.path().parent().unwrap().to_owned();
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        std::fs::write(f.path(), "x".repeat(11)).unwrap();
        assert!(
            matches!(f.read(10), JobEvents::Refused(why, raw) if why.contains("--events-limit") && raw.len() == 10)
        );
        drop(f);
        assert!(!dir.exists());
    }

    /// A directory `name` under `tmp`, with a lock file, dated `age` ago.
    fn aged(tmp: &Path, name: &str, age: Duration) -> PathBuf {
        let dir = tmp.join(name);
        std::fs::create_dir(&dir).unwrap();
        File::create(dir.join("lock")).unwrap();
        File::create(dir.join("events.jsonl")).unwrap();
        File::open(&dir)
            .unwrap()
            .set_modified(SystemTime::now() - age)
            .unwrap();
        dir
    }

    #[test]
    fn a_sweep_removes_only_old_directories_whose_lock_nobody_holds() {
        let tmp = tempfile::tempdir().unwrap();
        let hour = Duration::from_secs(3600);
        let abandoned = aged(tmp.path(), "leasectl-events-1-a", hour);
        let held = aged(tmp.path(), "leasectl-events-2-b", hour);
        let _holder = Flock::lock(
            File::open(held.join("lock")).unwrap(),
            FlockArg::LockExclusiveNonblock,
        )
        .unwrap();
        let young = aged(tmp.path(), "leasectl-events-3-c", Duration::ZERO);
        let other = aged(tmp.path(), "something-else", hour);
        sweep(tmp.path());
        assert!(!abandoned.exists());
        assert!(held.join("events.jsonl").exists());
        assert!(young.exists());
        assert!(other.exists());
    }
}
