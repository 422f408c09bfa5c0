/* Live and peak bytes of the process's heap, for benchmarks/memory.py (loaded with LD_PRELOAD).
 *
 * Every malloc-family call goes to glibc's own allocator (__libc_malloc and kin, so no dlsym is
 * needed while the dynamic loader itself allocates); this file only adds each block's usable size
 * (malloc_usable_size, what the block really holds) to a live counter on the way out and takes it
 * off on free, keeping the largest value seen. PyTorch's CPU tensors come from posix_memalign, numpy's
 * from malloc/calloc, Horovod's buffers from new (malloc): all counted, whichever thread allocates.
 * Not counted: memory mapped without malloc (Python's small-object arenas, shared libraries), and
 * the few blocks glibc allocates for itself without going through these symbols (a free of one
 * takes a few bytes off that were never added: a drift of bytes, against gradients of megabytes).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

extern void *__libc_malloc(size_t size);
extern void __libc_free(void *ptr);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *ptr, size_t size);
extern void *__libc_memalign(size_t alignment, size_t size);

static long long live_bytes = 0;
static long long peak_bytes = 0;

static void account(long long delta) {
    long long now = __atomic_add_fetch(&live_bytes, delta, __ATOMIC_RELAXED);
    long long peak = __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED);
    while (now > peak && !__atomic_compare_exchange_n(&peak_bytes, &peak, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void *counted(void *p) {
    if (p != NULL) account((long long)malloc_usable_size(p));
    return p;
}

void *malloc(size_t size) { return counted(__libc_malloc(size)); }

void *calloc(size_t n, size_t size) { return counted(__libc_calloc(n, size)); }

void free(void *p) {
    if (p == NULL) return;
    account(-(long long)malloc_usable_size(p));
    __libc_free(p);
}

void *realloc(void *old, size_t size) {
    long long before = old != NULL ? (long long)malloc_usable_size(old) : 0;
    void *p = __libc_realloc(old, size);
    if (p != NULL) {
        account((long long)malloc_usable_size(p) - before);
    } else if (old != NULL && size == 0) {
        account(-before); /* realloc(p, 0) freed p */
    }
    return p;
}

void *memalign(size_t alignment, size_t size) { return counted(__libc_memalign(alignment, size)); }

void *aligned_alloc(size_t alignment, size_t size) { return counted(__libc_memalign(alignment, size)); }

int posix_memalign(void **out, size_t alignment, size_t size) {
    if (alignment % sizeof(void *) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
    void *p = __libc_memalign(alignment, size);
    if (p == NULL) return ENOMEM;
    *out = counted(p);
    return 0;
}

void *valloc(size_t size) { return counted(__libc_memalign((size_t)sysconf(_SC_PAGESIZE), size)); }

void *pvalloc(size_t size) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return counted(__libc_memalign(page, (size + page - 1) / page * page));
}

long long psgd_heap_live(void) { return __atomic_load_n(&live_bytes, __ATOMIC_RELAXED); }

long long psgd_heap_peak(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }

void psgd_heap_reset_peak(void) { __atomic_store_n(&peak_bytes, psgd_heap_live(), __ATOMIC_RELAXED); }
