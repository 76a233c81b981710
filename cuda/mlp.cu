// Elementwise kernels of strata's linear algebra (strata::linalg), compiled at run time with NVRTC.
// bf16 values are carried as their 16-bit patterns (no cuda_bf16.h needed) and converted the way
// the host reference does: widen by shifting, narrow by round-to-nearest-even. Every kernel that
// computes in f32 uses the _rn intrinsics, so no multiply-add is contracted into an FMA and the
// results round exactly as the host reference's.

// bf16_to_f32 and f32_to_bf16 come from bf16.cuh, prepended at load.

__device__ __forceinline__ float ld(const unsigned short* p, unsigned long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float ld(const float* p, unsigned long long i) { return p[i]; }
__device__ __forceinline__ void st(unsigned short* p, unsigned long long i, float v) { p[i] = f32_to_bf16(v); }
__device__ __forceinline__ void st(float* p, unsigned long long i, float v) { p[i] = v; }

#define GRID_LOOP(i, n)                                                                            \
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (unsigned long long)gridDim.x * blockDim.x)

// w[i] = bf16(w[i] - lr * g[i]), computed in f32.
extern "C" __global__ void strata_sgd_bf16(unsigned short* w, const unsigned short* g, float lr,
                                           unsigned long long n) {
    GRID_LOOP(i, n) {
        float step = __fmul_rn(lr, bf16_to_f32(g[i]));
        w[i] = f32_to_bf16(__fsub_rn(bf16_to_f32(w[i]), step));
    }
}

// x[i] = v (a bf16 bit pattern).
extern "C" __global__ void strata_fill_bf16(unsigned short* x, unsigned short v, unsigned long long n) {
    GRID_LOOP(i, n) { x[i] = v; }
}

extern "C" __global__ void strata_fill_f32(float* x, float v, unsigned long long n) {
    GRID_LOOP(i, n) { x[i] = v; }
}

// x = max(x, 0), in place.
template <typename T> __device__ void relu(T* x, unsigned long long n) {
    GRID_LOOP(i, n) {
        if (!(ld(x, i) > 0.0f)) st(x, i, 0.0f);
    }
}

// g = a > 0 ? g : 0 (the gradient through a relu whose output is a).
template <typename T> __device__ void relu_mask(T* g, const T* a, unsigned long long n) {
    GRID_LOOP(i, n) {
        if (!(ld(a, i) > 0.0f)) st(g, i, 0.0f);
    }
}

// g = (out - y) * scale; partials[blockIdx.x] += this block's sum of (out - y)^2, summed in a
// fixed order (a tree over the block), so the loss is the same on every run.
template <typename T>
__device__ void loss_grad(const T* out, const T* y, T* g, float scale, float* partials,
                          unsigned long long n) {
    __shared__ float sums[256];
    float acc = 0.0f;
    GRID_LOOP(i, n) {
        float d = __fsub_rn(ld(out, i), ld(y, i));
        acc = __fadd_rn(acc, __fmul_rn(d, d));
        st(g, i, __fmul_rn(d, scale));
    }
    sums[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sums[threadIdx.x] = __fadd_rn(sums[threadIdx.x], sums[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = __fadd_rn(partials[blockIdx.x], sums[0]);
}

// acc = (first ? 0 : acc) + g, in f32 (gradient accumulation over micro-batches).
template <typename T>
__device__ void accumulate(float* acc, const T* g, int first, unsigned long long n) {
    GRID_LOOP(i, n) { acc[i] = first ? ld(g, i) : __fadd_rn(acc[i], ld(g, i)); }
}

#define FOR_TYPES(X) X(bf16, unsigned short) X(f32, float)
#define ENTRY_POINTS(name, T)                                                                      \
    extern "C" __global__ void strata_relu_##name(T* x, unsigned long long n) { relu(x, n); }     \
    extern "C" __global__ void strata_relu_mask_##name(T* g, const T* a, unsigned long long n) {  \
        relu_mask(g, a, n);                                                                        \
    }                                                                                              \
    extern "C" __global__ void strata_loss_grad_##name(const T* out, const T* y, T* g,            \
                                                       float scale, float* partials,              \
                                                       unsigned long long n) {                    \
        loss_grad(out, y, g, scale, partials, n);                                                  \
    }                                                                                              \
    extern "C" __global__ void strata_accumulate_##name(float* acc, const T* g, int first,        \
                                                        unsigned long long n) {                   \
        accumulate(acc, g, first, n);                                                              \
    }
FOR_TYPES(ENTRY_POINTS)
