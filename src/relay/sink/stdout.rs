//! `--sink stdout`: one JSON object per line ([`Format::document`]), for pipes and tests.
//!
//! Events are buffered for the batch and written with one `write` + flush at its end; a failed
//! write (a closed pipe, a full disk) fails the whole batch, which then stays in the outbox.

use std::cell::RefCell;
use std::io::Write;

use super::{DeliveryError, Event, Format};

pub struct Stdout {
    format: Format,
    buffer: RefCell<String>,
}

impl Stdout {
    pub fn new(format: Format) -> Stdout {
        Stdout {
            format,
            buffer: RefCell::new(String::with_capacity(64 * 1024)),
        }
    }

    pub fn deliver(&self, event: &Event) -> Result<(), DeliveryError> {
        let mut buf = self.buffer.borrow_mut();
        self.format.write_document(&mut buf, event);
        buf.push('\n');
        Ok(())
    }

    /// Forgets the buffered events: the batch is not to be written after all.
    pub fn discard(&self) {
        self.buffer.borrow_mut().clear();
    }

    pub fn flush(&self) -> Result<(), DeliveryError> {
        let mut buf = self.buffer.borrow_mut();
        let mut out = std::io::stdout().lock();
        let written = out.write_all(buf.as_bytes()).and_then(|_| out.flush());
        buf.clear();
        written.map_err(|e| DeliveryError::Unavailable(format!("cannot write to stdout: {e}")))
    }
}

impl Default for Stdout {
    fn default() -> Self {
        Self::new(Format::Json)
    }
}
