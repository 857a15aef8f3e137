//! Records the git commit leasectl is built from, for `leasectl --version`, and the SHA-384
//! checksum of every file in migrations/, which `leasectl` compares with a schema's ledger on
//! every start (src/db/migrate.rs): hashing them when building spares each run the work.
//! In a release build it also has the linker lay out the run's functions together
//! (`symbol_order`), and in every native GNU/Linux build it links GCC's unwinder in instead of
//! loading `libgcc_s.so.1` at each start (`static_unwinder`).
//!
//! Sets `BUILT_FROM_COMMIT` to ` (<12 hex>)`, or ` (<12 hex>, dirty)` when tracked files differ
//! from that commit, or to nothing when there is no git or no checkout (a crates.io tarball,
//! `cargo install` from a registry): the version alone is then all there is to say. Not named
//! `LEASECTL_…`: cargo exports it to the tests too, and their commands must see only the
//! `LEASECTL_` variables leasectl gives them.
//! Reruns when HEAD moves (a commit, a checkout) or the index changes; an edit that is neither
//! staged nor followed by a commit leaves "dirty" as it was at the last run, which is why the
//! flag is only a hint.

// Cargo reads a build script's directives from its stdout; there is no pipe to break here.
#![allow(clippy::disallowed_macros)]

use std::path::PathBuf;
use std::process::Command;

/// A variable cargo sets for build scripts, or "" when it is not set.
fn var(key: &str) -> String {
    std::env::var(key).unwrap_or_default()
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let suffix = match commit() {
        Some((hash, dirty)) if dirty => format!(" ({hash}, dirty)"),
        Some((hash, _)) => format!(" ({hash})"),
        None => String::new(),
    };
    println!("cargo:rustc-env=BUILT_FROM_COMMIT={suffix}");
    migration_sums();
    symbol_order();
    static_unwinder();
}

/// Links GCC's unwinder into the program (`libgcc_eh.a`) instead of loading `libgcc_s.so.1` at
/// every start. Rust's standard library asks for `-lgcc_s` on GNU/Linux, and that library's
/// constructor (`__cpu_indicator_init`) runs a dozen `CPUID` instructions, each of which traps
/// to the hypervisor on a virtual machine: about 0.15 ms of every start where one `CPUID` costs
/// 9 µs, 1.5 % of a `leasectl run -- true` (docs/BENCHMARKS.md). The same unwinder linked in
/// runs no constructor, and unwinding (a panic's exit 70, which kills the command's group on the
/// way) works as before: the static unwinder is what `-static-libgcc` C++ programs and Rust's
/// own `crt-static` builds use.
///
/// How: the linker looks for `-lgcc_s` in the directories it is given before the system's, and
/// takes `libgcc_s.a` there if there is no `libgcc_s.so` beside it; so a directory holding a
/// copy of `libgcc_eh.a` under that name, searched first, answers the request with the static
/// unwinder. Only for a native GNU/Linux build whose C compiler (rustc's linker driver) has a
/// `libgcc_eh.a`; anything else links as before.
fn static_unwinder() {
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER");
    if var("CARGO_CFG_TARGET_OS") != "linux"
        || var("CARGO_CFG_TARGET_ENV") != "gnu"
        || var("TARGET") != var("HOST")
        || var("CARGO_CFG_TARGET_FEATURE")
            .split(',')
            .any(|f| f == "crt-static")
    {
        return;
    }
    let driver = std::env::var("CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER")
        .ok()
        .filter(|_| var("TARGET") == "x86_64-unknown-linux-gnu")
        .unwrap_or_else(|| "cc".to_owned());
    let Ok(out) = Command::new(driver)
        .arg("-print-file-name=libgcc_eh.a")
        .output()
    else {
        return;
    };
    // A driver that does not know the file prints its bare name back.
    let found = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !out.status.success() || !found.is_absolute() || !found.is_file() {
        return;
    }
    let dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it")).join("unwind");
    if std::fs::create_dir_all(&dir).is_err()
        || std::fs::copy(&found, dir.join("libgcc_s.a")).is_err()
    {
        return;
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
}

/// In a release build, has the linker lay out the functions a `leasectl run` executes
/// (`link/run.order`, written by `scripts/order-symbols`) next to one another, ahead of the
/// rest. The kernel maps a program's code a 64 KiB block at a time around each page it first
/// runs; with the run's code strewn among the relay's sinks, TLS and the other commands, a
/// holding `leasectl run` had 4.5 MiB of the binary resident, where its own code is 1.1 MiB.
/// The list names symbols as this toolchain and these dependencies mangle them: a name that no
/// longer exists is skipped silently, so a stale list costs memory, never a build.
///
/// Only where rustc links with its own LLD (x86_64 Linux since Rust 1.90), which reads such a
/// list: not when another linker was asked for. With `LEASECTL_LINK_MAP=<file>` the linker also
/// writes its map there, which `scripts/order-symbols` reads.
fn symbol_order() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let order = manifest.join("link").join("run.order");
    println!("cargo:rerun-if-changed={}", order.display());
    println!("cargo:rerun-if-env-changed=LEASECTL_LINK_MAP");
    let other_linker = std::env::var_os("CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER").is_some()
        || var("CARGO_ENCODED_RUSTFLAGS").contains("link");
    if var("PROFILE") != "release"
        || var("TARGET") != "x86_64-unknown-linux-gnu"
        || other_linker
        || !rustc_links_with_lld()
        || !order.exists()
    {
        return;
    }
    println!(
        "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
        order.display()
    );
    println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    if let Some(map) = std::env::var_os("LEASECTL_LINK_MAP") {
        println!(
            "cargo:rustc-link-arg-bins=-Wl,-Map={}",
            map.to_string_lossy()
        );
        // The map then names symbols as the list must: mangled.
        println!("cargo:rustc-link-arg-bins=-Wl,--no-demangle");
    }
}

/// Whether the compiler is Rust 1.90 or later, which links x86_64 Linux programs with its
/// bundled LLD.
fn rustc_links_with_lld() -> bool {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let Ok(out) = Command::new(rustc).arg("-vV").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(release) = text.lines().find_map(|l| l.strip_prefix("release: ")) else {
        return false;
    };
    let mut parts = release
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (1, 90)
}

/// Writes `$OUT_DIR/migration_sums.rs`: `SUMS`, each `migrations/*.sql` file's name and the
/// SHA-384 of its bytes, sorted by name (so by version); and `LEDGER`, the first 12 bytes of the
/// SHA-384 of those checksums one after another, in hex: what names a schema's ledger marker.
fn migration_sums() {
    use sha2::{Digest, Sha384};
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let dir = manifest.join("migrations");
    println!("cargo:rerun-if-changed=migrations");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("migrations/ is readable")
        .map(|e| e.expect("migrations/ is readable").path())
        .filter(|p| p.extension().is_some_and(|x| x == "sql"))
        .collect();
    files.sort();
    let mut out = String::from("pub const SUMS: &[(&str, [u8; 48])] = &[\n");
    let mut ledger = Sha384::new();
    for f in files {
        let text = std::fs::read(&f).expect("a migration is readable");
        let digest = Sha384::digest(&text);
        ledger.update(digest);
        let sum: Vec<String> = digest.iter().map(u8::to_string).collect();
        let name = f
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a UTF-8 name");
        out.push_str(&format!("    ({name:?}, [{}]),\n", sum.join(", ")));
    }
    out.push_str("];\n");
    let ledger: String = ledger.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    out.push_str(&format!("pub const LEDGER: &str = {ledger:?};\n"));
    let target = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"));
    std::fs::write(target.join("migration_sums.rs"), out).expect("OUT_DIR is writable");
}

/// The short hash of HEAD and whether the work tree is dirty, or None outside a checkout.
fn commit() -> Option<(String, bool)> {
    // Only this package's own checkout counts: a leasectl vendored into another repository
    // would otherwise report that repository's commit.
    let top = git(&["rev-parse", "--show-toplevel"])?;
    let manifest = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    let same = |a: &str, b: &str| {
        let (a, b) = (
            PathBuf::from(a).canonicalize(),
            PathBuf::from(b).canonicalize(),
        );
        matches!((a, b), (Ok(a), Ok(b)) if a == b)
    };
    if !same(&top, &manifest) {
        return None;
    }
    // The files that move when HEAD does. In a worktree `.git` is a file, so ask git where
    // they are rather than assuming `.git/HEAD`.
    for path in ["HEAD", "index", "packed-refs"] {
        rerun_on(&git(&["rev-parse", "--git-path", path])?);
    }
    if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
        rerun_on(&git(&["rev-parse", "--git-path", &reference])?);
    }
    let hash = git(&["rev-parse", "--short=12", "HEAD"])?;
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    Some((hash, dirty))
}

fn rerun_on(path: &str) {
    // cargo treats a missing file as always changed; only name the ones that exist.
    if PathBuf::from(path).exists() {
        println!("cargo:rerun-if-changed={path}");
    }
}

/// Runs git in the package directory; its trimmed stdout, or None when git is missing or fails.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        // No index refresh by `git status`: writing the index would retrigger this script.
        .env("GIT_OPTIONAL_LOCKS", "0")
        .current_dir(std::env::var_os("CARGO_MANIFEST_DIR")?)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_owned())
}
