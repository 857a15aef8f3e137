//! The published form of an event, the one JSON line `relay --format json` and `outbox discard`
//! print; its own file because the relay's sinks and the operator's commands both build on it.

use std::time::SystemTime;

use crate::fmt::rfc3339;

/// The published form: `{"id","aggregate_type","aggregate_id","type","payload","created_at"}`
/// (`relay --format json`, `outbox discard`; [`crate::relay::sink::format`] builds what sinks send)
/// on one line. `payload` is PostgreSQL's own jsonb text, spliced in as it is (valid JSON, never
/// a raw newline), which spares a parse and re-serialisation per event.
pub fn published_json(
    id: &uuid::Uuid,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    payload: &str,
    created_at: SystemTime,
) -> String {
    let string = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let mut out = String::with_capacity(payload.len() + 160);
    out.push_str("{\"id\":\"");
    out.push_str(&id.hyphenated().to_string());
    out.push_str("\",\"aggregate_type\":");
    out.push_str(&string(aggregate_type));
    out.push_str(",\"aggregate_id\":");
    out.push_str(&string(aggregate_id));
    out.push_str(",\"type\":");
    out.push_str(&string(event_type));
    out.push_str(",\"payload\":");
    out.push_str(payload);
    out.push_str(",\"created_at\":\"");
    out.push_str(&rfc3339(created_at));
    out.push_str("\"}");
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn published_json_is_one_valid_line_with_spec_keys() {
        let id = uuid::Uuid::nil();
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        let s = published_json(
            &id,
            "order",
            "4\"2\n",
            "order.paid",
            r#"{"total": 1500}"#,
            t,
        );
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
