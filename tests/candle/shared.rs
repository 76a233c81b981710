//! One out-of-core model shared by many threads: every forward and every row gather succeeds
//! (readers never refuse each other) and gives the single-threaded result, bit for bit.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use strata::candle::{Layers, OutOfCoreBert};
use strata::LoadOptions;

use super::{bits, budget_store, candle_vb, config, write_bert};

const THREADS: usize = 8;

/// Thread `t`'s input of forward `i`: 4 sequences of 16 ids that overlap other threads' (the
/// same rows of the word table are gathered by many threads at once).
fn ids_of(t: usize, i: usize, dev: &Device) -> Tensor {
    let v: Vec<u32> = (0..64).map(|k| ((t * 7 + i * 3 + k * 11) % 50) as u32).collect();
    Tensor::from_vec(v, (4, 16), dev).unwrap()
}

#[test]
fn eight_threads_share_one_out_of_core_bert_with_identical_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_bert(dir.path(), strata::DType::F32, &[]);
    let dev = Device::Cpu;
    let reference =
        candle_transformers::models::bert::BertModel::load(candle_vb(&file, DType::F32), &config())
            .unwrap();
    let want = |t: usize, i: usize| {
        let ids = ids_of(t, i, &dev);
        bits(&reference.forward(&ids, &ids.zeros_like().unwrap(), None).unwrap())
    };
    // A Device tier of about two and a half layers: the threads' layers evict each other.
    let store = budget_store(40 << 10);
    let loaded = store.load_checkpoint(&file, LoadOptions::default()).unwrap();
    let layers = Layers::from_loaded(store.clone(), &loaded, &dev).unwrap();
    let bert = Arc::new(OutOfCoreBert::new(layers, &config(), DType::F32).unwrap());
    const FORWARDS: usize = 30;
    let wants: Vec<Vec<Vec<u32>>> =
        (0..THREADS).map(|t| (0..FORWARDS).map(|i| want(t, i)).collect()).collect();
    let wants = Arc::new(wants);
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (bert, wants) = (bert.clone(), wants.clone());
            std::thread::spawn(move || {
                for i in 0..FORWARDS {
                    let ids = ids_of(t, i, &Device::Cpu);
                    let got = bert
                        .forward(&ids, &ids.zeros_like().unwrap(), None)
                        .unwrap_or_else(|e| panic!("thread {t}, forward {i}: {e}"));
                    assert_eq!(bits(&got), wants[t][i], "thread {t}, forward {i}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(store.stats().evictions > 0, "the layers were streamed");
}

#[test]
fn eight_threads_gather_rows_of_one_table_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_bert(dir.path(), strata::DType::F32, &[]);
    let store = budget_store(40 << 10);
    let loaded = store.load_checkpoint(&file, LoadOptions::default()).unwrap();
    let layers = Arc::new(Layers::from_loaded(store.clone(), &loaded, &Device::Cpu).unwrap());
    let name = "embeddings.word_embeddings.weight";
    let table = candle_vb(&file, DType::F32).get((50, 32), name).unwrap();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (layers, table) = (layers.clone(), table.clone());
            std::thread::spawn(move || {
                for i in 0..200 {
                    // Many rows (repeats allowed): the gathers of the threads overlap in time.
                    let rows: Vec<usize> = (0..2000).map(|k| (t + i + 9 * k) % 50).collect();
                    let got = layers
                        .gather_rows(name, &rows)
                        .unwrap_or_else(|e| panic!("thread {t}, gather {i}: {e}"));
                    let idx = Tensor::from_vec(
                        rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
                        rows.len(),
                        &Device::Cpu,
                    )
                    .unwrap();
                    let want = table.index_select(&idx, 0).unwrap();
                    assert_eq!(bits(&got), bits(&want), "thread {t}, gather {i}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn eight_threads_share_one_out_of_core_llama_each_with_its_kv_cache() {
    use super::generate::{bits as lbits, logits_of, out_of_core, tiny, SEED};
    use strata::candle::{generate, InMemoryLlama, Sampling};
    let c = tiny();
    let mem = InMemoryLlama::random(&c, SEED, DType::F32, &Device::Cpu).unwrap();
    let prompt =
        |t: usize| -> Vec<u32> { (0..4).map(|k| ((t * 13 + k * 5) % 97) as u32).collect() };
    // The single-threaded reference: each thread's tokens and every step's logits.
    let wants: Vec<(Vec<u32>, Vec<Vec<u32>>)> = (0..THREADS)
        .map(|t| {
            let tokens = generate(&mem, &prompt(t), 10, &Sampling::Greedy).unwrap().tokens;
            let logits = logits_of(&mem, &prompt(t), &tokens[..9]).iter().map(lbits).collect();
            (tokens, logits)
        })
        .collect();
    let wants = Arc::new(wants);
    let model = Arc::new(out_of_core(&c));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (model, wants) = (model.clone(), wants.clone());
            std::thread::spawn(move || {
                for round in 0..3 {
                    let got = generate(&*model, &prompt(t), 10, &Sampling::Greedy)
                        .unwrap_or_else(|e| panic!("thread {t}, round {round}: {e}"));
                    assert_eq!(got.tokens, wants[t].0, "thread {t}, round {round}");
                    let logits: Vec<_> = logits_of(&*model, &prompt(t), &got.tokens[..9])
                        .iter()
                        .map(lbits)
                        .collect();
                    assert_eq!(logits, wants[t].1, "thread {t}, round {round}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(model.layers().store().stats().evictions > 0, "the blocks were streamed");
}
