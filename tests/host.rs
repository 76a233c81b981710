//! The store's host-backend suites (scale, large indexes, views and held locks, special files,
//! reliability, GGUF files), in one test binary: one build and one link instead of eight. Each
//! module was a test binary of its own; run one with `cargo test --test host scale::`.

mod common;

#[path = "host/gguf.rs"]
mod gguf;
#[path = "host/held.rs"]
mod held;
#[path = "host/large_index.rs"]
mod large_index;
#[path = "host/reliability.rs"]
mod reliability;
#[path = "host/scale.rs"]
mod scale;
#[path = "host/special_files.rs"]
mod special_files;
#[path = "host/view_rules.rs"]
mod view_rules;
#[path = "host/views_host.rs"]
mod views_host;
