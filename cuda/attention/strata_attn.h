/* strata's C interface to cuDNN 9's fused scaled-dot-product attention (SDPA), forward and
 * backward, on the tensor cores. `libstrata_attn.so` implements it (strata_attn.cpp, over
 * cuDNN's graph API through cudnn_frontend); `benches/gpu/build-attention` builds it. strata
 * loads it at run time (src/backend/cuda/attention_lib.rs), so nothing here is needed to build
 * strata.
 *
 * Every tensor is four-dimensional in cuDNN's order [batch, heads, seq, head_dim], with the
 * strides of those four dimensions given explicitly in elements (strata's [batch, seq, heads,
 * head_dim] layout is the same memory with the strides permuted); the head dimension's stride
 * is 1. q, o, dout and dq are [b, heads, q_len, d]; k, v, dk and dv [b, kv_heads, kv_len, d];
 * query head h reads key/value head h / (heads / kv_heads). The log-sum-exp of each query row
 * (cuDNN's softmax "stats", natural log, with the scale applied) is f32 [b, heads, q_len, 1],
 * contiguous: the forward writes it, the backward reads it.
 *
 * Masks: `causal` hides the keys after each query, the queries being the last q_len of the
 * kv_len positions (cuDNN's bottom-right diagonal); `window` (0: none) also hides the keys
 * `window` or more positions before it (a query sees at most `window` positions, itself
 * included). A window needs `causal`.
 *
 * Every function returns a strata_attn_status; on anything but STRATA_ATTN_OK,
 * strata_attn_last_error() gives the calling thread's last message. The checks that need no
 * GPU (sizes, strides, head width, heads, the lse's length, null pointers, options) run before
 * any CUDA or cuDNN call: strata_attn_check() runs them alone.
 *
 * The caller passes its CUDA stream (a cudaStream_t / CUstream: the work is queued there,
 * nothing waits for the device) with the device's context current on the calling thread, and
 * the workspace: strata_attn_workspace_size() gives the bytes a call needs (it builds the
 * cuDNN graph, so it needs the GPU). Built graphs are cached by everything a call's desc holds
 * and the device, for the life of the process.
 */
#ifndef STRATA_ATTN_H
#define STRATA_ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a declaration below changes; strata refuses a library of another version. */
#define STRATA_ATTN_ABI_VERSION 1

typedef enum strata_attn_status {
    STRATA_ATTN_OK = 0,
    /* A size, stride, pointer or length that cannot be right: the caller's bug. */
    STRATA_ATTN_INVALID_ARGUMENT = 1,
    /* A valid request that cuDNN's SDPA (or this interface) does not take: a head width past
     * 256 or not a multiple of 8, a window without causal, f32 inputs, ... */
    STRATA_ATTN_UNSUPPORTED = 2,
    /* The CUDA runtime failed (no GPU, no driver, a bad stream ...). */
    STRATA_ATTN_CUDA_ERROR = 3,
    /* cuDNN refused or failed (its message is kept). */
    STRATA_ATTN_CUDNN_ERROR = 4,
    /* Host memory ran out, or an exception the interface did not expect. */
    STRATA_ATTN_INTERNAL = 5
} strata_attn_status;

typedef enum strata_attn_dtype {
    STRATA_ATTN_BF16 = 0,
    STRATA_ATTN_F16 = 1
} strata_attn_dtype;

/* The tensors a call names, as indices of strata_attn_desc.strides. */
enum {
    STRATA_ATTN_Q = 0,
    STRATA_ATTN_K = 1,
    STRATA_ATTN_V = 2,
    STRATA_ATTN_O = 3,
    STRATA_ATTN_DOUT = 4,
    STRATA_ATTN_DQ = 5,
    STRATA_ATTN_DK = 6,
    STRATA_ATTN_DV = 7,
    STRATA_ATTN_TENSORS = 8
};

/* One attention call's shape. The forward reads the strides of Q, K, V and O; the backward
 * all eight. */
typedef struct strata_attn_desc {
    /* sizeof(strata_attn_desc): a caller built against another layout is refused. */
    uint32_t struct_size;
    /* a strata_attn_dtype: every q, k, v, o, dout, dq, dk, dv element. */
    int32_t dtype;
    int64_t batch;
    int64_t heads;
    int64_t kv_heads;
    int64_t q_len;
    int64_t kv_len;
    int64_t head_dim;
    /* [tensor][batch, head, seq, head_dim] strides in elements. */
    int64_t strides[STRATA_ATTN_TENSORS][4];
    /* The softmax's scale of q·kᵀ (1/sqrt(head_dim) usually); finite and above 0. */
    float scale;
    /* 1: causal (bottom-right), 0: every key. */
    int32_t causal;
    /* 0: no window; else a query sees at most this many positions. Needs causal. */
    int64_t window;
} strata_attn_desc;

/* STRATA_ATTN_ABI_VERSION as the library was built. */
int strata_attn_abi_version(void);

/* cuDNN's version as loaded (cudnnGetVersion: 91900 for 9.19.0), or 0 when cuDNN's parts do
 * not load (libcudnn.so.9 would abort the process); no GPU needed. */
size_t strata_attn_cudnn_version(void);

/* The checks that need no GPU, alone: forward (backward = 0) or backward (1). */
strata_attn_status strata_attn_check(const strata_attn_desc *desc, int backward);

/* The workspace bytes a forward (backward = 0) or backward (1) of `desc` needs, in *bytes.
 * Builds and caches the graph on the current device. */
strata_attn_status strata_attn_workspace_size(const strata_attn_desc *desc, int backward,
                                              size_t *bytes);

/* o = softmax(scale · q kᵀ + mask) v, and lse (lse_len elements: batch · heads · q_len). */
strata_attn_status strata_attn_sdpa_forward(const strata_attn_desc *desc, const void *q,
                                            const void *k, const void *v, void *o, float *lse,
                                            size_t lse_len, void *workspace,
                                            size_t workspace_bytes, void *stream);

/* dq, dk, dv of the forward that gave o and lse, for the output gradient dout. dk and dv are
 * summed over each key/value head's query heads. */
strata_attn_status strata_attn_sdpa_backward(const strata_attn_desc *desc, const void *q,
                                             const void *k, const void *v, const void *o,
                                             const void *dout, const float *lse, size_t lse_len,
                                             void *dq, void *dk, void *dv, void *workspace,
                                             size_t workspace_bytes, void *stream);

/* The calling thread's last error message ("" when none); valid until that thread's next
 * call. */
const char *strata_attn_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* STRATA_ATTN_H */
