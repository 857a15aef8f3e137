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
//! The command may also replace the file by anything else: a FIFO (whose plain `open` would wait
//! forever for a writer, heartbeats and signals with it), a symbolic link (to a device, or to a
//! file it has no business making us read), a directory, a socket. leasectl opens the name
//! relative to the directory it created (an `openat` on the descriptor it kept, so a renamed or
//! swapped directory does not redirect it), with `O_NONBLOCK | O_NOFOLLOW`, and reads only a
//! regular file: anything else is a malformed events file (exit 65), found without ever blocking.
//!
//! A leasectl that is SIGKILLed cannot remove its directory. So the directory also holds a
//! `lock` file that the owner keeps `flock`ed (not inherited by the command: close-on-exec), and
//! a sweep removes the directories of the same user whose lock nobody holds — their owner is
//! gone, whatever pid namespace it ran in — once they are older than `SWEEP_AFTER` (a directory
//! that young may be one whose owner has not locked it yet). The sweep reads the whole
//! temporary directory and opens every stale entry, so it is not on every run's path: one run in
//! `SWEEP_ONE_IN`, drawn at random, sweeps (abandoned directories are rare — only a SIGKILLed
//! run leaves one — so they still go soon, and never pile up), and so does any run whose
//! directory cannot be created (the temporary directory may be full of them).

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::stat::Mode;

use serde_json::{Map, Value};

/// The environment variable naming the file.
pub const VAR: &str = "LEASECTL_EVENTS";

/// The keys of one line, all required, none other allowed.
const KEYS: [&str; 4] = ["aggregate_type", "aggregate_id", "type", "payload"];

/// The prefix of the directories under the temporary directory.
const PREFIX: &str = "leasectl-events-";

/// The file's name in its directory.
const NAME: &str = "events.jsonl";

/// How a name the command could have replaced is opened: never waiting (a FIFO without a
/// writer), never following a symbolic link, never taking a terminal as ours.
const NEVER_BLOCK: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_NONBLOCK)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_NOCTTY)
    .union(OFlag::O_CLOEXEC);

/// How old an unlocked directory must be before a sweep removes it.
const SWEEP_AFTER: Duration = Duration::from_secs(60);

/// One run in this many sweeps (see the module docs).
const SWEEP_ONE_IN: u32 = 32;

/// The file and its private directory, removed when dropped.
pub struct EventsFile {
    dir: PathBuf,
    /// The directory we created, opened right after: the file is read relative to it.
    dir_fd: File,
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
    /// Creates the directory, its lock and the empty file under the temporary directory; one
    /// run in `SWEEP_ONE_IN` first sweeps the directories that SIGKILLed runs left behind, and
    /// a creation that fails sweeps and tries once more.
    pub fn create() -> io::Result<EventsFile> {
        let tmp = std::env::temp_dir();
        let swept = sweep_due(fastrand::u32(..sweep_one_in()));
        if swept {
            sweep(&tmp);
        }
        match Self::create_in(&tmp) {
            Err(_) if !swept => {
                sweep(&tmp);
                Self::create_in(&tmp)
            }
            created => created,
        }
    }

    fn create_in(tmp: &Path) -> io::Result<EventsFile> {
        let dir = tmp.join(format!(
            "{PREFIX}{}-{:016x}",
            std::process::id(),
            fastrand::u64(..)
        ));
        DirBuilder::new().mode(0o700).create(&dir)?;
        match fill(&dir) {
            Ok((dir_fd, path, lock)) => Ok(EventsFile {
                dir,
                dir_fd,
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

    /// Reads and checks what the command wrote, reading at most `limit + 1` bytes; anything
    /// but a regular file is refused without blocking.
    pub fn read(&self, limit: usize) -> JobEvents {
        let mut raw = Vec::new();
        let file = match self.open() {
            Ok(f) => f,
            Err(why) => return JobEvents::Refused(why, raw),
        };
        if let Err(e) = file.take(limit as u64 + 1).read_to_end(&mut raw) {
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

impl EventsFile {
    /// The file, opened without blocking and only if it is a regular file; else why not.
    fn open(&self) -> Result<File, String> {
        let not_regular =
            |kind: &str| format!("{VAR} is not a regular file (the command left {kind} there)");
        match nix::fcntl::openat(&self.dir_fd, NAME, NEVER_BLOCK, Mode::empty()) {
            Ok(fd) => {
                let file = File::from(fd);
                let kind = file
                    .metadata()
                    .map_err(|e| format!("cannot read {VAR}: {e}"))?
                    .file_type();
                match describe(kind) {
                    None => Ok(file),
                    Some(kind) => Err(not_regular(kind)),
                }
            }
            // O_NOFOLLOW refuses a symbolic link with ELOOP; a socket cannot be opened (ENXIO).
            // Name what is there rather than the errno.
            Err(errno) => {
                let there = nix::sys::stat::fstatat(
                    &self.dir_fd,
                    NAME,
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                );
                match there.ok().and_then(|st| describe_mode(st.st_mode)) {
                    Some(kind) => Err(not_regular(kind)),
                    None => Err(format!("cannot read {VAR}: {}", io::Error::from(errno))),
                }
            }
        }
    }
}

/// What a file that is not a regular file is, as a phrase; `None` for a regular file.
fn describe(t: std::fs::FileType) -> Option<&'static str> {
    if t.is_file() {
        None
    } else if t.is_symlink() {
        Some("a symbolic link")
    } else if t.is_dir() {
        Some("a directory")
    } else if t.is_fifo() {
        Some("a FIFO")
    } else if t.is_socket() {
        Some("a socket")
    } else if t.is_char_device() || t.is_block_device() {
        Some("a device")
    } else {
        Some("something else")
    }
}

/// [`describe`] for a raw `st_mode`.
fn describe_mode(mode: libc::mode_t) -> Option<&'static str> {
    match mode & libc::S_IFMT {
        libc::S_IFREG => None,
        libc::S_IFLNK => Some("a symbolic link"),
        libc::S_IFDIR => Some("a directory"),
        libc::S_IFIFO => Some("a FIFO"),
        libc::S_IFSOCK => Some("a socket"),
        libc::S_IFCHR | libc::S_IFBLK => Some("a device"),
        _ => Some("something else"),
    }
}

impl Drop for EventsFile {
    /// Removes the directory and whatever the command left in it (a directory in place of the
    /// file included); a symbolic link in it is removed, never followed.
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory opened, the locked `lock` file and the empty events file in a new directory.
fn fill(dir: &Path) -> io::Result<(File, PathBuf, Flock<File>)> {
    let dir_fd = File::open(dir)?;
    let lock = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dir.join("lock"))?;
    let lock = Flock::lock(lock, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| e)?;
    let path = dir.join(NAME);
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    Ok((dir_fd, path, lock))
}

/// [`SWEEP_ONE_IN`], or in debug builds `LEASECTL_TEST_SWEEP_ONE_IN` (tests make every run
/// sweep with 1).
fn sweep_one_in() -> u32 {
    let test = std::env::var("LEASECTL_TEST_SWEEP_ONE_IN")
        .ok()
        .filter(|_| cfg!(debug_assertions))
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0);
    test.unwrap_or(SWEEP_ONE_IN)
}

/// Whether this run sweeps, given a number drawn uniformly below [`sweep_one_in`].
fn sweep_due(draw: u32) -> bool {
    draw == 0
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
        // Opened as the events file is: a FIFO or a link left in place of the lock by a command
        // must not hang or redirect the sweep.
        let lock = OpenOptions::new()
            .read(true)
            .custom_flags(NEVER_BLOCK.bits())
            .open(dir.join("lock"));
        let abandoned = match lock {
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

    /// Whatever the command leaves in place of the file, only a regular file is read: the rest
    /// is refused at once (a FIFO without a writer would block a plain `open` forever), and
    /// the directory goes when the file is dropped, whatever is in it.
    #[test]
    fn anything_but_a_regular_file_is_refused_without_blocking() {
        let target = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(target.path(), "{}").unwrap();
        type Swap<'a> = &'a dyn Fn(&Path);
        let swaps: [(&str, Swap); 4] = [
            ("a FIFO", &|p| {
                nix::unistd::mkfifo(p, Mode::from_bits_truncate(0o600)).unwrap()
            }),
            ("a directory", &|p| {
                std::fs::create_dir(p).unwrap();
                std::fs::write(p.join("x"), "x").unwrap();
            }),
            ("a symbolic link", &|p| {
                std::os::unix::fs::symlink(target.path(), p).unwrap()
            }),
            ("a socket", &|p| {
                std::os::unix::net::UnixListener::bind(p).unwrap();
            }),
        ];
        for (kind, swap) in swaps {
            let f = EventsFile::create().unwrap();
            std::fs::remove_file(f.path()).unwrap();
            swap(f.path());
            let (tx, rx) = std::sync::mpsc::channel();
            let path = f.path().to_owned();
            std::thread::spawn(move || {
                let _ = tx.send(match f.read(100) {
                    JobEvents::Refused(why, raw) => Ok((why, raw.len(), f)),
                    JobEvents::Valid(..) | JobEvents::None => Err("read"),
                });
            });
            let (why, read, f) = rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("reading {kind} blocked"))
                .unwrap_or_else(|e| panic!("{kind} was {e}"));
            assert_eq!(
                why,
                format!("LEASECTL_EVENTS is not a regular file (the command left {kind} there)")
            );
            assert_eq!(read, 0, "{kind}");
            let dir = path.parent().unwrap().to_owned();
            drop(f);
            assert!(!dir.exists(), "{kind}: {dir:?} is left");
        }
        assert_eq!(std::fs::read(target.path()).unwrap(), b"{}");
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

    /// The sweep is off the common path: about one run in `SWEEP_ONE_IN`, not every run.
    #[test]
    fn one_run_in_sweep_one_in_sweeps() {
        let due = (0..SWEEP_ONE_IN).filter(|d| sweep_due(*d)).count();
        assert_eq!(due, 1);
        const { assert!(SWEEP_ONE_IN >= 16) };
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
        // A command replaced the lock by a FIFO, and its leasectl was SIGKILLed: the sweep
        // neither waits on it nor leaves it.
        let fifo = aged(tmp.path(), "leasectl-events-4-d", hour);
        std::fs::remove_file(fifo.join("lock")).unwrap();
        nix::unistd::mkfifo(&fifo.join("lock"), Mode::from_bits_truncate(0o600)).unwrap();
        File::open(&fifo)
            .unwrap()
            .set_modified(SystemTime::now() - hour)
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let swept = tmp.path().to_owned();
        std::thread::spawn(move || {
            sweep(&swept);
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the sweep blocked");
        assert!(!fifo.exists());
        assert!(!abandoned.exists());
        assert!(held.join("events.jsonl").exists());
        assert!(young.exists());
        assert!(other.exists());
    }
}
