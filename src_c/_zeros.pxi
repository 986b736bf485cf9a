# Zeroed tables as DLPack capsules (included by _core.pyx), for array
# libraries that take over memory through DLPack (torch.from_dlpack): the
# PyTorch bridge's gradient tables.
#
# The consumer owns a block while any of its tensors uses it, and calls the
# DLPack deleter (plain C, no GIL needed) when the last one is gone. Only
# then is a block either returned to the OS or kept for a later table of the
# same size (in a free slot, or in place of a kept block of another size,
# which is returned to the OS): a block is never handed out twice at
# once. A kept block is zeroed whole before it is handed out again (its last
# owner may have written anywhere), which on this kind of machine costs less
# than the page faults of fresh memory. A new block is anonymous private
# memory from mmap, which the OS hands out zeroed. The slots are taken and
# filled with atomic compare-and-swap, no lock, so a fork at any moment
# leaves nothing held. CPOSEMBED_REUSE_OUTPUTS=0 (the output pool's switch,
# _pool.pxi) turns keeping off.

from libc.stdint cimport int64_t

cdef extern from *:
    """
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #if !defined(_WIN32)
    #include <sys/mman.h>
    #endif

    /* dlpack.h (v0.8), the part used here. */
    typedef struct { int32_t device_type; int32_t device_id; } cpe_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } cpe_DLDataType;
    typedef struct {
        void *data;
        cpe_DLDevice device;
        int32_t ndim;
        cpe_DLDataType dtype;
        int64_t *shape;
        int64_t *strides;
        uint64_t byte_offset;
    } cpe_DLTensor;
    typedef struct cpe_DLManagedTensor {
        cpe_DLTensor dl_tensor;
        void *manager_ctx;
        void (*deleter)(struct cpe_DLManagedTensor *self);
    } cpe_DLManagedTensor;

    /* The managed tensor and what freeing it needs, in one allocation. */
    typedef struct {
        cpe_DLManagedTensor managed;
        int64_t shape[2];
        size_t nbytes;
        int mapped;
    } cpe_ZeroBlock;

    /* Freed blocks kept for reuse: at most CPE_ZERO_SLOTS, each of at most
       CPE_ZERO_KEEP_MAX bytes. */
    #define CPE_ZERO_SLOTS 4
    #define CPE_ZERO_KEEP_MAX ((size_t)1 << 28)
    static cpe_ZeroBlock *cpe_zero_slots[CPE_ZERO_SLOTS];
    static int cpe_zero_keep = 1;

    #if defined(_MSC_VER)
    #include <windows.h>
    static int cpe_zero_cas(cpe_ZeroBlock **slot, cpe_ZeroBlock *expect, cpe_ZeroBlock *desired) {
        return InterlockedCompareExchangePointer((PVOID volatile *)slot, desired, expect) == expect;
    }
    static cpe_ZeroBlock *cpe_zero_load(cpe_ZeroBlock **slot) {
        return (cpe_ZeroBlock *)InterlockedCompareExchangePointer(
            (PVOID volatile *)slot, NULL, NULL);
    }
    #else
    static int cpe_zero_cas(cpe_ZeroBlock **slot, cpe_ZeroBlock *expect, cpe_ZeroBlock *desired) {
        return __atomic_compare_exchange_n(slot, &expect, desired, 0, __ATOMIC_ACQ_REL,
                                           __ATOMIC_ACQUIRE);
    }
    static cpe_ZeroBlock *cpe_zero_load(cpe_ZeroBlock **slot) {
        return __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    }
    #endif

    static void cpe_zero_release(cpe_ZeroBlock *b) {
        cpe_DLManagedTensor *self = &b->managed;
    #if !defined(_WIN32)
        if (b->mapped) {
            munmap(self->dl_tensor.data, b->nbytes);
        } else
    #endif
        {
            free(self->dl_tensor.data);
        }
        free(b);
    }

    /* The slot the next block replaces when every slot is full (a race
       between two deleters only picks the same slot twice). */
    static unsigned cpe_zero_next_evict = 0;

    /* The DLPack deleter: keep the block in a free slot, else in place of
       a kept block of another size (the oldest kept first, round robin:
       a process whose table sizes change keeps the new sizes), else
       release it. */
    static void cpe_zero_block_free(cpe_DLManagedTensor *self) {
        cpe_ZeroBlock *b = (cpe_ZeroBlock *)self, *old;
        int i, k;
        if (cpe_zero_keep && b->mapped && b->nbytes <= CPE_ZERO_KEEP_MAX) {
            for (i = 0; i < CPE_ZERO_SLOTS; i++) {
                if (cpe_zero_load(&cpe_zero_slots[i]) == NULL &&
                    cpe_zero_cas(&cpe_zero_slots[i], NULL, b))
                    return;
            }
            for (i = 0; i < CPE_ZERO_SLOTS; i++) {
                k = (int)(cpe_zero_next_evict++ % CPE_ZERO_SLOTS);
                old = cpe_zero_load(&cpe_zero_slots[k]);
                if (old != NULL && old->nbytes != b->nbytes &&
                        cpe_zero_cas(&cpe_zero_slots[k], old, b)) {
                    cpe_zero_release(old);
                    return;
                }
            }
        }
        cpe_zero_release(b);
    }

    /* A kept block of exactly `nbytes`, taken out of its slot, or NULL. */
    static cpe_ZeroBlock *cpe_zero_take(size_t nbytes) {
        int i;
        for (i = 0; i < CPE_ZERO_SLOTS; i++) {
            cpe_ZeroBlock *b = cpe_zero_load(&cpe_zero_slots[i]);
            if (b != NULL && b->nbytes == nbytes && cpe_zero_cas(&cpe_zero_slots[i], b, NULL))
                return b;
        }
        return NULL;
    }

    /* Every kept block released (CPOSEMBED_REUSE_OUTPUTS=0, or a test). */
    static void cpe_zero_drop_kept(void) {
        int i;
        for (i = 0; i < CPE_ZERO_SLOTS; i++) {
            cpe_ZeroBlock *b = cpe_zero_load(&cpe_zero_slots[i]);
            if (b != NULL && cpe_zero_cas(&cpe_zero_slots[i], b, NULL)) cpe_zero_release(b);
        }
    }

    static int cpe_zero_kept_count(void) {
        int i, n = 0;
        for (i = 0; i < CPE_ZERO_SLOTS; i++) n += cpe_zero_load(&cpe_zero_slots[i]) != NULL;
        return n;
    }

    static void cpe_zero_set(cpe_ZeroBlock *b, int64_t rows, int64_t cols, int code,
                             int bits) {
        b->shape[0] = rows;
        b->shape[1] = cols;
        b->managed.dl_tensor.device.device_type = 1; /* kDLCPU */
        b->managed.dl_tensor.device.device_id = 0;
        b->managed.dl_tensor.ndim = 2;
        b->managed.dl_tensor.dtype.code = (uint8_t)code;
        b->managed.dl_tensor.dtype.bits = (uint8_t)bits;
        b->managed.dl_tensor.dtype.lanes = 1;
        b->managed.dl_tensor.shape = b->shape;
        b->managed.dl_tensor.strides = NULL; /* C order */
        b->managed.dl_tensor.byte_offset = 0;
        b->managed.manager_ctx = NULL;
        b->managed.deleter = cpe_zero_block_free;
    }

    /* A zeroed rows x cols table of `bits`-bit elements of DLPack type
       `code` (2: kDLFloat, 4: kDLBfloat), or NULL when there is no memory
       for it. */
    static cpe_DLManagedTensor *cpe_zero_block_new(int64_t rows, int64_t cols, int code,
                                                   int bits) {
        size_t nbytes = (size_t)rows * (size_t)cols * (size_t)(bits / 8);
        void *p = NULL;
        cpe_ZeroBlock *b = (cpe_ZeroBlock *)calloc(1, sizeof *b);
        if (b == NULL) return NULL;
    #if defined(MAP_ANONYMOUS)
        if (nbytes > 0) {
            p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) p = NULL;
            else b->mapped = 1;
        }
    #endif
        if (p == NULL) p = calloc(nbytes > 0 ? nbytes : 1, 1);
        if (p == NULL) {
            free(b);
            return NULL;
        }
        b->nbytes = nbytes;
        b->managed.dl_tensor.data = p;
        cpe_zero_set(b, rows, cols, code, bits);
        return &b->managed;
    }

    /* A kept block of the size, zeroed (without the GIL), else a new one. */
    static cpe_DLManagedTensor *cpe_zero_block(int64_t rows, int64_t cols, int code,
                                               int bits) {
        size_t nbytes = (size_t)rows * (size_t)cols * (size_t)(bits / 8);
        cpe_ZeroBlock *b = cpe_zero_keep ? cpe_zero_take(nbytes) : NULL;
        if (b == NULL) return cpe_zero_block_new(rows, cols, code, bits);
        Py_BEGIN_ALLOW_THREADS
        memset(b->managed.dl_tensor.data, 0, nbytes);
        Py_END_ALLOW_THREADS
        cpe_zero_set(b, rows, cols, code, bits);
        return &b->managed;
    }

    /* An unconsumed capsule frees its block; a consumer renames the capsule
       ("used_dltensor") and calls the deleter itself. */
    static void cpe_zero_capsule_free(PyObject *capsule) {
        if (PyCapsule_IsValid(capsule, "dltensor")) {
            cpe_DLManagedTensor *m =
                (cpe_DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
            if (m != NULL && m->deleter != NULL) m->deleter(m);
        } else {
            PyErr_Clear();
        }
    }

    static PyObject *cpe_zero_capsule(cpe_DLManagedTensor *m) {
        PyObject *capsule = PyCapsule_New(m, "dltensor", cpe_zero_capsule_free);
        if (capsule == NULL) m->deleter(m);
        return capsule;
    }
    """
    ctypedef struct cpe_DLManagedTensor:
        pass
    cpe_DLManagedTensor* cpe_zero_block(int64_t rows, int64_t cols, int code, int bits)
    object cpe_zero_capsule(cpe_DLManagedTensor* block)
    void cpe_zero_drop_kept()
    int cpe_zero_kept_count()
    int cpe_zero_keep


def zeroed_dlpack(rows, cols, itemsize, bfloat16=False):
    """A zeroed C-order ``(rows, cols)`` float table as a DLPack capsule.

    ``itemsize``: 2 (float16, or bfloat16 if ``bfloat16``), 4 (float32) or 8
    (float64). Pass the capsule to
    ``torch.from_dlpack``; when the last tensor using the memory is gone, it
    is kept for a later call of the same size or returned to the OS.
    """
    cdef cpe_DLManagedTensor* block
    for name, value in (("rows", rows), ("cols", cols)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int; got {value!r}")
    if type(itemsize) is not int or itemsize not in (2, 4, 8):
        raise ValueError(f"itemsize must be 2, 4 or 8; got {itemsize!r}")
    if bfloat16 and itemsize != 2:
        raise ValueError(f"a bfloat16 table has itemsize 2; got {itemsize!r}")
    nbytes = rows * cols * itemsize
    if nbytes >= 1 << 62:
        raise MemoryError(f"a ({rows}, {cols}) table of {nbytes} bytes does not fit in memory")
    block = cpe_zero_block(rows, cols, 4 if bfloat16 else 2, 8 * itemsize)
    if block == NULL:
        raise MemoryError(f"no memory for a ({rows}, {cols}) table of {nbytes} bytes")
    return cpe_zero_capsule(block)


def zeroed_kept(keep=None):
    """How many freed blocks are kept; ``keep=False`` releases them and keeps
    none from then on, ``keep=True`` keeps again."""
    global cpe_zero_keep
    if keep is not None:
        cpe_zero_keep = 1 if keep else 0
        if not keep:
            cpe_zero_drop_kept()
    return cpe_zero_kept_count()
