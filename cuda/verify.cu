// Kernels strata uses to check tensor contents on the device. Compiled at run time with NVRTC.
//
// strata_checksum: sum over i of data[i] * (i % 65521 + 1), modulo 2^64, added `repeats` times
// (a long-running read for tests that race eviction against a kernel). The host reference is
// strata::kernels::checksum_host.
// strata_fill: data[i] = pattern byte of (i, seed); host reference strata::kernels::pattern.

extern "C" __global__ void strata_checksum(const unsigned char* data,
                                           unsigned long long n,
                                           unsigned int repeats,
                                           unsigned long long* out) {
    unsigned long long acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned int r = 0; r < repeats; ++r) {
        unsigned long long local = 0;
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
             i < n; i += stride) {
            // volatile: every repeat really reads memory (the point of a long-running read).
            unsigned char b = ((const volatile unsigned char*)data)[i];
            local += (unsigned long long)b * (i % 65521ULL + 1ULL);
        }
        acc += local;
    }
    if (acc != 0) {
        atomicAdd(out, acc);
    }
}

extern "C" __global__ void strata_fill(unsigned char* data, unsigned long long n, unsigned int seed) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        data[i] = (unsigned char)((i * 31ULL + seed * 7ULL) ^ (i >> 8) ^ (seed >> 3));
    }
}
