//! The password file, `~/.pgpass` (or `PGPASSFILE` / `passfile=`), read as libpq reads it.
//!
//! Lines are `hostname:port:database:username:password`; `*` as a whole field matches
//! anything; `\:` and `\\` escape; lines starting with `#` are comments; the first matching
//! line wins. A file that others can read is ignored with a warning, as libpq does, since a
//! password readable by the group is a password leaked. It is consulted per host, and only when
//! no password was given otherwise.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// One field of a line: `*`, or text that must equal the connection's value.
#[derive(Debug, PartialEq)]
enum Field {
    Any,
    Exact(String),
}

/// A parsed password file.
#[derive(Debug, Default)]
pub struct PassFile {
    lines: Vec<([Field; 4], String)>,
}

/// What a connection attempt is matched on. `host` is the host name, or for a Unix socket
/// `localhost` when it is a default socket directory, else the directory (libpq's rule).
pub struct Key<'a> {
    pub host: &'a str,
    pub port: u16,
    pub dbname: &'a str,
    pub user: &'a str,
}

impl PassFile {
    pub fn parse(text: &str) -> PassFile {
        let lines = text
            .lines()
            .map(|l| l.trim_end_matches('\r'))
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(parse_line)
            .collect();
        PassFile { lines }
    }

    /// The password of the first line matching `key`.
    pub fn lookup(&self, key: &Key<'_>) -> Option<&str> {
        let port = key.port.to_string();
        let wanted = [key.host, port.as_str(), key.dbname, key.user];
        self.lines
            .iter()
            .find(|(fields, _)| {
                fields.iter().zip(wanted).all(|(f, w)| match f {
                    Field::Any => true,
                    Field::Exact(s) => s == w,
                })
            })
            .map(|(_, password)| password.as_str())
    }
}

/// Splits one line at unescaped colons; a line with fewer than five fields never matches.
fn parse_line(line: &str) -> Option<([Field; 4], String)> {
    let mut fields: Vec<(String, bool)> = Vec::new();
    let (mut cur, mut escaped_any, mut chars) = (String::new(), false, line.chars());
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                    escaped_any = true;
                }
            }
            // The password is the last field: it ends at the next unescaped colon.
            ':' if fields.len() == 4 => break,
            ':' => fields.push((std::mem::take(&mut cur), std::mem::take(&mut escaped_any))),
            c => cur.push(c),
        }
    }
    if fields.len() != 4 {
        return None;
    }
    let field = |(text, escaped): (String, bool)| {
        if text == "*" && !escaped {
            Field::Any
        } else {
            Field::Exact(text)
        }
    };
    let mut it = fields.into_iter().map(field);
    let four = [it.next()?, it.next()?, it.next()?, it.next()?];
    Some((four, cur))
}

/// Reads the file at `path`: `Ok(None)` when there is none, `Err(warning)` when it exists
/// but must be ignored (not a plain file, or readable by others), as libpq warns.
pub fn read(path: &Path) -> Result<Option<PassFile>, String> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(None);
    };
    if !meta.is_file() {
        return Err(format!(
            "password file \"{}\" is not a plain file",
            path.display()
        ));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "password file \"{}\" has group or world access; permissions should be u=rw (0600) or less",
            path.display()
        ));
    }
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(PassFile::parse(&text))),
        Err(e) => Err(format!(
            "cannot read password file \"{}\": {e}",
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(host: &'a str, port: u16, dbname: &'a str, user: &'a str) -> Key<'a> {
        Key {
            host,
            port,
            dbname,
            user,
        }
    }

    #[test]
    fn first_matching_line_wins_and_stars_match_anything() {
        let f = PassFile::parse(
            "# comment\n\
             db.example:5432:app:alice:first\n\
             *:*:app:alice:second\n\
             *:*:*:*:fallback\r\n\
             too:few:fields\n",
        );
        assert_eq!(
            f.lookup(&key("db.example", 5432, "app", "alice")),
            Some("first")
        );
        assert_eq!(
            f.lookup(&key("other", 6543, "app", "alice")),
            Some("second")
        );
        assert_eq!(f.lookup(&key("other", 1, "x", "bob")), Some("fallback"));
        assert!(PassFile::parse("h:1:d:u\n")
            .lookup(&key("h", 1, "d", "u"))
            .is_none());
    }

    #[test]
    fn escapes_and_the_password_field() {
        let f = PassFile::parse(
            "/run/my\\:pg:5432:d\\\\b:u:pa\\:ss\\\\word:ignored\n\\*:5432:d:u:literal-star\n",
        );
        assert_eq!(
            f.lookup(&key("/run/my:pg", 5432, "d\\b", "u")),
            Some("pa:ss\\word")
        );
        // An escaped star is a literal star, not a wildcard.
        assert_eq!(f.lookup(&key("*", 5432, "d", "u")), Some("literal-star"));
        assert_eq!(f.lookup(&key("h", 5432, "d", "u")), None);
    }

    #[test]
    fn a_file_others_can_read_is_ignored_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pgpass");
        std::fs::write(&path, "*:*:*:*:pw\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let warning = read(&path).unwrap_err();
        assert!(warning.contains("group or world access"), "{warning}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let f = read(&path).unwrap().unwrap();
        assert_eq!(f.lookup(&key("h", 5432, "d", "u")), Some("pw"));
        assert!(read(&dir.path().join("absent")).unwrap().is_none());
        assert!(read(dir.path()).unwrap_err().contains("not a plain file"));
    }
}
