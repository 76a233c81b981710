// Optimizer steps of strata::optim for the GpuMapped and GpuResident engines, compiled at run
// time with NVRTC. `p` is the f32 master copy (or the f32 parameter itself), `m` and `v` the
// AdamW moments, all f32; they may live in mapped host memory, read and written in place over
// PCIe. `grad` is f32 or bf16 (`grad_bf16`), each value multiplied by `grad_scale` as it is read
// (global gradient-norm clipping's factor, 1 when not clipping: x * 1 is x). `out`, when not
// null, receives the bf16 compute copy of the new value. Every operation rounds as the host engine's (the _rn intrinsics: no
// FMA contraction), in the order of PyTorch's single-tensor AdamW, so all engines give the same
// bits.

// bf16_to_f32 and f32_to_bf16 come from bf16.cuh, prepended at load.

__device__ __forceinline__ float grad_at(const void* g, int bf16, unsigned long long i) {
    return bf16 ? bf16_to_f32(((const unsigned short*)g)[i]) : ((const float*)g)[i];
}

// decay = 1 - lr * weight_decay; w = 1 - beta1, w_rest = 1 - w (f32), w_hi = |w| >= 0.5;
// step_size = lr / (1 - beta1^t); bc2_sqrt = sqrt(1 - beta2^t).
extern "C" __global__ void strata_adamw(float* p, float* m, float* v, const void* grad,
                                        int grad_bf16, float grad_scale, unsigned short* out,
                                        unsigned long long n,
                                        float decay, float w, float w_rest, int w_hi, float b2,
                                        float one_minus_b2, float step_size, float bc2_sqrt,
                                        float eps) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float g = __fmul_rn(grad_at(grad, grad_bf16, i), grad_scale);
        float pi = __fmul_rn(p[i], decay);
        // torch's lerp(m, g, w): m + w (g - m) for |w| < 0.5, else g - (g - m)(1 - w).
        float mi = w_hi ? __fsub_rn(g, __fmul_rn(__fsub_rn(g, m[i]), w_rest))
                        : __fadd_rn(m[i], __fmul_rn(w, __fsub_rn(g, m[i])));
        float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(one_minus_b2, g), g));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        pi = __fsub_rn(pi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (out) out[i] = f32_to_bf16(pi);
    }
}

// SGD as torch.optim.SGD without momentum: g += weight_decay * p; p -= lr * g.
extern "C" __global__ void strata_sgd(float* p, const void* grad, int grad_bf16,
                                      float grad_scale, unsigned short* out, unsigned long long n,
                                      float lr, float weight_decay) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float g = __fmul_rn(grad_at(grad, grad_bf16, i), grad_scale);
        if (weight_decay != 0.0f) g = __fadd_rn(g, __fmul_rn(weight_decay, p[i]));
        float pi = __fsub_rn(p[i], __fmul_rn(lr, g));
        p[i] = pi;
        if (out) out[i] = f32_to_bf16(pi);
    }
}
