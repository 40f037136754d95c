/* The one-step shared-memory reduction of tcoll's arena, in C: the hot path of small calls (and the one step
 * of small block collectives: step_blocks, below).
 *
 * tcoll.shm.vector's small all_reduce / reduce is one arena step: claim the
 * step, describe the call, copy this rank's vector into its slot, publish,
 * wait for every rank, check that every rank describes the same call, and
 * reduce the slots in rank order. In Python that is about two microseconds of
 * interpreter work around a few hundred nanoseconds of memory traffic; here it
 * is one call. The protocol, the memory layout and every decision that is not
 * the happy path stay in Python (tcoll/shm/arena.py): this kernel only spins
 * for a short, bounded time, and whenever something is not ready (a slow peer,
 * a descriptor that differs) it returns how far it got, and Python goes on
 * from there with its full waiting, liveness and error reporting.
 *
 * Reductions follow NumPy's ufuncs exactly: left to right in rank order, each
 * pair by combine() of tcoll/_native/reduce.h (the loops, apart from the data
 * movement here), integers wrap, min/max propagate NaN as np.minimum/np.maximum do.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "../_native/copy.h"
#include "../_native/polling.h"
#include "../_native/reduce.h"

#define SETS 2
#define DESC_WORDS 8
#define PROGRESS_LINE 64  /* bytes of a rank's progress line (streamed steps, below) */
/* What Python relies on of the steps, numbered (tcoll.shm.kernel_abi): 2, step_split stops where a peer lent. */
#define REVISION 2

/* What run() and run_split() return: how far the call got (see tcoll.shm.arena.Arena.run_small). */
enum { NOT_STARTED = 0, PUBLISHED = 1, DONE = 2, REDUCED = 3 };

/* SETS and DESC_WORDS above, and the dtype and op codes of reduce.h: exported by add_shared and compared
 * at import (check_kernel), as part_bounds is by tests/shm/test_kernel_constants.py */

typedef struct {
    PyObject_HEAD
    uint64_t *counters;
    uint64_t *desc;
    uint64_t *progress;  /* a cache line per rank: the step it streams (+ 1), and its bytes written so far */
    uint8_t *data;
    int size;
    int rank;
    Py_ssize_t slot_bytes;
    int nbells;
    /* The exports that keep the arena's mapping and the peers' doorbells mapped while this object lives: a
     * call under way in one thread stays safe when another thread closes the communicator. */
    Py_buffer arena;
    Py_buffer *bell_views;
    int held;  /* how many of bell_views are held; -1: not even the arena */
    int retired;  /* the arena was closed: express calls (express.h) no longer step on it */
    int busy;     /* steps under way (a thread's, the GIL released in its waits): retire() releases after them */
} Kernel;

static inline uint64_t min_counter(const Kernel *k) {
    uint64_t low = UINT64_MAX;
    for (int q = 0; q < k->size; q++) {
        uint64_t c = __atomic_load_n(&k->counters[q], __ATOMIC_ACQUIRE);
        if (c < low) low = c;
    }
    return low;
}

/* Poll until every counter reaches `target` or `budget_ns` passes; yields the core at each poll if asked. */
static int wait_all(const Kernel *k, uint64_t target, uint64_t budget_ns, int yield) {
    if (min_counter(k) >= target) return 1;
    if (budget_ns == 0) return 0;
    int ok = 0;
    Py_BEGIN_ALLOW_THREADS  /* ranks that are threads of one process must be able to publish meanwhile */
    uint64_t start = now_ns();
    for (;;) {
        if (min_counter(k) >= target) { ok = 1; break; }
        if (now_ns() - start >= budget_ns) break;
        if (yield) sched_yield();
        else cpu_relax();
    }
    Py_END_ALLOW_THREADS
    return ok;
}

/* Wake the peers that sleep on their doorbells. */
static void ring_sleepers(const Kernel *k) {
    for (int i = 0; i < k->nbells; i++) ring_doorbell((uint32_t *)k->bell_views[i].buf);
}

static uint8_t *slot_of(const Kernel *k, int rank, uint64_t step) {
    return k->data + ((Py_ssize_t)(step % SETS) * k->size + rank) * k->slot_bytes;
}

#define MAX_KERNEL_RANKS 512     /* ranks of one host whose calls the kernel reduces (more: Python does) */

/* outs[0][0:n] = ins[0] op ins[1] op ... op ins[nin - 1], in rank order, n items, then copied into outs[1]
 * if nout is 2. outs[0] must not overlap an input; outs[1] may be one (a rank's own part, read in place
 * from its buffer and overwritten with the result once every input was read). Whole streams, not
 * cache-sized chunks: reducing and copying 8-32 KiB chunks in turn measured 1.3x slower (512 KiB float32,
 * 36 against 28 us), the prefetchers' streams cut short. Returns 0 (nothing written) if this dtype does
 * not take the op in C. */
static int reduce_parts(int dtype, int op, const uint8_t *const *ins, int nin, uint8_t *const *outs, int nout,
                          Py_ssize_t n) {
    Py_ssize_t bytes = n * ITEMSIZE[dtype];
    if (nin == 1)
        tc_copy(outs[0], ins[0], (size_t)bytes);
    else if (!combine(dtype, op, outs[0], ins[0], ins[1], n))
        return 0;
    for (int q = 2; q < nin; q++)
        combine(dtype, op, outs[0], outs[0], ins[q], n);
    if (nout == 2)
        tc_copy(outs[1], outs[0], (size_t)bytes);
    return 1;
}

static void Kernel_release(Kernel *self) {
    if (self->held < 0) return;
    for (int i = 0; i < self->held; i++) PyBuffer_Release(&self->bell_views[i]);
    PyMem_Free(self->bell_views);
    self->bell_views = NULL;
    PyBuffer_Release(&self->arena);
    self->held = -1;
    self->nbells = 0;
}

static PyObject *Kernel_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Kernel *self = (Kernel *)PyType_GenericNew(type, args, kwds);
    if (self != NULL) self->held = -1;
    return (PyObject *)self;
}

static void Kernel_dealloc(Kernel *self) {
    Kernel_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Kernel(mapping, desc_at, data_at, size, rank, slot_bytes, bells): the arena's mapping (a writable buffer,
 * counters at 0, descriptors at desc_at, slots at data_at) and each peer's doorbell (an 8-byte buffer). */
static int Kernel_init(Kernel *self, PyObject *args, PyObject *kwds) {
    (void)kwds;
    PyObject *mapping, *bells;
    Py_ssize_t desc_at, data_at, slot_bytes;
    int size, rank;
    if (!PyArg_ParseTuple(args, "OnniinO", &mapping, &desc_at, &data_at, &size, &rank, &slot_bytes, &bells))
        return -1;
    Kernel_release(self);
    PyObject *seq = PySequence_Fast(bells, "bells must be a sequence of doorbell buffers");
    if (seq == NULL) return -1;
    Py_ssize_t nbells = PySequence_Fast_GET_SIZE(seq);
    /* the progress lines follow the descriptors (tcoll.shm.arena._layout) */
    Py_ssize_t progress_at = (desc_at + 8 * DESC_WORDS * SETS * (Py_ssize_t)size + 63) & ~(Py_ssize_t)63;
    if (nbells > INT_MAX || size < 1 || rank < 0 || rank >= size || slot_bytes < 1 || desc_at < 8 * size ||
        data_at < progress_at + PROGRESS_LINE * (Py_ssize_t)size) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "arena kernel: bad layout, size, rank, slot or number of doorbells");
        return -1;
    }
    if (PyObject_GetBuffer(mapping, &self->arena, PyBUF_WRITABLE) < 0) { Py_DECREF(seq); return -1; }
    self->held = 0;
    self->bell_views = PyMem_Calloc(nbells ? (size_t)nbells : 1, sizeof(Py_buffer));
    if (self->bell_views == NULL) { Py_DECREF(seq); Kernel_release(self); PyErr_NoMemory(); return -1; }
    if (data_at + SETS * (Py_ssize_t)size * slot_bytes > self->arena.len) {
        Py_DECREF(seq);
        Kernel_release(self);
        PyErr_SetString(PyExc_ValueError, "arena kernel: the mapping is smaller than its layout");
        return -1;
    }
    for (Py_ssize_t i = 0; i < nbells; i++) {
        Py_buffer *view = &self->bell_views[i];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), view, PyBUF_WRITABLE) < 0) {
            Py_DECREF(seq);
            Kernel_release(self);
            return -1;
        }
        self->held = (int)i + 1;
        if (view->len < 8) {
            Py_DECREF(seq);
            Kernel_release(self);
            PyErr_SetString(PyExc_ValueError, "arena kernel: a doorbell is 8 bytes");
            return -1;
        }
    }
    Py_DECREF(seq);
    uint8_t *base = (uint8_t *)self->arena.buf;
    self->nbells = (int)nbells;
    self->size = size;
    self->rank = rank;
    self->counters = (uint64_t *)base;
    self->desc = (uint64_t *)(base + desc_at);
    self->progress = (uint64_t *)(base + progress_at);
    self->data = base + data_at;
    self->slot_bytes = slot_bytes;
    return 0;
}

#define COPY_UNLOCKED (64 << 10)  /* copies from this size on release the GIL (it costs ~100 ns) */

static PyObject *SIXTY_FOUR;  /* the int 64, to shift a stamp by */

/* The arguments of run() and run_split(); the buffer acquired (release it), or -1 with the error set. */
typedef struct {
    Py_buffer view;
    int dtype, op, yield, want;
    uint64_t step, sequence, spin_ns, stamp_low, stamp_high;
} RunArgs;

/* This rank's descriptor of `step`: the call's stamp and sequence, nothing lent. */
static void describe_step(const Kernel *k, const RunArgs *a) {
    uint64_t *desc = k->desc + ((Py_ssize_t)(a->step % SETS) * k->size + k->rank) * DESC_WORDS;
    desc[0] = a->stamp_low;
    desc[1] = a->stamp_high;
    desc[2] = a->sequence;
    desc[3] = 0;
}

/* Whether a rank other than this one lent its buffer for the call of `step` (its descriptor names it). */
static int peer_lent(const Kernel *k, uint64_t step) {
    const uint64_t *base = k->desc + (Py_ssize_t)(step % SETS) * k->size * DESC_WORDS;
    for (int q = 0; q < k->size; q++)
        if (q != k->rank && base[(Py_ssize_t)q * DESC_WORDS + 3] != 0) return 1;
    return 0;
}

/* Publish this rank's counter (`value`: the steps it has published) and wake the peers that sleep. */
static void publish_counter(const Kernel *k, uint64_t value) {
    __atomic_store_n(&k->counters[k->rank], value, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the counter is visible before we look for sleepers */
    ring_sleepers(k);
}

/* Copy `len` bytes of `src` into this rank's slot of `step`, all but bytes [skip_lo, skip_hi): a split call's
 * (or piece's) own part, which this rank reads from its buffer. */
static void copy_in_but(const Kernel *k, uint64_t step, const uint8_t *src, Py_ssize_t len, Py_ssize_t skip_lo,
                        Py_ssize_t skip_hi) {
    uint8_t *slot = slot_of(k, k->rank, step);
    tc_copy(slot, src, (size_t)skip_lo);
    tc_copy(slot + skip_hi, src + skip_hi, (size_t)(len - skip_hi));
}

/* Describe the call in this rank's descriptor of its step, copy the buffer into its slot (copy_in_but),
 * publish, ring. */
static void publish_step(Kernel *k, const RunArgs *a, Py_ssize_t skip_lo, Py_ssize_t skip_hi) {
    describe_step(k, a);
    copy_in_but(k, a->step, a->view.buf, a->view.len, skip_lo, skip_hi);
    publish_counter(k, a->step + 1);
}

/* Whether every rank's descriptor of `step` names this call (stamp and sequence) as this rank's does. */
static int descriptors_agree(const Kernel *k, uint64_t step) {
    const uint64_t *base = k->desc + (Py_ssize_t)(step % SETS) * k->size * DESC_WORDS;
    const uint64_t *mine = base + (Py_ssize_t)k->rank * DESC_WORDS;
    for (int q = 0; q < k->size; q++) {
        const uint64_t *theirs = base + (Py_ssize_t)q * DESC_WORDS;
        if (theirs[0] != mine[0] || theirs[1] != mine[1] || theirs[2] != mine[2]) return 0;
    }
    return 1;
}

static int reduce_slots(const Kernel *k, uint64_t step, int dtype, int op, void *out, Py_ssize_t n) {
    if (k->size == 1) {
        tc_copy(out, slot_of(k, 0, step), (size_t)(n * ITEMSIZE[dtype]));
        return 1;
    }
    if (!combine(dtype, op, out, slot_of(k, 0, step), slot_of(k, 1, step), n)) return 0;
    for (int q = 2; q < k->size; q++)
        combine(dtype, op, out, out, slot_of(k, q, step), n);
    return 1;
}

/* The two 64-bit words of a call's stamp (a Python int of up to 128 bits); -1 with the error set. */
static int stamp_words(PyObject *stamp, uint64_t *low, uint64_t *high) {
    *low = PyLong_AsUnsignedLongLongMask(stamp);
    PyObject *shifted = PyNumber_Rshift(stamp, SIXTY_FOUR);
    if (shifted == NULL) return -1;
    *high = PyLong_AsUnsignedLongLongMask(shifted);
    Py_DECREF(shifted);
    return PyErr_Occurred() ? -1 : 0;
}

/* The five arguments every step takes, from args[0]: step, stamp, sequence, spin_ns, yield; -1 with the error set. */
static int parse_step(PyObject *const *args, RunArgs *a) {
    a->step = PyLong_AsUnsignedLongLong(args[0]);
    if (PyErr_Occurred() || stamp_words(args[1], &a->stamp_low, &a->stamp_high) < 0) return -1;
    a->sequence = PyLong_AsUnsignedLongLong(args[2]);
    a->spin_ns = PyLong_AsUnsignedLongLong(args[3]);
    a->yield = PyObject_IsTrue(args[4]);
    return PyErr_Occurred() ? -1 : 0;
}

/* The arguments of run(), run_split() and run_pieces(): buf, dtype, op, the step's five, want, then `extra` more
 * (run_pieces': piece, done); the buffer acquired (release it) and no larger than `largest`, or -1 with the
 * error set. */
static int parse_reduction(Kernel *self, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t extra, Py_ssize_t largest,
                           RunArgs *a) {
    if (nargs != 9 + extra) {
        PyErr_SetString(PyExc_TypeError, extra ? "run_pieces(buf, dtype, op, step, stamp, sequence, spin_ns, yield, "
                                                 "want, piece, done)"
                                               : "run(buf, dtype, op, step, stamp, sequence, spin_ns, yield, want) "
                                                 "(run_split too)");
        return -1;
    }
    a->dtype = (int)PyLong_AsLong(args[1]);
    a->op = (int)PyLong_AsLong(args[2]);
    if (PyErr_Occurred() || parse_step(args + 3, a) < 0) return -1;
    a->want = PyObject_IsTrue(args[8]);
    if (PyErr_Occurred()) return -1;
    if (a->dtype < 0 || a->dtype >= NDTYPES || a->op < 0 || a->op >= NOPS) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: unknown dtype or op code");
        return -1;
    }
    if (self->held < 0) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: not initialised");
        return -1;
    }
    /* (contiguous either way; writable only where the result goes: a reduce's other ranks may pass a read-only
     * array) */
    if (PyObject_GetBuffer(args[0], &a->view, a->want ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (a->view.len > largest || a->view.len % ITEMSIZE[a->dtype]) {
        PyBuffer_Release(&a->view);
        PyErr_SetString(PyExc_ValueError, "arena kernel: the buffer does not fit a slot or its dtype");
        return -1;
    }
    return 0;
}

static int parse_run(Kernel *self, PyObject *const *args, Py_ssize_t nargs, RunArgs *a) {
    return parse_reduction(self, args, nargs, 0, self->slot_bytes, a);
}

/* A call's first step: claim it (every rank is done with step - 2), describe the call, copy in, publish.
 * PUBLISHED, or NOT_STARTED (a peer is still on the step before, past the spin). */
static long claim_and_publish(Kernel *self, const RunArgs *a, Py_ssize_t skip_lo, Py_ssize_t skip_hi) {
    if (a->step >= 1 && !wait_all(self, a->step, a->spin_ns, a->yield))
        return NOT_STARTED;
    publish_step(self, a, skip_lo, skip_hi);
    return PUBLISHED;
}

/* The one-step call of run() on an acquired buffer: how far it got (NOT_STARTED, PUBLISHED or DONE). */
static long step_small(Kernel *self, const RunArgs *a) {
    long state = claim_and_publish(self, a, a->view.len, a->view.len);
    if (state == NOT_STARTED || !wait_all(self, a->step + 1, a->spin_ns, a->yield) || !descriptors_agree(self, a->step))
        return state;
    if (a->want && !reduce_slots(self, a->step, a->dtype, a->op, a->view.buf, a->view.len / ITEMSIZE[a->dtype]))
        return state;  /* an op this dtype does not take in C: Python reduces */
    return DONE;
}

/* A step is over: a kernel retired meanwhile lets go of the mapping once no step is under way any more. */
static void step_over(Kernel *self) {
    if (--self->busy == 0 && self->retired) Kernel_release(self);
}

static PyObject *Kernel_run(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    RunArgs a;
    if (parse_run(self, args, nargs, &a) < 0) return NULL;
    self->busy++;
    long state = step_small(self, &a);
    step_over(self);
    PyBuffer_Release(&a.view);
    return PyLong_FromLong(state);
}

/* Elements [lo, hi) of part `index` when `count` are cut into `parts` near-equal parts (algos.topology). */
static void part_bounds(Py_ssize_t count, int parts, int index, Py_ssize_t *lo, Py_ssize_t *hi) {
    Py_ssize_t base = count / parts, extra = count % parts;
    *lo = index * base + (index < extra ? index : extra);
    *hi = *lo + base + (index < extra);
}

/* This rank's part of the `n` items at `mine` (its buffer, or a piece of it), reduced in rank order over every
 * rank's input: the others' slots of `in_step` at that part, this rank's own `mine` there (its own part never
 * went into its slot). Into its slot of `out_step` at that part, where the others read it, and into `mine`
 * there too when `want` (reduce_parts). 0: this dtype does not take the op in C. */
static int reduce_part(const Kernel *k, uint64_t in_step, uint64_t out_step, int dtype, int op, uint8_t *mine,
                       int want, Py_ssize_t n) {
    Py_ssize_t lo, hi, item = ITEMSIZE[dtype];
    part_bounds(n, k->size, k->rank, &lo, &hi);
    const uint8_t *ins[MAX_KERNEL_RANKS];
    for (int q = 0; q < k->size; q++)
        ins[q] = q == k->rank ? mine + lo * item : slot_of(k, q, in_step) + lo * item;
    uint8_t *outs[2] = {slot_of(k, k->rank, out_step) + lo * item, mine + lo * item};
    return reduce_parts(dtype, op, ins, k->size, outs, want ? 2 : 1, hi - lo);
}

/* The other ranks' reduced parts, from their slots of `step`, into `out`. */
static void copy_parts_out(const Kernel *k, uint64_t step, Py_ssize_t item, uint8_t *out, Py_ssize_t n) {
    for (int q = 0; q < k->size; q++) {
        Py_ssize_t lo, hi;
        part_bounds(n, k->size, q, &lo, &hi);
        if (q != k->rank) tc_copy(out + lo * item, slot_of(k, q, step) + lo * item, (size_t)((hi - lo) * item));
    }
}

/* Streamed steps. A writer in C announces on its progress line how much of its slot it has written, chunk by
 * chunk, before it publishes the step, so that a reader in C copies each chunk out while the next is written:
 * one copy's time instead of two in a row, and the chunk still in the writer's cache when read. The line
 * holds the step it speaks of (+ 1) and the bytes written; a reader goes by the writer's counter once that
 * passed the step (a writer in Python, which never writes the line, or one that moved on). */
#define STREAM_CHUNK (16 << 10)  /* broadcasts of 64 KiB-1 MiB on 2 ranks: 8 and 16 KiB tied; 4, 32, 64 KiB slower */

/* Describe the call first (describe_step). Then, as the writer: announce that this rank streams the step,
 * copy `len` bytes of `src` into its slot a chunk at a time, announcing each, and publish the step. */
static void stream_slot(const Kernel *k, const RunArgs *a, const uint8_t *src, Py_ssize_t len) {
    uint64_t *line = k->progress + (Py_ssize_t)k->rank * (PROGRESS_LINE / 8);
    uint8_t *slot = slot_of(k, k->rank, a->step);
    __atomic_store_n(&line[1], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&line[0], a->step + 1, __ATOMIC_RELEASE);  /* (the descriptor is visible with it) */
    for (Py_ssize_t lo = 0; lo < len; lo += STREAM_CHUNK) {
        Py_ssize_t n = len - lo < STREAM_CHUNK ? len - lo : STREAM_CHUNK;
        tc_copy(slot + lo, src + lo, (size_t)n);
        __atomic_store_n(&line[1], (uint64_t)(lo + n), __ATOMIC_RELEASE);
    }
    publish_counter(k, a->step + 1);
}

/* Bytes of `rank`'s slot of `step` written so far: all (PY_SSIZE_T_MAX) once its counter passed the step;
 * else what its progress line says of the step; -1 before either (its descriptor not yet written). */
static Py_ssize_t written(const Kernel *k, int rank, uint64_t step) {
    const uint64_t *line = k->progress + (Py_ssize_t)rank * (PROGRESS_LINE / 8);
    uint64_t tag = __atomic_load_n(&line[0], __ATOMIC_ACQUIRE);
    uint64_t bytes = __atomic_load_n(&line[1], __ATOMIC_ACQUIRE);
    if (__atomic_load_n(&k->counters[rank], __ATOMIC_ACQUIRE) >= step + 1) return PY_SSIZE_T_MAX;
    return tag == step + 1 ? (Py_ssize_t)bytes : -1;  /* (a later step's bytes only once the counter passed) */
}

/* Wait (at most `spin_ns` without progress) until `rank` has written `need` bytes of `step`; 0: it did not. */
static int wait_written(const Kernel *k, int rank, uint64_t step, Py_ssize_t need, uint64_t spin_ns, int yield) {
    uint64_t start = now_ns();
    while (written(k, rank, step) < need) {
        if (now_ns() - start >= spin_ns) return 0;
        if (yield) sched_yield();
        else cpu_relax();
    }
    return 1;
}

/* Whether `rank` describes the call of `step` as this rank does and lent nothing (its descriptor visible). */
static int describes_mine(const Kernel *k, int rank, uint64_t step) {
    const uint64_t *base = k->desc + (Py_ssize_t)(step % SETS) * k->size * DESC_WORDS;
    const uint64_t *mine = base + (Py_ssize_t)k->rank * DESC_WORDS, *theirs = base + (Py_ssize_t)rank * DESC_WORDS;
    return theirs[0] == mine[0] && theirs[1] == mine[1] && theirs[2] == mine[2] && theirs[3] == 0;
}

/* As the reader: once `rank` describes the call of this step as this rank does (and lent nothing; checked only
 * where `check`: a call's first step), copy `len` bytes of its slot from `at` to `dst` as they are written.
 * 0: it describes another call, or made no progress within the spin (what was copied stays; the caller
 * copies the whole again once it published). */
static int read_stream_at(const Kernel *k, const RunArgs *a, int rank, Py_ssize_t at, uint8_t *dst, Py_ssize_t len,
                          int check) {
    if (!wait_written(k, rank, a->step, 0, a->spin_ns, a->yield) || (check && !describes_mine(k, rank, a->step)))
        return 0;
    const uint8_t *slot = slot_of(k, rank, a->step) + at;
    Py_ssize_t done = 0;
    while (done < len) {
        Py_ssize_t ready = written(k, rank, a->step);
        ready = ready == PY_SSIZE_T_MAX || ready - at > len ? len : ready - at;
        if (ready > done) {
            tc_copy(dst + done, slot + done, (size_t)(ready - done));
            done = ready;
        } else if (!wait_written(k, rank, a->step,
                                 at + done + (len - done < STREAM_CHUNK ? len - done : STREAM_CHUNK),
                                 a->spin_ns, a->yield)) {
            return 0;
        }
    }
    return 1;
}

/* read_stream_at the head of the slot: its first `len` bytes. */
static int read_stream(const Kernel *k, const RunArgs *a, int rank, uint8_t *dst, Py_ssize_t len, int check) {
    return read_stream_at(k, a, rank, 0, dst, len, check);
}

/* The end of a streamed step (`streamed`: this rank's part went whole): once every rank published it, every
 * descriptor names this call and, where the call may lend, nobody lent, publish the lenders' step too (this
 * rank lent nothing) and return DONE; else PUBLISHED (Python checks and copies again). */
static long close_streamed(const Kernel *k, const RunArgs *a, int streamed, int lending) {
    if (!streamed || !wait_all(k, a->step + 1, a->spin_ns, a->yield) || !descriptors_agree(k, a->step) ||
        (lending && peer_lent(k, a->step)))
        return PUBLISHED;
    if (lending) publish_counter(k, a->step + 2);
    return DONE;
}

/* run_split(buf, dtype, op, step, stamp, sequence, spin_ns, yield, want): a call that fits a slot, in three
 * steps, where each rank reduces 1/p of the data instead of all of it (tcoll.shm.vector._reduce_split has
 * the same steps in Python): step `step`: claim, describe, copy in, publish; when every rank has, describes
 * the same call and lent nothing (a lender's slot holds none of its input: Python reads its buffer), reduce
 * this rank's part of every slot (into `buf` at that part if `want`) and copy it over its own part of its
 * slot; publish `step + 1`; when every rank has, copy the others' parts out (if `want`); publish `step + 2`
 * (done reading the slots). Returns how far it got: NOT_STARTED, PUBLISHED (`step`), REDUCED (`step + 1`)
 * or DONE; Python goes on from there as with run(). */
static long step_split(Kernel *self, const RunArgs *a) {
    Py_ssize_t item = ITEMSIZE[a->dtype], n = a->view.len / item, lo, hi;
    part_bounds(n, self->size, self->rank, &lo, &hi);
    long state = self->size > MAX_KERNEL_RANKS ? NOT_STARTED : claim_and_publish(self, a, lo * item, hi * item);
    if (state == NOT_STARTED || !wait_all(self, a->step + 1, a->spin_ns, a->yield) ||
        !descriptors_agree(self, a->step) || peer_lent(self, a->step) ||
        !reduce_part(self, a->step, a->step, a->dtype, a->op, a->view.buf, a->want, n))
        return state;
    publish_counter(self, a->step + 2);
    if (a->want) {
        if (!wait_all(self, a->step + 2, a->spin_ns, a->yield))
            return REDUCED;
        copy_parts_out(self, a->step, item, a->view.buf, n);
    }
    publish_counter(self, a->step + 3);
    return DONE;
}

static PyObject *Kernel_run_split(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    RunArgs a;
    if (parse_run(self, args, nargs, &a) < 0) return NULL;
    self->busy++;
    long state = step_split(self, &a);
    step_over(self);
    PyBuffer_Release(&a.view);
    return PyLong_FromLong(state);
}

/* The one step of a broadcast that fits a slot: root copies its buffer into its slot; every rank describes the
 * call and publishes; once all have, and every descriptor names this call, the others copy root's slot out.
 * From STREAM_FROM bytes the copies overlap: root streams its slot (and publishes when it is whole), the
 * others publish at once, check root's descriptor and copy each chunk as it comes, then check every
 * descriptor (a call that differs raises in Python, whatever was copied). `lending`: the call is large enough
 * to lend (tcoll.shm.arena.ZERO_COPY_BYTES), so it ends with the lenders' step, which this rank publishes
 * (root here lends nothing; a root that lent leaves the reading of its buffer to Python). How far it got:
 * NOT_STARTED, PUBLISHED (the check, the copy and the lenders' step are Python's) or DONE. */
#define STREAM_FROM (32 << 10)

static long step_broadcast(Kernel *self, const RunArgs *a, int root, int lending) {
    Py_ssize_t len = a->view.len;
    if (len < STREAM_FROM) {
        long state = claim_and_publish(self, a, self->rank == root ? len : 0, len);
        if (state == NOT_STARTED || !wait_all(self, a->step + 1, a->spin_ns, a->yield) ||
            !descriptors_agree(self, a->step) || (lending && peer_lent(self, a->step)))
            return state;
        if (self->rank != root) tc_copy(a->view.buf, slot_of(self, root, a->step), (size_t)len);
    } else {
        if (a->step >= 1 && !wait_all(self, a->step, a->spin_ns, a->yield)) return NOT_STARTED;
        describe_step(self, a);
        int streamed = 1;
        PyThreadState *saved = PyEval_SaveThread();  /* (thread ranks: the others run meanwhile) */
        if (self->rank == root) {
            stream_slot(self, a, a->view.buf, len);
        } else {
            publish_counter(self, a->step + 1);
            streamed = read_stream(self, a, root, a->view.buf, len, 1);
        }
        PyEval_RestoreThread(saved);
        return close_streamed(self, a, streamed, lending);
    }
    if (lending) publish_counter(self, a->step + 2);  /* the lenders' step: nobody lent */
    return DONE;
}

/* The arguments of a rooted call: `count` of them, root at args[root_at], the step's five at args[step_at]; -1 with
 * the error set (the buffers are the caller's to acquire). */
static int parse_rooted(Kernel *self, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t count, Py_ssize_t root_at,
                        Py_ssize_t step_at, const char *usage, RunArgs *a, int *root) {
    if (nargs != count) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    memset(a, 0, sizeof(*a));
    *root = (int)PyLong_AsLong(args[root_at]);
    if (PyErr_Occurred() || parse_step(args + step_at, a) < 0) return -1;
    if (self->held < 0 || *root < 0 || *root >= self->size) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: not initialised, or the root is not a rank");
        return -1;
    }
    return 0;
}

/* The arguments of run_broadcast() and run_broadcast_pieces(): 8 of them, buf and root first, the step's five
 * from args[step_at]; the buffer acquired (writable off root; release it), or -1 with the error set. */
static int parse_broadcast(Kernel *self, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t step_at,
                           const char *usage, RunArgs *a, int *root) {
    if (parse_rooted(self, args, nargs, 8, 1, step_at, usage, a, root) < 0) return -1;
    a->want = self->rank != *root;
    return PyObject_GetBuffer(args[0], &a->view, a->want ? PyBUF_WRITABLE : PyBUF_SIMPLE);
}

/* run_broadcast(buf, root, lending, step, stamp, sequence, spin_ns, yield): step_broadcast on `buf` (writable off
 * root). */
static PyObject *Kernel_run_broadcast(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    RunArgs a;
    int root, lending = nargs == 8 ? PyObject_IsTrue(args[2]) : 0;
    if (lending < 0 || parse_broadcast(self, args, nargs, 3, "run_broadcast(buf, root, lending, step, stamp, "
                                       "sequence, spin_ns, yield)", &a, &root) < 0)
        return NULL;
    if (a.view.len > self->slot_bytes) {
        PyBuffer_Release(&a.view);
        PyErr_SetString(PyExc_ValueError, "arena kernel: the buffer does not fit a slot");
        return NULL;
    }
    self->busy++;
    long state = step_broadcast(self, &a, root, lending);
    step_over(self);
    PyBuffer_Release(&a.view);
    return PyLong_FromLong(state);
}

/* The block collectives' one step (tcoll.shm.blocks: an all_gather, gather, all_to_all or reduce_scatter whose
 * blocks fit one step, where this rank's buffer is not lent), laid out in the slots exactly as their Python steps lay it, so
 * that a rank in C and a rank in Python pair: claim, describe, copy this rank's blocks in, publish; once every
 * rank has and every descriptor names this call, copy (or reduce) this rank's result out of the slots. An
 * all_gather's or gather's block lies at the head of its slot; an all_to_all's or reduce_scatter's block for
 * rank q at q * share (share: the slot's bytes / size, in whole items for a reduce_scatter). What the Python
 * steps copy before the algorithm (a gather root's and an all_to_all's own block) is copied here too, so
 * that an express call (express.h) needs nothing else. */
enum { BLOCKS_ALL_GATHER = 0, BLOCKS_GATHER = 1, BLOCKS_ALL_TO_ALL = 2, BLOCKS_REDUCE_SCATTER = 3, BLOCKS_SCATTER = 4,
       BLOCKS_KINDS = 5 };
#define DESCRIPTION_BYTES 256  /* a scatter's description of its chunks (tcoll.shm.described.DESCRIPTION_BYTES) */

typedef struct {
    int kind, root;
    Py_ssize_t block;  /* bytes of each rank's block */
    Py_ssize_t share;  /* where block q lies in a slot (all_to_all, reduce_scatter): q * share */
    uint8_t *out;      /* this rank's result (NULL: none, a gather's other ranks) */
    int lending;       /* a call large enough to lend (tcoll.shm.arena.ZERO_COPY_BYTES): it ends with the lenders'
                        * step, which this rank (lending nothing itself) publishes without waiting; a peer that
                        * lent its buffer leaves the reading of it to Python */
    const uint8_t *header;  /* a scatter's description (DESCRIPTION_BYTES): root's to write, the others' to expect */
} Blocks;

/* The share of a slot per rank for `kind` (in whole items of `dtype` for a reduce_scatter: tcoll.shm.blocks._share). */
static Py_ssize_t blocks_share(const Kernel *k, int kind, int dtype) {
    Py_ssize_t item = kind == BLOCKS_REDUCE_SCATTER ? ITEMSIZE[dtype] : 1;
    return k->slot_bytes / k->size / item * item;
}

/* Whether buffers of `send_len` and `out_len` bytes (-1: no output) fit `kind`'s one step on this kernel. */
static int blocks_fit(const Kernel *k, const Blocks *b, int dtype, Py_ssize_t send_len, Py_ssize_t out_len) {
    Py_ssize_t p = k->size, n = b->block;
    int gathers = b->kind == BLOCKS_ALL_GATHER || b->kind == BLOCKS_GATHER;
    int wants_out = b->kind != BLOCKS_GATHER || k->rank == b->root;
    Py_ssize_t expect_out = b->kind == BLOCKS_REDUCE_SCATTER ? n : p * n;
    if (b->kind == BLOCKS_SCATTER)  /* root sends p blocks, the others' x is their out; all in the first share */
        return b->header != NULL && n >= 0 && b->root >= 0 && b->root < p && out_len == n &&
               send_len == (k->rank == b->root ? p * n : n) && n <= (k->slot_bytes - DESCRIPTION_BYTES) / p;
    if (n < 0 || b->root < 0 || b->root >= p || (wants_out && out_len != expect_out) || (!wants_out && out_len > 0))
        return 0;
    if (gathers)
        return send_len == n && n <= k->slot_bytes;
    return send_len == p * n && n <= b->share && (b->kind != BLOCKS_REDUCE_SCATTER || n % ITEMSIZE[dtype] == 0);
}

/* Describe the call and copy this rank's blocks into its slot of `step` (the layout above); publish, ring. */
static void publish_blocks(Kernel *k, const RunArgs *a, const Blocks *b) {
    describe_step(k, a);
    uint8_t *slot = slot_of(k, k->rank, a->step);
    const uint8_t *send = a->view.buf;
    if (b->kind == BLOCKS_ALL_GATHER || (b->kind == BLOCKS_GATHER && k->rank != b->root))
        tc_copy(slot, send, (size_t)b->block);
    else if (b->kind == BLOCKS_ALL_TO_ALL || b->kind == BLOCKS_REDUCE_SCATTER)
        for (int q = 0; q < k->size; q++)
            if (q != k->rank || b->kind == BLOCKS_REDUCE_SCATTER)
                tc_copy(slot + q * b->share, send + q * b->block, (size_t)b->block);
    publish_counter(k, a->step + 1);
}

/* This rank's result of the step, out of every rank's slot (all have published and agree). 0: the reduction's
 * dtype or op is not the kernel's (nothing written). */
static int blocks_out(const Kernel *k, const RunArgs *a, const Blocks *b) {
    Py_ssize_t n = b->block, at = k->rank * b->share;
    const uint8_t *send = a->view.buf;
    if (b->kind == BLOCKS_REDUCE_SCATTER) {
        const uint8_t *ins[MAX_KERNEL_RANKS];
        for (int q = 0; q < k->size; q++) ins[q] = slot_of(k, q, a->step) + at;
        uint8_t *outs[1] = {b->out};
        return reduce_parts(a->dtype, a->op, ins, k->size, outs, 1, n / ITEMSIZE[a->dtype]);
    }
    if (b->out == NULL) return 1;  /* a gather's other ranks */
    for (int q = 0; q < k->size; q++) {
        const uint8_t *from = b->kind == BLOCKS_ALL_TO_ALL ? (q == k->rank ? send + q * n : slot_of(k, q, a->step) + at)
                              : q == k->rank && b->kind == BLOCKS_GATHER ? send : slot_of(k, q, a->step);
        tc_copy(b->out + q * n, from, (size_t)n);
    }
    return 1;
}

/* A gather's step from STREAM_FROM bytes a block, streamed: the other ranks stream their blocks into their slots
 * (and publish when whole); root publishes at once and copies each block's chunks as they come, then every
 * rank checks every descriptor. PUBLISHED where a peer was late, described another call or lent its buffer:
 * Python checks and copies (the whole) again. */
static long step_gather_streamed(Kernel *self, const RunArgs *a, const Blocks *b) {
    Py_ssize_t n = b->block;
    int streamed = 1;
    describe_step(self, a);
    PyThreadState *saved = PyEval_SaveThread();
    if (self->rank != b->root) {
        stream_slot(self, a, a->view.buf, n);
    } else {
        publish_counter(self, a->step + 1);
        tc_copy(b->out + (Py_ssize_t)b->root * n, a->view.buf, (size_t)n);
        for (int q = 0; q < self->size && streamed; q++)
            streamed = q == self->rank || read_stream(self, a, q, b->out + q * n, n, 1);
    }
    PyEval_RestoreThread(saved);
    return close_streamed(self, a, streamed, b->lending);
}

/* A scatter's root in one step: write bytes [lo, lo + piece) of every other rank's chunk (`n` bytes each, in
 * `send`) into its slot of `step` at base + q * piece, after the description (`header`, at the head, where not
 * NULL), a STREAM_CHUNK at a time, announcing each on its progress line; then publish the step. */
static void stream_shares(const Kernel *k, uint64_t step, const uint8_t *send, Py_ssize_t n, Py_ssize_t base,
                          Py_ssize_t piece, Py_ssize_t lo, const uint8_t *header) {
    uint64_t *line = k->progress + (Py_ssize_t)k->rank * (PROGRESS_LINE / 8);
    uint8_t *slot = slot_of(k, k->rank, step);
    Py_ssize_t hi = n < lo + piece ? n : lo + piece;
    __atomic_store_n(&line[1], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&line[0], step + 1, __ATOMIC_RELEASE);  /* (the descriptor is visible with it) */
    if (header != NULL) {
        memcpy(slot, header, DESCRIPTION_BYTES);
        __atomic_store_n(&line[1], DESCRIPTION_BYTES, __ATOMIC_RELEASE);
    }
    for (int q = 0; q < k->size; q++) {
        uint8_t *to = slot + base + q * piece;
        for (Py_ssize_t at = lo; q != k->rank && at < hi; at += STREAM_CHUNK) {
            Py_ssize_t c = hi - at < STREAM_CHUNK ? hi - at : STREAM_CHUNK;
            tc_copy(to + at - lo, send + q * n + at, (size_t)c);
            __atomic_store_n(&line[1], (uint64_t)(base + q * piece + at - lo + c), __ATOMIC_RELEASE);
        }
    }
    publish_counter(k, step + 1);
}

/* A scatter's other rank: copy `len` bytes of root's slot of this step from `at` to `dst` as root streams them;
 * where `header` is not NULL (the first step), only once root describes this call as this rank does, lent
 * nothing and wrote that description. 0: it did not, or not within the spin. */
static int read_described(const Kernel *k, const RunArgs *a, int root, const uint8_t *header, Py_ssize_t at,
                          uint8_t *dst, Py_ssize_t len) {
    return (header == NULL || (wait_written(k, root, a->step, DESCRIPTION_BYTES, a->spin_ns, a->yield) &&
                               describes_mine(k, root, a->step) &&
                               memcmp(slot_of(k, root, a->step), header, DESCRIPTION_BYTES) == 0)) &&
           read_stream_at(k, a, root, at, dst, len, 0);
}

/* step_scatter's first step streamed (described, not yet published): root announces its description, then each
 * other rank's chunk a STREAM_CHUNK at a time, on its progress line, and publishes; the others publish at once,
 * and once root describes this call, lent nothing and wrote the description they expect, copy their chunk as it
 * comes. Then every rank checks every descriptor. 0: Python checks, reads the description and copies (again). */
static int scatter_streamed(Kernel *self, const RunArgs *a, const Blocks *b, Py_ssize_t share) {
    Py_ssize_t n = b->block, at = DESCRIPTION_BYTES + self->rank * share;
    int ok = 1;
    PyThreadState *saved = PyEval_SaveThread();  /* (thread ranks: the others run meanwhile) */
    if (self->rank == b->root) {
        const uint8_t *send = a->view.buf;
        stream_shares(self, a->step, send, n, DESCRIPTION_BYTES, share, 0, b->header);
        if (b->out != NULL) tc_copy(b->out, send + self->rank * n, (size_t)n);
    } else {
        publish_counter(self, a->step + 1);
        ok = read_described(self, a, b->root, b->header, at, b->out, n);
    }
    PyEval_RestoreThread(saved);
    return ok && wait_all(self, a->step + 1, a->spin_ns, a->yield) && descriptors_agree(self, a->step);
}

/* A scatter whose chunks fit the first step (tcoll.shm.described, which lays the slot out alike): root writes
 * its description and every other rank's chunk after it (rank q's at DESCRIPTION_BYTES + q * share), copies its
 * own, publishes; every other rank publishes at once. Once all have and agree, the others copy their chunk out
 * if root's description is the one they expect (else Python reads it: it may differ, or not match their out);
 * then every rank publishes the closing step and waits in it for all, so that a rank that failed fails every
 * rank's call. From STREAM_FROM bytes a chunk the copies overlap (scatter_streamed). How far it got:
 * NOT_STARTED, PUBLISHED (the first step), REDUCED (the closing step published, the wait in it Python's) or
 * DONE. */
static long step_scatter(Kernel *self, const RunArgs *a, const Blocks *b) {
    Py_ssize_t n = b->block, share = (self->slot_bytes - DESCRIPTION_BYTES) / self->size;
    uint8_t *slot = slot_of(self, b->root, a->step);
    describe_step(self, a);
    if (n >= STREAM_FROM) {
        if (!scatter_streamed(self, a, b, share)) return PUBLISHED;
    } else {
        if (self->rank == b->root) {
            const uint8_t *send = a->view.buf;
            PyThreadState *saved = n * self->size >= COPY_UNLOCKED ? PyEval_SaveThread() : NULL;  /* (thread ranks) */
            memcpy(slot, b->header, DESCRIPTION_BYTES);
            for (int q = 0; q < self->size; q++)
                if (q != b->root || b->out != NULL)
                    tc_copy(q == b->root ? b->out : slot + DESCRIPTION_BYTES + q * share, send + q * n, (size_t)n);
            if (saved != NULL) PyEval_RestoreThread(saved);
        }
        publish_counter(self, a->step + 1);
        if (!wait_all(self, a->step + 1, a->spin_ns, a->yield) || !descriptors_agree(self, a->step)) return PUBLISHED;
        if (self->rank != b->root) {
            if (peer_lent(self, a->step) || memcmp(slot, b->header, DESCRIPTION_BYTES) != 0) return PUBLISHED;
            tc_copy(b->out, slot + DESCRIPTION_BYTES + self->rank * share, (size_t)n);
        }
    }
    publish_counter(self, a->step + 2);
    return wait_all(self, a->step + 2, a->spin_ns, a->yield) ? DONE : REDUCED;
}

/* The step of `b` on an acquired send buffer: how far it got (NOT_STARTED, PUBLISHED or DONE; DONE with
 * the lenders' step published too when `b->lending`). */
static long step_blocks(Kernel *self, const RunArgs *a, const Blocks *b) {
    if (self->size > MAX_KERNEL_RANKS || (a->step >= 1 && !wait_all(self, a->step, a->spin_ns, a->yield)))
        return NOT_STARTED;
    if (b->kind == BLOCKS_SCATTER)
        return step_scatter(self, a, b);
    if (b->kind == BLOCKS_GATHER && b->block >= STREAM_FROM)
        return step_gather_streamed(self, a, b);
    int unlocked = b->block * self->size >= COPY_UNLOCKED;  /* large copies let other threads (thread ranks) run */
    PyThreadState *saved = unlocked ? PyEval_SaveThread() : NULL;
    publish_blocks(self, a, b);
    if (saved != NULL) PyEval_RestoreThread(saved);
    if (!wait_all(self, a->step + 1, a->spin_ns, a->yield) || !descriptors_agree(self, a->step) ||
        (b->lending && peer_lent(self, a->step)))
        return PUBLISHED;
    saved = unlocked ? PyEval_SaveThread() : NULL;
    int done = blocks_out(self, a, b);
    if (saved != NULL) PyEval_RestoreThread(saved);
    if (!done) return PUBLISHED;
    if (b->lending) publish_counter(self, a->step + 2);  /* the lenders' step: nobody reads this rank's buffer */
    return DONE;
}

/* run_scatter(send, out, header, root, step, stamp, sequence, spin_ns, yield): step_scatter for Python's steps
 * (tcoll.shm.described): root's chunks `send` and where its own goes (`out`; None: copied already), or another
 * rank's `out` (`send` None) and the description it expects; chunks that fit the first step, root's buffer not
 * lent. */
static PyObject *Kernel_run_scatter(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    RunArgs a;
    int root;
    if (parse_rooted(self, args, nargs, 9, 3, 4, "run_scatter(send, out, header, root, step, stamp, sequence, "
                     "spin_ns, yield)", &a, &root) < 0)
        return NULL;
    int is_root = self->rank == root, has_out = args[1] != Py_None;
    if (is_root != (args[0] != Py_None) || (!is_root && !has_out)) {
        PyErr_SetString(PyExc_ValueError, "run_scatter: root sends, the others receive into their out");
        return NULL;
    }
    Py_buffer out, header;
    if (PyObject_GetBuffer(args[is_root ? 0 : 1], &a.view, is_root ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0) return NULL;
    if (is_root && has_out && PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&a.view);
        return NULL;
    }
    if (!is_root) out = a.view;  /* (the others: x is out) */
    if (PyObject_GetBuffer(args[2], &header, PyBUF_SIMPLE) < 0) {
        if (is_root && has_out) PyBuffer_Release(&out);
        PyBuffer_Release(&a.view);
        return NULL;
    }
    Py_ssize_t n = is_root ? a.view.len / self->size : a.view.len;
    Blocks b = {BLOCKS_SCATTER, root, n, 0, has_out ? out.buf : NULL, 0,
                header.len == DESCRIPTION_BYTES ? header.buf : NULL};
    long state = -1;
    if (blocks_fit(self, &b, 0, a.view.len, n) && (!has_out || out.len == n)) {
        self->busy++;
        state = step_blocks(self, &a, &b);  /* (NOT_STARTED beyond MAX_KERNEL_RANKS: Python's steps) */
        step_over(self);
    } else {
        PyErr_SetString(PyExc_ValueError, "run_scatter: the chunks do not fit the first step, the output does not "
                                          "fit a chunk, or the header is not DESCRIPTION_BYTES long");
    }
    PyBuffer_Release(&header);
    if (is_root && has_out) PyBuffer_Release(&out);
    PyBuffer_Release(&a.view);
    return state < 0 ? NULL : PyLong_FromLong(state);
}

/* A description argument: None (NULL), or DESCRIPTION_BYTES acquired into `view` (release it); -1 with the
 * error set. */
static int get_header(PyObject *arg, Py_buffer *view, const uint8_t **header) {
    *header = NULL;
    if (arg == Py_None) return 0;
    if (PyObject_GetBuffer(arg, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len != DESCRIPTION_BYTES) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a scatter's description is DESCRIPTION_BYTES long");
        return -1;
    }
    *header = view->buf;
    return 0;
}

/* scatter_write(send, step, lo, piece, header): a scatter's root in Python's steps (tcoll.shm.described): bytes
 * [lo, lo + piece) of every other rank's chunk into its slot of `step`, after `header` (the first step's; None in
 * the others), streamed (stream_shares), and publish the step. */
static PyObject *Kernel_scatter_write(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "scatter_write(send, step, lo, piece, header)");
        return NULL;
    }
    uint64_t step = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t lo = PyLong_AsSsize_t(args[2]), piece = PyLong_AsSsize_t(args[3]);
    Py_buffer send, described;
    const uint8_t *header;
    if (PyErr_Occurred() || get_header(args[4], &described, &header) < 0) return NULL;
    Py_ssize_t base = header != NULL ? DESCRIPTION_BYTES : 0;
    if (PyObject_GetBuffer(args[0], &send, PyBUF_SIMPLE) < 0) {
        if (header != NULL) PyBuffer_Release(&described);
        return NULL;
    }
    Py_ssize_t n = send.len / self->size;
    int fits = self->held >= 0 && lo >= 0 && piece >= 1 && base + piece * self->size <= self->slot_bytes &&
               n * self->size == send.len;
    if (fits) {
        self->busy++;
        Py_BEGIN_ALLOW_THREADS
        stream_shares(self, step, send.buf, n, base, piece, lo, header);
        Py_END_ALLOW_THREADS
        step_over(self);
    } else {
        PyErr_SetString(PyExc_ValueError, "scatter_write: not initialised, or the shares do not fit a slot");
    }
    if (header != NULL) PyBuffer_Release(&described);
    PyBuffer_Release(&send);
    if (!fits) return NULL;
    Py_RETURN_NONE;
}

/* scatter_read(out, root, step, at, spin_ns, yield, header): a scatter's other rank in Python's steps: copy
 * `out`'s length of root's slot of `step` from `at` as root's stream announces it; in the first step (`header`:
 * the description this rank expects, else None), only once root describes this call, lent nothing and wrote
 * that description. Whether it all came within the spin (else the caller waits for root's step, reads the
 * description and copies). */
static PyObject *Kernel_scatter_read(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "scatter_read(out, root, step, at, spin_ns, yield, header)");
        return NULL;
    }
    RunArgs a;
    memset(&a, 0, sizeof(a));
    int root = (int)PyLong_AsLong(args[1]);
    a.step = PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t at = PyLong_AsSsize_t(args[3]);
    a.spin_ns = PyLong_AsUnsignedLongLong(args[4]);
    a.yield = PyObject_IsTrue(args[5]);
    Py_buffer described;
    const uint8_t *header;
    if (PyErr_Occurred() || get_header(args[6], &described, &header) < 0) return NULL;
    if (PyObject_GetBuffer(args[0], &a.view, PyBUF_WRITABLE) < 0) {
        if (header != NULL) PyBuffer_Release(&described);
        return NULL;
    }
    int done = -1;
    if (self->held >= 0 && root >= 0 && root < self->size && at >= 0 && at + a.view.len <= self->slot_bytes) {
        self->busy++;
        Py_BEGIN_ALLOW_THREADS
        done = read_described(self, &a, root, header, at, a.view.buf, a.view.len);
        Py_END_ALLOW_THREADS
        step_over(self);
    } else {
        PyErr_SetString(PyExc_ValueError, "scatter_read: not initialised, no such root, or past the slot");
    }
    if (header != NULL) PyBuffer_Release(&described);
    PyBuffer_Release(&a.view);
    return done < 0 ? NULL : PyBool_FromLong(done);
}

/* run_blocks(send, out, kind, block, root, dtype, op, lending, step, stamp, sequence, spin_ns, yield):
 * step_blocks, `out` None where this rank gets nothing (a gather's other ranks); dtype and op: a
 * reduce_scatter's codes; lending: the call is large enough to lend (see Blocks). */
static PyObject *Kernel_run_blocks(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "run_blocks(send, out, kind, block, root, dtype, op, lending, step, stamp, "
                                         "sequence, spin_ns, yield)");
        return NULL;
    }
    RunArgs a;
    Blocks b;
    memset(&a, 0, sizeof(a));
    b.kind = (int)PyLong_AsLong(args[2]);
    b.block = PyLong_AsSsize_t(args[3]);
    b.root = (int)PyLong_AsLong(args[4]);
    a.dtype = (int)PyLong_AsLong(args[5]);
    a.op = (int)PyLong_AsLong(args[6]);
    b.lending = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred() || parse_step(args + 8, &a) < 0) return NULL;
    if (self->held < 0 || b.kind < 0 || b.kind >= BLOCKS_KINDS || a.dtype < 0 || a.dtype >= NDTYPES || a.op < 0 ||
        a.op >= NOPS) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: not initialised, or an unknown kind, dtype or op code");
        return NULL;
    }
    b.share = blocks_share(self, b.kind, a.dtype);
    b.header = NULL;  /* (a scatter runs only as an express call: blocks_fit refuses it here) */
    Py_buffer out;
    int has_out = args[1] != Py_None;
    if (PyObject_GetBuffer(args[0], &a.view, PyBUF_SIMPLE) < 0) return NULL;
    if (has_out && PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE) < 0) { PyBuffer_Release(&a.view); return NULL; }
    b.out = has_out ? out.buf : NULL;
    long state = -1;
    if (blocks_fit(self, &b, a.dtype, a.view.len, has_out ? out.len : -1)) {
        self->busy++;
        state = step_blocks(self, &a, &b);
        step_over(self);
    } else {
        PyErr_SetString(PyExc_ValueError,
                        "arena kernel: the blocks do not fit one step, or the output does not fit them");
    }
    if (has_out) PyBuffer_Release(&out);
    PyBuffer_Release(&a.view);
    return state < 0 ? NULL : PyLong_FromLong(state);
}

/* retire(): the arena closes; express calls made for it step on it no more, and the mapping and doorbells
 * are let go now, or when the last step under way (another thread's) ends: an Express or a Plan that
 * outlives the communicator keeps this object, not the memory. */
static PyObject *Kernel_retire(Kernel *self, PyObject *unused) {
    (void)unused;
    self->retired = 1;
    if (self->busy == 0) Kernel_release(self);
    Py_RETURN_NONE;
}

static PyTypeObject KernelType;  /* (defined below; the express call checks its argument against it) */

#include "express.h"
#include "pieces.h"

/* combine(dtype, op, out, lower, higher): out = lower op higher over buffers of equal length (out may be
 * lower); False if this dtype does not take the op here. The pipelined steps reduce their pieces with it. */
static PyObject *module_combine(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "combine(dtype, op, out, lower, higher)");
        return NULL;
    }
    int dtype = (int)PyLong_AsLong(args[0]);
    int op = (int)PyLong_AsLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (dtype < 0 || dtype >= NDTYPES || op < 0 || op >= NOPS) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: unknown dtype or op code");
        return NULL;
    }
    Py_buffer out, lower, higher;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[3], &lower, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&out); return NULL; }
    if (PyObject_GetBuffer(args[4], &higher, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&lower);
        return NULL;
    }
    int ok = -1;
    if (out.len == lower.len && out.len == higher.len && out.len % ITEMSIZE[dtype] == 0)
        ok = combine(dtype, op, out.buf, lower.buf, higher.buf, out.len / ITEMSIZE[dtype]);
    PyBuffer_Release(&out);
    PyBuffer_Release(&lower);
    PyBuffer_Release(&higher);
    if (ok < 0) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: combine needs three buffers of one length");
        return NULL;
    }
    return PyBool_FromLong(ok);
}

/* Release the first `count` views of `views`. */
static void release_views(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

/* reduce_into(dtype, op, inputs, outputs): outputs[0][:] = inputs[0] op inputs[1] op ... in order, then
 * copied into outputs[1] if given, for buffers of one length (at most MAX_KERNEL_RANKS inputs and 2
 * outputs; outputs[0] overlaps no input but may be inputs[0] or inputs[1] exactly: the first combination reads
 * both at each element before it writes it; outputs[1] may be any input), through reduce_parts: the pipelined steps
 * reduce a rank's part of a piece with it, reading its own input in place from its buffer and writing the
 * result into its slot and its buffer. False if this dtype does not take the op here. */
static PyObject *module_reduce_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyTuple_Check(args[2]) || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "reduce_into(dtype, op, inputs: tuple, outputs: tuple)");
        return NULL;
    }
    int dtype = (int)PyLong_AsLong(args[0]), op = (int)PyLong_AsLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t nin = PyTuple_GET_SIZE(args[2]), nout = PyTuple_GET_SIZE(args[3]);
    if (nin > MAX_KERNEL_RANKS) Py_RETURN_FALSE;  /* more ranks than the kernel takes: Python reduces */
    if (dtype < 0 || dtype >= NDTYPES || op < 0 || op >= NOPS || nin < 1 || nout < 1 || nout > 2) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: reduce_into's codes or counts are out of range");
        return NULL;
    }
    Py_buffer views[MAX_KERNEL_RANKS + 2];
    const uint8_t *ins[MAX_KERNEL_RANKS];
    uint8_t *outs[2];
    int held = 0, ok = -1;
    for (Py_ssize_t i = 0; i < nin + nout; i++) {
        PyObject *obj = i < nin ? PyTuple_GET_ITEM(args[2], i) : PyTuple_GET_ITEM(args[3], i - nin);
        if (PyObject_GetBuffer(obj, &views[i], i < nin ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0) goto out;
        if (++held, views[i].len != views[0].len) break;
        if (i < nin) ins[i] = views[i].buf; else outs[i - nin] = views[i].buf;
    }
    if (held == nin + nout && views[0].len % ITEMSIZE[dtype] == 0) {
        Py_ssize_t n = views[0].len / ITEMSIZE[dtype];
        Py_BEGIN_ALLOW_THREADS
        ok = reduce_parts(dtype, op, ins, (int)nin, outs, (int)nout, n);
        Py_END_ALLOW_THREADS
    }
out:
    release_views(views, held);
    if (ok < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "arena kernel: reduce_into needs buffers of one length");
        return NULL;
    }
    return PyBool_FromLong(ok);
}

/* copy(dst, src[, backwards]): dst[:] = src for two buffers of one length that do not overlap, with tcoll's
 * own copy (_native/copy.h: the same speed at every alignment), the GIL released for large ones. The
 * arena's pipelined steps copy their pieces with it. `backwards` (tests, benchmarks/copy_offsets.py) forces
 * the direction in the aliasing window instead of the one calibrated when the module loaded. */
static PyObject *module_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src[, backwards])");
        return NULL;
    }
    int backwards = nargs == 3 ? PyObject_IsTrue(args[2]) : tc_backwards;
    if (backwards < 0) return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&dst); return NULL; }
    int same = dst.len == src.len;
    if (same && dst.len >= COPY_UNLOCKED) {
        Py_BEGIN_ALLOW_THREADS
        tc_copy_way(dst.buf, src.buf, (size_t)dst.len, backwards);
        Py_END_ALLOW_THREADS
    } else if (same) {
        tc_copy_way(dst.buf, src.buf, (size_t)dst.len, backwards);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (!same) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: copy needs two buffers of one length");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))module_copy, METH_FASTCALL, "dst[:] = src, tcoll's own copy (see the source)."},
    {"combine", (PyCFunction)(void (*)(void))module_combine, METH_FASTCALL, "out = lower op higher (see the source)."},
    {"reduce_into", (PyCFunction)(void (*)(void))module_reduce_into, METH_FASTCALL,
     "outputs[0] = the inputs reduced in order, copied to outputs[1] (see the source)."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef Kernel_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Kernel_run, METH_FASTCALL, "One small reduction step (see the module)."},
    {"run_broadcast", (PyCFunction)(void (*)(void))Kernel_run_broadcast, METH_FASTCALL,
     "A broadcast's one step (see step_broadcast)."},
    {"run_split", (PyCFunction)(void (*)(void))Kernel_run_split, METH_FASTCALL,
     "A call that fits a slot, in three steps (see the source)."},
    {"run_pieces", (PyCFunction)(void (*)(void))Kernel_run_pieces, METH_FASTCALL,
     "A large all_reduce's or reduce's pieces, from a phase on (see pieces.h)."},
    {"run_broadcast_pieces", (PyCFunction)(void (*)(void))Kernel_run_broadcast_pieces, METH_FASTCALL,
     "A broadcast's slot-sized pieces, streamed, from a phase on (see pieces.h)."},
    {"run_gather_pieces", (PyCFunction)(void (*)(void))Kernel_run_gather_pieces, METH_FASTCALL,
     "A gather's slot-sized pieces, streamed, from a phase on (see pieces.h)."},
    {"scatter_write", (PyCFunction)(void (*)(void))Kernel_scatter_write, METH_FASTCALL,
     "A scatter root's step in Python's steps, streamed (see stream_shares)."},
    {"scatter_read", (PyCFunction)(void (*)(void))Kernel_scatter_read, METH_FASTCALL,
     "A scatter's other rank in Python's steps: its share as root streams it (see read_stream_at)."},
    {"run_scatter", (PyCFunction)(void (*)(void))Kernel_run_scatter, METH_FASTCALL,
     "A scatter's step and its closing one, for chunks that fit the first step (see step_scatter)."},
    {"run_blocks", (PyCFunction)(void (*)(void))Kernel_run_blocks, METH_FASTCALL,
     "An all_gather's, gather's, all_to_all's or reduce_scatter's one step (see step_blocks)."},
    {"retire", (PyCFunction)Kernel_retire, METH_NOARGS, "The arena closes: express calls no longer use it."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tcoll.shm._arena_kernel.Kernel",
    .tp_basicsize = sizeof(Kernel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The small-reduction step of one arena, over addresses of its mapping.",
    .tp_methods = Kernel_methods,
    .tp_init = (initproc)Kernel_init,
    .tp_new = Kernel_new,
    .tp_dealloc = (destructor)Kernel_dealloc,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tcoll.shm._arena_kernel", "The arena's small-reduction step in C.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

/* part_bounds for Python, so that a test holds it to tcoll.algos.topology.part_bounds. */
static PyObject *module_part_bounds(PyObject *self, PyObject *args) {
    Py_ssize_t count, lo, hi;
    int parts, index;
    if (!PyArg_ParseTuple(args, "nii", &count, &parts, &index)) return NULL;
    if (parts < 1 || index < 0 || index >= parts || count < 0) {
        PyErr_SetString(PyExc_ValueError, "part_bounds: needs count >= 0 and 0 <= index < parts");
        return NULL;
    }
    part_bounds(count, parts, index, &lo, &hi);
    return Py_BuildValue("nn", lo, hi);
}

static PyMethodDef shared_methods[] = {
    {"part_bounds", module_part_bounds, METH_VARARGS, "(lo, hi) of part index of count cut into parts."},
    {NULL, NULL, 0, NULL},
};

/* The constants this file shares with Python: tcoll.shm.arena compares them at import (check_kernel). */
static int add_shared(PyObject *m) {

    static const char *dtypes[NDTYPES] = {"float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                                          "uint16", "uint32", "uint64", "float16", "bfloat16"};
    static const char *ops[NOPS] = {"sum", "prod", "min", "max", "band", "bor", "bxor"};
    PyObject *names = PyTuple_New(NDTYPES), *op_names = PyTuple_New(NOPS);
    if (names == NULL || op_names == NULL) goto fail;
    for (int i = 0; i < NDTYPES; i++) PyTuple_SET_ITEM(names, i, PyUnicode_FromString(dtypes[i]));
    for (int i = 0; i < NOPS; i++) PyTuple_SET_ITEM(op_names, i, PyUnicode_FromString(ops[i]));
    if (PyModule_AddObject(m, "DTYPES", names) < 0) goto fail;
    names = NULL;
    if (PyModule_AddObject(m, "OPS", op_names) < 0) goto fail;
    op_names = NULL;
    if (PyModule_AddIntConstant(m, "SETS", SETS) < 0 || PyModule_AddIntConstant(m, "DESC_WORDS", DESC_WORDS) < 0 ||
        PyModule_AddIntConstant(m, "PROGRESS_LINE", PROGRESS_LINE) < 0 ||
        PyModule_AddIntConstant(m, "REVISION", REVISION) < 0)
        return -1;
    return PyModule_AddFunctions(m, shared_methods);
fail:
    Py_XDECREF(names);
    Py_XDECREF(op_names);
    return -1;
}

PyMODINIT_FUNC PyInit__arena_kernel(void) {
    SIXTY_FOUR = PyLong_FromLong(64);
    if (SIXTY_FOUR == NULL || PyType_Ready(&KernelType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&KernelType);
    if (PyModule_AddObject(m, "Kernel", (PyObject *)&KernelType) < 0) {
        Py_DECREF(&KernelType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "NOT_STARTED", NOT_STARTED);
    PyModule_AddIntConstant(m, "PUBLISHED", PUBLISHED);
    PyModule_AddIntConstant(m, "DONE", DONE);
    PyModule_AddIntConstant(m, "REDUCED", REDUCED);
    PyModule_AddIntConstant(m, "BLOCKS_ALL_GATHER", BLOCKS_ALL_GATHER);
    PyModule_AddIntConstant(m, "BLOCKS_GATHER", BLOCKS_GATHER);
    PyModule_AddIntConstant(m, "BLOCKS_SCATTER", BLOCKS_SCATTER);
    PyModule_AddIntConstant(m, "DESCRIPTION_BYTES", DESCRIPTION_BYTES);
    PyModule_AddIntConstant(m, "BLOCKS_ALL_TO_ALL", BLOCKS_ALL_TO_ALL);
    PyModule_AddIntConstant(m, "BLOCKS_REDUCE_SCATTER", BLOCKS_REDUCE_SCATTER);
    double forward_ns = 0.0, backward_ns = 0.0;
#if defined(__x86_64__)
    tc_copy_calibrate(&forward_ns, &backward_ns);
    PyModule_AddIntConstant(m, "COPY_BACKWARDS", tc_backwards);
#else
    PyModule_AddIntConstant(m, "COPY_BACKWARDS", 0);
#endif
    /* what the calibration measured (ns for 256 KiB at distance 16): benchmarks/copy_offsets.py prints it */
    PyModule_AddObject(m, "COPY_CALIBRATION", Py_BuildValue("(dd)", forward_ns, backward_ns));
    if (add_shared(m) < 0 || add_express(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
