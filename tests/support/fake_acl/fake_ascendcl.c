/* A host-memory stand-in for CANN's libascendcl.so, for tests on machines without an NPU.
 *
 * It exports the ACL runtime functions kvfabric's Ascend backend binds (same names, same C
 * signatures as acl/acl_rt.h), so AclRuntime is exercised through real cffi ABI calls.
 * "Device" memory is a file in $KVFABRIC_SHM_DIR (or /dev/shm) mapped shared, so IPC
 * export keys work across processes. Copies run when they are submitted; each copy's
 * kind, and each batch attribute's memory locations, are checked against where the
 * pointers really live, and a mismatch returns ACL_ERROR_INVALID_PARAM like the runtime.
 * It is stateful and thread-safe, and it is test code only.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define OK 0
#define INVALID 100000
#define BAD_ALLOC 200000
#define MAX_ENTRIES 4096

typedef struct { uint32_t id; int type; } aclrtMemLocation;
typedef struct { aclrtMemLocation dstLoc; aclrtMemLocation srcLoc; uint8_t rsv[16]; } aclrtMemcpyBatchAttr;

enum kind { FREE_SLOT = 0, DEV, IMPORTED, PINNED, REGISTERED };
typedef struct { int kind; uintptr_t base; size_t size; char name[96]; } entry;

static entry table[MAX_ENTRIES];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long counter;
static int current_device = -1;

static const char *shm_dir(void) {
    const char *d = getenv("KVFABRIC_SHM_DIR");
    return (d && *d) ? d : "/dev/shm";
}

static entry *add(int kind, uintptr_t base, size_t size, const char *name) {
    for (int i = 0; i < MAX_ENTRIES; i++) {
        if (table[i].kind == FREE_SLOT) {
            table[i].kind = kind; table[i].base = base; table[i].size = size;
            snprintf(table[i].name, sizeof table[i].name, "%s", name ? name : "");
            return &table[i];
        }
    }
    return NULL;
}

static entry *find_base(uintptr_t base, int kind) {
    for (int i = 0; i < MAX_ENTRIES; i++)
        if (table[i].kind == kind && table[i].base == base) return &table[i];
    return NULL;
}

static int is_device(uintptr_t p, size_t n) {
    for (int i = 0; i < MAX_ENTRIES; i++)
        if ((table[i].kind == DEV || table[i].kind == IMPORTED) && table[i].base <= p &&
            p + n <= table[i].base + table[i].size) return 1;
    return 0;
}

int aclInit(const char *configPath) { (void)configPath; return OK; }
int aclrtSetDevice(int32_t id) { if (id != 0) return INVALID; current_device = id; return OK; }
int aclrtGetDeviceCount(uint32_t *count) { *count = 1; return OK; }
const char *aclrtGetSocName(void) { return "FakeAscend910B"; }

int aclrtGetMemInfo(int attr, size_t *free_, size_t *total) {
    (void)attr;
    size_t used = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_ENTRIES; i++) if (table[i].kind == DEV) used += table[i].size;
    pthread_mutex_unlock(&mu);
    *total = (size_t)64 << 30;
    *free_ = *total - used;
    return OK;
}

static void *map_file(const char *path, size_t size, int create) {
    int fd = open(path, create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
    if (fd < 0) return NULL;
    if (create && ftruncate(fd, (off_t)size) != 0) { close(fd); unlink(path); return NULL; }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return p == MAP_FAILED ? NULL : p;
}

int aclrtMalloc(void **devPtr, size_t size, int policy) {
    (void)policy;
    if (current_device < 0) return INVALID;  /* like ACL: set a device first */
    if (size == 0) return INVALID;
    char name[96], path[512];
    pthread_mutex_lock(&mu);
    snprintf(name, sizeof name, "kvfacl.%d.%lu", (int)getpid(), counter++);
    snprintf(path, sizeof path, "%s/%s", shm_dir(), name);
    void *p = map_file(path, size, 1);
    if (!p || !add(DEV, (uintptr_t)p, size, name)) { pthread_mutex_unlock(&mu); return BAD_ALLOC; }
    pthread_mutex_unlock(&mu);
    *devPtr = p;
    return OK;
}

int aclrtFree(void *devPtr) {
    char path[512];
    pthread_mutex_lock(&mu);
    entry *e = find_base((uintptr_t)devPtr, DEV);
    if (!e) { pthread_mutex_unlock(&mu); return INVALID; }
    munmap(devPtr, e->size);
    snprintf(path, sizeof path, "%s/%s", shm_dir(), e->name);
    unlink(path);
    e->kind = FREE_SLOT;
    pthread_mutex_unlock(&mu);
    return OK;
}

int aclrtMallocHost(void **hostPtr, size_t size) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return BAD_ALLOC;
    pthread_mutex_lock(&mu);
    add(PINNED, (uintptr_t)p, size, NULL);
    pthread_mutex_unlock(&mu);
    *hostPtr = p;
    return OK;
}

int aclrtFreeHost(void *hostPtr) {
    pthread_mutex_lock(&mu);
    entry *e = find_base((uintptr_t)hostPtr, PINNED);
    if (!e) { pthread_mutex_unlock(&mu); return INVALID; }
    munmap(hostPtr, e->size);
    e->kind = FREE_SLOT;
    pthread_mutex_unlock(&mu);
    return OK;
}

int aclrtHostRegister(void *ptr, uint64_t size, int type, void **devPtr) {
    (void)type;
    pthread_mutex_lock(&mu);
    if (find_base((uintptr_t)ptr, REGISTERED)) { pthread_mutex_unlock(&mu); return INVALID; }
    add(REGISTERED, (uintptr_t)ptr, (size_t)size, NULL);
    pthread_mutex_unlock(&mu);
    *devPtr = ptr;
    return OK;
}

int aclrtHostUnregister(void *ptr) {
    pthread_mutex_lock(&mu);
    entry *e = find_base((uintptr_t)ptr, REGISTERED);
    if (!e) { pthread_mutex_unlock(&mu); return INVALID; }
    e->kind = FREE_SLOT;
    pthread_mutex_unlock(&mu);
    return OK;
}

static int copy_checked(void *dst, size_t destMax, const void *src, size_t count, int kind) {
    if (count > destMax || kind < 0 || kind > 3) return INVALID;
    pthread_mutex_lock(&mu);
    int src_dev = is_device((uintptr_t)src, count), dst_dev = is_device((uintptr_t)dst, count);
    pthread_mutex_unlock(&mu);
    if (src_dev != (kind >= 2) || dst_dev != (kind % 2)) return INVALID;
    memmove(dst, src, count);
    return OK;
}

typedef struct { int live; int error; } fake_stream;
typedef struct { int recorded; } fake_event;
static int fail_copies;

/* Test hook (not part of ACL): the next n async copies fail; the error surfaces at the
 * stream's next synchronize, as an asynchronous device error does. */
void fakeacl_fail_next_copy(int n) { __atomic_add_fetch(&fail_copies, n, __ATOMIC_SEQ_CST); }

static int take_failure(void) {
    int cur = __atomic_load_n(&fail_copies, __ATOMIC_SEQ_CST);
    while (cur > 0) {
        if (__atomic_compare_exchange_n(&fail_copies, &cur, cur - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return 1;
    }
    return 0;
}

int aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, int kind, void *stream) {
    if (!stream) return INVALID;
    if (take_failure()) { ((fake_stream *)stream)->error = 507011; return OK; }
    return copy_checked(dst, destMax, src, count, kind);
}

int aclrtMemcpyBatchAsync(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes, size_t numBatches,
                          aclrtMemcpyBatchAttr *attrs, size_t *attrsIndexes, size_t numAttrs,
                          size_t *failIndex, void *stream) {
    *failIndex = SIZE_MAX;
    if (!stream || numAttrs == 0 || attrsIndexes[0] != 0) return INVALID;
    size_t a = 0;
    for (size_t i = 0; i < numBatches; i++) {
        while (a + 1 < numAttrs && attrsIndexes[a + 1] <= i) a++;
        int kind = (attrs[a].srcLoc.type == 1 ? 2 : 0) + (attrs[a].dstLoc.type == 1 ? 1 : 0);
        if (take_failure()) { ((fake_stream *)stream)->error = 507011; continue; }
        int rc = copy_checked(dsts[i], destMaxs[i], srcs[i], sizes[i], kind);
        if (rc != OK) { *failIndex = i; return rc; }
    }
    return OK;
}

int aclrtCreateStream(void **stream) { fake_stream *s = calloc(1, sizeof *s); s->live = 1; *stream = s; return OK; }
int aclrtDestroyStream(void *stream) { if (!stream) return INVALID; free(stream); return OK; }
int aclrtSynchronizeStream(void *stream) {
    if (!stream) return INVALID;
    fake_stream *s = stream;
    int err = s->error;
    s->error = 0;
    return err;
}
int aclrtStreamQuery(void *stream, int *status) { if (!stream) return INVALID; *status = 0; return OK; }
int aclrtStreamWaitEvent(void *stream, void *event) { return (stream && event) ? OK : INVALID; }
int aclrtCreateEvent(void **event) { *event = calloc(1, sizeof(fake_event)); return OK; }
int aclrtDestroyEvent(void *event) { if (!event) return INVALID; free(event); return OK; }
int aclrtRecordEvent(void *event, void *stream) {
    if (!event || !stream) return INVALID;
    ((fake_event *)event)->recorded = 1;
    return OK;
}
int aclrtSynchronizeEvent(void *event) { return event ? OK : INVALID; }
int aclrtQueryEventStatus(void *event, int *status) { if (!event) return INVALID; *status = 1; return OK; }

int aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags) {
    (void)flags;
    pthread_mutex_lock(&mu);
    entry *e = find_base((uintptr_t)devPtr, DEV);
    int rc = (!e || size > e->size || strlen(e->name) + 1 > len) ? INVALID : OK;
    if (rc == OK) snprintf(key, len, "%s", e->name);
    pthread_mutex_unlock(&mu);
    return rc;
}

int aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags) {
    (void)flags;
    char path[512];
    struct stat st;
    if (strchr(key, '/')) return INVALID;
    snprintf(path, sizeof path, "%s/%s", shm_dir(), key);
    if (stat(path, &st) != 0) return INVALID;
    void *p = map_file(path, (size_t)st.st_size, 0);
    if (!p) return INVALID;
    pthread_mutex_lock(&mu);
    add(IMPORTED, (uintptr_t)p, (size_t)st.st_size, key);
    pthread_mutex_unlock(&mu);
    *devPtr = p;
    return OK;
}

int aclrtIpcMemClose(const char *key) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_ENTRIES; i++) {
        if (table[i].kind == IMPORTED && strcmp(table[i].name, key) == 0) {
            munmap((void *)table[i].base, table[i].size);
            table[i].kind = FREE_SLOT;
            pthread_mutex_unlock(&mu);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID;
}
