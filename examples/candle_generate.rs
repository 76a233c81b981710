//! Generation out of core from Rust: a Llama-style decoder whose blocks stream through a Device
//! tier smaller than the model, its KV caches in the same store, several prompts in one batch
//! (one pass of the weights per token serves them all) and each sequence's tokens what it
//! would generate alone. `strata generate`, `strata chat` and `strata serve` are the commands
//! that do this on real checkpoints; this is the API under them.
//!
//! ```text
//! cargo run --release --features candle --example candle_generate
//! ```

use candle_core::DType as CDType;
use strata::candle::{
    generate, generate_batch, put_random_weights, Layers, LlamaConfig, OutOfCoreLlama, Sampling,
};
use strata::{format_size, DType, Store, Tier};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = LlamaConfig::from_json(
        r#"{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "max_position_embeddings": 64}"#,
    )?;
    let device = strata::candle::default_device()?;
    // 128 KiB of Device tier for about 800 KiB of weights: every pass streams the blocks.
    let builder = Store::builder()
        .capacity(Tier::Device, 128 << 10)
        .prefetch_budget(128 << 10)
        .capacity(Tier::Pinned, 16 << 20);
    let store = strata::candle::store_for(&device, builder)?;
    let weights = put_random_weights(&store, &config, 1, DType::F32)?;
    let layers = Layers::new(store.clone(), weights, &device)?;
    let model = OutOfCoreLlama::new(layers, &config, CDType::F32)?;

    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[40, 41], &[7, 8, 9, 10]];
    let sampling = Sampling::Greedy;
    let out = generate_batch(&model, &prompts, 12, &sampling, &[], |i, token| {
        if i == 0 {
            print!("{token} ");
        }
        Ok(())
    })?;
    println!("(sequence 0, streamed)");
    for (i, (p, g)) in prompts.iter().zip(&out).enumerate() {
        // The batch gives each sequence what it generates alone.
        assert_eq!(g.tokens, generate(&model, p, 12, &sampling)?.tokens);
        println!("[{i}] {:?} -> {:?}", p, g.tokens);
    }
    println!(
        "{} into the Device tier ({} budget); {}",
        format_size(store.stats().moved_into(Tier::Device)),
        format_size(store.stats().capacity(Tier::Device)),
        store.backend_description()
    );
    Ok(())
}
