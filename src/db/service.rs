//! Connection service files (`service=name` or `PGSERVICE`), found and read as libpq does.
//!
//! The user's file (`PGSERVICEFILE`, else `~/.pg_service.conf`) is searched first; if it has no
//! section for the service, the system file (`PGSYSCONFDIR/pg_service.conf`, else
//! `/etc/postgresql-common/pg_service.conf`, the directory Debian's libpq is built with). A
//! section is `[name]` followed by `key=value` lines; `#` starts a comment line. Its keys fill
//! whatever the connection string did not set, and beat the environment (libpq's order).

use std::path::{Path, PathBuf};

/// Where Debian's libpq looks for the system-wide service file (`pg_config --sysconfdir`).
const DEFAULT_SYSCONFDIR: &str = "/etc/postgresql-common";

/// The `key=value` pairs of service `name`, from the first file that defines it.
pub fn find(
    name: &str,
    env: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
) -> Result<Vec<(String, String)>, String> {
    let user_file = env("PGSERVICEFILE")
        .map(PathBuf::from)
        .or_else(|| home.map(|h| h.join(".pg_service.conf")));
    let system_file = Path::new(&env("PGSYSCONFDIR").unwrap_or_else(|| DEFAULT_SYSCONFDIR.into()))
        .join("pg_service.conf");
    for file in user_file.iter().chain([&system_file]) {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        if let Some(pairs) =
            section(&text, name).map_err(|e| format!("service file \"{}\": {e}", file.display()))?
        {
            return Ok(pairs);
        }
    }
    Err(format!(
        "definition of service \"{name}\" not found (looked in {}{})",
        user_file
            .map(|f| format!("{}, ", f.display()))
            .unwrap_or_default(),
        system_file.display()
    ))
}

/// The pairs of section `[name]` in a service file's text, `None` if it has no such section.
pub fn section(text: &str, name: &str) -> Result<Option<Vec<(String, String)>>, String> {
    let mut found: Option<Vec<(String, String)>> = None;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(group) = line.strip_prefix('[') {
            if found.is_some() {
                break;
            }
            if group.strip_suffix(']') == Some(name) {
                found = Some(Vec::new());
            }
            continue;
        }
        let Some(pairs) = found.as_mut() else {
            continue;
        };
        let Some((key, value)) = line.split_once('=') else {
            return Err(format!("syntax error on line {}", n + 1));
        };
        let key = key.trim();
        if key == "service" {
            return Err(format!(
                "nested service specifications not supported, line {}",
                n + 1
            ));
        }
        pairs.push((key.to_owned(), value.trim().to_owned()));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "\
# a comment
[other]
dbname=wrong

[mydb]
  host=db.example
port = 6543
# inside
dbname=app
[later]
dbname=also-wrong
";

    #[test]
    fn the_named_section_only() {
        let pairs = section(FILE, "mydb").unwrap().unwrap();
        assert_eq!(
            pairs,
            [("host", "db.example"), ("port", "6543"), ("dbname", "app")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        assert!(section(FILE, "missing").unwrap().is_none());
        assert!(section(FILE, "mydb2").unwrap().is_none());
        assert!(section("[s]\nno equals\n", "s")
            .unwrap_err()
            .contains("line 2"));
        assert!(section("[s]\nservice=t\n", "s").is_err());
        // A malformed line in a section we do not use is not our business.
        assert!(section("[t]\nno equals\n[s]\nhost=h\n", "s")
            .unwrap()
            .is_some());
    }

    #[test]
    fn user_file_first_then_system_file() {
        let dir = tempfile::tempdir().unwrap();
        let user = dir.path().join("user.conf");
        std::fs::write(&user, "[a]\ndbname=from-user\n").unwrap();
        std::fs::write(
            dir.path().join("pg_service.conf"),
            "[a]\ndbname=from-system\n[b]\ndbname=system-b\n",
        )
        .unwrap();
        let (u, d) = (user.display().to_string(), dir.path().display().to_string());
        let env = move |k: &str| match k {
            "PGSERVICEFILE" => Some(u.clone()),
            "PGSYSCONFDIR" => Some(d.clone()),
            _ => None,
        };
        assert_eq!(find("a", &env, None).unwrap()[0].1, "from-user");
        assert_eq!(find("b", &env, None).unwrap()[0].1, "system-b");
        let err = find("c", &env, None).unwrap_err();
        assert!(
            err.contains("definition of service \"c\" not found"),
            "{err}"
        );
        // Without PGSERVICEFILE, ~/.pg_service.conf.
        std::fs::write(dir.path().join(".pg_service.conf"), "[c]\ndbname=home\n").unwrap();
        let env = |k: &str| (k == "PGSYSCONFDIR").then(|| "/nonexistent".to_owned());
        assert_eq!(find("c", &env, Some(dir.path())).unwrap()[0].1, "home");
    }
}
