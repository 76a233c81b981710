// The fused ops of strata::candle::fused, compiled at run time with NVRTC (bf16.cuh prepended):
// attention forward and backward (FlashAttention-2's algorithm), RMSNorm (alone or after the
// residual add), RoPE and SwiGLU with their backwards, gradients summed in place in f32, and
// block-quantized weights dequantized.
// The same algorithms as the CPU code of src/candle/fused/ and src/base/quant.rs: every value
// widened to f32, combined in f32, rounded once to the storage type; no atomics, so every sum has a fixed order and a run gives the same bits as the last.
// Launched by src/candle/fused/cuda.rs on candle's stream. No headers: bf16 and f16 are carried
// as 16-bit patterns (f16 converted with PTX's cvt), -inf written as its bits.

#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu

struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(bf16_t v) { return bf16_to_f32(v.bits); }
__device__ __forceinline__ float widen(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T narrow(float x);
template <> __device__ __forceinline__ float narrow<float>(float x) { return x; }
// (bf16.cuh's f32_to_bf16 keeps a NaN a NaN, as half's bf16::from_f32 on the CPU does.)
template <> __device__ __forceinline__ bf16_t narrow<bf16_t>(float x) {
    bf16_t r;
    r.bits = f32_to_bf16(x);
    return r;
}
template <> __device__ __forceinline__ f16_t narrow<f16_t>(float x) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// Butterfly reductions over a warp: every lane ends with the same value, summed in one order.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// The sum of v over a block of blockDim.x threads (a multiple of 32, at most 1024), returned to
// every thread; `scratch` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* scratch) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

// ---------------------------------------------------------------------------------------------
// Attention. q: [b, sq, nh, d], k and v: [b, skv, nkv, d], any strides in elements (the head
// dimension's stride 1); o, dq: [b, sq, nh, d], dk, dv: [b, skv, nkv, d], lse and delta:
// [b, sq, nh], all contiguous. Query i is at position skv - sq + i and sees key j when
// j <= its position and, with a window (> 0), its position - j < window. Query head h reads
// key/value head h / (nh / nkv). DPL: head elements per lane (head_dim <= 32 * DPL).

#define BQ 16   // query rows per block of the forward and dq: 4 warps of RPW rows
#define RPW 4
#define BK 32   // keys per tile: one per lane

__device__ __forceinline__ bool sees(long long pos, long long j, long long window) {
    return j <= pos && (window == 0 || pos - j < window);
}

// The keys that query rows i0 .. i0 + BQ - 1 (those below sq) see: lo .. hi - 1.
__device__ __forceinline__ void key_range(int i0, int sq, long long offset, long long window,
                                          long long* lo, long long* hi) {
    *hi = offset + min(i0 + BQ, sq);
    *lo = window > 0 && offset + i0 + 1 > window ? offset + i0 + 1 - window : 0;
}

// Keys t0 .. t0 + BK - 1 of key/value head kvh of batch b (zeros from hi on) into Ks and Vs,
// rows of d + 1 floats (the padding keeps a lane per key off its neighbours' banks).
template <typename T>
__device__ void load_kv(const T* k, const T* v, float* Ks, float* Vs, int b, int kvh, int d,
                        long long t0, long long hi, long long ksb, long long kss, long long ksh,
                        long long vsb, long long vss, long long vsh) {
    for (int t = threadIdx.x; t < BK * d; t += blockDim.x) {
        const int j = t / d, e = t % d;
        const long long kj = t0 + j;
        float kv = 0.0f, vv = 0.0f;
        if (kj < hi) {
            kv = widen(k[b * ksb + kj * kss + kvh * ksh + e]);
            vv = widen(v[b * vsb + kj * vss + kvh * vsh + e]);
        }
        Ks[j * (d + 1) + e] = kv;
        Vs[j * (d + 1) + e] = vv;
    }
}

// One block per (tile of BQ query rows, head, batch); shared: Qs[BQ][d], Ks[BK][d + 1],
// Vs[BK][d + 1]. Each warp keeps RPW rows' running max, sum and output; lane j scores key j of the
// tile, then every lane adds the tile's probabilities times its DPL elements of each value row.
template <typename T, int DPL>
__device__ void attn_fwd(const T* q, const T* k, const T* v, T* o, float* lse, int sq, int skv,
                         int nh, int nkv, int d, long long qsb, long long qss, long long qsh,
                         long long ksb, long long kss, long long ksh, long long vsb, long long vss,
                         long long vsh, float scale, long long window) {
    extern __shared__ float smem[];
    float* Qs = smem;
    float* Ks = Qs + BQ * d;
    float* Vs = Ks + BK * (d + 1);
    const int b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * BQ;
    const int kvh = h / (nh / nkv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long offset = skv - sq;
    for (int t = threadIdx.x; t < BQ * d; t += blockDim.x) {
        const int r = t / d, e = t % d, i = i0 + r;
        Qs[t] = i < sq ? widen(q[b * qsb + i * qss + h * qsh + e]) : 0.0f;
    }
    float m[RPW], l[RPW], acc[RPW][DPL];
#pragma unroll
    for (int rr = 0; rr < RPW; rr++) {
        m[rr] = NEG_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int c = 0; c < DPL; c++) acc[rr][c] = 0.0f;
    }
    long long lo, hi;
    key_range(i0, sq, offset, window, &lo, &hi);
    for (long long t0 = lo; t0 < hi; t0 += BK) {
        __syncthreads();  // the previous tile is read
        load_kv(k, v, Ks, Vs, b, kvh, d, t0, hi, ksb, kss, ksh, vsb, vss, vsh);
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < RPW; rr++) {
            const int r = warp * RPW + rr, i = i0 + r;
            if (i < sq) {  // the same for the whole warp
                const long long pos = offset + i, kj = t0 + lane;
                const bool vis = kj < hi && sees(pos, kj, window);
                float s = NEG_INF;
                if (vis) {
                    float a = 0.0f;
                    for (int e = 0; e < d; e++) a += Qs[r * d + e] * Ks[lane * (d + 1) + e];
                    s = a * scale;
                }
                const float mt = warp_max(s);
                if (mt != NEG_INF) {
                    const float m_new = fmaxf(m[rr], mt);
                    const float alpha = expf(m[rr] - m_new);
                    const float p = vis ? expf(s - m_new) : 0.0f;
                    l[rr] = l[rr] * alpha + warp_sum(p);
#pragma unroll
                    for (int c = 0; c < DPL; c++) acc[rr][c] *= alpha;
                    for (int j = 0; j < BK; j++) {
                        const float pj = __shfl_sync(FULL_MASK, p, j);
#pragma unroll
                        for (int c = 0; c < DPL; c++) {
                            const int e = lane + 32 * c;
                            if (e < d) acc[rr][c] += pj * Vs[j * (d + 1) + e];
                        }
                    }
                    m[rr] = m_new;
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < RPW; rr++) {
        const int i = i0 + warp * RPW + rr;
        if (i < sq) {
            const float inv = 1.0f / l[rr];
            const long long row = ((long long)b * sq + i) * nh + h;
#pragma unroll
            for (int c = 0; c < DPL; c++) {
                const int e = lane + 32 * c;
                if (e < d) o[row * d + e] = narrow<T>(acc[rr][c] * inv);
            }
            if (lane == 0) lse[row] = m[rr] + logf(l[rr]);
        }
    }
}

// delta[row] = dout[row] . o[row], one warp per row of [b * sq * nh] rows of d.
template <typename T>
__device__ void attn_delta(const T* dout, const T* o, float* delta, long long rows, int d) {
    const long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;  // whole warps leave together
    float a = 0.0f;
    for (int e = lane; e < d; e += 32) a += widen(dout[row * d + e]) * widen(o[row * d + e]);
    a = warp_sum(a);
    if (lane == 0) delta[row] = a;
}

// dq, one block per (tile of BQ query rows, head, batch) as the forward; shared: Qs[BQ][d],
// Ds[BQ][d] (the output's gradient rows), Ks[BK][d + 1], Vs[BK][d + 1]. Lane j computes key j's
// probability p = exp(s - lse) and ds = p (dout . v_j - delta); every lane then adds
// ds_j k_j over its DPL elements.
template <typename T, int DPL>
__device__ void attn_dq(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                        const float* delta, T* dq, int sq, int skv, int nh, int nkv, int d,
                        long long qsb, long long qss, long long qsh, long long ksb, long long kss,
                        long long ksh, long long vsb, long long vss, long long vsh, float scale,
                        long long window) {
    extern __shared__ float smem[];
    float* Qs = smem;
    float* Ds = Qs + BQ * d;
    float* Ks = Ds + BQ * d;
    float* Vs = Ks + BK * (d + 1);
    const int b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * BQ;
    const int kvh = h / (nh / nkv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long offset = skv - sq;
    for (int t = threadIdx.x; t < BQ * d; t += blockDim.x) {
        const int r = t / d, e = t % d, i = i0 + r;
        const bool in = i < sq;
        Qs[t] = in ? widen(q[b * qsb + i * qss + h * qsh + e]) : 0.0f;
        Ds[t] = in ? widen(dout[(((long long)b * sq + i) * nh + h) * d + e]) : 0.0f;
    }
    float row_lse[RPW], row_delta[RPW], acc[RPW][DPL];
#pragma unroll
    for (int rr = 0; rr < RPW; rr++) {
        const int i = i0 + warp * RPW + rr;
        const long long row = ((long long)b * sq + i) * nh + h;
        row_lse[rr] = i < sq ? lse[row] : 0.0f;
        row_delta[rr] = i < sq ? delta[row] : 0.0f;
#pragma unroll
        for (int c = 0; c < DPL; c++) acc[rr][c] = 0.0f;
    }
    long long lo, hi;
    key_range(i0, sq, offset, window, &lo, &hi);
    for (long long t0 = lo; t0 < hi; t0 += BK) {
        __syncthreads();  // the previous tile is read
        load_kv(k, v, Ks, Vs, b, kvh, d, t0, hi, ksb, kss, ksh, vsb, vss, vsh);
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < RPW; rr++) {
            const int r = warp * RPW + rr, i = i0 + r;
            if (i < sq) {
                const long long pos = offset + i, kj = t0 + lane;
                float ds = 0.0f;
                if (kj < hi && sees(pos, kj, window)) {
                    float s = 0.0f, dp = 0.0f;
                    for (int e = 0; e < d; e++) {
                        s += Qs[r * d + e] * Ks[lane * (d + 1) + e];
                        dp += Ds[r * d + e] * Vs[lane * (d + 1) + e];
                    }
                    const float p = expf(s * scale - row_lse[rr]);
                    ds = p * (dp - row_delta[rr]);
                }
                for (int j = 0; j < BK; j++) {
                    const float dsj = __shfl_sync(FULL_MASK, ds, j);
#pragma unroll
                    for (int c = 0; c < DPL; c++) {
                        const int e = lane + 32 * c;
                        if (e < d) acc[rr][c] += dsj * Ks[j * (d + 1) + e];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < RPW; rr++) {
        const int i = i0 + warp * RPW + rr;
        if (i < sq) {
            const long long row = ((long long)b * sq + i) * nh + h;
#pragma unroll
            for (int c = 0; c < DPL; c++) {
                const int e = lane + 32 * c;
                if (e < d) dq[row * d + e] = narrow<T>(acc[rr][c] * scale);
            }
        }
    }
}

// dk and dv, one block of 4 warps per (tile of BK keys, key/value head, batch), summed over the
// query heads of the group and the query rows that see the tile, 4 rows at a time: thread
// (warp r, lane j) computes p and ds of row r and key j into shared memory, then warp w adds
// them into the DPL elements of its 8 keys. Shared: Ks[BK][d + 1], Vs[BK][d + 1], Qs[4][d],
// Ds[4][d], P[4][BK], S[4][BK].
template <typename T, int DPL>
__device__ void attn_dkdv(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                          const float* delta, T* dk, T* dv, int sq, int skv, int nh, int nkv,
                          int d, long long qsb, long long qss, long long qsh, long long ksb,
                          long long kss, long long ksh, long long vsb, long long vss,
                          long long vsh, float scale, long long window) {
    extern __shared__ float smem[];
    float* Ks = smem;
    float* Vs = Ks + BK * (d + 1);
    float* Qs = Vs + BK * (d + 1);
    float* Ds = Qs + 4 * d;
    float* P = Ds + 4 * d;
    float* S = P + 4 * BK;
    const int b = blockIdx.z, kvh = blockIdx.y, j0 = blockIdx.x * BK;
    const int group = nh / nkv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long offset = skv - sq;
    load_kv(k, v, Ks, Vs, b, kvh, d, j0, skv, ksb, kss, ksh, vsb, vss, vsh);
    float gk[8][DPL], gv[8][DPL];
#pragma unroll
    for (int jj = 0; jj < 8; jj++)
#pragma unroll
        for (int c = 0; c < DPL; c++) gk[jj][c] = gv[jj][c] = 0.0f;
    // The queries that see a key of the tile: from the first key's to the last key's.
    const int jl = min(j0 + BK, skv) - 1;
    long long qlo = j0 - offset;
    if (qlo < 0) qlo = 0;
    long long qhi = sq;
    if (window > 0 && jl + window - offset < qhi) qhi = jl + window - offset;
    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        for (long long i0 = qlo; i0 < qhi; i0 += 4) {
            __syncthreads();  // the previous rows are read
            for (int t = threadIdx.x; t < 4 * d; t += blockDim.x) {
                const int r = t / d, e = t % d;
                const long long i = i0 + r;
                const bool in = i < qhi;
                Qs[t] = in ? widen(q[b * qsb + i * qss + h * qsh + e]) : 0.0f;
                Ds[t] = in ? widen(dout[(((long long)b * sq + i) * nh + h) * d + e]) : 0.0f;
            }
            __syncthreads();
            {
                const long long i = i0 + warp, pos = offset + i, kj = j0 + lane;
                float p = 0.0f, ds = 0.0f;
                if (i < qhi && kj < skv && sees(pos, kj, window)) {
                    const long long row = ((long long)b * sq + i) * nh + h;
                    float s = 0.0f, dp = 0.0f;
                    for (int e = 0; e < d; e++) {
                        s += Qs[warp * d + e] * Ks[lane * (d + 1) + e];
                        dp += Ds[warp * d + e] * Vs[lane * (d + 1) + e];
                    }
                    p = expf(s * scale - lse[row]);
                    ds = p * (dp - delta[row]);
                }
                P[warp * BK + lane] = p;
                S[warp * BK + lane] = ds;
            }
            __syncthreads();
            for (int r = 0; r < 4; r++) {
#pragma unroll
                for (int jj = 0; jj < 8; jj++) {
                    const float pj = P[r * BK + warp * 8 + jj], sj = S[r * BK + warp * 8 + jj];
#pragma unroll
                    for (int c = 0; c < DPL; c++) {
                        const int e = lane + 32 * c;
                        if (e < d) {
                            gv[jj][c] += pj * Ds[r * d + e];
                            gk[jj][c] += sj * Qs[r * d + e];
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int jj = 0; jj < 8; jj++) {
        const int kj = j0 + warp * 8 + jj;
        if (kj < skv) {
            const long long row = ((long long)b * skv + kj) * nkv + kvh;
#pragma unroll
            for (int c = 0; c < DPL; c++) {
                const int e = lane + 32 * c;
                if (e < d) {
                    dk[row * d + e] = narrow<T>(gk[jj][c] * scale);
                    dv[row * d + e] = narrow<T>(gv[jj][c]);
                }
            }
        }
    }
}

#define QKV_STRIDES                                                                                \
    long long qsb, long long qss, long long qsh, long long ksb, long long kss, long long ksh,     \
        long long vsb, long long vss, long long vsh
#define QKV_STRIDE_ARGS qsb, qss, qsh, ksb, kss, ksh, vsb, vss, vsh

#define ATTENTION_ENTRIES(name, T, DPL, dname)                                                      \
    extern "C" __global__ void strata_attn_fwd_##name##_##dname(                                  \
        const T* q, const T* k, const T* v, T* o, float* lse, int sq, int skv, int nh, int nkv,   \
        int d, QKV_STRIDES, float scale, long long window) {                                      \
        attn_fwd<T, DPL>(q, k, v, o, lse, sq, skv, nh, nkv, d, QKV_STRIDE_ARGS, scale, window);    \
    }                                                                                              \
    extern "C" __global__ void strata_attn_dq_##name##_##dname(                                   \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,  \
        T* dq, int sq, int skv, int nh, int nkv, int d, QKV_STRIDES, float scale,                 \
        long long window) {                                                                        \
        attn_dq<T, DPL>(q, k, v, dout, lse, delta, dq, sq, skv, nh, nkv, d, QKV_STRIDE_ARGS,       \
                        scale, window);                                                            \
    }                                                                                              \
    extern "C" __global__ void strata_attn_dkdv_##name##_##dname(                                 \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,  \
        T* dk, T* dv, int sq, int skv, int nh, int nkv, int d, QKV_STRIDES, float scale,          \
        long long window) {                                                                        \
        attn_dkdv<T, DPL>(q, k, v, dout, lse, delta, dk, dv, sq, skv, nh, nkv, d,                  \
                          QKV_STRIDE_ARGS, scale, window);                                         \
    }

// ---------------------------------------------------------------------------------------------
// RMSNorm over rows of `hidden`: out = narrow(narrow(x * inv) * w), inv = 1 / sqrt(mean(x^2) +
// eps), one block per row.
template <typename T>
__device__ void rms_fwd(const T* x, const T* w, T* out, float* inv, int hidden, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * hidden;
    float ss = 0.0f;
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
        const float xv = widen(xr[e]);
        ss += xv * xv;
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / hidden + eps);
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
        const float n = widen(narrow<T>(widen(xr[e]) * r));
        out[row * hidden + e] = narrow<T>(n * widen(w[e]));
    }
    if (threadIdx.x == 0) inv[row] = r;
}

// The residual add and RMSNorm in one pass (src/candle/fused/add_norm.rs): h = narrow(x + r)
// as candle's add rounds it, then out and inv of h exactly as rms_fwd computes them (the same
// sums in the same order), one block per row. Each thread reads back only the h it wrote.
template <typename T>
__device__ void add_rms_fwd(const T* x, const T* r, const T* w, T* h, T* out, float* inv,
                            int hidden, float eps) {
    __shared__ float scratch[32];
    const long long at = (long long)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
        const T hv = narrow<T>(widen(x[at + e]) + widen(r[at + e]));
        h[at + e] = hv;
        const float v = widen(hv);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float rr = 1.0f / sqrtf(ss / hidden + eps);
    for (int e = threadIdx.x; e < hidden; e += blockDim.x) {
        const float n = widen(narrow<T>(widen(h[at + e]) * rr));
        out[at + e] = narrow<T>(n * widen(w[e]));
    }
    if (threadIdx.x == 0) inv[blockIdx.x] = rr;
}

// dx = inv * dn - x * inv^3 * mean(dn * x), dn = dy * w; one block per row.
template <typename T>
__device__ void rms_dx(const T* x, const T* w, const T* dy, const float* inv, T* dx, int hidden) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const long long at = row * hidden;
    const float r = inv[row];
    float a = 0.0f;
    for (int e = threadIdx.x; e < hidden; e += blockDim.x)
        a += widen(dy[at + e]) * widen(w[e]) * widen(x[at + e]);
    a = block_sum(a, scratch);
    const float kk = a / hidden * r * r * r;
    for (int e = threadIdx.x; e < hidden; e += blockDim.x)
        dx[at + e] = narrow<T>(r * widen(dy[at + e]) * widen(w[e]) - kk * widen(x[at + e]));
}

// partial[chunk][col] = sum over the chunk's rows of dy * narrow(x * inv): one thread per column,
// blockIdx.y the chunk of `chunk_rows` rows.
template <typename T>
__device__ void rms_dw_partial(const T* x, const T* dy, const float* inv, float* partial,
                               long long rows, int hidden, int chunk_rows) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= hidden) return;
    const long long r0 = (long long)blockIdx.y * chunk_rows;
    long long r1 = r0 + chunk_rows;
    if (r1 > rows) r1 = rows;
    float a = 0.0f;
    for (long long r = r0; r < r1; r++)
        a += widen(dy[r * hidden + col]) * widen(narrow<T>(widen(x[r * hidden + col]) * inv[r]));
    partial[(long long)blockIdx.y * hidden + col] = a;
}

// dw[col] = the chunks' partial sums, added in chunk order.
template <typename T>
__device__ void rms_dw_sum(const float* partial, T* dw, int chunks, int hidden) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= hidden) return;
    float a = 0.0f;
    for (int c = 0; c < chunks; c++) a += partial[(long long)c * hidden + col];
    dw[col] = narrow<T>(a);
}

// ---------------------------------------------------------------------------------------------
// RoPE of x: [b, s, h, d] (strides xsb, xss, xsh, xse) into out: [b, s, h, d] contiguous, one
// thread per pair (e, e + d/2) of a head at position offset + s; cos, sin: [positions, d].
// inverse: the transpose (the backward).
template <typename T>
__device__ void rope(const T* x, T* out, const float* cos_t, const float* sin_t, int s, int h,
                     int d, long long xsb, long long xss, long long xsh, long long xse,
                     long long offset, int inverse, long long pairs) {
    const int half = d / 2;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < pairs;
         t += (long long)gridDim.x * blockDim.x) {
        const int e = t % half;
        const long long hr = t / half;  // (b * s + si) * h + hi
        const int hi = hr % h;
        const long long bs = hr / h;
        const int si = bs % s;
        const long long bi = bs / s;
        const long long base = bi * xsb + si * xss + hi * xsh;
        const float x1 = widen(x[base + e * xse]), x2 = widen(x[base + (e + half) * xse]);
        const long long p = (offset + si) * d;
        const float c1 = cos_t[p + e], c2 = cos_t[p + e + half];
        const float s1 = sin_t[p + e], s2 = sin_t[p + e + half];
        float o1, o2;
        if (!inverse) {
            o1 = x1 * c1 - x2 * s1;
            o2 = x2 * c2 + x1 * s2;
        } else {
            o1 = x1 * c1 + x2 * s2;
            o2 = x2 * c2 - x1 * s1;
        }
        out[hr * d + e] = narrow<T>(o1);
        out[hr * d + e + half] = narrow<T>(o2);
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: out = silu(g) * u; the backward dg = dy * u * sig * (1 + g * (1 - sig)), du = dy *
// silu(g). Over `rows` rows of `inner` elements: g and u rows `in_stride` apart, out and dy
// contiguous, dg and du rows `out_stride` apart. Two tensors of one shape are one row
// (strata_swiglu_*: a one-dimensional grid); the joint gate/up GEMM's output [rows, 2 inner]
// is g in its first `inner` columns and u in the next (strata_swiglu_joined_*: in_stride =
// out_stride = 2 inner, the backward writing the joint's gradient whole; a two-dimensional
// grid, rows along y).
#define GRID_LOOP(i, n)                                                                            \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                 \
         i += (long long)gridDim.x * blockDim.x)
#define ROW_LOOP(r, c, rows, inner)                                                                \
    for (long long r = blockIdx.y; r < (rows); r += gridDim.y)                                     \
        GRID_LOOP(c, inner)

template <typename T>
__device__ void swiglu_fwd(const T* g, const T* u, long long in_stride, T* out, long long rows,
                           long long inner) {
    ROW_LOOP(r, c, rows, inner) {
        const long long a = r * in_stride + c;
        const float gv = widen(g[a]);
        out[r * inner + c] = narrow<T>(gv / (1.0f + expf(-gv)) * widen(u[a]));
    }
}

template <typename T>
__device__ void swiglu_bwd(const T* g, const T* u, long long in_stride, const T* dy, T* dg, T* du,
                           long long out_stride, long long rows, long long inner) {
    ROW_LOOP(r, c, rows, inner) {
        const long long a = r * in_stride + c, o = r * out_stride + c;
        const float gv = widen(g[a]), uv = widen(u[a]), d = widen(dy[r * inner + c]);
        const float sig = 1.0f / (1.0f + expf(-gv));
        dg[o] = narrow<T>(d * uv * sig * (1.0f + gv * (1.0f - sig)));
        du[o] = narrow<T>(d * gv * sig);
    }
}

// ---------------------------------------------------------------------------------------------
// Gradients summed in place in f32 (src/candle/fused/accumulate.rs): acc += g element by
// element; and an embedding's rows, acc[ids[i]] += rows[i] for i in order, one thread per column
// so that every element's sum runs in the CPU's order (no atomics). An id past the table is
// left out (the Rust side checks the ids before the step).
template <typename T> __device__ void grad_acc(float* acc, const T* g, long long n) {
    GRID_LOOP(i, n) acc[i] = acc[i] + widen(g[i]);
}

template <typename T>
__device__ void grad_index_add(float* acc, const unsigned int* ids, const T* rows, long long n,
                               int hidden, long long vocab) {
    GRID_LOOP(c, hidden) {
        for (long long i = 0; i < n; i++) {
            const long long id = ids[i];
            if (id < vocab) {
                float* a = acc + id * hidden + c;
                *a = *a + widen(rows[i * hidden + c]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Block-quantized weights (GGUF's Q4_0 ... Q8_K) to T, one thread an element: the arithmetic of
// src/base/quant.rs (the `gguf` package's, bit for bit): f16 scales widened, a sub-block's scale
// `d * sc` rounded before it multiplies a quant, `d * q + m` and `dl * q - ml` as two roundings
// (the _rn intrinsics: never contracted into an FMA), then rounded once to T. `type` is
// fused.rs's quant_index (Q4_0 0 ... Q8_K 10, as below); each block is `bsize` bytes of `belems`
// elements.

__device__ __forceinline__ float dq_half(const unsigned char* b, int at) {
    f16_t h;
    h.bits = (unsigned short)(b[at] | (b[at + 1] << 8));
    return widen(h);
}
// Element i (0..32) of 16 bytes of nibbles: low nibbles first, then the high ones.
__device__ __forceinline__ int dq_nibble32(const unsigned char* qs, int i) {
    return (qs[i % 16] >> (4 * (i / 16))) & 0x0f;
}
__device__ __forceinline__ int dq_bit32(const unsigned char* b, int at, int i) {
    return (b[at + i / 8] >> (i % 8)) & 1;
}
// Element i (0..256) of 64 bytes of 2-bit quants (quant.rs's crumb256).
__device__ __forceinline__ int dq_crumb256(const unsigned char* qs, int i) {
    const int half = i / 128, s = (i % 128) / 32, l = i % 32;
    return (qs[half * 32 + l] >> (2 * s)) & 3;
}
// Element i (0..256) of 128 bytes of nibbles (quant.rs's nibble256).
__device__ __forceinline__ int dq_nibble256(const unsigned char* qs, int i) {
    const int chunk = i / 64, s = (i % 64) / 32, l = i % 32;
    return (qs[chunk * 32 + l] >> (4 * s)) & 0x0f;
}
// Sub-block j's scale and minimum of a Q4_K / Q5_K super-block (quant.rs's scale_min_k4).
__device__ __forceinline__ void dq_scale_min_k4(const unsigned char* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 0x3f;
        *m = s[j + 4] & 0x3f;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

__device__ float dequant_one(int type, const unsigned char* b, int i) {
    switch (type) {
    case 0: {  // Q4_0: 32 elements, 18 bytes
        return __fmul_rn(dq_half(b, 0), (float)(dq_nibble32(b + 2, i) - 8));
    }
    case 1: {  // Q4_1: 32, 20
        return __fadd_rn(__fmul_rn(dq_half(b, 0), (float)dq_nibble32(b + 4, i)), dq_half(b, 2));
    }
    case 2: {  // Q5_0: 32, 22
        const int q = dq_nibble32(b + 6, i) | (dq_bit32(b, 2, i) << 4);
        return __fmul_rn(dq_half(b, 0), (float)(q - 16));
    }
    case 3: {  // Q5_1: 32, 24
        const int q = dq_nibble32(b + 8, i) | (dq_bit32(b, 4, i) << 4);
        return __fadd_rn(__fmul_rn(dq_half(b, 0), (float)q), dq_half(b, 2));
    }
    case 4: {  // Q8_0: 32, 34
        return __fmul_rn((float)(signed char)b[2 + i], dq_half(b, 0));
    }
    case 5: {  // Q2_K: 256, 84
        const int sc = b[i / 16];
        const float dl = __fmul_rn(dq_half(b, 80), (float)(sc & 0x0f));
        const float ml = __fmul_rn(dq_half(b, 82), (float)(sc >> 4));
        return __fsub_rn(__fmul_rn(dl, (float)dq_crumb256(b + 16, i)), ml);
    }
    case 6: {  // Q3_K: 256, 110
        const unsigned char* scales = b + 96;
        const int sub = i / 16;
        const int lo = (scales[sub % 8] >> (4 * (sub / 8))) & 0x0f;
        const int hi = (scales[8 + sub % 4] >> (2 * (sub / 4))) & 0x03;
        const float dl = __fmul_rn(dq_half(b, 108), (float)((lo | (hi << 4)) - 32));
        const int high = (b[i % 32] >> (i / 32)) & 1;  // clear: subtract 4
        return __fmul_rn(dl, (float)(dq_crumb256(b + 32, i) - ((high ^ 1) << 2)));
    }
    case 7:    // Q4_K: 256, 144
    case 8: {  // Q5_K: 256, 176
        int sc, m;
        dq_scale_min_k4(b + 4, i / 32, &sc, &m);
        const float dl = __fmul_rn(dq_half(b, 0), (float)sc);
        const float ml = __fmul_rn(dq_half(b, 2), (float)m);
        int q;
        if (type == 7) {
            q = dq_nibble256(b + 16, i);
        } else {
            q = dq_nibble256(b + 48, i) | (((b[16 + i % 32] >> (i / 32)) & 1) << 4);
        }
        return __fsub_rn(__fmul_rn(dl, (float)q), ml);
    }
    case 9: {  // Q6_K: 256, 210
        const float dl = __fmul_rn(dq_half(b, 208), (float)(signed char)b[192 + i / 16]);
        const int h = i / 128, r = i % 128;
        const int lo = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
        const int hi = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
        return __fmul_rn(dl, (float)((lo | (hi << 4)) - 32));
    }
    default: {  // 10, Q8_K: 256, 292 (an f32 scale)
        const unsigned int u = b[0] | (b[1] << 8) | (b[2] << 16) | ((unsigned int)b[3] << 24);
        return __fmul_rn(__uint_as_float(u), (float)(signed char)b[4 + i]);
    }
    }
}

template <typename T>
__device__ void dequant(const unsigned char* src, T* out, long long n, int type, int belems,
                        int bsize) {
    GRID_LOOP(e, n) {
        const unsigned char* b = src + (e / belems) * bsize;
        out[e] = narrow<T>(dequant_one(type, b, (int)(e % belems)));
    }
}

#define POINTWISE_ENTRIES(name, T)                                                                 \
    extern "C" __global__ void strata_attn_delta_##name(const T* dout, const T* o, float* delta,  \
                                                        long long rows, int d) {                  \
        attn_delta<T>(dout, o, delta, rows, d);                                                   \
    }                                                                                              \
    extern "C" __global__ void strata_rms_fwd_##name(const T* x, const T* w, T* out, float* inv,  \
                                                     int hidden, float eps) {                     \
        rms_fwd<T>(x, w, out, inv, hidden, eps);                                                  \
    }                                                                                              \
    extern "C" __global__ void strata_add_rms_fwd_##name(const T* x, const T* r, const T* w,       \
                                                         T* h, T* out, float* inv, int hidden,     \
                                                         float eps) {                              \
        add_rms_fwd<T>(x, r, w, h, out, inv, hidden, eps);                                         \
    }                                                                                              \
    extern "C" __global__ void strata_rms_dx_##name(const T* x, const T* w, const T* dy,          \
                                                    const float* inv, T* dx, int hidden) {        \
        rms_dx<T>(x, w, dy, inv, dx, hidden);                                                     \
    }                                                                                              \
    extern "C" __global__ void strata_rms_dw_partial_##name(const T* x, const T* dy,              \
                                                            const float* inv, float* partial,     \
                                                            long long rows, int hidden,           \
                                                            int chunk_rows) {                     \
        rms_dw_partial<T>(x, dy, inv, partial, rows, hidden, chunk_rows);                         \
    }                                                                                              \
    extern "C" __global__ void strata_rms_dw_sum_##name(const float* partial, T* dw, int chunks,  \
                                                        int hidden) {                             \
        rms_dw_sum<T>(partial, dw, chunks, hidden);                                               \
    }                                                                                              \
    extern "C" __global__ void strata_rope_##name(                                                \
        const T* x, T* out, const float* cos_t, const float* sin_t, int s, int h, int d,          \
        long long xsb, long long xss, long long xsh, long long xse, long long offset,             \
        int inverse, long long pairs) {                                                            \
        rope<T>(x, out, cos_t, sin_t, s, h, d, xsb, xss, xsh, xse, offset, inverse, pairs);       \
    }                                                                                              \
    extern "C" __global__ void strata_swiglu_fwd_##name(const T* g, const T* u, T* out,           \
                                                        long long n) {                            \
        swiglu_fwd<T>(g, u, n, out, 1, n);                                                        \
    }                                                                                              \
    extern "C" __global__ void strata_swiglu_bwd_##name(const T* g, const T* u, const T* dy,      \
                                                        T* dg, T* du, long long n) {              \
        swiglu_bwd<T>(g, u, n, dy, dg, du, n, 1, n);                                              \
    }                                                                                              \
    extern "C" __global__ void strata_swiglu_joined_fwd_##name(const T* y, T* out, long long rows, \
                                                               long long inner) {                 \
        swiglu_fwd<T>(y, y + inner, 2 * inner, out, rows, inner);                                 \
    }                                                                                              \
    extern "C" __global__ void strata_swiglu_joined_bwd_##name(const T* y, const T* dy, T* dyj,   \
                                                               long long rows, long long inner) { \
        swiglu_bwd<T>(y, y + inner, 2 * inner, dy, dyj, dyj + inner, 2 * inner, rows, inner);     \
    }                                                                                              \
    extern "C" __global__ void strata_grad_acc_##name(float* acc, const T* g, long long n) {      \
        grad_acc<T>(acc, g, n);                                                                   \
    }                                                                                              \
    extern "C" __global__ void strata_grad_index_add_##name(float* acc, const unsigned int* ids,  \
                                                            const T* rows, long long n,           \
                                                            int hidden, long long vocab) {        \
        grad_index_add<T>(acc, ids, rows, n, hidden, vocab);                                      \
    }                                                                                              \
    extern "C" __global__ void strata_dequant_##name(const unsigned char* src, T* out,            \
                                                     long long n, int type, int belems,           \
                                                     int bsize) {                                 \
        dequant<T>(src, out, n, type, belems, bsize);                                             \
    }

// One element type per module (the Rust side defines STRATA_ELEM_<type> before the source, so a
// program compiles only the kernels of the dtype it runs); all three without.
#if defined(STRATA_ELEM_f32)
#define FOR_TYPES(X) X(f32, float)
#elif defined(STRATA_ELEM_bf16)
#define FOR_TYPES(X) X(bf16, bf16_t)
#elif defined(STRATA_ELEM_f16)
#define FOR_TYPES(X) X(f16, f16_t)
#else
#define FOR_TYPES(X) X(f32, float) X(bf16, bf16_t) X(f16, f16_t)
#endif
#define ATTENTION_WIDTHS(name, T)                                                                  \
    ATTENTION_ENTRIES(name, T, 2, d64) ATTENTION_ENTRIES(name, T, 4, d128)                         \
    ATTENTION_ENTRIES(name, T, 8, d256)
FOR_TYPES(ATTENTION_WIDTHS)
FOR_TYPES(POINTWISE_ENTRIES)
