//! Data on stdout: every command's output goes through [`print()`], never the std print macros,
//! which panic when the reader of a pipe has gone.

use anyhow::Result;

/// Writes to stdout, treating a closed pipe (`leasectl … | head`) as success.
pub fn print(bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("cannot write to stdout"))
        }
        _ => Ok(()),
    }
}

/// Pretty JSON and a newline on stdout.
pub fn print_json(value: &serde_json::Value) -> Result<()> {
    let mut s = serde_json::to_string_pretty(value)?;
    s.push('\n');
    print(s.as_bytes())
}
