"""The C matrix-multiply routines every MatMul, Gemm and Conv kernel embeds (float32).

``gemm_simple`` is the straightforward candidate (i-k-j loops the compiler vectorises over j).
``gemm_blocked`` is the tuned one: the output is cut into tiles shared out to OpenMP threads,
each tile is computed by a 4x16 register-blocked micro-kernel over 256-deep slices of K, and the
tile routine is compiled twice (``target_clones``: x86-64-v3, i.e. AVX2+FMA, and baseline x86-64), the right one
picked when the library loads, so the bundle stays portable while using the host's vectors.
Both compute ``C[M, N] = A[M, K] @ B[K, N]`` (row-major, leading dimensions given).

The routines take every shape as an argument and depend on nothing the kernel defines, so they are
a separately compiled unit (``engine_cpu.units``): declared at the top of the preamble, defined
between its unit markers. The CPU plugin compiles them once per kernel cache and links them into
each kernel. Before, they were compiled again with every Conv, MatMul and Gemm source, which was
most of a cold conversion's compile time. What must be specialised on a kernel's shape (the
Conv's packing and tile routines) stays in the kernel's own part.
"""

from engine_onnx.ops.gemm_blas import GEMM_BLAS_PREAMBLE, blas_available

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
#define GEMM_KC 256
#define GEMM_TM 64
#define GEMM_TN 256
#define GP_MR 6
#define GP_NR 16
#define GP_KC 256
#define GP_MC 72
#define GP_NC 256
/* The routines are compiled once, in the unit below (engine_cpu.units), and linked into each
   kernel: external, so the kernel's own part can call them, and hidden, so no kernel exports them. */
#define GEMM_API __attribute__((visibility("hidden")))
GEMM_API void gemm_simple(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                          const float *B, int64_t ldb, float *C, int64_t ldc);
GEMM_API void gemm_blocked(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const float *B, int64_t ldb, float *C, int64_t ldc);
GEMM_API void gemm_packed(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                          const float *B, int64_t ldb, float *C, int64_t ldc);
GEMM_API void gemm_pack_a(int64_t mc, int64_t kc, const float *A, int64_t lda, float *dst);
GEMM_API void gemm_pack_b(int64_t kc, int64_t nc, const float *B, int64_t ldb, float *dst);
GEMM_API void gemm_macro(int64_t mc, int64_t nc, int64_t kc, const float *Ap, const float *Bp, float *C,
                         int64_t ldc, int acc);
GEMM_API void gemm_grid(int64_t M, int64_t N, int64_t units, int64_t *tm, int64_t *tn);

/* K cut into even blocks of at most GP_KC. */
static inline int64_t gemm_kc(int64_t K) {
    const int64_t blocks = (K + GP_KC - 1) / GP_KC;
    return (K + blocks - 1) / blocks;
}
#endif
// engine-cpu: unit begin
#ifndef ENGINE_ONNX_GEMM_ROUTINES
#define ENGINE_ONNX_GEMM_ROUTINES
GEMM_API void gemm_simple(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
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

GEMM_API void gemm_blocked(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
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
/* ---- Packed GEMM (gemm_packed) -------------------------------------------------------------
   BLIS-style: B is packed into NR-column panels and A into MR-row panels, KC deep, so the 6x16
   micro-kernel streams both operands contiguously (12 accumulators + 2 B vectors + 1 broadcast
   = 15 of AVX2's 16 registers). A B panel (KC x 16 floats) stays in L1 while every A panel of
   the MC-row block runs over it; the A block (MC x KC) stays in L2. Each thread packs into its
   own stack buffers and owns whole output tiles, so one parallel region has no barrier inside.
   fp-contract=fast: ISO C mode (-std=c11) turns off a*b+c contraction, which would halve the
   AVX2 clone's throughput (separate multiply and add instead of FMA). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

/* mc x kc block of A (row stride lda) into MR-row panels, zero-padded to a multiple of MR. */
GEMM_API void gemm_pack_a(int64_t mc, int64_t kc, const float *A, int64_t lda, float *dst) {
    for (int64_t p = 0; p < mc; p += GP_MR) {
        const int64_t mr = mc - p < GP_MR ? mc - p : GP_MR;
        const float *a = A + p * lda;
        if (mr == GP_MR) {
            const float *a1 = a + lda, *a2 = a1 + lda, *a3 = a2 + lda, *a4 = a3 + lda, *a5 = a4 + lda;
            for (int64_t k = 0; k < kc; k++, dst += GP_MR) {
                dst[0] = a[k]; dst[1] = a1[k]; dst[2] = a2[k]; dst[3] = a3[k]; dst[4] = a4[k]; dst[5] = a5[k];
            }
        } else {
            for (int64_t k = 0; k < kc; k++, dst += GP_MR)
                for (int64_t i = 0; i < GP_MR; i++) dst[i] = i < mr ? a[i * lda + k] : 0.0f;
        }
    }
}

/* kc x nc block of B (row stride ldb) into NR-column panels, zero-padded to a multiple of NR. */
GEMM_API void gemm_pack_b(int64_t kc, int64_t nc, const float *B, int64_t ldb, float *dst) {
    for (int64_t j = 0; j < nc; j += GP_NR) {
        const int64_t nr = nc - j < GP_NR ? nc - j : GP_NR;
        if (nr == GP_NR) {
            for (int64_t k = 0; k < kc; k++, dst += GP_NR) {
                st8(dst, ld8(B + k * ldb + j)); st8(dst + 8, ld8(B + k * ldb + j + 8));
            }
        } else {
            for (int64_t k = 0; k < kc; k++, dst += GP_NR)
                for (int64_t q = 0; q < GP_NR; q++) dst[q] = q < nr ? B[k * ldb + j + q] : 0.0f;
        }
    }
}

/* C[mc, nc] (+)= packed A (mc x kc) @ packed B (kc x nc); acc = 0 overwrites C. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
GEMM_API void gemm_macro(int64_t mc, int64_t nc, int64_t kc, const float *Ap, const float *Bp, float *C,
                         int64_t ldc, int acc) {
    for (int64_t j = 0; j < nc; j += GP_NR) {
        const int64_t nr = nc - j < GP_NR ? nc - j : GP_NR;
        const float *bpanel = Bp + j * kc;
        for (int64_t i = 0; i < mc; i += GP_MR) {
            const int64_t mr = mc - i < GP_MR ? mc - i : GP_MR;
            const float *a = Ap + i * kc, *b = bpanel;
            v8sf c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
            v8sf c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
            for (int64_t k = 0; k < kc; k++, a += GP_MR, b += GP_NR) {
                const v8sf b0 = ld8(b), b1 = ld8(b + 8);
                float p = a[0]; c00 += p * b0; c01 += p * b1;
                p = a[1]; c10 += p * b0; c11 += p * b1;
                p = a[2]; c20 += p * b0; c21 += p * b1;
                p = a[3]; c30 += p * b0; c31 += p * b1;
                p = a[4]; c40 += p * b0; c41 += p * b1;
                p = a[5]; c50 += p * b0; c51 += p * b1;
            }
            float *c = C + i * ldc + j;
            if (mr == GP_MR && nr == GP_NR) {
                if (acc) {
                    c00 += ld8(c); c01 += ld8(c + 8); c10 += ld8(c + ldc); c11 += ld8(c + ldc + 8);
                    c20 += ld8(c + 2 * ldc); c21 += ld8(c + 2 * ldc + 8); c30 += ld8(c + 3 * ldc);
                    c31 += ld8(c + 3 * ldc + 8); c40 += ld8(c + 4 * ldc); c41 += ld8(c + 4 * ldc + 8);
                    c50 += ld8(c + 5 * ldc); c51 += ld8(c + 5 * ldc + 8);
                }
                st8(c, c00); st8(c + 8, c01); st8(c + ldc, c10); st8(c + ldc + 8, c11);
                st8(c + 2 * ldc, c20); st8(c + 2 * ldc + 8, c21); st8(c + 3 * ldc, c30); st8(c + 3 * ldc + 8, c31);
                st8(c + 4 * ldc, c40); st8(c + 4 * ldc + 8, c41); st8(c + 5 * ldc, c50); st8(c + 5 * ldc + 8, c51);
            } else {  /* an edge tile: through a local buffer, only the valid part written */
                float tmp[GP_MR * GP_NR];
                st8(tmp, c00); st8(tmp + 8, c01); st8(tmp + 16, c10); st8(tmp + 24, c11);
                st8(tmp + 32, c20); st8(tmp + 40, c21); st8(tmp + 48, c30); st8(tmp + 56, c31);
                st8(tmp + 64, c40); st8(tmp + 72, c41); st8(tmp + 80, c50); st8(tmp + 88, c51);
                for (int64_t ii = 0; ii < mr; ii++)
                    for (int64_t jj = 0; jj < nr; jj++)
                        c[ii * ldc + jj] = (acc ? c[ii * ldc + jj] : 0.0f) + tmp[ii * GP_NR + jj];
            }
        }
    }
}

/* The output grid for `units` independent products of M x N (images x groups of a Conv):
   column chunks of at most GP_NC (multiples of NR), split further, then by rows, until every
   thread has work and the tile count is a multiple of the threads (or large). */
GEMM_API void gemm_grid(int64_t M, int64_t N, int64_t units, int64_t *tm, int64_t *tn) {
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const int64_t max_cn = (N + GP_NR - 1) / GP_NR, max_cm = (M + GP_MR - 1) / GP_MR;
    int64_t cn = (N + GP_NC - 1) / GP_NC, cm = 1;
    if ((units * cn) % threads && units * cn < 4 * threads) {
        int64_t want = ((units * cn + threads - 1) / threads) * threads;
        int64_t c2 = (want + units - 1) / units;
        cn = c2 < max_cn ? c2 : max_cn;
    }
    if (units * cn < threads) {
        int64_t c2 = (threads + units * cn - 1) / (units * cn);
        cm = c2 < max_cm ? c2 : max_cm;
    }
    *tn = ((N + cn - 1) / cn + GP_NR - 1) / GP_NR * GP_NR;
    *tm = ((M + cm - 1) / cm + GP_MR - 1) / GP_MR * GP_MR;
}

GEMM_API void gemm_packed(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                          const float *B, int64_t ldb, float *C, int64_t ldc) {
    int64_t tm, tn;
    gemm_grid(M, N, 1, &tm, &tn);
    const int64_t cm = (M + tm - 1) / tm, cn = (N + tn - 1) / tn, kcb = gemm_kc(K);
    #pragma omp parallel if (cm * cn > 1 && M * N * K >= 65536)
    {
        float ap[GP_MC * GP_KC] __attribute__((aligned(64)));
        float bp[GP_KC * GP_NC] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < cm * cn; t++) {
            const int64_t m0 = (t / cn) * tm, n0 = (t % cn) * tn;
            const int64_t m1 = m0 + tm < M ? m0 + tm : M, n1 = n0 + tn < N ? n0 + tn : N;
            for (int64_t k0 = 0; k0 < K; k0 += kcb) {
                const int64_t kc = K - k0 < kcb ? K - k0 : kcb;
                gemm_pack_b(kc, n1 - n0, B + k0 * ldb + n0, ldb, bp);
                for (int64_t mb = m0; mb < m1; mb += GP_MC) {
                    const int64_t mc = m1 - mb < GP_MC ? m1 - mb : GP_MC;
                    gemm_pack_a(mc, kc, A + mb * lda + k0, lda, ap);
                    gemm_macro(mc, n1 - n0, kc, ap, bp, C + mb * ldc + n0, ldc, k0 > 0);
                }
            }
        }
    }
}
#pragma GCC pop_options
#endif
// engine-cpu: unit end
"""

def _blas_ready() -> bool:
    return blas_available() is None  # the wheel is installed where the model is converted


def _own_binary_routines() -> dict[str, str]:
    return {"gemm_blas": GEMM_BLAS_PREAMBLE} if _blas_ready() else {}


#: GEMM routines whose callers get a source (and binaries) of their own: they need something
#: optional where they load (``codegen.kernel_sources``). Routine name -> the preamble defining it.
OWN_BINARY_ROUTINES = _own_binary_routines()

#: Candidate entries of every GEMM-shaped kernel, in index order, and the routine each one calls.
#: ``blas`` (OpenBLAS from the scipy-openblas32 wheel, ``gemm_blas``) is offered where the wheel
#: is installed at conversion; its entries get binaries of their own, so a machine without the
#: wheel still loads the bundle and runs the other candidates.
GEMM_CANDIDATES = (("simple", "gemm_simple"), ("blocked", "gemm_blocked"), ("packed", "gemm_packed"),
                   *((("blas", "gemm_blas"),) if OWN_BINARY_ROUTINES else ()))
