// Elementwise kernels of strata's linear algebra (strata::linalg), compiled at run time with NVRTC.
// bf16 values are carried as their 16-bit patterns (no cuda_bf16.h needed) and converted the way
// the host reference does: widen by shifting, narrow by round-to-nearest-even.

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// w[i] = bf16(w[i] - lr * g[i]), computed in f32 without contraction into an FMA, so that it
// rounds exactly as the host reference does.
extern "C" __global__ void strata_sgd_bf16(unsigned short* w, const unsigned short* g, float lr,
                                           unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float step = __fmul_rn(lr, bf16_to_f32(g[i]));
        w[i] = f32_to_bf16(__fsub_rn(bf16_to_f32(w[i]), step));
    }
}

// x[i] = v (a bf16 bit pattern).
extern "C" __global__ void strata_fill_bf16(unsigned short* x, unsigned short v, unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        x[i] = v;
    }
}
