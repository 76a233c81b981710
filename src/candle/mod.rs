//! strata inside [candle](https://github.com/huggingface/candle) (feature `candle`): a store's
//! tensors served to candle models.
//!
//! | what | type | what is copied |
//! |---|---|---|
//! | a candle-nn `VarBuilder` over a store | [`StoreBackend`] | each tensor, once, from its fastest replica (in place in the checkpoint file, or a memory tier) into a candle-owned buffer on the candle device; the store keeps no extra copy |
//! | one layer's weights at a time | [`Layers`], [`LayerWeights`] | the layer's tensors through device views: on the CPU from the host memory of the store's Device tier (host backend), on CUDA device to device from the store's Device tier into candle-owned memory, on candle's stream; the next layer is prefetched meanwhile |
//! | candle-transformers' BERT run layer by layer | [`OutOfCoreBert`] | as [`Layers`]; the word-embedding rows the input uses are gathered from a host replica |
//! | a Llama-style decoder trained out of core | [`Trainer`] (model: [`llama`]; its reference and baseline, resident on the device: [`LlamaTwin`]; budgets for a machine: [`train::TrainPlan`]) | each stage's weights as [`Layers`] hands them, twice a step (forward, backward); activation checkpoints and f32 gradients from candle into store tensors; the optimizer's state never leaves the store |
//! | blocks of your own, LoRA adapters over a frozen base | [`block::Block`] ([`block`]), [`lora::LoraConfig`] ([`lora`]: PEFT's format) | as [`Trainer`]: the base's stages streamed, only the adapters' gradients and state |
//!
//! A model built from [`StoreBackend`] computes what the same model built with candle's own
//! `VarBuilder::from_mmaped_safetensors` computes, bit for bit: the same dtype conversions
//! (safetensors `U16` becomes candle `U32`; the dtypes candle lacks are an error naming the
//! tensor), the same shape check and error (`UnexpectedShape`, "shape mismatch for NAME").
//!
//! Every function here returns `candle_core::Result`, and a strata error converts into a candle
//! error with `?` (its whole chain as the message, the tensor named where it is known), so one
//! error type runs through a candle program. strata's `DType`, `Result` and `Error` have the
//! same names as candle's: import strata under a short name (`use strata as st;`) rather than
//! its items.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use candle_core::{DType, Device};
//! use strata as st;
//! use st::candle::StoreBackend;
//!
//! let device = Device::Cpu;
//! let store = st::candle::store_for(&device, st::Store::builder())?;
//! // A .safetensors file, a sharded checkpoint's *.index.json, or a directory: loaded in place.
//! let backend = StoreBackend::load(store, "all-MiniLM-L6-v2/")?;
//! let vb = backend.into_var_builder(DType::F32, &device);
//! let config: candle_transformers::models::bert::Config =
//!     serde_json::from_str(&std::fs::read_to_string("all-MiniLM-L6-v2/config.json")?)?;
//! let model = candle_transformers::models::bert::BertModel::load(vb, &config)?;
//! # let _ = model; Ok(()) }
//! ```
//!
//! Candle cannot be handed memory it does not own: a candle tensor frees its buffer when its
//! last clone drops, which for a store's memory would free (or reuse) what the store still
//! owns. So every tensor handed to candle is candle's own copy, and the store's replica is
//! released as soon as that copy is made (on CUDA: once candle's stream has run the copy, which
//! the store waits for in stream order, never on the host). `docs/candle.md` has the details and
//! the figures.

mod bert;
pub mod block;
#[cfg(feature = "candle-cuda")]
mod cuda;
pub mod fused;
mod generate;
mod gguf;
mod layers;
mod linear;
pub mod llama;
mod llama_config;
pub mod lora;
#[cfg(feature = "text")]
pub mod text;
pub mod train;
mod var_builder;

pub use bert::OutOfCoreBert;
pub use generate::{
    generate, generate_batch, CausalLm, Generated, InMemoryCache, InMemoryLlama, OutOfCoreLlama,
    Sampler, Sampling, StoreKvCache,
};
pub use gguf::{hf_name, load_gguf_weights, needs_widening, widen_for_training};
pub use layers::{LayerWeights, Layers, Transfers};
pub use llama_config::{LlamaConfig, RopeScaling, StepFlops};
pub use train::config::TrainConfig;
pub use train::init::{load_tensors, load_weights, put_random_tensors, put_random_weights};
pub use train::schedule::LrSchedule;
pub use train::trainer::{StepReport, Trainer};
pub use train::twin::LlamaTwin;
pub use var_builder::StoreBackend;

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::base::error::{Error, Result};
use crate::base::types::{DType, TensorId};
use crate::{Store, StoreBuilder, Stream};

/// Builds a store whose backend goes with a candle device, shared (`Arc`) as every type of
/// this module takes it: the host backend for [`Device::Cpu`] (its Device tier is host memory,
/// so the budgets and the streaming work as on a GPU), and for a CUDA device the CUDA backend
/// in the device's own CUDA context (a store in another context could not copy into candle's
/// memory). Every other setting comes from `builder`.
///
/// For a CUDA device made by `Device::new_cuda` (candle's per-thread default stream, no other
/// stream in its context) this turns cudarc's event tracking off in the device's context, as
/// candle runs without a store: the store's copy streams would otherwise switch it on, costing
/// events around every allocation, launch and free of candle's, and they never touch candle's
/// tensors (the store orders its own memory with its own events). A device whose context
/// already has a stream of cudarc's (`Device::new_cuda_with_stream`) keeps its tracking. Work
/// you issue on a stream of your own in that context, with candle's tensors or a view's memory,
/// is then yours to order (events; [`DeviceView::record_use`](crate::DeviceView::record_use)),
/// and so is a candle tensor used, or dropped, on two host threads (a tensor freed on another
/// thread is freed on that thread's stream, no longer after the first thread's work on it; the
/// per-thread stream is one stream per
/// thread): to share a model between threads, make the device with `new_cuda_with_stream`.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use strata as st;
/// let store = st::candle::store_for(
///     &candle_core::Device::Cpu,
///     st::Store::builder().capacity(st::Tier::Device, 8 << 20),
/// )?;
/// assert_eq!(store.backend(), st::BackendKind::Host);
/// # Ok(()) }
/// ```
pub fn store_for(device: &Device, builder: StoreBuilder) -> candle_core::Result<Arc<Store>> {
    let store = match device {
        Device::Cpu => builder.host_backend().build(),
        #[cfg(feature = "candle-cuda")]
        Device::Cuda(dev) => {
            let ctx = dev.cuda_stream().context().clone();
            // Before the store makes its copy streams in candle's context: they would turn
            // cudarc's event tracking on for every candle op, and need none of it (what orders
            // what, and where tracking stays on: backend::cuda::untrack_single_stream).
            crate::backend::cuda::untrack_single_stream(&ctx);
            builder.context(ctx).build()
        }
        other => Err(Error::BackendMismatch(format!(
            "candle device {other:?}: strata serves candle's CPU device, and its CUDA devices \
             when built with the candle-cuda feature"
        ))),
    };
    Ok(Arc::new(store?))
}

/// The device a program built on this module runs on: CUDA's first GPU when strata is built
/// with `candle-cuda` and one answers, else candle's CPU device. With the environment variable
/// `STRATA_REQUIRE_GPU=1` (as the GPU tests take it) no GPU is an error saying why, instead of
/// the CPU: a run meant for the GPU does not quietly pass on the CPU.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// let device = strata::candle::default_device()?;
/// println!("candle device: {device:?}");
/// # Ok(()) }
/// ```
pub fn default_device() -> candle_core::Result<Device> {
    #[cfg(feature = "candle-cuda")]
    let why = match Device::new_cuda(0) {
        Ok(d) => return Ok(d),
        Err(e) => format!("candle found no CUDA device: {e}"),
    };
    #[cfg(not(feature = "candle-cuda"))]
    let why = "strata was built without the candle-cuda feature".to_string();
    if std::env::var("STRATA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        return Err(candle_core::Error::Msg(format!(
            "STRATA_REQUIRE_GPU=1 but no GPU: {why}; unset it to run on the CPU"
        )));
    }
    Ok(Device::Cpu)
}

/// The stream on which the store lends tensors to work on `device`: candle's own CUDA stream
/// (so the store's copies and candle's kernels are ordered on the GPU, without host waits), or
/// one of the store's host streams for the CPU. Fails when the store and the device do not go
/// together (see [`store_for`]).
pub(crate) fn stream_for(store: &Store, device: &Device) -> Result<Stream> {
    let mismatch = |why: &str| {
        Err(Error::BackendMismatch(format!(
            "{why}: build the store with strata::candle::store_for(&device, Store::builder())"
        )))
    };
    match device {
        Device::Cpu if store.backend() == crate::BackendKind::Host => store.stream(),
        Device::Cpu => mismatch("a CUDA store with candle's CPU device"),
        #[cfg(feature = "candle-cuda")]
        Device::Cuda(dev) => {
            let stream = dev.cuda_stream();
            match store.cuda_context() {
                Some(ctx) if ctx.cu_ctx() == stream.context().cu_ctx() => {
                    Ok(Stream::from_cuda(stream))
                }
                Some(_) => mismatch("the store's CUDA context is not the candle device's"),
                None => mismatch("a host-backend store with a CUDA candle device"),
            }
        }
        _ => mismatch(&format!("candle device {device:?} is not served")),
    }
}

/// The largest text file (a config, a tokenizer, a chat template, prompts) read whole.
pub(crate) const TEXT_FILE_LIMIT: u64 = 256 << 20;

/// A text file read whole, bounded: it must be a regular file (not a FIFO or a device, which
/// could block or never end) of at most [`TEXT_FILE_LIMIT`] bytes, sized before it is read.
/// `Ok(None)` when it does not exist.
pub(crate) fn read_text_file(path: &std::path::Path) -> candle_core::Result<Option<String>> {
    let fail = |why: String| candle_core::Error::Msg(format!("{}: {why}", path.display())).bt();
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(fail(e.to_string())),
    };
    if !meta.is_file() {
        return Err(fail("not a regular file".into()));
    }
    if meta.len() > TEXT_FILE_LIMIT {
        return Err(fail(format!(
            "{} bytes, more than the {} a text file here may have",
            meta.len(),
            TEXT_FILE_LIMIT
        )));
    }
    let mut text = String::with_capacity(meta.len() as usize);
    use std::io::Read;
    std::fs::File::open(path)
        .and_then(|f| f.take(TEXT_FILE_LIMIT + 1).read_to_string(&mut text))
        .map_err(|e| fail(e.to_string()))?;
    if text.len() as u64 > TEXT_FILE_LIMIT {
        return Err(fail(format!("grew past {TEXT_FILE_LIMIT} bytes while read")));
    }
    Ok(Some(text))
}

/// [`read_text_file`] of a file that must exist.
pub(crate) fn read_text_file_needed(path: &std::path::Path) -> candle_core::Result<String> {
    read_text_file(path)?
        .ok_or_else(|| candle_core::Error::Msg(format!("{}: no such file", path.display())).bt())
}

/// The candle dtype a tensor of `dtype` loads as, as candle's safetensors loader does it
/// (`U16` is widened to `U32`; a block-quantized tensor is dequantized to `F32`, exactly, by
/// [`quant::dequantize`](crate::base::quant::dequantize)); `None` for the dtypes candle has no type
/// for.
pub(crate) fn candle_dtype(dtype: DType) -> Option<candle_core::DType> {
    use candle_core::DType as C;
    Some(match dtype {
        DType::U8 => C::U8,
        DType::U16 | DType::U32 => C::U32,
        DType::I16 => C::I16,
        DType::I32 => C::I32,
        DType::I64 => C::I64,
        DType::BF16 => C::BF16,
        DType::F16 => C::F16,
        DType::F32 => C::F32,
        DType::F64 => C::F64,
        DType::F8E4M3 => C::F8E4M3,
        d if d.is_quantized() => C::F32,
        _ => return None,
    })
}

/// candle's error for a dtype it cannot load (what its safetensors loader says), naming the
/// tensor.
pub(crate) fn unsupported_dtype(name: &str, dtype: DType) -> candle_core::Error {
    let st = match dtype {
        DType::F8E5M2 => safetensors::Dtype::F8_E5M2,
        DType::I8 => safetensors::Dtype::I8,
        DType::U64 => safetensors::Dtype::U64,
        _ => safetensors::Dtype::BOOL,
    };
    candle_core::Error::UnsupportedSafeTensorDtype(st).context(format!(
        "tensor {name} is {dtype}, which candle cannot hold: convert it in the checkpoint (to \
         one of u8, u16, u32, i16, i32, i64, f8e4m3, f16, bf16, f32, f64)"
    ))
}

/// A strata error as a candle error, so that `?` works on strata calls in code returning
/// `candle_core::Result`. The candle error's message is the strata error's whole chain
/// ([`Error::chain`](crate::Error::chain): an I/O error's OS reason included), on one line.
/// Where strata's error names the tensor, so does the message; the functions of this module
/// add the tensor's name where they know it (`strata could not serve tensor NAME: ...`).
///
/// ```
/// use strata as st;
///
/// fn f(store: &st::Store) -> candle_core::Result<Vec<u8>> {
///     let id = store.put("w", st::DType::F32, &[1], &[0u8; 4])?;
///     store.put("w", st::DType::F32, &[1], &[0u8; 4])?; // a second "w": strata's error
///     Ok(store.read(id)?)
/// }
/// let store = st::Store::builder().host_backend().build().unwrap();
/// let e = f(&store).unwrap_err();
/// assert!(e.to_string().contains("a tensor named \"w\" already exists"));
/// ```
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::Msg(e.chain()).bt()
    }
}

/// The error of type `E` carried in `e` (as `candle_core::Error::Io` of an `io::Error::other`,
/// how [`TrainError`](train::TrainError) and [`GgufTokenizerError`](text::GgufTokenizerError)
/// travel), under any backtrace or context candle added.
pub(crate) fn find_carried<E: std::error::Error + 'static>(e: &candle_core::Error) -> Option<&E> {
    use candle_core::Error as C;
    match e {
        C::Io(io) => io.get_ref()?.downcast_ref::<E>(),
        C::WithBacktrace { inner, .. } | C::Context { inner, .. } | C::WithPath { inner, .. } => {
            find_carried(inner)
        }
        _ => None,
    }
}

/// A strata error as a candle error, naming the tensor it concerns (one line: the name, then
/// the strata error's chain).
pub(crate) fn strata_err(name: &str, e: Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("strata could not serve tensor {name}: {}", e.chain())).bt()
}

/// candle's error for a tensor of another shape than the one asked for, in the words of
/// candle's own safetensors loader (`shape mismatch for NAME`).
pub(crate) fn shape_mismatch(name: &str, expected: &[usize], got: &[usize]) -> candle_core::Error {
    candle_core::Error::UnexpectedShape {
        msg: format!("shape mismatch for {name}"),
        expected: expected.into(),
        got: got.into(),
    }
    .bt()
}

/// Runs `f` until it is not [`Error::Busy`], for up to a minute: the tensor is held by a
/// writer (an exclusive host view, a move, a view of another tier) that ends moments later.
/// Readers never make each other busy; this waits only for a writer.
pub(crate) fn wait_for_writer<T>(mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut pause = std::time::Duration::from_micros(20);
    loop {
        match f() {
            Err(Error::Busy { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(1));
            }
            r => return r,
        }
    }
}

/// The tensor `id` (`info` its metadata) read from the store without promoting it, as a candle
/// tensor on `device`, converted as candle's safetensors loader converts it. The bytes are read
/// straight into the vector candle takes (on the CPU, candle keeps it: one copy from the store).
/// With `var`, a float tensor is made a candle variable (a `Var` of it shares its storage,
/// instead of copying it as `Var::from_tensor` copies a plain tensor).
pub(crate) fn read_tensor(
    store: &Store,
    name: &str,
    id: TensorId,
    info: &crate::TensorInfo,
    device: &Device,
    var: bool,
) -> candle_core::Result<Tensor> {
    let shape = info.shape.as_slice();
    macro_rules! typed {
        ($t:ty) => {{
            let values = wait_for_writer(|| store.read_in_place_as::<$t>(id))
                .map_err(|e| strata_err(name, e))?;
            made(values, shape, device, var)
        }};
    }
    match info.dtype {
        DType::U8 => typed!(u8),
        DType::U16 => {
            let narrow = wait_for_writer(|| store.read_in_place_as::<u16>(id))
                .map_err(|e| strata_err(name, e))?;
            made(narrow.into_iter().map(u32::from).collect(), shape, device, var)
        }
        DType::U32 => typed!(u32),
        DType::I16 => typed!(i16),
        DType::I32 => typed!(i32),
        DType::I64 => typed!(i64),
        DType::BF16 => typed!(half::bf16),
        DType::F16 => typed!(half::f16),
        DType::F32 => typed!(f32),
        DType::F64 => typed!(f64),
        _ => {
            let bytes =
                wait_for_writer(|| store.read_in_place(id)).map_err(|e| strata_err(name, e))?;
            tensor_from_bytes(name, &bytes, info.dtype, shape, device, var)
        }
    }
}

/// Calls `f` with a contiguous CPU tensor's elements as bytes (native order), borrowed from
/// candle's storage (no copy; a tensor that is a view starts at its offset). An error naming
/// `name` for a tensor that is not on the CPU, not contiguous, or not f32, bf16 or f16. `f` runs
/// under the storage's read lock: it must not write to `t` or to a tensor sharing its storage.
pub(crate) fn with_cpu_bytes<R>(
    name: &str,
    t: &Tensor,
    f: impl FnOnce(&[u8]) -> R,
) -> candle_core::Result<R> {
    use candle_core::{CpuStorage, Storage};
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{name}: not contiguous")))?;
    let bytes: &[u8] = match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => bytemuck::cast_slice(&v[start..end]),
        Storage::Cpu(CpuStorage::BF16(v)) => bytemuck::cast_slice(&v[start..end]),
        Storage::Cpu(CpuStorage::F16(v)) => bytemuck::cast_slice(&v[start..end]),
        Storage::Cpu(_) => candle_core::bail!("{name}: no bytes of a {:?} tensor", t.dtype()),
        _ => candle_core::bail!("{name}: not a CPU tensor"),
    };
    Ok(f(bytes))
}

/// A candle tensor on `device` holding a copy of `bytes`, a tensor of `dtype` and `shape` as
/// stored (native byte order), converted as candle's safetensors loader converts it. With `var`,
/// a candle variable (a `Var` of it shares its storage; made as it is made for f32, bf16, f16,
/// u16 and a dequantized block-quantized tensor, copied once more by `Var::from_tensor` for
/// another dtype).
pub(crate) fn tensor_from_bytes(
    name: &str,
    bytes: &[u8],
    dtype: DType,
    shape: &[usize],
    device: &Device,
    var: bool,
) -> candle_core::Result<Tensor> {
    let Some(cd) = candle_dtype(dtype) else { return Err(unsupported_dtype(name, dtype)) };
    fn values<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
        let mut v = Vec::with_capacity(b.len() / std::mem::size_of::<T>());
        extend_from_bytes(&mut v, b);
        v
    }
    if dtype.is_quantized() {
        let values =
            crate::base::quant::dequantize(dtype, bytes).map_err(|e| strata_err(name, e))?;
        return made(values, shape, device, var);
    }
    match dtype {
        DType::U16 => {
            let wide = bytes.chunks_exact(2).map(|b| u32::from(u16::from_ne_bytes([b[0], b[1]])));
            made(wide.collect(), shape, device, var)
        }
        DType::F32 if var => made(values::<f32>(bytes), shape, device, var),
        DType::BF16 if var => made(values::<half::bf16>(bytes), shape, device, var),
        DType::F16 if var => made(values::<half::f16>(bytes), shape, device, var),
        _ if var => {
            candle_core::Var::from_tensor(&Tensor::from_raw_buffer(bytes, cd, shape, device)?)
                .map(candle_core::Var::into_inner)
        }
        _ => Tensor::from_raw_buffer(bytes, cd, shape, device),
    }
}

/// A candle tensor of `values`, a candle variable with `var` (no copy of its own either way).
fn made<T: candle_core::WithDType>(
    values: Vec<T>,
    shape: &[usize],
    device: &Device,
    var: bool,
) -> candle_core::Result<Tensor> {
    if var {
        candle_core::Var::from_vec(values, shape, device).map(candle_core::Var::into_inner)
    } else {
        Tensor::from_vec(values, shape, device)
    }
}

/// Appends `bytes` (native byte order, whole elements) to `v`: cast where they are aligned for
/// `T`, else read element by element.
pub(crate) fn extend_from_bytes<T: bytemuck::Pod>(v: &mut Vec<T>, bytes: &[u8]) {
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(values) => v.extend_from_slice(values),
        Err(_) => v.extend(
            bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned::<T>),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_bytes_are_borrowed_from_the_view_and_refused_where_there_are_none() {
        let t = Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &Device::Cpu).unwrap();
        let row = t.narrow(0, 1, 1).unwrap();
        let got = with_cpu_bytes("row", &row, |b| b.to_vec()).unwrap();
        assert_eq!(got, bytemuck::cast_slice::<f32, u8>(&[3.0, 4.0]));
        let bf = t.to_dtype(candle_core::DType::BF16).unwrap();
        assert_eq!(with_cpu_bytes("bf", &bf, |b| b.len()).unwrap(), 12);
        let err = with_cpu_bytes("tr", &t.t().unwrap(), |_| ()).unwrap_err().to_string();
        assert!(err.contains("tr: not contiguous"), "{err}");
        let ids = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        let err = with_cpu_bytes("ids", &ids, |_| ()).unwrap_err().to_string();
        assert!(err.contains("ids: no bytes of a U32 tensor"), "{err}");
    }
}
