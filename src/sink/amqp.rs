//! `--sink amqp://…`: RabbitMQ with publisher confirms. (Skeleton: to be built.)

use super::{DeliveryError, Event, SinkOptions};

#[derive(Debug, Clone)]
pub struct Spec {
    pub url: String,
    pub exchange: String,
}

impl Spec {
    pub fn parse(url: &str) -> Result<Spec, String> {
        let (url, ours) = super::take_query_params(url, &["exchange"]);
        let exchange = ours
            .into_iter()
            .find(|(k, _)| k == "exchange")
            .map_or_else(|| "leasectl".to_owned(), |(_, v)| v);
        Ok(Spec { url, exchange })
    }

    pub fn describe(&self) -> String {
        format!("{} exchange {}", super::redact(&self.url), self.exchange)
    }
}

pub struct Amqp {
    #[allow(dead_code)]
    spec: Spec,
    #[allow(dead_code)]
    opts: SinkOptions,
}

impl Amqp {
    pub fn new(spec: Spec, opts: SinkOptions) -> Amqp {
        Amqp { spec, opts }
    }

    pub async fn deliver(&self, _event: &Event) -> Result<(), DeliveryError> {
        Err(DeliveryError::Unavailable("the amqp sink is not built yet".into()))
    }
}
