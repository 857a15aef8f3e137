//! `--sink http(s)://…`: a webhook. (Skeleton: to be built.)

use super::{DeliveryError, Event, SinkOptions};

#[derive(Debug, Clone)]
pub struct Spec {
    pub url: String,
}

impl Spec {
    pub fn parse(url: &str) -> Result<Spec, String> {
        Ok(Spec { url: url.to_owned() })
    }
}

pub struct Http {
    #[allow(dead_code)]
    spec: Spec,
    #[allow(dead_code)]
    opts: SinkOptions,
}

impl Http {
    pub fn new(spec: Spec, opts: SinkOptions) -> anyhow::Result<Http> {
        Ok(Http { spec, opts })
    }

    pub async fn deliver(&self, _event: &Event) -> Result<(), DeliveryError> {
        Err(DeliveryError::Unavailable("the http sink is not built yet".into()))
    }
}
