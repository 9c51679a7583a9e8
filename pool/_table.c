/* kvfabric pool directory table: lock-free readers for the meta service's shared table.
 *
 * Layout (see table.py): a 128-byte header, nslots 64-byte slots (open addressing, linear
 * probing), then a key arena. One writer (the meta service) updates a slot under its
 * sequence counter (odd while writing) and moves slots (backward-shift delete, arena
 * compaction) under the header's struct_seq; readers in any process retry when either
 * changed under them. Acquire loads / fences come from the __atomic builtins, which give
 * the ordering ARM hosts need.
 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Readers back off while a writer is inside a write section: spin, then yield, then
 * sleep; a lookup gives up (-2) only after about two seconds of continuous writing,
 * which means the service stalled mid-write (a stopped process), not a race. */
static int backoff(int attempt, struct timespec *start)
{
    if (attempt < 64) return 1;
    if (attempt < 256) { sched_yield(); return 1; }
    struct timespec now, pause = {0, 50000};
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (attempt == 256) { *start = now; }
    else if ((now.tv_sec - start->tv_sec) * 1000000000L + (now.tv_nsec - start->tv_nsec) > 2000000000L)
        return 0;
    nanosleep(&pause, NULL);
    return 1;
}

typedef struct {
    uint64_t magic, layout, nslots, struct_seq, count, arena_size, arena_used, epoch;
    uint64_t retired;
    uint64_t local_keys, local_hits, local_hit_bytes, local_corrupt; /* on-node reads (clients) */
    uint64_t reserved[3];
} kvf_hdr;

typedef struct {
    uint64_t seq, hash, gva, size, gen, csum;
    uint32_t key_off, atime, expire;
    uint16_t key_len;
    uint8_t state, pad;
} kvf_slot;

#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define KVF_OUT 7 /* fields a lookup reports per key */

uint64_t kvf_key_hash(const uint8_t *key, uint64_t len)
{
    uint64_t h = 0xcbf29ce484222325ULL;            /* FNV-1a 64 ... */
    for (uint64_t i = 0; i < len; i++) { h ^= key[i]; h *= 0x100000001b3ULL; }
    h ^= h >> 30; h *= 0xbf58476d1ce4e5b9ULL;        /* ... with a splitmix64 finish */
    h ^= h >> 27; h *= 0x94d049bb133111ebULL;
    h ^= h >> 31;
    return h ? h : 1;                                /* 0 marks an empty slot */
}

/* Find `key` (hash h). out[0..6] = seq, gva, size, gen, state, expire, csum of the slot.
 * Returns the slot index, -1 when absent, -2 when writers kept it busy too long. */
int64_t kvf_tbl_lookup(uint64_t base, uint64_t h, const uint8_t *key, uint32_t klen, uint64_t *out)
{
    kvf_hdr *hdr = (kvf_hdr *)(uintptr_t)base;
    kvf_slot *slots = (kvf_slot *)(uintptr_t)(base + sizeof(kvf_hdr));
    uint64_t nslots = hdr->nslots;
    const uint8_t *arena = (const uint8_t *)(slots + nslots);
    if (LOAD_ACQ(&hdr->retired)) return -3;              /* retired: the service restarted */
    struct timespec start = {0, 0};
    for (int attempt = 0; backoff(attempt, &start); attempt++) {
        uint64_t g1 = LOAD_ACQ(&hdr->struct_seq);
        if (g1 & 1) continue;
        uint64_t asize = hdr->arena_size;
        int64_t found = -1;
        int busy = 0;
        uint64_t i = h % nslots;
        for (uint64_t probe = 0; probe < nslots; probe++, i = (i + 1 == nslots) ? 0 : i + 1) {
            kvf_slot *s = &slots[i];
            uint64_t s1 = LOAD_ACQ(&s->seq);
            if (s1 & 1) { busy = 1; break; }
            uint64_t sh = s->hash;
            if (sh == 0) break;
            if (sh != h || s->key_len != klen) continue;
            uint64_t off = s->key_off;
            if (off > asize || klen > asize - off) continue;   /* torn read: re-checked below */
            int same = memcmp(arena + off, key, klen) == 0;
            uint64_t gva = s->gva, size = s->size, gen = s->gen;
            uint64_t state = s->state, expire = s->expire, csum = s->csum;
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(&s->seq, __ATOMIC_RELAXED) != s1) { busy = 1; break; }
            if (!same) continue;
            out[0] = s1; out[1] = gva; out[2] = size; out[3] = gen; out[4] = state; out[5] = expire;
            out[6] = csum;
            found = (int64_t)i;
            break;
        }
        if (busy) continue;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&hdr->struct_seq, __ATOMIC_RELAXED) != g1) continue;
        return found;
    }
    return -2;
}

/* Batched lookup: keys packed in `keys` at offs[k]..offs[k]+lens[k]; results into
 * idx[k] (slot, -1, -2) and out[7k..7k+6]; hashes computed here. Returns hits. */
uint64_t kvf_tbl_lookup_batch(uint64_t base, const uint8_t *keys, const uint64_t *offs,
                              const uint32_t *lens, uint64_t n, int64_t *idx, uint64_t *out)
{
    uint64_t hits = 0;
    for (uint64_t k = 0; k < n; k++) {
        const uint8_t *key = keys + offs[k];
        idx[k] = kvf_tbl_lookup(base, kvf_key_hash(key, lens[k]), key, lens[k], out + KVF_OUT * k);
        hits += idx[k] >= 0;
    }
    return hits;
}

/* The slot's sequence counter now (acquire), for the after-copy re-check. */
uint64_t kvf_tbl_seq(uint64_t base, int64_t i)
{
    kvf_hdr *hdr = (kvf_hdr *)(uintptr_t)base;
    kvf_slot *slots = (kvf_slot *)(uintptr_t)(base + sizeof(kvf_hdr));
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (LOAD_ACQ(&hdr->retired)) return ~0ULL;          /* retired: nothing read from it counts */
    return (uint64_t)i < hdr->nslots ? LOAD_ACQ(&slots[i].seq) : ~0ULL;
}

/* A reader marks recency (relaxed: a hint, outside the seqlock). */
void kvf_tbl_touch(uint64_t base, int64_t i, uint32_t now)
{
    kvf_hdr *hdr = (kvf_hdr *)(uintptr_t)base;
    kvf_slot *slots = (kvf_slot *)(uintptr_t)(base + sizeof(kvf_hdr));
    if ((uint64_t)i < hdr->nslots) __atomic_store_n(&slots[i].atime, now, __ATOMIC_RELAXED);
}

/* Writer side: open / close a slot's or the table's write section. */
void kvf_seq_begin(uint64_t addr) { __atomic_fetch_add((uint64_t *)(uintptr_t)addr, 1, __ATOMIC_ACQ_REL);
                                    __atomic_thread_fence(__ATOMIC_RELEASE); }
void kvf_seq_end(uint64_t addr) { __atomic_fetch_add((uint64_t *)(uintptr_t)addr, 1, __ATOMIC_RELEASE); }

/* Hash many keys packed like kvf_tbl_lookup_batch's input. */
void kvf_key_hash_batch(const uint8_t *keys, const uint64_t *offs, const uint32_t *lens, uint64_t n,
                        uint64_t *out)
{
    for (uint64_t k = 0; k < n; k++) out[k] = kvf_key_hash(keys + offs[k], lens[k]);
}

/* Sequence counters of many slots (acquire), for the after-copy re-check of a batch. */
void kvf_tbl_seq_batch(uint64_t base, const int64_t *idx, uint64_t n, uint64_t *out)
{
    for (uint64_t k = 0; k < n; k++) out[k] = kvf_tbl_seq(base, idx[k]);
}

/* One read call's outcome added to the header's on-node read counters (any process). */
void kvf_tbl_count_reads(uint64_t base, uint64_t keys, uint64_t hits, uint64_t bytes, uint64_t corrupt)
{
    kvf_hdr *hdr = (kvf_hdr *)(uintptr_t)base;
    __atomic_fetch_add(&hdr->local_keys, keys, __ATOMIC_RELAXED);
    if (hits) __atomic_fetch_add(&hdr->local_hits, hits, __ATOMIC_RELAXED);
    if (bytes) __atomic_fetch_add(&hdr->local_hit_bytes, bytes, __ATOMIC_RELAXED);
    if (corrupt) __atomic_fetch_add(&hdr->local_corrupt, corrupt, __ATOMIC_RELAXED);
}

void kvf_tbl_touch_batch(uint64_t base, const int64_t *idx, uint64_t n, uint32_t now)
{
    for (uint64_t k = 0; k < n; k++) if (idx[k] >= 0) kvf_tbl_touch(base, idx[k], now);
}

/* Writer side, in C because it is the service's hot path. Single writer by contract. */

/* Insert a new key (the caller checked it is absent and that there is room): copy the
 * key into the arena, take the first empty slot from the key's home slot, and publish
 * the slot under its sequence counter. Returns the slot, or -1 if the arena is full. */
int64_t kvf_tbl_insert(uint64_t base, uint64_t h, const uint8_t *key, uint32_t klen, uint64_t gva,
                       uint64_t size, uint64_t gen, uint32_t state, uint32_t now, uint32_t expire)
{
    kvf_hdr *hdr = (kvf_hdr *)(uintptr_t)base;
    kvf_slot *slots = (kvf_slot *)(uintptr_t)(base + sizeof(kvf_hdr));
    uint64_t nslots = hdr->nslots;
    uint8_t *arena = (uint8_t *)(slots + nslots);
    if (hdr->arena_used + klen > hdr->arena_size) return -1;
    uint64_t off = hdr->arena_used;
    memcpy(arena + off, key, klen);
    hdr->arena_used = off + klen;
    uint64_t i = h % nslots;
    while (slots[i].hash != 0) i = (i + 1 == nslots) ? 0 : i + 1;
    kvf_slot *s = &slots[i];
    kvf_seq_begin((uint64_t)(uintptr_t)&s->seq);
    s->hash = h; s->gva = gva; s->size = size; s->gen = gen; s->csum = 0;
    s->key_off = (uint32_t)off; s->key_len = (uint16_t)klen;
    s->atime = now; s->expire = expire; s->state = (uint8_t)state;
    kvf_seq_end((uint64_t)(uintptr_t)&s->seq);
    hdr->count += 1;
    return (int64_t)i;
}

/* Change a slot's state, recency, expiry and checksum under its sequence counter. */
void kvf_tbl_set_state(uint64_t base, int64_t i, uint32_t state, uint32_t now, uint32_t expire,
                       uint64_t csum)
{
    kvf_slot *s = (kvf_slot *)(uintptr_t)(base + sizeof(kvf_hdr)) + i;
    kvf_seq_begin((uint64_t)(uintptr_t)&s->seq);
    s->state = (uint8_t)state; s->atime = now; s->expire = expire; s->csum = csum;
    kvf_seq_end((uint64_t)(uintptr_t)&s->seq);
}
