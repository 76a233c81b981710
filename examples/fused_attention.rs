//! strata's fused attention (`strata::candle::fused::attention`: causal, grouped-query, never a
//! `seq × seq` tensor) timed forward and forward + backward on candle's device: CUDA's first GPU
//! when built with `candle-cuda` and one is present, else the CPU. The inputs are seeded, so
//! `--save FILE` writes them with the outputs and gradients for `benches/peers/sdpa.py`, which
//! runs PyTorch's `scaled_dot_product_attention` on the same tensors and compares time and
//! values.
//!
//! ```text
//! cargo run --release --features candle --example fused_attention -- --seq 256 --heads 8 \
//!     --kv-heads 2 --head-dim 64 --dtype f32 --reps 3          # the CPU, seconds
//! .gpu/bin/cuda-example-fused_attention --seq 4096 --save /tmp/a.safetensors   # a GPU (bf16,
//! python3 benches/peers/sdpa.py /tmp/a.safetensors                            # Llama 2 7B's heads)
//! ```
//! Prints one JSON line: the median milliseconds of each and the model TFLOPS they stand for
//! (a causal attention's forward counts `2 · b · h · s² · d` multiply-adds, FlashAttention's
//! convention, the backward 2.5 times that).
//!
//! `--kernel NAME` picks the candidate: `strata` (the default: strata's own kernel, NVRTC on
//! CUDA, the CPU twin on the CPU) or `cudnn-sdpa` (cuDNN 9's fused SDPA on the tensor cores,
//! through `libstrata_attn.so`: `strata::candle::fused::cudnn`; bf16 or f16, CUDA only).
//! `--kernel list` prints the names of those that can run here, one a line (the GPU lease runs
//! each), and says on standard error why another cannot (`cudnn-sdpa` without candle's CUDA
//! build or without the library: `bash benches/gpu/build-attention` builds it).

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use strata::candle::fused;
use strata::candle::llama::SeededRng;

/// The candidate kernels, by the names `--kernel` takes.
#[derive(Clone, Copy, PartialEq)]
enum Kernel {
    Strata,
    CudnnSdpa,
}

impl Kernel {
    const ALL: [Kernel; 2] = [Kernel::Strata, Kernel::CudnnSdpa];

    fn name(self) -> &'static str {
        match self {
            Kernel::Strata => "strata",
            Kernel::CudnnSdpa => "cudnn-sdpa",
        }
    }

    /// Whether it can run here: what runs it, or why it cannot.
    fn available(self) -> Result<String, String> {
        match self {
            Kernel::Strata => Ok("strata's fused attention".into()),
            Kernel::CudnnSdpa => fused::cudnn::available().map_err(|e| e.to_string()),
        }
    }

    fn run(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        window: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        match self {
            Kernel::Strata => fused::attention(q, k, v, scale, window),
            Kernel::CudnnSdpa => fused::cudnn::attention(q, k, v, scale, window),
        }
    }
}

struct Args {
    /// None: `--kernel list`.
    kernel: Option<Kernel>,
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    window: Option<usize>,
    warmup: usize,
    reps: usize,
    save: Option<std::path::PathBuf>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        kernel: Some(Kernel::Strata),
        batch: 1,
        seq: 2048,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        dtype: DType::BF16,
        window: None,
        warmup: 2,
        reps: 5,
        save: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let n = || match v.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{flag} {v}: a whole number above 0")),
        };
        match flag.as_str() {
            "--batch" => a.batch = n()?,
            "--seq" => a.seq = n()?,
            "--heads" => a.heads = n()?,
            "--kv-heads" => a.kv_heads = n()?,
            "--head-dim" => a.head_dim = n()?,
            "--window" => a.window = Some(n()?),
            "--warmup" => a.warmup = v.parse().map_err(|e| format!("{flag} {v}: {e}"))?,
            "--reps" => a.reps = n()?,
            "--save" => a.save = Some(v.into()),
            "--kernel" if v == "list" => a.kernel = None,
            "--kernel" => {
                a.kernel =
                    Some(Kernel::ALL.into_iter().find(|k| k.name() == v).ok_or_else(|| {
                        let names: Vec<_> = Kernel::ALL.iter().map(|k| k.name()).collect();
                        format!("--kernel {v}: one of {}, or list", names.join(", "))
                    })?)
            }
            "--dtype" => {
                a.dtype = match v.as_str() {
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    "f32" => DType::F32,
                    _ => return Err(format!("--dtype {v}: bf16, f16 or f32")),
                }
            }
            _ => return Err(format!("unknown flag {flag} (see the example's docs)")),
        }
    }
    if a.heads % a.kv_heads != 0 {
        return Err(format!("--heads {} is not a multiple of --kv-heads {}", a.heads, a.kv_heads));
    }
    let elems =
        [a.batch, a.seq, a.heads, a.head_dim].iter().try_fold(1usize, |x, &y| x.checked_mul(y));
    if elems.is_none_or(|e| e > 1 << 31) {
        return Err("batch × seq × heads × head-dim is past 2^31 elements".into());
    }
    Ok(a)
}

/// A seeded normal `[b, s, h, d]` tensor of `dtype` on `dev`.
fn input(
    rng: &mut SeededRng,
    shape: [usize; 4],
    dtype: DType,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal(1.0) as f32).collect();
    Tensor::from_vec(v, &shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)
}

/// Median seconds of `reps` runs of `f` after `warmup`, each ended by a device synchronize.
fn time(
    dev: &Device,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> candle_core::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let Some(kernel) = a.kernel else {
        // The candidates that can run here, one a line; why the others cannot, on stderr.
        for k in Kernel::ALL {
            match k.available() {
                Ok(_) => println!("{}", k.name()),
                Err(why) => eprintln!("{}: not available: {why}", k.name()),
            }
        }
        return Ok(());
    };
    kernel
        .available()
        .map_err(|why| format!("--kernel {}: not available: {why}", kernel.name()))?;
    let dev = strata::candle::default_device()?;
    let mut rng = SeededRng::new(17);
    let (b, s, h, kv, d) = (a.batch, a.seq, a.heads, a.kv_heads, a.head_dim);
    let q = Var::from_tensor(&input(&mut rng, [b, s, h, d], a.dtype, &dev)?)?;
    let k = Var::from_tensor(&input(&mut rng, [b, s, kv, d], a.dtype, &dev)?)?;
    let v = Var::from_tensor(&input(&mut rng, [b, s, kv, d], a.dtype, &dev)?)?;
    let dout = input(&mut rng, [b, s, h, d], a.dtype, &dev)?;
    let scale = 1.0 / (d as f64).sqrt();
    let attn = || kernel.run(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, a.window);
    let fwd = time(&dev, a.warmup, a.reps, || attn().map(drop))?;
    // The backward of sum(o · dout): the gradients a training step's backward gets.
    let step = || -> candle_core::Result<(Tensor, candle_core::backprop::GradStore)> {
        let o = attn()?;
        let g = o.to_dtype(DType::F32)?.mul(&dout.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
        Ok((o, g))
    };
    let fwd_bwd = time(&dev, a.warmup, a.reps, || step().map(drop))?;
    // Multiply-adds of a causal forward: half of the full 4·b·h·s²·d FLOPs.
    let flops = 2.0 * (b * h) as f64 * (s as f64) * (s as f64) * d as f64;
    let json = serde_json::json!({
        "bench": "strata-fused-attention",
        "kernel": kernel.name(),
        // Where the cuDNN candidate could not run, why (the lease's logs keep it).
        "cudnn_sdpa": Kernel::CudnnSdpa.available().unwrap_or_else(|why| format!("not available: {why}")),
        "device": if dev.is_cuda() { "cuda" } else { "cpu" },
        "dtype": format!("{:?}", a.dtype).to_lowercase(),
        "batch": b, "seq": s, "heads": h, "kv_heads": kv, "head_dim": d, "window": a.window,
        "reps": a.reps,
        "fwd_ms": fwd * 1e3,
        "fwd_bwd_ms": fwd_bwd * 1e3,
        "fwd_tflops": flops / fwd / 1e12,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd / 1e12,
    });
    println!("{json}");
    if let Some(path) = &a.save {
        let (o, g) = step()?;
        let grad = |x: &Var, name: &str| {
            g.get(x.as_tensor()).cloned().ok_or_else(|| format!("no gradient for {name}"))
        };
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for (name, t) in [
            ("q", q.as_tensor().clone()),
            ("k", k.as_tensor().clone()),
            ("v", v.as_tensor().clone()),
            ("dout", dout.clone()),
            ("o", o),
            ("dq", grad(&q, "q")?),
            ("dk", grad(&k, "k")?),
            ("dv", grad(&v, "v")?),
        ] {
            tensors.insert(name.to_string(), t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
        }
        let window = a.window.map_or(-1, |w| w as i64);
        tensors.insert("meta".into(), Tensor::new(&[scale as f32, window as f32], &Device::Cpu)?);
        candle_core::safetensors::save(&tensors, path)?;
        println!("wrote {} (inputs, outputs and gradients in f32)", path.display());
    }
    Ok(())
}
