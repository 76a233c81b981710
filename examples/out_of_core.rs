//! Out-of-core training of a bf16 MLP with cuBLAS, weights in a strata store with a device budget
//! smaller than the model (the same as `strata train-demo`).
//!
//! ```text
//! cargo run --release --example out_of_core -- --layers 32 --hidden 8192 --rows 2048 \
//!     --device-budget 1GiB --mode forward
//! cargo run --release --example out_of_core -- --layers 4 --hidden 64 --rows 8 \
//!     --device-budget 24KiB --mode train          # seconds, without a GPU
//! ```
//! Flags: `strata::mlp::USAGE`. Prints each step (time, bytes in and out of the device, stall,
//! prefetch hits and misses), the compute and PCIe floors measured in the same run, the ratio,
//! and whether the result equals the all-resident run's bit for bit.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = strata::mlp::MlpConfig::parse(&args)?;
    let report = strata::mlp::run(&cfg, |line| println!("{line}"))?;
    println!("{report}");
    if report.matches_resident == Some(false) {
        return Err("the out-of-core run differs from the all-resident run".into());
    }
    Ok(())
}
