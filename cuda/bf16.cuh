// bf16 as 16-bit patterns (no cuda_bf16.h needed), converted the way strata's host code does:
// widen by shifting, narrow by round-to-nearest-even. Prepended to the kernel sources that use it
// (mlp.cu, optim.cu) before NVRTC compiles them.

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

