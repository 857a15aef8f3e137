//! `link/run.order`, the functions a `leasectl run` executes, which build.rs has the linker lay
//! out together in a release build. A name the linker does not find is skipped silently, so a
//! list that names nothing it can find would cost the holding run its memory and fail no build:
//! these checks catch the ways a list can be wrong as a whole (demangled names, an empty or
//! truncated list, one of another program). Whether the names are the current build's is what
//! `bench/run-overhead.py`'s holding-run memory shows.

use std::collections::HashSet;
use std::path::PathBuf;

fn names() -> Vec<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("link/run.order");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/order-symbols writes it)", path.display()));
    text.lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_run_order_names_symbols_as_the_linker_sees_them() {
    let names = names();
    // The run's code is some 700 functions; a list of a few dozen was cut short.
    assert!(names.len() >= 300, "only {} names", names.len());
    let symbol = |n: &str| {
        n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '.'))
    };
    let bad: Vec<&String> = names.iter().filter(|n| !symbol(n)).take(3).collect();
    assert!(
        bad.is_empty(),
        "not mangled symbol names (a map written without --no-demangle?): {bad:?}"
    );
    let mut seen = HashSet::new();
    let twice: Vec<&String> = names.iter().filter(|n| !seen.insert(*n)).take(3).collect();
    assert!(twice.is_empty(), "named twice: {twice:?}");
}

#[test]
fn the_run_order_names_leasectls_own_run_code() {
    let names = names();
    // Legacy mangling spells a path's parts with their lengths: 8leasectl, 3run, 9supervise.
    let ours: Vec<&String> = names.iter().filter(|n| n.contains("8leasectl")).collect();
    assert!(
        ours.len() >= 20,
        "{} of leasectl's own functions",
        ours.len()
    );
    assert!(
        ours.iter().any(|n| n.contains("3run")),
        "none of the run command's code"
    );
}
