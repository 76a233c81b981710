// strata's shim over cuDNN 9's fused SDPA (strata_attn.h): the checks that need no GPU, then a
// cuDNN graph per shape (cudnn_frontend's graph API, header-only), built once and cached, run on
// the caller's stream with the caller's workspace. Built by benches/gpu/build-attention:
//     g++ -O2 -std=c++17 -fPIC -shared strata_attn.cpp -l:libcudnn.so.9 -l:libcudart.so.13
// No exception crosses the C interface: each entry point catches and returns a status.
// Only the interface is exported (the library is built with -fvisibility=hidden).
#pragma GCC visibility push(default)
#include "strata_attn.h"
#pragma GCC visibility pop

#include <dlfcn.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <cudnn_frontend.h>

namespace fe = cudnn_frontend;

namespace {

thread_local std::string last_error;

strata_attn_status fail(strata_attn_status s, const std::string &message) {
    last_error = message;
    return s;
}

// ---- the checks that need no GPU -----------------------------------------------------------

const char *const NAMES[STRATA_ATTN_TENSORS] = {"q", "k", "v", "o", "dout", "dq", "dk", "dv"};

// The [batch, head, seq, head_dim] sizes of tensor `t`.
void sizes(const strata_attn_desc &d, int t, int64_t out[4]) {
    bool kv = t == STRATA_ATTN_K || t == STRATA_ATTN_V || t == STRATA_ATTN_DK || t == STRATA_ATTN_DV;
    out[0] = d.batch;
    out[1] = kv ? d.kv_heads : d.heads;
    out[2] = kv ? d.kv_len : d.q_len;
    out[3] = d.head_dim;
}

// The elements tensor `t` spans from its first (largest offset + 1), or -1 past int64.
int64_t reach(const strata_attn_desc &d, int t) {
    int64_t n[4];
    sizes(d, t, n);
    int64_t r = 1;
    for (int i = 0; i < 4; i++) {
        int64_t step;
        if (__builtin_mul_overflow(n[i] - 1, d.strides[t][i], &step) ||
            __builtin_add_overflow(r, step, &r)) {
            return -1;
        }
    }
    return r;
}

// Whether no two elements of tensor `t` share an address: its dimensions of more than one
// element, by increasing stride, each step past everything the smaller ones span.
bool disjoint(const strata_attn_desc &d, int t) {
    int64_t n[4];
    sizes(d, t, n);
    int order[4] = {0, 1, 2, 3};
    for (int i = 1; i < 4; i++) {
        for (int j = i; j > 0 && d.strides[t][order[j]] < d.strides[t][order[j - 1]]; j--) {
            std::swap(order[j], order[j - 1]);
        }
    }
    int64_t span = 1;  // elements the dimensions so far reach
    for (int i : order) {
        if (n[i] <= 1) continue;
        if (d.strides[t][i] < span) return false;
        int64_t step;
        if (__builtin_mul_overflow(n[i] - 1, d.strides[t][i], &step) ||
            __builtin_add_overflow(span, step, &span)) {
            return false;
        }
    }
    return true;
}

std::string fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char *f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

// The tensors a direction names: the forward's q, k, v, o; the backward's eight.
int tensor_count(int backward) { return backward ? STRATA_ATTN_TENSORS : STRATA_ATTN_DOUT; }

bool is_output(int t, int backward) {
    return backward ? t >= STRATA_ATTN_DQ : t == STRATA_ATTN_O;
}

strata_attn_status check_desc(const strata_attn_desc *desc, int backward) {
    if (desc == nullptr) return fail(STRATA_ATTN_INVALID_ARGUMENT, "desc is null");
    const strata_attn_desc &d = *desc;
    if (d.struct_size != sizeof(strata_attn_desc)) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT,
                    fmt("desc.struct_size is %u, this library's strata_attn_desc is %zu bytes "
                        "(built against another strata_attn.h)",
                        d.struct_size, sizeof(strata_attn_desc)));
    }
    if (backward != 0 && backward != 1) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT, fmt("backward is %d: 0 or 1", backward));
    }
    if (d.dtype != STRATA_ATTN_BF16 && d.dtype != STRATA_ATTN_F16) {
        return fail(STRATA_ATTN_UNSUPPORTED,
                    fmt("dtype %d: cuDNN's fused SDPA takes bf16 (%d) or f16 (%d)", d.dtype,
                        STRATA_ATTN_BF16, STRATA_ATTN_F16));
    }
    const struct {
        const char *name;
        int64_t v;
    } dims[] = {{"batch", d.batch},   {"heads", d.heads},   {"kv_heads", d.kv_heads},
                {"q_len", d.q_len},   {"kv_len", d.kv_len}, {"head_dim", d.head_dim}};
    for (auto &x : dims) {
        if (x.v < 1 || x.v > INT32_MAX) {
            return fail(STRATA_ATTN_INVALID_ARGUMENT,
                        fmt("%s is %lld: from 1 to 2^31 - 1", x.name, (long long)x.v));
        }
    }
    if (d.heads % d.kv_heads != 0) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT,
                    fmt("%lld query heads are not a multiple of %lld key/value heads",
                        (long long)d.heads, (long long)d.kv_heads));
    }
    if (d.head_dim % 8 != 0 || d.head_dim > 256) {
        return fail(STRATA_ATTN_UNSUPPORTED,
                    fmt("head_dim %lld: cuDNN's fused SDPA takes multiples of 8 up to 256 (64 and "
                        "128 on every GPU it runs on)",
                        (long long)d.head_dim));
    }
    if (!std::isfinite(d.scale) || d.scale <= 0.0f) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT,
                    fmt("scale %g: a finite number above 0", (double)d.scale));
    }
    if (d.causal != 0 && d.causal != 1) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT, fmt("causal is %d: 0 or 1", d.causal));
    }
    if (d.causal && d.q_len > d.kv_len) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT,
                    fmt("%lld queries over %lld keys with a causal mask: the queries are the "
                        "last positions of the keys, so there are at least as many keys",
                        (long long)d.q_len, (long long)d.kv_len));
    }
    if (d.window < 0) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT,
                    fmt("window %lld: 0 (none) or the positions a query sees", (long long)d.window));
    }
    if (d.window > 0 && !d.causal) {
        return fail(STRATA_ATTN_UNSUPPORTED,
                    "a sliding window without the causal mask: cuDNN's SDPA bounds the window "
                    "on the causal diagonal only");
    }
    if (backward && d.q_len == 1 && d.kv_len == 1) {
        return fail(STRATA_ATTN_UNSUPPORTED,
                    "cuDNN's SDPA backward does not take one query over one key");
    }
    for (int t = 0; t < tensor_count(backward); t++) {
        const int64_t *s = d.strides[t];
        int64_t n[4];
        sizes(d, t, n);
        for (int i = 0; i < 4; i++) {
            if (s[i] < 0) {
                return fail(STRATA_ATTN_INVALID_ARGUMENT,
                            fmt("%s's stride %d is %lld: strides are not negative", NAMES[t], i,
                                (long long)s[i]));
            }
        }
        if (s[3] != 1) {
            return fail(STRATA_ATTN_UNSUPPORTED,
                        fmt("%s's head dimension has stride %lld: cuDNN's SDPA reads whole head "
                            "rows (stride 1)",
                            NAMES[t], (long long)s[3]));
        }
        for (int i = 0; i < 3; i++) {
            if (n[i] > 1 && s[i] % 8 != 0) {
                return fail(STRATA_ATTN_UNSUPPORTED,
                            fmt("%s's stride %d is %lld elements: cuDNN's SDPA loads rows of 16 "
                                "bytes, so strides are multiples of 8 elements",
                                NAMES[t], i, (long long)s[i]));
            }
        }
        if (reach(d, t) < 0) {
            return fail(STRATA_ATTN_INVALID_ARGUMENT,
                        fmt("%s's sizes and strides reach past 2^63 elements", NAMES[t]));
        }
        if (is_output(t, backward) && !disjoint(d, t)) {
            return fail(STRATA_ATTN_INVALID_ARGUMENT,
                        fmt("%s's strides make two of its elements share an address: an output "
                            "is written once per element",
                            NAMES[t]));
        }
    }
    return STRATA_ATTN_OK;
}

// The pointers a call passes, named: null ones refused, and each 16-byte aligned (cuDNN's
// tensor-memory loads).
strata_attn_status check_pointers(const void *const *ptrs, const char *const *names, int n) {
    for (int i = 0; i < n; i++) {
        if (ptrs[i] == nullptr) {
            return fail(STRATA_ATTN_INVALID_ARGUMENT, fmt("%s is a null pointer", names[i]));
        }
        if (reinterpret_cast<uintptr_t>(ptrs[i]) % 16 != 0) {
            return fail(STRATA_ATTN_UNSUPPORTED,
                        fmt("%s is not 16-byte aligned: cuDNN's SDPA loads 16 bytes at a time",
                            names[i]));
        }
    }
    return STRATA_ATTN_OK;
}

strata_attn_status check_lse(const strata_attn_desc &d, size_t lse_len) {
    // batch · heads · q_len fits: each is below 2^31 and q's reach was checked.
    uint64_t want = (uint64_t)d.batch * (uint64_t)d.heads * (uint64_t)d.q_len;
    if (lse_len != want) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT,
                    fmt("lse holds %zu elements: the log-sum-exp is f32 [batch, heads, q_len, 1], "
                        "%llu elements",
                        lse_len, (unsigned long long)want));
    }
    return STRATA_ATTN_OK;
}

strata_attn_status check_workspace(const void *workspace, size_t bytes) {
    if (bytes > 0 && workspace == nullptr) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT,
                    fmt("workspace is a null pointer with %zu bytes", bytes));
    }
    return STRATA_ATTN_OK;
}

// ---- cuDNN: handles and graphs -------------------------------------------------------------

enum : int64_t { Q_UID = 1, K_UID, V_UID, O_UID, STATS_UID, DO_UID, DQ_UID, DK_UID, DV_UID };

struct Plan {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
};

std::mutex mu;  // guards the maps below and every use of a handle
std::map<int, cudnnHandle_t> handles;
std::map<std::vector<int64_t>, Plan> plans;

strata_attn_status cuda_failed(const char *call, cudaError_t e) {
    return fail(STRATA_ATTN_CUDA_ERROR,
                fmt("%s: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e)));
}

strata_attn_status cudnn_failed(const char *call, cudnnStatus_t s) {
    char detail[256] = "";
    cudnnGetLastErrorString(detail, sizeof detail);
    return fail(STRATA_ATTN_CUDNN_ERROR,
                fmt("%s: %s%s%s", call, cudnnGetErrorString(s), detail[0] ? ": " : "", detail));
}

strata_attn_status frontend_failed(const char *step, fe::error_t e) {
    strata_attn_status s = e.get_code() == fe::error_code_t::GRAPH_NOT_SUPPORTED
                               ? STRATA_ATTN_UNSUPPORTED
                               : STRATA_ATTN_CUDNN_ERROR;
    return fail(s, fmt("cuDNN's SDPA graph, %s: %s", step, e.get_message().c_str()));
}

// Whether cuDNN's parts load; else why not. libcudnn.so.9 dispatches each call to its parts
// (libcudnn_graph.so.9 first), found beside it ($ORIGIN) or on the library path, and aborts the
// process when one is missing: this looks first, the same two ways, so that a partial install
// is a status.
const std::string &cudnn_missing() {
    static const std::string why = [] {
        std::string name = "libcudnn_graph.so." + std::to_string(CUDNN_MAJOR);
        Dl_info info;
        if (dladdr(reinterpret_cast<void *>(&cudnnGetVersion), &info) != 0 && info.dli_fname) {
            std::string beside = info.dli_fname;
            beside = beside.substr(0, beside.rfind('/') + 1) + name;
            if (dlopen(beside.c_str(), RTLD_LAZY | RTLD_LOCAL) != nullptr) return std::string();
        }
        if (dlopen(name.c_str(), RTLD_LAZY | RTLD_LOCAL) != nullptr) return std::string();
        const char *e = dlerror();
        return name + " (cuDNN's graph part, which libcudnn.so." + std::to_string(CUDNN_MAJOR) +
               " loads) is neither beside it nor on the library path: " + (e ? e : "not found") +
               ". Install the whole of cuDNN 9 (PyTorch's nvidia-cudnn-cu13 wheel has it) and "
               "put its lib folder on LD_LIBRARY_PATH";
    }();
    return why;
}

// The current device and its cuDNN handle (created on first use; under `mu`).
strata_attn_status handle_for_current(int *device, cudnnHandle_t *h) {
    cudaError_t e = cudaGetDevice(device);
    if (e != cudaSuccess) return cuda_failed("cudaGetDevice", e);
    auto it = handles.find(*device);
    if (it != handles.end()) {
        *h = it->second;
        return STRATA_ATTN_OK;
    }
    if (!cudnn_missing().empty()) return fail(STRATA_ATTN_CUDNN_ERROR, cudnn_missing());
    cudnnStatus_t s = cudnnCreate(h);
    if (s != CUDNN_STATUS_SUCCESS) return cudnn_failed("cudnnCreate", s);
    handles[*device] = *h;
    return STRATA_ATTN_OK;
}

std::vector<int64_t> key(const strata_attn_desc &d, int backward, int device) {
    std::vector<int64_t> k = {backward,   device,   d.dtype,  d.batch,    d.heads,
                              d.kv_heads, d.q_len,  d.kv_len, d.head_dim, d.causal,
                              d.window};
    uint32_t scale_bits;
    std::memcpy(&scale_bits, &d.scale, sizeof scale_bits);
    k.push_back(scale_bits);
    for (int t = 0; t < tensor_count(backward); t++) {
        k.insert(k.end(), d.strides[t], d.strides[t] + 4);
    }
    return k;
}

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph &g,
                                                     const strata_attn_desc &d, int t,
                                                     int64_t uid) {
    int64_t n[4];
    sizes(d, t, n);
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(NAMES[t])
                        .set_uid(uid)
                        .set_dim({n[0], n[1], n[2], n[3]})
                        .set_stride({d.strides[t][0], d.strides[t][1], d.strides[t][2],
                                     d.strides[t][3]}));
}

// The masks of `d` on SDPA's forward or backward attributes (the same setters on both).
template <typename Attributes>
void masks(Attributes &a, const strata_attn_desc &d) {
    if (d.causal) {
        // Top-left and bottom-right are one diagonal when q_len == kv_len; top-left is the
        // older, more widely supported one.
        a.set_diagonal_alignment(d.q_len == d.kv_len ? fe::DiagonalAlignment_t::TOP_LEFT
                                                     : fe::DiagonalAlignment_t::BOTTOM_RIGHT);
        a.set_diagonal_band_right_bound(0);
    }
    // A window as wide as the keys hides nothing.
    if (d.window > 0 && d.window < d.kv_len) {
        a.set_diagonal_band_left_bound(static_cast<int>(d.window));
    }
}

std::shared_ptr<fe::graph::Graph> new_graph(const strata_attn_desc &d) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(d.dtype == STRATA_ATTN_BF16 ? fe::DataType_t::BFLOAT16
                                                    : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return g;
}

std::shared_ptr<fe::graph::Tensor_attributes> stats_tensor(fe::graph::Graph &g,
                                                           const strata_attn_desc &d) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name("lse")
                        .set_uid(STATS_UID)
                        .set_dim({d.batch, d.heads, d.q_len, 1})
                        .set_stride({d.heads * d.q_len, d.q_len, 1, 1})
                        .set_data_type(fe::DataType_t::FLOAT));
}

std::shared_ptr<fe::graph::Graph> forward_graph(const strata_attn_desc &d) {
    auto g = new_graph(d);
    auto q = tensor(*g, d, STRATA_ATTN_Q, Q_UID);
    auto k = tensor(*g, d, STRATA_ATTN_K, K_UID);
    auto v = tensor(*g, d, STRATA_ATTN_V, V_UID);
    auto a = fe::graph::SDPA_attributes()
                 .set_name("strata_sdpa")
                 .set_generate_stats(true)
                 .set_attn_scale(d.scale);
    masks(a, d);
    auto [o, stats] = g->sdpa(q, k, v, a);
    int64_t n[4];
    sizes(d, STRATA_ATTN_O, n);
    const int64_t *s = d.strides[STRATA_ATTN_O];
    o->set_output(true).set_uid(O_UID).set_dim({n[0], n[1], n[2], n[3]}).set_stride(
        {s[0], s[1], s[2], s[3]});
    stats->set_output(true)
        .set_uid(STATS_UID)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({d.batch, d.heads, d.q_len, 1})
        .set_stride({d.heads * d.q_len, d.q_len, 1, 1});
    return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const strata_attn_desc &d) {
    auto g = new_graph(d);
    auto q = tensor(*g, d, STRATA_ATTN_Q, Q_UID);
    auto k = tensor(*g, d, STRATA_ATTN_K, K_UID);
    auto v = tensor(*g, d, STRATA_ATTN_V, V_UID);
    auto o = tensor(*g, d, STRATA_ATTN_O, O_UID);
    auto dout = tensor(*g, d, STRATA_ATTN_DOUT, DO_UID);
    auto stats = stats_tensor(*g, d);
    // The deterministic algorithm: dQ summed in a fixed order, so the same inputs give the
    // same bits run after run, as strata's own kernel does (out of core and its in-memory twin,
    // and a resumed run, stay equal bit for bit). On Hopper it takes the dP workspace, which
    // cuDNN 9 does not otherwise: batch × heads × queries × keys (each rounded up to 64) of 2
    // bytes, 256 MiB for a 7B's 32 heads at seq 2048, 1 GiB at 4096 (the workspace size this
    // library reports, and strata's training plan counts). A GPU or cuDNN without a
    // deterministic engine for a shape refuses its graph: strata's kernel then runs it.
    auto a = fe::graph::SDPA_backward_attributes()
                 .set_name("strata_sdpa_backward")
                 .set_attn_scale(d.scale)
                 .set_deterministic_algorithm(true);
    masks(a, d);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, a);
    const struct {
        std::shared_ptr<fe::graph::Tensor_attributes> &t;
        int which;
        int64_t uid;
    } outs[] = {{dq, STRATA_ATTN_DQ, DQ_UID}, {dk, STRATA_ATTN_DK, DK_UID}, {dv, STRATA_ATTN_DV, DV_UID}};
    for (auto &x : outs) {
        int64_t n[4];
        sizes(d, x.which, n);
        const int64_t *s = d.strides[x.which];
        x.t->set_output(true).set_uid(x.uid).set_dim({n[0], n[1], n[2], n[3]}).set_stride(
            {s[0], s[1], s[2], s[3]});
    }
    return g;
}

// The plan of `d` on the current device, built on first use (under `mu`).
strata_attn_status plan_for(const strata_attn_desc &d, int backward, cudnnHandle_t *h,
                            const Plan **out) {
    int device = 0;
    strata_attn_status st = handle_for_current(&device, h);
    if (st != STRATA_ATTN_OK) return st;
    auto k = key(d, backward, device);
    auto it = plans.find(k);
    if (it != plans.end()) {
        *out = &it->second;
        return STRATA_ATTN_OK;
    }
    Plan p;
    p.graph = backward ? backward_graph(d) : forward_graph(d);
    fe::graph::Graph &g = *p.graph;
    fe::error_t e = g.validate();
    if (e.is_bad()) return frontend_failed("validate", e);
    e = g.build_operation_graph(*h);
    if (e.is_bad()) return frontend_failed("build_operation_graph", e);
    e = g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (e.is_bad()) return frontend_failed("create_execution_plans", e);
    e = g.check_support();
    if (e.is_bad()) return frontend_failed("check_support", e);
    e = g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
    if (e.is_bad()) return frontend_failed("build_plans", e);
    e = g.get_workspace_size(p.workspace);
    if (e.is_bad()) return frontend_failed("get_workspace_size", e);
    auto placed = plans.emplace(std::move(k), std::move(p));
    *out = &placed.first->second;
    return STRATA_ATTN_OK;
}

strata_attn_status run(const strata_attn_desc &d, int backward,
                       std::unordered_map<int64_t, void *> &pack, void *workspace,
                       size_t workspace_bytes, void *stream) {
    std::lock_guard<std::mutex> lock(mu);
    cudnnHandle_t h;
    const Plan *p;
    strata_attn_status st = plan_for(d, backward, &h, &p);
    if (st != STRATA_ATTN_OK) return st;
    if (workspace_bytes < static_cast<size_t>(p->workspace)) {
        return fail(STRATA_ATTN_INVALID_ARGUMENT,
                    fmt("a workspace of %zu bytes: this %s needs %lld "
                        "(strata_attn_workspace_size)",
                        workspace_bytes, backward ? "backward" : "forward",
                        (long long)p->workspace));
    }
    cudnnStatus_t s = cudnnSetStream(h, static_cast<cudaStream_t>(stream));
    if (s != CUDNN_STATUS_SUCCESS) return cudnn_failed("cudnnSetStream", s);
    fe::error_t e = p->graph->execute(h, pack, workspace);
    if (e.is_bad()) return frontend_failed("execute", e);
    return STRATA_ATTN_OK;
}

template <typename F>
strata_attn_status guarded(F f) {
    last_error.clear();
    try {
        return f();
    } catch (const std::exception &e) {
        return fail(STRATA_ATTN_INTERNAL, fmt("unexpected exception: %s", e.what()));
    } catch (...) {
        return fail(STRATA_ATTN_INTERNAL, "unexpected exception");
    }
}

}  // namespace

extern "C" {

int strata_attn_abi_version(void) { return STRATA_ATTN_ABI_VERSION; }

size_t strata_attn_cudnn_version(void) {
    try {
        return cudnn_missing().empty() ? cudnnGetVersion() : 0;
    } catch (...) {
        return 0;
    }
}

strata_attn_status strata_attn_check(const strata_attn_desc *desc, int backward) {
    return guarded([&] { return check_desc(desc, backward); });
}

strata_attn_status strata_attn_workspace_size(const strata_attn_desc *desc, int backward,
                                              size_t *bytes) {
    return guarded([&] {
        strata_attn_status st = check_desc(desc, backward);
        if (st != STRATA_ATTN_OK) return st;
        if (bytes == nullptr) return fail(STRATA_ATTN_INVALID_ARGUMENT, "bytes is a null pointer");
        std::lock_guard<std::mutex> lock(mu);
        cudnnHandle_t h;
        const Plan *p;
        st = plan_for(*desc, backward, &h, &p);
        if (st != STRATA_ATTN_OK) return st;
        *bytes = static_cast<size_t>(p->workspace);
        return STRATA_ATTN_OK;
    });
}

strata_attn_status strata_attn_sdpa_forward(const strata_attn_desc *desc, const void *q,
                                            const void *k, const void *v, void *o, float *lse,
                                            size_t lse_len, void *workspace,
                                            size_t workspace_bytes, void *stream) {
    return guarded([&] {
        strata_attn_status st = check_desc(desc, 0);
        if (st != STRATA_ATTN_OK) return st;
        const void *ptrs[] = {q, k, v, o, lse};
        const char *names[] = {"q", "k", "v", "o", "lse"};
        if ((st = check_pointers(ptrs, names, 5)) != STRATA_ATTN_OK) return st;
        if ((st = check_lse(*desc, lse_len)) != STRATA_ATTN_OK) return st;
        if ((st = check_workspace(workspace, workspace_bytes)) != STRATA_ATTN_OK) return st;
        std::unordered_map<int64_t, void *> pack = {
            {Q_UID, const_cast<void *>(q)}, {K_UID, const_cast<void *>(k)},
            {V_UID, const_cast<void *>(v)}, {O_UID, o},
            {STATS_UID, lse}};
        return run(*desc, 0, pack, workspace, workspace_bytes, stream);
    });
}

strata_attn_status strata_attn_sdpa_backward(const strata_attn_desc *desc, const void *q,
                                             const void *k, const void *v, const void *o,
                                             const void *dout, const float *lse, size_t lse_len,
                                             void *dq, void *dk, void *dv, void *workspace,
                                             size_t workspace_bytes, void *stream) {
    return guarded([&] {
        strata_attn_status st = check_desc(desc, 1);
        if (st != STRATA_ATTN_OK) return st;
        const void *ptrs[] = {q, k, v, o, dout, lse, dq, dk, dv};
        const char *names[] = {"q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv"};
        if ((st = check_pointers(ptrs, names, 9)) != STRATA_ATTN_OK) return st;
        if ((st = check_lse(*desc, lse_len)) != STRATA_ATTN_OK) return st;
        if ((st = check_workspace(workspace, workspace_bytes)) != STRATA_ATTN_OK) return st;
        std::unordered_map<int64_t, void *> pack = {
            {Q_UID, const_cast<void *>(q)},       {K_UID, const_cast<void *>(k)},
            {V_UID, const_cast<void *>(v)},       {O_UID, const_cast<void *>(o)},
            {DO_UID, const_cast<void *>(dout)},   {STATS_UID, const_cast<float *>(lse)},
            {DQ_UID, dq},                         {DK_UID, dk},
            {DV_UID, dv}};
        return run(*desc, 1, pack, workspace, workspace_bytes, stream);
    });
}

const char *strata_attn_last_error(void) { return last_error.c_str(); }

}  // extern "C"
