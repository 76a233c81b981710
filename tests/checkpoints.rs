//! Safetensors checkpoints as real models ship them: sharded checkpoints loaded from their
//! `*.index.json` or their directory, bit for bit equal to the one-file checkpoint; the checks
//! of shards against their index (typed errors naming the file and the tensor, nothing loaded);
//! `__metadata__` kept from load to save and set by the caller; the FP8 and unsigned dtypes; and
//! [`strata::Loaded`], which saves in one call under the files' names (no load-time prefix).
//!
//! Checkpoints are written by the test with the `safetensors` crate, shards and index laid out
//! as Hugging Face writes them (`model-00001-of-00003.safetensors`, ...,
//! `model.safetensors.index.json`).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{each_backend, st_dtype, tensor, used_per_tier, Backend, Rng, T};
use safetensors::tensor::{serialize_to_file, SafeTensors, TensorView};
use strata::{DType, Error, LoadOptions, Loaded, Store, TensorId, Tier};

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

/// Writes `tensors` with the `safetensors` crate, with this `__metadata__`.
fn write(path: &Path, tensors: &[&T], metadata: &[(&str, &str)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            (t.name.clone(), TensorView::new(st_dtype(t.dtype), t.shape.clone(), &t.data).unwrap())
        })
        .collect();
    let meta: HashMap<String, String> =
        metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    serialize_to_file(views, (!meta.is_empty()).then_some(meta), path).unwrap();
}

/// A small model of every kind of tensor a real checkpoint holds: bf16 and f32 weights, FP8
/// weights with their f32 scales, unsigned and signed integers, a mask, a scalar, an empty one.
fn model(rng: &mut Rng) -> Vec<T> {
    let mut ts = Vec::new();
    for l in 0..3 {
        let p = format!("model.layers.{l}");
        ts.push(tensor(&format!("{p}.self_attn.q_proj.weight"), DType::BF16, &[16, 24], rng));
        ts.push(tensor(&format!("{p}.mlp.up_proj.weight"), DType::F8E4M3, &[24, 16], rng));
        ts.push(tensor(&format!("{p}.mlp.up_proj.weight_scale_inv"), DType::F32, &[3, 2], rng));
        ts.push(tensor(&format!("{p}.mlp.down_proj.weight"), DType::F8E5M2, &[16, 24], rng));
        ts.push(tensor(&format!("{p}.input_layernorm.weight"), DType::F16, &[16], rng));
    }
    ts.push(tensor("model.embed_tokens.weight", DType::BF16, &[40, 16], rng));
    ts.push(tensor("lm_head.qweight", DType::U32, &[16, 5], rng));
    ts.push(tensor("lm_head.g_idx", DType::U16, &[40], rng));
    ts.push(tensor("lm_head.offsets", DType::U64, &[3], rng));
    ts.push(tensor("position_ids", DType::I64, &[1, 7], rng));
    ts.push(tensor("mask", DType::Bool, &[2, 3], rng));
    ts.push(tensor("step", DType::I32, &[], rng));
    ts.push(tensor("empty", DType::F32, &[0, 4], rng));
    ts
}

/// The names of a file's tensors in file order, as the crate reads them.
fn file_order(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(usize, usize, String)> = st
        .iter()
        .map(|(n, t)| {
            let off = t.data().as_ptr() as usize - bytes.as_ptr() as usize;
            (off, t.data().len(), n.to_string())
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, _, n)| n).collect()
}

/// A model written as one file and as a sharded checkpoint of the same tensors.
struct Fixture {
    _dir: tempfile::TempDir,
    tensors: Vec<T>,
    /// `single/model.safetensors`, `{"format": "pt"}`.
    single: PathBuf,
    /// `sharded/`: three shards of the single file's tensors, in its order, each
    /// `{"format": "pt"}`, and `model.safetensors.index.json`.
    sharded: PathBuf,
    /// The shards, in order.
    shards: Vec<PathBuf>,
    /// `sharded/model.safetensors.index.json`.
    index: PathBuf,
    /// `shards_only/`: the same shards without the index.
    shards_only: PathBuf,
}

const SHARDS: usize = 3;

fn shard_name(i: usize) -> String {
    format!("model-{:05}-of-{SHARDS:05}.safetensors", i + 1)
}

fn fixture(seed: u64) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let tensors = model(&mut Rng::new(seed));
    let single_dir = dir.path().join("single");
    std::fs::create_dir(&single_dir).unwrap();
    let single = single_dir.join("model.safetensors");
    write(&single, &tensors.iter().collect::<Vec<_>>(), &[("format", "pt")]);
    // Shards of consecutive runs of the single file's order: their concatenation is that order
    // (the writer sorts each shard as it sorted the whole).
    let order = file_order(&single);
    let by_name: HashMap<&str, &T> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let sharded = dir.path().join("sharded");
    let shards_only = dir.path().join("shards_only");
    std::fs::create_dir(&sharded).unwrap();
    std::fs::create_dir(&shards_only).unwrap();
    let mut weight_map = serde_json::Map::new();
    let mut shards = Vec::new();
    let per = order.len().div_ceil(SHARDS);
    for (i, chunk) in order.chunks(per).enumerate() {
        let ts: Vec<&T> = chunk.iter().map(|n| by_name[n.as_str()]).collect();
        let path = sharded.join(shard_name(i));
        write(&path, &ts, &[("format", "pt")]);
        std::fs::copy(&path, shards_only.join(shard_name(i))).unwrap();
        for n in chunk {
            weight_map.insert(n.clone(), shard_name(i).into());
        }
        shards.push(path);
    }
    assert_eq!(shards.len(), SHARDS);
    let total: usize = tensors.iter().map(|t| t.data.len()).sum();
    let index = sharded.join("model.safetensors.index.json");
    let json = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(&index, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    Fixture { _dir: dir, tensors, single, sharded, shards, index, shards_only }
}

fn store(backend: Backend) -> Store {
    backend
        .builder()
        .capacity(Tier::Device, 64 << 10)
        .capacity(Tier::Pinned, 64 << 10)
        .capacity(Tier::Mapped, 64 << 10)
        .capacity(Tier::Disk, 1 << 20)
        .staging(2, 64 << 10)
        .build()
        .unwrap()
}

fn load(store: &Store, path: &Path) -> Loaded {
    store
        .load_checkpoint(path, LoadOptions::default())
        .unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}

/// `(name, dtype, shape, bytes)` of every loaded tensor, in load order, read through the store.
fn contents(store: &Store, loaded: &Loaded) -> Vec<(String, DType, Vec<usize>, Vec<u8>)> {
    loaded
        .iter()
        .map(|t| {
            let info = store.info(t.id).unwrap();
            assert_eq!(info.name, t.store_name);
            (t.name.clone(), info.dtype, info.shape, store.read(t.id).unwrap())
        })
        .collect()
}

fn pt() -> BTreeMap<String, String> {
    BTreeMap::from([("format".to_string(), "pt".to_string())])
}

// ---------------------------------------------------------------------------------------------
// 1. Sharded checkpoints, bit for bit
// ---------------------------------------------------------------------------------------------

#[test]
fn sharded_checkpoint_loads_bit_for_bit_like_the_single_file() {
    each_backend("sharded_checkpoint_loads_bit_for_bit_like_the_single_file", |b| {
        let fx = fixture(1);
        let reference = store(b);
        let single = load(&reference, &fx.single);
        let want = contents(&reference, &single);
        assert_eq!(want.len(), fx.tensors.len());
        for t in &fx.tensors {
            let got = want.iter().find(|w| w.0 == t.name).expect("every tensor loaded");
            assert_eq!((got.1, &got.2, &got.3), (t.dtype, &t.shape, &t.data), "{}", t.name);
        }
        assert_eq!(single.files().len(), 1);
        assert_eq!(single.index(), None);
        assert_eq!(single.metadata(), &pt());

        for (form, path, index) in [
            ("index", &fx.index, true),
            ("directory with its index", &fx.sharded, true),
            ("directory of shards", &fx.shards_only, false),
        ] {
            let s = store(b);
            let loaded = load(&s, path);
            assert_eq!(used_per_tier(&s), [0; 4], "{form}: an in-place load copies nothing");
            // Where each tensor lives: its byte range of its shard.
            for t in &loaded {
                let (p, _) = s.disk_location(t.id).unwrap().expect("in place");
                assert_eq!(p, loaded.files()[t.file].path, "{form}: {}", t.name);
                assert_eq!(s.tier_of(t.id).unwrap(), Tier::Disk);
            }
            assert_eq!(contents(&s, &loaded), want, "{form}: not the single file's tensors");
            let files: Vec<PathBuf> = loaded.files().iter().map(|f| f.path.clone()).collect();
            let dir = if index { &fx.sharded } else { &fx.shards_only };
            let shards: Vec<PathBuf> = (0..SHARDS).map(|i| dir.join(shard_name(i))).collect();
            assert_eq!(files, shards, "{form}: the shards, in order");
            assert_eq!(loaded.index(), index.then_some(fx.index.as_path()), "{form}");
            assert_eq!(loaded.metadata(), &pt(), "{form}");
            assert!(loaded.files().iter().all(|f| f.metadata == pt()), "{form}");
            // The pairs API gives the same.
            let s2 = store(b);
            let pairs = s2.load_safetensors(path, LoadOptions::default()).unwrap();
            let names: Vec<&str> = pairs.iter().map(|(n, _)| n.as_str()).collect();
            let want_names: Vec<&str> = want.iter().map(|w| w.0.as_str()).collect();
            assert_eq!(names, want_names, "{form}: load_safetensors");
        }

        // Copied into a tier instead, from every shard.
        let s = store(b);
        let opts = LoadOptions { copy_to: Some(Tier::Disk), ..Default::default() };
        let copied = s.load_checkpoint(&fx.index, opts).unwrap();
        for t in &copied {
            let (p, _) = s.disk_location(t.id).unwrap().expect("in the disk tier");
            assert!(!fx.shards.contains(&p), "{}: copied, but still in its shard", t.name);
        }
        assert_eq!(contents(&s, &copied), want, "copy_to disk");
    });
}

#[test]
fn loaded_finds_tensors_by_their_names_in_the_files() {
    let fx = fixture(2);
    let s = store(Backend::Host);
    let opts = LoadOptions { name_prefix: "teacher.".into(), ..Default::default() };
    let loaded = s.load_checkpoint(&fx.index, opts).unwrap();
    assert_eq!(loaded.len(), fx.tensors.len());
    assert!(!loaded.is_empty());
    for t in &fx.tensors {
        let id = loaded.get(&t.name).unwrap_or_else(|| panic!("{}", t.name));
        assert_eq!(s.lookup(&format!("teacher.{}", t.name)), Some(id));
        assert_eq!(s.read(id).unwrap(), t.data, "{}", t.name);
    }
    assert_eq!(loaded.get("teacher.mask"), None, "get takes the name in the file");
    assert_eq!(loaded.ids(), loaded.iter().map(|t| t.id).collect::<Vec<TensorId>>());
    let pairs = loaded.clone().into_pairs();
    assert!(pairs.iter().zip(&loaded).all(|((n, id), t)| *n == t.store_name && *id == t.id));
    assert!(pairs.iter().all(|(n, _)| n.starts_with("teacher.")));
}

// ---------------------------------------------------------------------------------------------
// 2. Bad checkpoints: typed errors naming the file and the tensor; nothing loaded
// ---------------------------------------------------------------------------------------------

/// What a failed load must leave: the store as it was (one tensor of the caller's, intact, in
/// the disk tier).
fn assert_untouched(s: &Store, keep: TensorId, case: &str) {
    assert_eq!(s.stats().tensors, 1, "{case}: tensors left in the store");
    assert_eq!(s.ids(), vec![keep], "{case}");
    // Only in the disk tier (a read may have promoted it): then nothing else uses memory.
    s.move_to(keep, Tier::Disk).unwrap();
    let (used, disk) = (used_per_tier(s), s.info(keep).unwrap().bytes.next_multiple_of(4096));
    assert_eq!(used, [0, 0, 0, disk], "{case}: memory left in use");
    assert_eq!(s.read(keep).unwrap(), vec![1, 2, 3], "{case}");
}

fn expect_bad(s: &Store, path: &Path, file: &Path, tensor: Option<&str>, case: &str) {
    for copy_to in [None, Some(Tier::Pinned)] {
        let opts = LoadOptions { copy_to, ..Default::default() };
        match s.load_checkpoint(path, opts) {
            Err(e @ Error::BadFile { .. }) => {
                let Error::BadFile { path: p, tensor: t, .. } = &e else { unreachable!() };
                assert_eq!(p, file, "{case}: the file named ({e})");
                assert_eq!(t.as_deref(), tensor, "{case}: the tensor named ({e})");
                let msg = e.to_string();
                assert!(msg.contains(&file.display().to_string()), "{case}: {msg}");
                println!("{case}: {msg}");
            }
            other => panic!("{case}: expected BadFile for {}, got {other:?}", file.display()),
        }
    }
}

/// Rewrites the fixture's index with `f` applied to its JSON.
fn edit_index(fx: &Fixture, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&fx.index).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&fx.index, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn bad_sharded_checkpoints_are_typed_errors_and_load_nothing() {
    let s = Arc::new(store(Backend::Host));
    let keep = s.put("keep", DType::U8, &[3], &[1, 2, 3]).unwrap();
    assert_untouched(&s, keep, "before");

    // A missing shard: an I/O error naming it, by the index and by the directory.
    let fx = fixture(3);
    std::fs::remove_file(&fx.shards[1]).unwrap();
    for path in [&fx.index, &fx.sharded] {
        match s.load_checkpoint(path, LoadOptions::default()) {
            Err(Error::Io { path: p, source }) => {
                assert_eq!(p, fx.shards[1]);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("missing shard: {other:?}"),
        }
        assert_untouched(&s, keep, "missing shard");
    }

    // A tensor of the index missing from its shard.
    let fx = fixture(4);
    edit_index(&fx, |v| {
        v["weight_map"]["model.layers.9.ghost"] = shard_name(2).into();
    });
    expect_bad(&s, &fx.index, &fx.shards[2], Some("model.layers.9.ghost"), "missing from shard");
    assert_untouched(&s, keep, "missing from shard");

    // A tensor of a shard that the index does not map.
    let fx = fixture(5);
    let victim = file_order(&fx.shards[1])[0].clone();
    edit_index(&fx, |v| {
        v["weight_map"].as_object_mut().unwrap().remove(&victim);
    });
    expect_bad(&s, &fx.index, &fx.shards[1], Some(&victim), "not in the index");
    expect_bad(&s, &fx.sharded, &fx.shards[1], Some(&victim), "not in the index (directory)");
    assert_untouched(&s, keep, "not in the index");

    // A duplicate across shards: in the directory form, the second file holding it is named; in
    // the index form, the shard the index does not map it to.
    let fx = fixture(6);
    let first = file_order(&fx.shards[0]);
    let dup = fx.tensors.iter().find(|t| t.name == first[0]).unwrap().clone();
    let shard3: Vec<T> = file_order(&fx.shards[2])
        .iter()
        .map(|n| fx.tensors.iter().find(|t| &t.name == n).unwrap().clone())
        .collect();
    let mut with_dup: Vec<&T> = shard3.iter().collect();
    with_dup.push(&dup);
    for dir in [&fx.sharded, &fx.shards_only] {
        write(&dir.join(shard_name(2)), &with_dup, &[("format", "pt")]);
    }
    let third = fx.shards_only.join(shard_name(2));
    expect_bad(&s, &fx.shards_only, &third, Some(&dup.name), "duplicate across shards (dir)");
    expect_bad(&s, &fx.index, &fx.shards[2], Some(&dup.name), "duplicate across shards (index)");
    assert_untouched(&s, keep, "duplicate");

    // A shard that is not a whole safetensors file: the shard is named.
    let fx = fixture(7);
    let bytes = std::fs::read(&fx.shards[2]).unwrap();
    // The data of its last tensor is cut: that tensor is named.
    let last = file_order(&fx.shards[2]).pop().unwrap();
    std::fs::write(&fx.shards[2], &bytes[..bytes.len() - 3]).unwrap();
    expect_bad(&s, &fx.index, &fx.shards[2], Some(&last), "truncated shard");
    assert_untouched(&s, keep, "truncated shard");

    // Indexes that are not indexes.
    let fx = fixture(8);
    for (case, text, tensor) in [
        ("bad JSON", "{\"weight_map\": {\"a\": ", None),
        ("JSON, no weight_map", "{\"metadata\": {}}", None),
        ("weight_map not an object", "{\"weight_map\": [1, 2]}", None),
        ("shard not a string", "{\"weight_map\": {\"a\": 3}}", Some("a")),
        ("shard outside", "{\"weight_map\": {\"a\": \"../single/model.safetensors\"}}", Some("a")),
        ("shard absolute", "{\"weight_map\": {\"a\": \"/etc/passwd\"}}", Some("a")),
        ("shard empty", "{\"weight_map\": {\"a\": \"\"}}", Some("a")),
    ] {
        std::fs::write(&fx.index, text).unwrap();
        expect_bad(&s, &fx.index, &fx.index, tensor, case);
        // Found in the directory: the same error.
        expect_bad(&s, &fx.sharded, &fx.index, tensor, case);
        assert_untouched(&s, keep, case);
    }

    // Directories with nothing to load, or two indexes to choose from.
    let fx = fixture(9);
    let empty = fx.sharded.parent().unwrap().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("README.md"), "no weights here").unwrap();
    expect_bad(&s, &empty, &empty, None, "no checkpoint in the directory");
    std::fs::copy(&fx.index, fx.sharded.join("model.fp16.safetensors.index.json")).unwrap();
    expect_bad(&s, &fx.sharded, &fx.sharded, None, "two indexes");
    // Naming one of them loads it.
    let loaded = s.load_checkpoint(&fx.index, LoadOptions::default()).unwrap();
    assert_eq!(loaded.len(), fx.tensors.len());
    for t in &loaded {
        s.remove(t.id).unwrap();
    }
    assert_untouched(&s, keep, "after a load and removes");

    // A name already in the store (one tensor of the third shard): nothing loaded.
    let fx = fixture(10);
    let taken = file_order(&fx.shards[2]).pop().unwrap();
    let clash = s.put(&format!("x.{taken}"), DType::U8, &[1], &[0]).unwrap();
    let opts = LoadOptions { name_prefix: "x.".into(), ..Default::default() };
    match s.load_checkpoint(&fx.index, opts) {
        Err(Error::DuplicateName(n)) => assert_eq!(n, format!("x.{taken}")),
        other => panic!("name clash: {other:?}"),
    }
    s.remove(clash).unwrap();
    assert_untouched(&s, keep, "name clash");

    // A missing path, and a file index that does not exist.
    for missing in [fx.sharded.join("nothing"), fx.sharded.join("nothing.index.json")] {
        match s.load_checkpoint(&missing, LoadOptions::default()) {
            Err(Error::Io { path, .. }) => assert_eq!(path, missing),
            other => panic!("{}: {other:?}", missing.display()),
        }
    }
    assert_untouched(&s, keep, "missing paths");
}

#[test]
fn directories_skip_hidden_files_and_follow_links() {
    let fx = fixture(11);
    // A stray hidden file (a half-written save, a macOS resource fork) is not a shard.
    std::fs::write(fx.shards_only.join("._model-00001-of-00003.safetensors"), b"junk").unwrap();
    // A Hugging Face cache links each file of a snapshot to its blob.
    let linked = fx.shards_only.parent().unwrap().join("linked");
    std::fs::create_dir(&linked).unwrap();
    for (i, shard) in fx.shards.iter().enumerate() {
        std::os::unix::fs::symlink(shard, linked.join(shard_name(i))).unwrap();
    }
    std::os::unix::fs::symlink(&fx.index, linked.join("model.safetensors.index.json")).unwrap();
    let reference = store(Backend::Host);
    let want = contents(&reference, &load(&reference, &fx.single));
    for dir in [&fx.shards_only, &linked] {
        let s = store(Backend::Host);
        assert_eq!(contents(&s, &load(&s, dir)), want, "{}", dir.display());
    }
}

// ---------------------------------------------------------------------------------------------
// 3. __metadata__ from load to save; saving without the prefix
// ---------------------------------------------------------------------------------------------

/// The tensors (name, dtype, shape, bytes) and `__metadata__` of a saved file, as the crate
/// reads it.
type FileContents = (Vec<(String, DType, Vec<usize>, Vec<u8>)>, Option<BTreeMap<String, String>>);

fn read_with_crate(path: &Path) -> FileContents {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut ts: Vec<_> = st
        .iter()
        .map(|(n, v)| {
            let d = DType::ALL.into_iter().find(|&d| st_dtype(d) == v.dtype()).unwrap();
            (n.to_string(), d, v.shape().to_vec(), v.data().to_vec())
        })
        .collect();
    ts.sort_by(|a, b| a.0.cmp(&b.0));
    let meta = header.metadata().clone().map(|m| m.into_iter().collect());
    (ts, meta)
}

fn sorted(tensors: &[T]) -> Vec<(String, DType, Vec<usize>, Vec<u8>)> {
    let mut v: Vec<_> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.data.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn load_then_save_keeps_metadata_and_the_files_names() {
    each_backend("load_then_save_keeps_metadata_and_the_files_names", |b| {
        let fx = fixture(12);
        let out_dir = tempfile::tempdir().unwrap();
        let mut tensors = fx.tensors.clone();
        for (form, path) in [("single", &fx.single), ("index", &fx.index), ("dir", &fx.sharded)] {
            let s = store(b);
            let opts = LoadOptions { name_prefix: "student.".into(), ..Default::default() };
            let loaded = s.load_checkpoint(path, opts).unwrap();
            // A training step's worth of writes: every FP8 weight and the scalar.
            let mut rng = Rng::new(99);
            for t in tensors.iter_mut().filter(|t| t.dtype == DType::F8E4M3 || t.name == "step") {
                t.data = rng.bytes(t.data.len());
                s.write(loaded.get(&t.name).unwrap(), &t.data).unwrap();
            }
            let out = out_dir.path().join(format!("{form}.safetensors"));
            loaded.save(&s, &out).unwrap();
            let (saved, meta) = read_with_crate(&out);
            assert_eq!(saved, sorted(&tensors), "{form}: the names of the files, the bytes now");
            assert_eq!(meta, Some(pt()), "{form}: __metadata__ kept");

            // The caller's metadata is written too.
            let mut m = loaded.clone();
            m.metadata_mut().insert("step".into(), "100".into());
            m.metadata_mut().insert("note".into(), "ünïcode, \"quoted\"".into());
            let out2 = out_dir.path().join(format!("{form}.meta.safetensors"));
            m.save(&s, &out2).unwrap();
            let mut want = pt();
            want.insert("step".into(), "100".into());
            want.insert("note".into(), "ünïcode, \"quoted\"".into());
            assert_eq!(read_with_crate(&out2).1, Some(want.clone()), "{form}");
            // ... and a load of that keeps it again.
            let back = store(b);
            let again = load(&back, &out2);
            assert_eq!(again.metadata(), &want, "{form}");
            assert_eq!(contents(&back, &again).len(), tensors.len());

            // Saving the ids saves under the store's names: the prefix, when asked for.
            let out3 = out_dir.path().join(format!("{form}.prefixed.safetensors"));
            s.save_safetensors(&out3, &loaded.ids()).unwrap();
            let (prefixed, meta) = read_with_crate(&out3);
            assert!(prefixed.iter().all(|t| t.0.starts_with("student.")), "{form}");
            assert_eq!(meta, None, "{form}: save_safetensors writes no metadata");
        }
    });
}

#[test]
fn save_with_metadata_and_merged_metadata_of_shards() {
    let s = store(Backend::Host);
    let dir = tempfile::tempdir().unwrap();
    let a = s.put("a", DType::U16, &[3], &[1, 0, 2, 0, 3, 0]).unwrap();
    let b = s.put("b", DType::F8E5M2, &[2], &[0x7c, 0xfc]).unwrap();
    let named = [(a, "first".to_string()), (b, "second".to_string())];
    let path = dir.path().join("m.safetensors");
    let meta = BTreeMap::from([("format".into(), "pt".into()), ("epoch".into(), "3".into())]);
    s.save_safetensors_with(&path, &named, &meta).unwrap();
    let (ts, m) = read_with_crate(&path);
    assert_eq!(m, Some(meta.clone()));
    assert_eq!(ts[0], ("first".to_string(), DType::U16, vec![3], vec![1, 0, 2, 0, 3, 0]));
    assert_eq!(ts[1], ("second".to_string(), DType::F8E5M2, vec![2], vec![0x7c, 0xfc]));
    // Empty metadata: no __metadata__ entry at all.
    s.save_safetensors_with(&path, &named, &BTreeMap::new()).unwrap();
    assert_eq!(read_with_crate(&path).1, None);
    let header = std::fs::read(&path).unwrap();
    assert!(!String::from_utf8_lossy(&header).contains("__metadata__"));

    // Shards that disagree: every key, the first shard's value; each file keeps its own.
    let sh = dir.path().join("shards");
    std::fs::create_dir(&sh).unwrap();
    let t1 = tensor("x", DType::U64, &[2], &mut Rng::new(1));
    let t2 = tensor("y", DType::U32, &[2], &mut Rng::new(2));
    write(&sh.join("a.safetensors"), &[&t1], &[("format", "pt"), ("who", "a")]);
    write(&sh.join("b.safetensors"), &[&t2], &[("format", "pt"), ("who", "b"), ("only", "b")]);
    let loaded = s.load_checkpoint(&sh, LoadOptions::default()).unwrap();
    let want: BTreeMap<String, String> =
        [("format", "pt"), ("who", "a"), ("only", "b")].map(|(k, v)| (k.into(), v.into())).into();
    assert_eq!(loaded.metadata(), &want);
    assert_eq!(loaded.files()[1].metadata["who"], "b");
    assert_eq!(loaded.files()[0].metadata.len(), 2);
}

// ---------------------------------------------------------------------------------------------
// 4. The FP8 and unsigned dtypes
// ---------------------------------------------------------------------------------------------

const NEW: [DType; 5] = [DType::F8E4M3, DType::F8E5M2, DType::U16, DType::U32, DType::U64];

#[test]
fn fp8_and_unsigned_dtypes_load_save_and_inspect() {
    each_backend("fp8_and_unsigned_dtypes_load_save_and_inspect", |b| {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng::new(13);
        // Every bit pattern of the FP8 types (NaNs and infinities included: bytes are bytes),
        // and the extremes of the unsigned ones.
        let all_bytes: Vec<u8> = (0..=255).collect();
        let mut ts = vec![
            T {
                name: "e4m3".into(),
                dtype: DType::F8E4M3,
                shape: vec![16, 16],
                data: all_bytes.clone(),
            },
            T { name: "e5m2".into(), dtype: DType::F8E5M2, shape: vec![256], data: all_bytes },
            T {
                name: "u64".into(),
                dtype: DType::U64,
                shape: vec![2],
                data: [u64::MAX.to_le_bytes(), 1u64.to_le_bytes()].concat(),
            },
            T {
                name: "u32".into(),
                dtype: DType::U32,
                shape: vec![1, 2],
                data: [u32::MAX.to_le_bytes(), 7u32.to_le_bytes()].concat(),
            },
            T {
                name: "u16".into(),
                dtype: DType::U16,
                shape: vec![],
                data: u16::MAX.to_le_bytes().to_vec(),
            },
        ];
        for d in NEW {
            ts.push(tensor(&format!("{d}.random"), d, &[3, 5], &mut rng));
        }
        let path = dir.path().join("new.safetensors");
        write(&path, &ts.iter().collect::<Vec<_>>(), &[]);

        let s = store(b);
        let loaded = load(&s, &path);
        for t in &ts {
            let id = loaded.get(&t.name).unwrap();
            let info = s.info(id).unwrap();
            assert_eq!((info.dtype, &info.shape), (t.dtype, &t.shape), "{}", t.name);
            assert_eq!(s.read(id).unwrap(), t.data, "{}", t.name);
            for tier in [Tier::Device, Tier::Pinned, Tier::Mapped, Tier::Disk] {
                s.move_to(id, tier).unwrap();
                assert_eq!(s.read(id).unwrap(), t.data, "{} in {tier}", t.name);
            }
        }
        // Saved, the crate reads them back with their dtypes; loaded again, identical.
        let out = dir.path().join("saved.safetensors");
        loaded.save(&s, &out).unwrap();
        assert_eq!(read_with_crate(&out).0, sorted(&ts));
        let back = store(b);
        let again = load(&back, &out);
        for t in &ts {
            assert_eq!(back.read(again.get(&t.name).unwrap()).unwrap(), t.data, "{}", t.name);
        }
        // Put directly, too.
        for (i, d) in NEW.into_iter().enumerate() {
            let id = s.put(&format!("put.{i}"), d, &[4], &vec![i as u8; 4 * d.size_of()]).unwrap();
            assert_eq!(s.info(id).unwrap().dtype, d);
        }

        // Inspect's reading of the header.
        let entries = strata::plan::read_tensors(&path).unwrap();
        for t in &ts {
            let e = entries.iter().find(|e| e.name == t.name).unwrap();
            assert_eq!((e.dtype, &e.shape, e.bytes), (t.dtype, &t.shape, t.data.len() as u64));
        }
        let table = strata::plan::tensor_table(&entries);
        for d in NEW {
            assert!(table.contains(&format!(" {d} ")), "{d} in\n{table}");
        }
    });
}

#[test]
fn compute_refuses_dtypes_it_does_not_run() {
    use strata::optim::{Algorithm, Engine, Optimizer, OptimizerConfig, Sgd};
    let s = Arc::new(store(Backend::Host));
    let stream = s.stream().unwrap();
    for d in [DType::F8E4M3, DType::F8E5M2, DType::U16, DType::U32, DType::U64] {
        let id = s.put(&format!("w.{d}"), d, &[4], &vec![0u8; 4 * d.size_of()]).unwrap();
        let cfg = OptimizerConfig::new(Algorithm::Sgd(Sgd::default()), Engine::Cpu);
        match Optimizer::new(s.clone(), &stream, &[id], cfg) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(&d.to_string()), "{m}"),
            Err(e) => panic!("{d}: {e:?}"),
            Ok(_) => panic!("{d}: the optimizer took it"),
        }
    }
    // `strata train-demo` refuses them too: its unit test
    // `train_demo_refuses_dtypes_it_does_not_run` (src/cli/train/tests.rs).
}

/// A load that copies shows its tensors to no one before it is done: another thread looking
/// them up meanwhile finds nothing, so a load that fails (here on its third tensor, which the
/// tier cannot hold) removes tensors nobody else holds, and memory it frees is not written
/// through a stale view.
#[test]
fn a_copying_load_shows_its_tensors_only_once_it_is_done() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let (small, big, huge) = (64 << 10, 16 << 20, 8 << 20);
    {
        let src = Store::builder().host_backend().build().unwrap();
        let a = src.put("t0", DType::U8, &[small], &vec![1u8; small]).unwrap();
        let b = src.put("t1", DType::U8, &[big], &vec![2u8; big]).unwrap();
        let c = src.put("t2", DType::U8, &[huge], &vec![3u8; huge]).unwrap();
        src.save_safetensors(&path, &[a, b, c]).unwrap();
    }
    let store = std::sync::Arc::new(
        Store::builder()
            .host_backend()
            .capacity(Tier::Device, 0)
            .capacity(Tier::Mapped, 0)
            .capacity(Tier::Pinned, (small + big) as u64 + (4 << 10))
            .capacity(Tier::Disk, 0)
            .build()
            .unwrap(),
    );
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let (s2, d2) = (store.clone(), done.clone());
    let watcher = std::thread::spawn(move || {
        let mut seen = Vec::new();
        while !d2.load(Ordering::Relaxed) {
            seen.extend(s2.lookup("t0"));
            seen.extend(s2.ids());
        }
        seen
    });
    let opts = LoadOptions { copy_to: Some(Tier::Pinned), ..LoadOptions::default() };
    let err = store.load_checkpoint(&path, opts).err();
    done.store(true, Ordering::Relaxed);
    assert!(matches!(err, Some(Error::OutOfMemory { .. } | Error::TooLarge { .. })), "{err:?}");
    assert_eq!(watcher.join().unwrap(), [], "a failing load's tensors were visible");
    assert!(store.ids().is_empty() && store.lookup("t0").is_none());
    assert_eq!(store.stats().used(Tier::Pinned), 0);
    // The names are free again, and a load that fits shows its tensors when it returns.
    let fits = Store::builder().host_backend().capacity(Tier::Pinned, 32 << 20).build().unwrap();
    let opts = LoadOptions { copy_to: Some(Tier::Pinned), ..LoadOptions::default() };
    let loaded = fits.load_checkpoint(&path, opts).unwrap();
    assert_eq!(fits.lookup("t1"), loaded.get("t1"));
    assert_eq!(fits.ids().len(), 3);
}
