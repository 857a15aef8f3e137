//! Taking a connection string apart before tokio-postgres parses it.
//!
//! tokio-postgres rejects libpq keys it does not know (`service`, `passfile`, `sslcert`, …) and
//! knows only some `sslmode`s, so those keys are taken out here, in both forms a connection
//! string has: a URL's query (`postgres://h/db?sslcert=/c.crt`) and a `key=value` string
//! (`host=h sslcert='/c.crt'`). The rest goes to tokio-postgres unchanged. The keys the string
//! sets are recorded too: a value given in the string beats a service file's and the
//! environment's, as in libpq.
//!
//! Errors never echo the string: it may hold a password.

use std::collections::BTreeMap;

/// The libpq keys leasectl handles itself rather than tokio-postgres.
pub const OWN_KEYS: [&str; 6] = [
    "service",
    "passfile",
    "sslmode",
    "sslcert",
    "sslkey",
    "sslrootcert",
];

/// A connection string split into what tokio-postgres parses and what leasectl handles.
#[derive(Debug, Default)]
pub struct Split {
    /// The string without [`OWN_KEYS`], for tokio-postgres.
    pub rest: String,
    /// The values of [`OWN_KEYS`] found (decoded).
    pub own: BTreeMap<String, String>,
    /// Every parameter key the string sets explicitly (a URL's user, host and database are
    /// visible in the parsed config instead).
    pub keys: Vec<String>,
}

impl Split {
    pub fn sets(&self, key: &str) -> bool {
        self.keys.iter().any(|k| k == key)
    }
}

/// Splits a URL or `key=value` connection string (see the module doc).
pub fn split(conn: &str) -> Result<Split, String> {
    if let Some(rest) = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|p| conn.strip_prefix(p))
    {
        split_url(&conn[..conn.len() - rest.len()], rest)
    } else {
        split_key_values(conn)
    }
}

/// The query of a URL: `&`-separated, percent-encoded `key=value` pairs. Like tokio-postgres,
/// the credentials end at the first `@` and the query starts at the next `?`.
fn split_url(scheme: &str, body: &str) -> Result<Split, String> {
    let creds_end = body.find('@').map_or(0, |i| i + 1);
    let Some(q) = body[creds_end..].find('?').map(|i| i + creds_end) else {
        return Ok(Split {
            rest: format!("{scheme}{body}"),
            ..Split::default()
        });
    };
    let mut split = Split::default();
    let mut kept = Vec::new();
    for pair in body[q + 1..].split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').ok_or("a URL parameter without '='")?;
        let key = percent_decode(k)?;
        if OWN_KEYS.contains(&key.as_str()) {
            split.own.insert(key.clone(), percent_decode(v)?);
        } else {
            kept.push(pair);
        }
        split.keys.push(key);
    }
    split.rest = format!("{scheme}{}", &body[..q]);
    if !kept.is_empty() {
        split.rest.push('?');
        split.rest.push_str(&kept.join("&"));
    }
    Ok(split)
}

/// libpq's `key = value` list: white space between pairs and around `=`; a value is either
/// single-quoted (`\'` and `\\` escapes inside) or runs to the next white space (`\` escapes
/// the next character).
fn split_key_values(conn: &str) -> Result<Split, String> {
    let mut split = Split::default();
    let mut kept = Vec::new();
    for (key, value) in parse_key_values(conn)? {
        if OWN_KEYS.contains(&key.as_str()) {
            split.own.insert(key.clone(), value);
        } else {
            kept.push(format!("{key}={}", quote(&value)));
        }
        split.keys.push(key);
    }
    split.rest = kept.join(" ");
    Ok(split)
}

/// The pairs of a `key=value` string, values unquoted and unescaped.
pub fn parse_key_values(conn: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    let mut chars = conn.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            // Not naming the word: a stray one may be part of a password.
            return Err("a parameter without '='".to_owned());
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => return Err(format!("unterminated quoted value of \"{key}\"")),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
}

/// A value quoted for a `key=value` string.
pub fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'%')
            .then(|| s.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| "a URL parameter is not UTF-8 once decoded".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parameters_of_our_own_are_taken_out() {
        let s = split(
            "postgres://u:p%3Fw@h1,h2:5433/db?sslmode=verify-full&connect_timeout=3&sslcert=%2Fc.crt&service=x",
        )
        .unwrap();
        assert_eq!(s.rest, "postgres://u:p%3Fw@h1,h2:5433/db?connect_timeout=3");
        assert_eq!(s.own["sslmode"], "verify-full");
        assert_eq!(s.own["sslcert"], "/c.crt");
        assert_eq!(s.own["service"], "x");
        assert!(s.sets("connect_timeout") && !s.sets("user"));
        let s = split("postgresql:///db?service=only").unwrap();
        assert_eq!(s.rest, "postgresql:///db");
        assert_eq!(split("postgres://h/db").unwrap().rest, "postgres://h/db");
        assert!(split("postgres://h/db?novalue").is_err());
    }

    #[test]
    fn key_value_strings_keep_quoting_and_escapes() {
        let s = split(r"host=h  password = 'it\'s a \\ secret' sslkey=/k\ ey service='s'").unwrap();
        assert_eq!(s.rest, r"host='h' password='it\'s a \\ secret'");
        assert_eq!(s.own["sslkey"], "/k ey");
        assert_eq!(s.own["service"], "s");
        assert!(s.sets("password") && s.sets("sslkey"));
        let err = split("host=h password='unterminated").unwrap_err();
        assert!(!err.contains("unterminated'"), "{err}");
        assert!(split("host").is_err());
        assert_eq!(split("").unwrap().rest, "");
        // What was split parses again as the same pairs.
        let pairs = parse_key_values(&s.rest).unwrap();
        assert_eq!(pairs[1].1, r"it's a \ secret");
    }
}
