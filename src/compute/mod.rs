//! Compute built on the store's public API: the optimizer ([`optim`]), memory plans of a tensor
//! file ([`plan`]), GEMMs and the MLP's steps over views ([`linalg`]), verification kernels
//! ([`kernels`]), raw transfer measurements ([`probe`]) and measuring a
//! [`Machine`](crate::Machine) (`machine.rs`: an `impl` block, so its methods are the type's).
//! `lib.rs` re-exports each as `strata::optim`, `strata::plan`, ...; this module itself is
//! private, so each has one public path.

pub mod kernels;
pub mod linalg;
mod machine;
pub mod optim;
pub mod plan;
pub mod probe;
