//! What the `strata` binary runs, built on the store's public API (feature `cli`, on by
//! default): [`bench`] (`strata bench`), [`mlp`] (the bf16 out-of-core benchmark loop) and
//! [`train`] (the out-of-core trainer) behind `strata train-demo` and
//! `examples/out_of_core.rs`. A library user who wants the store alone turns the feature off
//! (`default-features = false`) and compiles none of this, nor its dependencies.

pub mod args;
pub mod bench;
pub mod mlp;
pub mod train;
