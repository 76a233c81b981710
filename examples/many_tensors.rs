//! A checkpoint of many small tensors (sharded MoE checkpoints and optimizer state have 10k to
//! 100k+): writes a safetensors file of `--tensors N` tensors of `--bytes B` each, loads it into a
//! store whose device holds a tenth of them, reads every tensor twice (each read promotes, and
//! promotions evict), and prints how long each phase took.
//!
//! ```text
//! cargo run --release --example many_tensors -- --tensors 200000 [--keep FILE]
//! ```
//! `--keep FILE` writes the checkpoint to FILE and leaves it there (for `strata load FILE`).

use std::time::Instant;

use safetensors::tensor::{Dtype, TensorView};
use strata::{LoadOptions, Store, Tier};

fn arg(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a whole number")),
        None => Ok(default),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n = arg("--tensors", 200_000)?;
    let bytes = arg("--bytes", 16)?;
    let dir = tempfile::tempdir()?;
    let args: Vec<String> = std::env::args().collect();
    let path = match args.iter().position(|a| a == "--keep") {
        Some(i) => std::path::PathBuf::from(args.get(i + 1).ok_or("--keep needs a path")?),
        None => dir.path().join("many.safetensors"),
    };
    let t = Instant::now();
    let data = vec![1u8; n * bytes];
    let views: Vec<(String, TensorView<'_>)> = (0..n)
        .map(|i| {
            let v = TensorView::new(Dtype::U8, vec![bytes], &data[i * bytes..(i + 1) * bytes]);
            v.map(|v| (format!("layer{}.w{i}", i % 97), v))
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, &path)?;
    println!("wrote {n} tensors of {bytes} B in {:.2} s", t.elapsed().as_secs_f64());

    let budget = ((n / 10).max(1) * bytes.max(1).next_multiple_of(256)) as u64;
    let store = Store::builder()
        .capacity(Tier::Device, budget)
        .capacity(Tier::Pinned, budget)
        .capacity(Tier::Mapped, 0)
        .build()?;
    println!("{}", store.backend_description());
    let t = Instant::now();
    let loaded = store.load_safetensors(&path, LoadOptions::default())?;
    println!("loaded {} tensors in place in {:.2} s", loaded.len(), t.elapsed().as_secs_f64());
    for pass in 1..=2 {
        let t = Instant::now();
        for (_, id) in &loaded {
            let b = store.read(*id)?;
            assert_eq!(b.len(), bytes);
        }
        let secs = t.elapsed().as_secs_f64();
        println!(
            "read every tensor (pass {pass}) in {secs:.2} s: {:.2} µs a read",
            secs * 1e6 / n as f64
        );
    }
    let st = store.stats();
    println!("{st}");
    store.check_err()?;
    Ok(())
}
