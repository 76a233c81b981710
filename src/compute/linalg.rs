//! Dense linear algebra over store tensors, for out-of-core training loops: GEMMs in bf16 or f32
//! with f32 accumulation (cuBLAS on the CUDA backend, a reference loop on the host backend), the
//! elementwise steps of a relu MLP with a squared-error loss, gradient accumulation in f32 and
//! an SGD update, reading weights through [`DeviceView`]s.
//!
//! Matrices are row-major. A linear layer's weight `W` is `[out, in]`; `linear` computes
//! `y = x Wᵀ`, `linear_grad_input` `dx = dy W`, `linear_grad_weight` `dW = dyᵀ x`, as
//! `torch.nn.Linear` does. Activations and gradients are [`Matrix`] scratch buffers that live
//! outside the store; [`Linalg::copy_to_view`] and [`Linalg::copy_from_view`] move them in and
//! out of store tensors. The element type is [`Float`]: `half::bf16` or `f32`.
//!
//! The host backend's GEMM is a plain triple loop (sum in f32 in index order, one rounding at
//! the end): it is for checking out-of-core loops against all-resident ones on small models,
//! not for speed. cuBLAS sums in its own order, so host and CUDA results differ in the last bits;
//! within one backend the same calls give the same bits. The elementwise kernels round exactly
//! as the host code does.
//!
//! ```
//! use half::bf16;
//! use strata::linalg::Linalg;
//! use strata::{DType, Store, Tier};
//!
//! # fn main() -> strata::Result<()> {
//! let store = Store::builder().host_backend().capacity(Tier::Device, 1 << 20).build()?;
//! let s = store.stream()?;
//! let la = Linalg::new(&store, &s)?;
//! // W = [[1, 2], [3, 4]] (f32), x = [[1, -1]]: y = x Wᵀ = [[-1, -1]], relu(y) = [[0, 0]].
//! let w: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_ne_bytes()).collect();
//! let id = store.put("w", DType::F32, &[2, 2], &w)?;
//! let view = store.device_view(id, &s)?;
//! let mut x = la.matrix::<f32>(1, 2)?;
//! la.upload(&mut x, &[1.0, -1.0])?;
//! let mut y = la.matrix::<f32>(1, 2)?;
//! la.linear(&x, &view, &mut y)?;
//! assert_eq!(la.download(&y)?, [-1.0, -1.0]);
//! la.relu(&mut y)?;
//! assert_eq!(la.download(&y)?, [0.0, 0.0]);
//! # Ok(()) }
//! ```

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::bf16;

use crate::backend::cuda::programs::{self, GpuFloat, Mlp, Op};
use crate::backend::sim::SimClock;
use crate::base::error::{Error, Result};
use crate::base::types::DType;
use crate::{DeviceView, Store, Stream};

/// Blocks of the loss kernel, and so the length of its partial sums (see [`Linalg::loss_grad`]).
pub const LOSS_PARTIALS: usize = programs::LOSS_PARTIALS;

/// An element type of [`Matrix`] and of the weights [`Linalg`] reads: `half::bf16` or `f32`
/// (the float [`Element`](crate::Element)s the GEMMs and kernels take).
pub trait Float:
    crate::Element + GpuFloat + Default + DeviceRepr + ValidAsZeroBits + Unpin
{
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Narrows from f32, rounding to nearest even (exact for f32).
    fn from_f32(f: f32) -> Self;
    /// Values from native-endian bytes (a trailing partial value is ignored).
    fn from_ne_bytes(bytes: &[u8]) -> Vec<Self>;
    /// Writes values as native-endian bytes into `out` (`size_of::<Self>() * vals.len()` long).
    fn write_ne_bytes(vals: &[Self], out: &mut [u8]);
}

impl Float for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(f: f32) -> bf16 {
        narrow(f)
    }
    fn from_ne_bytes(bytes: &[u8]) -> Vec<bf16> {
        bytes.chunks_exact(2).map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]]))).collect()
    }
    fn write_ne_bytes(vals: &[bf16], out: &mut [u8]) {
        for (c, v) in out.chunks_exact_mut(2).zip(vals) {
            c.copy_from_slice(&v.to_bits().to_ne_bytes());
        }
    }
}

impl Float for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(f: f32) -> f32 {
        f
    }
    fn from_ne_bytes(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
    fn write_ne_bytes(vals: &[f32], out: &mut [u8]) {
        for (c, v) in out.chunks_exact_mut(4).zip(vals) {
            c.copy_from_slice(&v.to_ne_bytes());
        }
    }
}

/// A row-major matrix of scratch memory (device memory on CUDA, host memory on the host
/// backend), for activations and gradients.
pub struct Matrix<T: Float = bf16> {
    rows: usize,
    cols: usize,
    data: Data<T>,
}

enum Data<T: Float> {
    Cuda(CudaSlice<T>),
    Host(Vec<T>),
}

impl<T: Float> Matrix<T> {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes of memory it takes.
    pub fn len_bytes(&self) -> u64 {
        (self.rows * self.cols * std::mem::size_of::<T>()) as u64
    }
    fn len(&self) -> usize {
        self.rows * self.cols
    }
    fn host(&self) -> Result<&[T]> {
        match &self.data {
            Data::Host(v) => Ok(v),
            Data::Cuda(_) => Err(Error::BackendMismatch("a device matrix on the host path".into())),
        }
    }
    fn host_mut(&mut self) -> Result<&mut [T]> {
        match &mut self.data {
            Data::Host(v) => Ok(v),
            Data::Cuda(_) => Err(Error::BackendMismatch("a device matrix on the host path".into())),
        }
    }
    fn dev(&self) -> Result<&CudaSlice<T>> {
        match &self.data {
            Data::Cuda(s) => Ok(s),
            Data::Host(_) => Err(Error::BackendMismatch("a host matrix on the CUDA path".into())),
        }
    }
    fn dev_mut(&mut self) -> Result<&mut CudaSlice<T>> {
        match &mut self.data {
            Data::Cuda(s) => Ok(s),
            Data::Host(_) => Err(Error::BackendMismatch("a host matrix on the CUDA path".into())),
        }
    }
}

struct CudaLinalg {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Mlp,
}

/// GEMMs and elementwise work on one stream of a store's backend.
pub struct Linalg {
    cuda: Option<CudaLinalg>,
    stream: Stream,
    /// The simulated clock of a [simulated](crate::StoreBuilder::simulate) store: host work is
    /// charged to the stream as the device time it stands for.
    sim: Option<Arc<SimClock>>,
}

fn shape_err(what: &str) -> Error {
    Error::InvalidArgument(format!("matrix shapes do not fit: {what}"))
}

/// Round-to-nearest-even narrowing, as the CUDA kernels do (`cuda/bf16.cuh`'s `f32_to_bf16`;
/// `half`'s `from_f32` rounds the same way and keeps a NaN a quiet NaN, as both do; written out
/// so both sides visibly match).
fn narrow(f: f32) -> bf16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return bf16::from_bits(((u >> 16) | 0x40) as u16);
    }
    bf16::from_bits((u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16) as u16)
}

/// `c[m×n] = a · b` on the host, with `a(i, p)` and `b(p, j)` given as closures, summing in f32
/// in order of `p`.
fn host_gemm<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    a: impl Fn(usize, usize) -> f32,
    b: impl Fn(usize, usize) -> f32,
    c: &mut [T],
) {
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for p in 0..k {
                acc += a(i, p) * b(p, j);
            }
            c[i * n + j] = T::from_f32(acc);
        }
    }
}

impl Linalg {
    /// Linear algebra on `stream` (a stream of `store`'s backend). On CUDA this compiles the
    /// elementwise kernels with NVRTC and opens a cuBLAS handle bound to the stream.
    pub fn new(store: &Store, stream: &Stream) -> Result<Linalg> {
        store.check_stream(stream)?;
        let Some(ctx) = store.cuda_context() else {
            let sim = store.sim_clock();
            return Ok(Linalg { cuda: None, stream: stream.clone(), sim });
        };
        let s = stream
            .cuda()
            .ok_or_else(|| Error::BackendMismatch("a host stream with a CUDA store".into()))?
            .clone();
        if !crate::backend::cuda::lib_present(crate::backend::cuda::Lib::Cublas) {
            return Err(Error::Cuda {
                call: "cublas",
                message: "libcublas.so was not found".into(),
            });
        }
        let k = Mlp::load(ctx)?;
        let blas = CudaBlas::new(s.clone())
            .map_err(|e| Error::Cuda { call: "cublasCreate", message: e.to_string() })?;
        Ok(Linalg {
            cuda: Some(CudaLinalg { stream: s, blas, k }),
            stream: stream.clone(),
            sim: None,
        })
    }

    /// Simulated store: charges the stream with the device time of `flops` of GEMM, `bytes` of
    /// elementwise traffic on store tensors and weight-shaped operands, and `matrix_bytes` on
    /// matrices (the host has just done the work itself).
    fn charge(&self, flops: usize, bytes: u64, matrix_bytes: u64) {
        if let Some(c) = &self.sim {
            let secs = c.kernel_seconds(flops as f64, bytes as f64, matrix_bytes as f64);
            self.stream.raw.advance(secs);
        }
    }

    /// The stream the work runs on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// A `rows × cols` matrix of zeros.
    pub fn matrix<T: Float>(&self, rows: usize, cols: usize) -> Result<Matrix<T>> {
        let n = rows.checked_mul(cols).ok_or_else(|| shape_err("rows × cols overflows"))?;
        let data = match &self.cuda {
            Some(c) => Data::Cuda(
                c.stream.alloc_zeros::<T>(n).map_err(|e| Error::cuda("cuMemAllocAsync", e))?,
            ),
            None => Data::Host(vec![T::default(); n]),
        };
        Ok(Matrix { rows, cols, data })
    }

    /// Copies `values` (row-major, `rows × cols` of them) into `m`.
    pub fn upload<T: Float>(&self, m: &mut Matrix<T>, values: &[T]) -> Result<()> {
        if values.len() != m.len() {
            return Err(shape_err("upload length"));
        }
        match &self.cuda {
            Some(c) => c
                .stream
                .memcpy_htod(values, m.dev_mut()?)
                .map_err(|e| Error::cuda("cuMemcpyHtoDAsync", e)),
            None => {
                m.host_mut()?.copy_from_slice(values);
                Ok(())
            }
        }
    }

    /// The matrix's values, once the work issued before has run.
    pub fn download<T: Float>(&self, m: &Matrix<T>) -> Result<Vec<T>> {
        match &self.cuda {
            Some(c) => {
                c.stream.synchronize().map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
                c.stream.clone_dtoh(m.dev()?).map_err(|e| Error::cuda("cuMemcpyDtoH", e))
            }
            None => {
                if self.sim.is_some() {
                    // As a device-to-host copy would, wait for the work issued before.
                    self.stream.synchronize()?;
                }
                Ok(m.host()?.to_vec())
            }
        }
    }

    /// Sets every element of `m` to `v` (rounded to `T`).
    pub fn fill<T: Float>(&self, m: &mut Matrix<T>, v: f32) -> Result<()> {
        let v = T::from_f32(v);
        match &self.cuda {
            Some(c) => c.k.fill(&c.stream, &mut m.dev_mut()?.as_view_mut(), v),
            None => {
                self.charge(0, 0, m.len_bytes());
                m.host_mut()?.fill(v);
                Ok(())
            }
        }
    }

    /// `y = x · Wᵀ`: `x` is `rows × in`, the view's tensor `W` is `out × in` of `T`, `y` is
    /// `rows × out`.
    pub fn linear<T: Float>(&self, x: &Matrix<T>, w: &DeviceView, y: &mut Matrix<T>) -> Result<()> {
        self.check_stream(w)?;
        let (rows, inp, out) = (x.rows, x.cols, y.cols);
        check_weight::<T>(w, out, inp)?;
        if y.rows != rows {
            return Err(shape_err("linear: y rows"));
        }
        match &self.cuda {
            Some(c) => {
                let wv = w.cuda_view::<T>().ok_or_else(|| shape_err("weight view"))?;
                // Column-major: yᵀ[out×rows] = W[out×in] · xᵀ[in×rows]; W's memory is Wᵀ in
                // column-major, hence transa = T.
                let (xv, mut yv) = (x.dev()?.as_view(), y.dev_mut()?.as_view_mut());
                programs::gemm(
                    &c.blas,
                    [Op::T, Op::N],
                    [out, rows, inp],
                    [inp, inp, out],
                    &wv,
                    &xv,
                    &mut yv,
                )
            }
            None => {
                self.charge(2 * rows * out * inp, 0, 0);
                let wb = w.with_host_bytes(T::from_ne_bytes)?;
                let xb = x.host()?;
                host_gemm(
                    rows,
                    out,
                    inp,
                    |i, p| xb[i * inp + p].to_f32(),
                    |p, j| wb[j * inp + p].to_f32(),
                    y.host_mut()?,
                );
                Ok(())
            }
        }
    }

    /// `dx = dy · W`: `dy` is `rows × out`, `W` is `out × in`, `dx` is `rows × in`.
    pub fn linear_grad_input<T: Float>(
        &self,
        dy: &Matrix<T>,
        w: &DeviceView,
        dx: &mut Matrix<T>,
    ) -> Result<()> {
        self.check_stream(w)?;
        let (rows, out, inp) = (dy.rows, dy.cols, dx.cols);
        check_weight::<T>(w, out, inp)?;
        if dx.rows != rows {
            return Err(shape_err("grad input: dx rows"));
        }
        match &self.cuda {
            Some(c) => {
                let wv = w.cuda_view::<T>().ok_or_else(|| shape_err("weight view"))?;
                // dxᵀ[in×rows] = Wᵀ[in×out] · dyᵀ[out×rows].
                let (dyv, mut dxv) = (dy.dev()?.as_view(), dx.dev_mut()?.as_view_mut());
                programs::gemm(
                    &c.blas,
                    [Op::N, Op::N],
                    [inp, rows, out],
                    [inp, out, inp],
                    &wv,
                    &dyv,
                    &mut dxv,
                )
            }
            None => {
                self.charge(2 * rows * out * inp, 0, 0);
                let wb = w.with_host_bytes(T::from_ne_bytes)?;
                let g = dy.host()?;
                host_gemm(
                    rows,
                    inp,
                    out,
                    |i, p| g[i * out + p].to_f32(),
                    |p, j| wb[p * inp + j].to_f32(),
                    dx.host_mut()?,
                );
                Ok(())
            }
        }
    }

    /// `dW = dyᵀ · x`: `dy` is `rows × out`, `x` is `rows × in`, `dw` is `out × in`.
    pub fn linear_grad_weight<T: Float>(
        &self,
        dy: &Matrix<T>,
        x: &Matrix<T>,
        dw: &mut Matrix<T>,
    ) -> Result<()> {
        let (rows, out, inp) = (dy.rows, dy.cols, x.cols);
        if x.rows != rows || dw.rows != out || dw.cols != inp {
            return Err(shape_err("grad weight"));
        }
        match &self.cuda {
            Some(c) => {
                // dWᵀ[in×out] = xᵀ[in×rows] · dy[rows×out]; dy's memory is dyᵀ column-major.
                let (xv, dyv) = (x.dev()?.as_view(), dy.dev()?.as_view());
                programs::gemm(
                    &c.blas,
                    [Op::N, Op::T],
                    [inp, out, rows],
                    [inp, out, inp],
                    &xv,
                    &dyv,
                    &mut dw.dev_mut()?.as_view_mut(),
                )
            }
            None => {
                self.charge(2 * rows * out * inp, 0, 0);
                let (g, xb) = (dy.host()?, x.host()?);
                host_gemm(
                    out,
                    inp,
                    rows,
                    |i, p| g[p * out + i].to_f32(),
                    |p, j| xb[p * inp + j].to_f32(),
                    dw.host_mut()?,
                );
                Ok(())
            }
        }
    }

    /// `W -= lr · dW` on a bf16 weight's device copy, in f32, rounded once to bf16; marks the
    /// view dirty (the store writes the new weight back when it evicts it).
    pub fn sgd(&self, w: &mut DeviceView, dw: &Matrix<bf16>, lr: f32) -> Result<()> {
        self.check_stream(w)?;
        check_weight::<bf16>(w, dw.rows, dw.cols)?;
        match &self.cuda {
            Some(c) => {
                let mut wv = w.cuda_view_mut::<bf16>().ok_or_else(|| shape_err("weight view"))?;
                c.k.sgd_bf16(&c.stream, &mut wv, &dw.dev()?.as_view(), lr)
            }
            None => {
                self.charge(0, 3 * dw.len_bytes(), 0);
                let g = dw.host()?;
                w.with_host_bytes_mut(|bytes| {
                    for (c, gv) in bytes.chunks_exact_mut(2).zip(g) {
                        let wv = bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32();
                        let nv = narrow(wv - lr * gv.to_f32());
                        c.copy_from_slice(&nv.to_bits().to_ne_bytes());
                    }
                })
            }
        }
    }

    /// `x = max(x, 0)`, in place.
    pub fn relu<T: Float>(&self, x: &mut Matrix<T>) -> Result<()> {
        match &self.cuda {
            Some(c) => c.k.relu(&c.stream, &mut x.dev_mut()?.as_view_mut()),
            None => {
                self.charge(0, 0, 2 * x.len_bytes());
                for v in x.host_mut()? {
                    if !positive(v.to_f32()) {
                        *v = T::from_f32(0.0);
                    }
                }
                Ok(())
            }
        }
    }

    /// `g = a > 0 ? g : 0`: the gradient through a relu whose output is `a`.
    pub fn relu_mask<T: Float>(&self, g: &mut Matrix<T>, a: &Matrix<T>) -> Result<()> {
        if g.rows != a.rows || g.cols != a.cols {
            return Err(shape_err("relu mask"));
        }
        match &self.cuda {
            Some(c) => {
                c.k.relu_mask(&c.stream, &mut g.dev_mut()?.as_view_mut(), &a.dev()?.as_view())
            }
            None => {
                self.charge(0, 0, 3 * g.len_bytes());
                let a = a.host()?;
                for (v, a) in g.host_mut()?.iter_mut().zip(a) {
                    if !positive(a.to_f32()) {
                        *v = T::from_f32(0.0);
                    }
                }
                Ok(())
            }
        }
    }

    /// The squared-error loss's gradient and value: `g = (out − y) · scale`, and
    /// `Σ (out − y)²` (in f32) added into `partials`, a `1 × LOSS_PARTIALS` matrix that
    /// [`loss_value`] sums. With `scale = 1 / R` and the loss `0.5 · Σ(out − y)² / R`, `g` is the
    /// loss's gradient with respect to `out`.
    pub fn loss_grad<T: Float>(
        &self,
        out: &Matrix<T>,
        y: &Matrix<T>,
        scale: f32,
        g: &mut Matrix<T>,
        partials: &mut Matrix<f32>,
    ) -> Result<()> {
        if out.rows != y.rows || out.cols != y.cols || g.rows != y.rows || g.cols != y.cols {
            return Err(shape_err("loss: out, y and g differ"));
        }
        if partials.len() != LOSS_PARTIALS {
            return Err(shape_err("loss partials are 1 × LOSS_PARTIALS"));
        }
        match &self.cuda {
            Some(c) => {
                let (ov, yv) = (out.dev()?.as_view(), y.dev()?.as_view());
                c.k.loss_grad(
                    &c.stream,
                    &ov,
                    &yv,
                    &mut g.dev_mut()?.as_view_mut(),
                    scale,
                    &mut partials.dev_mut()?.as_view_mut(),
                )
            }
            None => {
                self.charge(0, 0, 3 * out.len_bytes());
                let (o, yv) = (out.host()?, y.host()?);
                let mut acc = 0f32;
                for ((gv, o), yv) in g.host_mut()?.iter_mut().zip(o).zip(yv) {
                    let d = o.to_f32() - yv.to_f32();
                    acc += d * d;
                    *gv = T::from_f32(d * scale);
                }
                partials.host_mut()?[0] += acc;
                Ok(())
            }
        }
    }

    /// Accumulates a gradient into a store tensor: `grad = (first ? 0 : grad) + dw`. An f32
    /// `grad` accumulates any `T` (micro-batches in f32); a `grad` of `T` itself takes only
    /// `first` (a copy). Marks the view dirty.
    pub fn accumulate<T: Float>(
        &self,
        grad: &mut DeviceView,
        dw: &Matrix<T>,
        first: bool,
    ) -> Result<()> {
        self.check_stream(grad)?;
        let f32_acc = grad.dtype() == DType::F32;
        if !f32_acc && (grad.dtype() != T::DTYPE || !first) {
            return Err(Error::InvalidArgument(format!(
                "accumulating {} gradients needs an f32 tensor (got {})",
                T::DTYPE,
                grad.dtype()
            )));
        }
        let elem = if f32_acc { 4 } else { std::mem::size_of::<T>() };
        if grad.len_bytes() != dw.len() * elem {
            return Err(shape_err("gradient tensor and dW differ in length"));
        }
        match &self.cuda {
            Some(c) if f32_acc => {
                let mut gv = grad.cuda_view_mut::<f32>().ok_or_else(|| shape_err("grad view"))?;
                c.k.accumulate(&c.stream, &mut gv, &dw.dev()?.as_view(), first)
            }
            Some(c) => {
                let mut gv = grad.cuda_view_mut::<T>().ok_or_else(|| shape_err("grad view"))?;
                c.stream
                    .memcpy_dtod(dw.dev()?, &mut gv)
                    .map_err(|e| Error::cuda("cuMemcpyDtoDAsync", e))
            }
            None => {
                self.charge(0, 2 * grad.len_bytes() as u64 + dw.len_bytes(), 0);
                let d = dw.host()?;
                grad.with_host_bytes_mut(|bytes| {
                    if !f32_acc {
                        T::write_ne_bytes(d, bytes);
                        return;
                    }
                    for (c, v) in bytes.chunks_exact_mut(4).zip(d) {
                        let old = f32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
                        let new = if first { v.to_f32() } else { old + v.to_f32() };
                        c.copy_from_slice(&new.to_ne_bytes());
                    }
                })
            }
        }
    }

    /// Copies a matrix into a store tensor of the same type and size (an activation kept in
    /// the store); marks the view dirty.
    pub fn copy_to_view<T: Float>(&self, src: &Matrix<T>, dst: &mut DeviceView) -> Result<()> {
        self.check_stream(dst)?;
        check_len::<T>(dst, src.len())?;
        match &self.cuda {
            Some(c) => {
                let mut dv = dst.cuda_view_mut::<T>().ok_or_else(|| shape_err("view"))?;
                c.stream
                    .memcpy_dtod(src.dev()?, &mut dv)
                    .map_err(|e| Error::cuda("cuMemcpyDtoDAsync", e))
            }
            None => {
                self.charge(0, src.len_bytes(), src.len_bytes());
                let s = src.host()?;
                dst.with_host_bytes_mut(|b| T::write_ne_bytes(s, b))
            }
        }
    }

    /// Copies a store tensor of the same type and size into a matrix.
    pub fn copy_from_view<T: Float>(&self, src: &DeviceView, dst: &mut Matrix<T>) -> Result<()> {
        self.check_stream(src)?;
        check_len::<T>(src, dst.len())?;
        match &self.cuda {
            Some(c) => {
                let sv = src.cuda_view::<T>().ok_or_else(|| shape_err("view"))?;
                c.stream
                    .memcpy_dtod(&sv, dst.dev_mut()?)
                    .map_err(|e| Error::cuda("cuMemcpyDtoDAsync", e))
            }
            None => {
                self.charge(0, dst.len_bytes(), dst.len_bytes());
                let v = src.with_host_bytes(T::from_ne_bytes)?;
                dst.host_mut()?.copy_from_slice(&v);
                Ok(())
            }
        }
    }

    /// Views must belong to this stream: it is the one `device_view` made wait for the copy
    /// that brought the bytes.
    fn check_stream(&self, w: &DeviceView) -> Result<()> {
        if !w.stream().same_as(&self.stream) {
            return Err(Error::InvalidArgument(
                "the weight's view was made for another stream than this Linalg's".into(),
            ));
        }
        Ok(())
    }

    /// Blocks until the work issued so far has run.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }
}

/// The loss `0.5 · Σ partials · scale` from the partial sums [`Linalg::loss_grad`] added up
/// (downloaded), summed in index order. With `scale = 1 / R` it is `0.5 · Σ(out − y)² / R`.
pub fn loss_value(partials: &[f32], scale: f32) -> f32 {
    0.5 * partials.iter().sum::<f32>() * scale
}

/// `v > 0` (false for NaN), as the kernels test it.
fn positive(v: f32) -> bool {
    v.partial_cmp(&0.0) == Some(std::cmp::Ordering::Greater)
}

fn check_len<T: Float>(v: &DeviceView, elems: usize) -> Result<()> {
    if v.dtype() != T::DTYPE || v.len_bytes() != elems * std::mem::size_of::<T>() {
        return Err(shape_err(&format!(
            "a {} tensor of {} bytes for {elems} elements of {}",
            v.dtype(),
            v.len_bytes(),
            T::DTYPE
        )));
    }
    Ok(())
}

fn check_weight<T: Float>(w: &DeviceView, out: usize, inp: usize) -> Result<()> {
    let want = out.checked_mul(inp).and_then(|n| n.checked_mul(std::mem::size_of::<T>()));
    if want != Some(w.len_bytes()) || w.dtype() != T::DTYPE {
        return Err(shape_err(&format!(
            "weight of {} bytes ({}) for a {out}×{inp} {} matrix",
            w.len_bytes(),
            w.dtype(),
            T::DTYPE
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_rounds_to_nearest_even_like_half() {
        for f in [0.0f32, 1.0, -2.5, 3.25, 1e-3, 65504.0, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 512.0] {
            assert_eq!(narrow(f), bf16::from_f32(f), "{f}");
        }
        // NaNs, the one GPU arithmetic makes (0x7fffffff) first: the rounding's carry once made
        // it -0.0. Infinities round to themselves.
        for bits in [0x7fff_ffffu32, 0xffff_ffff, 0x7fc0_0000, 0x7f80_0001, 0xff80_0001] {
            let f = f32::from_bits(bits);
            assert_eq!(narrow(f).to_bits(), bf16::from_f32(f).to_bits(), "{bits:#x}");
            assert!(narrow(f).is_nan(), "{bits:#x}");
        }
        for f in [f32::INFINITY, f32::NEG_INFINITY, f32::MAX] {
            assert_eq!(narrow(f).to_bits(), bf16::from_f32(f).to_bits(), "{f}");
        }
    }

    #[test]
    fn host_gemms_match_small_hand_examples() {
        let store =
            Store::builder().host_backend().capacity(crate::Tier::Device, 1 << 20).build().unwrap();
        let s = store.stream().unwrap();
        let la = Linalg::new(&store, &s).unwrap();
        // W = [[1, 2], [3, 4], [5, 6]] (out 3 × in 2); x = [[1, 1]] (rows 1 × in 2).
        let w: Vec<bf16> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].map(bf16::from_f32).to_vec();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_bits().to_ne_bytes()).collect();
        let id = store.put("w", crate::DType::BF16, &[3, 2], &bytes).unwrap();
        let mut view = store.device_view(id, &s).unwrap();
        let mut x = la.matrix(1, 2).unwrap();
        la.upload(&mut x, &[bf16::ONE, bf16::ONE]).unwrap();
        let mut y = la.matrix(1, 3).unwrap();
        la.linear(&x, &view, &mut y).unwrap();
        assert_eq!(la.download(&y).unwrap(), [3.0f32, 7.0, 11.0].map(bf16::from_f32));
        let mut dx = la.matrix(1, 2).unwrap();
        la.linear_grad_input(&y, &view, &mut dx).unwrap(); // [3,7,11]·W = [3+21+55, 6+28+66]
        assert_eq!(la.download(&dx).unwrap(), [79.0f32, 100.0].map(bf16::from_f32));
        let mut dw = la.matrix(3, 2).unwrap();
        la.linear_grad_weight(&y, &x, &mut dw).unwrap(); // yᵀ·x = [[3,3],[7,7],[11,11]]
        assert_eq!(
            la.download(&dw).unwrap(),
            [3.0f32, 3.0, 7.0, 7.0, 11.0, 11.0].map(bf16::from_f32)
        );
        la.sgd(&mut view, &dw, 0.5).unwrap();
        drop(view);
        let got = <bf16 as Float>::from_ne_bytes(&store.read(id).unwrap());
        assert_eq!(got, [-0.5f32, 0.5, -0.5, 0.5, -0.5, 0.5].map(bf16::from_f32));
        let mut wrong = la.matrix(1, 2).unwrap();
        let v = store.device_view(id, &s).unwrap();
        assert!(la.linear(&dx, &v, &mut wrong).is_err(), "W is 3×2, y must have 3 columns");
    }
}
