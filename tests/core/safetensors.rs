//! Loading and saving `.safetensors` files: round trips through the `safetensors` crate
//! with every dtype, a file written by the Python package (tests/fixtures/make_fixture.py), a file
//! larger than every in-memory budget, the user's file left byte-identical by training-style
//! writes, `LoadOptions`, typed errors for bad input, and a randomized robustness test.
//!
//! Test files are written with the `safetensors` crate, or by hand (8-byte little-endian header
//! length, JSON header, data) where they must be malformed or laid out a particular way.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use common::{
    each_backend, st_dtype, tensor, used_per_tier, view_read, view_write, Backend, Rng, T,
};
use safetensors::tensor::{serialize, serialize_to_file, SafeTensors, TensorView};
use strata::{DType, Error, LoadOptions, Store, TensorId, Tier};

const KIB: u64 = 1024;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The dtype's name in a safetensors header.
fn header_dtype(d: DType) -> &'static str {
    let name = d.safetensors_name().expect("a dtype safetensors holds");
    // The crate's own name for it (its serde name) is the same.
    assert_eq!(format!("{:?}", st_dtype(d)), name);
    name
}

fn views(tensors: &[T]) -> Vec<(String, TensorView<'_>)> {
    tensors
        .iter()
        .map(|t| {
            let v = TensorView::new(st_dtype(t.dtype), t.shape.clone(), &t.data)
                .unwrap_or_else(|e| panic!("TensorView for {}: {e}", t.name));
            (t.name.clone(), v)
        })
        .collect()
}

/// Writes `tensors` with the `safetensors` crate.
fn write_st(path: &Path, tensors: &[T], metadata: Option<HashMap<String, String>>) {
    serialize_to_file(views(tensors), metadata, path).expect("serialize_to_file");
}

/// `tensors` serialized by the `safetensors` crate.
fn st_bytes(tensors: &[T]) -> Vec<u8> {
    serialize(views(tensors), None).expect("serialize")
}

/// A raw safetensors file: the header's length (8 bytes, little-endian), the header, the data.
fn raw(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// A file written by hand with the tensors laid out back to back in the given order, the header
/// padded with spaces so that the data starts at byte 4096 (page-aligned data, for the
/// `O_DIRECT` path of the disk workers).
fn page_aligned_file(tensors: &[T]) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut off = 0usize;
    let mut data = Vec::new();
    for t in tensors {
        entries.push(format!(
            "\"{}\":{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{},{}]}}",
            t.name,
            header_dtype(t.dtype),
            t.shape,
            off,
            off + t.data.len()
        ));
        off += t.data.len();
        data.extend_from_slice(&t.data);
    }
    let mut json = format!("{{{}}}", entries.join(","));
    let pad = (4096 - (8 + json.len()) % 4096) % 4096;
    json.push_str(&" ".repeat(pad));
    assert_eq!((8 + json.len()) % 4096, 0);
    raw(json.as_bytes(), &data)
}

/// Byte offset in the file of each tensor's data, as the `safetensors` crate reads it.
fn file_offsets(file: &[u8]) -> HashMap<String, (u64, u64)> {
    let st = SafeTensors::deserialize(file).expect("the crate reads the file");
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let off = v.data().as_ptr() as usize - file.as_ptr() as usize;
            (name, (off as u64, v.data().len() as u64))
        })
        .collect()
}

/// A store with these budgets (Device, Pinned, Mapped, Disk) and small staging buffers.
fn store_with(backend: Backend, caps: [u64; 4]) -> Store {
    let mut b = backend.builder();
    for t in Tier::ALL {
        b = b.capacity(t, caps[t.index()]);
    }
    b.staging(2, 64 << 10).disk_workers(2).build().expect("build store")
}

/// Room for every tensor of [`every_dtype`] in each memory tier (a host extent takes 4 KiB).
fn roomy_store(backend: Backend) -> Store {
    store_with(backend, [512 * KIB, 512 * KIB, 512 * KIB, 8 << 20])
}

fn load(store: &Store, path: &Path) -> Vec<(String, TensorId)> {
    store
        .load_safetensors(path, LoadOptions::default())
        .unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}

/// Checks that `loaded` is exactly `tensors` (names with `prefix`): dtype, shape, size and
/// bytes.
fn check_contents(store: &Store, loaded: &[(String, TensorId)], tensors: &[T], prefix: &str) {
    let by_name: HashMap<String, &T> =
        tensors.iter().map(|t| (format!("{prefix}{}", t.name), t)).collect();
    assert_eq!(loaded.len(), tensors.len(), "number of tensors loaded");
    let names: HashSet<&String> = loaded.iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), loaded.len(), "names loaded twice: {loaded:?}");
    for (name, id) in loaded {
        let t = by_name.get(name).unwrap_or_else(|| panic!("unexpected tensor {name:?}"));
        let info = store.info(*id).unwrap();
        assert_eq!(&info.name, name);
        assert_eq!(info.dtype, t.dtype, "{name}: dtype");
        assert_eq!(info.shape, t.shape, "{name}: shape");
        assert_eq!(info.bytes, t.data.len() as u64, "{name}: bytes");
        assert_eq!(store.lookup(name), Some(*id), "{name}: lookup");
        assert!(store.read(*id).unwrap() == t.data, "{name}: contents differ");
    }
}

/// Checks a file written by `save_safetensors` with the `safetensors` crate: exactly these
/// tensors, with these bytes.
fn check_saved_with_crate(path: &Path, expected: &[T]) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes)
        .unwrap_or_else(|e| panic!("the crate cannot read {}: {e}", path.display()));
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut want: Vec<String> = expected.iter().map(|t| t.name.clone()).collect();
    want.sort();
    assert_eq!(names, want, "tensors in {}", path.display());
    for t in expected {
        let v = st.tensor(&t.name).unwrap();
        assert_eq!(v.dtype(), st_dtype(t.dtype), "{}: dtype in the saved file", t.name);
        assert_eq!(v.shape(), &t.shape[..], "{}: shape in the saved file", t.name);
        assert!(v.data() == &t.data[..], "{}: bytes in the saved file differ", t.name);
    }
}

fn crc(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// Every dtype with odd shapes, a scalar among them.
fn every_dtype(rng: &mut Rng) -> Vec<T> {
    let shapes: [&[usize]; 5] = [&[], &[7], &[3, 5], &[2, 1, 3, 3], &[1, 1, 1, 1, 1]];
    let mut ts = Vec::new();
    // Every dtype safetensors holds (not the block-quantized ones).
    for d in DType::ALL.into_iter().filter(|d| d.safetensors_name().is_some()) {
        for (i, s) in shapes.iter().enumerate() {
            ts.push(tensor(&format!("{d}.{i}"), d, s, rng));
        }
    }
    ts.push(tensor("model.layers.0/self_attn.q_proj.weight", DType::BF16, &[16, 24], rng));
    ts.push(tensor("ünïcode ‹name›", DType::F32, &[5, 3], rng));
    ts
}

// ---------------------------------------------------------------------------------------------
// 1. Round trip
// ---------------------------------------------------------------------------------------------

#[test]
fn round_trip_every_dtype_in_place_through_every_tier_and_save() {
    each_backend("round_trip_every_dtype_in_place_through_every_tier_and_save", |b| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let mut rng = Rng::new(1);
        let mut ts = every_dtype(&mut rng);
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        write_st(&path, &ts, Some(meta));
        let orig = std::fs::read(&path).unwrap();
        let offsets = file_offsets(&orig);

        let store = roomy_store(b);
        let loaded = load(&store, &path);
        check_contents(&store, &loaded, &ts, "");
        // In file order, each in place: the Disk replica is the file's byte range.
        let order: Vec<u64> = loaded.iter().map(|(n, _)| offsets[n].0).collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "not in file order: {loaded:?}");
        let fresh = roomy_store(b);
        let loaded2 = load(&fresh, &path);
        for (name, id) in &loaded2 {
            assert_eq!(fresh.tier_of(*id).unwrap(), Tier::Disk, "{name}: tier after load");
            assert_eq!(fresh.info(*id).unwrap().tiers, vec![Tier::Disk], "{name}: tiers");
            assert_eq!(
                fresh.disk_location(*id).unwrap(),
                Some((path.clone(), offsets[name].0)),
                "{name}: the Disk replica is the file, in place"
            );
        }
        assert_eq!(used_per_tier(&fresh), [0; 4], "an in-place load copies nothing");
        assert_eq!(fresh.stats().tensors, ts.len());
        drop(fresh);

        // Through every tier and back.
        for tier in
            [Tier::Device, Tier::Pinned, Tier::Mapped, Tier::Disk, Tier::Device, Tier::Pinned]
        {
            for ((name, id), t) in loaded.iter().zip(by_order(&loaded, &ts)) {
                store.move_to(*id, tier).unwrap_or_else(|e| panic!("move {name} to {tier}: {e}"));
                assert_eq!(store.tier_of(*id).unwrap(), tier, "{name}");
                assert!(store.read(*id).unwrap() == t.data, "{name}: contents in {tier}");
            }
        }

        // Training-style writes: a dirty device copy (its only copy) and plain writes.
        let stream = store.stream().unwrap();
        let ids: HashMap<String, TensorId> = loaded.iter().cloned().collect();
        let mut dirty = Vec::new();
        for t in ts.iter_mut().filter(|t| t.name.ends_with(".2")) {
            let id = ids[&t.name];
            let new = tensor(&t.name, t.dtype, &t.shape, &mut rng).data;
            if t.dtype.size_of() >= 2 {
                let mut v = store.device_view(id, &stream).unwrap();
                view_write(&mut v, &new);
                drop(v);
                stream.synchronize().unwrap();
                dirty.push(id);
            } else {
                store.write(id, &new).unwrap();
            }
            t.data = new;
        }
        for &id in &dirty {
            assert_eq!(store.info(id).unwrap().tiers, vec![Tier::Device], "dirty: only on device");
        }
        store.check_err().unwrap();

        let all: Vec<TensorId> = loaded.iter().map(|(_, id)| *id).collect();
        let out = dir.path().join("saved.safetensors");
        store.save_safetensors(&out, &all).unwrap();
        check_saved_with_crate(&out, &ts);
        for &id in &dirty {
            assert_eq!(store.info(id).unwrap().tiers, vec![Tier::Device], "save moved it");
        }
        assert!(std::fs::read(&path).unwrap() == orig, "the loaded file changed");

        // The saved file loads back identically into a fresh store (in place and copied).
        let back = roomy_store(b);
        let loaded_back = load(&back, &out);
        check_contents(&back, &loaded_back, &ts, "");
        let copied = roomy_store(b);
        let opts = LoadOptions { copy_to: Some(Tier::Pinned), ..Default::default() };
        let loaded_copy = copied.load_safetensors(&out, opts).unwrap();
        check_contents(&copied, &loaded_copy, &ts, "");

        // A subset, in another order.
        let subset: Vec<TensorId> = all.iter().rev().step_by(3).copied().collect();
        let sub_path = dir.path().join("subset.safetensors");
        store.save_safetensors(&sub_path, &subset).unwrap();
        let want: Vec<T> = subset
            .iter()
            .map(|id| {
                let name = store.info(*id).unwrap().name;
                ts.iter().find(|t| t.name == name).unwrap().clone()
            })
            .collect();
        check_saved_with_crate(&sub_path, &want);

        // Saving leaves no temporary file behind.
        let mut files: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(files, ["model.safetensors", "saved.safetensors", "subset.safetensors"]);
    });
}

/// The tensors of `ts` in the order of `loaded`.
fn by_order<'a>(loaded: &[(String, TensorId)], ts: &'a [T]) -> Vec<&'a T> {
    loaded.iter().map(|(n, _)| ts.iter().find(|t| &t.name == n).expect("loaded name")).collect()
}

#[test]
fn zero_size_tensors_round_trip() {
    each_backend("zero_size_tensors_round_trip", |b| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.safetensors");
        let mut rng = Rng::new(2);
        let ts = vec![
            tensor("before", DType::F32, &[3], &mut rng),
            tensor("empty.f32", DType::F32, &[0], &mut rng),
            tensor("empty.u8", DType::U8, &[3, 0], &mut rng),
            tensor("empty.bf16", DType::BF16, &[0, 5, 2], &mut rng),
            tensor("after", DType::I16, &[2, 2], &mut rng),
        ];
        write_st(&path, &ts, None);
        let store = roomy_store(b);
        let loaded = load(&store, &path);
        // Tiers first: a read may promote the tensor.
        for (name, id) in &loaded {
            assert_eq!(store.tier_of(*id).unwrap(), Tier::Disk, "{name}");
        }
        check_contents(&store, &loaded, &ts, "");
        for tier in [Tier::Device, Tier::Pinned, Tier::Mapped, Tier::Disk] {
            for (name, id) in &loaded {
                store.move_to(*id, tier).unwrap_or_else(|e| panic!("move {name} to {tier}: {e}"));
                assert_eq!(store.tier_of(*id).unwrap(), tier, "{name}");
            }
            check_contents(&store, &loaded, &ts, "");
        }
        let out = dir.path().join("saved.safetensors");
        let ids: Vec<TensorId> = loaded.iter().map(|(_, id)| *id).collect();
        store.save_safetensors(&out, &ids).unwrap();
        check_saved_with_crate(&out, &ts);
        let back = roomy_store(b);
        let loaded_back = load(&back, &out);
        check_contents(&back, &loaded_back, &ts, "");
    });
}

#[test]
fn save_refuses_bad_requests_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let store = roomy_store(Backend::Host);
    let a = store.put("a", DType::F32, &[2], &[0; 8]).unwrap();
    let other = roomy_store(Backend::Host);
    other.put("x", DType::F32, &[1], &[0; 4]).unwrap();
    let gone = store.put("gone", DType::U8, &[1], &[1]).unwrap();
    store.remove(gone).unwrap();

    let p = dir.path().join("dup.safetensors");
    assert!(
        matches!(store.save_safetensors(&p, &[a, a]), Err(Error::DuplicateName(n)) if n == "a")
    );
    assert!(
        matches!(store.save_safetensors(&p, &[a, gone]), Err(Error::UnknownId(id)) if id == gone)
    );
    let missing_dir = dir.path().join("no/such/dir/m.safetensors");
    match store.save_safetensors(&missing_dir, &[a]) {
        Err(Error::Io { path, .. }) => assert!(path.starts_with(dir.path().join("no")), "{path:?}"),
        other => panic!("save into a missing directory: {other:?}"),
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "files left behind");

    // The name safetensors reserves for the header's metadata.
    let meta = store.put("__metadata__", DType::U8, &[1], &[0]).unwrap();
    match store.save_safetensors(dir.path().join("m.safetensors"), &[a, meta]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("__metadata__"), "{m}"),
        other => panic!("a tensor named __metadata__: {other:?}"),
    }
    store.remove(meta).unwrap();

    // Not a regular file: a directory, a FIFO (a device alike) is refused, never replaced.
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    assert!(matches!(
        store.save_safetensors(&sub, &[a]),
        Err(Error::NotAFile { what: "a directory", .. })
    ));
    let fifo = dir.path().join("fifo");
    if std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
        match store.save_safetensors(&fifo, &[a]) {
            Err(e @ Error::NotAFile { what: "a FIFO", .. }) => {
                assert!(e.to_string().contains("not a regular file"), "{e}")
            }
            other => panic!("save over a FIFO: {other:?}"),
        }
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "replaced");
        std::fs::remove_file(&fifo).unwrap();
    }
    std::fs::remove_dir(&sub).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "files left behind");

    // A symlink is followed: the file it names is replaced and the link still names it.
    let real = dir.path().join("real.safetensors");
    let link = dir.path().join("link.safetensors");
    store.save_safetensors(&real, &[]).unwrap();
    std::os::unix::fs::symlink(&real, &link).unwrap();
    store.save_safetensors(&link, &[a]).unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(load(&roomy_store(Backend::Host), &real).len(), 1, "the link's file was saved");
    std::fs::remove_file(&link).unwrap();
    std::fs::remove_file(&real).unwrap();

    // An empty list is a valid (empty) file.
    let empty = dir.path().join("empty.safetensors");
    store.save_safetensors(&empty, &[]).unwrap();
    let bytes = std::fs::read(&empty).unwrap();
    assert_eq!(SafeTensors::deserialize(&bytes).unwrap().len(), 0);
    assert!(load(&roomy_store(Backend::Host), &empty).is_empty());
}

#[test]
fn save_over_a_file_keeps_its_permissions_and_its_loaded_tensors() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    let store = roomy_store(Backend::Host);
    let a = store.put("a", DType::U8, &[4], &[1, 2, 3, 4]).unwrap();
    store.save_safetensors(&p, &[a]).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();

    // The old file stays loaded in place while a new one replaces it under its name.
    let reader = roomy_store(Backend::Host);
    let loaded = load(&reader, &p);
    let b = store.put("b", DType::U8, &[2], &[9, 9]).unwrap();
    store.save_safetensors(&p, &[b]).unwrap();
    assert_eq!(reader.read(loaded[0].1).unwrap(), [1, 2, 3, 4], "the old file's tensor");
    assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777, 0o640);
    let fresh = roomy_store(Backend::Host);
    let again = load(&fresh, &p);
    assert_eq!(again.len(), 1);
    assert_eq!(fresh.read(again[0].1).unwrap(), [9, 9]);

    // A temporary file of a save killed between its link and its rename (its process is gone:
    // no pid reaches 2^31) is removed by the next save; another file's and a live process's stay.
    let stale = dir.path().join(".model.safetensors.strata-2147483647-0.tmp");
    let live = dir.path().join(format!(".model.safetensors.strata-{}-99.tmp", std::process::id()));
    let other = dir.path().join(".other.safetensors.strata-2147483647-0.tmp");
    for f in [&stale, &live, &other] {
        std::fs::write(f, b"partial").unwrap();
    }
    store.save_safetensors(&p, &[a]).unwrap();
    assert!(!stale.exists(), "a dead save's temporary file stayed");
    assert!(live.exists() && other.exists(), "a file that is not a dead save's was removed");
}

#[test]
fn two_saves_to_one_path_at_once_each_write_a_whole_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    let store = std::sync::Arc::new(roomy_store(Backend::Host));
    // Two versions of two tensors each, saved at once under the same names.
    let versions: Vec<Vec<(TensorId, String)>> = (0..2u8)
        .map(|v| {
            ["a", "b"]
                .iter()
                .map(|n| {
                    let data = vec![v * 10 + n.len() as u8; 1 << 20];
                    let id = store.put(&format!("{v}.{n}"), DType::U8, &[1 << 20], &data).unwrap();
                    (id, n.to_string())
                })
                .collect()
        })
        .collect();
    for round in 0..30 {
        std::thread::scope(|s| {
            for v in &versions {
                let (store, p) = (store.clone(), p.clone());
                s.spawn(move || store.save_safetensors_as(&p, v).unwrap());
            }
        });
        // The file is one call's, whole: both tensors of one version.
        let bytes = std::fs::read(&p).unwrap();
        let f = SafeTensors::deserialize(&bytes).unwrap();
        let (a, b) = (f.tensor("a").unwrap().data()[0], f.tensor("b").unwrap().data()[0]);
        assert!((a, b) == (1, 1) || (a, b) == (11, 11), "round {round}: a={a} b={b}: mixed");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["model.safetensors"], "round {round}: files left behind");
    }
}

// ---------------------------------------------------------------------------------------------
// 2. A file written by the Python package
// ---------------------------------------------------------------------------------------------

fn le<I: IntoIterator<Item = B>, B: AsRef<[u8]>>(items: I) -> Vec<u8> {
    items.into_iter().flat_map(|b| b.as_ref().to_vec()).collect()
}

/// What tests/fixtures/make_fixture.py writes.
fn python_fixture_tensors() -> Vec<T> {
    let t = |name: &str, dtype, shape: &[usize], data| T {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        data,
    };
    vec![
        t("f32", DType::F32, &[3, 4], le((0..12).map(|i| (i as f32 * 0.5 - 1.0).to_le_bytes()))),
        t(
            "f16",
            DType::F16,
            &[2, 3],
            le((0..6).map(|i| half::f16::from_f32(i as f32 / 4.0).to_le_bytes())),
        ),
        t("i64", DType::I64, &[6], le((-3i64..3).map(|i| (i * 1_000_000_000_000).to_le_bytes()))),
        t("i8", DType::I8, &[2, 2, 2], le((-4i8..4).map(i8::to_le_bytes))),
        t("u8", DType::U8, &[10], (0..10).map(|i| i * 25).collect()),
        t("bool", DType::Bool, &[7], (0..7).map(|i| u8::from(i % 3 == 0)).collect()),
        t("scalar", DType::F32, &[], 3.25f32.to_le_bytes().to_vec()),
        t("u16", DType::U16, &[4], le([0u16, 1, 65535, 256].map(u16::to_le_bytes))),
        t("u32", DType::U32, &[3], le([0u32, u32::MAX, 65536].map(u32::to_le_bytes))),
        t("u64", DType::U64, &[3], le([0u64, u64::MAX, 1 << 40].map(u64::to_le_bytes))),
        // 0, 1.0, -2.0, 448 (the largest), NaN, 0.5
        t("f8_e4m3", DType::F8E4M3, &[2, 3], vec![0x00, 0x38, 0xC0, 0x7E, 0x7F, 0x30]),
        // 0, 1.0, -2.0, 57344 (the largest), +inf, NaN
        t("f8_e5m2", DType::F8E5M2, &[6], vec![0x00, 0x3C, 0xC0, 0x7B, 0x7C, 0x7E]),
    ]
}

fn fixture_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/python.safetensors")
}

#[test]
fn python_fixture_loads_with_known_values() {
    let path = fixture_path();
    let bytes = std::fs::read(&path).expect("tests/fixtures/python.safetensors (make_fixture.py)");
    assert!(bytes.len() < 8 << 10, "the fixture should stay small");
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().expect("the fixture has metadata");
    assert_eq!(meta.get("format").map(String::as_str), Some("np"));
    let expected = python_fixture_tensors();
    each_backend("python_fixture_loads_with_known_values", |b| {
        let store = roomy_store(b);
        let loaded = load(&store, &path);
        // Tiers first: a read may promote the tensor.
        for (name, id) in &loaded {
            assert_eq!(store.tier_of(*id).unwrap(), Tier::Disk, "{name}");
        }
        check_contents(&store, &loaded, &expected, "");
        for (_, id) in &loaded {
            store.move_to(*id, Tier::Device).unwrap();
        }
        check_contents(&store, &loaded, &expected, "");
        for tier in [Tier::Pinned, Tier::Device, Tier::Disk] {
            let s = roomy_store(b);
            let opts = LoadOptions {
                copy_to: Some(tier),
                name_prefix: "py.".into(),
                ..Default::default()
            };
            let loaded = s.load_safetensors(&path, opts).unwrap();
            for (name, id) in &loaded {
                assert_eq!(s.tier_of(*id).unwrap(), tier, "{name}: copy_to {tier}");
            }
            check_contents(&s, &loaded, &expected, "py.");
        }
    });
    assert!(std::fs::read(&path).unwrap() == bytes, "the fixture changed");
}

/// Runs python3 with the `safetensors` package, if there is one.
fn python(script: &str, arg: &Path) -> Option<String> {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import numpy, safetensors.numpy"])
        .output()
        .ok()?;
    if !probe.status.success() {
        return None;
    }
    let out = std::process::Command::new("python3").arg("-c").arg(script).arg(arg).output().ok()?;
    assert!(
        out.status.success(),
        "python3 failed on {}: {}",
        arg.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap())
}

#[test]
fn saved_files_load_in_python() {
    // numpy has no bfloat16 and no FP8 (tests/fp8_python checks those with torch): every other
    // dtype, the unsigned ones included.
    let mut rng = Rng::new(3);
    let mut ts: Vec<T> = every_dtype(&mut rng)
        .into_iter()
        .filter(|t| !matches!(t.dtype, DType::BF16 | DType::F8E4M3 | DType::F8E5M2))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.safetensors");
    write_st(&src, &ts, None);
    let store = roomy_store(Backend::Host);
    let loaded = load(&store, &src);
    let ids: HashMap<String, TensorId> = loaded.iter().cloned().collect();
    let stream = store.stream().unwrap();
    for (i, t) in ts.iter_mut().enumerate().filter(|(i, _)| i % 4 == 1) {
        let new = tensor(&t.name, t.dtype, &t.shape, &mut rng).data;
        if i % 8 == 1 {
            let mut v = store.device_view(ids[&t.name], &stream).unwrap();
            view_write(&mut v, &new);
        } else {
            store.write(ids[&t.name], &new).unwrap();
        }
        t.data = new;
    }
    let out = dir.path().join("for python.safetensors");
    let all: Vec<TensorId> = loaded.iter().map(|(_, id)| *id).collect();
    store.save_safetensors(&out, &all).unwrap();
    // One line per tensor: the name in hex, the numpy dtype, the shape, the bytes in hex.
    let script = "import sys\n\
                  from safetensors.numpy import load_file\n\
                  for k, v in load_file(sys.argv[1]).items():\n    \
                  print(k.encode().hex(), v.dtype, ','.join(map(str, v.shape)),\n          \
                  v.tobytes().hex())\n";
    let Some(listing) = python(script, &out) else {
        println!("SKIP saved_files_load_in_python: no python3 with safetensors and numpy");
        return;
    };
    let np = |d: DType| match d {
        DType::F64 => "float64",
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::I8 => "int8",
        DType::U64 => "uint64",
        DType::U32 => "uint32",
        DType::U16 => "uint16",
        DType::U8 => "uint8",
        DType::Bool => "bool",
        other => unreachable!("{other} is not in numpy"),
    };
    check_python_listing(listing.lines(), &ts, np);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks python's lines (the name in hex, the dtype, the shape, the bytes in hex) against
/// `ts`, each tensor under its name, its dtype as `dtype` names it.
fn check_python_listing<'a>(
    lines: impl Iterator<Item = &'a str>,
    ts: &[T],
    dtype: impl Fn(DType) -> &'static str,
) {
    let got: HashMap<String, Vec<String>> = lines
        .map(|l| {
            let f: Vec<String> = l.split(' ').map(str::to_string).collect();
            assert_eq!(f.len(), 4, "python line {l:?}");
            (f[0].clone(), f[1..].to_vec())
        })
        .collect();
    assert_eq!(got.len(), ts.len(), "python listing: {got:?}");
    for t in ts {
        let shape = t.shape.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let want = vec![dtype(t.dtype).to_string(), shape, hex(&t.data)];
        let g = got.get(&hex(t.name.as_bytes()));
        assert_eq!(g, Some(&want), "{}: what python read", t.name);
    }
}

#[test]
fn every_dtype_and_metadata_load_in_python() {
    // Python's `safetensors.deserialize` gives any dtype's bytes (bf16 and FP8 included, which
    // numpy lacks); `safe_open` gives the header's metadata.
    let mut rng = Rng::new(14);
    let ts = every_dtype(&mut rng);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.safetensors");
    write_st(&src, &ts, Some(HashMap::from([("format".into(), "pt".into())])));
    let store = roomy_store(Backend::Host);
    let opts = LoadOptions { name_prefix: "loaded.".into(), ..Default::default() };
    let mut loaded = store.load_checkpoint(&src, opts).unwrap();
    loaded.metadata_mut().insert("saved_by".into(), "strata ü".into());
    let out = dir.path().join("every dtype.safetensors");
    loaded.save(&store, &out).unwrap();
    // The metadata as JSON, then one line per tensor: the name in hex, the dtype, the shape, the
    // bytes in hex.
    let script = "import sys, json\n\
                  from safetensors import deserialize, safe_open\n\
                  with safe_open(sys.argv[1], framework='numpy') as f:\n    \
                  print(json.dumps(f.metadata(), sort_keys=True))\n\
                  for k, t in deserialize(open(sys.argv[1], 'rb').read()):\n    \
                  print(k.encode().hex(), t['dtype'], ','.join(map(str, t['shape'])),\n          \
                  bytes(t['data']).hex())\n";
    let Some(listing) = python(script, &out) else {
        println!("SKIP every_dtype_and_metadata_load_in_python: no python3 with safetensors");
        return;
    };
    let mut lines = listing.lines();
    let meta: HashMap<String, String> = serde_json::from_str(lines.next().unwrap()).unwrap();
    let want = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("saved_by".to_string(), "strata ü".to_string()),
    ]);
    assert_eq!(meta, want, "the metadata python read");
    // Saved under their names in the file: no "loaded." prefix.
    check_python_listing(lines, &ts, |d| d.safetensors_name().expect("a safetensors dtype"));
}

// ---------------------------------------------------------------------------------------------
// 3. A file larger than every in-memory budget
// ---------------------------------------------------------------------------------------------

/// 8 tensors of 256 KiB and 12 of 12 KiB: about 2.1 MiB, more than Device + Pinned + Mapped +
/// Disk budgets together.
fn large_model(rng: &mut Rng) -> Vec<T> {
    let mut ts = Vec::new();
    for i in 0..8 {
        ts.push(tensor(&format!("big.{i}"), DType::F32, &[256, 256], rng));
        if i % 2 == 0 {
            ts.push(tensor(&format!("small.{i}a"), DType::F32, &[48, 64], rng));
            ts.push(tensor(&format!("small.{i}b"), DType::BF16, &[96, 64], rng));
            ts.push(tensor(&format!("small.{i}c"), DType::U8, &[12, 1024], rng));
        }
    }
    ts
}

const SMALL_BUDGETS: [u64; 4] = [64 * KIB, 64 * KIB, 0, 512 * KIB];

fn check_large_file(b: Backend, path: &Path, ts: &[T], rng: &mut Rng) {
    let orig = std::fs::read(path).unwrap();
    let total: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
    assert!(SMALL_BUDGETS.iter().all(|&c| c < total), "the file must exceed every budget");
    let store = store_with(b, SMALL_BUDGETS);
    let loaded = load(&store, path);
    assert_eq!(used_per_tier(&store), [0; 4], "loading in place uses no budget");
    let ts = by_order(&loaded, ts);
    for (name, id) in &loaded {
        assert_eq!(store.tier_of(*id).unwrap(), Tier::Disk, "{name}");
    }
    // Reads in random order, twice.
    for _ in 0..2 {
        for _ in 0..loaded.len() {
            let i = rng.below(loaded.len() as u64) as usize;
            let (name, id) = &loaded[i];
            assert!(store.read(*id).unwrap() == ts[i].data, "{name}: bytes read");
            common::assert_budgets(&store.stats(), name);
        }
    }
    // The small tensors fit the device: prefetch them (disk workers read the user's file), then
    // view each, one at a time (the device holds five of them).
    let small: Vec<usize> =
        (0..loaded.len()).filter(|&i| loaded[i].0.starts_with("small")).collect();
    let small_ids: Vec<TensorId> = small.iter().map(|&i| loaded[i].1).collect();
    let stream = store.stream().unwrap();
    for round in 0..2 {
        // Only in the file again (dropping the copies reads promoted), so that the prefetches
        // read the file.
        for &id in &small_ids {
            store.move_to(id, Tier::Disk).unwrap();
            assert_eq!(store.info(id).unwrap().tiers, vec![Tier::Disk]);
        }
        let before = store.stats().prefetches;
        store.prefetch(&small_ids).unwrap();
        assert!(store.stats().prefetches > before, "no prefetch started (round {round})");
        for &i in &small {
            let (name, id) = &loaded[i];
            let v = store.device_view(*id, &stream).unwrap_or_else(|e| panic!("view {name}: {e}"));
            assert!(view_read(&v) == ts[i].data, "{name}: bytes on the device (round {round})");
            assert!(store.info(*id).unwrap().device_loads > round, "{name}: never loaded");
            drop(v);
            common::assert_budgets(&store.stats(), name);
        }
    }
    // Pinned and back, and read again.
    for &i in &small {
        let (name, id) = &loaded[i];
        store.move_to(*id, Tier::Pinned).unwrap();
        assert!(store.read(*id).unwrap() == ts[i].data, "{name}");
        store.move_to(*id, Tier::Disk).unwrap();
        assert_eq!(store.disk_location(*id).unwrap().map(|(p, _)| p).as_deref(), Some(path));
    }
    // The big ones can never be on the device or in Pinned: a typed error, nothing else.
    let (name, big) = loaded.iter().find(|(n, _)| n.starts_with("big")).unwrap();
    assert!(
        matches!(store.move_to(*big, Tier::Pinned), Err(Error::TooLarge { .. })),
        "{name} into Pinned"
    );
    assert!(
        matches!(store.device_view(*big, &stream), Err(Error::TooLarge { .. })),
        "{name} on the device"
    );
    for (i, (name, id)) in loaded.iter().enumerate() {
        assert!(store.read(*id).unwrap() == ts[i].data, "{name}: bytes read at the end");
    }
    store.check_err().unwrap();
    stream.synchronize().unwrap();
    drop(store);
    assert!(std::fs::read(path).unwrap() == orig, "the file changed");
}

#[test]
fn file_larger_than_every_budget_reads_in_place() {
    each_backend("file_larger_than_every_budget_reads_in_place", |b| {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng::new(4);
        let ts = large_model(&mut rng);
        let path = dir.path().join("large.safetensors");
        write_st(&path, &ts, None);
        check_large_file(b, &path, &ts, &mut rng);
    });
}

#[test]
fn page_aligned_file_larger_than_every_budget_reads_in_place() {
    each_backend("page_aligned_file_larger_than_every_budget_reads_in_place", |b| {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng::new(5);
        let ts = large_model(&mut rng);
        let path = dir.path().join("aligned.safetensors");
        let bytes = page_aligned_file(&ts);
        // Sanity: the crate reads the hand-made file, and every tensor starts on a page.
        let offsets = file_offsets(&bytes);
        assert!(offsets.values().all(|(off, _)| off % 4096 == 0), "{offsets:?}");
        std::fs::write(&path, &bytes).unwrap();
        check_large_file(b, &path, &ts, &mut rng);
    });
}

// ---------------------------------------------------------------------------------------------
// 4. The user's file is never written
// ---------------------------------------------------------------------------------------------

#[test]
fn users_file_is_byte_identical_after_training_style_writes() {
    each_backend("users_file_is_byte_identical_after_training_style_writes", |b| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weights.safetensors");
        let mut rng = Rng::new(6);
        let ts: Vec<T> = (0..16)
            .map(|i| tensor(&format!("layer{i}.w"), DType::F32, &[2048], &mut rng))
            .collect();
        write_st(&path, &ts, None);
        let orig = std::fs::read(&path).unwrap();
        let (crc0, mtime0) = (crc(&orig), std::fs::metadata(&path).unwrap().modified().unwrap());
        let offsets = file_offsets(&orig);

        // Device holds 4 of the 8 KiB tensors, Pinned 4, Mapped 2: writes force evictions.
        let store = store_with(b, [32 * KIB, 32 * KIB, 16 * KIB, 1 << 20]);
        let loaded = load(&store, &path);
        let mut want: HashMap<TensorId, Vec<u8>> = HashMap::new();
        for ((_, id), t) in loaded.iter().zip(by_order(&loaded, &ts)) {
            want.insert(*id, t.data.clone());
        }
        // Tensors 12.. are only read, viewed and moved; the others are also written.
        let untouched: HashSet<TensorId> = loaded
            .iter()
            .filter(|(n, _)| n.trim_end_matches(".w")[5..].parse::<usize>().unwrap() >= 12)
            .map(|(_, id)| *id)
            .collect();
        let mut written: HashSet<TensorId> = HashSet::new();
        assert!(untouched.len() == 4);
        let stream = store.stream().unwrap();
        for step in 0..3 {
            for (i, (n, id)) in loaded.iter().enumerate() {
                let id = *id;
                let touched = !untouched.contains(&id);
                match (i + step) % 5 {
                    0 if touched => {
                        let new = rng.bytes(8192);
                        let mut v = store.device_view(id, &stream).unwrap();
                        view_write(&mut v, &new);
                        want.insert(id, new);
                        written.insert(id);
                    }
                    1 if touched => {
                        let new = rng.bytes(8192);
                        store.write(id, &new).unwrap_or_else(|e| panic!("write {n}: {e}"));
                        want.insert(id, new);
                        written.insert(id);
                    }
                    2 => {
                        let v = store.device_view(id, &stream).unwrap();
                        assert!(view_read(&v) == want[&id], "{n}: step {step}, clean view");
                    }
                    3 => {
                        let tier = *rng.pick(&Tier::ALL);
                        store.move_to(id, tier).unwrap_or_else(|e| panic!("move {n}: {e}"));
                    }
                    _ => {
                        store.prefetch(&[id]).unwrap();
                    }
                }
                assert!(store.read(id).unwrap() == want[&id], "{n}: step {step}");
                common::assert_budgets(&store.stats(), n);
            }
            // The end of the second step: everything written so far goes down to the store's
            // disk slab, not to the file.
            for (n, id) in &loaded {
                if written.contains(id) && step == 1 {
                    store.move_to(*id, Tier::Disk).unwrap_or_else(|e| panic!("demote {n}: {e}"));
                    let loc = store.disk_location(*id).unwrap().expect("on disk");
                    assert_ne!(loc.0, path, "{n}: a written tensor's home is not the user's file");
                }
            }
        }
        stream.synchronize().unwrap();
        store.check_err().unwrap();
        assert!(store.stats().evictions > 0, "the budgets should have forced evictions");
        assert!(written.len() >= 8, "only {} tensors written", written.len());
        for (n, id) in &loaded {
            assert!(store.read(*id).unwrap() == want[id], "{n}: final contents");
            let loc = store.disk_location(*id).unwrap();
            // Never written: the file is still its home, however it moved.
            if !written.contains(id) {
                assert_eq!(
                    loc,
                    Some((path.clone(), offsets[n].0)),
                    "{n}: still read from the file"
                );
            } else {
                assert!(loc.is_none_or(|(p, _)| p != path), "{n}: written, but homed in the file");
            }
        }
        let now = std::fs::read(&path).unwrap();
        assert_eq!(crc(&now), crc0, "the user's file changed");
        assert!(now == orig, "the user's file changed");
        assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime0, "mtime changed");

        // Saving over the loaded file itself replaces it atomically (a new inode): the store
        // keeps reading the old contents of the tensors still homed in it.
        let ids: Vec<TensorId> = loaded.iter().map(|(_, id)| *id).collect();
        store.save_safetensors(&path, &ids).unwrap();
        for (n, id) in &loaded {
            assert!(store.read(*id).unwrap() == want[id], "{n}: after saving over its file");
        }
        let expected: Vec<T> = loaded
            .iter()
            .map(|(n, id)| T {
                name: n.clone(),
                dtype: DType::F32,
                shape: vec![2048],
                data: want[id].clone(),
            })
            .collect();
        check_saved_with_crate(&path, &expected);
        let back = roomy_store(b);
        let loaded_back = load(&back, &path);
        check_contents(&back, &loaded_back, &expected, "");
    });
}

// ---------------------------------------------------------------------------------------------
// 5. LoadOptions: copy_to, name_prefix, duplicates
// ---------------------------------------------------------------------------------------------

fn small_model(rng: &mut Rng) -> Vec<T> {
    vec![
        tensor("embed", DType::BF16, &[32, 16], rng),
        tensor("w0", DType::F32, &[16, 16], rng),
        tensor("b0", DType::F16, &[16], rng),
        tensor("steps", DType::I64, &[], rng),
        tensor("mask", DType::Bool, &[5, 3], rng),
        tensor("q", DType::I8, &[40], rng),
    ]
}

#[test]
fn copy_to_puts_every_tensor_in_that_tier_and_lets_go_of_the_file() {
    each_backend("copy_to_puts_every_tensor_in_that_tier_and_lets_go_of_the_file", |b| {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng::new(7);
        let ts = small_model(&mut rng);
        let total: u64 = ts.iter().map(|t| t.data.len() as u64).sum();
        for tier in [Tier::Pinned, Tier::Device, Tier::Mapped, Tier::Disk] {
            let path = dir.path().join(format!("copy_{tier}.safetensors"));
            write_st(&path, &ts, None);
            let store = roomy_store(b);
            let opts = LoadOptions { copy_to: Some(tier), ..Default::default() };
            let loaded = store.load_safetensors(&path, opts).unwrap();
            // Tiers first: a read may promote the tensor.
            for (name, id) in &loaded {
                assert_eq!(store.tier_of(*id).unwrap(), tier, "{name}: copy_to {tier}");
                assert_eq!(store.info(*id).unwrap().tiers, vec![tier], "{name}: copy_to {tier}");
                let loc = store.disk_location(*id).unwrap();
                if tier == Tier::Disk {
                    let (p, _) = loc.expect("a Disk copy");
                    assert_ne!(p, path, "{name}: copied, but still homed in the file");
                } else {
                    assert_eq!(loc, None, "{name}: copy_to {tier}");
                }
            }
            assert!(store.stats().used(tier) >= total, "{tier}: used {}", store.stats().used(tier));
            check_contents(&store, &loaded, &ts, "");
            // The store no longer needs the file: replace it with something else entirely.
            std::fs::remove_file(&path).unwrap();
            std::fs::write(&path, b"not a tensor file").unwrap();
            check_contents(&store, &loaded, &ts, "");
            for (_, id) in &loaded {
                store.move_to(*id, Tier::Disk).unwrap();
            }
            check_contents(&store, &loaded, &ts, "");
        }
    });
}

#[derive(Debug, PartialEq)]
struct Snapshot {
    ids: Vec<TensorId>,
    names: Vec<Option<TensorId>>,
    tensors: usize,
    used: [u64; 4],
}

fn snapshot(store: &Store, names: &[String]) -> Snapshot {
    Snapshot {
        ids: store.ids(),
        names: names.iter().map(|n| store.lookup(n)).collect(),
        tensors: store.stats().tensors,
        used: used_per_tier(store),
    }
}

#[test]
fn name_prefix_and_duplicate_names() {
    each_backend("name_prefix_and_duplicate_names", |b| {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng::new(8);
        let ts = small_model(&mut rng);
        let path = dir.path().join("m.safetensors");
        write_st(&path, &ts, None);
        let store = roomy_store(b);
        let mut all_names: Vec<String> = Vec::new();
        for p in ["", "a.", "b.", "c.", "z/"] {
            all_names.extend(ts.iter().map(|t| format!("{p}{}", t.name)));
        }

        let plain = load(&store, &path);
        check_contents(&store, &plain, &ts, "");
        let opts = |p: &str| LoadOptions {
            copy_to: None,
            name_prefix: p.to_string(),
            ..Default::default()
        };
        let a = store.load_safetensors(&path, opts("a.")).unwrap();
        check_contents(&store, &a, &ts, "a.");
        let pinned = LoadOptions {
            copy_to: Some(Tier::Pinned),
            name_prefix: "b.".into(),
            ..Default::default()
        };
        let bb = store.load_safetensors(&path, pinned).unwrap();
        check_contents(&store, &bb, &ts, "b.");
        assert_eq!(store.stats().tensors, 3 * ts.len());
        let c_w0 = store.put("c.w0", DType::U8, &[3], &[1, 2, 3]).unwrap();

        let before = snapshot(&store, &all_names);
        let dup = |res: strata::Result<Vec<(String, TensorId)>>, prefix: &str| match res {
            Err(Error::DuplicateName(n)) => {
                assert!(n.starts_with(prefix), "{n:?} should start with {prefix:?}");
                assert!(all_names.contains(&n), "{n:?}");
            }
            other => panic!("prefix {prefix:?}: expected DuplicateName, got {other:?}"),
        };
        dup(store.load_safetensors(&path, LoadOptions::default()), "");
        dup(store.load_safetensors(&path, opts("a.")), "a.");
        let copy_b = LoadOptions {
            copy_to: Some(Tier::Device),
            name_prefix: "b.".into(),
            ..Default::default()
        };
        dup(store.load_safetensors(&path, copy_b), "b.");
        // Only one name of the file is taken ("c.w0", by a put): still nothing is loaded.
        match store.load_safetensors(&path, opts("c.")) {
            Err(Error::DuplicateName(n)) => assert_eq!(n, "c.w0"),
            other => panic!("prefix c.: expected DuplicateName(c.w0), got {other:?}"),
        }
        assert_eq!(snapshot(&store, &all_names), before, "a refused load changed the store");
        assert_eq!(store.read(c_w0).unwrap(), vec![1, 2, 3]);

        // Other prefixes still load, and everything loaded before is intact.
        let z = store.load_safetensors(&path, opts("z/")).unwrap();
        check_contents(&store, &z, &ts, "z/");
        check_contents(&store, &plain, &ts, "");
        check_contents(&store, &a, &ts, "a.");
        check_contents(&store, &bb, &ts, "b.");
    });
}

#[test]
fn a_failed_copy_loads_nothing() {
    each_backend("a_failed_copy_loads_nothing", |b| {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng::new(9);
        // The last tensor (in file order: the largest alignment first, so put it in its own
        // file position by size) is larger than the whole Pinned budget.
        let ts = vec![
            tensor("fits.0", DType::F32, &[1024], &mut rng),
            tensor("fits.1", DType::F32, &[1024], &mut rng),
            tensor("too.big", DType::F32, &[32 * 1024], &mut rng),
        ];
        let path = dir.path().join("m.safetensors");
        write_st(&path, &ts, None);
        let store = store_with(b, [64 * KIB, 64 * KIB, 0, 1 << 20]);
        let keep = store.put("keep", DType::U8, &[4], &[9, 8, 7, 6]).unwrap();
        let names: Vec<String> = ts.iter().map(|t| t.name.clone()).collect();
        let before = snapshot(&store, &names);
        let opts = LoadOptions { copy_to: Some(Tier::Pinned), ..Default::default() };
        match store.load_safetensors(&path, opts) {
            Err(Error::OutOfMemory { .. } | Error::TooLarge { .. }) => {}
            other => panic!("copy_to Pinned of a tensor larger than Pinned: {other:?}"),
        }
        assert_eq!(snapshot(&store, &names), before, "a failed copy left something behind");
        let opts = LoadOptions { copy_to: Some(Tier::Mapped), ..Default::default() };
        match store.load_safetensors(&path, opts) {
            Err(Error::TierDisabled { tier: Tier::Mapped }) => {}
            other => panic!("copy_to a disabled tier: {other:?}"),
        }
        assert_eq!(snapshot(&store, &names), before, "a refused copy left something behind");
        assert_eq!(store.read(keep).unwrap(), vec![9, 8, 7, 6]);
        // The same file still loads in place.
        let loaded = load(&store, &path);
        check_contents(&store, &loaded, &ts, "");
    });
}

// ---------------------------------------------------------------------------------------------
// 6. Bad input: typed errors naming the file (and the tensor), never a panic
// ---------------------------------------------------------------------------------------------

/// Which tensor a `BadFile` error must name.
#[derive(Clone, Copy, Debug)]
enum Blame {
    /// Any, or none (the file as a whole is at fault).
    Any,
    /// One of these.
    OneOf(&'static [&'static str]),
}

/// Loads `bytes` written to `dir/<case>.safetensors` and checks the error; returns a description
/// of what was wrong, or `None`.
fn bad_case(store: &Store, dir: &Path, case: &str, bytes: &[u8], blame: Blame) -> Option<String> {
    let path = dir.join(format!("{case}.safetensors"));
    std::fs::write(&path, bytes).unwrap();
    let res =
        catch_unwind(AssertUnwindSafe(|| store.load_safetensors(&path, LoadOptions::default())));
    let problem = match res {
        Err(panic) => Some(format!("panicked: {}", panic_message(&panic))),
        Ok(Ok(loaded)) => {
            // Report it, and leave the store empty for the next case.
            for (_, id) in &loaded {
                let _ = store.remove(*id);
            }
            Some(format!("loaded {loaded:?}"))
        }
        Ok(Err(Error::BadFile { path: p, tensor, why })) => {
            let shown =
                Error::BadFile { path: p.clone(), tensor: tensor.clone(), why: why.clone() }
                    .to_string();
            if p != path {
                Some(format!("BadFile names {p:?}, not the file"))
            } else if !shown.contains(&path.display().to_string()) {
                Some(format!("message does not show the path: {shown}"))
            } else {
                match (blame, &tensor) {
                    (Blame::OneOf(names), Some(t)) if names.contains(&t.as_str()) => None,
                    (Blame::OneOf(names), _) => {
                        Some(format!("should name tensor {names:?}, names {tensor:?} ({shown})"))
                    }
                    (Blame::Any, _) => None,
                }
            }
        }
        Ok(Err(e)) => Some(format!("expected BadFile, got {e:?}")),
    };
    let problem = match store.stats().tensors {
        0 => problem,
        n => Some(format!("{n} tensor(s) left in the store after the error ({problem:?})")),
    };
    problem.map(|p| format!("{case}: {p}"))
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".into())
}

fn entry(name: &str, dtype: &str, shape: &str, start: u64, end: u64) -> String {
    format!(
        "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape},\"data_offsets\":[{start},{end}]}}"
    )
}

fn header(entries: &[String]) -> Vec<u8> {
    format!("{{{}}}", entries.join(",")).into_bytes()
}

#[test]
fn bad_files_are_typed_errors_naming_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let store = roomy_store(Backend::Host);
    let a = entry("a", "F32", "[2,2]", 0, 16);
    let b = entry("b", "I8", "[4]", 16, 20);
    let hdr = header(&[a.clone(), b.clone()]);
    let base = raw(&hdr, &[7u8; 20]);
    let n = hdr.len();
    // Sanity: the base file is valid.
    {
        let ok = roomy_store(Backend::Host);
        let p = dir.path().join("base.safetensors");
        std::fs::write(&p, &base).unwrap();
        assert_eq!(load(&ok, &p).len(), 2);
    }
    let with_prefix = |prefix: u64| {
        let mut v = base.clone();
        v[..8].copy_from_slice(&prefix.to_le_bytes());
        v
    };
    let one = |e: String, data: usize| raw(&header(&[e]), &vec![1u8; data]);
    let two = |e1: String, e2: String, data: usize| raw(&header(&[e1, e2]), &vec![1u8; data]);

    use Blame::{Any, OneOf};
    let mut cases: Vec<(String, Vec<u8>, Blame)> = vec![
        ("empty_file".into(), vec![], Any),
        ("cut_in_length_prefix".into(), base[..5].to_vec(), Any),
        ("only_length_prefix".into(), base[..8].to_vec(), Any),
        ("cut_in_header".into(), base[..8 + n / 2].to_vec(), Any),
        ("cut_before_data".into(), base[..8 + n].to_vec(), Any),
        ("cut_in_data".into(), base[..base.len() - 3].to_vec(), Any),
        ("trailing_bytes".into(), [&base[..], &[0u8; 5]].concat(), Any),
        ("malformed_json".into(), raw(&hdr[..hdr.len() - 1], &[7u8; 20]), Any),
        ("json_array".into(), raw(b"[1,2,3]", &[]), Any),
        ("json_string".into(), raw(b"\"hello\"", &[]), Any),
        ("json_null".into(), raw(b"null", &[]), Any),
        ("not_utf8".into(), raw(&[b'{', 0xff, 0xfe, b'}'], &[]), Any),
        ("length_prefix_past_end".into(), with_prefix(base.len() as u64 + 100), Any),
        ("length_prefix_u64_max".into(), with_prefix(u64::MAX), Any),
        ("length_prefix_over_the_limit".into(), with_prefix(100_000_001), Any),
        ("length_prefix_zero".into(), with_prefix(0), Any),
        ("length_prefix_short".into(), with_prefix(n as u64 - 1), Any),
        ("length_prefix_long".into(), with_prefix(n as u64 + 1), Any),
        ("tensor_not_object".into(), raw(b"{\"a\":5}", &[]), Any),
        ("missing_offsets".into(), raw(b"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", &[0; 4]), Any),
        ("negative_dim".into(), one(entry("a", "F32", "[-1,4]", 0, 16), 16), Any),
        ("fractional_dim".into(), one(entry("a", "F32", "[1.5]", 0, 16), 16), Any),
        (
            "metadata_not_strings".into(),
            raw(format!("{{\"__metadata__\":{{\"k\":1}},{a}}}").as_bytes(), &[0; 16]),
            Any,
        ),
        ("dtype_lowercase".into(), one(entry("a", "f32", "[4]", 0, 16), 16), Any),
        // One tensor's fault: the error names it.
        (
            "offsets_past_end".into(),
            two(entry("a", "F32", "[4]", 0, 16), entry("b", "F32", "[4]", 16, 32), 20),
            OneOf(&["b"]),
        ),
        (
            "offsets_far_past_end".into(),
            two(
                entry("a", "F32", "[4]", 0, 16),
                entry("b", "U8", "[1099511627760]", 16, 1 << 40),
                20,
            ),
            OneOf(&["b"]),
        ),
        (
            "overlapping".into(),
            two(entry("a", "F32", "[4]", 0, 16), entry("b", "F32", "[4]", 8, 24), 24),
            OneOf(&["a", "b"]),
        ),
        (
            "same_range".into(),
            two(entry("a", "F32", "[4]", 0, 16), entry("b", "F32", "[4]", 0, 16), 16),
            OneOf(&["a", "b"]),
        ),
        (
            "gap".into(),
            two(entry("a", "F32", "[4]", 0, 16), entry("b", "F32", "[4]", 20, 36), 36),
            OneOf(&["a", "b"]),
        ),
        ("reversed_offsets".into(), one(entry("a", "F32", "[4]", 16, 0), 16), OneOf(&["a"])),
        ("not_starting_at_zero".into(), one(entry("a", "F32", "[4]", 8, 24), 24), OneOf(&["a"])),
        ("shape_too_small".into(), one(entry("a", "F32", "[3]", 0, 16), 16), OneOf(&["a"])),
        ("shape_too_large".into(), one(entry("a", "F32", "[2,3]", 0, 16), 16), OneOf(&["a"])),
        (
            "shape_mismatch_second".into(),
            two(entry("a", "F32", "[4]", 0, 16), entry("b", "I16", "[3]", 16, 24), 24),
            OneOf(&["b"]),
        ),
        (
            "shape_overflows".into(),
            one(entry("a", "F32", "[4294967296,4294967296]", 0, 16), 16),
            OneOf(&["a"]),
        ),
    ];
    // Dtypes the crate knows and strata does not.
    for (dt, shape, len) in [
        ("F8_E8M0", "[16]", 16),
        ("F8_E4M3FNUZ", "[16]", 16),
        ("F8_E5M2FNUZ", "[16]", 16),
        ("C64", "[2]", 16),
        ("F4", "[32]", 16),
        ("F6_E2M3", "[8]", 6),
    ] {
        cases.push((
            format!("unsupported_dtype_{dt}"),
            two(
                entry("ok", "F32", "[4]", 0, 16),
                entry("odd", dt, shape, 16, 16 + len),
                16 + len as usize,
            ),
            OneOf(&["odd"]),
        ));
    }
    let mut problems = Vec::new();
    for (case, bytes, blame) in &cases {
        problems.extend(bad_case(&store, dir.path(), case, bytes, *blame));
    }
    // The unsupported dtype is named in the message.
    let p = dir.path().join("unsupported_dtype_F8_E8M0.safetensors");
    if let Err(e) = store.load_safetensors(&p, LoadOptions::default()) {
        if !e.to_string().contains("F8_E8M0") {
            problems.push(format!("unsupported dtype: the message does not say which: {e}"));
        }
    }
    // A dtype nobody knows: the message names it or the tensor.
    let unknown = one(entry("weird", "Q7_WHAT", "[4]", 0, 16), 16);
    problems.extend(bad_case(&store, dir.path(), "unknown_dtype", &unknown, Any));
    let p = dir.path().join("unknown_dtype.safetensors");
    if let Err(e) = store.load_safetensors(&p, LoadOptions::default()) {
        let s = e.to_string();
        if !s.contains("Q7_WHAT") && !s.contains("weird") {
            problems
                .push(format!("unknown dtype: the message names neither dtype nor tensor: {s}"));
        }
    }
    // With copy_to and a prefix, the same errors.
    let p = dir.path().join("shape_too_small.safetensors");
    let opts =
        LoadOptions { copy_to: Some(Tier::Pinned), name_prefix: "x.".into(), ..Default::default() };
    match store.load_safetensors(&p, opts) {
        Err(Error::BadFile { path, .. }) if path == p => {}
        other => problems.push(format!("shape_too_small with copy_to: {other:?}")),
    }
    assert_eq!(store.stats().tensors, 0);
    assert_eq!(used_per_tier(&store), [0; 4]);
    assert!(
        problems.is_empty(),
        "{} bad-input case(s) failed:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn offsets_summing_past_u64_max_are_a_bad_file_not_a_panic() {
    // Eight U8 tensors of 2^61 - 1 bytes each, back to back: the last ends at 2^64 - 8, so the
    // end of the data (8 + header + 2^64 - 8) overflows a u64.
    let dir = tempfile::tempdir().unwrap();
    let store = roomy_store(Backend::Host);
    let size: u64 = (1 << 61) - 1;
    let entries: Vec<String> = (0..8)
        .map(|i| entry(&format!("t{i}"), "U8", &format!("[{size}]"), i * size, (i + 1) * size))
        .collect();
    let mut problems = Vec::new();
    problems.extend(bad_case(
        &store,
        dir.path(),
        "offsets_overflow",
        &raw(&header(&entries), &[]),
        Blame::Any,
    ));
    // The same with some data after the header.
    problems.extend(bad_case(
        &store,
        dir.path(),
        "offsets_overflow_with_data",
        &raw(&header(&entries), &[0u8; 64]),
        Blame::Any,
    ));
    // The largest end offset there is.
    let last = entry("big", "U8", &format!("[{}]", u64::MAX), 0, u64::MAX);
    problems.extend(bad_case(
        &store,
        dir.path(),
        "offset_u64_max",
        &raw(&header(&[last]), &[]),
        Blame::Any,
    ));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn missing_unreadable_and_non_files_are_io_errors_with_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let store = roomy_store(Backend::Host);
    let missing = dir.path().join("missing.safetensors");
    match store.load_safetensors(&missing, LoadOptions::default()) {
        Err(e @ Error::Io { .. }) => {
            let Error::Io { path, source } = &e else { unreachable!() };
            assert_eq!(path, &missing);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            assert!(e.to_string().contains(&missing.display().to_string()), "{e}");
        }
        other => panic!("missing file: {other:?}"),
    }
    // A directory: an I/O error (or a bad file) naming it.
    let sub = dir.path().join("a_directory.safetensors");
    std::fs::create_dir(&sub).unwrap();
    match store.load_safetensors(&sub, LoadOptions::default()) {
        Err(Error::Io { path, .. } | Error::BadFile { path, .. }) => assert_eq!(path, sub),
        other => panic!("directory: {other:?}"),
    }
    // Permission denied (root reads anything: then there is nothing to test).
    let locked = dir.path().join("locked.safetensors");
    write_st(&locked, &small_model(&mut Rng::new(10)), None);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        println!("SKIP permission denied: running as root, chmod 000 does not deny reads");
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
        match store.load_safetensors(&locked, LoadOptions::default()) {
            Err(Error::Io { path, source }) => {
                assert_eq!(path, locked);
                assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied);
            }
            other => panic!("unreadable file: {other:?}"),
        }
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    assert_eq!(store.stats().tensors, 0);
    assert_eq!(used_per_tier(&store), [0; 4]);
}

// ---------------------------------------------------------------------------------------------
// 7. Randomized robustness
// ---------------------------------------------------------------------------------------------

const DTYPE_NAMES: [&str; 16] = [
    "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "F8_E4M3", "F4",
    "C64", "XX", "",
];

/// One random mutation of `v` (header region `8..8 + n` of the original); says what it did.
fn mutate(v: &mut Vec<u8>, n: usize, rng: &mut Rng) -> String {
    let hdr_end = (8 + n).min(v.len());
    let fix_prefix = |v: &mut Vec<u8>, delta: i64| {
        if v.len() >= 8 {
            let old = u64::from_le_bytes(v[..8].try_into().unwrap());
            v[..8].copy_from_slice(&(old as i64 + delta).max(0).to_le_bytes());
        }
    };
    match rng.below(14) {
        0 if hdr_end > 0 => {
            let i = rng.below(hdr_end as u64) as usize;
            let bit = rng.below(8);
            v[i] ^= 1 << bit;
            format!("flip bit {bit} of byte {i}")
        }
        1 if hdr_end > 8 => {
            let i = rng.range(8, hdr_end as u64 - 1) as usize;
            let b = *rng.pick(b"{}[]\",:0123456789-eE. ab_\\\x00\xff");
            v[i] = b;
            format!("byte {i} = {b:#04x}")
        }
        2 if hdr_end >= 8 => {
            let i = rng.range(8, hdr_end as u64) as usize;
            let k = rng.range(1, 4) as usize;
            let ins = rng.bytes(k);
            v.splice(i..i, ins.iter().copied());
            let fix = rng.chance(1, 2);
            if fix {
                fix_prefix(v, k as i64);
            }
            format!("insert {ins:?} at {i} (prefix fixed: {fix})")
        }
        3 if hdr_end > 8 => {
            let i = rng.range(8, hdr_end as u64 - 1) as usize;
            let k = (rng.range(1, 4) as usize).min(hdr_end - i);
            v.drain(i..i + k);
            let fix = rng.chance(1, 2);
            if fix {
                fix_prefix(v, -(k as i64));
            }
            format!("delete {k} at {i} (prefix fixed: {fix})")
        }
        4 => {
            let len = rng.below(v.len() as u64 + 1) as usize;
            v.truncate(len);
            format!("truncate to {len}")
        }
        5 if v.len() >= 8 => {
            let len = v.len() as u64;
            let p = match rng.below(6) {
                0 => rng.next_u64(),
                1 => rng.below(len + 16),
                2 => (n as u64).wrapping_add(rng.range(0, 8)).wrapping_sub(4),
                3 => u64::MAX - rng.below(16),
                4 => 100_000_000 + rng.below(3),
                _ => len,
            };
            v[..8].copy_from_slice(&p.to_le_bytes());
            format!("prefix = {p}")
        }
        6 | 7 if hdr_end > 8 => {
            // Tweak a number: change a digit, or make it much larger (prefix fixed).
            let digits: Vec<usize> = (8..hdr_end).filter(|&i| v[i].is_ascii_digit()).collect();
            if digits.is_empty() {
                return "no digit".into();
            }
            let i = *rng.pick(&digits);
            if rng.chance(1, 2) {
                let d = b'0' + rng.below(10) as u8;
                v[i] = d;
                format!("digit at {i} = {}", d as char)
            } else {
                let zeros = "0".repeat(rng.range(1, 19) as usize);
                v.splice(i + 1..i + 1, zeros.bytes());
                fix_prefix(v, zeros.len() as i64);
                format!("append {} zeros to the number at {i}", zeros.len())
            }
        }
        8 if hdr_end > 8 => {
            // Swap a dtype for any other name (prefix fixed).
            let Some((s, len)) = pick_value(v, hdr_end, b"\"dtype\":\"", b'"', rng) else {
                return "no dtype".into();
            };
            let new = *rng.pick(&DTYPE_NAMES);
            v.splice(s..s + len, new.bytes());
            fix_prefix(v, new.len() as i64 - len as i64);
            format!("dtype at {s} = {new:?}")
        }
        9 if hdr_end > 8 => {
            // Swap a dtype for one of the same size: the file usually stays valid.
            let Some((s, len)) = pick_value(v, hdr_end, b"\"dtype\":\"", b'"', rng) else {
                return "no dtype".into();
            };
            let old = String::from_utf8_lossy(&v[s..s + len]).into_owned();
            let Some(group) = SAME_SIZE.iter().find(|g| g.contains(&old.as_str())) else {
                return format!("dtype {old:?} left alone");
            };
            let new = *rng.pick(group);
            v.splice(s..s + len, new.bytes());
            fix_prefix(v, new.len() as i64 - len as i64);
            format!("dtype at {s}: {old} -> {new}")
        }
        10 if hdr_end > 8 => {
            // Reshape to the same number of elements (prefix fixed).
            let Some((s, len)) = pick_value(v, hdr_end, b"\"shape\":[", b']', rng) else {
                return "no shape".into();
            };
            let dims: Option<Vec<u64>> = std::str::from_utf8(&v[s..s + len])
                .ok()
                .map(|t| {
                    t.split(',').filter(|d| !d.is_empty()).map(|d| d.trim().parse().ok()).collect()
                })
                .and_then(|d: Option<Vec<u64>>| d);
            let Some(dims) = dims else { return "unparsable shape".into() };
            let p: u64 = dims.iter().product();
            let new = match rng.below(4) {
                0 => vec![p],
                1 => vec![1, p, 1],
                2 => dims.iter().rev().copied().collect(),
                _ => (1..=p).find(|d| p % d == 0 && *d > 1).map_or(vec![], |d| vec![d, p / d]),
            };
            let text = new.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
            v.splice(s..s + len, text.bytes());
            fix_prefix(v, text.len() as i64 - len as i64);
            format!("shape at {s} = [{text}]")
        }
        11 if hdr_end > 8 => {
            // Rename a tensor (prefix fixed): names may clash, be empty or be "__metadata__".
            let ends = find_all(&v[8..hdr_end], b"\":{\"");
            if ends.is_empty() {
                return "no name".into();
            }
            let e = 8 + *rng.pick(&ends);
            let Some(s) = v[8..e].iter().rposition(|&c| c == b'"').map(|i| 9 + i) else {
                return "no name start".into();
            };
            let new = *rng.pick(&["x", "", "w", "b", "__metadata__", "ü/ñ.weight", "a\\\"q", "s"]);
            v.splice(s..e, new.bytes());
            fix_prefix(v, new.len() as i64 - (e - s) as i64);
            format!("rename at {s} to {new:?}")
        }
        12 if v.len() > hdr_end => {
            let i = rng.range(hdr_end as u64, v.len() as u64 - 1) as usize;
            v[i] ^= 0xff;
            format!("flip data byte {i}")
        }
        _ => {
            let k = rng.range(1, 8) as usize;
            let tail = rng.bytes(k);
            v.extend_from_slice(&tail);
            format!("append {k} bytes")
        }
    }
}

/// Dtypes of the same size, that can replace each other in a valid file.
const SAME_SIZE: [&[&str]; 4] = [
    &["F64", "I64", "U64", "C64"],
    &["F32", "I32", "U32"],
    &["F16", "BF16", "I16", "U16"],
    &["U8", "I8", "BOOL", "F8_E4M3"],
];

/// Every position of `needle` in `hay`.
fn find_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    (0..hay.len().saturating_sub(needle.len() - 1))
        .filter(|&i| hay[i..].starts_with(needle))
        .collect()
}

/// A random value that follows `key` in `v[..end]` and runs up to `stop`: (start, length).
fn pick_value(v: &[u8], end: usize, key: &[u8], stop: u8, rng: &mut Rng) -> Option<(usize, usize)> {
    let starts: Vec<usize> =
        find_all(&v[8..end], key).into_iter().map(|i| 8 + i + key.len()).collect();
    if starts.is_empty() {
        return None;
    }
    let s = *rng.pick(&starts);
    let len = v[s..].iter().position(|&c| c == stop)?;
    Some((s, len))
}

fn escape(bytes: &[u8]) -> String {
    bytes.iter().flat_map(|&b| std::ascii::escape_default(b)).map(char::from).collect()
}

/// What the `safetensors` crate makes of a file, catching its panics: `Some(tensors)` (name,
/// dtype supported by strata, bytes) when it reads the file, `None` when it refuses it.
type CrateView = Option<Vec<(String, Option<DType>, Vec<usize>, Vec<u8>)>>;

fn crate_view(bytes: &[u8]) -> Result<CrateView, String> {
    catch_unwind(|| {
        SafeTensors::deserialize(bytes).ok().map(|st| {
            st.tensors()
                .into_iter()
                .map(|(name, v)| {
                    let d = DType::ALL.into_iter().find(|&d| st_dtype(d) == v.dtype());
                    (name, d, v.shape().to_vec(), v.data().to_vec())
                })
                .collect()
        })
    })
    .map_err(|p| panic_message(&p))
}

#[test]
fn mutated_files_never_panic() {
    let seed = common::env_seed("STRATA_SEED").unwrap_or(0x5afe_7e25);
    let variants: usize =
        std::env::var("STRATA_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(2000);
    println!("mutated_files_never_panic: seed {seed} (STRATA_SEED), {variants} variants");
    let mut rng = Rng::new(seed);
    let ts = vec![
        tensor("w", DType::F32, &[3, 4], &mut rng),
        tensor("b", DType::F16, &[5], &mut rng),
        tensor("idx", DType::I64, &[2], &mut rng),
        tensor("mask", DType::Bool, &[3], &mut rng),
        tensor("s", DType::U8, &[], &mut rng),
    ];
    let base = st_bytes(&ts);
    let n = u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    let dir = tempfile::tempdir().unwrap();
    let mut failures: Vec<String> = Vec::new();
    let (mut ok, mut refused) = (0usize, 0usize);
    for case in 0..variants {
        let mut v = base.clone();
        let ops: Vec<String> = (0..rng.range(1, 3)).map(|_| mutate(&mut v, n, &mut rng)).collect();
        let path = dir.path().join(format!("v{case}.safetensors"));
        std::fs::write(&path, &v).unwrap();
        let store = store_with(Backend::Host, [16 * KIB, 16 * KIB, 0, 1 << 20]);
        let res = catch_unwind(AssertUnwindSafe(|| {
            store.load_safetensors(&path, LoadOptions::default())
        }));
        let expected = crate_view(&v);
        let mut fail = |why: String| {
            let shown = &v[..v.len().min(8 + n + 16)];
            failures.push(format!(
                "seed {seed} case {case} ({}): {why}\n    ops: {ops:?}\n    file ({} bytes) starts: {}",
                path.display(),
                v.len(),
                escape(shown)
            ));
        };
        match res {
            Err(p) => fail(format!("load panicked: {}", panic_message(&p))),
            Ok(Err(e)) => {
                refused += 1;
                match &e {
                    Error::BadFile { path: p, .. } | Error::Io { path: p, .. } if *p == path => {}
                    Error::DuplicateName(_) => {}
                    _ => fail(format!("unexpected error {e:?}")),
                }
                // A file the crate reads, with dtypes strata supports, must load (strata also
                // refuses empty tensor names, as `put` does).
                if let Ok(Some(tensors)) = &expected {
                    if tensors.iter().all(|t| t.1.is_some() && !t.0.is_empty()) {
                        fail(format!("refused a valid file: {e}"));
                    }
                }
            }
            Ok(Ok(loaded)) => {
                ok += 1;
                let mut ranges = Vec::new();
                for (name, id) in &loaded {
                    let check = || -> Result<(u64, u64), String> {
                        let info = store.info(*id).map_err(|e| e.to_string())?;
                        let elems = info.shape.iter().product::<usize>() as u64;
                        if elems * info.dtype.size_of() as u64 != info.bytes {
                            return Err(format!(
                                "{name}: shape {:?} vs {} bytes",
                                info.shape, info.bytes
                            ));
                        }
                        let (p, off) = store
                            .disk_location(*id)
                            .map_err(|e| e.to_string())?
                            .ok_or(format!("{name}: not in place"))?;
                        if p != path || off + info.bytes > v.len() as u64 {
                            return Err(format!("{name}: at {p:?} offset {off}"));
                        }
                        let got = catch_unwind(AssertUnwindSafe(|| store.read(*id)))
                            .map_err(|p| format!("{name}: read panicked: {}", panic_message(&p)))?
                            .map_err(|e| format!("{name}: read: {e}"))?;
                        if got[..] != v[off as usize..(off + info.bytes) as usize] {
                            return Err(format!("{name}: bytes read differ from the file's range"));
                        }
                        match &expected {
                            Ok(Some(tensors)) => {
                                let t = tensors
                                    .iter()
                                    .find(|t| &t.0 == name)
                                    .ok_or(format!("{name}: the crate does not see it"))?;
                                if t.1 != Some(info.dtype) || t.2 != info.shape || t.3 != got {
                                    return Err(format!("{name}: differs from the crate's view"));
                                }
                            }
                            other => return Err(format!("loaded, but the crate says {other:?}")),
                        }
                        Ok((off, off + info.bytes))
                    };
                    match check() {
                        Ok(r) => ranges.push(r),
                        Err(why) => fail(why),
                    }
                }
                ranges.sort();
                if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
                    fail(format!("overlapping ranges {ranges:?}"));
                }
                if let Ok(Some(tensors)) = &expected {
                    if tensors.len() != loaded.len() {
                        fail(format!(
                            "{} tensors loaded, the crate sees {}",
                            loaded.len(),
                            tensors.len()
                        ));
                    }
                }
            }
        }
        drop(store);
        std::fs::remove_file(&path).unwrap();
    }
    println!(
        "mutated_files_never_panic: {ok} loaded, {refused} refused, {} failed",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {variants} mutated files failed (seed {seed}); the first ones:\n{}",
        failures.len(),
        failures.iter().take(10).cloned().collect::<Vec<_>>().join("\n")
    );
    assert!(ok >= variants / 50, "only {ok} variants loaded: the mutations do not reach deep");
}
