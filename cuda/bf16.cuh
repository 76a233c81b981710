// bf16 as 16-bit patterns (no cuda_bf16.h needed), converted the way strata's host code does:
// widen by shifting, narrow by round-to-nearest-even (a NaN kept a NaN). Prepended to the kernel sources that use it
// (mlp.cu, optim.cu) before NVRTC compiles them.

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// A NaN stays a (quiet) NaN, as half's bf16::from_f32 keeps it: the rounding's carry would turn
// the NaN GPU arithmetic produces (0x7fffffff) into -0.0.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

