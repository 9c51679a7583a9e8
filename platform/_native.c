/* kvfabric native helpers: batched memcpy and the atomics / fences Python lacks.
 *
 * Built on first use through cffi (see native.py). Every function is reentrant; cffi
 * releases the GIL around each call, so copies run in parallel with Python threads.
 * The atomics use the GCC/Clang __atomic builtins, which emit the barriers that ARM
 * hosts (weaker memory order than x86) need.
 */
#include <stdint.h>
#include <string.h>

void kvf_memcpy_batch(const uint64_t *dst, const uint64_t *src, const uint64_t *n, uint64_t k)
{
    for (uint64_t i = 0; i < k; i++)
        memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)n[i]);
}

/* Gather k pieces into one contiguous destination; returns bytes written. */
uint64_t kvf_gather(uint64_t dst, const uint64_t *src, const uint64_t *n, uint64_t k)
{
    uint64_t off = 0;
    for (uint64_t i = 0; i < k; i++) {
        memcpy((void *)(uintptr_t)(dst + off), (const void *)(uintptr_t)src[i], (size_t)n[i]);
        off += n[i];
    }
    return off;
}

/* Scatter one contiguous source into k pieces; returns bytes read. */
uint64_t kvf_scatter(const uint64_t *dst, uint64_t src, const uint64_t *n, uint64_t k)
{
    uint64_t off = 0;
    for (uint64_t i = 0; i < k; i++) {
        memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)(src + off), (size_t)n[i]);
        off += n[i];
    }
    return off;
}

uint64_t kvf_load_acquire_u64(uint64_t addr)
{
    return __atomic_load_n((uint64_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE);
}

void kvf_store_release_u64(uint64_t addr, uint64_t value)
{
    __atomic_store_n((uint64_t *)(uintptr_t)addr, value, __ATOMIC_RELEASE);
}

uint64_t kvf_fetch_add_u64(uint64_t addr, uint64_t delta)
{
    return __atomic_fetch_add((uint64_t *)(uintptr_t)addr, delta, __ATOMIC_ACQ_REL);
}

int kvf_cas_u64(uint64_t addr, uint64_t expected, uint64_t desired)
{
    return __atomic_compare_exchange_n((uint64_t *)(uintptr_t)addr, &expected, desired, 0,
                                       __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

void kvf_fence_acquire(void) { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
void kvf_fence_release(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
void kvf_fence_seq_cst(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
