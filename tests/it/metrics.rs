//! `relay --metrics ADDR`: scraped with a real HTTP client (curl) while events flow
//! to the exec sink, the counters match what the sink received.

use std::net::TcpListener;
use std::process::{Command, Stdio};

use crate::common::*;
use crate::events::*;

/// `curl` on the metrics address: the status code and the body.
pub(crate) fn scrape(port: u16, path: &str) -> (String, String) {
    let out = Command::new("curl")
        .args(["-s", "-o", "-", "-w", "\n%{http_code}", "--max-time", "10"])
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .output_in_time();
    let text = stdout(&out);
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    (status.to_owned(), body.to_owned())
}

/// The sum of the samples of `metric` whose labels contain every one of `labels`.
pub(crate) fn value(body: &str, metric: &str, labels: &[&str]) -> f64 {
    body.lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn scraped_counters_match_what_the_sink_received() {
    let env = migrated();
    insert_events(&env, 30, 5, 1);
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', 'x', 'order.refused', '{}')",
    );
    let out = env.path("received");
    let port = spare_port();
    // One write per event, so the parallel deliveries' lines never interleave.
    let sink = format!(
        "exec:if [ \"$LEASECTL_EVENT_TYPE\" = order.refused ]; then exit 1; fi; \
         line=$(cat); printf '%s\\n' \"$line\" >> '{}'",
        out.display()
    );
    let relay = Watched::new(
        env.command()
            .args(["relay", "--sink", &sink, "--max-attempts", "2"])
            .args(["--metrics", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );

    let delivered = "leasectl_relay_events_delivered_total";
    let mut body = String::new();
    wait_for("the relay to count 30 delivered events and 1 dead", || {
        body = scrape(port, "/metrics").1;
        value(&body, delivered, &[]) == 30.0
            && value(&body, "leasectl_relay_events_dead_total", &[]) == 1.0
    });
    let received = std::fs::read_to_string(&out).unwrap();
    assert_eq!(received.lines().count(), 30);
    for t in ["order.created", "order.paid", "order.shipped"] {
        let sent = received
            .lines()
            .filter(|l| l.contains(&format!("\"type\":\"{t}\"")))
            .count();
        assert_eq!(
            value(&body, delivered, &[&format!("type=\"{t}\"")]),
            sent as f64,
            "{t}\n{body}"
        );
        assert_eq!(sent, 10);
    }
    let refused = &["type=\"order.refused\""];
    assert_eq!(
        value(&body, "leasectl_relay_events_refused_total", refused),
        2.0,
        "two attempts, both refused\n{body}"
    );
    assert_eq!(
        value(&body, "leasectl_relay_events_dead_total", refused),
        1.0
    );
    assert_eq!(
        value(&body, "leasectl_relay_delivery_latency_seconds_count", &[]),
        30.0,
        "{body}"
    );
    assert!(value(&body, "leasectl_relay_batch_size_count", &[]) >= 1.0);
    assert!(value(&body, "leasectl_relay_batch_size_sum", &[]) >= 31.0);
    assert_eq!(value(&body, "leasectl_relay_sink_up", &[]), 1.0, "{body}");
    assert_eq!(
        value(&body, "leasectl_relay_database_reconnects_total", &[]),
        0.0
    );

    // The gauges read from the database catch up within a refresh (5 s): nothing pending, the
    // dead event counted.
    wait_for("the backlog gauges to show one dead event", || {
        body = scrape(port, "/metrics").1;
        value(&body, "leasectl_relay_dead_events", &[]) == 1.0
            && value(&body, "leasectl_relay_backlog_events", &[]) == 0.0
    });
    assert_eq!(
        value(&body, "leasectl_relay_oldest_pending_age_seconds", &[]),
        0.0
    );
    assert!(
        body.contains("# TYPE leasectl_relay_events_delivered counter"),
        "{body}"
    );
    assert!(
        body.ends_with("# EOF\n"),
        "OpenMetrics text ends with # EOF"
    );

    assert_eq!(scrape(port, "/elsewhere").0, "404");

    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn a_metrics_address_in_use_is_a_usage_error_naming_it() {
    let env = migrated();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let o = env.run(&["relay", "--sink", "stdout", "--metrics", &addr]);
    assert_one_line_error(
        &o,
        2,
        &format!("--metrics: cannot listen on {addr}: Address already in use"),
    );
    let o = env.run(&["relay", "--sink", "stdout", "--metrics", "localhost"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
}
