// Kernels of `strata bench` (strata::probe::GpuProbe). Compiled at run time with NVRTC.
//
// strata_bench_rsum: the streaming read of ../shared/peers/transfer_anchors.py ("rsum"), kept
// identical so that its figures agree: every thread sums float4s in a grid-stride loop and adds
// its sum to *out once. Run over device memory (HBM), mapped host memory (zero-copy over PCIe)
// or managed memory (on-demand page faults).
//
// strata_bench_gather: a sparse read, the case where zero-copy wins. The buffer is cut into rows
// of 256 bytes (16 float4s) and `nsel` of them are read: row j*group + hash(j) % group for
// j < nsel, so one row out of each group of `group` consecutive rows, at a pseudo-random place
// within the group (no two picks share a row, and neighbouring picks are not adjacent). Sixteen
// consecutive threads read one row's sixteen float4s, so each row is one coalesced 256-byte
// request. Only nsel * 256 bytes cross PCIe when the buffer is mapped host memory.

extern "C" __global__ void strata_bench_rsum(const float4* __restrict__ x,
                                             unsigned long long n4,
                                             float* out) {
    float acc = 0.f;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n4;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float4 v = x[i];
        acc += v.x + v.y + v.z + v.w;
    }
    atomicAdd(out, acc);
}

__device__ __forceinline__ unsigned long long strata_bench_hash(unsigned long long j) {
    // splitmix64's finalizer: a fixed, well-mixed function of the pick's index.
    j += 0x9E3779B97F4A7C15ULL;
    j = (j ^ (j >> 30)) * 0xBF58476D1CE4E5B9ULL;
    j = (j ^ (j >> 27)) * 0x94D049BB133111EBULL;
    return j ^ (j >> 31);
}

extern "C" __global__ void strata_bench_gather(const float4* __restrict__ x,
                                               unsigned long long group,
                                               unsigned long long nsel,
                                               float* out) {
    float acc = 0.f;
    const unsigned long long total = nsel * 16ULL;
    for (unsigned long long t = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         t < total; t += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long j = t >> 4;
        const unsigned long long row = j * group + strata_bench_hash(j) % group;
        float4 v = x[row * 16ULL + (t & 15ULL)];
        acc += v.x + v.y + v.z + v.w;
    }
    // One atomic per warp, not per thread: the gather reads little, so atomics would dominate.
    for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_down_sync(0xffffffffu, acc, off);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(out, acc);
    }
}
