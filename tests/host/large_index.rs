//! A checkpoint of 100,000 tiny tensors (a sharded one, by its index) loaded with a copy into
//! Pinned: every tensor of a few bytes used to take a 4 KiB page of its own, so the copies
//! overflowed a 64 MiB Pinned tier at 16,384 tensors, and with nowhere to put the rest the load
//! ran on for many minutes before failing with `OutOfMemory { tier: Pinned, bytes: 2 }`. Small
//! tensors now share pages, and the load takes seconds.

use std::path::Path;
use std::time::{Duration, Instant};

use strata::{LoadOptions, Store, Tier};

const TENSORS: usize = 100_000;
const SHARDS: usize = 4;

/// Writes a safetensors file of `names` (each a `[2]` u8 tensor holding its index's low bytes)
/// straight from its header: quicker than putting 100k tensors into a store to save them.
fn write_shard(path: &Path, names: &[(usize, String)]) {
    let mut header = String::from("{");
    let mut data = Vec::with_capacity(2 * names.len());
    for (k, (i, name)) in names.iter().enumerate() {
        let off = 2 * k;
        if k > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"{name}\":{{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[{off},{}]}}",
            off + 2
        ));
        data.extend_from_slice(&(*i as u16).to_le_bytes());
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_100k_tensor_index_copies_into_pinned_in_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let mut weight_map = serde_json::Map::new();
    let per = TENSORS / SHARDS;
    for s in 0..SHARDS {
        let file = format!("model-{:05}-of-{SHARDS:05}.safetensors", s + 1);
        let names: Vec<(usize, String)> =
            (s * per..(s + 1) * per).map(|i| (i, format!("t{i:06}"))).collect();
        for (_, n) in &names {
            weight_map.insert(n.clone(), file.clone().into());
        }
        write_shard(&dir.path().join(&file), &names);
    }
    let index = dir.path().join("model.safetensors.index.json");
    let json = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(&index, json.to_string()).unwrap();

    // Budgets under which the copies once needed 391 MiB of Pinned and could not spill.
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 1 << 20)
        .capacity(Tier::Pinned, 64 << 20)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 1 << 20)
        .build()
        .unwrap();
    // On a thread under a deadline: the load this guards against ran for many minutes.
    let store = std::sync::Arc::new(store);
    let (tx, rx) = std::sync::mpsc::channel();
    let (s, path) = (store.clone(), index.clone());
    let t = Instant::now();
    std::thread::spawn(move || {
        let opts = LoadOptions { copy_to: Some(Tier::Pinned), ..LoadOptions::default() };
        let _ = tx.send(s.load_checkpoint(&path, opts));
    });
    let loaded = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(r) => r.unwrap(),
        Err(_) => panic!("the load and copy of {TENSORS} tensors took over 60 s"),
    };
    let took = t.elapsed();
    println!("loaded and copied {TENSORS} tensors into Pinned in {:.2} s", took.as_secs_f64());
    assert_eq!(loaded.len(), TENSORS);
    let stats = store.stats();
    assert_eq!(stats.tiers[Tier::Pinned.index()].tensors, TENSORS, "{stats}");
    assert_eq!(stats.tiers[Tier::Pinned.index()].used, TENSORS as u64 * 64, "{stats}");
    for i in [0, 1, per, TENSORS - 1] {
        let id = loaded.get(&format!("t{i:06}")).unwrap();
        assert_eq!(store.tier_of(id).unwrap(), Tier::Pinned);
        assert_eq!(store.read(id).unwrap(), (i as u16).to_le_bytes());
    }
}
