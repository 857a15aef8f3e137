//! How the leasectl binary gets its unwinder: linked in from `libgcc_eh.a` (build.rs), not
//! loaded from `libgcc_s.so.1` at every start, whose constructor costs about 0.15 ms of `CPUID`
//! traps on a virtual machine. That unwinding still works — a panic ends as exit 70 with the
//! command's group killed — is `safety::a_panic_mid_run_is_one_line_exit_70_and_the_command_dies_with_leasectl`.

use std::process::Command;

use crate::common::bin;

/// The shared libraries the dynamic loader would load for `path`, as `ldd` lists them: glibc's
/// loader prints them and exits, without running the program, when `LD_TRACE_LOADED_OBJECTS`
/// is set.
fn loaded_libraries(path: &std::path::Path) -> String {
    let o = Command::new(path)
        .env("LD_TRACE_LOADED_OBJECTS", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn leasectl_links_the_unwinder_in_wherever_the_c_compiler_has_it() {
    // build.rs's condition: the C compiler that links leasectl knows a libgcc_eh.a.
    let out = Command::new("cc")
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .unwrap();
    let found = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let static_unwinder = std::path::Path::new(&found).is_file();
    let libs = loaded_libraries(&bin());
    assert!(libs.contains("libc.so"), "no library list: {libs}");
    assert_eq!(
        libs.contains("libgcc_s"),
        !static_unwinder,
        "cc finds libgcc_eh.a at {found:?}; leasectl loads:\n{libs}"
    );
}
