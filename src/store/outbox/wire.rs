//! The published form of an event, the one JSON line `relay --format json` and `outbox discard`
//! print; its own file because the relay's sinks and the operator's commands both build on it.

use std::time::SystemTime;

use crate::fmt::write_rfc3339;

/// An event in its published form: `{"id","aggregate_type","aggregate_id","type","payload",
/// "created_at"}` (`relay --format json`, `outbox discard`; [`crate::relay::sink::format`] builds
/// what sinks send) on one line. `payload` is PostgreSQL's own jsonb text, spliced in as it is
/// (valid JSON, never a raw newline), which spares a parse and re-serialisation per event.
pub struct Published<'a> {
    pub id: &'a uuid::Uuid,
    pub aggregate_type: &'a str,
    pub aggregate_id: &'a str,
    pub event_type: &'a str,
    pub payload: &'a str,
    pub created_at: SystemTime,
}

impl Published<'_> {
    /// The line, without its newline.
    pub fn json(&self) -> String {
        let mut out = String::with_capacity(self.payload.len() + 160);
        self.write_json(&mut out);
        out
    }

    /// [`Published::json`], appended to `out`: the stdout sink writes a batch's thousand lines
    /// into one buffer without a string of its own for each line and each of its parts.
    pub fn write_json(&self, out: &mut String) {
        out.push_str("{\"id\":\"");
        out.push_str(
            self.id
                .hyphenated()
                .encode_lower(&mut uuid::Uuid::encode_buffer()),
        );
        out.push_str("\",\"aggregate_type\":");
        json_string(out, self.aggregate_type);
        out.push_str(",\"aggregate_id\":");
        json_string(out, self.aggregate_id);
        out.push_str(",\"type\":");
        json_string(out, self.event_type);
        out.push_str(",\"payload\":");
        out.push_str(self.payload);
        out.push_str(",\"created_at\":\"");
        write_rfc3339(out, self.created_at);
        out.push_str("\"}");
    }
}

/// `s` as a JSON string, appended to `out`: as serde_json writes it, without a copy first when
/// nothing in it needs escaping (an aggregate's type and id, an event's type, almost always).
fn json_string(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        for s in [
            "order",
            "",
            "a\"b",
            "back\\slash",
            "tab\there",
            "\u{1}",
            "\u{7f}del",
            "zürich/注文",
            "\u{2028}",
        ] {
            let mut out = String::new();
            json_string(&mut out, s);
            assert_eq!(out, serde_json::to_string(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn published_json_is_one_valid_line_with_spec_keys() {
        let id = uuid::Uuid::nil();
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        let s = Published {
            id: &id,
            aggregate_type: "order",
            aggregate_id: "4\"2\n",
            event_type: "order.paid",
            payload: r#"{"total": 1500}"#,
            created_at: t,
        }
        .json();
        assert!(!s.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "id",
                "aggregate_type",
                "aggregate_id",
                "type",
                "payload",
                "created_at"
            ]
        );
        assert_eq!(v["aggregate_id"], "4\"2\n");
        assert_eq!(v["payload"]["total"], 1500);
        assert_eq!(v["created_at"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(v["id"], "00000000-0000-0000-0000-000000000000");
    }
}
