//! The bottom layer, what every layer may use: the small value types, the one error, the machine
//! model ([`Machine`](crate::Machine)), element types, block-quantized dtypes to `f32`, `Signal`
//! and the held-lock check, fault injection and the unit tests' PRNG. It imports no other layer.
//! `lib.rs` re-exports the public pieces (`strata::DType`, `strata::Error`, `strata::Machine`,
//! `strata::quant`, ...); this module itself is private, so each of them has one public path.

pub(crate) mod element;
pub(crate) mod error;
pub mod failpoint;
pub(crate) mod machine;
pub mod quant;
pub(crate) mod sync;
#[cfg(test)]
pub(crate) mod testutil;
pub(crate) mod types;
