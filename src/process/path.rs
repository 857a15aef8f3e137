//! Finding a command in `PATH` before the fork, as `execvp` would after it.
//!
//! `execvp` in the forked child tries `execve` in each directory of `PATH` until one works; a
//! failed `execve` costs the child about as much as a successful `stat`, and the child runs on
//! the critical path of every `run` (leasectl waits for it), while the parent can look before
//! it forks. With a `PATH` of nine directories and the command in the last, as `true` is on
//! many machines, that was nine failed calls between the fork and the command.
//!
//! The lookup only names what `execvp` would have run: the first regular file the caller may
//! execute (`access(X_OK)`, which also refuses files on `noexec` mounts). Where it finds none,
//! the caller leaves the name to `execvp`, which then reports exactly what it always did.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `execvp`'s search path when `PATH` is unset (glibc's).
const DEFAULT_PATH: &str = "/bin:/usr/bin";

/// Where `execvp` would find `program` in `path` (the value of `PATH`, or `None` when it is
/// unset): `None` for a name with a slash (it is used as it is), or when no directory holds an
/// executable regular file of that name.
fn find_in_path(program: &OsStr, path: Option<&OsStr>) -> Option<PathBuf> {
    if program.is_empty() || program.as_bytes().contains(&b'/') {
        return None;
    }
    dirs(path.unwrap_or(OsStr::new(DEFAULT_PATH))).find_map(|dir| {
        let candidate = dir.join(program);
        let is_file = std::fs::metadata(&candidate).is_ok_and(|m| m.is_file());
        (is_file && nix::unistd::access(&candidate, nix::unistd::AccessFlags::X_OK).is_ok())
            .then_some(candidate)
    })
}

/// The directories of a `PATH` value in order; an empty entry is the current directory, as
/// for `execvp`.
fn dirs(path: &OsStr) -> impl Iterator<Item = &Path> {
    path.as_bytes().split(|&b| b == b':').map(|dir| {
        if dir.is_empty() {
            Path::new(".")
        } else {
            Path::new(OsStr::from_bytes(dir))
        }
    })
}

/// The argument to start `program` with: where `find_in_path` found it in this process's
/// `PATH`, or the name as given.
pub fn resolved(program: &OsStr) -> OsString {
    find_in_path(program, std::env::var_os("PATH").as_deref())
        .map_or_else(|| program.to_owned(), PathBuf::into_os_string)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn file(path: &Path, mode: u32) {
        std::fs::write(path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn the_first_executable_regular_file_in_path_order_wins() {
        let d = tempfile::tempdir().unwrap();
        let (a, b, c) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
        for dir in [&a, &b, &c] {
            std::fs::create_dir(dir).unwrap();
        }
        // In a: a directory of that name; in b: a file nobody may execute (unless root, for
        // whom one x bit is needed, so none is set); in c: the program.
        std::fs::create_dir(a.join("tool")).unwrap();
        file(&b.join("tool"), 0o644);
        file(&c.join("tool"), 0o755);
        let path = std::env::join_paths([&a, &b, &c]).unwrap();
        assert_eq!(
            find_in_path(OsStr::new("tool"), Some(&path)),
            Some(c.join("tool"))
        );
        // Nothing executable of that name: left to execvp.
        let path = std::env::join_paths([&a, &b]).unwrap();
        assert_eq!(find_in_path(OsStr::new("tool"), Some(&path)), None);
    }

    #[test]
    fn a_name_with_a_slash_or_an_empty_one_is_not_looked_up() {
        let path = OsStr::new("/bin:/usr/bin");
        assert_eq!(find_in_path(OsStr::new("./true"), Some(path)), None);
        assert_eq!(find_in_path(OsStr::new("/bin/true"), Some(path)), None);
        assert_eq!(find_in_path(OsStr::new(""), Some(path)), None);
    }

    #[test]
    fn an_empty_entry_is_the_current_directory_and_an_unset_path_is_execvps_default() {
        let dirs: Vec<&Path> = dirs(OsStr::new(":/a::b:")).collect();
        assert_eq!(dirs, [".", "/a", ".", "b", "."].map(Path::new));
        let sh = find_in_path(OsStr::new("sh"), None).expect("sh in /bin or /usr/bin");
        assert!(
            sh.starts_with("/bin") || sh.starts_with("/usr/bin"),
            "{sh:?}"
        );
    }
}
