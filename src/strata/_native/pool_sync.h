/* Synchronisation helpers of the CPU pool (cpu_pool.pxi): acquire / release accesses to the
 * exchange buffer's sequence words (the GPU writes them over PCIe into mapped host memory), a
 * pause for spin loops, a monotonic clock and a short sleep. */
#pragma once
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* The device stores x/ids/wts, fences (__threadfence_system) and then the seq: reading the seq
 * with acquire semantics orders the reads of x/ids/wts after it. */
static inline int64_t st_load_acquire_i64(const int64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

/* y must be visible to the device before done[l]: a full fence (sfence on x86 orders
 * non-temporal stores too), then a release store. */
static inline void st_store_release_i64(int64_t *p, int64_t value) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(p, value, __ATOMIC_RELEASE);
}

static inline void st_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline int64_t st_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void st_sleep_ns(int64_t ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    nanosleep(&ts, NULL);
}
