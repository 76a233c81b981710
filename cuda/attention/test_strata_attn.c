/* strata_attn.h's checks, through libstrata_attn.so, on a host with no GPU (C99: the header is
 * C). benches/gpu/build-attention builds and runs it right after the library:
 *     test_strata_attn            each bad request refused with its status and its message
 * Each case prints PASS or FAIL; the exit status is the number of failures. Pointers here are
 * never dereferenced: every case is refused before the library touches memory, and the last
 * (a valid call) runs only where the CUDA runtime finds no GPU, where it must fail cleanly.
 * With STRATA_ATTN_TEST_NO_GRAPH set (and cuDNN's graph part kept off the path), only the
 * check that a partial cuDNN is a version of 0, not an abort. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata_attn.h"

static int failures = 0;

/* A valid desc: bf16, 2 batches, 8 heads over 2 kv heads, 64 queries over 128 keys, head 64,
 * strata's [b, s, h, d] layout (strides given in [b, h, s, d] order), causal. */
static strata_attn_desc good(void) {
    strata_attn_desc d;
    int t;
    memset(&d, 0, sizeof d);
    d.struct_size = sizeof d;
    d.dtype = STRATA_ATTN_BF16;
    d.batch = 2;
    d.heads = 8;
    d.kv_heads = 2;
    d.q_len = 64;
    d.kv_len = 128;
    d.head_dim = 64;
    for (t = 0; t < STRATA_ATTN_TENSORS; t++) {
        int kv = t == STRATA_ATTN_K || t == STRATA_ATTN_V || t == STRATA_ATTN_DK ||
                 t == STRATA_ATTN_DV;
        int64_t h = kv ? d.kv_heads : d.heads, s = kv ? d.kv_len : d.q_len;
        d.strides[t][0] = s * h * d.head_dim;
        d.strides[t][1] = d.head_dim;
        d.strides[t][2] = h * d.head_dim;
        d.strides[t][3] = 1;
    }
    d.scale = 0.125f;
    d.causal = 1;
    d.window = 0;
    return d;
}

/* Distinct 16-byte-aligned addresses that are never read. */
static char arena[16 * 16] __attribute__((aligned(16)));
#define P(i) ((void *)(arena + 16 * (i)))
#define LSE_LEN(d) ((size_t)((d).batch * (d).heads * (d).q_len))

static void expect(const char *name, strata_attn_status got, strata_attn_status want,
                   const char *needle) {
    const char *msg = strata_attn_last_error();
    int ok = got == want && (needle == NULL || strstr(msg, needle) != NULL);
    printf("%s: %s (status %d, want %d%s%s%s): %s\n", ok ? "PASS" : "FAIL", name, (int)got,
           (int)want, needle ? ", message with \"" : "", needle ? needle : "", needle ? "\"" : "",
           msg[0] ? msg : "(no message)");
    failures += !ok;
}

/* A forward or backward of a desc the checks must refuse: called only when they do (a desc
 * they let through would reach the GPU with these pointers; the no-GPU cases call it on a host
 * the CUDA runtime found no GPU on). */
static strata_attn_status fwd(const strata_attn_desc *d) {
    return strata_attn_sdpa_forward(d, P(0), P(1), P(2), P(3), (float *)P(4), LSE_LEN(*d), NULL,
                                    0, NULL);
}

static strata_attn_status bwd(const strata_attn_desc *d) {
    return strata_attn_sdpa_backward(d, P(0), P(1), P(2), P(3), P(4), (const float *)P(5),
                                     LSE_LEN(*d), P(6), P(7), P(8), NULL, 0, NULL);
}

int main(void) {
    strata_attn_desc d;
    size_t bytes = 0;
    strata_attn_status st;

    printf("libstrata_attn: ABI %d (header %d), cuDNN %zu\n", strata_attn_abi_version(),
           STRATA_ATTN_ABI_VERSION, strata_attn_cudnn_version());
    if (getenv("STRATA_ATTN_TEST_NO_GRAPH") != NULL) {
        /* libcudnn.so.9 without its graph part beside it or on the path: a version of 0, where
         * libcudnn.so.9 itself would abort the process. */
        expect("cuDNN without its graph part: version 0",
               strata_attn_cudnn_version() == 0 ? STRATA_ATTN_OK : STRATA_ATTN_INTERNAL,
               STRATA_ATTN_OK, NULL);
        printf("%d failed\n", failures);
        return failures;
    }
    expect("the ABI version", strata_attn_abi_version() == STRATA_ATTN_ABI_VERSION
                                  ? STRATA_ATTN_OK : STRATA_ATTN_INTERNAL, STRATA_ATTN_OK, NULL);

    d = good();
    expect("a valid forward", strata_attn_check(&d, 0), STRATA_ATTN_OK, NULL);
    expect("a valid backward", strata_attn_check(&d, 1), STRATA_ATTN_OK, NULL);
    d = good(), d.head_dim = 128, d.dtype = STRATA_ATTN_F16, d.window = 32;
    {
        int t;
        for (t = 0; t < STRATA_ATTN_TENSORS; t++) {
            int64_t h = d.strides[t][2] / 64;
            d.strides[t][0] = d.strides[t][0] * 2;
            d.strides[t][1] = 128;
            d.strides[t][2] = h * 128;
        }
    }
    expect("f16, head 128, a window of 32", strata_attn_check(&d, 1), STRATA_ATTN_OK, NULL);

    expect("no desc", strata_attn_check(NULL, 0), STRATA_ATTN_INVALID_ARGUMENT, "desc is null");
    d = good(), d.struct_size -= 8;
    expect("another header's desc", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT,
           "struct_size");
    d = good();
    expect("a direction of 2", strata_attn_check(&d, 2), STRATA_ATTN_INVALID_ARGUMENT,
           "backward is 2");
    d = good(), d.dtype = 7;
    expect("dtype 7 (f32 or unknown)", strata_attn_check(&d, 0), STRATA_ATTN_UNSUPPORTED,
           "bf16");
    d = good(), d.batch = 0;
    expect("no batch", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT, "batch is 0");
    d = good(), d.kv_len = -5;
    expect("a negative kv_len", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT,
           "kv_len is -5");
    d = good(), d.kv_heads = 3;
    expect("8 heads over 3 kv heads", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT,
           "not a multiple of 3 key/value heads");
    d = good(), d.head_dim = 60;
    expect("head 60", strata_attn_check(&d, 0), STRATA_ATTN_UNSUPPORTED, "head_dim 60");
    d = good(), d.head_dim = 512;
    expect("head 512", strata_attn_check(&d, 0), STRATA_ATTN_UNSUPPORTED, "up to 256");
    d = good(), d.scale = 0.0f;
    expect("scale 0", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT, "scale");
    d = good(), d.causal = 2;
    expect("causal 2", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT, "causal is 2");
    d = good(), d.q_len = 256;
    expect("more queries than keys, causal", strata_attn_check(&d, 0),
           STRATA_ATTN_INVALID_ARGUMENT, "at least as many keys");
    d = good(), d.window = -1;
    expect("a window of -1", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT,
           "window -1");
    d = good(), d.window = 16, d.causal = 0;
    expect("a window without causal", strata_attn_check(&d, 0), STRATA_ATTN_UNSUPPORTED,
           "sliding window");
    d = good(), d.q_len = 1, d.kv_len = 1;
    expect("one query over one key, forward", strata_attn_check(&d, 0), STRATA_ATTN_OK, NULL);
    expect("one query over one key, backward", strata_attn_check(&d, 1), STRATA_ATTN_UNSUPPORTED,
           "one query over one key");
    d = good(), d.strides[STRATA_ATTN_K][3] = 2;
    expect("k's head dimension strided", strata_attn_check(&d, 0), STRATA_ATTN_UNSUPPORTED,
           "k's head dimension has stride 2");
    d = good(), d.strides[STRATA_ATTN_V][1] = -64;
    expect("a negative stride", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT,
           "v's stride 1 is -64");
    d = good(), d.strides[STRATA_ATTN_Q][2] = 100;
    expect("a stride of 100 elements", strata_attn_check(&d, 0), STRATA_ATTN_UNSUPPORTED,
           "multiples of 8");
    d = good(), d.strides[STRATA_ATTN_O][2] = 8;
    expect("o's rows overlapping", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT,
           "o's strides make two of its elements share an address");
    d = good(), d.strides[STRATA_ATTN_DK][0] = 0;
    expect("dk's batches on one another", strata_attn_check(&d, 1), STRATA_ATTN_INVALID_ARGUMENT,
           "dk's strides");
    expect("... which the forward does not read", strata_attn_check(&d, 0), STRATA_ATTN_OK, NULL);
    d = good(), d.strides[STRATA_ATTN_K][0] = 0;
    expect("k's batches shared (an input: fine)", strata_attn_check(&d, 0), STRATA_ATTN_OK, NULL);
    d = good(), d.batch = 3, d.strides[STRATA_ATTN_Q][0] = (INT64_MAX / 2) & ~(int64_t)7;
    expect("q's reach past 2^63", strata_attn_check(&d, 0), STRATA_ATTN_INVALID_ARGUMENT,
           "past 2^63");

    d = good();
    expect("forward: q null",
           strata_attn_sdpa_forward(&d, NULL, P(1), P(2), P(3), (float *)P(4), LSE_LEN(d), NULL, 0,
                                    NULL),
           STRATA_ATTN_INVALID_ARGUMENT, "q is a null pointer");
    expect("forward: lse null",
           strata_attn_sdpa_forward(&d, P(0), P(1), P(2), P(3), NULL, LSE_LEN(d), NULL, 0, NULL),
           STRATA_ATTN_INVALID_ARGUMENT, "lse is a null pointer");
    expect("forward: lse one short",
           strata_attn_sdpa_forward(&d, P(0), P(1), P(2), P(3), (float *)P(4), LSE_LEN(d) - 1,
                                    NULL, 0, NULL),
           STRATA_ATTN_INVALID_ARGUMENT, "1024 elements");
    expect("forward: k misaligned",
           strata_attn_sdpa_forward(&d, P(0), arena + 2, P(2), P(3), (float *)P(4), LSE_LEN(d),
                                    NULL, 0, NULL),
           STRATA_ATTN_UNSUPPORTED, "k is not 16-byte aligned");
    expect("forward: a workspace of 64 bytes at null",
           strata_attn_sdpa_forward(&d, P(0), P(1), P(2), P(3), (float *)P(4), LSE_LEN(d), NULL,
                                    64, NULL),
           STRATA_ATTN_INVALID_ARGUMENT, "workspace is a null pointer");
    d.head_dim = 36;
    expect("forward: head 36", strata_attn_check(&d, 0) == STRATA_ATTN_OK ? STRATA_ATTN_OK : fwd(&d),
           STRATA_ATTN_UNSUPPORTED, "head_dim 36");
    d = good();
    expect("backward: dout null",
           strata_attn_sdpa_backward(&d, P(0), P(1), P(2), P(3), NULL, (const float *)P(5),
                                     LSE_LEN(d), P(6), P(7), P(8), NULL, 0, NULL),
           STRATA_ATTN_INVALID_ARGUMENT, "dout is a null pointer");
    expect("backward: dv null",
           strata_attn_sdpa_backward(&d, P(0), P(1), P(2), P(3), P(4), (const float *)P(5),
                                     LSE_LEN(d), P(6), P(7), NULL, NULL, 0, NULL),
           STRATA_ATTN_INVALID_ARGUMENT, "dv is a null pointer");
    expect("backward: lse of the kv rows",
           strata_attn_sdpa_backward(&d, P(0), P(1), P(2), P(3), P(4), (const float *)P(5),
                                     (size_t)(d.batch * d.heads * d.kv_len), P(6), P(7), P(8),
                                     NULL, 0, NULL),
           STRATA_ATTN_INVALID_ARGUMENT, "lse holds 2048 elements");
    d.window = -3;
    expect("backward: a window of -3",
           strata_attn_check(&d, 1) == STRATA_ATTN_OK ? STRATA_ATTN_OK : bwd(&d),
           STRATA_ATTN_INVALID_ARGUMENT, "window -3");
    d = good();
    expect("workspace size: bytes null", strata_attn_workspace_size(&d, 0, NULL),
           STRATA_ATTN_INVALID_ARGUMENT, "bytes is a null pointer");
    expect("the message clears on success", strata_attn_check(&d, 0), STRATA_ATTN_OK, NULL);
    if (strata_attn_last_error()[0] != '\0') {
        printf("FAIL: a successful call left the message \"%s\"\n", strata_attn_last_error());
        failures++;
    }

    /* A valid request: without a GPU, the CUDA runtime's refusal as a status, not a crash. */
    st = strata_attn_workspace_size(&d, 0, &bytes);
    if (st == STRATA_ATTN_OK) {
        printf("SKIP: a GPU answered (forward workspace %zu bytes): the no-GPU cases need a host "
               "without one\n", bytes);
    } else {
        expect("workspace size without a GPU", st, STRATA_ATTN_CUDA_ERROR, "cudaGetDevice");
        expect("forward without a GPU", fwd(&d), STRATA_ATTN_CUDA_ERROR, "cudaGetDevice");
        expect("backward without a GPU", bwd(&d), STRATA_ATTN_CUDA_ERROR, "cudaGetDevice");
    }
    printf("%d failed\n", failures);
    return failures;
}
