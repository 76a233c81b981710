//! Dense linear algebra over store tensors, for out-of-core training loops: bf16 GEMMs with f32
//! accumulation (cuBLAS on the CUDA backend, a reference loop on the host backend) and an SGD
//! update, reading weights through [`DeviceView`]s.
//!
//! Matrices are row-major. A linear layer's weight `W` is `[out, in]`; `linear` computes
//! `y = x Wᵀ`, `linear_grad_input` `dx = dy W`, `linear_grad_weight` `dW = dyᵀ x`, as
//! `torch.nn.Linear` does. Activations and gradients are [`Matrix`] scratch buffers that live
//! outside the store.
//!
//! The host backend's GEMM is a plain triple loop (sum in f32 in index order, one bf16 rounding
//! at the end): it is for checking out-of-core loops against all-resident ones on small models,
//! not for speed. cuBLAS sums in its own order, so host and CUDA results differ in the last bits;
//! within one backend the same calls give the same bits.

use std::sync::Arc;

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use half::bf16;

use crate::error::{Error, Result};
use crate::store::Store;
use crate::view::{DeviceView, Stream};

const SOURCE: &str = include_str!("../../cuda/mlp.cu");

/// A row-major bf16 matrix of scratch memory (device memory on CUDA, host memory on the host
/// backend), for activations and gradients.
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Data,
}

enum Data {
    Cuda(CudaSlice<bf16>),
    Host(Vec<bf16>),
}

impl Matrix {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    fn host(&self) -> Result<&[bf16]> {
        match &self.data {
            Data::Host(v) => Ok(v),
            Data::Cuda(_) => Err(Error::BackendMismatch("a device matrix on the host path".into())),
        }
    }
    fn host_mut(&mut self) -> Result<&mut [bf16]> {
        match &mut self.data {
            Data::Host(v) => Ok(v),
            Data::Cuda(_) => Err(Error::BackendMismatch("a device matrix on the host path".into())),
        }
    }
    fn dev(&self) -> Result<&CudaSlice<bf16>> {
        match &self.data {
            Data::Cuda(s) => Ok(s),
            Data::Host(_) => Err(Error::BackendMismatch("a host matrix on the CUDA path".into())),
        }
    }
    fn dev_mut(&mut self) -> Result<&mut CudaSlice<bf16>> {
        match &mut self.data {
            Data::Cuda(s) => Ok(s),
            Data::Host(_) => Err(Error::BackendMismatch("a host matrix on the CUDA path".into())),
        }
    }
}

struct CudaLinalg {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    _module: Arc<CudaModule>,
    sgd: CudaFunction,
    fill: CudaFunction,
}

/// GEMMs and updates on one stream of a store's backend.
pub struct Linalg {
    cuda: Option<CudaLinalg>,
    stream: Stream,
}

fn shape_err(what: &str) -> Error {
    Error::InvalidArgument(format!("matrix shapes do not fit: {what}"))
}

/// bf16 from bits, and the bytes of a view as bf16 values (native byte order).
fn to_bf16(bytes: &[u8]) -> Vec<bf16> {
    bytes.chunks_exact(2).map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]]))).collect()
}

/// Round-to-nearest-even narrowing, as the CUDA kernels do (`half`'s `from_f32` rounds the same
/// way; written out so both sides visibly match).
fn narrow(f: f32) -> bf16 {
    let u = f.to_bits();
    bf16::from_bits((u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16) as u16)
}

/// `c[m×n] = a · b` on the host, with `a(i, p)` and `b(p, j)` given as closures, summing in f32
/// in order of `p`.
fn host_gemm(
    m: usize,
    n: usize,
    k: usize,
    a: impl Fn(usize, usize) -> f32,
    b: impl Fn(usize, usize) -> f32,
    c: &mut [bf16],
) {
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for p in 0..k {
                acc += a(i, p) * b(p, j);
            }
            c[i * n + j] = narrow(acc);
        }
    }
}

impl Linalg {
    /// Linear algebra on `stream` (a stream of `store`'s backend). On CUDA this compiles the
    /// elementwise kernels with NVRTC and opens a cuBLAS handle bound to the stream.
    pub fn new(store: &Store, stream: &Stream) -> Result<Linalg> {
        let Some(ctx) = store.cuda_context() else {
            if stream.cuda().is_some() {
                return Err(Error::BackendMismatch("a CUDA stream with a host store".into()));
            }
            return Ok(Linalg { cuda: None, stream: stream.clone() });
        };
        let s = stream
            .cuda()
            .ok_or_else(|| Error::BackendMismatch("a host stream with a CUDA store".into()))?
            .clone();
        // SAFETY: only tries to dlopen the library and closes it again.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::Cuda {
                call: "cublas",
                message: "libcublas.so was not found".into(),
            });
        }
        let (module, [sgd, fill]) =
            super::cuda::load_kernels(ctx, SOURCE, ["strata_sgd_bf16", "strata_fill_bf16"])?;
        let blas = CudaBlas::new(s.clone())
            .map_err(|e| Error::Cuda { call: "cublasCreate", message: e.to_string() })?;
        Ok(Linalg {
            cuda: Some(CudaLinalg { stream: s, blas, _module: module, sgd, fill }),
            stream: stream.clone(),
        })
    }

    /// The stream the work runs on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// A `rows × cols` matrix of zeros.
    pub fn matrix(&self, rows: usize, cols: usize) -> Result<Matrix> {
        let n = rows.checked_mul(cols).ok_or_else(|| shape_err("rows × cols overflows"))?;
        let data = match &self.cuda {
            Some(c) => Data::Cuda(
                c.stream.alloc_zeros::<bf16>(n).map_err(|e| Error::cuda("cuMemAllocAsync", e))?,
            ),
            None => Data::Host(vec![bf16::ZERO; n]),
        };
        Ok(Matrix { rows, cols, data })
    }

    /// Copies `values` (row-major, `rows × cols` of them) into `m`.
    pub fn upload(&self, m: &mut Matrix, values: &[bf16]) -> Result<()> {
        if values.len() != m.rows * m.cols {
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
    pub fn download(&self, m: &Matrix) -> Result<Vec<bf16>> {
        match &self.cuda {
            Some(c) => {
                c.stream.synchronize().map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
                c.stream.clone_dtoh(m.dev()?).map_err(|e| Error::cuda("cuMemcpyDtoH", e))
            }
            None => Ok(m.host()?.to_vec()),
        }
    }

    /// Sets every element of `m` to `v`.
    pub fn fill(&self, m: &mut Matrix, v: f32) -> Result<()> {
        let bits = narrow(v).to_bits();
        match &self.cuda {
            Some(c) => {
                let n = (m.rows * m.cols) as u64;
                let mut b = c.stream.launch_builder(&c.fill);
                b.arg(m.dev_mut()?).arg(&bits).arg(&n);
                // SAFETY: (u16*, u16, u64): the matrix's `n` elements and two scalars.
                unsafe { b.launch(grid(n)) }.map_err(|e| Error::cuda("cuLaunchKernel", e))?;
                Ok(())
            }
            None => {
                m.host_mut()?.fill(bf16::from_bits(bits));
                Ok(())
            }
        }
    }

    /// `y = x · Wᵀ`: `x` is `rows × in`, the view's tensor `W` is `out × in` bf16, `y` is
    /// `rows × out`.
    pub fn linear(&self, x: &Matrix, w: &DeviceView, y: &mut Matrix) -> Result<()> {
        self.check_stream(w)?;
        let (rows, inp, out) = (x.rows, x.cols, y.cols);
        check_weight(w, out, inp)?;
        if y.rows != rows {
            return Err(shape_err("linear: y rows"));
        }
        match &self.cuda {
            Some(c) => {
                let wv = w.cuda_view::<bf16>().ok_or_else(|| shape_err("weight view"))?;
                // Column-major: yᵀ[out×rows] = W[out×in] · xᵀ[in×rows]; W's memory is Wᵀ in
                // column-major, hence transa = T.
                let cfg = gemm_cfg(
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    out,
                    rows,
                    inp,
                    inp,
                    inp,
                    out,
                )?;
                // SAFETY: the dimensions and leading dimensions describe exactly the three
                // buffers (W out×in, x rows×in, y rows×out, checked above); all are device
                // memory on the handle's stream (the view's memory is held by the view).
                unsafe { c.blas.gemm(cfg, &wv, x.dev()?, y.dev_mut()?) }
                    .map_err(|e| Error::Cuda { call: "cublasGemmEx", message: e.to_string() })
            }
            None => {
                let wb = w.with_host_bytes(to_bf16)?;
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
    pub fn linear_grad_input(&self, dy: &Matrix, w: &DeviceView, dx: &mut Matrix) -> Result<()> {
        self.check_stream(w)?;
        let (rows, out, inp) = (dy.rows, dy.cols, dx.cols);
        check_weight(w, out, inp)?;
        if dx.rows != rows {
            return Err(shape_err("grad input: dx rows"));
        }
        match &self.cuda {
            Some(c) => {
                let wv = w.cuda_view::<bf16>().ok_or_else(|| shape_err("weight view"))?;
                // dxᵀ[in×rows] = Wᵀ[in×out] · dyᵀ[out×rows].
                let cfg = gemm_cfg(
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_N,
                    inp,
                    rows,
                    out,
                    inp,
                    out,
                    inp,
                )?;
                // SAFETY: as in `linear`, for W out×in, dy rows×out, dx rows×in.
                unsafe { c.blas.gemm(cfg, &wv, dy.dev()?, dx.dev_mut()?) }
                    .map_err(|e| Error::Cuda { call: "cublasGemmEx", message: e.to_string() })
            }
            None => {
                let wb = w.with_host_bytes(to_bf16)?;
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
    pub fn linear_grad_weight(&self, dy: &Matrix, x: &Matrix, dw: &mut Matrix) -> Result<()> {
        let (rows, out, inp) = (dy.rows, dy.cols, x.cols);
        if x.rows != rows || dw.rows != out || dw.cols != inp {
            return Err(shape_err("grad weight"));
        }
        match &self.cuda {
            Some(c) => {
                // dWᵀ[in×out] = xᵀ[in×rows] · dy[rows×out]; dy's memory is dyᵀ column-major.
                let cfg = gemm_cfg(
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_T,
                    inp,
                    out,
                    rows,
                    inp,
                    out,
                    inp,
                )?;
                // SAFETY: x rows×in, dy rows×out, dW out×in: the dimensions match the buffers.
                unsafe { c.blas.gemm(cfg, x.dev()?, dy.dev()?, dw.dev_mut()?) }
                    .map_err(|e| Error::Cuda { call: "cublasGemmEx", message: e.to_string() })
            }
            None => {
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

    /// `W -= lr · dW` on the weight's device copy, in f32, rounded once to bf16; marks the view
    /// dirty (the store writes the new weight back when it evicts it).
    pub fn sgd(&self, w: &mut DeviceView, dw: &Matrix, lr: f32) -> Result<()> {
        self.check_stream(w)?;
        check_weight(w, dw.rows, dw.cols)?;
        match &self.cuda {
            Some(c) => {
                let n = (dw.rows * dw.cols) as u64;
                let mut wv = w.cuda_view_mut::<bf16>().ok_or_else(|| shape_err("weight view"))?;
                let mut b = c.stream.launch_builder(&c.sgd);
                b.arg(&mut wv).arg(dw.dev()?).arg(&lr).arg(&n);
                // SAFETY: (u16*, const u16*, f32, u64): the weight's and dW's `n` elements.
                unsafe { b.launch(grid(n)) }.map_err(|e| Error::cuda("cuLaunchKernel", e))?;
                Ok(())
            }
            None => {
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

fn check_weight(w: &DeviceView, out: usize, inp: usize) -> Result<()> {
    if out.checked_mul(inp).and_then(|n| n.checked_mul(2)) != Some(w.len_bytes()) {
        return Err(shape_err(&format!(
            "weight of {} bytes for a {out}×{inp} bf16 matrix",
            w.len_bytes()
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn gemm_cfg(
    transa: cublasOperation_t,
    transb: cublasOperation_t,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
) -> Result<GemmConfig<bf16>> {
    let i = |v: usize| i32::try_from(v).map_err(|_| shape_err("dimension over 2^31"));
    Ok(GemmConfig {
        transa,
        transb,
        m: i(m)?,
        n: i(n)?,
        k: i(k)?,
        alpha: bf16::ONE,
        lda: i(lda)?,
        ldb: i(ldb)?,
        beta: bf16::ZERO,
        ldc: i(ldc)?,
    })
}

fn grid(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 132 * 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_rounds_to_nearest_even_like_half() {
        for f in [0.0f32, 1.0, -2.5, 3.25, 1e-3, 65504.0, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 512.0] {
            assert_eq!(narrow(f), bf16::from_f32(f), "{f}");
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
        let got = to_bf16(&store.read(id).unwrap());
        assert_eq!(got, [-0.5f32, 0.5, -0.5, 0.5, -0.5, 0.5].map(bf16::from_f32));
        let mut wrong = la.matrix(1, 2).unwrap();
        let v = store.device_view(id, &s).unwrap();
        assert!(la.linear(&dx, &v, &mut wrong).is_err(), "W is 3×2, y must have 3 columns");
    }
}
