//! Causal grouped-query attention, FlashAttention-2's algorithm (Dao, "FlashAttention-2:
//! Faster Attention with Better Parallelism and Work Partitioning", 2023): the keys are visited
//! in tiles with a running maximum and sum per query row (the online softmax), so no
//! `seq × seq` tensor exists, and only each row's log-sum-exp is kept for the backward, which
//! recomputes the probabilities from it.
//!
//! The backward runs in two passes, neither with atomic adds, so its sums have a fixed order:
//! one over key tiles (each key's `dK` and `dV`, summed over the query heads of its group, so
//! grouped-query attention needs no repeated keys), one over query tiles (`dQ`). Each pass
//! recomputes the scores and `dout · vᵀ` (FlashAttention-2 computes them once and adds `dQ`
//! atomically): 7 products of `seq × seq × head_dim` in the backward against its 5, for
//! results that do not depend on the order threads finish in.

use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::{axpy, cpu_tensor, dot, with_elem, Elem, Geometry};

/// Causal attention of `q` (`[batch, q_len, heads, head_dim]`) over `k` and `v` (`[batch,
/// kv_len, kv_heads, head_dim]`), for queries at the last `q_len` of the `kv_len` positions
/// (`kv_len - q_len` positions are cached before them): `softmax(scale · q kᵀ + mask) v`, where
/// query head `h` reads key/value head `h / (heads / kv_heads)` (Hugging Face's `repeat_kv`
/// order) and the mask hides the keys after each query and, with a `window`, the keys `window`
/// or more positions before it (Mistral's sliding window: a query sees at most `window`
/// positions, itself included). Gives `[batch, q_len, heads, head_dim]` in `q`'s dtype.
///
/// Any strides: a transposed KV cache is read in place (a head dimension whose stride is not 1
/// is copied first). f32, bf16 or f16, computed in f32. The backward is fused too: the
/// gradients of `q`, `k` and `v`, each in its input's dtype.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let [_, sq, _, skv, _, _] = check_qkv("fused attention", q, k, v)?;
    if skv < sq {
        candle_core::bail!(
            "fused attention: {sq} queries over {skv} keys; the queries are the last positions \
             of the keys, so there are at least as many keys"
        );
    }
    if window == Some(0) {
        candle_core::bail!("fused attention: a sliding window of 0 positions sees nothing");
    }
    // The kernels read whole head rows: a head dimension with another stride is copied first.
    head_rows(q)?.apply_op3_arc(
        &head_rows(k)?,
        &head_rows(v)?,
        std::sync::Arc::new(Box::new(Attention {
            scale: scale as f32,
            window,
            lse: OnceLock::new(),
        })),
    )
}

/// Checks `q` (`[batch, q_len, heads, head_dim]`), `k` and `v` (`[batch, kv_len, kv_heads,
/// head_dim]`) as an attention takes them (`what` names it in the errors): one batch, head width
/// and dtype, keys and values one shape, query heads a multiple of the key/value heads. Returns
/// `[batch, q_len, heads, kv_len, kv_heads, head_dim]`.
pub(super) fn check_qkv(
    what: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> candle_core::Result<[usize; 6]> {
    let (b, sq, nh, d) = q.dims4()?;
    let (bk, skv, nkv, dk) = k.dims4()?;
    if k.dims() != v.dims() || bk != b || dk != d {
        candle_core::bail!(
            "{what}: queries {:?}, keys {:?} and values {:?} must share the batch and the head \
             width, keys and values one shape ([batch, seq, heads, head_dim])",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if nkv == 0 || nh % nkv != 0 {
        candle_core::bail!("{what}: {nh} query heads are not a multiple of {nkv} key/value heads");
    }
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        candle_core::bail!(
            "{what}: queries {:?}, keys {:?} and values {:?}: one dtype",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    Ok([b, sq, nh, skv, nkv, d])
}

/// `t` with whole head rows (`[.., head_dim]` of stride 1), copied where its head dimension has
/// another stride.
pub(super) fn head_rows(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.stride()[3] == 1 {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// The op: its parameters, and the log-sum-exp of each query row once the forward ran.
struct Attention {
    scale: f32,
    window: Option<usize>,
    /// `[batch, q_len, heads]` f32, on the forward's device.
    lse: OnceLock<Tensor>,
}

/// Query rows per work item, and keys per tile, on the CPU.
const TILE: usize = 64;

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "strata-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = Geometry::new(lq, lk, self.scale, self.window);
        with_elem!(q, "fused attention", |T| {
            let qf = heads_major::<T>(q, lq)?;
            let kf = heads_major::<T>(k, lk)?;
            let vf = heads_major::<T>(v, lv)?;
            let (o, lse) = forward_cpu::<T>(&g, &qf, &kf, &vf);
            let _ = self.lse.set(cpu_tensor(lse, (g.b, g.sq, g.nh)));
            Ok((T::to_cpu_storage_owned(o), Shape::from((g.b, g.sq, g.nh, g.d))))
        })
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let g = Geometry::new(lq, lk, self.scale, self.window);
        let (o, lse) = super::cuda::attention_forward(&g, (q, lq), (k, lk), (v, lv))?;
        let _ = self.lse.set(super::cuda_tensor(lse, (g.b, g.sq, g.nh)));
        Ok((o, Shape::from((g.b, g.sq, g.nh, g.d))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.get().ok_or_else(|| {
            candle_core::Error::Msg("fused attention: a backward before its forward".into()).bt()
        })?;
        let grad = grad.contiguous()?;
        let g = Geometry::new(q.layout(), k.layout(), self.scale, self.window);
        let (qs, lq) = q.storage_and_layout();
        let (ks, lk) = k.storage_and_layout();
        let (vs, lv) = v.storage_and_layout();
        let (os, lo) = o.storage_and_layout();
        let (dos, ldo) = grad.storage_and_layout();
        let (ls, ll) = lse.storage_and_layout();
        let (dq, dk, dv) = match (&*qs, &*ks, &*vs, &*os, &*dos, &*ls) {
            (
                Storage::Cpu(q),
                Storage::Cpu(k),
                Storage::Cpu(v),
                Storage::Cpu(o),
                Storage::Cpu(dout),
                Storage::Cpu(lse),
            ) => with_elem!(q, "fused attention", |T| {
                let f = Saved {
                    q: heads_major::<T>(q, lq)?,
                    k: heads_major::<T>(k, lk)?,
                    v: heads_major::<T>(v, lv)?,
                    o: heads_major::<T>(o, lo)?,
                    dout: heads_major::<T>(dout, ldo)?,
                    lse: super::contiguous::<f32>(lse, ll, "the log-sum-exp")?,
                };
                let (dq, dk, dv) = backward_cpu::<T>(&g, &f);
                Ok((
                    cpu_tensor(dq, (g.b, g.sq, g.nh, g.d)),
                    cpu_tensor(dk, (g.b, g.skv, g.nkv, g.d)),
                    cpu_tensor(dv, (g.b, g.skv, g.nkv, g.d)),
                ))
            })?,
            #[cfg(feature = "candle-cuda")]
            (
                Storage::Cuda(q),
                Storage::Cuda(k),
                Storage::Cuda(v),
                Storage::Cuda(o),
                Storage::Cuda(dout),
                Storage::Cuda(lse),
            ) => {
                let (dq, dk, dv) = super::cuda::attention_backward(
                    &g,
                    [(q, lq), (k, lk), (v, lv), (o, lo), (dout, ldo)],
                    (lse, ll),
                )?;
                (
                    super::cuda_tensor(dq, (g.b, g.sq, g.nh, g.d)),
                    super::cuda_tensor(dk, (g.b, g.skv, g.nkv, g.d)),
                    super::cuda_tensor(dv, (g.b, g.skv, g.nkv, g.d)),
                )
            }
            _ => candle_core::bail!(
                "fused attention's backward: the tensors are on different devices, or on one \
                 it does not run on (CPU, or CUDA with the candle-cuda feature)"
            ),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// `[batch, seq, heads, head_dim]` (any strides) as f32 in `[batch, heads, seq, head_dim]`
/// order: each head's rows contiguous.
fn heads_major<T: Elem>(s: &CpuStorage, l: &Layout) -> candle_core::Result<Vec<f32>> {
    let x = s.as_slice::<T>()?;
    let (dims, st, start) = (l.dims(), l.stride(), l.start_offset());
    let (b, n, h, d) = (dims[0], dims[1], dims[2], dims[3]);
    let mut out = Vec::with_capacity(b * h * n * d);
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..n {
                let base = start + bi * st[0] + si * st[1] + hi * st[2];
                if st[3] == 1 {
                    out.extend(x[base..base + d].iter().map(|&e| e.widen()));
                } else {
                    out.extend((0..d).map(|e| x[base + e * st[3]].widen()));
                }
            }
        }
    }
    Ok(out)
}

/// The rows `i0..i0 + rows` of head `h` of batch `bi` in a heads-major buffer of `n` rows.
fn rows<'a>(x: &'a [f32], g: &Geometry, heads: usize, n: usize, bi: usize, h: usize) -> &'a [f32] {
    let start = (bi * heads + h) * n * g.d;
    &x[start..start + n * g.d]
}

/// The forward on the CPU: the output (`[batch, q_len, heads, head_dim]`) and the log-sum-exp
/// (`[batch, q_len, heads]`). One work item per batch and tile of query rows (every head), so
/// each writes its own slice of both.
fn forward_cpu<T: Elem>(g: &Geometry, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<T>, Vec<f32>) {
    let (d, nh) = (g.d, g.nh);
    let mut o = vec![T::narrow(0.0); g.b * g.sq * nh * d];
    let mut lse = vec![0f32; g.b * g.sq * nh];
    let mut items: Vec<(usize, usize, &mut [T], &mut [f32])> = Vec::new();
    if g.sq > 0 && nh * d > 0 {
        for (bi, (ob, lb)) in o.chunks_mut(g.sq * nh * d).zip(lse.chunks_mut(g.sq * nh)).enumerate()
        {
            for (t, (ot, lt)) in
                ob.chunks_mut(TILE * nh * d).zip(lb.chunks_mut(TILE * nh)).enumerate()
            {
                items.push((bi, t * TILE, ot, lt));
            }
        }
    }
    items.into_par_iter().for_each(|(bi, i0, o, lse)| {
        let n = lse.len() / nh;
        let mut scores = vec![0f32; TILE];
        let (mut m, mut l, mut acc) = (vec![0f32; n], vec![0f32; n], vec![0f32; n * d]);
        for h in 0..nh {
            let kvh = h / g.group();
            let (qh, kh, vh) = (
                rows(q, g, nh, g.sq, bi, h),
                rows(k, g, g.nkv, g.skv, bi, kvh),
                rows(v, g, g.nkv, g.skv, bi, kvh),
            );
            m.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            l.iter_mut().chain(acc.iter_mut()).for_each(|x| *x = 0.0);
            // Tiles of keys outside, query rows inside: a tile of keys stays in cache for the
            // tile of queries.
            let (klo, khi) = (g.keys(i0).0, g.keys(i0 + n - 1).1);
            for t0 in (klo..khi).step_by(TILE) {
                let t1 = (t0 + TILE).min(khi);
                for r in 0..n {
                    let i = i0 + r;
                    let (lo, hi) = g.keys(i);
                    let (j0, j1) = (t0.max(lo), t1.min(hi));
                    if j0 >= j1 {
                        continue;
                    }
                    let qi = &qh[i * d..(i + 1) * d];
                    let s = &mut scores[..j1 - j0];
                    let mut mt = f32::NEG_INFINITY;
                    for (sj, j) in s.iter_mut().zip(j0..j1) {
                        *sj = dot(qi, &kh[j * d..(j + 1) * d]) * g.scale;
                        mt = mt.max(*sj);
                    }
                    let m_new = m[r].max(mt);
                    let alpha = (m[r] - m_new).exp();
                    let ar = &mut acc[r * d..(r + 1) * d];
                    if alpha != 1.0 {
                        ar.iter_mut().for_each(|a| *a *= alpha);
                    }
                    l[r] *= alpha;
                    for (&sj, j) in s.iter().zip(j0..j1) {
                        let p = (sj - m_new).exp();
                        l[r] += p;
                        axpy(ar, p, &vh[j * d..(j + 1) * d]);
                    }
                    m[r] = m_new;
                }
            }
            for r in 0..n {
                let inv = 1.0 / l[r];
                let out = &mut o[(r * nh + h) * d..(r * nh + h + 1) * d];
                for (o, a) in out.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                    *o = T::narrow(a * inv);
                }
                lse[r * nh + h] = m[r] + l[r].ln();
            }
        }
    });
    (o, lse)
}

/// What the backward reads, as f32: `q`, `dout` and `o` heads-major as the forward's inputs.
struct Saved<'a> {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    dout: Vec<f32>,
    /// `[batch, q_len, heads]`.
    lse: &'a [f32],
}

/// The backward on the CPU: `dq`, `dk`, `dv` in the inputs' shapes (contiguous).
fn backward_cpu<T: Elem>(g: &Geometry, f: &Saved) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (d, nh, nkv) = (g.d, g.nh, g.nkv);
    // delta[b, h, i] = dout_i · o_i: the softmax backward's row term.
    let delta: Vec<f32> =
        f.dout.par_chunks(d.max(1)).zip(f.o.par_chunks(d.max(1))).map(|(a, b)| dot(a, b)).collect();
    let lse = |bi: usize, i: usize, h: usize| f.lse[(bi * g.sq + i) * nh + h];
    // Row `i` of head `h` of batch `bi` in a heads-major buffer of `heads` heads of `n` rows.
    let row = |heads: usize, n: usize, bi: usize, h: usize, i: usize| {
        let start = ((bi * heads + h) * n + i) * d;
        start..start + d
    };

    // dK and dV: one work item per batch and tile of keys (every key/value head).
    let mut dk = vec![T::narrow(0.0); g.b * g.skv * nkv * d];
    let mut dv = vec![T::narrow(0.0); g.b * g.skv * nkv * d];
    let mut items: Vec<(usize, usize, &mut [T], &mut [T])> = Vec::new();
    if g.skv > 0 && nkv * d > 0 {
        for (bi, (kb, vb)) in
            dk.chunks_mut(g.skv * nkv * d).zip(dv.chunks_mut(g.skv * nkv * d)).enumerate()
        {
            for (t, (kt, vt)) in
                kb.chunks_mut(TILE * nkv * d).zip(vb.chunks_mut(TILE * nkv * d)).enumerate()
            {
                items.push((bi, t * TILE, kt, vt));
            }
        }
    }
    items.into_par_iter().for_each(|(bi, j0, dk, dv)| {
        let n = dk.len() / (nkv * d);
        let mut gk = vec![0f32; n * d];
        let mut gv = vec![0f32; n * d];
        for kvh in 0..nkv {
            gk.iter_mut().chain(gv.iter_mut()).for_each(|x| *x = 0.0);
            for h in kvh * g.group()..(kvh + 1) * g.group() {
                // Query tiles outside, keys inside: a tile of queries stays in cache for the
                // tile of keys.
                let (qlo, _) = g.queries(j0);
                let (_, qhi) = g.queries(j0 + n - 1);
                for i0 in (qlo..qhi).step_by(TILE) {
                    let i1 = (i0 + TILE).min(qhi);
                    for r in 0..n {
                        let j = j0 + r;
                        let kj = &f.k[row(nkv, g.skv, bi, kvh, j)];
                        let vj = &f.v[row(nkv, g.skv, bi, kvh, j)];
                        let (lo, hi) = g.queries(j);
                        let (gkr, gvr) = (&mut gk[r * d..(r + 1) * d], &mut gv[r * d..(r + 1) * d]);
                        for i in i0.max(lo)..i1.min(hi) {
                            let qi = &f.q[row(nh, g.sq, bi, h, i)];
                            let di = &f.dout[row(nh, g.sq, bi, h, i)];
                            let p = (dot(qi, kj) * g.scale - lse(bi, i, h)).exp();
                            let dp = dot(di, vj);
                            let ds = p * (dp - delta[(bi * nh + h) * g.sq + i]);
                            axpy(gvr, p, di);
                            axpy(gkr, ds * g.scale, qi);
                        }
                    }
                }
            }
            for r in 0..n {
                let at = (r * nkv + kvh) * d;
                for e in 0..d {
                    dk[at + e] = T::narrow(gk[r * d + e]);
                    dv[at + e] = T::narrow(gv[r * d + e]);
                }
            }
        }
    });

    // dQ: one work item per batch and tile of queries (every head).
    let mut dq = vec![T::narrow(0.0); g.b * g.sq * nh * d];
    let mut items: Vec<(usize, usize, &mut [T])> = Vec::new();
    if g.sq > 0 && nh * d > 0 {
        for (bi, qb) in dq.chunks_mut(g.sq * nh * d).enumerate() {
            for (t, qt) in qb.chunks_mut(TILE * nh * d).enumerate() {
                items.push((bi, t * TILE, qt));
            }
        }
    }
    items.into_par_iter().for_each(|(bi, i0, dq)| {
        let n = dq.len() / (nh * d);
        let mut acc = vec![0f32; n * d];
        for h in 0..nh {
            let kvh = h / g.group();
            acc.iter_mut().for_each(|a| *a = 0.0);
            let (klo, khi) = (g.keys(i0).0, g.keys(i0 + n - 1).1);
            for t0 in (klo..khi).step_by(TILE) {
                let t1 = (t0 + TILE).min(khi);
                for r in 0..n {
                    let i = i0 + r;
                    let (lo, hi) = g.keys(i);
                    let qi = &f.q[row(nh, g.sq, bi, h, i)];
                    let di = &f.dout[row(nh, g.sq, bi, h, i)];
                    let (l, dl) = (lse(bi, i, h), delta[(bi * nh + h) * g.sq + i]);
                    let ar = &mut acc[r * d..(r + 1) * d];
                    for j in t0.max(lo)..t1.min(hi) {
                        let kj = &f.k[row(nkv, g.skv, bi, kvh, j)];
                        let p = (dot(qi, kj) * g.scale - l).exp();
                        let dp = dot(di, &f.v[row(nkv, g.skv, bi, kvh, j)]);
                        axpy(ar, p * (dp - dl) * g.scale, kj);
                    }
                }
            }
            for r in 0..n {
                let at = (r * nh + h) * d;
                for e in 0..d {
                    dq[at + e] = T::narrow(acc[r * d + e]);
                }
            }
        }
    });
    (dq, dk, dv)
}
