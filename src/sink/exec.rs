//! `--sink exec:COMMAND`: runs COMMAND once per event with the event JSON on stdin.
//! (Skeleton: to be built.)

use super::{DeliveryError, Event, SinkOptions};

#[derive(Debug, Clone)]
pub struct Spec {
    pub command: String,
}

impl Spec {
    pub fn parse(command: &str) -> Result<Spec, String> {
        if command.trim().is_empty() {
            return Err("exec: needs a command, e.g. --sink 'exec:./publish.sh'".into());
        }
        Ok(Spec {
            command: command.to_owned(),
        })
    }
}

pub struct Exec {
    #[allow(dead_code)]
    spec: Spec,
    #[allow(dead_code)]
    opts: SinkOptions,
}

impl Exec {
    pub fn new(spec: Spec, opts: SinkOptions) -> Exec {
        Exec { spec, opts }
    }

    pub async fn deliver(&self, _event: &Event) -> Result<(), DeliveryError> {
        Err(DeliveryError::Unavailable("the exec sink is not built yet".into()))
    }
}
