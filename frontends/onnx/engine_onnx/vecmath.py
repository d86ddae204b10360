"""float32 math that a compiler can vectorise, for the kernels that need it in a loop.

The C library's ``expf``/``erff`` are scalar calls, so a loop that calls them runs one element at a
time. These are branch-free inline functions (selects, not jumps; integer tricks for powers of two)
that GCC vectorises for whichever vector width the function is compiled for. ``math_preamble(body)``
gives the definitions a kernel body uses, with ``NO_TRAPS`` first.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["NO_TRAPS", "ERF_F32", "EXP_F32", "SUM_F32", "math_preamble"]

#: GCC turns a ``?:`` whose value feeds more arithmetic (a Relu, Clip or Where in the middle of a
#: group) into a branch, which cannot be vectorised and mispredicts on signed data, unless it may
#: assume that floating-point comparisons do not trap. Nothing here reads the floating-point
#: exception flags, and results are unchanged: no reassociation, NaN and signed zeros kept.
NO_TRAPS = '#if defined(__GNUC__) && !defined(__clang__)\n#pragma GCC optimize("no-trapping-math")\n#endif\n'


# erf in float32 without a branch or a library call, so that a loop computing it vectorises (the C
# library's erff is scalar): |x| < 0.92: x * P(x^2); 0.92 <= |x| < 2 and 2 <= |x| < 3.92: 1 - Q(u)
# with u the position in the interval scaled to [-1, 1]; beyond, 1. Chebyshev fits of erf(x)/x and
# erfc(x) (degrees 6, 10, 10); evaluated in float32 within 1.4e-7 of erf everywhere (about two
# units in the last place near 1; frontends/onnx/tests/test_onnx_fusion.py checks it on a dense
# grid). NaN stays NaN (it fails every comparison and falls to the first polynomial).
_ERF_SMALL = (1.128379225730896, -0.37612634897232056, 0.11283702403306961, -0.026859745383262634,
              0.005201837979257107, -0.0008151342626661062, 8.40485081425868e-05)
_ERFC_MID = (1.46, 0.54, (0.0389464907348156, -0.07229473441839218, 0.05699717253446579, -0.022930730134248734,
                          0.0034991567954421043, 0.0009028537897393107, -0.0005093258805572987,
                          5.120756395626813e-05, 2.1678528355550952e-05, -5.865365892532282e-06,
                          -1.6529268975773448e-07))
_ERFC_HIGH = (2.96, 0.96, (2.8382704840623774e-05, -0.00016960092762019485, 0.00048211286775767803,
                           -0.0008626913768239319, 0.0010758958524093032, -0.0009761981200426817,
                           0.00066648970823735, -0.0003454822872299701, 0.00010334001126466319,
                           1.511374648544006e-05, -1.733851786411833e-05))


def _horner(coefs: Sequence[float], var: str) -> str:
    text = f"{coefs[-1]!r}f"
    for c in coefs[-2::-1]:
        text = f"({c!r}f + {var} * {text})"
    return text


ERF_F32 = f"""static inline float eng_erff(float x) {{
    const float t = __builtin_fabsf(x), s = t * t;
    const float small = t * {_horner(_ERF_SMALL, "s")};
    const float u1 = (t - {_ERFC_MID[0]!r}f) * {1 / _ERFC_MID[1]!r}f;
    const float mid = 1.0f - {_horner(_ERFC_MID[2], "u1")};
    const float u2 = (t - {_ERFC_HIGH[0]!r}f) * {1 / _ERFC_HIGH[1]!r}f;
    const float high = 1.0f - {_horner(_ERFC_HIGH[2], "u2")};
    const float r = t >= 3.92f ? 1.0f : (t >= 2.0f ? high : (t >= 0.92f ? mid : small));
    return __builtin_copysignf(r, x);
}}
"""


# exp in float32: x = n*ln2 + r with |r| <= ln2/2 (n rounded with the 1.5*2^23 trick, which needs no
# floor instruction), e^r by Cephes' expf polynomial, then 2^n applied as two exact powers of two so
# that every n from -150 to 128 gives a normal scale: overflow becomes inf and underflow rounds
# gradually to 0 as in the C library. Within one unit in the last place of exp over the normal range
# (frontends/onnx/tests/test_onnx_fusion.py checks a dense grid and the edges); NaN stays NaN, -inf
# gives 0.
EXP_F32 = """static inline float eng_pow2i(int32_t n) {
    const int32_t bits = (n + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline float eng_expf(float x) {
    const float c = x < 88.8f ? (x > -104.0f ? x : -104.0f) : 88.8f;
    const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
    const float p = ((((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r
                        + 4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * r * r + r) + 1.0f;
    const int32_t ni = (int32_t)n, half = ni >> 1;
    const float y = p * eng_pow2i(half) * eng_pow2i(ni - half);
    return x != x ? x : y;
}
"""


# Reductions of a contiguous row in eight lanes (a left-to-right float sum cannot be vectorised
# without reassociating it; this is the reassociation, written out, so results do not depend on
# flags): ``eng_sumf`` of the values, ``eng_maxf`` their maximum (a NaN is skipped, as the
# branch-free ``m = v > m ? v : m`` everywhere here), ``eng_sqdevf`` their squared distances from ``c``.
SUM_F32 = """static inline float eng_sumf(const float *x, int64_t n) {
    float lane[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) lane[k] += x[j + k];
    float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; j < n; j++) s += x[j];
    return s;
}
static inline float eng_maxf(const float *x, int64_t n) {
    float lane[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) lane[k] = x[j + k] > lane[k] ? x[j + k] : lane[k];
    float m = -INFINITY;
    for (int k = 0; k < 8; k++) m = lane[k] > m ? lane[k] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}
static inline float eng_sqdevf(const float *x, int64_t n, float c) {
    float lane[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) { const float d = x[j + k] - c; lane[k] += d * d; }
    float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; j < n; j++) { const float d = x[j] - c; s += d * d; }
    return s;
}
"""


def math_preamble(body: str) -> str:
    """``NO_TRAPS`` and the definitions of the functions ``body`` calls."""
    return (NO_TRAPS + (ERF_F32 if "eng_erff(" in body else "") + (EXP_F32 if "eng_expf(" in body else "")
            + (SUM_F32 if any(f in body for f in ("eng_sumf(", "eng_maxf(", "eng_sqdevf(")) else ""))
