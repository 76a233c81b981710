//! strata's out-of-core trainer from Rust, in a few calls: a Llama-style decoder whose weights,
//! gradients and AdamW state live in a strata store, trained block by block through a Device
//! tier smaller than the model. `strata finetune` is the command that does this with every
//! option (real checkpoints, text and chat data, LoRA, checkpoints, Ctrl-C); this is the API
//! under it.
//!
//! ```text
//! cargo run --release --features candle --example candle_train
//! ```

use candle_core::Tensor;
use strata::candle::{put_random_weights, LlamaConfig, TrainConfig, Trainer};
use strata::{format_size, DType, Store, Tier};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A small Llama: 4 blocks of width 64 (Hugging Face's config.json fields).
    let config = LlamaConfig::from_json(
        r#"{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "max_position_embeddings": 64}"#,
    )?;
    let device = strata::candle::default_device()?;
    // A Device tier of 256 KiB: about one block at a time; the rest waits in pinned memory.
    let builder =
        Store::builder().capacity(Tier::Device, 256 << 10).capacity(Tier::Pinned, 64 << 20);
    let store = strata::candle::store_for(&device, builder)?;
    let weights = put_random_weights(&store, &config, 1, DType::F32)?;
    let train = TrainConfig { micro_batch: 2, seq: 16, accum: 2, ..TrainConfig::default() };
    train.validate(&config, DType::F32, &device)?;
    let mut trainer = Trainer::new(store.clone(), &device, config, train.clone(), weights)?;

    // A learnable stream: each row counts up by one from its own start.
    let batch = |step: usize, m: usize| -> candle_core::Result<Tensor> {
        let rows: Vec<u32> = (0..train.micro_batch)
            .flat_map(|r| {
                let start = (step * 31 + m * 7 + r * 13) as u32;
                (0..=train.seq as u32).map(move |i| (start + i) % 256)
            })
            .collect();
        Tensor::from_vec(rows, (train.micro_batch, train.seq + 1), &device)
    };
    for step in 0..20 {
        let batches = (0..train.accum).map(|m| batch(step, m)).collect::<Result<Vec<_>, _>>()?;
        let r = trainer.step(&batches)?;
        println!(
            "step {:>2}: loss {:.4}  {:.0} tokens/s  stall {:.2} ms",
            step + 1,
            r.loss,
            r.tokens as f64 / r.seconds,
            r.stall_seconds * 1e3
        );
    }
    trainer.finish()?;
    let s = store.stats();
    println!(
        "{} into the Device tier over the run ({} budget); {}",
        format_size(s.moved_into(Tier::Device)),
        format_size(s.capacity(Tier::Device)),
        store.backend_description()
    );
    Ok(())
}
