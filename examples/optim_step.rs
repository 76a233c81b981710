//! The Cpu engine's AdamW step on fp32 state against the host memory-bandwidth bound, measured
//! in one run: the bytes the step must read and write (28 per parameter with f32 parameters and
//! gradients: parameter, gradient and both moments read, parameter and moments written) over
//! the bandwidth of a multi-threaded copy of the same size class, measured by this binary.
//!
//! ```text
//! cargo run --release --example optim_step -- --params 100000000 --threads 16 --steps 10
//! cargo run --release --example optim_step -- --params 100000000 --dtype bf16   # mixed precision
//! ```
//! `--dtype bf16`: bf16 gradients in, fp32 master weights and moments updated, bf16 compute copy
//! out (the same 28 bytes per parameter). Prints one line per step and a JSON summary.

use std::time::Instant;

use half::bf16;
use strata::optim::{
    cpu_update, host_copy_bandwidth, host_update_bandwidth, update_bytes, AdamW, Algorithm,
    GradSlice,
};
use strata::probe::median;
use strata::DType;

/// A count of at least `min`.
fn at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |s| match s.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        Ok(n) => Err(format!("{n} is below {min}")),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

/// The parameters' and gradients' dtype.
#[derive(Clone, Copy, clap::ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
}

/// The Cpu engine's AdamW step against the host memory-bandwidth bound.
#[derive(clap::Parser)]
struct Args {
    /// Parameters updated per step.
    #[arg(long, default_value = "100000000", value_parser = at_least(1), allow_negative_numbers = true)]
    params: usize,
    /// Threads of the step; 0: every core.
    #[arg(long, default_value = "0", value_parser = at_least(0), allow_negative_numbers = true)]
    threads: usize,
    /// Steps; the first is a warm-up (at least 2).
    #[arg(long, default_value = "10", value_parser = clap::value_parser!(u64).range(2..), allow_negative_numbers = true)]
    steps: u64,
    /// f32: fp32 parameters and gradients; bf16: bf16 gradients in, fp32 master weights and
    /// moments, a bf16 compute copy out.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = <Args as clap::Parser>::parse();
    let (params, threads, steps, dtype) = (
        a.params,
        a.threads,
        a.steps as usize,
        match a.dtype {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
        },
    );
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let alg = Algorithm::AdamW(AdamW::default());
    let bytes = update_bytes(&alg, params as u64, dtype, dtype);
    println!(
        "AdamW on {params} parameters ({dtype} parameters and gradients, fp32 state), {threads} threads: {} bytes per step",
        bytes
    );
    let copy_bw = host_copy_bandwidth(threads, params * 4)?;
    let rmw_bw = host_update_bandwidth(threads, params * 4);
    println!(
        "host in-place update bandwidth ({} MB, {threads} threads): {:.2} GB/s (read + write)",
        params * 4 / 1_000_000,
        rmw_bw / 1e9
    );
    println!(
        "host copy bandwidth ({} MB, {threads} threads): {:.2} GB/s (read + write)",
        params * 4 / 1_000_000,
        copy_bw / 1e9
    );

    let mut p: Vec<f32> = (0..params).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let mut m = vec![0f32; params];
    let mut v = vec![0f32; params];
    let g32: Vec<f32> = (0..params).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
    let g16: Vec<bf16> = if dtype == DType::BF16 {
        g32.iter().map(|&x| bf16::from_f32(x)).collect()
    } else {
        Vec::new()
    };
    let mut out: Vec<bf16> =
        if dtype == DType::BF16 { vec![bf16::ZERO; params] } else { Vec::new() };
    let mut times = Vec::new();
    for t in 1..=steps as u64 {
        let g = if dtype == DType::BF16 { GradSlice::Bf16(&g16) } else { GradSlice::F32(&g32) };
        let o = if dtype == DType::BF16 { Some(&mut out[..]) } else { None };
        let start = Instant::now();
        cpu_update(&alg, t, threads, &mut p, &mut m, &mut v, g, o)?;
        let s = start.elapsed().as_secs_f64();
        println!("step {t:>3}: {:>8.2} ms  {:>6.2} GB/s", s * 1e3, bytes as f64 / s / 1e9);
        if t > 1 {
            times.push(s);
        }
    }
    std::hint::black_box((&p, &out));
    let step = median(&times);
    let bound = bytes as f64 / copy_bw;
    let rmw_bound = bytes as f64 / rmw_bw;
    println!(
        "median step {:.2} ms = {:.2} GB/s; copy bound {:.2} ms (fraction {:.3}); in-place update bound {:.2} ms (fraction {:.3})",
        step * 1e3,
        bytes as f64 / step / 1e9,
        bound * 1e3,
        bound / step,
        rmw_bound * 1e3,
        rmw_bound / step
    );
    println!(
        "{{\"bench\":\"strata-cpu-adamw\",\"params\":{params},\"threads\":{threads},\"dtype\":\"{dtype}\",\"bytes\":{bytes},\"copy_gbps\":{:.3},\"step_s\":{step:.6},\"bound_s\":{bound:.6},\"fraction_of_bound\":{:.4},\"update_gbps\":{:.3},\"fraction_of_update_bound\":{:.4}}}",
        copy_bw / 1e9,
        bound / step,
        rmw_bw / 1e9,
        rmw_bound / step
    );
    Ok(())
}
