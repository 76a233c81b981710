// cuda_cpu.h: the subset of CUDA C that cuda/fused.cu and cuda/bf16.cuh use, emulated on the CPU
// so that those kernel sources run under AddressSanitizer and ThreadSanitizer (see README.md).
//
// - A launch runs the grid's blocks in waves (EMU_WAVE blocks at a time, default 1), every
//   thread of a block a real OS thread: ThreadSanitizer sees the races between threads that no
//   barrier separates (and, with EMU_WAVE > 1, between the blocks of a wave).
// - threadIdx, blockIdx, blockDim, gridDim are thread-local.
// - __syncthreads() is a real barrier over the block's threads; __shfl_sync/__shfl_xor_sync
//   (FULL_MASK only) exchange values through a barrier of the warp's 32 lanes. Each barrier
//   also checks that every thread reached the same call site (the source line). A barrier that
//   cannot complete (a thread returned while others wait, threads at different sites, or none
//   arrives within EMU_TIMEOUT_S seconds, default 20) fails the launch with a message naming the
//   kernel, the block and the line; the threads waiting in it unwind, and launch() returns false.
// - Dynamic shared memory is one malloc of exactly the launch's bytes per block; each static
//   __shared__ array is its own malloc per block (so AddressSanitizer sees overruns of either).
//   Both start as 0xFF bytes (a float NaN), as a reminder that shared memory is not zeroed.
// - Kernel sources need a little rewriting first (prep.py): the f16 inline asm becomes calls of
//   emu_f16_to_f32 / emu_f32_to_f16_rn, `extern __shared__ T name[];` and `__shared__ T
//   name[N];` become EMU_DYNAMIC_SHARED / EMU_STATIC_SHARED.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <math.h>

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

namespace emu {
struct Fiber;
// The fiber running on this OS thread (a relaxed atomic: the scheduler writes it and each
// fiber reads it with no happens-before between them, which ThreadSanitizer must not see as a
// race of its own).
inline thread_local std::atomic<Fiber*> tl_cur{nullptr};
inline Fiber* cur();
}  // namespace emu

// Per CUDA thread (fiber), read through the current fiber.
#define threadIdx (emu::cur()->tid)
#define blockIdx (emu::cur()->bid)
#define blockDim (emu::cur()->bdim)
#define gridDim (emu::cur()->gdim)

// ---- float intrinsics ---------------------------------------------------------------------
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// f16 <-> f32 as PTX's cvt.f32.f16 and cvt.rn.f16.f32 (round to nearest even; NaN as a quiet
// NaN, the sign kept).
inline float emu_f16_to_f32(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in f32
        const float v = (float)m * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
inline unsigned short emu_f32_to_f16_rn(float f) {
    unsigned int x = __float_as_uint(f);
    const unsigned short sign = (unsigned short)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00u;   // NaN
    if (x >= 0x477ff000u) return sign | 0x7c00u;  // from 65520 on: infinity
    if (x < 0x38800000u) {                        // below 2^-14: a subnormal (or 0)
        const float a = __uint_as_float(x) * 16777216.0f;  // exact: a power-of-two scaling
        return sign | (unsigned short)std::nearbyint(a);    // round to nearest even
    }
    x += 0xfffu + ((x >> 13) & 1u);
    return sign | (unsigned short)((x - 0x38000000u) >> 13);
}


// ---- fibers -------------------------------------------------------------------------------
// One fiber per CUDA thread, switched by hand (x86-64 System V: the callee-saved registers,
// MXCSR and the x87 control word). Every switch goes through the scheduler, which runs on the
// launching OS thread. ThreadSanitizer is told about every fiber and every switch (without
// synchronisation: two lanes are ordered only by what orders them on a GPU, __syncthreads
// here), AddressSanitizer about every stack switch.

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define EMU_TSAN 1
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif
#include <sys/mman.h>

extern "C" void emu_ctx_switch(void** save_sp, void* new_sp);
extern "C" void emu_ctx_trampoline();
asm(R"(
.text
.globl emu_ctx_switch
.type emu_ctx_switch,@function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_ctx_switch, .-emu_ctx_switch
.globl emu_ctx_trampoline
.type emu_ctx_trampoline,@function
emu_ctx_trampoline:
    andq $-16, %rsp
    movq %r12, %rdi
    callq *%r13
    ud2
.size emu_ctx_trampoline, .-emu_ctx_trampoline
)");

namespace emu {

enum State : int { RUNNABLE, WAIT_BLOCK, WAIT_WARP, DONE };

struct Block;
struct Launch;

struct Fiber {
    uint3 tid, bid;
    dim3 bdim, gdim;
    Block* block;
    unsigned lane, warp;
    // Written by the fiber, read by the scheduler (and back): relaxed atomics, no ordering.
    std::atomic<int> state{RUNNABLE};
    std::atomic<int> line{0};
    std::atomic<unsigned long long> shfl_in{0}, shfl_out{0};
    std::atomic<unsigned> shfl_src{0};
    void* sp = nullptr;  // saved stack pointer while switched out
    char* stack = nullptr;
    size_t stack_size = 0;
    void* tsan = nullptr;
};

struct Block {
    Launch* launch;
    uint3 idx;
    unsigned threads;
    void* dyn = nullptr;
    static constexpr int kSlots = 64;
    std::atomic<void*> statics[kSlots];
    char sync_token;  // the address __syncthreads' release/acquire annotations use
    Fiber* fibers;
    Block() {
        for (auto& s : statics) s.store(nullptr);
    }
    std::string where() const;
};

struct Launch {
    const char* kernel;
    void (*body)(void*);
    void* ctx;
    void* sched_sp = nullptr;
    void* sched_tsan = nullptr;
    const void* sched_stack_bottom = nullptr;
    size_t sched_stack_size = 0;
    std::string failure;
};

inline Fiber* cur() { return tl_cur.load(std::memory_order_relaxed); }

inline std::string Block::where() const {
    char b[200];
    std::snprintf(b, sizeof b, "kernel %s, block (%u, %u, %u)", launch->kernel, idx.x, idx.y,
                  idx.z);
    return b;
}

// Addresses for ThreadSanitizer's release/acquire annotations: a launch's start (the launcher's
// writes before every fiber) and end (every fiber before the launcher's reads after it).
inline char start_token, end_token;

inline void fail(Launch& L, const std::string& why) {
    if (L.failure.empty()) L.failure = why;
}

// Scheduler -> fiber f, back when f yields.
// Everything is read before ThreadSanitizer hears of the switch: after it, accesses count as
// the fiber's.
inline void switch_in(Launch& L, Fiber* f) {
    tl_cur.store(f, std::memory_order_relaxed);
    void** save = &L.sched_sp;
    void* to = f->sp;
#if EMU_TSAN
    __tsan_switch_to_fiber(f->tsan, __tsan_switch_to_fiber_no_sync);
#endif
#if EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f->stack, f->stack_size);
#endif
    emu_ctx_switch(save, to);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    tl_cur.store(nullptr, std::memory_order_relaxed);
}

// Fiber -> scheduler (for good when `last`). Under ThreadSanitizer every fiber's work up to here
// happens before the launcher's after the wave (end_token), whether or not the fiber finishes,
// and nothing of the launcher's is read after that release.
inline void switch_out(Launch& L, Fiber* f, bool last) {
    void** save = &f->sp;
    void* to = L.sched_sp;
#if EMU_TSAN
    void* sched = L.sched_tsan;
    __tsan_release(&end_token);
    __tsan_switch_to_fiber(sched, __tsan_switch_to_fiber_no_sync);
#endif
#if EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(last ? nullptr : &fake, L.sched_stack_bottom,
                                   L.sched_stack_size);
#endif
    emu_ctx_switch(save, to);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, &L.sched_stack_bottom, &L.sched_stack_size);
#endif
    (void)last;
}
inline void switch_out(bool last) { switch_out(*cur()->block->launch, cur(), last); }

// A failure seen inside a fiber: recorded (under ThreadSanitizer's release, the scheduler
// acquires before reading it), and the fiber is never resumed.
[[noreturn]] inline void fiber_fail(const std::string& why) {
    Fiber* f = cur();
    Launch& L = *f->block->launch;
    fail(L, f->block->where() + ": " + why);
    f->state.store(DONE, std::memory_order_relaxed);
#if EMU_TSAN
    __tsan_release(&L.failure);
#endif
    switch_out(L, f, true);
    __builtin_unreachable();
}

inline void fiber_entry(void* p) {
#if EMU_TSAN
    __tsan_acquire(&start_token);
#endif
    Fiber* f = (Fiber*)p;
    Launch& L = *f->block->launch;
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &L.sched_stack_bottom, &L.sched_stack_size);
#endif
    L.body(L.ctx);
    f->state.store(DONE, std::memory_order_relaxed);
    switch_out(L, f, true);
    __builtin_unreachable();
}

inline void syncthreads(int line) {
    Fiber* f = cur();
#if EMU_TSAN
    __tsan_release(&f->block->sync_token);
#endif
    f->line.store(line, std::memory_order_relaxed);
    f->state.store(WAIT_BLOCK, std::memory_order_relaxed);
    switch_out(false);
#if EMU_TSAN
    __tsan_acquire(&f->block->sync_token);
#endif
}

// __shfl_sync / __shfl_xor_sync, width 32: every lane of the warp must arrive at the same line
// (no memory ordering comes with it, as on a GPU).
template <typename T>
inline T shfl(unsigned mask, T v, int line, bool xor_mode, int arg) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
    if (mask != 0xffffffffu)
        fiber_fail("a shuffle with a mask other than FULL_MASK (line " + std::to_string(line) +
                   ") is not emulated");
    Fiber* f = cur();
    unsigned long long s = 0;
    std::memcpy(&s, &v, sizeof(T));
    f->shfl_in.store(s, std::memory_order_relaxed);
    f->shfl_src.store((xor_mode ? (f->lane ^ (unsigned)arg) : (unsigned)arg) % 32u,
                      std::memory_order_relaxed);
    f->line.store(line, std::memory_order_relaxed);
    f->state.store(WAIT_WARP, std::memory_order_relaxed);
    switch_out(false);
    s = f->shfl_out.load(std::memory_order_relaxed);
    T out;
    std::memcpy(&out, &s, sizeof(T));
    return out;
}

// Static __shared__ arrays: one slot per declaration (per template instance), a malloc per
// block on first use.
inline std::atomic<int> next_static_slot{0};
inline int new_static_slot() {
    const int s = next_static_slot.fetch_add(1);
    if (s >= Block::kSlots) {
        std::fprintf(stderr, "emu: more than %d static __shared__ declarations\n", Block::kSlots);
        std::abort();
    }
    return s;
}
inline void* static_shared(int slot, size_t bytes) {
    std::atomic<void*>& a = cur()->block->statics[slot];
    void* p = a.load(std::memory_order_acquire);
    if (p) return p;
    void* fresh = std::malloc(bytes);
    std::memset(fresh, 0xFF, bytes);
    if (a.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
    std::free(fresh);
    return p;
}
inline void* dynamic_shared() { return cur()->block->dyn; }

// Fiber stacks: mmap'd with a guard page below, kept for the next launch.
constexpr size_t kStack = 256 << 10;
inline std::vector<char*>& stack_pool() {
    static std::vector<char*> pool;
    return pool;
}
inline char* get_stack(size_t i) {
    auto& pool = stack_pool();
    while (pool.size() <= i) {
        char* m = (char*)mmap(nullptr, kStack + 4096, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            std::perror("emu: mmap");
            std::abort();
        }
        mprotect(m, 4096, PROT_NONE);
        pool.push_back(m + 4096);
    }
    return pool[i];
}

#if EMU_TSAN
// ThreadSanitizer's fiber contexts, kept for the next launch like the stacks (creating one costs
// ~0.5 ms). A fiber's clock then carries its own earlier launches, which the launcher's order
// already implies; fibers of one wave never share a context. After a failed launch the contexts
// of the abandoned fibers are replaced.
inline std::vector<void*>& tsan_pool() {
    static std::vector<void*> pool;
    return pool;
}
inline void* get_tsan_fiber(size_t i) {
    auto& pool = tsan_pool();
    while (pool.size() <= i) pool.push_back(__tsan_create_fiber(0));
    return pool[i];
}
#endif

// Types a launch argument may have for a kernel parameter: the same, or for a pointer the same
// pointee with other qualifiers (cudarc passes a device pointer either way). Anything else (an
// int where the kernel takes a long long, ...) does not compile: the Rust side would push bytes
// of another size or meaning.
template <typename P, typename A>
struct arg_ok : std::is_same<P, A> {};
template <typename P, typename A>
struct arg_ok<P*, A*> : std::is_same<std::remove_cv_t<P>, std::remove_cv_t<A>> {};

inline double env_double(const char* name, double dflt) {
    const char* v = std::getenv(name);
    return v && *v ? std::atof(v) : dflt;
}

inline std::string describe_waits(Block& B) {
    // threads per (state, line), for a deadlock's message
    std::string out;
    for (int st : {WAIT_BLOCK, WAIT_WARP, DONE}) {
        std::vector<std::pair<int, int>> lines;  // (line, count)
        for (unsigned t = 0; t < B.threads; t++) {
            Fiber& f = B.fibers[t];
            if (f.state.load(std::memory_order_relaxed) != st) continue;
            const int ln = st == DONE ? 0 : f.line.load(std::memory_order_relaxed);
            bool found = false;
            for (auto& p : lines)
                if (p.first == ln) found = (p.second++, true);
            if (!found) lines.push_back({ln, 1});
        }
        for (auto& p : lines) {
            char b[120];
            if (st == DONE) std::snprintf(b, sizeof b, "%d returned; ", p.second);
            else
                std::snprintf(b, sizeof b, "%d wait at %s line %d; ", p.second,
                              st == WAIT_BLOCK ? "__syncthreads" : "a shuffle", p.first);
            out += b;
        }
    }
    return out;
}

// Releases the barriers every participant reached; records a barrier that can never complete.
// True if some fiber became runnable.
inline bool complete_barriers(Launch& L, Block& B) {
    bool woke = false;
    for (unsigned w0 = 0; w0 < B.threads; w0 += 32) {
        Fiber* lanes = B.fibers + w0;
        int waiting = 0, done = 0, line = -1;
        bool same = true;
        for (int l = 0; l < 32; l++) {
            const int st = lanes[l].state.load(std::memory_order_relaxed);
            if (st == DONE) done++;
            if (st != WAIT_WARP) continue;
            const int ln = lanes[l].line.load(std::memory_order_relaxed);
            if (waiting++ == 0) line = ln;
            else if (ln != line) same = false;
        }
        if (waiting == 0) continue;
        char m[200];
        if (!same) {
            std::snprintf(m, sizeof m, "divergent shuffles in warp %u: lanes at different lines",
                          w0 / 32);
            fail(L, B.where() + ": " + m + " (" + describe_waits(B) + ")");
            return false;
        }
        if (waiting == 32) {
            for (int l = 0; l < 32; l++) {
                const unsigned src = lanes[l].shfl_src.load(std::memory_order_relaxed);
                lanes[l].shfl_out.store(lanes[src].shfl_in.load(std::memory_order_relaxed),
                                        std::memory_order_relaxed);
            }
            for (int l = 0; l < 32; l++) lanes[l].state.store(RUNNABLE, std::memory_order_relaxed);
            woke = true;
        } else if (waiting + done == 32) {
            std::snprintf(m, sizeof m,
                          "the shuffle at line %d in warp %u can never complete: %d lanes wait, "
                          "%d returned",
                          line, w0 / 32, waiting, done);
            fail(L, B.where() + ": " + m);
            return false;
        }
    }
    int waiting = 0, done = 0, line = -1;
    bool same = true;
    for (unsigned t = 0; t < B.threads; t++) {
        const int st = B.fibers[t].state.load(std::memory_order_relaxed);
        if (st == DONE) done++;
        if (st != WAIT_BLOCK) continue;
        const int ln = B.fibers[t].line.load(std::memory_order_relaxed);
        if (waiting++ == 0) line = ln;
        else if (ln != line) same = false;
    }
    if (waiting == 0) return woke;
    if (!same) {
        fail(L, B.where() + ": divergent __syncthreads (" + describe_waits(B) + ")");
        return false;
    }
    if (waiting == (int)B.threads) {
        for (unsigned t = 0; t < B.threads; t++)
            B.fibers[t].state.store(RUNNABLE, std::memory_order_relaxed);
        return true;
    }
    if (waiting + done == (int)B.threads) {
        char m[160];
        std::snprintf(m, sizeof m,
                      "the __syncthreads at line %d can never complete: %d threads wait, %d "
                      "returned",
                      line, waiting, done);
        fail(L, B.where() + ": " + m);
        return false;
    }
    return woke;
}

// kernel<<<grid, threads, smem_bytes>>>(args...). The blocks run in waves of EMU_WAVE blocks
// (default: as many as make up to 1024 threads), the fibers of a wave with no happens-before
// between blocks. False (after printing why) when a barrier failed.
template <typename... P, typename... A>
bool launch(const char* name, void (*kernel)(P...), dim3 grid, unsigned threads,
            size_t smem_bytes, A... args) {
    static_assert(sizeof...(P) == sizeof...(A), "argument count differs from the kernel's");
    static_assert((arg_ok<P, A>::value && ...), "argument types differ from the kernel's");
    if (threads == 0 || threads > 1024 || threads % 32 != 0) {
        std::fprintf(stderr, "emu: %s: %u threads per block (want a multiple of 32 up to 1024)\n",
                     name, threads);
        return false;
    }
    if (smem_bytes > 227 * 1024) {
        std::fprintf(stderr, "emu: %s: %zu bytes of dynamic shared memory, past 227 KiB\n", name,
                     smem_bytes);
        return false;
    }
    Launch L;
    L.kernel = name;
    std::tuple<A...> tup(args...);
    struct Ctx {
        void (*k)(P...);
        std::tuple<A...>* t;
    } ctx{kernel, &tup};
    L.body = [](void* c) {
        Ctx* x = (Ctx*)c;
        std::apply([&](A... a) { x->k(a...); }, *x->t);
    };
    L.ctx = &ctx;
#if EMU_TSAN
    L.sched_tsan = __tsan_get_current_fiber();
#endif
    const unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
    unsigned wave = (unsigned)env_double("EMU_WAVE", 1024 / threads);
    if (wave < 1) wave = 1;
    for (unsigned long long b0 = 0; b0 < blocks && L.failure.empty(); b0 += wave) {
        const unsigned nb = (unsigned)std::min<unsigned long long>(wave, blocks - b0);
        std::vector<Block> blks(nb);
        std::vector<Fiber> fibers((size_t)nb * threads);
        for (unsigned i = 0; i < nb; i++) {
            Block& B = blks[i];
            const unsigned long long lin = b0 + i;
            B.launch = &L;
            B.idx = {(unsigned)(lin % grid.x), (unsigned)(lin / grid.x % grid.y),
                     (unsigned)(lin / grid.x / grid.y)};
            B.threads = threads;
            B.dyn = std::malloc(smem_bytes ? smem_bytes : 1);
            std::memset(B.dyn, 0xFF, smem_bytes ? smem_bytes : 1);
            B.fibers = &fibers[(size_t)i * threads];
            for (unsigned t = 0; t < threads; t++) {
                Fiber& f = B.fibers[t];
                f.tid = {t, 0, 0};
                f.bid = B.idx;
                f.bdim = {threads, 1, 1};
                f.gdim = grid;
                f.block = &B;
                f.lane = t % 32;
                f.warp = t / 32;
                f.stack = get_stack((size_t)i * threads + t);
                f.stack_size = kStack;
#if EMU_ASAN
                __asan_unpoison_memory_region(f.stack, kStack);
#endif
                // The first switch "returns" into the trampoline, which calls fiber_entry(&f).
                unsigned long long* sp = (unsigned long long*)(f.stack + kStack) - 9;
                sp[0] = 0x1F80ull | (0x037Full << 32);  // MXCSR, x87 control word
                sp[1] = 0;                               // r15
                sp[2] = 0;                               // r14
                sp[3] = (unsigned long long)(void*)&fiber_entry;  // r13
                sp[4] = (unsigned long long)(void*)&f;            // r12
                sp[5] = 0;                                        // rbx
                sp[6] = 0;                                        // rbp
                sp[7] = (unsigned long long)(void*)&emu_ctx_trampoline;
                sp[8] = 0;
                f.sp = sp;
#if EMU_TSAN
                f.tsan = get_tsan_fiber((size_t)i * threads + t);
#endif
            }
        }
#if EMU_TSAN
        __tsan_release(&start_token);
#endif
        for (;;) {
            bool ran = false;
            for (auto& f : fibers)
                if (f.state.load(std::memory_order_relaxed) == RUNNABLE) {
                    switch_in(L, &f);
                    ran = true;
                }
#if EMU_TSAN
            __tsan_acquire(&L.failure);
#endif
            if (!L.failure.empty()) break;
            bool all_done = true;
            for (auto& B : blks) {
                if (complete_barriers(L, B)) ran = true;
                for (unsigned t = 0; t < threads; t++)
                    if (B.fibers[t].state.load(std::memory_order_relaxed) != DONE) all_done = false;
            }
            if (!L.failure.empty() || all_done) break;
            if (!ran) {
                for (auto& B : blks)
                    for (unsigned t = 0; t < threads; t++)
                        if (B.fibers[t].state.load(std::memory_order_relaxed) != DONE) {
                            fail(L, B.where() + ": deadlock: " + describe_waits(B));
                            break;
                        }
                break;
            }
        }
#if EMU_TSAN
        __tsan_acquire(&end_token);
        for (size_t t = 0; t < fibers.size(); t++)
            if (fibers[t].state.load(std::memory_order_relaxed) != DONE) {
                __tsan_destroy_fiber(fibers[t].tsan);
                tsan_pool()[t] = __tsan_create_fiber(0);
            }
#endif
        for (auto& B : blks) {
            std::free(B.dyn);
            for (auto& s : B.statics) std::free(s.load());
        }
    }
    if (!L.failure.empty()) {
        std::fprintf(stderr, "emu: %s\n", L.failure.c_str());
        return false;
    }
    return true;
}

}  // namespace emu

#define __syncthreads() emu::syncthreads(__LINE__)
#define __shfl_sync(mask, v, lane) emu::shfl((mask), (v), __LINE__, false, (lane))
#define __shfl_xor_sync(mask, v, lanemask) emu::shfl((mask), (v), __LINE__, true, (lanemask))
#define EMU_DYNAMIC_SHARED(T, name) T* name = (T*)emu::dynamic_shared()
#define EMU_STATIC_SHARED(T, name, N)                                                         \
    static const int name##_emu_slot = emu::new_static_slot();                                \
    T(&name)[N] = *reinterpret_cast<T(*)[N]>(emu::static_shared(name##_emu_slot, sizeof(T[N])))
// kernel<<<grid, threads, smem>>>(args...), the kernel named in messages.
#define EMU_LAUNCH(kernel, grid, threads, smem, ...) \
    emu::launch(#kernel, kernel, grid, threads, smem, __VA_ARGS__)
