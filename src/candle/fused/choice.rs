//! Which kernel runs the built-in blocks' attention ([`block_attention`]): strata's own
//! ([`attention`](super::attention): FlashAttention-2's algorithm on CUDA cores, and the CPU's
//! implementation) or cuDNN's fused SDPA on the tensor cores ([`super::cudnn`]), chosen by
//! [`set_attention_kernel`], else by the `STRATA_ATTENTION` variable (`auto`, `strata` or
//! `cudnn`), else [`AttentionKernel::Auto`].
//!
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device, Tensor};
//! use strata::candle::fused::{self, AttentionKernel};
//!
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1.0, (1, 5, 4, 8), &dev)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 5, 2, 8), &dev)?;
//! // On the CPU `auto` is strata's kernel, the same bits as `fused::attention`.
//! let o = fused::attention_with(AttentionKernel::Auto, &q, &k, &k, 0.35, None, false)?;
//! let same = fused::attention(&q, &k, &k, 0.35, None)?;
//! assert_eq!(o.flatten_all()?.to_vec1::<f32>()?, same.flatten_all()?.to_vec1::<f32>()?);
//! // What a run would say it uses for its attention.
//! println!("{}", fused::attention_kernel_for(&dev, DType::BF16, 128)?);
//! # Ok(()) }
//! ```

use std::str::FromStr;
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};

/// The variable that chooses the attention kernel where [`set_attention_kernel`] has not.
pub const ATTENTION_ENV: &str = "STRATA_ATTENTION";

/// The kernel the built-in blocks' attention runs on ([`block_attention`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// cuDNN's fused SDPA where it takes the call: on candle's CUDA device, bf16 or f16, the
    /// library loaded (`libstrata_attn.so`, built by `benches/gpu/build-attention`), cuDNN's
    /// graphs for the shape built (asked once a shape; a refusal is logged once), and no KV
    /// cache (generation: cuDNN would build a graph for every length of the cache). Strata's
    /// kernel everywhere else.
    #[default]
    Auto,
    /// Strata's own kernel ([`attention`](super::attention)) for every call.
    Strata,
    /// cuDNN's for every call, a KV cache's included; an error where it cannot take one.
    Cudnn,
}

impl FromStr for AttentionKernel {
    type Err = candle_core::Error;

    fn from_str(s: &str) -> candle_core::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Self::Auto),
            "strata" => Ok(Self::Strata),
            "cudnn" => Ok(Self::Cudnn),
            other => candle_core::bail!(
                "no attention kernel is called {other:?}: choose auto (cuDNN's where it takes \
                 the call, else strata's), strata or cudnn"
            ),
        }
    }
}

impl std::fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Strata => "strata",
            Self::Cudnn => "cudnn",
        })
    }
}

static CHOSEN: parking_lot::Mutex<Option<AttentionKernel>> = parking_lot::Mutex::new(None);

/// Chooses the kernel of [`block_attention`] for the whole process (`None`: back to
/// `STRATA_ATTENTION`'s, else [`AttentionKernel::Auto`]).
pub fn set_attention_kernel(kernel: Option<AttentionKernel>) {
    *CHOSEN.lock() = kernel;
}

/// The kernel [`block_attention`] runs: [`set_attention_kernel`]'s, else `STRATA_ATTENTION`'s
/// (read once), else [`AttentionKernel::Auto`]. A value of the variable that names no kernel
/// is an error saying which it can be.
pub fn attention_kernel() -> candle_core::Result<AttentionKernel> {
    static FROM_ENV: OnceLock<Result<AttentionKernel, String>> = OnceLock::new();
    if let Some(k) = *CHOSEN.lock() {
        return Ok(k);
    }
    FROM_ENV
        .get_or_init(|| from_env(std::env::var(ATTENTION_ENV).ok().as_deref()))
        .clone()
        .map_err(candle_core::Error::Msg)
}

/// The kernel a value of `STRATA_ATTENTION` names (unset: [`AttentionKernel::Auto`]).
fn from_env(value: Option<&str>) -> Result<AttentionKernel, String> {
    match value {
        None => Ok(AttentionKernel::Auto),
        Some(v) => v.parse().map_err(|e| format!("{ATTENTION_ENV}: {e}")),
    }
}

/// The built-in blocks' attention: [`attention_with`] the process's [`attention_kernel`].
pub fn block_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
    cached: bool,
) -> candle_core::Result<Tensor> {
    attention_with(attention_kernel()?, q, k, v, scale, window, cached)
}

/// Causal attention of `q` (`[batch, q_len, heads, head_dim]`) over `k` and `v` (`[batch,
/// kv_len, kv_heads, head_dim]`), as [`attention`](super::attention) takes them, on `kernel`:
/// strata's, cuDNN's ([`super::cudnn::attention`]), or under [`AttentionKernel::Auto`] cuDNN's
/// where it takes the call and `cached` is false (the call is not a KV cache's), else
/// strata's. cuDNN sums in another order than strata's kernel: the two agree to rounding, not
/// bit for bit; each gives the same bits run after run (cuDNN's backward is its deterministic
/// algorithm).
pub fn attention_with(
    kernel: AttentionKernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
    cached: bool,
) -> candle_core::Result<Tensor> {
    match kernel {
        AttentionKernel::Strata => super::attention(q, k, v, scale, window),
        AttentionKernel::Cudnn => super::cudnn::attention(q, k, v, scale, window),
        // (The CPU's calls go straight to strata's kernel: nothing of cuDNN's is asked.)
        AttentionKernel::Auto if cached || !q.device().is_cuda() => {
            super::attention(q, k, v, scale, window)
        }
        AttentionKernel::Auto => match super::cudnn::attention_if_taken(q, k, v, scale, window)? {
            Ok(o) => Ok(o),
            Err(_) => super::attention(q, k, v, scale, window),
        },
    }
}

/// What the built-in blocks' attention runs on for tensors of `dtype` on `device` with heads of
/// `head_dim` under the process's [`attention_kernel`], in words, for a run to print: cuDNN's
/// (with the library's path and cuDNN's version) or strata's, and why. A bad
/// `STRATA_ATTENTION` is an error; so is `cudnn` where cuDNN cannot run at all (nothing would).
pub fn attention_kernel_for(
    device: &Device,
    dtype: DType,
    head_dim: usize,
) -> candle_core::Result<String> {
    let kernel = attention_kernel()?;
    let why_not = if !device.is_cuda() {
        Err("candle's CPU device".to_string())
    } else if !matches!(dtype, DType::BF16 | DType::F16) {
        Err(format!("{dtype:?}: cuDNN's SDPA takes bf16 or f16"))
    } else if head_dim % 8 != 0 || head_dim > 256 {
        Err(format!("heads of {head_dim}: cuDNN's SDPA takes multiples of 8 up to 256"))
    } else {
        super::cudnn::available().map_err(|e| format!("no cuDNN attention library: {e}"))
    };
    let strata =
        if device.is_cuda() { "strata's kernel (CUDA cores)" } else { "strata's kernel (CPU)" };
    match (kernel, why_not) {
        (AttentionKernel::Strata, _) => Ok(format!("{strata} (the kernel chosen: strata)")),
        (AttentionKernel::Cudnn, Ok(lib)) => {
            Ok(format!("cuDNN's fused SDPA for every call ({lib}) (the kernel chosen: cudnn)"))
        }
        (AttentionKernel::Cudnn, Err(why)) => candle_core::bail!(
            "the attention kernel chosen is cudnn, but cuDNN's attention cannot run here \
             ({why}); choose auto or strata ({ATTENTION_ENV})"
        ),
        (AttentionKernel::Auto, Ok(lib)) => Ok(format!(
            "cuDNN's fused SDPA on the tensor cores ({lib}) for training's shapes it takes, \
             {strata} for the rest; {ATTENTION_ENV}=strata for strata's everywhere"
        )),
        (AttentionKernel::Auto, Err(why)) => Ok(format!("{strata}; not cuDNN's: {why}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variables_values_name_a_kernel_or_say_which_they_can() {
        assert_eq!(from_env(None), Ok(AttentionKernel::Auto));
        for (v, k) in [
            ("auto", AttentionKernel::Auto),
            ("strata", AttentionKernel::Strata),
            (" CuDNN ", AttentionKernel::Cudnn),
        ] {
            assert_eq!(from_env(Some(v)), Ok(k), "{v}");
            assert_eq!(k.to_string().parse::<AttentionKernel>().unwrap(), k);
        }
        let e = from_env(Some("flash")).unwrap_err();
        assert!(
            e.contains("STRATA_ATTENTION") && e.contains("\"flash\"") && e.contains("auto"),
            "{e}"
        );
    }

    #[test]
    fn on_the_cpu_every_choice_but_cudnn_is_strata_s_kernel_bit_for_bit() {
        let dev = Device::Cpu;
        let q =
            Tensor::randn(0f32, 1.0, (2, 6, 4, 8), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let k =
            Tensor::randn(0f32, 1.0, (2, 6, 2, 8), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let v =
            Tensor::randn(0f32, 1.0, (2, 6, 2, 8), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let bits = |t: Tensor| -> Vec<u16> {
            t.flatten_all()
                .unwrap()
                .to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        let want = bits(super::super::attention(&q, &k, &v, 0.3, Some(4)).unwrap());
        for (kernel, cached) in [
            (AttentionKernel::Auto, false),
            (AttentionKernel::Auto, true),
            (AttentionKernel::Strata, false),
        ] {
            let o = attention_with(kernel, &q, &k, &v, 0.3, Some(4), cached).unwrap();
            assert_eq!(bits(o), want, "{kernel} cached {cached}");
        }
        let e = attention_with(AttentionKernel::Cudnn, &q, &k, &v, 0.3, None, false).unwrap_err();
        assert!(e.to_string().contains("CUDA device"), "{e}");
        // Bad input is strata's kernel's refusal under auto (nothing of cuDNN's is asked).
        let e = attention_with(
            AttentionKernel::Auto,
            &q,
            &k.narrow(3, 0, 4).unwrap(),
            &v,
            0.3,
            None,
            false,
        );
        assert!(e.unwrap_err().to_string().contains("fused attention"));
    }

    #[test]
    fn a_run_says_which_kernel_its_attention_runs_on_and_why() {
        // (The process's choice is left alone: other tests run beside this one. Under a
        // STRATA_ATTENTION of cudnn or of no kernel the CPU's answer is an error.)
        match attention_kernel() {
            Ok(AttentionKernel::Cudnn) | Err(_) => {
                assert!(attention_kernel_for(&Device::Cpu, DType::BF16, 128).is_err());
            }
            Ok(kernel) => {
                let said = attention_kernel_for(&Device::Cpu, DType::BF16, 128).unwrap();
                assert!(said.starts_with("strata's kernel (CPU)"), "{said}");
                if kernel == AttentionKernel::Auto {
                    assert!(said.contains("not cuDNN's: candle's CPU device"), "{said}");
                }
            }
        }
        #[cfg(not(feature = "candle-cuda"))]
        assert_eq!(super::super::cudnn::asked_so_far(), None, "no cuDNN without candle's CUDA");
    }
}
