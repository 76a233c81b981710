//! strata inside candle (feature `candle`, CPU candle): a small BERT with random weights, written
//! by the test as safetensors (one file, and sharded with an index), run by candle-transformers'
//! `BertModel` with its weights from strata's `VarBuilder` backend and from candle's own loader,
//! and layer by layer out of core under a Device budget smaller than the model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config, HiddenAct};
use strata::candle::{Layers, OutOfCoreBert, StoreBackend};
use strata::{LoadOptions, Store, Tier};

fn config() -> Config {
    Config {
        vocab_size: 50,
        hidden_size: 32,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        intermediate_size: 64,
        hidden_act: HiddenAct::Gelu,
        max_position_embeddings: 16,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        ..Config::default()
    }
}

/// The tensors of a BERT of `c`, as Hugging Face names them, with their shapes.
fn bert_shapes(c: &Config) -> Vec<(String, Vec<usize>)> {
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let mut v = vec![
        ("embeddings.word_embeddings.weight".to_string(), vec![c.vocab_size, h]),
        ("embeddings.position_embeddings.weight".into(), vec![c.max_position_embeddings, h]),
        ("embeddings.token_type_embeddings.weight".into(), vec![c.type_vocab_size, h]),
        ("embeddings.LayerNorm.weight".into(), vec![h]),
        ("embeddings.LayerNorm.bias".into(), vec![h]),
    ];
    for l in 0..c.num_hidden_layers {
        let p = format!("encoder.layer.{l}.");
        for (n, s) in [
            ("attention.self.query.weight", vec![h, h]),
            ("attention.self.query.bias", vec![h]),
            ("attention.self.key.weight", vec![h, h]),
            ("attention.self.key.bias", vec![h]),
            ("attention.self.value.weight", vec![h, h]),
            ("attention.self.value.bias", vec![h]),
            ("attention.output.dense.weight", vec![h, h]),
            ("attention.output.dense.bias", vec![h]),
            ("attention.output.LayerNorm.weight", vec![h]),
            ("attention.output.LayerNorm.bias", vec![h]),
            ("intermediate.dense.weight", vec![i, h]),
            ("intermediate.dense.bias", vec![i]),
            ("output.dense.weight", vec![h, i]),
            ("output.dense.bias", vec![h]),
            ("output.LayerNorm.weight", vec![h]),
            ("output.LayerNorm.bias", vec![h]),
        ] {
            v.push((format!("{p}{n}"), s));
        }
    }
    v
}

/// A seeded xorshift in [-0.5, 0.5).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// Writes a random BERT of `config()` in `dtype` (`F32` or `BF16`) to `dir`: `model.safetensors`,
/// and the same tensors in two shards with `model.safetensors.index.json` under `dir/sharded/`.
/// Returns the single file's path.
fn write_bert(
    dir: &Path,
    dtype: strata::DType,
    extra: &[(&str, strata::DType, Vec<usize>)],
) -> PathBuf {
    let store = Store::builder().host_backend().capacity(Tier::Device, 0).build().unwrap();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut ids = Vec::new();
    for (name, shape) in bert_shapes(&config()) {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n).map(|_| rng.next()).collect();
        let bytes: Vec<u8> = match dtype {
            strata::DType::BF16 => {
                vals.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect()
            }
            _ => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        ids.push((store.put(&name, dtype, &shape, &bytes).unwrap(), name));
    }
    for (name, dt, shape) in extra {
        let n: usize = shape.iter().product::<usize>() * dt.size_of();
        let bytes: Vec<u8> = (0..n).map(|i| (i % 2) as u8).collect();
        ids.push((store.put(name, *dt, shape, &bytes).unwrap(), name.to_string()));
    }
    let file = dir.join("model.safetensors");
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    store.save_safetensors_with(&file, &ids, &meta).unwrap();
    let sharded = dir.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    let half = ids.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (k, part) in [&ids[..half], &ids[half..]].into_iter().enumerate() {
        let shard = format!("model-0000{}-of-00002.safetensors", k + 1);
        store.save_safetensors_with(sharded.join(&shard), part, &meta).unwrap();
        for (_, name) in part {
            weight_map.insert(name.clone(), shard.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();
    file
}

fn input(dev: &Device) -> (Tensor, Tensor, Tensor) {
    let ids = Tensor::new(&[[1u32, 7, 42, 7, 3, 49]], dev).unwrap();
    let types = ids.zeros_like().unwrap();
    let mask = ids.ones_like().unwrap();
    (ids, types, mask)
}

fn run(vb: VarBuilder) -> Tensor {
    let (ids, types, mask) = input(vb.device());
    BertModel::load(vb, &config()).unwrap().forward(&ids, &types, Some(&mask)).unwrap()
}

/// The error under candle's backtrace and context wrappers.
fn root(e: &candle_core::Error) -> &candle_core::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. }
        | candle_core::Error::Context { inner, .. } => root(inner),
        e => e,
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// candle's own loader over the single file (the buffered variant: the same conversions as the
/// mapped one, without `unsafe`).
fn candle_vb(file: &Path, dtype: DType) -> VarBuilder<'static> {
    VarBuilder::from_buffered_safetensors(std::fs::read(file).unwrap(), dtype, &Device::Cpu)
        .unwrap()
}

fn strata_vb(path: &Path, dtype: DType) -> VarBuilder<'static> {
    let store = Arc::new(Store::builder().host_backend().build().unwrap());
    StoreBackend::load(store, path).unwrap().into_var_builder(dtype, &Device::Cpu)
}

#[test]
fn strata_backend_runs_bert_as_candles_loader_does() {
    for (dtype, model_dtype) in [
        (strata::DType::F32, DType::F32),
        (strata::DType::BF16, DType::F32),
        (strata::DType::F32, DType::BF16),
        (strata::DType::BF16, DType::BF16),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let file = write_bert(dir.path(), dtype, &[]);
        let want = run(candle_vb(&file, model_dtype)).to_dtype(DType::F32).unwrap();
        let sharded = dir.path().join("sharded");
        for path in [file.clone(), sharded.join("model.safetensors.index.json"), sharded] {
            let got = run(strata_vb(&path, model_dtype)).to_dtype(DType::F32).unwrap();
            assert_eq!(got.dims(), &[1, 6, 32]);
            assert_eq!(
                bits(&got),
                bits(&want),
                "{dtype} weights computed in {model_dtype:?} from {}",
                path.display()
            );
        }
    }
}

#[test]
fn strata_backend_converts_every_dtype_as_candle_does() {
    let dir = tempfile::tempdir().unwrap();
    let loadable = [
        strata::DType::U8,
        strata::DType::U16,
        strata::DType::U32,
        strata::DType::I16,
        strata::DType::I32,
        strata::DType::I64,
        strata::DType::F16,
        strata::DType::BF16,
        strata::DType::F32,
        strata::DType::F64,
        strata::DType::F8E4M3,
    ];
    let names: Vec<String> = loadable.iter().map(|d| format!("t.{d}")).collect();
    let extra: Vec<_> =
        loadable.iter().zip(&names).map(|(&d, n)| (n.as_str(), d, vec![3, 4])).collect();
    let file = write_bert(dir.path(), strata::DType::F32, &extra);
    let (theirs, ours) = (candle_vb(&file, DType::F32), strata_vb(&file, DType::F32));
    for name in &names {
        for to in [DType::U32, DType::I64, DType::F16, DType::BF16, DType::F32, DType::F64] {
            if name.ends_with("f8e4m3") && to == DType::F64 {
                continue; // candle 0.11's own f8e4m3 -> f64 conversion does not return
            }
            let a = theirs.get_unchecked_dtype(name, to);
            let b = ours.get_unchecked_dtype(name, to);
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    assert_eq!((a.dtype(), a.dims()), (b.dtype(), b.dims()), "{name} as {to:?}");
                    // Exact in f32: the values are 0 and 1 and the smallest f8e4m3.
                    let f = |t: Tensor| bits(&t.to_dtype(DType::F32).unwrap());
                    assert_eq!(f(a), f(b), "{name} as {to:?}");
                }
                (Err(_), Err(_)) => {}
                (a, b) => {
                    panic!("{name} as {to:?}: candle {:?}, strata {:?}", a.is_ok(), b.is_ok())
                }
            }
        }
        // The stored dtype, as candle loads it (u16 widened to u32).
        let stored = |vb: &VarBuilder| {
            let t = vb.get_unchecked_dtype(name, DType::F32).unwrap();
            (t.dims().to_vec(), bits(&t))
        };
        assert_eq!(stored(&ours), stored(&theirs), "{name}");
    }
}

#[test]
fn bad_inputs_are_candle_errors_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let odd = [
        ("odd.i8", strata::DType::I8),
        ("odd.bool", strata::DType::Bool),
        ("odd.u64", strata::DType::U64),
        ("odd.f8e5m2", strata::DType::F8E5M2),
    ];
    let extra: Vec<_> = odd.iter().map(|&(n, d)| (n, d, vec![2])).collect();
    let file = write_bert(dir.path(), strata::DType::F32, &extra);
    let ours = strata_vb(&file, DType::F32);
    let theirs = candle_vb(&file, DType::F32);

    // Missing: candle's CannotFindTensor, with the full name.
    let e = ours.pp("encoder").get((32, 32), "layer.9.attention.self.query.weight").unwrap_err();
    assert!(matches!(root(&e), candle_core::Error::CannotFindTensor { .. }), "{e:?}");
    assert!(e.to_string().contains("encoder.layer.9.attention.self.query.weight"), "{e}");

    // Wrong shape: candle's UnexpectedShape, word for word what candle's loader says.
    let name = "embeddings.word_embeddings.weight";
    let e = ours.get((51, 32), name).unwrap_err();
    let c = theirs.get((51, 32), name).unwrap_err();
    assert!(matches!(root(&e), candle_core::Error::UnexpectedShape { .. }), "{e:?}");
    assert_eq!(root(&e).to_string(), root(&c).to_string());
    assert!(e.to_string().contains(name), "{e}");

    // A dtype candle cannot hold: candle's UnsupportedSafeTensorDtype, with the tensor named.
    for (name, dt) in odd {
        for e in [ours.get(2, name).unwrap_err(), ours.get_unchecked(name).unwrap_err()] {
            let s = e.to_string();
            assert!(s.contains(name) && s.contains("unsupported safetensor dtype"), "{s}");
            assert!(matches!(root(&e), candle_core::Error::UnsupportedSafeTensorDtype(_)), "{e:?}");
            assert!(s.contains(dt.name()), "{s}");
        }
    }

    // Through a model: BertModel::load of a config with one layer more than the file has.
    let c = Config { num_hidden_layers: 5, ..config() };
    let e = BertModel::load(strata_vb(&file, DType::F32), &c).err().unwrap();
    assert!(e.to_string().contains("encoder.layer.4."), "{e}");
}

/// A store for the out-of-core run: a Device tier of `budget` bytes.
fn budget_store(budget: u64) -> Arc<Store> {
    let builder = Store::builder()
        .capacity(Tier::Device, budget)
        .prefetch_budget(budget)
        .capacity(Tier::Pinned, 1 << 20)
        .capacity(Tier::Mapped, 0)
        .staging(2, 64 << 10)
        .disk_workers(2);
    strata::candle::store_for(&Device::Cpu, builder).unwrap()
}

/// Layers kept resident (the first k, or the whole model) give the same bits as in memory,
/// and are not fetched again: a forward fetches only the stages it streams.
#[test]
fn resident_layers_give_the_same_bits_and_are_not_fetched_again() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_bert(dir.path(), strata::DType::F32, &[]);
    let want = run(candle_vb(&file, DType::F32));
    let c = config();
    let (ids, types, mask) = input(&Device::Cpu);
    let store = budget_store(64 << 20);
    let loaded = store.load_checkpoint(&file, LoadOptions::default()).unwrap();
    let bert = || {
        OutOfCoreBert::new(
            Layers::from_loaded(store.clone(), &loaded, &Device::Cpu).unwrap(),
            &c,
            DType::F32,
        )
        .unwrap()
    };
    // The whole model fits 64 MiB; a budget of one byte keeps nothing.
    assert_eq!(bert().layers_within(64 << 20).unwrap(), c.num_hidden_layers);
    assert_eq!(bert().layers_within(1).unwrap(), 0);
    for k in [0, 1, c.num_hidden_layers] {
        let b = bert().with_resident(k).unwrap();
        assert_eq!(b.resident_layers(), k);
        let before = b.layers().transfers().unwrap().tensors;
        for step in 0..2 {
            let got = b.forward(&ids, &types, Some(&mask)).unwrap();
            assert_eq!(bits(&got), bits(&want), "k {k}, step {step}");
        }
        let fetched = b.layers().transfers().unwrap().tensors - before;
        // 16 tensors a layer; the embeddings' stage (without the word table) when streamed.
        let stage = loaded
            .iter()
            .filter(|t| t.name.starts_with("embeddings.") && !t.name.contains("word"))
            .count() as u64;
        let embeddings = if k == c.num_hidden_layers { 0 } else { stage };
        assert_eq!(fetched, 2 * (16 * (c.num_hidden_layers - k) as u64 + embeddings), "k {k}");
    }
}

#[test]
fn out_of_core_equals_in_memory_and_streams_every_layer_after_the_first_from_prefetches() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_bert(dir.path(), strata::DType::F32, &[]);
    let want = run(candle_vb(&file, DType::F32));
    let c = config();
    let model_bytes: u64 =
        bert_shapes(&c).iter().map(|(_, s)| 4 * s.iter().product::<usize>() as u64).sum();
    let layer_bytes = (model_bytes
        - 4 * (c.vocab_size + c.max_position_embeddings + 2 + 2) as u64 * 32)
        / c.num_hidden_layers as u64;
    // Two layers and a half: less than the model, room for a layer and the next.
    let budget = layer_bytes * 5 / 2;
    assert!(budget < model_bytes);
    let sharded = dir.path().join("sharded").join("model.safetensors.index.json");
    for (path, stage_in_pinned) in [(file.clone(), false), (sharded, true)] {
        let store = budget_store(budget);
        let loaded = store.load_checkpoint(&path, LoadOptions::default()).unwrap();
        if stage_in_pinned {
            for t in loaded.iter() {
                store.move_to(t.id, Tier::Pinned).unwrap();
            }
        }
        let layers = Layers::from_loaded(store.clone(), &loaded, &Device::Cpu).unwrap();
        let bert = OutOfCoreBert::new(layers, &c, DType::F32).unwrap();
        let (ids, types, mask) = input(&Device::Cpu);
        // The embeddings stage: every tensor under embeddings. but the word table.
        let first_stage = loaded
            .iter()
            .filter(|t| t.name.starts_with("embeddings.") && !t.name.contains("word"))
            .count() as u64;
        let mut before = store.stats();
        for step in 0..3 {
            let got = bert.forward(&ids, &types, Some(&mask)).unwrap();
            assert_eq!(bits(&got), bits(&want), "step {step} from {}", path.display());
            let s = store.stats();
            let misses = s.prefetch_misses - before.prefetch_misses;
            // The first step misses only its first stage, which nothing prefetched; later steps
            // find it prefetched by the last layer of the step before.
            let allowed = if step == 0 { first_stage } else { 0 };
            assert_eq!(misses, allowed, "step {step}: device-view misses from {}", path.display());
            assert_eq!(s.prefetch_hits - before.prefetch_hits, 16 * 4 + first_stage - allowed);
            // The layers were streamed: more bytes into the Device tier than it holds, and
            // never more there than the budget.
            assert!(s.moved_into(Tier::Device) - before.moved_into(Tier::Device) > budget);
            assert!(s.used(Tier::Device) <= budget);
            before = s;
        }
        assert!(before.evictions > 0);
        let tr = bert.layers().transfers().unwrap();
        assert_eq!(tr.tensors, 3 * (16 * 4 + first_stage));
        assert_eq!(tr.gathered_bytes, 3 * 5 * 32 * 4, "5 distinct ids, 32 f32 columns");
        assert_eq!(tr.host_copy_bytes, 0);
    }
}

#[test]
fn out_of_core_fetches_name_missing_tensors_and_refuse_a_mismatched_store() {
    let dir = tempfile::tempdir().unwrap();
    let file =
        write_bert(dir.path(), strata::DType::F32, &[("odd.bool", strata::DType::Bool, vec![4])]);
    let store = budget_store(64 << 10);
    let loaded = store.load_checkpoint(&file, LoadOptions::default()).unwrap();
    let layers = Layers::from_loaded(store.clone(), &loaded, &Device::Cpu).unwrap();
    let e = layers.fetch(&["encoder.layer.0.nope"], &[]).unwrap_err();
    assert!(e.to_string().contains("encoder.layer.0.nope"), "{e}");
    let e = layers.fetch(&[], &["encoder.layer.7.x"]).unwrap_err();
    assert!(e.to_string().contains("encoder.layer.7.x"), "{e}");
    let e = layers.fetch(&["odd.bool"], &[]).unwrap_err();
    assert!(e.to_string().contains("odd.bool"), "{e}");
    let w = layers.fetch(&["encoder.layer.0.output.dense.bias"], &[]).unwrap();
    let e = w.var_builder(DType::F32).get(33, "encoder.layer.0.output.dense.bias").unwrap_err();
    assert!(e.to_string().contains("shape mismatch for encoder.layer.0.output.dense.bias"), "{e}");
    // A config with more layers than the checkpoint: the missing layer is named.
    let e = OutOfCoreBert::new(layers, &Config { num_hidden_layers: 5, ..config() }, DType::F32)
        .unwrap_err();
    assert!(e.to_string().contains("encoder.layer.4."), "{e}");
}

fn f32_bytes(n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (i as f32).to_ne_bytes()).collect()
}

fn tiers(s: &Store, id: strata::TensorId) -> Vec<Tier> {
    s.info(id).unwrap().tiers
}

/// A fetch or a row gather refused for a dtype candle lacks moves nothing: `next` is not
/// prefetched, the tensors before the bad one are not copied, the table is not moved.
#[test]
fn refused_fetches_and_gathers_leave_the_store_as_it_was() {
    let s = budget_store(64 << 10);
    let mk = |n: &str| s.put(n, strata::DType::F32, &[64, 64], &f32_bytes(4096)).unwrap();
    let (a, n1, n2) = (mk("a"), mk("n1"), mk("n2"));
    let bad = s.put("bad", strata::DType::I8, &[8, 4], &[1u8; 32]).unwrap();
    let table = mk("table");
    s.move_to(table, Tier::Device).unwrap();
    let names = [("a", a), ("n1", n1), ("n2", n2), ("bad", bad), ("table", table)];
    let layers =
        Layers::new(s.clone(), names.map(|(n, i)| (n.to_string(), i)), &Device::Cpu).unwrap();
    let ids = [a, n1, n2, bad, table];
    let before: Vec<_> = ids.iter().map(|&i| tiers(&s, i)).collect();
    let moved = s.stats().moved_into(Tier::Device);

    let e = layers.fetch(&["a", "bad"], &["n1", "n2"]).unwrap_err();
    assert!(format!("{e}").contains("bad"), "{e}");
    let e = layers.gather_rows("bad", &[0]).unwrap_err();
    assert!(format!("{e}").contains("bad"), "{e}");
    std::thread::sleep(std::time::Duration::from_millis(100)); // a prefetch would have run

    let after: Vec<_> = ids.iter().map(|&i| tiers(&s, i)).collect();
    assert_eq!(before, after);
    assert_eq!(s.stats().moved_into(Tier::Device), moved);
    assert_eq!(layers.transfers().unwrap(), strata::candle::Transfers::default());
}

/// A tensor the Device tier cannot hold now (its extent larger than the tier, or no room
/// beside a pinned tensor) is read on the host instead of failing; a name given twice is
/// handed over once.
#[test]
fn tensors_the_device_tier_cannot_hold_now_are_read_on_the_host() {
    // 1000 bytes in a 1000-byte tier: the tier's extents are larger than the bytes.
    let s = budget_store(1000);
    let a = s.put("a", strata::DType::F32, &[250], &f32_bytes(250)).unwrap();
    let layers = Layers::new(s.clone(), [("a".to_string(), a)], &Device::Cpu).unwrap();
    let w = layers.fetch(&["a", "a"], &[]).unwrap();
    assert_eq!(w.len(), 1);
    assert_eq!(w.get("a").unwrap().to_vec1::<f32>().unwrap()[249], 249.0);
    let t = layers.transfers().unwrap();
    assert_eq!((t.tensors, t.host_copy_bytes, t.view_copy_bytes), (1, 1000, 0));

    // 48 KiB beside 16 KiB pinned in a 64 KiB tier fits; 60 KiB does not, for now.
    let s = budget_store(64 << 10);
    let p = s.put("p", strata::DType::F32, &[64, 64], &f32_bytes(4096)).unwrap();
    s.move_to(p, Tier::Device).unwrap();
    s.pin(&[p]).unwrap();
    let big = s.put("big", strata::DType::F32, &[15 * 1024], &f32_bytes(15 * 1024)).unwrap();
    let layers = Layers::new(s.clone(), [("big".to_string(), big)], &Device::Cpu).unwrap();
    let w = layers.fetch(&["big"], &[]).unwrap();
    assert_eq!(w.get("big").unwrap().to_vec1::<f32>().unwrap()[15 * 1024 - 1], 15359.0);
    assert_eq!(layers.transfers().unwrap().host_copy_bytes, 60 << 10);
}

/// A joined group is copied once into one tensor whose row ranges are the group's tensors (each
/// from the Device tier, or from host memory when the tier cannot hold it); a group that does
/// not qualify is fetched one by one, the same values.
#[test]
fn joined_groups_are_fetched_into_one_tensor_of_their_rows() {
    let s = budget_store(64 << 10);
    let put = |n: &str, shape: &[usize]| {
        let count = shape.iter().product();
        s.put(n, strata::DType::F32, shape, &f32_bytes(count)).unwrap()
    };
    // "big" (48 KiB) beside 16 KiB pinned in a 64 KiB tier: read from host memory.
    let p = put("p", &[64, 64]);
    s.move_to(p, Tier::Device).unwrap();
    s.pin(&[p]).unwrap();
    let ids = [("q", put("q", &[8, 4])), ("k", put("k", &[4, 4])), ("big", put("big", &[3072, 4]))];
    let odd = [("wide", put("wide", &[2, 8])), ("flat", put("flat", &[4]))];
    let names = ids.iter().chain(&odd).map(|&(n, i)| (n.to_string(), i));
    let layers = Layers::new(s.clone(), names, &Device::Cpu).unwrap();
    let groups: Vec<Vec<String>> =
        [vec!["q", "k", "big"], vec!["q", "wide"], vec!["k", "flat"], vec!["k", "q"]]
            .iter()
            .map(|g| g.iter().map(|n| n.to_string()).collect())
            .collect();
    let uses = ["q", "k", "big", "wide", "flat"];
    let w = layers.fetch_joined(&uses, &[], &groups).unwrap();
    let joint = w.joined(&["q", "k", "big"]).expect("stacked");
    assert_eq!(joint.dims(), [3084, 4]);
    let rows = |t: &Tensor| t.to_vec2::<f32>().unwrap();
    let cat = Tensor::cat(&[w.get("q").unwrap(), w.get("k").unwrap(), w.get("big").unwrap()], 0);
    assert_eq!(rows(joint), rows(&cat.unwrap()));
    assert_eq!(rows(w.get("k").unwrap())[0], [0.0, 1.0, 2.0, 3.0]);
    for not in [&["q", "wide"][..], &["k", "flat"], &["k", "q"]] {
        assert!(w.joined(not).is_none(), "{not:?}: not stacked (the last: q and k were already)");
    }
    assert_eq!(w.get("flat").unwrap().to_vec1::<f32>().unwrap(), [0.0, 1.0, 2.0, 3.0]);
    assert_eq!(w.len(), 5);
    let t = layers.transfers().unwrap();
    assert_eq!((t.tensors, t.host_copy_bytes), (5, 3072 * 16));
    assert_eq!(t.view_copy_bytes, (32 + 16 + 16 + 4) * 4, "q, k, wide, flat through views");
    // A group naming what the fetch does not use is not stacked.
    let w = layers.fetch_joined(&["q"], &[], &groups).unwrap();
    assert!(w.joined(&["q", "k", "big"]).is_none() && w.len() == 1);

    // bf16 weights stack as bf16, their bits as stored.
    let bf = |n: &str, rows: usize| {
        let v: Vec<half::bf16> =
            (0..rows * 4).map(|i| half::bf16::from_f32(i as f32 / 8.0)).collect();
        s.put(n, strata::DType::BF16, &[rows, 4], bytemuck::cast_slice(&v)).unwrap()
    };
    let (g, u) = (bf("g", 3), bf("u", 2));
    let layers =
        Layers::new(s.clone(), [("g".to_string(), g), ("u".to_string(), u)], &Device::Cpu).unwrap();
    let group = vec![vec!["g".to_string(), "u".to_string()]];
    let w = layers.fetch_joined(&["g", "u"], &[], &group).unwrap();
    let joint = w.joined(&["g", "u"]).expect("stacked");
    assert_eq!((joint.dtype(), joint.dims()), (DType::BF16, &[5, 4][..]));
    let row = |t: &Tensor, r: usize| t.get(r).unwrap().to_vec1::<half::bf16>().unwrap();
    assert_eq!(row(joint, 3), row(w.get("u").unwrap(), 0));
    assert_eq!(row(joint, 3)[1], half::bf16::from_f32(0.125));
}

/// `fetch_vars` hands the named tensors over as candle variables (through a view, from host
/// memory when the Device tier cannot hold one, bf16 as stored, Q8_0 dequantized, u16 widened),
/// the same values as `fetch`;
/// `Var::from_tensor` takes them without a copy (a gradient reaches them).
#[test]
fn fetch_vars_hands_variables_over_without_a_second_copy() {
    let s = budget_store(64 << 10);
    let p = s.put("p", strata::DType::F32, &[64, 64], &f32_bytes(4096)).unwrap();
    s.move_to(p, Tier::Device).unwrap();
    s.pin(&[p]).unwrap();
    let bf = |n: usize| -> Vec<half::bf16> {
        (0..n).map(|i| half::bf16::from_f32((i % 64) as f32 / 8.0)).collect()
    };
    // Two Q8_0 blocks: an f16 scale of 0.5, then 32 signed bytes each.
    let mut q8 = Vec::new();
    for b in 0..2i8 {
        q8.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        q8.extend((0..32i8).map(|i| (i - 16 + b) as u8));
    }
    let put = |n: &'static str, dtype, shape: &[usize], bytes: &[u8]| {
        (n, s.put(n, dtype, shape, bytes).unwrap())
    };
    let ids = [
        put("w", strata::DType::F32, &[2, 4], &f32_bytes(8)),
        put("big", strata::DType::F32, &[3072, 4], &f32_bytes(3072 * 4)),
        put("b", strata::DType::BF16, &[2, 4], bytemuck::cast_slice(&bf(8))),
        // 60 KiB of bf16 beside 16 KiB pinned in a 64 KiB tier: read from host memory
        put("bigb", strata::DType::BF16, &[7680, 4], bytemuck::cast_slice(&bf(7680 * 4))),
        put("q", strata::DType::Q8_0, &[2, 32], &q8),
        // 64 KiB of u16 (widened to u32): read from host memory
        put("u", strata::DType::U16, &[8192, 4], bytemuck::cast_slice(&[7u16; 8192 * 4])),
        put("n", strata::DType::F32, &[2, 4], &f32_bytes(8)),
    ];
    let layers =
        Layers::new(s.clone(), ids.iter().map(|&(n, i)| (n.to_string(), i)), &Device::Cpu).unwrap();
    let uses = ["w", "big", "b", "bigb", "q", "u", "n"];
    let plain = layers.fetch(&uses, &[]).unwrap();
    let w = layers.fetch_vars(&uses, &[], &["w", "big", "b", "bigb", "q", "u"]).unwrap();
    for n in uses {
        let (got, want) = (w.get(n).unwrap(), plain.get(n).unwrap());
        assert_eq!(got.is_variable(), n != "n", "{n}");
        assert!(!want.is_variable());
        assert_eq!((got.dtype(), got.dims()), (want.dtype(), want.dims()));
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        assert_eq!(f32s(got).to_vec1::<f32>().unwrap(), f32s(want).to_vec1::<f32>().unwrap());
    }
    assert_eq!(w.get("q").unwrap().dtype(), DType::F32, "dequantized");
    assert_eq!(w.get("q").unwrap().get(1).unwrap().to_vec1::<f32>().unwrap()[0], -7.5);
    let t = layers.transfers().unwrap();
    assert_eq!(t.host_copy_bytes, 2 * (3072 * 16 + 7680 * 8 + 8192 * 8), "big, bigb, u: host");
    // The Var is the fetched tensor itself: a gradient of the one is a gradient of the other.
    let var = candle_core::Var::from_tensor(w.get("w").unwrap()).unwrap();
    assert_eq!(var.as_tensor().id(), w.get("w").unwrap().id());
    let grads = var.as_tensor().sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let g = grads.get(w.get("w").unwrap()).expect("a gradient").flatten_all().unwrap();
    assert_eq!(g.to_vec1::<f32>().unwrap(), (0..8).map(|i| 2.0 * i as f32).collect::<Vec<_>>());
    // Copied by `Var::from_tensor` where the fetch made a plain tensor.
    let copied = candle_core::Var::from_tensor(plain.get("w").unwrap()).unwrap();
    assert_ne!(copied.as_tensor().id(), plain.get("w").unwrap().id());
}

/// On a GPU (feature `candle-cuda`): the out-of-core run on candle's CUDA device, from device
/// views on candle's stream, equals candle's own in-memory run there, with cudarc's event
/// tracking off in candle's context (`store_for`: the store's events order its streams).
#[cfg(feature = "candle-cuda")]
#[test]
fn out_of_core_on_cuda_equals_in_memory() {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            assert!(std::env::var("STRATA_REQUIRE_GPU").is_err(), "no GPU: {e}");
            println!("SKIP out_of_core_on_cuda_equals_in_memory: no GPU ({e})");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let file = write_bert(dir.path(), strata::DType::F32, &[]);
    let vb = VarBuilder::from_buffered_safetensors(std::fs::read(&file).unwrap(), DType::F32, &dev)
        .unwrap();
    let want = run(vb);
    let store = strata::candle::store_for(
        &dev,
        Store::builder().capacity(Tier::Device, 96 << 10).prefetch_budget(96 << 10),
    )
    .unwrap();
    assert!(!dev.as_cuda_device().unwrap().is_event_tracking(), "store_for left tracking on");
    let loaded = store.load_checkpoint(&file, LoadOptions::default()).unwrap();
    let layers = Layers::from_loaded(store.clone(), &loaded, &dev).unwrap();
    let bert = OutOfCoreBert::new(layers, &config(), DType::F32).unwrap();
    let (ids, types, mask) = input(&dev);
    for _ in 0..2 {
        let got = bert.forward(&ids, &types, Some(&mask)).unwrap();
        assert_eq!(bits(&got), bits(&want));
    }
    let tr = bert.layers().transfers().unwrap();
    assert!(tr.view_copy_bytes > 0 && tr.view_copy_seconds > 0.0);
}

/// On a GPU (feature `candle-cuda`): a candle device whose context already has a stream of
/// cudarc's (`new_cuda_with_stream`) keeps cudarc's event tracking: its owner may count on it.
#[cfg(feature = "candle-cuda")]
#[test]
fn a_device_with_its_own_stream_keeps_cudarc_event_tracking() {
    let dev = match Device::new_cuda_with_stream(0) {
        Ok(d) => d,
        Err(e) => {
            assert!(std::env::var("STRATA_REQUIRE_GPU").is_err(), "no GPU: {e}");
            println!("SKIP a_device_with_its_own_stream_keeps_cudarc_event_tracking: no GPU ({e})");
            return;
        }
    };
    let small = Store::builder()
        .capacity(Tier::Device, 1 << 20)
        .capacity(Tier::Pinned, 1 << 20)
        .capacity(Tier::Mapped, 1 << 20);
    let _store = strata::candle::store_for(&dev, small).unwrap();
    assert!(dev.as_cuda_device().unwrap().is_event_tracking());
}

/// Out-of-core training of a Llama-style decoder, and the decoder itself (in this binary, so
/// that candle's tests build once).
#[path = "candle/fused.rs"]
mod fused;
#[path = "candle/llama.rs"]
mod llama;
/// Checkpoints, faults, divergence and bounded inputs of the trainer, and its example run as a
/// user runs it (the crash test).
#[path = "candle/reliable.rs"]
mod reliable;
#[path = "candle/shared.rs"]
mod shared;
#[path = "candle/train.rs"]
mod train;
// `strata serve` (the binary) through a real HTTP client.
#[cfg(feature = "serve")]
#[path = "candle/serve.rs"]
mod serve;
// `strata finetune` (the binary, with its `text` commands).
#[cfg(all(feature = "cli", feature = "text"))]
#[path = "candle/train_cli.rs"]
mod train_cli;

/// A strata error reaches candle code through `?` as one candle error whose message has the
/// whole chain (an I/O error's OS reason too) and the tensor's name where it is known.
#[test]
fn strata_errors_in_candle_keep_the_chain_and_the_tensor_name() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.safetensors");
    let store = budget_store(64 << 10);
    let e = StoreBackend::load(store.clone(), &missing).unwrap_err().to_string();
    // On one line (a backtrace, when enabled, follows it).
    let first = e.lines().next().unwrap();
    assert!(first.contains("nope.safetensors") && first.contains("No such file"), "{e}");

    let file = write_bert(dir.path(), strata::DType::F32, &[]);
    let loaded = store.load_checkpoint(&file, LoadOptions::default()).unwrap();
    let layers = Layers::from_loaded(store.clone(), &loaded, &Device::Cpu).unwrap();
    let name = "encoder.layer.0.output.dense.bias";
    store.remove(loaded.get(name).unwrap()).unwrap();
    let e = layers.fetch(&[name], &[]).unwrap_err().to_string();
    assert!(e.starts_with(&format!("strata could not serve tensor {name}: ")), "{e}");

    // `?` in a function returning candle's Result.
    fn put_twice(store: &Store) -> candle_core::Result<()> {
        store.put("w", strata::DType::F32, &[1], &[0u8; 4])?;
        store.put("w", strata::DType::F32, &[1], &[0u8; 4])?;
        Ok(())
    }
    let e = put_twice(&store).unwrap_err().to_string();
    assert!(e.contains("\"w\" already exists"), "{e}");
}
#[path = "candle/blocks.rs"]
mod blocks;
#[path = "candle/configs.rs"]
mod configs;
#[path = "candle/generate.rs"]
mod generate;
#[path = "candle/gguf.rs"]
mod gguf;
#[cfg(feature = "text")]
#[path = "candle/gguf_text.rs"]
mod gguf_text;
#[path = "candle/lora.rs"]
mod lora;
#[cfg(feature = "text")]
#[path = "candle/text.rs"]
mod text;
