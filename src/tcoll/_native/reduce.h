/* tcoll's reduction loops: out = lower op higher, elementwise, for every dtype and op the C kernels reduce.
 *
 * Kept apart from the data movement (copy.h) and the waiting (polling.h), as NCCL keeps its reduction
 * functors apart from its primitives: the arena kernel (shm/_arena_kernel.c) claims, publishes, waits and
 * copies, and calls combine() here for the arithmetic.
 *
 * Reductions follow NumPy's ufuncs exactly: built without -ffast-math (no reassociation, no contraction),
 * integers wrap, min/max propagate NaN as np.minimum/np.maximum do, and float16/bfloat16 compute each
 * operation in float32 and round back after every one. The loops are compiled for the widest vectors the
 * CPU has (target_clones); float16 and bfloat16 have explicit AVX2/F16C paths, chosen at run time.
 *
 * The including module includes <Python.h> first (with PY_SSIZE_T_CLEAN); the loops take its Py_ssize_t.
 */

#ifndef TCOLL_NATIVE_REDUCE_H
#define TCOLL_NATIVE_REDUCE_H

#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* dtype codes (tcoll.shm.kernel_abi.KERNEL_DTYPES) and op codes (KERNEL_OPS): the arena kernel exports them
 * (add_shared in shm/_arena_kernel.c) and tcoll.shm.arena compares them at import (check_kernel). */
enum { F32, F64, I8, I16, I32, I64, U8, U16, U32, U64, F16, BF16, NDTYPES };
enum { OP_SUM, OP_PROD, OP_MIN, OP_MAX, OP_BAND, OP_BOR, OP_BXOR, NOPS };

#define COMBINE_LOOP(T, EXPR)                                                   \
    do {                                                                        \
        T *o = (T *)out;                                                        \
        const T *a = (const T *)lower;                                          \
        const T *b = (const T *)higher;                                         \
        for (Py_ssize_t i = 0; i < n; i++) { T x = a[i], y = b[i]; o[i] = (EXPR); } \
    } while (0)

/* NumPy's np.minimum / np.maximum: a NaN first operand wins, then the comparison; on a tie the second
 * operand (so minimum(0.0, -0.0) is -0.0 and minimum(-0.0, 0.0) is 0.0, as NumPy gives). */
#define FMIN(x, y) (((x) < (y) || isnan(x)) ? (x) : (y))
#define FMAX(x, y) (((x) > (y) || isnan(x)) ? (x) : (y))

#define FLOAT_OPS(T)                                                            \
    switch (op) {                                                               \
    case OP_SUM: COMBINE_LOOP(T, x + y); return 1;                              \
    case OP_PROD: COMBINE_LOOP(T, x * y); return 1;                             \
    case OP_MIN: COMBINE_LOOP(T, FMIN(x, y)); return 1;                         \
    case OP_MAX: COMBINE_LOOP(T, FMAX(x, y)); return 1;                         \
    default: return 0;                                                          \
    }

/* Integers: sums and products in the unsigned type of the same width, so that they wrap as NumPy's do. */
#define INT_OPS(T, U)                                                           \
    switch (op) {                                                               \
    case OP_SUM: COMBINE_LOOP(T, (T)((U)x + (U)y)); return 1;                   \
    case OP_PROD: COMBINE_LOOP(T, (T)((U)x * (U)y)); return 1;                  \
    case OP_MIN: COMBINE_LOOP(T, x < y ? x : y); return 1;                      \
    case OP_MAX: COMBINE_LOOP(T, x > y ? x : y); return 1;                      \
    case OP_BAND: COMBINE_LOOP(T, x & y); return 1;                             \
    case OP_BOR: COMBINE_LOOP(T, x | y); return 1;                              \
    case OP_BXOR: COMBINE_LOOP(T, x ^ y); return 1;                             \
    default: return 0;                                                          \
    }

/* Compiled for the widest vectors the CPU has (chosen once, at load), where GCC's dispatch recognises the
 * CPU model: "arch=" clones are picked by model, so a CPU it does not name (the 2-core Xeon VM measured on
 * 2026-11-27) runs the default (SSE2) clone. No width won everywhere there (float32 sums of 4 KiB to 8 MiB,
 * one run: AVX-512 10% ahead of SSE2 at 16 KiB, 20% behind at 256 KiB): the loops are bound by memory. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDEST __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define WIDEST
#endif

/* Half precision, as NumPy (float16) and ml_dtypes (bfloat16) compute it: each operation in float32,
 * rounded back to nearest-even after every operation (so a sum over ranks rounds after each rank). */
static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40u;  /* a NaN stays a NaN, quiet, its sign kept */
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet : rounded);  /* branch-free: it vectorises */
}

/* LT and GT: how minimum and maximum compare; on a tie NumPy's float16 keeps the first operand (<=, >=),
 * ml_dtypes' bfloat16 the second (<, >), as float32 does. */
#define HALF_OPS(T, TO_F, FROM_F, LT, GT)                                       \
    switch (op) {                                                               \
    case OP_SUM: COMBINE_LOOP(T, FROM_F(TO_F(x) + TO_F(y))); return 1;          \
    case OP_PROD: COMBINE_LOOP(T, FROM_F(TO_F(x) * TO_F(y))); return 1;         \
    case OP_MIN: COMBINE_LOOP(T, (TO_F(x) LT TO_F(y) || isnan(TO_F(x))) ? x : y); return 1; \
    case OP_MAX: COMBINE_LOOP(T, (TO_F(x) GT TO_F(y) || isnan(TO_F(x))) ? x : y); return 1; \
    default: return 0;                                                          \
    }

/* IEEE half <-> float, exact, rounding to nearest-even (F. Giesen's branch-light conversions). */
static inline float f16_to_float(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t exp = shifted_exp & o;
    float f;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == shifted_exp) {
        o += (uint32_t)(128 - 16) << 23;  /* Inf, NaN */
    } else if (exp == 0) {                /* zero, subnormal: renormalise through a float subtraction */
        const uint32_t magic_bits = 113u << 23;
        float magic;
        memcpy(&magic, &magic_bits, sizeof magic);
        o += 1u << 23;
        memcpy(&f, &o, sizeof f);
        f -= magic;
        memcpy(&o, &f, sizeof o);
    }
    o |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &o, sizeof f);
    return f;
}

static inline uint16_t float_to_f16(float value) {
    const uint32_t f32_infinity = 255u << 23, f16_max = (127u + 16u) << 23;
    const uint32_t denorm_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    float denorm_magic;
    memcpy(&denorm_magic, &denorm_bits, sizeof denorm_magic);
    uint32_t f;
    memcpy(&f, &value, sizeof f);
    uint32_t sign = f & 0x80000000u;
    uint16_t o;
    f ^= sign;
    if (f >= f16_max) {
        o = f > f32_infinity ? 0x7e00 : 0x7c00;  /* NaN (quiet), Inf */
    } else if (f < (113u << 23)) {               /* a subnormal half, or zero: rounded by a float addition */
        float t;
        memcpy(&t, &f, sizeof t);
        t += denorm_magic;
        uint32_t bits;
        memcpy(&bits, &t, sizeof bits);
        o = (uint16_t)(bits - denorm_bits);
    } else {
        uint32_t mant_odd = (f >> 13) & 1u;
        f += ((uint32_t)(15 - 127) << 23) + 0xfffu;
        f += mant_odd;
        o = (uint16_t)(f >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_F16C_PATH 1
/* op on eight floats; min and max keep x on a tie if tie_first (float16), else y (bfloat16), x if it is NaN. */
__attribute__((target("avx2")))
static inline __m256 op8(int op, __m256 x, __m256 y, int tie_first) {
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    switch (op) {
    case OP_SUM: return _mm256_add_ps(x, y);
    case OP_PROD: return _mm256_mul_ps(x, y);
    case OP_MIN:
        return _mm256_blendv_ps(y, x, _mm256_or_ps(tie_first ? _mm256_cmp_ps(x, y, _CMP_LE_OQ)
                                                             : _mm256_cmp_ps(x, y, _CMP_LT_OQ), nan));
    default:
        return _mm256_blendv_ps(y, x, _mm256_or_ps(tie_first ? _mm256_cmp_ps(x, y, _CMP_GE_OQ)
                                                             : _mm256_cmp_ps(x, y, _CMP_GT_OQ), nan));
    }
}

/* The last items of a vector loop over half-precision words, one at a time (as op8 would). */
static inline void half_tail(int op, uint16_t *out, const uint16_t *a, const uint16_t *b, Py_ssize_t i,
                             Py_ssize_t n, float (*to_f)(uint16_t), uint16_t (*from_f)(float), int tie_first) {
    for (; i < n; i++) {
        float x = to_f(a[i]), y = to_f(b[i]);
        switch (op) {
        case OP_SUM: out[i] = from_f(x + y); break;
        case OP_PROD: out[i] = from_f(x * y); break;
        case OP_MIN: out[i] = ((tie_first ? x <= y : x < y) || isnan(x)) ? a[i] : b[i]; break;
        default: out[i] = ((tie_first ? x >= y : x > y) || isnan(x)) ? a[i] : b[i]; break;
        }
    }
}

/* float16 eight at a time with the F16C conversions (exact, nearest-even), where the CPU has them. */
__attribute__((target("avx2,f16c")))
static int combine_f16_f16c(int op, uint16_t *out, const uint16_t *a, const uint16_t *b, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        __m256 r = op8(op, x, y, 1);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
    }
    half_tail(op, out, a, b, i, n, f16_to_float, float_to_f16, 1);
    return 1;
}

/* bfloat16 eight at a time with AVX2: widen to float, operate, round back to nearest-even (NaN kept quiet). */
__attribute__((target("avx2")))
static int combine_bf16_avx2(int op, uint16_t *out, const uint16_t *a, const uint16_t *b, Py_ssize_t n) {
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), quiet_bit = _mm256_set1_epi32(0x40);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + i))), 16));
        __m256 y = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i))), 16));
        __m256 r = op8(op, x, y, 0);
        __m256i u = _mm256_castps_si256(r);
        __m256i high = _mm256_srli_epi32(u, 16);
        __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias),
                                                             _mm256_and_si256(high, one)), 16);
        __m256i quiet = _mm256_or_si256(high, quiet_bit);
        __m256i words = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                                             _mm256_castsi256_ps(quiet),
                                                             _mm256_cmp_ps(r, r, _CMP_UNORD_Q)));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(words, words), 0x08);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_castsi256_si128(packed));
    }
    half_tail(op, out, a, b, i, n, bf16_to_float, float_to_bf16, 0);
    return 1;
}
#endif

/* out = lower op higher, elementwise over n items (out may alias lower). */
static int has_f16c = -1;  /* whether this CPU has F16C (asked once) */

WIDEST static int combine(int dtype, int op, void *out, const void *lower, const void *higher, Py_ssize_t n) {
#ifdef HAVE_F16C_PATH
    if ((dtype == F16 || dtype == BF16) && op <= OP_MAX) {
        if (has_f16c < 0) has_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
        if (has_f16c)
            return dtype == F16 ? combine_f16_f16c(op, out, lower, higher, n)
                                : combine_bf16_avx2(op, out, lower, higher, n);
    }
#endif
    switch (dtype) {
    case F32: FLOAT_OPS(float)
    case F64: FLOAT_OPS(double)
    case I8: INT_OPS(int8_t, uint8_t)
    case I16: INT_OPS(int16_t, uint16_t)
    case I32: INT_OPS(int32_t, uint32_t)
    case I64: INT_OPS(int64_t, uint64_t)
    case U8: INT_OPS(uint8_t, uint8_t)
    case U16: INT_OPS(uint16_t, uint16_t)
    case U32: INT_OPS(uint32_t, uint32_t)
    case U64: INT_OPS(uint64_t, uint64_t)
    case F16: HALF_OPS(uint16_t, f16_to_float, float_to_f16, <=, >=)
    case BF16: HALF_OPS(uint16_t, bf16_to_float, float_to_bf16, <, >)
    default: return 0;
    }
}

static const Py_ssize_t ITEMSIZE[NDTYPES] = {4, 8, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2};  /* bytes per item, by dtype */

#endif /* TCOLL_NATIVE_REDUCE_H */
