/* tcoll's own memory copy: the same speed at every alignment of source and destination.
 *
 * Why not memcpy. glibc copies a block of more than about 2 KiB with `rep movsb`, and how fast the CPU
 * runs that depends on things tcoll does not choose: on AMD EPYC (Zen) it runs at 2-3 GB/s instead of
 * 20-35 when the destination sits just after the source modulo 4096 (a large NumPy array starts 16 bytes
 * into its page, malloc's header, while an arena slot starts on a page: every copy out of the arena hit
 * it), and a single `rep movsb` of 1 MiB or more entered a slower mode there too. So tcoll copies with
 * its own vector loop, and decides the direction itself:
 *
 * - The destination is aligned to the vector width first (one unaligned vector covers the head), so
 *   every store in the loop is aligned and no store splits a cache line.
 * - 4K aliasing. A load whose address equals an earlier, still buffered store's address in the low 12
 *   bits waits for that store on x86 cores (Intel documents it; Zen's `rep movsb` case above is the
 *   same shape). In a forward copy the loads run ahead of the stores, so a destination a little AFTER
 *   the source modulo 4096 (0 < (dst - src) mod 4096 < TC_ALIAS_WINDOW) makes loads alias the stores
 *   still buffered just behind them. Copied backwards, the loads run ahead downwards, below every
 *   buffered store, and cannot alias them (glibc's vector loop draws the same line, at eight vectors).
 *   But a backward copy is not free: on the Xeon measured, copying backwards at distance 16 ran at 0.78x
 *   the forward speed, and forwards showed no aliasing cost at all. So the direction in that window is
 *   measured once, when the module loads (tc_copy_calibrate: the best of several 256 KiB copies each way),
 *   and kept: a CPU that pays for aliasing copies backwards there, one that does not, forwards.
 * - Non-temporal stores from TCOLL_NT_BYTES up: a copy that large leaves cache anyway, and streaming
 *   stores skip reading the destination's lines first (a third less memory traffic). Below it the
 *   copied data stays in cache, where the next step (another rank's read, a reduction) finds it.
 *
 * benchmarks/copy_offsets.py measures it at every page offset, both directions; docs/performance.md has
 * the table. Buffers may not overlap (the arena never copies a buffer onto itself).
 */

#ifndef TCOLL_NATIVE_COPY_H
#define TCOLL_NATIVE_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define TC_COPY_SMALL 256           /* below this, memcpy: a few vector moves, never rep movsb */
#ifndef TC_ALIAS_WINDOW  /* (defined before the include only to measure the alternatives) */
#define TC_ALIAS_WINDOW 256         /* 0 < (dst - src) mod 4096 < this: copy backwards (see above) */
#endif
#ifndef TC_NT_BYTES
#define TC_NT_BYTES (16u << 20)     /* from this size on, non-temporal stores (measured, docs/performance.md) */
#endif

static int tc_backwards = 1;  /* copy backwards in the aliasing window (tc_copy_calibrate decides) */

#if defined(__x86_64__)

/* The loop over [lo, hi) in steps of four aligned vectors, upwards or downwards, storing with PUT. */
#define TC_LOOP_FORWARD(W, VEC, PUT)                                                                       \
    for (size_t at = lo; at < hi; at += 4 * W) {                                                           \
        VEC a = LOAD_##W(src + at), b = LOAD_##W(src + at + W);                                            \
        VEC c = LOAD_##W(src + at + 2 * W), d = LOAD_##W(src + at + 3 * W);                                \
        PUT(dst + at, a); PUT(dst + at + W, b); PUT(dst + at + 2 * W, c); PUT(dst + at + 3 * W, d);        \
    }
#define TC_LOOP_BACK(W, VEC, PUT)                                                                          \
    for (size_t at = hi; at > lo; at -= 4 * W) {                                                           \
        VEC a = LOAD_##W(src + at - W), b = LOAD_##W(src + at - 2 * W);                                    \
        VEC c = LOAD_##W(src + at - 3 * W), d = LOAD_##W(src + at - 4 * W);                                \
        PUT(dst + at - W, a); PUT(dst + at - 2 * W, b); PUT(dst + at - 3 * W, c); PUT(dst + at - 4 * W, d);\
    }

/* One vector width's loop, forwards or backwards, with aligned (optionally streaming) stores. W is the
 * vector width in bytes (64, 32 or 16: it picks the intrinsics below); the head and tail are unaligned
 * vectors that may overlap the loop's first and last stores (the same bytes written twice, same values). */
#define TC_DEFINE_COPY(NAME, TARGET, VEC, W)                                                               \
    __attribute__((target(TARGET))) static void NAME(uint8_t *dst, const uint8_t *src, size_t n, int nt, int backwards) { \
        VEC head = LOAD_##W(src), tail = LOAD_##W(src + n - W);                                            \
        size_t lo = (size_t)(-(uintptr_t)dst) & (W - 1); /* bytes before dst's first aligned vector */    \
        size_t hi = lo + ((n - lo) & ~(size_t)(4 * W - 1));                                                \
        size_t ahead = ((uintptr_t)dst - (uintptr_t)src) % 4096;                                           \
        int back = backwards && ahead != 0 && ahead < TC_ALIAS_WINDOW;                                     \
        if (back && nt) TC_LOOP_BACK(W, VEC, STREAM_##W)                                                   \
        else if (back) TC_LOOP_BACK(W, VEC, STORE_##W)                                                     \
        else if (nt) TC_LOOP_FORWARD(W, VEC, STREAM_##W)                                                   \
        else TC_LOOP_FORWARD(W, VEC, STORE_##W)                                                            \
        if (nt) _mm_sfence(); /* streaming stores are weakly ordered: visible before the caller publishes */ \
        for (size_t at = hi; at + W <= n; at += W) /* fewer than 4 aligned vectors left */                \
            STORE_##W(dst + at, LOAD_##W(src + at));                                                       \
        STOREU_##W(dst, head);                                                                             \
        STOREU_##W(dst + n - W, tail);                                                                     \
    }

#define LOAD_64(p) _mm512_loadu_si512((const void *)(p))
#define STORE_64(p, v) _mm512_store_si512((void *)(p), v)
#define STREAM_64(p, v) _mm512_stream_si512((void *)(p), v)
#define STOREU_64(p, v) _mm512_storeu_si512((void *)(p), v)
#define LOAD_32(p) _mm256_loadu_si256((const __m256i *)(p))
#define STORE_32(p, v) _mm256_store_si256((__m256i *)(p), v)
#define STREAM_32(p, v) _mm256_stream_si256((__m256i *)(p), v)
#define STOREU_32(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define LOAD_16(p) _mm_loadu_si128((const __m128i *)(p))
#define STORE_16(p, v) _mm_store_si128((__m128i *)(p), v)
#define STREAM_16(p, v) _mm_stream_si128((__m128i *)(p), v)
#define STOREU_16(p, v) _mm_storeu_si128((__m128i *)(p), v)

TC_DEFINE_COPY(tc_copy_avx512, "avx512f", __m512i, 64)
TC_DEFINE_COPY(tc_copy_avx2, "avx2", __m256i, 32)
TC_DEFINE_COPY(tc_copy_sse2, "sse2", __m128i, 16)

typedef void (*tc_copy_loop)(uint8_t *, const uint8_t *, size_t, int, int);

/* The widest loop this CPU runs (asked once). On the Xeon measured, 64-byte vectors copied at the same
 * speed at every page offset (0.97 of the fastest at 1 MiB), where 32-byte ones dipped to 0.78 at four of
 * them: with one aligned store per cache line, no store and no line is split, whatever the source's
 * alignment. AVX2 where AVX-512 is missing, SSE2 below that. */
static tc_copy_loop tc_widest(void) {
    static tc_copy_loop chosen;
    if (chosen == NULL) {
        __builtin_cpu_init();
        chosen = __builtin_cpu_supports("avx512f") ? tc_copy_avx512
                 : __builtin_cpu_supports("avx2")  ? tc_copy_avx2 : tc_copy_sse2;
    }
    return chosen;
}

/* Decide, by timing, whether copies in the aliasing window go backwards: the best of 7 interleaved
 * 256 KiB copies each way at distance 16 (about 80 us in all) (a large array 16 bytes into its page, a slot on a page). The
 * best of several is what the CPU can do; a preempted copy only makes its own sample worse. Backwards
 * only when it wins by 5%: a tie goes forwards. Returns the two times in ns through the pointers. */
static inline void tc_copy_calibrate(double *forward_ns, double *backward_ns) {
    enum { N = 256 << 10, TRIES = 7 };
    uint8_t *block = (uint8_t *)aligned_alloc(4096, 2 * N + 8192);
    double best[2] = {1e30, 1e30};
    if (block != NULL) {
        memset(block, 1, 2 * N + 8192);
        uint8_t *src = block, *dst = block + N + 4096 + 16;
        for (int i = 0; i < 2 * TRIES; i++) {
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            tc_widest()(dst, src, N, 0, i % 2);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
            if (i >= 2 && ns < best[i % 2]) best[i % 2] = ns;  /* the first of each way warms the lines */
        }
        free(block);
    }
    tc_backwards = best[1] < 0.95 * best[0];
    *forward_ns = best[0];
    *backward_ns = best[1];
}

#endif /* __x86_64__ */

/* dst[0:n] = src[0:n] for buffers that do not overlap; `backwards` allows the backward loop in the
 * aliasing window (tc_copy passes what the calibration chose; tests and benchmarks force either). */
static inline void tc_copy_way(void *dst, const void *src, size_t n, int backwards) {
#if defined(__x86_64__)
    if (n >= TC_COPY_SMALL) {
        tc_widest()((uint8_t *)dst, (const uint8_t *)src, n, n >= TC_NT_BYTES, backwards);
        return;
    }
#endif
    (void)backwards;
    memcpy(dst, src, n);
}

/* dst[0:n] = src[0:n] for buffers that do not overlap, at the same speed at every alignment (see above). */
static inline void tc_copy(void *dst, const void *src, size_t n) {
    tc_copy_way(dst, src, n, tc_backwards);
}

#endif
