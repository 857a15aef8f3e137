//! The command's own outbox events (`LEASECTL_EVENTS`).
//!
//! The command gets the path of a fresh file (mode 0600, in a directory only its user may enter,
//! mode 0700: below) and may append JSON lines `{"aggregate_type", "aggregate_id", "type", "payload"}` to
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
//! relative to the directory it made the file in (an `openat` on the descriptor it kept, so a
//! renamed or swapped directory does not redirect it), with `O_NONBLOCK | O_NOFOLLOW`, and reads only a
//! regular file: anything else is a malformed events file (exit 65), found without ever blocking.
//!
//! Where the file lives: in this user's directory under the temporary directory,
//! `leasectl-<uid>` (mode 0700, created once and kept), as `events-<pid>-<random>.jsonl` beside
//! its `.lock`. Creating and removing a directory for every run cost more than the rest of the
//! file's handling together: a directory holds a data block, and freeing a block on a filesystem
//! mounted with `discard` (common on cloud disks) waits for the device to discard it, about a
//! millisecond on every run's path. Two empty files hold no block. A name the user does not own
//! as a private directory (another user's, a symbolic link, open to others) is never used: the
//! run then gets a directory of its own, `leasectl-events-<pid>-<random>`, removed after it.
//!
//! A leasectl that is SIGKILLed cannot remove its files. So the owner keeps the `.lock` file
//! `flock`ed (not inherited by the command: close-on-exec), and a sweep removes the files (or
//! directories) of the same user whose lock nobody holds — their owner is gone, whatever pid
//! namespace it ran in — once they are older than `SWEEP_AFTER` (a lock that young may be one
//! whose owner has not locked it yet). The sweep reads the whole directory and opens every stale
//! entry, so it is not on every run's path: one run in `SWEEP_ONE_IN`, drawn at random, sweeps
//! (abandoned files are rare — only a SIGKILLed run leaves them — so they still go soon, and
//! never pile up), and so does any run whose file cannot be created.

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

/// The prefix of this user's directory under the temporary directory (`leasectl-<uid>`).
const USER_DIR_PREFIX: &str = "leasectl-";

/// The prefix of one run's files in that directory (`events-<pid>-<random>.jsonl` and `.lock`).
const RUN_PREFIX: &str = "events-";

/// The prefix of a run's own directory under the temporary directory, where the user's cannot be
/// used.
const PREFIX: &str = "leasectl-events-";

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

/// The file and its lock (and the directory, when it is the run's own), removed when dropped.
pub struct EventsFile {
    dir: PathBuf,
    /// The directory, opened before the files were made in it: the file is read relative to it.
    dir_fd: File,
    /// Whether the directory is this run's own (removed with the files).
    own_dir: bool,
    /// The file's and the lock's names in the directory.
    name: String,
    lock_name: String,
    path: PathBuf,
    /// Held while we live: tells a sweep that the files are in use.
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
        let run = format!("{}-{:016x}", std::process::id(), fastrand::u64(..));
        if let Some((dir, dir_fd)) = user_dir(tmp) {
            let stem = format!("{RUN_PREFIX}{run}");
            let names = (format!("{stem}.jsonl"), format!("{stem}.lock"));
            return fill(dir, dir_fd, false, names);
        }
        let dir = tmp.join(format!("{PREFIX}{run}"));
        DirBuilder::new().mode(0o700).create(&dir)?;
        let names = ("events.jsonl".to_owned(), "lock".to_owned());
        let filled = File::open(&dir).and_then(|fd| fill(dir.clone(), fd, true, names));
        if filled.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        filled
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
        match nix::fcntl::openat(&self.dir_fd, self.name.as_str(), NEVER_BLOCK, Mode::empty()) {
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
                    self.name.as_str(),
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
    /// Removes the file, whatever the command left in its place (a directory included; a
    /// symbolic link is removed, never followed), then the lock, still held: a sweep cannot
    /// take it meanwhile. A directory of the run's own goes whole.
    fn drop(&mut self) {
        if self.own_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
            return;
        }
        remove_entry(&self.path);
        let _ = std::fs::remove_file(self.dir.join(&self.lock_name));
    }
}

/// This user's directory under `tmp` ([`USER_DIR_PREFIX`]`<uid>`), created if missing, and
/// opened; `None` if that name is anything but a directory of this user's that only they can
/// enter (another user's, a symbolic link, a file, open to others), or cannot be made.
fn user_dir(tmp: &Path) -> Option<(PathBuf, File)> {
    let uid = nix::unistd::geteuid().as_raw();
    let dir = tmp.join(format!("{USER_DIR_PREFIX}{uid}"));
    match DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(_) => return None,
    }
    let fd = OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(&dir)
        .ok()?;
    let meta = fd.metadata().ok()?;
    let private = meta.is_dir() && meta.uid() == uid && meta.mode() & 0o777 == 0o700;
    private.then_some((dir, fd))
}

/// The locked lock file and the empty events file (`names`: the file's, the lock's) in `dir`.
fn fill(
    dir: PathBuf,
    dir_fd: File,
    own_dir: bool,
    (name, lock_name): (String, String),
) -> io::Result<EventsFile> {
    let lock = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dir.join(&lock_name))?;
    let lock = Flock::lock(lock, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| e)?;
    let path = dir.join(&name);
    let made = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path);
    if let Err(e) = made {
        let _ = std::fs::remove_file(dir.join(&lock_name));
        return Err(e);
    }
    Ok(EventsFile {
        dir,
        dir_fd,
        own_dir,
        name,
        lock_name,
        path,
        _lock: lock,
    })
}

/// Removes whatever is at `path`: a directory with what it holds, anything else unlinked (a
/// symbolic link itself, never what it points to).
fn remove_entry(path: &Path) {
    let _ = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        _ => std::fs::remove_file(path),
    };
}

/// [`SWEEP_ONE_IN`], or in debug builds `LEASECTL_TEST_SWEEP_ONE_IN` (tests make every run
/// sweep with 1).
fn sweep_one_in() -> u32 {
    crate::config::test_count("LEASECTL_TEST_SWEEP_ONE_IN")
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(SWEEP_ONE_IN)
}

/// Whether this run sweeps, given a number drawn uniformly below [`sweep_one_in`].
fn sweep_due(draw: u32) -> bool {
    draw == 0
}

/// Whether `meta` is this user's and older than [`SWEEP_AFTER`].
fn stale(meta: &std::fs::Metadata, uid: u32) -> bool {
    let old = meta
        .modified()
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .is_some_and(|age| age >= SWEEP_AFTER);
    meta.uid() == uid && old
}

/// Whether the owner of the lock at `lock` is gone: nobody holds it (or there is none). Opened
/// as the events file is: a FIFO or a link left in place of the lock by a command must not hang
/// or redirect the sweep. Closing the file releases the lock taken here.
fn abandoned(lock: &Path) -> bool {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(NEVER_BLOCK.bits())
        .open(lock);
    match file {
        Ok(f) => Flock::lock(f, FlockArg::LockExclusiveNonblock).is_ok(),
        Err(e) => e.kind() == io::ErrorKind::NotFound,
    }
}

/// Removes this user's leftovers under `tmp` whose owner is gone: in this user's directory, the
/// files of runs whose lock nobody holds (or that have none) once older than [`SWEEP_AFTER`];
/// beside it, the runs' own directories likewise. Best effort: what cannot be read or removed is
/// left alone.
fn sweep(tmp: &Path) {
    let uid = nix::unistd::geteuid().as_raw();
    if let Some((dir, _fd)) = user_dir(tmp) {
        sweep_user_dir(&dir, uid);
    }
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(PREFIX) {
            continue;
        }
        let dir = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&dir) else {
            continue;
        };
        if meta.is_dir() && stale(&meta, uid) && abandoned(&dir.join("lock")) {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// [`sweep`] in this user's directory: each run's `.jsonl` and `.lock`, judged by whichever of
/// them is there (the lock first).
fn sweep_user_dir(dir: &Path, uid: u32) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut seen = std::collections::HashSet::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name
            .strip_suffix(".lock")
            .or_else(|| name.strip_suffix(".jsonl"))
            .filter(|s| s.starts_with(RUN_PREFIX))
        else {
            continue;
        };
        if !seen.insert(stem.to_owned()) {
            continue;
        }
        let (file, lock) = (
            dir.join(format!("{stem}.jsonl")),
            dir.join(format!("{stem}.lock")),
        );
        let meta = std::fs::symlink_metadata(&lock).or_else(|_| std::fs::symlink_metadata(&file));
        if meta.is_ok_and(|m| stale(&m, uid)) && abandoned(&lock) {
            remove_entry(&file);
            let _ = std::fs::remove_file(&lock);
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
        let uid = nix::unistd::geteuid().as_raw();
        assert_eq!(dir, std::env::temp_dir().join(format!("leasectl-{uid}")));
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let lock = f.path().with_extension("lock");
        assert!(lock.exists());
        std::fs::write(f.path(), "x".repeat(11)).unwrap();
        assert!(
            matches!(f.read(10), JobEvents::Refused(why, raw) if why.contains("--events-limit") && raw.len() == 10)
        );
        let path = f.path().to_owned();
        drop(f);
        assert!(!path.exists());
        assert!(!lock.exists());
        assert!(dir.exists(), "the user's directory is kept");
    }

    /// Where the user's directory is not theirs alone (open to others here; another user's or
    /// a symbolic link likewise), the run gets a directory of its own, removed with the file.
    #[test]
    fn a_user_directory_open_to_others_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let shared = tmp.path().join(format!("leasectl-{uid}"));
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let f = EventsFile::create_in(tmp.path()).unwrap();
        let dir = f.path().parent().unwrap().to_owned();
        assert!(
            dir.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(PREFIX),
            "{dir:?}"
        );
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        drop(f);
        assert!(!dir.exists());
        assert_eq!(std::fs::read_dir(&shared).unwrap().count(), 0);
        // A symbolic link by that name is not followed either.
        std::fs::remove_dir(&shared).unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), &shared).unwrap();
        let f = EventsFile::create_in(tmp.path()).unwrap();
        assert!(!f.path().starts_with(&shared), "{:?}", f.path());
        drop(f);
        assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
    }

    /// Whatever the command leaves in place of the file, only a regular file is read: the rest
    /// is refused at once (a FIFO without a writer would block a plain `open` forever), and
    /// it goes when the file is dropped, whatever it is.
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
            drop(f);
            assert!(
                std::fs::symlink_metadata(&path).is_err(),
                "{kind}: {path:?} is left"
            );
            assert!(
                !path.with_extension("lock").exists(),
                "{kind}: its lock is left"
            );
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

    /// Sweeps `tmp`, failing if that takes more than 10 s (a FIFO in place of a lock must not
    /// block it).
    fn sweep_in_time(tmp: &Path) {
        let (tx, rx) = std::sync::mpsc::channel();
        let swept = tmp.to_owned();
        std::thread::spawn(move || {
            sweep(&swept);
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the sweep blocked");
    }

    /// A run's files in the user's directory, `events-<name>.lock` and `.jsonl`, dated `age`
    /// ago.
    fn aged_files(dir: &Path, name: &str, age: Duration) -> PathBuf {
        let stem = dir.join(format!("events-{name}"));
        for ext in ["lock", "jsonl"] {
            let f = File::create(stem.with_extension(ext)).unwrap();
            f.set_modified(SystemTime::now() - age).unwrap();
        }
        stem
    }

    #[test]
    fn a_sweep_removes_only_old_files_whose_lock_nobody_holds() {
        let tmp = tempfile::tempdir().unwrap();
        let hour = Duration::from_secs(3600);
        let (dir, _fd) = user_dir(tmp.path()).unwrap();
        let abandoned = aged_files(&dir, "1-a", hour);
        let held = aged_files(&dir, "2-b", hour);
        let _holder = Flock::lock(
            File::open(held.with_extension("lock")).unwrap(),
            FlockArg::LockExclusiveNonblock,
        )
        .unwrap();
        let young = aged_files(&dir, "3-c", Duration::ZERO);
        // Its lock removed by the command, and a directory left in place of its file.
        let lockless = aged_files(&dir, "4-d", hour);
        std::fs::remove_file(lockless.with_extension("lock")).unwrap();
        std::fs::remove_file(lockless.with_extension("jsonl")).unwrap();
        std::fs::create_dir(lockless.with_extension("jsonl")).unwrap();
        std::fs::write(lockless.with_extension("jsonl").join("x"), "x").unwrap();
        File::open(lockless.with_extension("jsonl"))
            .unwrap()
            .set_modified(SystemTime::now() - hour)
            .unwrap();
        // A FIFO in place of a lock: the sweep neither waits on it nor leaves it.
        let fifo = aged_files(&dir, "5-e", hour);
        std::fs::remove_file(fifo.with_extension("lock")).unwrap();
        nix::unistd::mkfifo(
            &fifo.with_extension("lock"),
            Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let then = nix::sys::time::TimeSpec::from_duration(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                - hour,
        );
        nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            &fifo.with_extension("lock"),
            &then,
            &then,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();
        let other = dir.join("something-else.lock");
        File::create(&other)
            .unwrap()
            .set_modified(SystemTime::now() - hour)
            .unwrap();
        sweep_in_time(tmp.path());
        for gone in [&abandoned, &lockless, &fifo] {
            for ext in ["lock", "jsonl"] {
                let p = gone.with_extension(ext);
                assert!(std::fs::symlink_metadata(&p).is_err(), "{p:?} is left");
            }
        }
        for kept in [&held, &young] {
            assert!(kept.with_extension("lock").exists());
            assert!(kept.with_extension("jsonl").exists());
        }
        assert!(other.exists());
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
        sweep_in_time(tmp.path());
        assert!(!fifo.exists());
        assert!(!abandoned.exists());
        assert!(held.join("events.jsonl").exists());
        assert!(young.exists());
        assert!(other.exists());
    }
}
