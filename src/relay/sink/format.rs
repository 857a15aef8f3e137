//! What a sink publishes for an event (`--format`): the one place the published form is built,
//! for every sink.
//!
//! * `json` (the default): the published object `{"id","aggregate_type","aggregate_id","type","payload",
//!   "created_at"}` ([`crate::store::outbox::Published`]), as every sink's body.
//! * `cloudevents`: [CloudEvents 1.0](https://github.com/cloudevents/spec). Its attributes are
//!   `specversion` `1.0`, `id` (the event id), `source` (`--source`, default `leasectl://SCHEMA`),
//!   `type`, `subject` (`aggregate_type/aggregate_id`), `time` (`created_at`, RFC 3339),
//!   `datacontenttype` `application/json`, and two extension attributes, `aggregatetype` and
//!   `aggregateid` (the subject cannot be split back when the aggregate type holds a `/`).
//!   Extension names follow the spec's rule (lower-case ASCII letters and digits, at most 20
//!   characters); the names are Debezium's outbox columns. `data` is the payload.
//!
//!   Each sink uses the content mode its protocol binding suits: the *structured* JSON event
//!   format ([`Format::document`]: one JSON object on one line) where there is nowhere to put
//!   metadata but the body — stdout and `exec:`; the *binary* mode ([`Format::body`] is the
//!   payload alone, [`Format::attributes`] go into the message's metadata) for HTTP (`ce-*`
//!   headers, `Content-Type` = `datacontenttype`), AMQP (`cloudEvents:*` headers, the
//!   `content-type` property = `datacontenttype`) and NATS (`ce-*` headers, `datacontenttype`
//!   included).
//!
//! The JSON is built by hand, as [`crate::store::outbox::Published`] is: the payload is
//! PostgreSQL's own jsonb text, spliced in as it is (valid JSON, never a raw newline), which
//! spares a parse and a re-serialisation per event.

use super::Event;
use crate::fmt::rfc3339;
use crate::store::outbox::Published;

/// The CloudEvents version published.
pub const SPECVERSION: &str = "1.0";
/// The media type of `data`: the payload is JSON (a jsonb column).
pub const DATACONTENTTYPE: &str = "application/json";

/// A parsed `--format` (with `--source`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// The published JSON object, `{"id","aggregate_type","aggregate_id","type","payload","created_at"}`
    /// (the default).
    Json,
    /// CloudEvents 1.0 with this `source`.
    CloudEvents { source: String },
}

impl Format {
    /// The event as one JSON object on one line, without a newline: the published object, or the
    /// CloudEvents JSON event format (structured mode) — what stdout and `exec:` publish.
    pub fn document(&self, e: &Event) -> String {
        let mut out = String::with_capacity(e.payload.len() + 256);
        self.write_document(&mut out, e);
        out
    }

    /// [`Format::document`], appended to `out` (the stdout sink's buffer of a batch).
    pub fn write_document(&self, out: &mut String, e: &Event) {
        match self {
            Format::Json => Published {
                id: &e.id,
                aggregate_type: &e.aggregate_type,
                aggregate_id: &e.aggregate_id,
                event_type: &e.event_type,
                payload: &e.payload,
                created_at: e.created_at,
            }
            .write_json(out),
            Format::CloudEvents { .. } => {
                out.push('{');
                for (i, (name, value)) in self.attributes(e).iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push('"');
                    out.push_str(name);
                    out.push_str("\":");
                    out.push_str(&json_string(value));
                }
                out.push_str(",\"data\":");
                out.push_str(&e.payload);
                out.push('}');
            }
        }
    }

    /// The message body of a sink whose protocol has metadata (HTTP, AMQP, NATS): the document
    /// for `json`, the payload alone for CloudEvents' binary mode.
    pub fn body(&self, e: &Event) -> String {
        match self {
            Format::Json => self.document(e),
            Format::CloudEvents { .. } => e.payload.clone(),
        }
    }

    /// The CloudEvents attributes of the event, by name, in the spec's order (none for `json`).
    /// A binding puts each into its message's metadata under its own prefix; HTTP and AMQP
    /// carry `datacontenttype` as the message's content type instead (see [`DATACONTENTTYPE`]).
    pub fn attributes(&self, e: &Event) -> Vec<(&'static str, String)> {
        let Format::CloudEvents { source } = self else {
            return Vec::new();
        };
        vec![
            ("specversion", SPECVERSION.to_owned()),
            ("id", e.id.hyphenated().to_string()),
            ("source", source.clone()),
            ("type", e.event_type.clone()),
            (
                "subject",
                format!("{}/{}", e.aggregate_type, e.aggregate_id),
            ),
            ("time", rfc3339(e.created_at)),
            ("datacontenttype", DATACONTENTTYPE.to_owned()),
            ("aggregatetype", e.aggregate_type.clone()),
            ("aggregateid", e.aggregate_id.clone()),
        ]
    }
}

/// The default `source`: `leasectl://SCHEMA` (schema names are letters, digits and `_`, all
/// allowed in a URI's authority as they are).
pub fn default_source(schema: &str) -> String {
    format!("leasectl://{schema}")
}

/// A string as a JSON string literal.
fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// A header value for the `ce-*` headers of the HTTP and NATS bindings: the attribute's string
/// form with space, `"`, `%` and everything outside printable ASCII (U+0021–U+007E)
/// percent-encoded as UTF-8 bytes, upper-case hex — exactly the characters both bindings say
/// MUST be encoded.
pub fn percent_encode_header(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if (0x21..=0x7e).contains(&b) && b != b'"' && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Checks `--source`: CloudEvents requires a non-empty URI-reference (RFC 3986), absolute
/// (`https://example.com/orders`, `urn:app:orders`) or relative (`/orders`). The check is the
/// grammar's: only characters a URI may hold, `%` followed by two hex digits, a scheme of a
/// letter then letters, digits, `+`, `-` or `.` before the first `:` (a relative reference
/// cannot have a `:` in its first segment), `[` `]` only around a host, at most one `#`.
pub fn parse_source(s: &str) -> Result<String, String> {
    let bad = |why: String| Err(format!("'{s}' is not a URI-reference: {why}"));
    if s.is_empty() {
        return Err("the source must not be empty (a URI-reference such as https://example.com/orders or /orders)".into());
    }
    for (at, c) in s.char_indices() {
        if c == '%' {
            let hex = s.as_bytes().get(at + 1..at + 3);
            if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                return bad("'%' must start a percent-escape such as %20".into());
            }
        } else if !(c.is_ascii_alphanumeric() || "-._~:/?#[]@!$&'()*+,;=".contains(c)) {
            return bad(format!(
                "{} must be percent-encoded",
                if c == ' ' {
                    "a space".to_owned()
                } else {
                    format!("'{}'", c.escape_debug())
                }
            ));
        }
    }
    let (before_fragment, fragment) = s.split_once('#').unwrap_or((s, ""));
    if fragment.contains('#') {
        return bad("more than one '#'".into());
    }
    let first_segment_end = s.find(['/', '?', '#']).unwrap_or(s.len());
    let rest = match s[..first_segment_end].find(':') {
        Some(colon) => {
            let scheme = &s[..colon];
            let ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
            if !ok {
                return bad(format!(
                    "'{scheme}' before the first ':' is not a scheme (a letter, then letters, digits, '+', '-' or '.')"
                ));
            }
            &before_fragment[colon + 1..]
        }
        None => before_fragment,
    };
    // `[` and `]` may only enclose an IP literal host in the authority (`//[::1]:8080/…`).
    let (authority, path_and_query) = match rest.strip_prefix("//") {
        Some(r) => r.split_at(r.find(['/', '?']).unwrap_or(r.len())),
        None => ("", rest),
    };
    if path_and_query.contains(['[', ']']) || fragment.contains(['[', ']']) {
        return bad("'[' and ']' may only enclose an IP address host".into());
    }
    if authority.contains(['[', ']']) {
        let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let literal = host_port
            .strip_prefix('[')
            .and_then(|h| h.split_once(']'))
            .is_some_and(|(ip, port)| {
                !ip.contains('[')
                    && !ip.contains(']')
                    && port.chars().all(|c| c == ':' || c.is_ascii_digit())
            });
        if !literal {
            return bad("'[' and ']' may only enclose an IP address host".into());
        }
    }
    Ok(s.to_owned())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;

    fn event() -> Event {
        Event {
            seq: 7,
            id: uuid::Uuid::nil(),
            aggregate_type: "order".into(),
            aggregate_id: "4\"2/x".into(),
            event_type: "order.paid".into(),
            payload: r#"{"total": 1500}"#.into(),
            created_at: SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456),
        }
    }

    fn ce() -> Format {
        Format::CloudEvents {
            source: "leasectl://app".into(),
        }
    }

    #[test]
    fn json_is_specs_object_and_the_body_everywhere() {
        let e = event();
        let d = Format::Json.document(&e);
        let v: serde_json::Value = serde_json::from_str(&d).unwrap();
        assert_eq!(v["payload"]["total"], 1500);
        assert_eq!(v["type"], "order.paid");
        assert_eq!(Format::Json.body(&e), d);
        assert!(Format::Json.attributes(&e).is_empty());
    }

    #[test]
    fn cloudevents_structured_is_one_line_with_the_required_attributes() {
        let e = event();
        let d = ce().document(&e);
        assert!(!d.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&d).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["id"], "00000000-0000-0000-0000-000000000000");
        assert_eq!(v["source"], "leasectl://app");
        assert_eq!(v["type"], "order.paid");
        assert_eq!(v["subject"], "order/4\"2/x");
        assert_eq!(v["time"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(v["datacontenttype"], "application/json");
        assert_eq!(v["aggregatetype"], "order");
        assert_eq!(v["aggregateid"], "4\"2/x");
        assert_eq!(v["data"]["total"], 1500);
        // Every attribute name is a valid CloudEvents name.
        for (name, _) in ce().attributes(&e) {
            assert!(name.len() <= 20, "{name}");
            assert!(name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
        }
    }

    #[test]
    fn cloudevents_binary_body_is_the_payload() {
        assert_eq!(ce().body(&event()), r#"{"total": 1500}"#);
    }

    #[test]
    fn header_values_are_percent_encoded_as_the_bindings_say() {
        assert_eq!(percent_encode_header("order.paid"), "order.paid");
        assert_eq!(
            percent_encode_header("Euro € 😀"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
        assert_eq!(percent_encode_header("a\"b%c\n"), "a%22b%25c%0A");
    }

    #[test]
    fn sources_must_be_uri_references() {
        for good in [
            "leasectl://app",
            "https://example.com/orders?x=1#top",
            "urn:example:orders",
            "/orders",
            "orders",
            "orders/a:b",
            "http://[::1]:8080/x",
            "https://u@h/p%20q",
            "mailto:ops@example.com",
        ] {
            assert_eq!(parse_source(good).as_deref(), Ok(good), "{good}");
        }
        for bad in [
            "",
            "has space",
            "http://h/%zz",
            "100%",
            "1a:b",
            ":x",
            "a#b#c",
            "http://h/[x]",
            "x/é",
            "a\"b",
            "<x>",
        ] {
            let e = parse_source(bad).unwrap_err();
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
    }
}
