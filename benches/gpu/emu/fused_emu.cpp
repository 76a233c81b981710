// Runs every kernel of cuda/fused.cu that src/backend/cuda/fused.rs launches, on the CPU through
// cuda_cpu.h, with the grid, threads, shared memory and arguments the launcher computes, on
// random inputs in buffers of exactly the size the launcher checks, and compares the results
// with naive references (double precision, the semantics of src/candle/fused/). One line per
// case; exit status 1 if any case failed. See README.md.
#include "fused_prog.h"  // prep.py's rewrite of cuda/bf16.cuh + cuda/fused.cu per element type
#include "quants_ref.h"  // quants.py: tests/fixtures/quants.gguf's blocks and the gguf package's values

#include <algorithm>
#include <cinttypes>
#include <functional>
#include <random>

using i32 = int;        // a Rust i32 pushed as a kernel's int
using i64 = long long;  // a Rust i64 pushed as a kernel's long long

// ---- element types --------------------------------------------------------------------------
using bf16 = emu_bf16::bf16_t;
using f16 = emu_f16::f16_t;

static unsigned short host_f32_to_bf16(float f) {  // round to nearest even (half::bf16)
    unsigned int u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
static float host_bf16_to_f32(unsigned short b) {
    unsigned int u = (unsigned int)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// An f16 decoded independently of cuda_cpu.h's converter.
static double f16_value(unsigned short h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double s = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0) return s * std::ldexp((double)m, -24);
    if (e == 31) return m ? NAN : s * INFINITY;
    return s * std::ldexp((double)(m | 1024), e - 25);
}

template <class T>
struct E;
template <>
struct E<float> {
    static constexpr const char* name = "f32";
    static constexpr int mant = 23;
    static float widen(float v) { return v; }
    static float narrow(float x) { return x; }
};
template <>
struct E<bf16> {
    static constexpr const char* name = "bf16";
    static constexpr int mant = 7;
    static float widen(bf16 v) { return host_bf16_to_f32(v.bits); }
    static bf16 narrow(float x) { return bf16{host_f32_to_bf16(x)}; }
};
template <>
struct E<f16> {
    static constexpr const char* name = "f16";
    static constexpr int mant = 10;
    static float widen(f16 v) { return (float)f16_value(v.bits); }
    static f16 narrow(float x) { return f16{emu_f32_to_f16_rn(x)}; }  // checked by f16_conversions
};
// One rounding step of T at magnitude a (the spacing of T's values there; 0 for f32, whose
// error the relative tolerance covers).
template <class T>
static double ulp(double a) {
    if (E<T>::mant == 23) return 0.0;
    a = std::fabs(a);
    const int min_exp = E<T>::mant == 10 ? -14 : -126;
    int e = a > 0 ? std::ilogb(a) : min_exp;
    if (e < min_exp) e = min_exp;
    return std::ldexp(1.0, e - E<T>::mant);
}
template <class T>
static T nan_of() {
    T t;
    std::memset(&t, 0xFF, sizeof t);  // NaN in f32, bf16 and f16: marks what no kernel wrote
    return t;
}

// ---- the kernels, by element type ---------------------------------------------------------
template <class T>
struct K;
#define KERNELS(NS, N, T)                                                                       \
    template <>                                                                                 \
    struct K<T> {                                                                               \
        static constexpr decltype(&NS::strata_attn_fwd_##N##_d64) fwd[3] = {                   \
            NS::strata_attn_fwd_##N##_d64, NS::strata_attn_fwd_##N##_d128,                      \
            NS::strata_attn_fwd_##N##_d256};                                                    \
        static constexpr decltype(&NS::strata_attn_dq_##N##_d64) dq[3] = {                     \
            NS::strata_attn_dq_##N##_d64, NS::strata_attn_dq_##N##_d128,                        \
            NS::strata_attn_dq_##N##_d256};                                                     \
        static constexpr decltype(&NS::strata_attn_dkdv_##N##_d64) dkdv[3] = {                 \
            NS::strata_attn_dkdv_##N##_d64, NS::strata_attn_dkdv_##N##_d128,                    \
            NS::strata_attn_dkdv_##N##_d256};                                                   \
        static constexpr auto delta = NS::strata_attn_delta_##N;                                \
        static constexpr auto rms_fwd = NS::strata_rms_fwd_##N;                                 \
        static constexpr auto add_rms_fwd = NS::strata_add_rms_fwd_##N;                         \
        static constexpr auto rms_dx = NS::strata_rms_dx_##N;                                   \
        static constexpr auto rms_dw_partial = NS::strata_rms_dw_partial_##N;                   \
        static constexpr auto rms_dw_sum = NS::strata_rms_dw_sum_##N;                           \
        static constexpr auto rope = NS::strata_rope_##N;                                       \
        static constexpr auto swiglu_fwd = NS::strata_swiglu_fwd_##N;                           \
        static constexpr auto swiglu_bwd = NS::strata_swiglu_bwd_##N;                           \
        static constexpr auto swiglu_joined_fwd = NS::strata_swiglu_joined_fwd_##N;             \
        static constexpr auto swiglu_joined_bwd = NS::strata_swiglu_joined_bwd_##N;             \
        static constexpr auto grad_acc = NS::strata_grad_acc_##N;                               \
        static constexpr auto grad_index_add = NS::strata_grad_index_add_##N;                   \
        static constexpr auto dequant = NS::strata_dequant_##N;                                 \
    };
KERNELS(emu_f32, f32, float)
KERNELS(emu_bf16, bf16, bf16)
KERNELS(emu_f16, f16, f16)

static std::string kname(const char* k, const char* elem, int width = 0) {
    std::string s = std::string("strata_") + k + "_" + elem;
    if (width) s += "_d" + std::to_string(width);
    return s;
}

// ---- checking -----------------------------------------------------------------------------
static int failures = 0, cases = 0;

struct Check {
    std::string what;
    double worst = 0, max_abs = 0;  // worst |got - ref| / tol; largest |got - ref|
    long n = 0, bad = 0;
    std::string first;
    void add(size_t i, double got, double ref, double tol) {
        n++;
        const double err = got == ref ? 0.0 : std::fabs(got - ref);  // inf == inf
        bool ok = err <= tol;
        if (std::isnan(got) || std::isnan(ref)) ok = std::isnan(got) && std::isnan(ref);
        const double r = tol > 0 ? err / tol : (err > 0 ? INFINITY : 0.0);
        if (!std::isnan(err)) {
            worst = std::max(worst, r);
            max_abs = std::max(max_abs, err);
        } else if (!ok) {
            worst = INFINITY;
        }
        if (!ok && bad++ == 0) {
            char b[200];
            std::snprintf(b, sizeof b, "[%zu] got %.9g want %.9g (tol %.3g)", i, got, ref, tol);
            first = b;
        }
    }
};

static bool report(const std::string& name, bool launched, const std::vector<Check>& checks,
                   const std::string& extra = "") {
    bool ok = launched;
    std::string detail;
    for (auto& c : checks) {
        ok = ok && c.bad == 0;
        char b[300];
        std::snprintf(b, sizeof b, " %s err/tol %.3g (abs %.3g)", c.what.c_str(), c.worst,
                      c.max_abs);
        detail += b;
        if (c.bad) {
            std::snprintf(b, sizeof b, " [%ld of %ld bad, first %s]", c.bad, c.n, c.first.c_str());
            detail += b;
        }
    }
    if (!launched) detail = " launch failed (barrier; see the emu: line above)";
    cases++;
    if (!ok) failures++;
    std::printf("%s %s:%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str(), extra.c_str());
    std::fflush(stdout);
    return ok;
}

static std::mt19937_64 rng(12345);
static double uni(double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); }
template <class T>
static std::vector<T> rand_vec(size_t n, double lo, double hi) {
    std::vector<T> v(n);
    for (auto& x : v) x = E<T>::narrow((float)uni(lo, hi));
    return v;
}
template <class T>
static double W(const T& v) {
    return E<T>::widen(v);
}

// fused.rs's helpers, as written there.
static size_t div_ceil(size_t a, size_t b) { return (a + b - 1) / b; }
// fused.rs: stride_blocks
static size_t stride_blocks(size_t n) { return std::clamp<size_t>(div_ceil(n, 256), 1, 1 << 16); }
// fused.rs: row_threads
static unsigned row_threads(size_t hidden) {
    return (unsigned)std::clamp<size_t>(div_ceil(hidden, 32) * 32, 32, 1024);
}
static dim3 grid3(size_t x, size_t y, size_t z) { return dim3{(unsigned)x, (unsigned)y, (unsigned)z}; }
// fused.rs: Kernel::config launches nothing for a grid with a 0.
static bool empty_grid(dim3 g) { return g.x == 0 || g.y == 0 || g.z == 0; }

// ---- attention ------------------------------------------------------------------------------
constexpr size_t BQ = 16, BK = 32;  // fused.rs: BQ, BK (cuda/fused.cu's)
constexpr unsigned ATTN_THREADS = 128;
constexpr size_t WIDTHS[3] = {64, 128, 256};

enum Layout { DENSE, FUSED_QKV, HEADS_MAJOR };
static const char* layout_name[] = {"dense", "fused-qkv", "heads-major"};

struct Geo {
    size_t b, sq, skv, nh, nkv, d, window;  // window 0: none
    Layout layout;
    size_t offset() const { return skv - sq; }
    bool sees(size_t i, size_t j) const {
        const size_t pos = offset() + i;
        return j <= pos && (window == 0 || pos - j < window);
    }
    std::string str() const {
        char s[200];
        std::snprintf(s, sizeof s, "b=%zu sq=%zu skv=%zu nh=%zu nkv=%zu d=%zu window=%zu %s", b, sq,
                      skv, nh, nkv, d, window, layout_name[layout]);
        return s;
    }
};

// q, k, v laid out as the case says: the buffers (exactly sized), the element offset of each
// view in its buffer, and [batch, seq, head] strides (fused.rs: AttnShape::strides).
template <class T>
struct QKV {
    std::vector<T> qbuf, kbuf, vbuf;  // FUSED_QKV: all three in qbuf
    size_t qo = 0, ko = 0, vo = 0;
    size_t st[3][3];
    const T* q() const { return qbuf.data() + qo; }
    const T* k() const { return (kbuf.empty() ? qbuf.data() : kbuf.data()) + ko; }
    const T* v() const { return (vbuf.empty() ? qbuf.data() : vbuf.data()) + vo; }
    // element e of row (bi, s, h) of tensor t (0 q, 1 k, 2 v)
    double at(int t, size_t bi, size_t s, size_t h, size_t e) const {
        const T* p = t == 0 ? q() : t == 1 ? k() : v();
        return W(p[bi * st[t][0] + s * st[t][1] + h * st[t][2] + e]);
    }
};

template <class T>
static QKV<T> make_qkv(const Geo& g) {
    QKV<T> x;
    const size_t d = g.d;
    if (g.layout == FUSED_QKV) {  // [b, s, nh + 2 nkv, d]: q, k, v heads side by side
        const size_t heads = g.nh + 2 * g.nkv, s = g.sq;
        x.qbuf = rand_vec<T>(g.b * s * heads * d, -2, 2);
        x.ko = g.nh * d;
        x.vo = (g.nh + g.nkv) * d;
        for (auto& r : x.st) r[0] = s * heads * d, r[1] = heads * d, r[2] = d;
    } else {
        x.qbuf = rand_vec<T>(g.b * g.sq * g.nh * d, -2, 2);
        x.kbuf = rand_vec<T>(g.b * g.skv * g.nkv * d, -2, 2);
        x.vbuf = rand_vec<T>(g.b * g.skv * g.nkv * d, -2, 2);
        if (g.layout == DENSE) {  // [b, s, h, d]
            x.st[0][0] = g.sq * g.nh * d, x.st[0][1] = g.nh * d, x.st[0][2] = d;
            for (int t : {1, 2}) x.st[t][0] = g.skv * g.nkv * d, x.st[t][1] = g.nkv * d, x.st[t][2] = d;
        } else {  // [b, h, s, d] seen as [b, s, h, d]
            x.st[0][0] = g.nh * g.sq * d, x.st[0][1] = d, x.st[0][2] = g.sq * d;
            for (int t : {1, 2}) x.st[t][0] = g.nkv * g.skv * d, x.st[t][1] = d, x.st[t][2] = g.skv * d;
        }
    }
    return x;
}

// The reference in double: forward (o, lse) and backward (dq, dk, dv) of causal GQA attention,
// src/candle/fused/attention.rs's semantics, from dense double copies of the inputs.
struct Ref {
    const Geo& g;
    double scale;
    std::vector<double> q, k, v;  // [b, s, h, d]
    double& Q(size_t bi, size_t i, size_t h, size_t e) { return q[((bi * g.sq + i) * g.nh + h) * g.d + e]; }
    double& Kd(size_t bi, size_t j, size_t h, size_t e) { return k[((bi * g.skv + j) * g.nkv + h) * g.d + e]; }
    double& Vd(size_t bi, size_t j, size_t h, size_t e) { return v[((bi * g.skv + j) * g.nkv + h) * g.d + e]; }
    size_t kvh(size_t h) const { return h / (g.nh / g.nkv); }
    double score(size_t bi, size_t i, size_t h, size_t j, double* sabs = nullptr) {
        double s = 0, a = 0;
        for (size_t e = 0; e < g.d; e++) {
            s += Q(bi, i, h, e) * Kd(bi, j, kvh(h), e);
            a += std::fabs(Q(bi, i, h, e) * Kd(bi, j, kvh(h), e));
        }
        if (sabs) *sabs = a * std::fabs(scale);
        return s * scale;
    }
    // o [b, sq, nh, d], lse [b, sq, nh]; omag: sum_j p |v_j| per element, smax: max |s| per row.
    void forward(std::vector<double>& o, std::vector<double>& lse, std::vector<double>* omag = nullptr,
                 std::vector<double>* smax = nullptr) {
        o.assign(g.b * g.sq * g.nh * g.d, 0.0);
        lse.assign(g.b * g.sq * g.nh, 0.0);
        if (omag) omag->assign(o.size(), 0.0);
        if (smax) smax->assign(lse.size(), 0.0);
        std::vector<double> s(g.skv);
        for (size_t bi = 0; bi < g.b; bi++)
            for (size_t i = 0; i < g.sq; i++)
                for (size_t h = 0; h < g.nh; h++) {
                    const size_t row = (bi * g.sq + i) * g.nh + h;
                    double m = -INFINITY, sm = 0;
                    for (size_t j = 0; j < g.skv; j++)
                        if (g.sees(i, j)) {
                            s[j] = score(bi, i, h, j);
                            m = std::max(m, s[j]);
                            sm = std::max(sm, std::fabs(s[j]));
                        }
                    double l = 0;
                    for (size_t j = 0; j < g.skv; j++)
                        if (g.sees(i, j)) l += std::exp(s[j] - m);
                    for (size_t j = 0; j < g.skv; j++)
                        if (g.sees(i, j)) {
                            const double p = std::exp(s[j] - m) / l;
                            for (size_t e = 0; e < g.d; e++) {
                                o[row * g.d + e] += p * Vd(bi, j, kvh(h), e);
                                if (omag) (*omag)[row * g.d + e] += p * std::fabs(Vd(bi, j, kvh(h), e));
                            }
                        }
                    lse[row] = m + std::log(l);
                    if (smax) (*smax)[row] = sm;
                }
    }
    // The backward from dout, lse and delta as given; *mag: error scales (see Check's tolerance).
    void backward(const std::vector<double>& dout, const std::vector<double>& lse,
                  const std::vector<double>& delta, std::vector<double>& dq, std::vector<double>& dk,
                  std::vector<double>& dv, std::vector<double>* dqm = nullptr,
                  std::vector<double>* dkm = nullptr, std::vector<double>* dvm = nullptr) {
        dq.assign(q.size(), 0.0);
        dk.assign(k.size(), 0.0);
        dv.assign(v.size(), 0.0);
        if (dqm) dqm->assign(q.size(), 0.0), dkm->assign(k.size(), 0.0), dvm->assign(v.size(), 0.0);
        for (size_t bi = 0; bi < g.b; bi++)
            for (size_t i = 0; i < g.sq; i++)
                for (size_t h = 0; h < g.nh; h++) {
                    const size_t row = (bi * g.sq + i) * g.nh + h, kh = kvh(h);
                    for (size_t j = 0; j < g.skv; j++) {
                        if (!g.sees(i, j)) continue;
                        double sabs;
                        const double p = std::exp(score(bi, i, h, j, &sabs) - lse[row]);
                        double dp = 0, dpabs = 0;
                        for (size_t e = 0; e < g.d; e++) {
                            dp += dout[row * g.d + e] * Vd(bi, j, kh, e);
                            dpabs += std::fabs(dout[row * g.d + e] * Vd(bi, j, kh, e));
                        }
                        const double ds = p * (dp - delta[row]);
                        // f32 error scale of ds: p's relative error ~ that of s and lse, dp's
                        // ~ dpabs, and the difference's.
                        const double dsm = p * ((std::fabs(dp) + std::fabs(delta[row])) *
                                                    (1 + sabs + std::fabs(lse[row])) +
                                                dpabs);
                        const double pm = p * (1 + sabs + std::fabs(lse[row]));
                        for (size_t e = 0; e < g.d; e++) {
                            dq[row * g.d + e] += scale * ds * Kd(bi, j, kh, e);
                            dk[((bi * g.skv + j) * g.nkv + kh) * g.d + e] += scale * ds * Q(bi, i, h, e);
                            dv[((bi * g.skv + j) * g.nkv + kh) * g.d + e] += p * dout[row * g.d + e];
                            if (dqm) {
                                (*dqm)[row * g.d + e] += std::fabs(scale) * dsm * std::fabs(Kd(bi, j, kh, e));
                                (*dkm)[((bi * g.skv + j) * g.nkv + kh) * g.d + e] +=
                                    std::fabs(scale) * dsm * std::fabs(Q(bi, i, h, e));
                                (*dvm)[((bi * g.skv + j) * g.nkv + kh) * g.d + e] +=
                                    pm * std::fabs(dout[row * g.d + e]);
                            }
                        }
                    }
                }
    }
};

// The reference's backward against central differences of its forward, in double: the largest
// relative difference over a few elements of q, k and v, L = sum(o * dout).
static double fd_check(Ref& R, const std::vector<double>& dout) {
    std::vector<double> o, lse, delta(R.g.b * R.g.sq * R.g.nh, 0.0), dq, dk, dv;
    R.forward(o, lse);
    for (size_t r = 0; r < delta.size(); r++)
        for (size_t e = 0; e < R.g.d; e++) delta[r] += dout[r * R.g.d + e] * o[r * R.g.d + e];
    R.backward(dout, lse, delta, dq, dk, dv);
    auto loss = [&]() {
        std::vector<double> o2, l2;
        R.forward(o2, l2);
        double L = 0;
        for (size_t i = 0; i < o2.size(); i++) L += o2[i] * dout[i];
        return L;
    };
    double worst = 0;
    std::vector<double>* xs[3] = {&R.q, &R.k, &R.v};
    const std::vector<double>* gs[3] = {&dq, &dk, &dv};
    for (int t = 0; t < 3; t++)
        for (int n = 0; n < 4; n++) {
            const size_t idx = (size_t)(uni(0, 1) * xs[t]->size()) % xs[t]->size();
            const double h = 1e-6, x0 = (*xs[t])[idx];
            (*xs[t])[idx] = x0 + h;
            const double lp = loss();
            (*xs[t])[idx] = x0 - h;
            const double lm = loss();
            (*xs[t])[idx] = x0;
            const double fd = (lp - lm) / (2 * h), an = (*gs[t])[idx];
            worst = std::max(worst, std::fabs(fd - an) / (std::fabs(an) + 1e-3));
        }
    return worst;
}

template <class T>
static void attention_case(const Geo& g) {
    const std::string elem = E<T>::name;
    const size_t width = std::find_if(WIDTHS, WIDTHS + 3, [&](size_t w) { return g.d <= w; }) - WIDTHS;
    const int W_ = (int)WIDTHS[width];
    const float scale = 1.0f / std::sqrt((float)g.d);
    QKV<T> x = make_qkv<T>(g);
    const size_t rows = g.b * g.sq * g.nh, kv_rows = g.b * g.skv * g.nkv, d = g.d;
    // fused.rs: AttnArgs::push: sq, skv, nh, nkv, d as int; nine strides, window as long long.
    const i32 sq = (i32)g.sq, skv = (i32)g.skv, nh = (i32)g.nh, nkv = (i32)g.nkv, di = (i32)d;
    i64 s[9];
    for (int t = 0; t < 3; t++)
        for (int j = 0; j < 3; j++) s[t * 3 + j] = (i64)x.st[t][j];
    const i64 window = (i64)g.window;
    const std::string tag = elem + " d" + std::to_string(W_) + " " + g.str();

    Ref R{g, (double)scale, {}, {}, {}};
    R.q.resize(rows * d), R.k.resize(kv_rows * d), R.v.resize(kv_rows * d);
    for (size_t bi = 0; bi < g.b; bi++)
        for (size_t e = 0; e < d; e++) {
            for (size_t i = 0; i < g.sq; i++)
                for (size_t h = 0; h < g.nh; h++) R.Q(bi, i, h, e) = x.at(0, bi, i, h, e);
            for (size_t j = 0; j < g.skv; j++)
                for (size_t h = 0; h < g.nkv; h++) {
                    R.Kd(bi, j, h, e) = x.at(1, bi, j, h, e);
                    R.Vd(bi, j, h, e) = x.at(2, bi, j, h, e);
                }
        }

    // -- forward (fused.rs: FusedKernels::attn_fwd)
    std::vector<T> o(rows * d, nan_of<T>());
    std::vector<float> lse(rows, nan_of<float>());
    {
        const size_t smem = 4 * (BQ * d + 2 * BK * (d + 1));
        const dim3 grid = grid3(div_ceil(g.sq, BQ), g.nh, g.b);
        bool ok = empty_grid(grid) ||
                  emu::launch(kname("attn_fwd", E<T>::name, W_).c_str(), K<T>::fwd[width], grid,
                              ATTN_THREADS, smem, x.q(), x.k(), x.v(), o.data(), lse.data(), sq, skv,
                              nh, nkv, di, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8],
                              scale, window);
        std::vector<double> ro, rl, om, sm;
        R.forward(ro, rl, &om, &sm);
        Check co{"o"}, cl{"lse"};
        for (size_t i = 0; i < ro.size(); i++)
            co.add(i, W(o[i]), ro[i], ulp<T>(std::max(std::fabs(ro[i]), std::fabs(W(o[i])))) + 1e-5 * om[i]);
        for (size_t i = 0; i < rl.size(); i++) cl.add(i, lse[i], rl[i], 1e-5 * (1 + sm[i] + std::fabs(rl[i])));
        report("attn_fwd " + tag, ok, {co, cl});
    }

    // -- backward inputs: dout random, o and lse the reference's (rounded as stored), delta
    // from them, so each kernel is checked on its own.
    std::vector<double> ro, rl;
    R.forward(ro, rl);
    std::vector<T> dout = rand_vec<T>(rows * d, -1, 1), o_in(rows * d);
    std::vector<float> lse_in(rows), delta_in(rows);
    std::vector<double> dd(rows * d), lse_d(rows), delta_d(rows, 0.0);
    for (size_t i = 0; i < rows * d; i++) o_in[i] = E<T>::narrow((float)ro[i]), dd[i] = W(dout[i]);
    for (size_t r = 0; r < rows; r++) {
        lse_in[r] = (float)rl[r];
        lse_d[r] = lse_in[r];
        double a = 0;
        for (size_t e = 0; e < d; e++) a += W(dout[r * d + e]) * W(o_in[r * d + e]);
        delta_in[r] = (float)a;
        delta_d[r] = delta_in[r];
    }

    // -- delta (fused.rs: FusedKernels::attn_delta)
    {
        std::vector<float> delta(rows, nan_of<float>());
        const dim3 grid = grid3(div_ceil(rows, 4), 1, 1);
        bool ok = empty_grid(grid) ||
                  emu::launch(kname("attn_delta", E<T>::name).c_str(), K<T>::delta, grid,
                              ATTN_THREADS, (size_t)0, dout.data(), o_in.data(), delta.data(),
                              (i64)rows, di);
        Check c{"delta"};
        for (size_t r = 0; r < rows; r++) {
            double a = 0, m = 0;
            for (size_t e = 0; e < d; e++) {
                a += W(dout[r * d + e]) * W(o_in[r * d + e]);
                m += std::fabs(W(dout[r * d + e]) * W(o_in[r * d + e]));
            }
            c.add(r, delta[r], a, 1e-5 * m);
        }
        report("attn_delta " + elem + " rows=" + std::to_string(rows) + " d=" + std::to_string(d), ok, {c});
    }

    std::vector<double> rdq, rdk, rdv, mq, mk, mv;
    R.backward(dd, lse_d, delta_d, rdq, rdk, rdv, &mq, &mk, &mv);
    // -- dq (fused.rs: FusedKernels::attn_dq)
    {
        std::vector<T> dq(rows * d, nan_of<T>());
        const size_t smem = 4 * (2 * BQ * d + 2 * BK * (d + 1));
        const dim3 grid = grid3(div_ceil(g.sq, BQ), g.nh, g.b);
        bool ok = empty_grid(grid) ||
                  emu::launch(kname("attn_dq", E<T>::name, W_).c_str(), K<T>::dq[width], grid,
                              ATTN_THREADS, smem, x.q(), x.k(), x.v(), dout.data(), lse_in.data(),
                              delta_in.data(), dq.data(), sq, skv, nh, nkv, di, s[0], s[1], s[2],
                              s[3], s[4], s[5], s[6], s[7], s[8], scale, window);
        Check c{"dq"};
        for (size_t i = 0; i < dq.size(); i++)
            c.add(i, W(dq[i]), rdq[i], ulp<T>(std::max(std::fabs(rdq[i]), std::fabs(W(dq[i])))) + 1e-5 * mq[i]);
        report("attn_dq " + tag, ok, {c});
    }
    // -- dk, dv (fused.rs: FusedKernels::attn_dkdv)
    {
        std::vector<T> dk(kv_rows * d, nan_of<T>()), dv(kv_rows * d, nan_of<T>());
        const size_t smem = 4 * (2 * BK * (d + 1) + 2 * 4 * d + 2 * 4 * BK);
        const dim3 grid = grid3(div_ceil(g.skv, BK), g.nkv, g.b);
        bool ok = empty_grid(grid) ||
                  emu::launch(kname("attn_dkdv", E<T>::name, W_).c_str(), K<T>::dkdv[width], grid,
                              ATTN_THREADS, smem, x.q(), x.k(), x.v(), dout.data(), lse_in.data(),
                              delta_in.data(), dk.data(), dv.data(), sq, skv, nh, nkv, di, s[0],
                              s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], scale, window);
        Check ck{"dk"}, cv{"dv"};
        for (size_t i = 0; i < dk.size(); i++) {
            ck.add(i, W(dk[i]), rdk[i], ulp<T>(std::max(std::fabs(rdk[i]), std::fabs(W(dk[i])))) + 1e-5 * mk[i]);
            cv.add(i, W(dv[i]), rdv[i], ulp<T>(std::max(std::fabs(rdv[i]), std::fabs(W(dv[i])))) + 1e-5 * mv[i]);
        }
        char fd[80] = "";
        if (E<T>::mant == 23) {  // the reference's own backward, once per geometry
            const double w = fd_check(R, dd);
            std::snprintf(fd, sizeof fd, "; reference backward vs finite differences %.2g", w);
            if (!(w < 1e-5)) {
                std::printf("FAIL reference backward vs finite differences: %.3g\n", w);
                failures++;
            }
        }
        report("attn_dkdv " + tag, ok, {ck, cv}, fd);
    }
}

// ---- RMSNorm --------------------------------------------------------------------------------
// fwd_dx false: only the weight's gradient (rms_dw_partial, rms_dw_sum), for many rows.
// 1 / sqrt(mean(x_r^2) + eps) of row r, in double.
template <class T>
static double ref_inv(const std::vector<T>& x, size_t r, size_t hidden, float eps) {
    double ss = 0;
    for (size_t e = 0; e < hidden; e++) ss += W(x[r * hidden + e]) * W(x[r * hidden + e]);
    return 1.0 / std::sqrt(ss / hidden + eps);
}

template <class T>
static void rms_case(size_t rows, size_t hidden, bool fwd_dx = true) {
    const std::string tag = std::string(E<T>::name) + " rows=" + std::to_string(rows) +
                            " hidden=" + std::to_string(hidden);
    const float eps = 1e-5f;
    auto x = rand_vec<T>(rows * hidden, -2, 2), w = rand_vec<T>(hidden, -1.5, 1.5),
         dy = rand_vec<T>(rows * hidden, -1, 1);
    const i32 h = (i32)hidden;
    std::vector<float> inv(rows, nan_of<float>());
    if (fwd_dx) {  // fused.rs: FusedKernels::rms_fwd
        std::vector<T> out(rows * hidden, nan_of<T>());
        const dim3 grid = grid3(rows, 1, 1);
        bool ok = empty_grid(grid) ||
                  emu::launch(kname("rms_fwd", E<T>::name).c_str(), K<T>::rms_fwd, grid,
                              row_threads(hidden), (size_t)0, x.data(), w.data(), out.data(),
                              inv.data(), h, eps);
        Check ci{"inv"}, co{"out"};
        for (size_t r = 0; r < rows; r++) {
            const double ri = ref_inv(x, r, hidden, eps);
            ci.add(r, inv[r], ri, 1e-5 * ri);
            for (size_t e = 0; e < hidden; e++) {
                // out = narrow(narrow(x * inv) * w): the inner rounding of the f32 product
                // x * inv (with the kernel's inv, checked above), as norm.rs rounds it.
                const double n = W(E<T>::narrow((float)W(x[r * hidden + e]) * inv[r]));
                const double ref = n * W(w[e]);
                const double got = W(out[r * hidden + e]);
                co.add(r * hidden + e, got, ref, ulp<T>(std::max(std::fabs(ref), std::fabs(got))) + 1e-5 * std::fabs(ref));
            }
        }
        report("rms_fwd " + tag, ok, {ci, co});
    }
    // the backward's inv: the reference's, rounded to f32 as stored
    for (size_t r = 0; r < rows; r++) inv[r] = (float)ref_inv(x, r, hidden, eps);
    if (fwd_dx) {  // fused.rs: FusedKernels::rms_dx
        std::vector<T> dx(rows * hidden, nan_of<T>());
        const dim3 grid = grid3(rows, 1, 1);
        bool ok = empty_grid(grid) ||
                  emu::launch(kname("rms_dx", E<T>::name).c_str(), K<T>::rms_dx, grid,
                              row_threads(hidden), (size_t)0, x.data(), w.data(), dy.data(),
                              inv.data(), dx.data(), h);
        Check c{"dx"};
        for (size_t r = 0; r < rows; r++) {
            const double ri = inv[r];
            double a = 0, am = 0;
            for (size_t e = 0; e < hidden; e++) {
                const double t = W(dy[r * hidden + e]) * W(w[e]) * W(x[r * hidden + e]);
                a += t, am += std::fabs(t);
            }
            const double kk = a / hidden * ri * ri * ri, km = am / hidden * ri * ri * ri;
            for (size_t e = 0; e < hidden; e++) {
                const size_t i = r * hidden + e;
                const double ref = ri * W(dy[i]) * W(w[e]) - kk * W(x[i]);
                const double m = std::fabs(ri * W(dy[i]) * W(w[e])) + km * std::fabs(W(x[i]));
                c.add(i, W(dx[i]), ref, ulp<T>(std::max(std::fabs(ref), std::fabs(W(dx[i])))) + 1e-5 * m);
            }
        }
        report("rms_dx " + tag, ok, {c});
    }
    // fused.rs: FusedKernels::rms_dw_partial with cuda.rs's DW_ROWS = 64 rows per chunk
    const size_t chunk_rows = 64, chunks = div_ceil(rows, chunk_rows);
    std::vector<float> partial(chunks * hidden, nan_of<float>());
    {
        const dim3 grid = grid3(div_ceil(hidden, 256), chunks, 1);
        bool ok = empty_grid(grid) ||
                  emu::launch(kname("rms_dw_partial", E<T>::name).c_str(), K<T>::rms_dw_partial,
                              grid, 256u, (size_t)0, x.data(), dy.data(), inv.data(),
                              partial.data(), (i64)rows, h, (i32)chunk_rows);
        Check c{"partial"};
        for (size_t ch = 0; ch < chunks; ch++)
            for (size_t col = 0; col < hidden; col++) {
                double a = 0, m = 0;
                for (size_t r = ch * chunk_rows; r < std::min(rows, (ch + 1) * chunk_rows); r++) {
                    const double n = W(E<T>::narrow((float)W(x[r * hidden + col]) * inv[r]));
                    a += W(dy[r * hidden + col]) * n;
                    m += std::fabs(W(dy[r * hidden + col]) * n);
                }
                c.add(ch * hidden + col, partial[ch * hidden + col], a, 1e-5 * m);
            }
        report("rms_dw_partial " + tag + " chunks=" + std::to_string(chunks), ok, {c});
    }
    {  // fused.rs: FusedKernels::rms_dw_sum: the partial sums added in chunk order in f32
        std::vector<T> dw(hidden, nan_of<T>());
        const dim3 grid = grid3(div_ceil(hidden, 256), 1, 1);
        bool ok = empty_grid(grid) ||
                  emu::launch(kname("rms_dw_sum", E<T>::name).c_str(), K<T>::rms_dw_sum, grid,
                              256u, (size_t)0, partial.data(), dw.data(), (i32)chunks, h);
        Check c{"dw (bit-exact f32 sum in chunk order)"};
        for (size_t col = 0; col < hidden; col++) {
            float a = 0.0f;
            for (size_t ch = 0; ch < chunks; ch++) a += partial[ch * hidden + col];
            c.add(col, W(dw[col]), W(E<T>::narrow(a)), 0.0);
        }
        report("rms_dw_sum " + tag, ok, {c});
    }
}

// The residual add and RMSNorm in one pass (add_rms_fwd): h must be narrow(x + r) with the sum
// in f32 (candle's add), bit for bit; out and inv must be bit for bit what rms_fwd gives for that
// h (the same sums in the same order), and within rms_fwd's tolerance of the reference.
template <class T>
static void add_rms_case(size_t rows, size_t hidden) {
    const std::string tag = std::string(E<T>::name) + " rows=" + std::to_string(rows) +
                            " hidden=" + std::to_string(hidden);
    const float eps = 1e-5f;
    auto x = rand_vec<T>(rows * hidden, -2, 2), r = rand_vec<T>(rows * hidden, -2, 2),
         w = rand_vec<T>(hidden, -1.5, 1.5);
    const i32 h = (i32)hidden;
    std::vector<T> hs(rows * hidden, nan_of<T>()), out(rows * hidden, nan_of<T>());
    std::vector<float> inv(rows, nan_of<float>());
    const dim3 grid = grid3(rows, 1, 1);
    // fused.rs: FusedKernels::add_rms_fwd
    bool ok = empty_grid(grid) ||
              emu::launch(kname("add_rms_fwd", E<T>::name).c_str(), K<T>::add_rms_fwd, grid,
                          row_threads(hidden), (size_t)0, x.data(), r.data(), w.data(),
                          hs.data(), out.data(), inv.data(), h, eps);
    // rms_fwd over the h add_rms_fwd wrote: the unfused pair's norm.
    std::vector<T> out2(rows * hidden, nan_of<T>());
    std::vector<float> inv2(rows, nan_of<float>());
    ok = ok && (empty_grid(grid) ||
                emu::launch(kname("rms_fwd", E<T>::name).c_str(), K<T>::rms_fwd, grid,
                            row_threads(hidden), (size_t)0, hs.data(), w.data(), out2.data(),
                            inv2.data(), h, eps));
    Check ch{"h (bit-exact: x + r in f32, rounded once)"}, cu{"out, inv = rms_fwd's (bit-exact)"},
        ci{"inv"}, co{"out"};
    for (size_t i = 0; i < rows * hidden; i++) {
        ch.add(i, W(hs[i]), W(E<T>::narrow((float)W(x[i]) + (float)W(r[i]))), 0.0);
        cu.add(i, W(out[i]), W(out2[i]), 0.0);
    }
    for (size_t row = 0; row < rows; row++) {
        cu.add(row, inv[row], inv2[row], 0.0);
        const double ri = ref_inv(hs, row, hidden, eps);
        ci.add(row, inv[row], ri, 1e-5 * ri);
        for (size_t e = 0; e < hidden; e++) {
            const double n = W(E<T>::narrow((float)W(hs[row * hidden + e]) * inv[row]));
            const double ref = n * W(w[e]);
            const double got = W(out[row * hidden + e]);
            co.add(row * hidden + e, got, ref, ulp<T>(std::max(std::fabs(ref), std::fabs(got))) + 1e-5 * std::fabs(ref));
        }
    }
    report("add_rms_fwd " + tag, ok, {ch, cu, ci, co});
}

// ---- RoPE -----------------------------------------------------------------------------------
// x: [b, s, h, d] at strides st (exact buffer), positions offset.., tables [(offset + s), d].
template <class T>
static void rope_case(size_t b, size_t s, size_t h, size_t d, const size_t st[4], size_t offset,
                      bool inverse, const char* layout, size_t grid_override = 0) {
    size_t reach = 1;  // fused.rs: reach()
    const size_t dims[4] = {b, s, h, d};
    for (int i = 0; i < 4; i++) reach += (dims[i] - 1) * st[i];
    auto x = rand_vec<T>(reach, -2, 2);
    std::vector<float> cs((offset + s) * d), sn((offset + s) * d);  // random: c1 != c2 is checked
    for (auto& v : cs) v = (float)uni(-1, 1);
    for (auto& v : sn) v = (float)uni(-1, 1);
    const size_t dense = b * s * h * d, pairs = dense / 2;
    std::vector<T> out(dense, nan_of<T>());
    dim3 grid = grid3(pairs == 0 ? 0 : stride_blocks(pairs), 1, 1);  // fused.rs: FusedKernels::rope
    if (grid_override) grid.x = (unsigned)grid_override;
    bool ok = empty_grid(grid) ||
              emu::launch(kname("rope", E<T>::name).c_str(), K<T>::rope, grid, 256u, (size_t)0,
                          x.data(), out.data(), cs.data(), sn.data(), (i32)s, (i32)h, (i32)d,
                          (i64)st[0], (i64)st[1], (i64)st[2], (i64)st[3], (i64)offset,
                          (i32)inverse, (i64)pairs);
    Check c{"out"};
    const size_t half = d / 2;
    for (size_t bi = 0; bi < b; bi++)
        for (size_t si = 0; si < s; si++)
            for (size_t hi = 0; hi < h; hi++)
                for (size_t e = 0; e < half; e++) {
                    const size_t base = bi * st[0] + si * st[1] + hi * st[2];
                    const double x1 = W(x[base + e * st[3]]), x2 = W(x[base + (e + half) * st[3]]);
                    const size_t p = (offset + si) * d;
                    const double c1 = cs[p + e], c2 = cs[p + e + half], s1 = sn[p + e], s2 = sn[p + e + half];
                    double o1, o2;
                    if (!inverse) o1 = x1 * c1 - x2 * s1, o2 = x2 * c2 + x1 * s2;
                    else o1 = x1 * c1 + x2 * s2, o2 = x2 * c2 - x1 * s1;
                    const double m = std::fabs(x1) + std::fabs(x2);
                    const size_t at = ((bi * s + si) * h + hi) * d;
                    c.add(at + e, W(out[at + e]), o1, ulp<T>(std::max(std::fabs(o1), std::fabs(W(out[at + e])))) + 1e-5 * m);
                    c.add(at + e + half, W(out[at + e + half]), o2,
                          ulp<T>(std::max(std::fabs(o2), std::fabs(W(out[at + e + half])))) + 1e-5 * m);
                }
    char tag[200];
    std::snprintf(tag, sizeof tag, "rope %s b=%zu s=%zu h=%zu d=%zu offset=%zu %s %s%s", E<T>::name, b,
                  s, h, d, offset, inverse ? "inverse" : "forward", layout,
                  grid_override ? " (grid-stride loop: fewer blocks than fused.rs)" : "");
    report(tag, ok, {c});
}

// ---- SwiGLU, gradient sums -----------------------------------------------------------------
template <class T>
static void swiglu_case(size_t n, size_t grid_override = 0) {
    auto g = rand_vec<T>(n, -8, 8), u = rand_vec<T>(n, -2, 2), dy = rand_vec<T>(n, -1, 1);
    std::vector<T> out(n, nan_of<T>()), dg(n, nan_of<T>()), du(n, nan_of<T>());
    dim3 grid = grid3(n == 0 ? 0 : stride_blocks(n), 1, 1);  // fused.rs: swiglu_fwd, swiglu_bwd
    if (grid_override) grid.x = (unsigned)grid_override;
    const std::string extra = grid_override ? " (grid-stride loop: fewer blocks than fused.rs)" : "";
    bool ok = empty_grid(grid) ||
              emu::launch(kname("swiglu_fwd", E<T>::name).c_str(), K<T>::swiglu_fwd, grid, 256u,
                          (size_t)0, g.data(), u.data(), out.data(), (i64)n);
    Check c{"out"};
    for (size_t i = 0; i < n; i++) {
        const double gv = W(g[i]), uv = W(u[i]), sig = 1 / (1 + std::exp(-gv));
        const double ref = gv * sig * uv;
        c.add(i, W(out[i]), ref, ulp<T>(std::max(std::fabs(ref), std::fabs(W(out[i])))) + 1e-5 * std::fabs(ref));
    }
    report(std::string("swiglu_fwd ") + E<T>::name + " n=" + std::to_string(n) + extra, ok, {c});
    ok = empty_grid(grid) ||
         emu::launch(kname("swiglu_bwd", E<T>::name).c_str(), K<T>::swiglu_bwd, grid, 256u,
                     (size_t)0, g.data(), u.data(), dy.data(), dg.data(), du.data(), (i64)n);
    Check cg{"dg"}, cu{"du"};
    for (size_t i = 0; i < n; i++) {
        const double gv = W(g[i]), uv = W(u[i]), d = W(dy[i]), sig = 1 / (1 + std::exp(-gv));
        const double rg = d * uv * sig * (1 + gv * (1 - sig)), ru = d * gv * sig;
        const double mg = std::fabs(d * uv * sig) * (1 + std::fabs(gv) * (1 - sig) * 2);
        cg.add(i, W(dg[i]), rg, ulp<T>(std::max(std::fabs(rg), std::fabs(W(dg[i])))) + 1e-5 * mg);
        cu.add(i, W(du[i]), ru, ulp<T>(std::max(std::fabs(ru), std::fabs(W(du[i])))) + 1e-5 * std::fabs(ru));
    }
    report(std::string("swiglu_bwd ") + E<T>::name + " n=" + std::to_string(n) + extra, ok, {cg, cu});
}

// SwiGLU over the joint gate/up output y [rows, 2 inner] read in place (swiglu_joined_*): out
// must be swiglu_fwd's of the halves bit for bit, and the joint's gradient [rows, 2 inner]
// swiglu_bwd's dg and du side by side, bit for bit (one formula, one rounding).
template <class T>
static void swiglu_joined_case(size_t rows, size_t inner, size_t gx = 0, size_t gy = 0) {
    const size_t n = rows * inner;
    auto y = rand_vec<T>(2 * n, -8, 8), dy = rand_vec<T>(n, -1, 1);
    std::vector<T> g(n), u(n);
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < inner; c++) {
            g[r * inner + c] = y[r * 2 * inner + c];
            u[r * inner + c] = y[r * 2 * inner + inner + c];
        }
    std::vector<T> out(n, nan_of<T>()), want(n, nan_of<T>()), dyj(2 * n, nan_of<T>());
    std::vector<T> dg(n, nan_of<T>()), du(n, nan_of<T>());
    // fused.rs: joined_grid (columns along x, rows along y).
    dim3 grid = grid3(n == 0 ? 0 : std::min<size_t>(div_ceil(inner, 256), 1 << 16),
                      n == 0 ? 0 : std::min<size_t>(rows, 65535), 1);
    if (gx) grid.x = (unsigned)gx;
    if (gy) grid.y = (unsigned)gy;
    const std::string extra = gx || gy ? " (grid-stride loops: fewer blocks than fused.rs)" : "";
    const dim3 flat = grid3(n == 0 ? 0 : stride_blocks(n), 1, 1);
    bool ok = empty_grid(grid) ||
              (emu::launch(kname("swiglu_joined_fwd", E<T>::name).c_str(), K<T>::swiglu_joined_fwd,
                           grid, 256u, (size_t)0, y.data(), out.data(), (i64)rows, (i64)inner) &&
               emu::launch(kname("swiglu_fwd", E<T>::name).c_str(), K<T>::swiglu_fwd, flat, 256u,
                           (size_t)0, g.data(), u.data(), want.data(), (i64)n));
    Check c{"out"};
    for (size_t i = 0; i < n; i++) c.add(i, W(out[i]), W(want[i]), 0);
    const std::string shape = " rows=" + std::to_string(rows) + " inner=" + std::to_string(inner);
    report(std::string("swiglu_joined_fwd ") + E<T>::name + shape + extra, ok, {c});
    ok = empty_grid(grid) ||
         (emu::launch(kname("swiglu_joined_bwd", E<T>::name).c_str(), K<T>::swiglu_joined_bwd, grid,
                      256u, (size_t)0, y.data(), dy.data(), dyj.data(), (i64)rows, (i64)inner) &&
          emu::launch(kname("swiglu_bwd", E<T>::name).c_str(), K<T>::swiglu_bwd, flat, 256u,
                      (size_t)0, g.data(), u.data(), dy.data(), dg.data(), du.data(), (i64)n));
    Check cg{"dgate"}, cu{"dup"};
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < inner; c++) {
            const size_t i = r * inner + c;
            cg.add(i, W(dyj[r * 2 * inner + c]), W(dg[i]), 0);
            cu.add(i, W(dyj[r * 2 * inner + inner + c]), W(du[i]), 0);
        }
    report(std::string("swiglu_joined_bwd ") + E<T>::name + shape + extra, ok, {cg, cu});
}

template <class T>
static void grad_acc_case(size_t n, size_t grid_override = 0) {
    auto g = rand_vec<T>(n, -3, 3);
    std::vector<float> acc(n);
    for (auto& a : acc) a = (float)uni(-100, 100);
    const std::vector<float> acc0 = acc;
    dim3 grid = grid3(n == 0 ? 0 : stride_blocks(n), 1, 1);  // fused.rs: FusedKernels::grad_acc
    if (grid_override) grid.x = (unsigned)grid_override;
    bool ok = empty_grid(grid) ||
              emu::launch(kname("grad_acc", E<T>::name).c_str(), K<T>::grad_acc, grid, 256u,
                          (size_t)0, acc.data(), g.data(), (i64)n);
    Check c{"acc (bit-exact f32)"};
    for (size_t i = 0; i < n; i++) c.add(i, acc[i], acc0[i] + E<T>::widen(g[i]), 0.0);
    report(std::string("grad_acc ") + E<T>::name + " n=" + std::to_string(n) +
               (grid_override ? " (grid-stride loop: fewer blocks than fused.rs)" : ""),
           ok, {c});
}

// acc[ids[i]] += rows[i] in id order, an id past the table left out (accumulate.rs; fused.rs:
// FusedKernels::grad_index_add).
template <class T>
static void grad_index_add_case(size_t vocab, size_t hidden, std::vector<unsigned> ids) {
    const size_t n = ids.size();
    auto rows = rand_vec<T>(n * hidden, -3, 3);
    std::vector<float> acc(vocab * hidden);
    for (auto& a : acc) a = (float)uni(-10, 10);
    std::vector<float> ref = acc;
    const dim3 grid = grid3(n == 0 || hidden == 0 ? 0 : div_ceil(hidden, 128), 1, 1);
    bool ok = empty_grid(grid) ||
              emu::launch(kname("grad_index_add", E<T>::name).c_str(), K<T>::grad_index_add, grid,
                          128u, (size_t)0, acc.data(), ids.data(), rows.data(), (i64)n,
                          (i32)hidden, (i64)vocab);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < vocab)
            for (size_t c = 0; c < hidden; c++) ref[ids[i] * hidden + c] += E<T>::widen(rows[i * hidden + c]);
    Check c{"acc (bit-exact f32, in id order)"};
    for (size_t i = 0; i < acc.size(); i++) c.add(i, acc[i], ref[i], 0.0);
    std::string idl;
    for (auto i : ids) idl += (idl.empty() ? "" : ",") + std::to_string(i);
    report(std::string("grad_index_add ") + E<T>::name + " vocab=" + std::to_string(vocab) +
               " hidden=" + std::to_string(hidden) + " ids=" + idl,
           ok, {c});
}

// cuda_cpu.h's f16 converters (the PTX cvt stand-ins) against an independent decoding: every
// f16 widens exactly, and f32 values (random, every f16's neighbours and every halfway point)
// narrow to the nearest f16, ties to even.
static void f16_conversions() {
    Check cw{"widen"}, cn{"narrow"};
    std::vector<float> xs;
    for (unsigned h = 0; h < 0x10000; h++) {
        const double v = f16_value((unsigned short)h);
        cw.add(h, emu_f16_to_f32((unsigned short)h), v, 0.0);
        if (std::isfinite(v) && h < 0x7c00) {
            const double next = f16_value((unsigned short)(h + 1));
            const float mid = (float)((v + (std::isfinite(next) ? next : 65536.0)) / 2);
            xs.push_back((float)v), xs.push_back(mid), xs.push_back(-mid);
            xs.push_back(std::nextafter(mid, 0.0f)), xs.push_back(std::nextafter(mid, 1e9f));
        }
    }
    for (int i = 0; i < 100000; i++) xs.push_back((float)std::ldexp(uni(-1, 1), (int)uni(-30, 18)));
    for (size_t i = 0; i < xs.size(); i++) {
        const float x = xs[i];
        const unsigned short h = emu_f32_to_f16_rn(x);
        // the nearest f16 by search over the neighbours of h, ties to the even mantissa
        double best = INFINITY;
        unsigned short bh = 0;
        for (int dlt = -2; dlt <= 2; dlt++) {
            const int c = (h & 0x7fff) + dlt;
            if (c < 0 || c > 0x7c00) continue;
            const unsigned short ch = (unsigned short)((h & 0x8000) | c);
            double v = f16_value(ch);
            if (std::isinf(v)) v = std::copysign(65536.0, v);  // past the largest: rounds to inf
            const double err = std::fabs(v - (double)x);
            if (err < best || (err == best && (ch & 1) == 0)) best = err, bh = ch;
        }
        cn.add(i, h, bh, 0.0);
    }
    report("f16 conversions (cuda_cpu.h's stand-ins for cvt.f32.f16 / cvt.rn.f16.f32)", true, {cw, cn});
}

// fused.cu's narrow<bf16_t> (the rounding of every bf16 output) against half's bf16::from_f32,
// which the CPU code of src/candle/fused/ uses: round to nearest even, and a NaN stays a NaN,
// among them 0x7fffffff, the NaN a GPU's arithmetic produces.
static void bf16_narrowing() {
    Check c{"bits"};
    std::vector<unsigned> xs = {0x7fffffffu, 0xffffffffu, 0x7fc00000u, 0xffc00000u, 0x7f800001u,
                                0x7fff8000u, 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x00000001u};
    for (int i = 0; i < 200000; i++) {
        const unsigned hi = (unsigned)(uni(0, 1) * 65536) & 0xffffu;
        const unsigned lo[] = {0x8000u, 0x7fffu, 0x8001u, (unsigned)(uni(0, 1) * 65536) & 0xffffu};
        xs.push_back(hi << 16 | lo[i % 4]);
    }
    for (size_t i = 0; i < xs.size(); i++) {
        float x;
        std::memcpy(&x, &xs[i], 4);
        const unsigned short got = emu_bf16::narrow<emu_bf16::bf16_t>(x).bits;
        double want;
        if (std::isnan(x)) want = NAN;  // any NaN
        else {
            // nearest of the two bf16 neighbours, ties to the even one (as half's from_f32)
            const unsigned short a = (unsigned short)(xs[i] >> 16);
            // (past the largest finite bf16 the upper neighbour is infinity, at 2^128 for ties)
            const double va = host_bf16_to_f32(a);
            double vb = host_bf16_to_f32((unsigned short)(a + 1));
            if (std::isinf(vb)) vb = std::copysign(std::ldexp(1.0, 128), vb);
            const double ea = std::fabs((double)x - va), eb = std::fabs(vb - (double)x);
            const bool up = !std::isinf(x) && (eb < ea || (eb == ea && (a & 1)));
            want = host_bf16_to_f32(up ? (unsigned short)(a + 1) : a);
        }
        c.add(i, host_bf16_to_f32(got), want, 0.0);
    }
    report("bf16 narrowing (fused.cu narrow<bf16_t>, NaNs included) vs half's bf16::from_f32", true, {c});
}

// Block-quantized bytes to T (fused.rs: FusedKernels::dequantize): every value the `gguf`
// package's dequantization of the same blocks, rounded once to T, bit for bit.
template <class T>
static void dequant_case(const QuantRef& r, size_t grid_override = 0) {
    std::vector<T> out(r.n, nan_of<T>());
    dim3 grid = grid3(r.n == 0 ? 0 : stride_blocks(r.n), 1, 1);
    if (grid_override) grid.x = (unsigned)grid_override;
    const bool ok = emu::launch(kname("dequant", E<T>::name).c_str(), K<T>::dequant, grid, 256u,
                                (size_t)0, r.bytes, out.data(), (i64)r.n, (i32)r.type,
                                (i32)r.belems, (i32)r.bsize);
    Check c{"values (bit-exact)"};
    for (size_t i = 0; i < r.n; i++) {
        float want;
        std::memcpy(&want, &r.ref[i], 4);
        c.add(i, E<T>::widen(out[i]), E<T>::widen(E<T>::narrow(want)), 0.0);
    }
    report(std::string("dequant ") + r.name + " " + E<T>::name + " n=" + std::to_string(r.n) +
               (grid_override ? " (grid-stride loop: fewer blocks than fused.rs)" : ""),
           ok, {c});
}

// Q8_K, which the gguf package cannot dequantize: one block of scale 0.25 (an f32) and quants
// -100 .. 155 wrapped to i8, against scale x quant.
template <class T>
static void dequant_q8_k_case() {
    std::vector<unsigned char> b(292, 0);
    const float d = 0.25f;
    std::memcpy(b.data(), &d, 4);
    std::vector<unsigned int> ref(256);
    for (int i = 0; i < 256; i++) {
        b[4 + i] = (unsigned char)(signed char)(i - 100);
        const float v = d * (float)(signed char)(i - 100);
        std::memcpy(&ref[i], &v, 4);
    }
    dequant_case<T>(QuantRef{"Q8_K", 10, 256, 292, b.data(), 292, ref.data(), 256});
}

template <class T>
static void all_for_type() {
    // attention: every width, sq and skv not multiples of BQ / BK, sq != skv, windows, GQA
    // (nkv = 2, 1 and nh), d below and at the compiled width, three layouts, batch > 1.
    const Geo geos[] = {
        {2, 21, 37, 4, 2, 40, 0, DENSE},         // d64 kernel, d < width, GQA 2, b 2
        {1, 37, 37, 2, 1, 64, 0, FUSED_QKV},     // d = 64, q/k/v slices of one qkv buffer, MQA
        {2, 1, 45, 4, 2, 64, 16, HEADS_MAJOR},   // decode: one query, window, [b, h, s, d]
        {1, 19, 50, 4, 1, 96, 13, HEADS_MAJOR},  // d128 kernel, d < width, window, MQA
        {1, 17, 33, 2, 2, 128, 5, DENSE},        // d = 128, no GQA, small window
        {1, 9, 40, 2, 1, 200, 0, FUSED_QKV},     // d256 kernel, d < width (sq != skv: no fused)
        {1, 18, 18, 2, 1, 256, 0, FUSED_QKV},    // d = 256
    };
    for (Geo g : geos) {
        if (g.layout == FUSED_QKV && g.sq != g.skv) g.layout = DENSE;
        attention_case<T>(g);
    }
    rms_case<T>(5, 100);   // hidden not a multiple of 32: 128 threads
    rms_case<T>(3, 1100);  // past 1024: 1024 threads, each several columns
    rms_case<T>(130, 300, false);  // dw: chunks of 64, 64 and 2 rows, 2 column blocks
    add_rms_case<T>(5, 100);   // hidden not a multiple of 32: 128 threads
    add_rms_case<T>(3, 1100);  // past 1024: 1024 threads, each several columns
    {
        const size_t dense[4] = {3 * 4 * 8, 4 * 8, 8, 1};
        rope_case<T>(2, 3, 4, 8, dense, 0, false, "dense");
        const size_t qkv[4] = {5 * 6 * 64, 6 * 64, 64, 1};  // heads 0..3 of a [b, s, 6, 64] buffer
        rope_case<T>(2, 5, 4, 64, qkv, 3, false, "slice of a qkv buffer");
        rope_case<T>(2, 5, 4, 64, qkv, 3, true, "slice of a qkv buffer");
        const size_t tr[4] = {3 * 7 * 2 * 16, 2 * 16, 7 * 2 * 16, 2};  // [b, h, s, d] with d stride 2
        rope_case<T>(2, 7, 3, 16, tr, 1, true, "heads-major, head stride 2");
        rope_case<T>(2, 7, 3, 16, tr, 1, false, "heads-major, head stride 2", 1);
    }
    swiglu_case<T>(1000);
    swiglu_case<T>(1000, 2);
    swiglu_joined_case<T>(7, 300);
    swiglu_joined_case<T>(7, 300, 1, 2);  // both loops stride
    swiglu_joined_case<T>(1, 5);
    swiglu_joined_case<T>(0, 64);
    grad_acc_case<T>(1000);
    grad_acc_case<T>(777, 1);
    grad_index_add_case<T>(5, 200, {1, 0, 4, 1, 5, 3, 1, 9});  // 5 and 9: past the table
    for (const QuantRef& r : QUANT_REFS) dequant_case<T>(r);
    dequant_case<T>(QUANT_REFS[7], 1);  // Q4_K, one block of threads for every element
    dequant_q8_k_case<T>();
}

int main(int argc, char** argv) {
    const std::string only = argc > 1 ? argv[1] : "";
    if (only.empty() || only == "f16") f16_conversions();
    if (only.empty() || only == "bf16") bf16_narrowing();
    if (only.empty() || only == "f32") all_for_type<float>();
    if (only.empty() || only == "bf16") all_for_type<bf16>();
    if (only.empty() || only == "f16") all_for_type<f16>();
    std::printf("%d cases, %d failed\n", cases, failures);
    return failures ? 1 : 0;
}
