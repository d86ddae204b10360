"""The C matrix-multiply routines every MatMul, Gemm and Conv kernel embeds (float32).

``gemm_simple`` is the straightforward candidate (i-k-j loops the compiler vectorises over j).
``gemm_blocked`` is the tuned one: the output is cut into tiles shared out to OpenMP threads,
each tile is computed by a 4x16 register-blocked micro-kernel over 256-deep slices of K, and the
tile routine is compiled twice (``target_clones``: x86-64-v3, i.e. AVX2+FMA, and baseline x86-64), the right one
picked when the library loads, so the bundle stays portable while using the host's vectors.
Both compute ``C[M, N] = A[M, K] @ B[K, N]`` (row-major, leading dimensions given).
"""

GEMM_PREAMBLE = r"""
#ifndef ENGINE_ONNX_GEMM
#define ENGINE_ONNX_GEMM
#ifdef _OPENMP
#include <omp.h>
#endif
/* Unaligned, aliasing 8-float vectors: macros, not functions, so the AVX2 clone never calls a
   baseline helper across an ABI boundary. */
typedef float v8sf __attribute__((vector_size(32), aligned(4), may_alias));
#define ld8(p) (*(const v8sf *)(p))
#define st8(p, v) (*(v8sf *)(p) = (v))

static void gemm_simple(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                        const float *B, int64_t ldb, float *C, int64_t ldc) {
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * ldc;
        for (int64_t j = 0; j < N; j++) c[j] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float a = A[i * lda + k];
            const float *b = B + k * ldb;
            for (int64_t j = 0; j < N; j++) c[j] += a * b[j];
        }
    }
}

#define GEMM_KC 256
#define GEMM_TM 64
#define GEMM_TN 256

__attribute__((target_clones("arch=x86-64-v3", "default")))
static void gemm_tile(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc) {
    for (int64_t i = m0; i < m1; i++)
        for (int64_t j = n0; j < n1; j++) C[i * ldc + j] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
        const int64_t k1 = k0 + GEMM_KC < K ? k0 + GEMM_KC : K;
        int64_t i = m0;
        for (; i + 4 <= m1; i += 4) {
            const float *a0 = A + i * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
            float *c0 = C + i * ldc, *c1 = c0 + ldc, *c2 = c1 + ldc, *c3 = c2 + ldc;
            int64_t j = n0;
            for (; j + 16 <= n1; j += 16) {
                v8sf x00 = ld8(c0 + j), x01 = ld8(c0 + j + 8), x10 = ld8(c1 + j), x11 = ld8(c1 + j + 8);
                v8sf x20 = ld8(c2 + j), x21 = ld8(c2 + j + 8), x30 = ld8(c3 + j), x31 = ld8(c3 + j + 8);
                for (int64_t k = k0; k < k1; k++) {
                    const v8sf b0 = ld8(B + k * ldb + j), b1 = ld8(B + k * ldb + j + 8);
                    const float p0 = a0[k], p1 = a1[k], p2 = a2[k], p3 = a3[k];
                    x00 += p0 * b0; x01 += p0 * b1; x10 += p1 * b0; x11 += p1 * b1;
                    x20 += p2 * b0; x21 += p2 * b1; x30 += p3 * b0; x31 += p3 * b1;
                }
                st8(c0 + j, x00); st8(c0 + j + 8, x01); st8(c1 + j, x10); st8(c1 + j + 8, x11);
                st8(c2 + j, x20); st8(c2 + j + 8, x21); st8(c3 + j, x30); st8(c3 + j + 8, x31);
            }
            for (; j < n1; j++) {
                float s0 = c0[j], s1 = c1[j], s2 = c2[j], s3 = c3[j];
                for (int64_t k = k0; k < k1; k++) {
                    const float b = B[k * ldb + j];
                    s0 += a0[k] * b; s1 += a1[k] * b; s2 += a2[k] * b; s3 += a3[k] * b;
                }
                c0[j] = s0; c1[j] = s1; c2[j] = s2; c3[j] = s3;
            }
        }
        for (; i < m1; i++) {  /* leftover rows: axpy over the tile's contiguous row segment */
            const float *a = A + i * lda;
            float *c = C + i * ldc;
            for (int64_t k = k0; k < k1; k++) {
                const float p = a[k];
                const float *b = B + k * ldb;
                int64_t j = n0;
                for (; j + 8 <= n1; j += 8) st8(c + j, ld8(c + j) + p * ld8(b + j));
                for (; j < n1; j++) c[j] += p * b[j];
            }
        }
    }
}

static void gemm_blocked(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb, float *C, int64_t ldc) {
    /* Few rows (a classifier head at batch 1): one wide column band per thread, so each thread
       streams long contiguous runs of B's rows instead of hopping between pages. */
    int64_t tn_width = GEMM_TN;
#ifdef _OPENMP
    if (M < 16) {
        const int64_t threads = omp_get_max_threads();
        tn_width = ((N + threads - 1) / threads + 15) / 16 * 16;
        if (tn_width < 64) tn_width = 64;
    }
#endif
    const int64_t tm = (M + GEMM_TM - 1) / GEMM_TM, tn = (N + tn_width - 1) / tn_width;
    #pragma omp parallel for schedule(static) if (M * N * K >= 65536 && tm * tn > 1)
    for (int64_t t = 0; t < tm * tn; t++) {
        const int64_t m0 = (t / tn) * GEMM_TM, n0 = (t % tn) * tn_width;
        const int64_t m1 = m0 + GEMM_TM < M ? m0 + GEMM_TM : M, n1 = n0 + tn_width < N ? n0 + tn_width : N;
        gemm_tile(m0, m1, n0, n1, K, A, lda, B, ldb, C, ldc);
    }
}
#endif
"""

#: Candidate entries of every GEMM-shaped kernel, in index order, and the routine each one calls.
GEMM_CANDIDATES = (("simple", "gemm_simple"), ("blocked", "gemm_blocked"))
