//! Out-of-core training on strata's public API: an MLP of `--layers` bf16 `[hidden, hidden]`
//! weights in a store whose device budget holds only a few of them, trained with AdamW (fp32
//! masters and moments in the store, updated on the CPU while the backward pass goes on).
//!
//! Each layer's forward and backward runs inside a layer scope (`Store::layer(uses, next)`): the
//! store makes the layer's weight resident, prefetches the next one, and releases the weight at
//! the end of the scope, so copies overlap the GEMMs. Prints each step's loss, time and the bytes
//! that crossed to the device.
//!
//! ```text
//! cargo run --release --example out_of_core -- --layers 8 --hidden 256 --rows 64 --steps 5 \
//!     --device-budget 512KiB --host          # seconds, without a GPU
//! cargo run --release --example out_of_core -- --layers 32 --hidden 8192 --rows 2048 \
//!     --device-budget 2GiB                   # the GPU when there is one
//! ```
//! The full trainer with every option (engines, activations offloaded or recomputed, floors
//! measured in the same run) is `strata train-demo`.

use std::sync::Arc;
use std::time::Instant;

use strata::half::bf16;
use strata::linalg::{loss_value, Linalg, Matrix, LOSS_PARTIALS};
use strata::optim::{AdamW, Algorithm, Engine, Optimizer, OptimizerConfig};
use strata::{format_size, parse_size, Group, Store, Tier};

struct Args {
    layers: usize,
    hidden: usize,
    rows: usize,
    steps: usize,
    device_budget: u64,
    host: bool,
}

fn args() -> Result<Args, String> {
    let mut a =
        Args { layers: 8, hidden: 256, rows: 64, steps: 5, device_budget: 512 << 10, host: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--host" {
            a.host = true;
            continue;
        }
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let n = || v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--layers" => a.layers = n()?,
            "--hidden" => a.hidden = n()?,
            "--rows" => a.rows = n()?,
            "--steps" => a.steps = n()?,
            "--device-budget" => a.device_budget = parse_size(&v).map_err(|e| e.to_string())?,
            _ => return Err(format!("unknown flag {flag} (see the example's docs)")),
        }
    }
    if a.layers == 0 || a.hidden == 0 || a.rows == 0 {
        return Err("--layers, --hidden and --rows must be at least 1".into());
    }
    Ok(a)
}

/// A deterministic value in [-scale, scale) for element `i` of tensor `seed`.
fn value(seed: u64, i: usize, scale: f32) -> f32 {
    let mut x = (seed.wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64;
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let (h, r) = (a.hidden, a.rows);
    let mut b = Store::builder().capacity(Tier::Device, a.device_budget);
    if a.host {
        b = b.host_backend();
    }
    let store = Arc::new(b.build()?);
    println!("{}", store.backend_description());
    let scale = (1.0 / h as f32).sqrt();
    let mut weights = Vec::with_capacity(a.layers);
    for l in 0..a.layers {
        let w: Vec<bf16> = (0..h * h).map(|i| bf16::from_f32(value(l as u64, i, scale))).collect();
        let id = store.put_slice(&format!("layer{l}.weight"), &[h, h], &w)?;
        store.set_group(id, Group::Param)?;
        weights.push(id);
    }
    println!(
        "{} layers of [{h}, {h}] bf16 ({}) through a device budget of {}",
        a.layers,
        format_size(weights.len() as u64 * (h * h * 2) as u64),
        format_size(a.device_budget)
    );
    let stream = store.stream()?;
    let la = Linalg::new(&store, &stream)?;
    let adamw = Algorithm::AdamW(AdamW { lr: 1e-3, ..AdamW::default() });
    let mut opt =
        Optimizer::new(store.clone(), &stream, &weights, OptimizerConfig::new(adamw, Engine::Cpu))?;
    // Inputs and targets: fixed random rows.
    let mut x0 = la.matrix::<bf16>(r, h)?;
    let mut y = la.matrix::<bf16>(r, h)?;
    la.upload(
        &mut x0,
        &(0..r * h).map(|i| bf16::from_f32(value(1000, i, 1.0))).collect::<Vec<_>>(),
    )?;
    la.upload(
        &mut y,
        &(0..r * h).map(|i| bf16::from_f32(value(2000, i, 0.1))).collect::<Vec<_>>(),
    )?;
    for step in 0..a.steps {
        let t = Instant::now();
        let before = store.stats();
        // Forward: acts[l] is layer l's input; relu after every layer but the last.
        let mut acts = vec![x0_clone(&la, &x0)?];
        for l in 0..a.layers {
            let next: &[_] = if l + 1 < a.layers { &weights[l + 1..l + 2] } else { &[] };
            let _scope = store.layer(&weights[l..l + 1], next)?;
            let w = store.device_view(weights[l], &stream)?;
            let mut out = la.matrix::<bf16>(r, h)?;
            la.linear(&acts[l], &w, &mut out)?;
            if l + 1 < a.layers {
                la.relu(&mut out)?;
            }
            acts.push(out);
        }
        // Loss 0.5 · Σ(out − y)² / rows, and its gradient.
        let mut g = la.matrix::<bf16>(r, h)?;
        let mut partials = la.matrix::<f32>(1, LOSS_PARTIALS)?;
        la.loss_grad(&acts[a.layers], &y, 1.0 / r as f32, &mut g, &mut partials)?;
        // Backward, last layer first: each weight's gradient goes to the optimizer, whose
        // update runs on the CPU while the layers below go on.
        for l in (0..a.layers).rev() {
            let prev: &[_] = if l > 0 { &weights[l - 1..l] } else { &[] };
            let _scope = store.layer(&weights[l..l + 1], prev)?;
            if l + 1 < a.layers {
                la.relu_mask(&mut g, &acts[l + 1])?;
            }
            let mut dw = la.matrix::<bf16>(h, h)?;
            la.linear_grad_weight(&g, &acts[l], &mut dw)?;
            let mut dx = la.matrix::<bf16>(r, h)?;
            {
                let w = store.device_view(weights[l], &stream)?;
                la.linear_grad_input(&g, &w, &mut dx)?;
                let mut grad = store.device_view(opt.grad(weights[l])?, &stream)?;
                la.accumulate(&mut grad, &dw, true)?;
            }
            opt.update(weights[l])?;
            g = dx;
        }
        opt.finish()?;
        let loss = loss_value(&la.download(&partials)?, 1.0 / r as f32);
        let to_device = |s: &strata::Stats| s.moved.iter().map(|from| from[0]).sum::<u64>();
        let moved = to_device(&store.stats()) - to_device(&before);
        println!(
            "step {step}: loss {loss:.6}  {:.1} ms  {} to the device",
            t.elapsed().as_secs_f64() * 1e3,
            format_size(moved)
        );
    }
    store.check_err()?;
    Ok(())
}

/// A copy of the input rows (the first activation), so each step's forward starts fresh.
fn x0_clone(la: &Linalg, x0: &Matrix<bf16>) -> strata::Result<Matrix<bf16>> {
    let mut m = la.matrix::<bf16>(x0.rows(), x0.cols())?;
    la.upload(&mut m, &la.download(x0)?)?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    #[test]
    fn values_are_in_range_and_deterministic() {
        for i in 0..1000 {
            let v = super::value(3, i, 0.5);
            assert!((-0.5..0.5).contains(&v));
            assert_eq!(v, super::value(3, i, 0.5));
        }
    }
}
