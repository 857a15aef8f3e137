//! The crate's vocabulary: plain types, constants and pure rules that several areas share
//! (the flags, the store, the run path, the relay). It imports nothing else of the crate, so
//! every other module may depend on it and no import cycle can pass through it.

pub mod flags;
pub mod health;
pub mod order;
pub mod slot;
pub mod time;
