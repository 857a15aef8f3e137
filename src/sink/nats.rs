//! `--sink nats://…`: NATS JetStream with acks. (Skeleton: to be built.)

use super::{DeliveryError, Event, SinkOptions};

#[derive(Debug, Clone)]
pub struct Spec {
    pub url: String,
    pub subject: String,
    pub stream: String,
}

impl Spec {
    pub fn parse(url: &str) -> Result<Spec, String> {
        let (url, ours) = super::take_query_params(url, &["subject", "stream"]);
        let get = |key: &str, default: &str| {
            ours.iter()
                .find(|(k, _)| k == key)
                .map_or_else(|| default.to_owned(), |(_, v)| v.clone())
        };
        Ok(Spec {
            subject: get("subject", "leasectl"),
            stream: get("stream", "LEASECTL"),
            url,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "{} subject {}.* stream {}",
            super::redact(&self.url),
            self.subject,
            self.stream
        )
    }
}

pub struct Nats {
    #[allow(dead_code)]
    spec: Spec,
    #[allow(dead_code)]
    opts: SinkOptions,
}

impl Nats {
    pub fn new(spec: Spec, opts: SinkOptions) -> Nats {
        Nats { spec, opts }
    }

    pub async fn deliver(&self, _event: &Event) -> Result<(), DeliveryError> {
        Err(DeliveryError::Unavailable("the nats sink is not built yet".into()))
    }
}
