//! The store's core suites, each on every backend there is (`common::each_backend`: the host
//! backend, and CUDA where a GPU is present), in one test binary: one build and one link instead of
//! eleven. Each module was a test binary of its own; run one with `cargo test --test core hints::`.
//! The lease runs this binary on the GPU machine with `STRATA_REQUIRE_GPU=1` (check `tests-core`).

mod common;

#[path = "core/concurrency.rs"]
mod concurrency;
#[path = "core/errors.rs"]
mod errors;
#[path = "core/groups.rs"]
mod groups;
#[path = "core/hints.rs"]
mod hints;
#[path = "core/migration.rs"]
mod migration;
#[path = "core/model.rs"]
mod model;
#[path = "core/policy.rs"]
mod policy;
#[path = "core/safetensors.rs"]
mod safetensors;
#[path = "core/schedule.rs"]
mod schedule;
#[path = "core/streams.rs"]
mod streams;
#[path = "core/typed.rs"]
mod typed;
