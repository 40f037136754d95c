/* What tcoll's C kernels share: polling a word with a bounded spin, and ringing a peer's doorbell.
 *
 * A doorbell (tcoll.p2p.waiting.Doorbell) is 8 bytes that several processes map: a uint32 sequence that
 * wakers bump, then a uint32 count of the owner's sleeping threads. A waker publishes its data, fences,
 * and pays for a system call only when somebody sleeps.
 */

#ifndef TCOLL_NATIVE_POLLING_H
#define TCOLL_NATIVE_POLLING_H

#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Wake the owner of `bell` if it sleeps: FUTEX_WAKE_OP bumps the sequence and wakes, as Doorbell.wake.
 * The caller has fenced after publishing, so a sleeper that announced itself is seen here. */
static inline void ring_doorbell(uint32_t *bell) {
    const int op = (FUTEX_OP_ADD << 28) | (FUTEX_OP_CMP_EQ << 24) | (1 << 12);
    if (__atomic_load_n(&bell[1], __ATOMIC_ACQUIRE))
        syscall(SYS_futex, bell, FUTEX_WAKE_OP, INT_MAX, (void *)(intptr_t)INT_MAX, bell, op);
}

#endif
