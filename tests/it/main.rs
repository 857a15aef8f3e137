//! One integration-test binary (faster to build than one per file). Tests of leasectl talk to a
//! real PostgreSQL, in a schema of their own (see `common.rs`); the sink tests talk to the real
//! RabbitMQ and NATS on this machine, and to an HTTP peer they start themselves.

// Tests may print with the std macros (clippy.toml forbids them in leasectl itself, where a
// broken pipe must not panic); nextest captures the output.
#![allow(clippy::disallowed_macros)]
// The tests' own SQL runs on direct connections, where named statements are fine (leasectl's
// own code may only send unnamed ones, for poolers: clippy.toml).
#![allow(clippy::disallowed_methods)]

mod common;

mod ci_examples;
mod cli;
mod cloudevents;
mod completions;
mod connect;
mod doc_examples;
mod doctor;
mod events;
mod examples;
mod failover;
mod faults;
mod flights;
mod footprint;
mod harness;
mod health;
mod inspect;
mod job_events;
mod lease;
mod link_order;
mod manpages;
mod max_holders;
mod metrics;
mod netfault;
mod outage;
mod patroni;
mod pooler;
mod privileges;
mod proxy;
mod queue;
mod relay;
mod relay_ahead;
mod relay_backlog;
mod relay_dead_heads;
mod relay_faults;
mod relay_locked;
mod relay_memory;
mod relay_order;
mod relay_plain;
mod relay_session;
mod relay_sinks;
mod relay_wake;
mod release;
mod replace;
mod round_trips;
mod safety;
mod scripts;
mod singleflight;
mod sink_brokers;
mod sink_local;
mod slot;
mod steps;
mod stopping;
mod supervise;
mod unwinder;
