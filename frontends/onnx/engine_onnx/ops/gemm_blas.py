"""``gemm_blas``: the float32 GEMM routine of a BLAS candidate, OpenBLAS from the scipy-openblas32 wheel.

Same signature and meaning as ``gemm_blocked`` in ``gemm_c`` (``C[M, N] = A[M, K] @ B[K, N]``,
row-major, leading dimensions given, ``C`` overwritten), so a kernel swaps one for the other.

The library is linked through the CPU plugin's library providers (``engine_cpu.libraries``): the
preamble's ``// engine-cpu: link scipy_openblas32`` line makes the plugin add the wheel's include
directory and link its ``libscipy_openblas.so`` by soname only (no path into site-packages in the
kernel), both for the ``elf-so`` built at conversion and for the ``c-source`` compiled at load; the
loader opens the wheel's library before the kernel. ``KernelSpec.options`` reads the line into the
``link`` compile option. A kernel with this preamble needs the wheel wherever it loads: keep it in a
binary of its own, apart from the portable candidates, so that a machine without the wheel still
runs those (the CPU plugin reports the BLAS candidate unavailable and the core runs another).

Threads: OpenBLAS (this wheel is built with pthreads, not OpenMP) keeps its own thread pool,
the engine's kernels use OpenMP's. ``gemm_blas`` is called from serial code (as ``gemm_blocked``
is) and cuts the output into one column band per OpenMP thread (the CPU plugin's ``num_threads``),
each computed by a single-threaded sgemm: the engine's threads do the work, OpenBLAS's pool stays
idle and nothing competes with OpenMP's threads for the cores. OpenBLAS's own setting is restored
after the call: per calling thread with ``openblas_set_num_threads_local`` where the library
exports it, else process-wide around the call (the 0.3.34 wheel declares the first in
``cblas.h`` but does not export it, hence a weak symbol). The alternative, OpenBLAS threading the
whole call with OpenMP's thread count, is ``GEMM_BLAS_OPENBLAS_THREADS`` (defined before the
preamble); ``benchmarks/gemm_blas.py`` compares the two (docs/benchmarks.md).
"""

from __future__ import annotations

__all__ = ["GEMM_BLAS_PREAMBLE", "GEMM_BLAS_LIBRARY", "GEMM_BLAS_OPTIONS", "blas_available"]

#: The library provider (``engine_cpu.libraries``) the routine links.
GEMM_BLAS_LIBRARY = "scipy_openblas32"

#: The compile options a kernel using ``gemm_blas`` needs (``KernelSpec.options`` derives the same
#: ``link`` from the preamble's directive line).
GEMM_BLAS_OPTIONS = {"link": [GEMM_BLAS_LIBRARY]}

GEMM_BLAS_PREAMBLE = r"""
// engine-cpu: link scipy_openblas32
#ifndef ENGINE_ONNX_GEMM_BLAS
#define ENGINE_ONNX_GEMM_BLAS
#include <stdint.h>
#include <cblas.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* Declared by cblas.h but not exported by every build of the wheel: weak, so a library without it
   still loads (the address is then NULL) and the process-wide setting is used instead. */
#pragma weak scipy_openblas_set_num_threads_local

static void gemm_blas_sgemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                            const float *B, int64_t ldb, float *C, int64_t ldc) {
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)M, (blasint)N, (blasint)K,
                      1.0f, A, (blasint)lda, B, (blasint)ldb, 0.0f, C, (blasint)ldc);
}

/* OpenBLAS's thread count for the calls that follow; returns the previous one for the restore.
   Per calling thread where the library has the local setter, else process-wide. */
static int gemm_blas_set_threads(int threads) {
    if (scipy_openblas_set_num_threads_local) return scipy_openblas_set_num_threads_local(threads);
    const int previous = scipy_openblas_get_num_threads();
    if (previous != threads) scipy_openblas_set_num_threads(threads);
    return previous;
}

static void gemm_blas(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc) {
#if defined(_OPENMP) && defined(GEMM_BLAS_OPENBLAS_THREADS)
    /* OpenBLAS threads the call itself (its own pool), with OpenMP's thread count. */
    const int previous = gemm_blas_set_threads(omp_in_parallel() ? 1 : omp_get_max_threads());
    gemm_blas_sgemm(M, N, K, A, lda, B, ldb, C, ldc);
    gemm_blas_set_threads(previous);
#elif defined(_OPENMP)
    /* One column band per OpenMP thread, each a single-threaded sgemm: the engine's threads do
       the work and OpenBLAS's pool stays idle (no second set of threads competing for cores). */
    const int local = scipy_openblas_set_num_threads_local != 0;
    const int previous = local ? 0 : gemm_blas_set_threads(1);
    #pragma omp parallel if (M * N * K >= 65536)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t width = ((N + threads - 1) / threads + 15) / 16 * 16;
        const int64_t n0 = t * width < N ? t * width : N, n1 = n0 + width < N ? n0 + width : N;
        if (n0 < n1) {
            const int mine = local ? gemm_blas_set_threads(1) : 0;
            gemm_blas_sgemm(M, n1 - n0, K, A, lda, B + n0, ldb, C + n0, ldc);
            if (local) gemm_blas_set_threads(mine);
        }
    }
    if (!local) gemm_blas_set_threads(previous);
#else
    const int previous = gemm_blas_set_threads(1);
    gemm_blas_sgemm(M, N, K, A, lda, B, ldb, C, ldc);
    gemm_blas_set_threads(previous);
#endif
}
#endif
"""


def blas_available() -> str | None:
    """``None`` when the BLAS candidate can be built and loaded here, else why not (with the fix)."""
    from engine_cpu import LibraryRegistry, LibraryUnavailableError

    try:
        LibraryRegistry().locate(GEMM_BLAS_LIBRARY, "the BLAS GEMM candidate")
    except LibraryUnavailableError as exc:
        return str(exc)
    return None
