//! `--sink stdout`: one JSON object per line ([`Format::document`]), for pipes and tests.
//!
//! Events are buffered for the batch and written with one `write` + flush at its end; a failed
//! write (a closed pipe, a full disk) fails the whole batch, which then stays in the outbox.

use std::cell::RefCell;
use std::io::Write;

use super::{DeliveryError, Event, Format};

pub struct Stdout {
    format: Format,
    buffer: RefCell<Vec<u8>>,
}

impl Stdout {
    pub fn new(format: Format) -> Stdout {
        Stdout {
            format,
            buffer: RefCell::new(Vec::with_capacity(64 * 1024)),
        }
    }

    pub fn deliver(&self, event: &Event) -> Result<(), DeliveryError> {
        let mut buf = self.buffer.borrow_mut();
        buf.extend_from_slice(self.format.document(event).as_bytes());
        buf.push(b'\n');
        Ok(())
    }

    /// Forgets the buffered events: the batch is not to be written after all.
    pub fn discard(&self) {
        self.buffer.borrow_mut().clear();
    }

    pub fn flush(&self) -> Result<(), DeliveryError> {
        let mut buf = self.buffer.borrow_mut();
        let mut out = std::io::stdout().lock();
        let written = out.write_all(&buf).and_then(|_| out.flush());
        buf.clear();
        written.map_err(|e| DeliveryError::Unavailable(format!("cannot write to stdout: {e}")))
    }
}

impl Default for Stdout {
    fn default() -> Self {
        Self::new(Format::Json)
    }
}
