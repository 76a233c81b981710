//! GGUF files and block-quantized tensors: every quantized type dequantized bit for bit as the
//! `gguf` Python package does it (on `tests/fixtures/quants.gguf`, which that package wrote:
//! `tests/fixtures/gen_quants.py`), every metadata value type read, a GGUF file loaded in place
//! and its quantized tensors moved through the tiers as their bytes, and bad files (truncated,
//! huge counts and offsets, unknown types, tensors past the end, metadata of the wrong kind)
//! refused with an error naming what is wrong, nothing left in the store.

use std::path::{Path, PathBuf};

use strata::{quant, DType, Error, Gguf, GgufValue, LoadOptions, Store, Tier};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quants.gguf")
}

const QUANTIZED: [(&str, DType); 10] = [
    ("Q4_0", DType::Q4_0),
    ("Q4_1", DType::Q4_1),
    ("Q5_0", DType::Q5_0),
    ("Q5_1", DType::Q5_1),
    ("Q8_0", DType::Q8_0),
    ("Q2_K", DType::Q2K),
    ("Q3_K", DType::Q3K),
    ("Q4_K", DType::Q4K),
    ("Q5_K", DType::Q5K),
    ("Q6_K", DType::Q6K),
];

#[test]
fn every_type_dequantizes_bit_for_bit_as_the_gguf_package() {
    let f = Gguf::open(fixture()).unwrap();
    for (name, dtype) in QUANTIZED.into_iter().chain([("F16", DType::F16)]) {
        let t = f.tensor(name).unwrap_or_else(|| panic!("{name} in the fixture"));
        assert_eq!(t.dtype, dtype, "{name}");
        let r = f.tensor(&format!("{name}.f32")).unwrap();
        assert_eq!(r.shape, t.shape, "{name}");
        let got = quant::dequantize(t.dtype, f.bytes(t)).unwrap();
        let want = quant::dequantize(DType::F32, f.bytes(r)).unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{name}: {differ} of {} values differ", want.len());
        // Not a fixture of zeros: the values vary.
        assert!(want.iter().filter(|v| **v != 0.0).count() > want.len() / 2, "{name}");
    }
}

#[test]
fn metadata_of_every_value_type_reads() {
    let f = Gguf::open(fixture()).unwrap();
    let g = |k: &str| f.get(k).unwrap_or_else(|| panic!("{k}")).clone();
    assert_eq!(f.version(), 3);
    assert_eq!(g("test.u8"), GgufValue::U8(200));
    assert_eq!(g("test.i8"), GgufValue::I8(-100));
    assert_eq!(g("test.u16"), GgufValue::U16(60000));
    assert_eq!(g("test.i16"), GgufValue::I16(-30000));
    assert_eq!(g("test.u32"), GgufValue::U32(4_000_000_000));
    assert_eq!(g("test.i32"), GgufValue::I32(-2_000_000_000));
    assert_eq!(g("test.f32"), GgufValue::F32(0.15625));
    assert_eq!(g("test.bool"), GgufValue::Bool(true));
    assert_eq!(g("test.string").as_str(), Some("héllo"));
    assert_eq!(g("test.u64"), GgufValue::U64((1 << 63) + 5));
    assert_eq!(g("test.i64"), GgufValue::I64(-(1 << 62)));
    assert_eq!(g("test.f64"), GgufValue::F64(-2.5e-300));
    let ints: Vec<i32> = match g("test.array.i32") {
        GgufValue::Array(v) => {
            v.iter().map(|x| if let GgufValue::I32(i) = x { *i } else { 0 }).collect()
        }
        v => panic!("{v:?}"),
    };
    assert_eq!(ints, [1, -2, 3]);
    let strs: Vec<&str> = f
        .get("test.array.string")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(strs, ["a", "", "ccc"]);
    assert_eq!(g("general.architecture").as_str(), Some("llama"));
}

#[test]
fn a_gguf_file_loads_in_place_and_its_quantized_tensors_move_as_bytes() {
    let f = Gguf::open(fixture()).unwrap();
    let store = Store::builder().host_backend().capacity(Tier::Device, 1 << 20).build().unwrap();
    let opts = LoadOptions { name_prefix: "m.".into(), ..LoadOptions::default() };
    let loaded = store.load_checkpoint(fixture(), opts).unwrap();
    assert_eq!(loaded.len(), f.tensors().len());
    assert_eq!(loaded.files()[0].metadata.get("test.i8").map(String::as_str), Some("-100"));
    assert!(!loaded.files()[0].metadata.contains_key("test.array.i32"));
    for (name, dtype) in QUANTIZED {
        let t = f.tensor(name).unwrap();
        let id = loaded.get(name).unwrap();
        let info = store.info(id).unwrap();
        assert_eq!((info.dtype, &info.shape, info.bytes), (dtype, &t.shape, t.bytes), "{name}");
        assert_eq!(info.bytes, dtype.bytes_for(&t.shape).unwrap());
        assert_eq!(store.tier_of(id).unwrap(), Tier::Disk, "{name}: in place");
        assert_eq!(store.read(id).unwrap(), f.bytes(t), "{name}");
        for tier in [Tier::Device, Tier::Pinned, Tier::Disk] {
            store.move_to(id, tier).unwrap();
            assert_eq!(store.read(id).unwrap(), f.bytes(t), "{name} in {tier}");
        }
    }
    // Safetensors cannot hold a quantized tensor: refused by its name and dtype.
    let q = loaded.get("Q4_K").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let e = store.save_safetensors(dir.path().join("x.safetensors"), &[q]).unwrap_err();
    assert!(e.to_string().contains("m.Q4_K") && e.to_string().contains("q4_k"), "{e}");
    assert!(!dir.path().join("x.safetensors").exists());
    // A put of quantized bytes is sized by its blocks.
    let bytes = f.bytes(f.tensor("Q8_0").unwrap()).to_vec();
    let e = store.put("bad", DType::Q8_0, &[4, 250], &bytes).unwrap_err();
    assert!(matches!(e, Error::BadShape { .. }), "{e}");
    let id = store.put("q", DType::Q8_0, &[4, 256], &bytes).unwrap();
    assert_eq!(store.read(id).unwrap(), bytes);
}

// ---------------------------------------------------------------------------------------------
// Bad files
// ---------------------------------------------------------------------------------------------

/// A GGUF file written byte by byte: version 3, these metadata pairs (already encoded: key,
/// type, value) and tensors `(name, dims innermost first, ggml type, offset)`, then `data`.
struct Raw {
    version: u32,
    kv: Vec<Vec<u8>>,
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    data: Vec<u8>,
    counts: Option<(u64, u64)>,
}

fn string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

fn kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let mut b = string(key);
    b.extend(ty.to_le_bytes());
    b.extend(value);
    b
}

impl Raw {
    /// One Q8_0 tensor of 2 × 32 (68 bytes of data) and one F32 tensor of 3.
    fn good() -> Raw {
        Raw {
            version: 3,
            kv: vec![kv("general.architecture", 8, &string("llama"))],
            tensors: vec![("q".into(), vec![32, 2], 8, 0), ("f".into(), vec![3], 0, 96)],
            data: (0..108u8).collect(),
            counts: None,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        let (nt, nk) = self.counts.unwrap_or((self.tensors.len() as u64, self.kv.len() as u64));
        b.extend(nt.to_le_bytes());
        b.extend(nk.to_le_bytes());
        for kv in &self.kv {
            b.extend(kv);
        }
        for (name, dims, ty, offset) in &self.tensors {
            b.extend(string(name));
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(&self.data);
        b
    }
}

/// Writes `bytes` and loads them: the error, after checking the store holds nothing.
fn refused(bytes: &[u8]) -> Error {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    let store = Store::builder().host_backend().build().unwrap();
    let e = store.load_checkpoint(&path, LoadOptions::default()).unwrap_err();
    assert!(store.ids().is_empty(), "{e}: nothing half-loaded");
    assert!(matches!(e, Error::BadFile { .. }), "{e}");
    assert!(Gguf::open(&path).is_err());
    e
}

fn refused_with(raw: &Raw, words: &[&str]) {
    let e = refused(&raw.bytes()).to_string();
    for w in words {
        assert!(e.contains(w), "{w:?} not in: {e}");
    }
}

#[test]
fn the_good_raw_file_loads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, Raw::good().bytes()).unwrap();
    let store = Store::builder().host_backend().build().unwrap();
    let loaded = store.load_checkpoint(&path, LoadOptions::default()).unwrap();
    let q = loaded.get("q").unwrap();
    assert_eq!(store.info(q).unwrap().shape, [2, 32]);
    assert_eq!(store.read(q).unwrap(), (0..68).collect::<Vec<u8>>());
    let f = loaded.get("f").unwrap();
    assert_eq!(store.read(f).unwrap(), (96..108).collect::<Vec<u8>>());
    // An empty array (the `gguf` package does not write one).
    let mut r = Raw::good();
    r.kv.push(kv("empty", 9, &[&4u32.to_le_bytes()[..], &0u64.to_le_bytes()].concat()));
    let path = dir.path().join("empty.gguf");
    std::fs::write(&path, r.bytes()).unwrap();
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.get("empty"), Some(&GgufValue::Array(vec![])));
    assert_eq!(g.tensors().len(), 2);
}

#[test]
fn every_truncation_is_refused() {
    let bytes = Raw::good().bytes();
    for n in 0..bytes.len() {
        let e = refused(&bytes[..n]).to_string();
        assert!(
            e.contains("truncated")
                || e.contains("run past")
                || e.contains("not a GGUF")
                || e.contains("more than"),
            "{n}: {e}"
        );
    }
    let e = refused(&std::fs::read(fixture()).unwrap()[..40_000]).to_string();
    assert!(e.contains("run past the end"), "{e}");
}

#[test]
fn huge_counts_and_offsets_are_refused_without_allocating() {
    let mut r = Raw::good();
    r.counts = Some((u64::MAX, 1));
    refused_with(&r, &["tensor count is 18446744073709551615", "more than"]);
    r.counts = Some((2, u64::MAX / 2));
    refused_with(&r, &["metadata count"]);
    let mut r = Raw::good();
    r.kv.push(kv("big", 9, &[&8u32.to_le_bytes()[..], &(u64::MAX / 4).to_le_bytes()].concat()));
    refused_with(&r, &["the length of array \"big\""]);
    let mut r = Raw::good();
    r.kv.push(u64::MAX.to_le_bytes().to_vec()); // a key of 2^64 - 1 bytes
    refused_with(&r, &["a metadata key is 18446744073709551615", "more than"]);
    let mut r = Raw::good();
    r.tensors[1].3 = u64::MAX - 31;
    refused_with(&r, &["\"f\"", "overflows"]);
    let mut r = Raw::good();
    r.tensors[0].1 = vec![32, 1 << 62];
    refused_with(&r, &["\"q\"", "overflows"]);
}

#[test]
fn unknown_types_and_tensors_past_the_end_are_refused_by_name() {
    let mut r = Raw::good();
    r.tensors[0].2 = 16; // IQ2_XXS
    refused_with(&r, &["\"q\"", "GGML type 16"]);
    let mut r = Raw::good();
    r.kv.push(kv("x", 13, &[0]));
    refused_with(&r, &["\"x\"", "unknown value type 13"]);
    let mut r = Raw::good();
    r.tensors[1].3 = 128;
    refused_with(&r, &["\"f\"", "run past the end"]);
    let mut r = Raw::good();
    r.tensors[0].1 = vec![30, 2]; // not whole Q8_0 blocks
    refused_with(&r, &["\"q\"", "multiple of 32"]);
    let mut r = Raw::good();
    r.tensors[1].3 = 64; // inside q's bytes
    refused_with(&r, &["\"f\"", "overlap"]);
    let mut r = Raw::good();
    r.tensors[1].3 = 100;
    refused_with(&r, &["\"f\"", "not a multiple of 32"]);
    let mut r = Raw::good();
    r.tensors[1].0 = "q".into();
    refused_with(&r, &["\"q\"", "second tensor"]);
    let mut r = Raw::good();
    r.tensors[1].1 = vec![1, 1, 1, 1, 3];
    refused_with(&r, &["5 dimensions"]);
    let mut r = Raw::good();
    r.version = 1;
    refused_with(&r, &["version 1"]);
}

#[test]
fn metadata_of_the_wrong_kind_is_refused_by_name() {
    let mut r = Raw::good();
    r.kv.push(kv("general.alignment", 8, &string("32")));
    refused_with(&r, &["general.alignment is string"]);
    let mut r = Raw::good();
    r.kv.push(kv("general.alignment", 4, &24u32.to_le_bytes()));
    refused_with(&r, &["general.alignment is uint32 24", "power-of-two"]);
    let mut r = Raw::good();
    r.kv.push(kv("b", 7, &[2]));
    refused_with(&r, &["\"b\" is a bool of byte 2"]);
    let mut r = Raw::good();
    r.kv.push(r.kv[0].clone());
    refused_with(&r, &["general.architecture", "twice"]);
    // Arrays of arrays nest a few levels at most.
    let mut nested = 4u32.to_le_bytes().to_vec(); // innermost: an array of uint32
    nested.extend(0u64.to_le_bytes());
    for _ in 0..6 {
        nested = [&9u32.to_le_bytes()[..], &1u64.to_le_bytes(), &nested].concat();
    }
    let mut r = Raw::good();
    r.kv.push(kv("deep", 9, &nested));
    refused_with(&r, &["\"deep\" nests arrays"]);
}
