//! Out-of-core inference and training of an MLP whose weights, gradients, optimizer state and
//! activations live in a strata store with a device budget smaller than the model (the same as
//! `strata train-demo`).
//!
//! ```text
//! # training (strata::apps::train): relu MLP, squared-error loss, AdamW with fp32 state in the store
//! cargo run --release --example out_of_core -- --mode train --layers 32 --hidden 8192 \
//!     --rows 2048 --dtype bf16 --optimizer adamw --device-budget 8GiB --engine all
//! cargo run --release --example out_of_core -- --mode train --layers 4 --hidden 64 --rows 8 \
//!     --device-budget 64KiB --activations offload --host     # seconds, without a GPU
//! # the forward benchmark (strata::apps::mlp), and its device-SGD training loop
//! cargo run --release --example out_of_core -- --layers 32 --hidden 8192 --rows 2048 \
//!     --device-budget 1GiB --mode forward
//! cargo run --release --example out_of_core -- --mode train --optimizer device-sgd \
//!     --layers 4 --hidden 64 --rows 8 --device-budget 24KiB
//! ```
//! Flags: `--help` (`strata::apps::args::TrainDemoArgs`). Each step prints its time, loss,
//! bytes in and out of the device and stall; the end prints memory per group (predicted,
//! held, peak on the device), the floors measured in the same run and the ratio.

use clap::Parser;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    match run() {
        // stdout's reader went away (`| head`): nothing is wrong.
        Err(e) if strata::apps::is_broken_pipe(&*e) => Ok(()),
        r => r,
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = strata::apps::args::TrainDemoCommand::parse().args;
    let outcome = strata::apps::train::dispatch(&args, strata::apps::println)?;
    strata::apps::println(&outcome.to_string())?;
    if let strata::apps::train::Outcome::Mlp(r) = &outcome {
        if r.matches_resident == Some(false) {
            return Err("the out-of-core run differs from the all-resident run".into());
        }
    }
    Ok(())
}
