/* The lean blocking point-to-point path over tcoll's shared-memory rings, in C.
 *
 * A blocking send between two ranks of one host is, in the common case, a
 * 40-byte header and the payload written into the peer's ring and the ring's
 * head published; a blocking receive is the next header of our ring found to
 * be the one asked for and its payload copied out. tcoll.transport.shm.channel's
 * ShmChannel does the same through the engine (a Work per message, matching
 * queues, the progress loop), about ten microseconds per round trip; this
 * kernel does only the common case, in one call, and reports anything else
 * (no room, another message first, one not complete within its spin, a buffer
 * it will not take) without touching the ring, so that Python goes the
 * ordinary way, which handles every case and every error.
 *
 * The ring layout and the header are tcoll.transport.shm.rings' and
 * tcoll.p2p.channel.HEADER's ("<IIqQQQ": magic, ctx, tag, nbytes, stamp low,
 * stamp high). The caller holds the engine's lock. The stream positions live
 * only in the rings' control words (this rank is the only writer of its
 * outbound head and inbound tail): each call reads its position there and
 * publishes the new one, so no copy elsewhere can fall behind.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "../../_native/copy.h"
#include "../../_native/polling.h"

#define HEADER_BYTES 40  /* tcoll.p2p.channel.HEADER.size and MAGIC: compared at import (check_ring_kernel) */
#define MAGIC 0x7C011002u
#define HEAD_WORD 0  /* the ring's control words as uint64: head on the first cache line */
#define TAIL_WORD 8  /* tail on the second */

/* What recv() returns instead of a stream position. */
enum { NOTHING_YET = -1, NOT_MINE = -2 };
/* What send() returns instead of a stream position. */
enum { NO_ROOM = -1 };

enum { IN_CTL, IN_DATA, OUT_CTL, OUT_DATA, PEER_BELL, NVIEWS };

typedef struct {
    PyObject_HEAD
    /* Exports of the two rings (control words, data) and of the peer's doorbell: they keep the mappings
     * alive while this object lives, whoever closes the segments meanwhile. */
    Py_buffer views[NVIEWS];
    int held;  /* how many of views are held */
    uint64_t *in_ctl, *out_ctl;
    uint8_t *in_data, *out_data;
    uint64_t in_size, out_size;
    uint32_t *peer_bell;
} Rings;

static void ring_write(uint8_t *data, uint64_t size, uint64_t pos, const void *src, uint64_t count) {
    uint64_t at = pos % size;
    uint64_t first = count < size - at ? count : size - at;
    tc_copy(data + at, src, first);  /* tcoll's copy: the same speed at every alignment (copy.h) */
    if (first < count) tc_copy(data, (const uint8_t *)src + first, count - first);
}

static void ring_read(const uint8_t *data, uint64_t size, uint64_t pos, void *dst, uint64_t count) {
    uint64_t at = pos % size;
    uint64_t first = count < size - at ? count : size - at;
    tc_copy(dst, data + at, first);
    if (first < count) tc_copy((uint8_t *)dst + first, data, count - first);
}

static void Rings_release(Rings *self) {
    for (int i = 0; i < self->held; i++) PyBuffer_Release(&self->views[i]);
    self->held = 0;
}

static void Rings_dealloc(Rings *self) {
    Rings_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Rings(in_ctl, in_data, out_ctl, out_data, peer_bell): writable buffers over our inbound ring (the peer
 * writes it), the peer's ring that we write, and the peer's doorbell. */
static int Rings_init(Rings *self, PyObject *args, PyObject *kwds) {
    (void)kwds;
    PyObject *objects[NVIEWS];
    if (!PyArg_ParseTuple(args, "OOOOO", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4]))
        return -1;
    Rings_release(self);
    for (int i = 0; i < NVIEWS; i++) {
        if (PyObject_GetBuffer(objects[i], &self->views[i], PyBUF_WRITABLE) < 0) {
            Rings_release(self);
            return -1;
        }
        self->held = i + 1;
    }
    if (self->views[IN_CTL].len < 8 * (TAIL_WORD + 1) || self->views[OUT_CTL].len < 8 * (TAIL_WORD + 1) ||
        self->views[IN_DATA].len < HEADER_BYTES || self->views[OUT_DATA].len < HEADER_BYTES ||
        self->views[PEER_BELL].len < 8) {
        Rings_release(self);
        PyErr_SetString(PyExc_ValueError, "ring kernel: a ring or doorbell is smaller than its layout");
        return -1;
    }
    self->in_ctl = (uint64_t *)self->views[IN_CTL].buf;
    self->out_ctl = (uint64_t *)self->views[OUT_CTL].buf;
    self->in_data = (uint8_t *)self->views[IN_DATA].buf;
    self->out_data = (uint8_t *)self->views[OUT_DATA].buf;
    self->in_size = (uint64_t)self->views[IN_DATA].len;
    self->out_size = (uint64_t)self->views[OUT_DATA].len;
    self->peer_bell = (uint32_t *)self->views[PEER_BELL].buf;
    return 0;
}

/* A contiguous buffer of plain data (no Python objects in it), or 0 with no error set. */
static int plain_buffer(PyObject *obj, Py_buffer *view, int flags) {
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_FORMAT) < 0) {
        PyErr_Clear();  /* not ours to judge: the ordinary path names what is wrong with it */
        return 0;
    }
    if (view->format != NULL && strchr(view->format, 'O') != NULL) {  /* object pointers are no data */
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* Check a call's argument count and this object, and read its first two arguments (ctx, a uint32, and
 * tag) as uint64; -1 with the error set if any of that fails. */
static int begin_call(const Rings *self, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected,
                      const char *usage, uint64_t *ctx_tag) {
    if (nargs != expected) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (self->held != NVIEWS) {
        PyErr_SetString(PyExc_ValueError, "ring kernel: not initialised");
        return -1;
    }
    for (int i = 0; i < 2; i++) {
        ctx_tag[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (ctx_tag[i] == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    if (ctx_tag[0] > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "ring kernel: a context is a 32-bit number");
        return -1;
    }
    return 0;
}

/* send(ctx, tag, buf): write one message into the peer's ring at its head, publish the new head and ring
 * the peer; the new head, or NO_ROOM (nothing written: no room now, or not a buffer it takes). */
static PyObject *Rings_send(Rings *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t ctx_tag[2];
    if (begin_call(self, args, nargs, 3, "send(ctx, tag, buf)", ctx_tag) < 0) return NULL;
    uint64_t head = __atomic_load_n(&self->out_ctl[HEAD_WORD], __ATOMIC_RELAXED);  /* ours: we wrote it */
    Py_buffer view;
    if (!plain_buffer(args[2], &view, PyBUF_C_CONTIGUOUS)) return PyLong_FromLong(NO_ROOM);
    uint64_t nbytes = (uint64_t)view.len;
    uint64_t tail = __atomic_load_n(&self->out_ctl[TAIL_WORD], __ATOMIC_ACQUIRE);
    if (HEADER_BYTES + nbytes > self->out_size - (head - tail)) {
        PyBuffer_Release(&view);
        return PyLong_FromLong(NO_ROOM);
    }
    uint8_t header[HEADER_BYTES] = {0};  /* a user message: stamp 0 */
    uint32_t magic = MAGIC, ctx = (uint32_t)ctx_tag[0];
    memcpy(header, &magic, 4);
    memcpy(header + 4, &ctx, 4);
    memcpy(header + 8, &ctx_tag[1], 8);
    memcpy(header + 16, &nbytes, 8);
    ring_write(self->out_data, self->out_size, head, header, HEADER_BYTES);
    ring_write(self->out_data, self->out_size, head + HEADER_BYTES, view.buf, nbytes);
    PyBuffer_Release(&view);
    head += HEADER_BYTES + nbytes;
    __atomic_store_n(&self->out_ctl[HEAD_WORD], head, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the head is visible before we look for a sleeper */
    ring_doorbell(self->peer_bell);
    return PyLong_FromUnsignedLongLong(head);
}

/* Poll our ring's head until `want` bytes past `tail` have arrived or `budget_ns` passes. */
static uint64_t wait_bytes(const Rings *self, uint64_t tail, uint64_t want, uint64_t budget_ns, int yield) {
    uint64_t head = __atomic_load_n(&self->in_ctl[HEAD_WORD], __ATOMIC_ACQUIRE);
    if (head - tail >= want || budget_ns == 0) return head;
    Py_BEGIN_ALLOW_THREADS  /* a peer that is a thread of this process must be able to write meanwhile */
    uint64_t start = now_ns();
    for (;;) {
        head = __atomic_load_n(&self->in_ctl[HEAD_WORD], __ATOMIC_ACQUIRE);
        if (head - tail >= want || now_ns() - start >= budget_ns) break;
        if (yield) sched_yield();
        else cpu_relax();
    }
    Py_END_ALLOW_THREADS
    return head;
}

/* Whether the header at `tail` is a user message (ctx, tag) of at most `capacity` bytes that the ring can
 * hold whole; its size in *nbytes. */
static int header_is_mine(const Rings *self, uint64_t tail, uint32_t ctx, uint64_t tag, uint64_t capacity,
                          uint64_t *nbytes) {
    uint8_t header[HEADER_BYTES];
    uint32_t magic, their_ctx;
    uint64_t their_tag;
    ring_read(self->in_data, self->in_size, tail, header, HEADER_BYTES);
    memcpy(&magic, header, 4);
    memcpy(&their_ctx, header + 4, 4);
    memcpy(&their_tag, header + 8, 8);
    memcpy(nbytes, header + 16, 8);
    return magic == MAGIC && their_ctx == ctx && their_tag == tag && *nbytes <= capacity &&
           *nbytes <= self->in_size - HEADER_BYTES;
}

/* recv(ctx, tag, buf, spin_ns, yield): take the message at our ring's tail if it is (ctx, tag) and fits
 * `buf`, polling up to spin_ns for it (yielding the core at each poll if asked); the new tail, or
 * NOTHING_YET (no header came) or NOT_MINE (another message, one too large, one not complete in time, or
 * a buffer it will not take): then nothing was taken. */
static PyObject *Rings_recv(Rings *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t ctx_tag[2];
    if (begin_call(self, args, nargs, 5, "recv(ctx, tag, buf, spin_ns, yield)", ctx_tag) < 0) return NULL;
    uint64_t budget_ns = PyLong_AsUnsignedLongLong(args[3]);
    int yield = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred()) return NULL;
    uint64_t tail = __atomic_load_n(&self->in_ctl[TAIL_WORD], __ATOMIC_RELAXED), nbytes;  /* ours: we wrote it */
    Py_buffer view;
    if (!plain_buffer(args[2], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) return PyLong_FromLong(NOT_MINE);
    uint64_t start = now_ns();
    uint64_t head = wait_bytes(self, tail, HEADER_BYTES, budget_ns, yield);
    long outcome = NOTHING_YET;
    if (head - tail < HEADER_BYTES) goto out;
    outcome = NOT_MINE;
    if (!header_is_mine(self, tail, (uint32_t)ctx_tag[0], ctx_tag[1], (uint64_t)view.len, &nbytes))
        goto out;
    if (head - tail < HEADER_BYTES + nbytes) {
        uint64_t spent = now_ns() - start;
        head = wait_bytes(self, tail, HEADER_BYTES + nbytes, spent < budget_ns ? budget_ns - spent : 0, yield);
        if (head - tail < HEADER_BYTES + nbytes) goto out;
    }
    ring_read(self->in_data, self->in_size, tail + HEADER_BYTES, view.buf, nbytes);
    PyBuffer_Release(&view);
    tail += HEADER_BYTES + nbytes;
    __atomic_store_n(&self->in_ctl[TAIL_WORD], tail, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the tail is visible before we look for a sleeper */
    ring_doorbell(self->peer_bell);  /* the peer may wait for room */
    return PyLong_FromUnsignedLongLong(tail);
out:
    PyBuffer_Release(&view);
    return PyLong_FromLong(outcome);
}

static PyMethodDef Rings_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Rings_send, METH_FASTCALL, "Write one message if it fits now."},
    {"recv", (PyCFunction)(void (*)(void))Rings_recv, METH_FASTCALL, "Take the next message if it is the one."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tcoll.transport.shm._ring_kernel.Rings",
    .tp_basicsize = sizeof(Rings),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The two rings between this rank and one peer, for the lean blocking send and receive.",
    .tp_methods = Rings_methods,
    .tp_init = (initproc)Rings_init,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Rings_dealloc,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tcoll.transport.shm._ring_kernel", "The lean blocking send and receive in C.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ring_kernel(void) {
    if (PyType_Ready(&RingsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RingsType);
    if (PyModule_AddObject(m, "Rings", (PyObject *)&RingsType) < 0) {
        Py_DECREF(&RingsType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "NO_ROOM", NO_ROOM);
    PyModule_AddIntConstant(m, "NOTHING_YET", NOTHING_YET);
    PyModule_AddIntConstant(m, "NOT_MINE", NOT_MINE);
    PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES);
    PyModule_AddIntConstant(m, "MAGIC", (long)MAGIC);
#if defined(__x86_64__)
    double forward_ns, backward_ns;
    tc_copy_calibrate(&forward_ns, &backward_ns);  /* the direction in the aliasing window (copy.h) */
#endif
    return m;
}
