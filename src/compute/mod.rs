//! Compute built on the store's public API: the optimizer ([`optim`]), memory plans of a tensor
//! file ([`plan`]), GEMMs and the MLP's steps over views ([`linalg`]), verification kernels
//! ([`kernels`]) and raw transfer measurements ([`probe`]). `lib.rs` re-exports each as
//! `strata::optim`, `strata::plan`, ...; this module itself is private, so each has one public
//! path.

pub mod kernels;
pub mod linalg;
pub mod optim;
pub mod plan;
pub mod probe;
