//! Many tensors: bookkeeping that stays cheap as the count grows (checkpoints have 10k–100k
//! tensors). `examples/many_tensors.rs` runs the 200k-tensor case; this test keeps a 20k-tensor
//! one in CI.

mod common;

use std::time::{Duration, Instant};

use safetensors::tensor::{Dtype, TensorView};
use strata::{LoadOptions, Store, Tier};

#[test]
fn a_file_of_20k_tensors_loads_and_reads_through_a_small_device() {
    common::watch_deadlocks();
    const N: usize = 20_000;
    const B: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.safetensors");
    let data: Vec<u8> = (0..N * B).map(|i| (i / B) as u8 ^ (i % B) as u8).collect();
    let views: Vec<(String, TensorView<'_>)> = (0..N)
        .map(|i| {
            let v = TensorView::new(Dtype::U8, vec![B], &data[i * B..(i + 1) * B]).unwrap();
            (format!("w{i}"), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    // The device holds a tenth of them: reads promote, and promotions evict.
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, (N / 10 * 256) as u64)
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .build()
        .unwrap();
    let t = Instant::now();
    let loaded = store.load_safetensors(&path, LoadOptions::default()).unwrap();
    assert_eq!(loaded.len(), N);
    for _ in 0..2 {
        for (name, id) in &loaded {
            let i: usize = name[1..].parse().unwrap();
            assert_eq!(store.read(*id).unwrap(), data[i * B..(i + 1) * B]);
        }
    }
    let took = t.elapsed();
    let st = store.stats();
    println!("{N} tensors loaded and read twice in {took:?}\n{st}");
    assert!(st.evictions as usize >= N, "reads evicted {} tensors", st.evictions);
    // Before the victims were indexed, each eviction sorted every tensor: minutes at this size.
    assert!(took < Duration::from_secs(60), "{took:?}");
    store.check_err().unwrap();
}
