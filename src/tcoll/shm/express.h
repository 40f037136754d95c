/* The express call: an ordinary blocking reduction, broadcast or block collective repeated on the same buffers, whole,
 * in one C call.
 *
 * Included by _arena_kernel.c after the steps it runs (step_small, step_split, step_broadcast, step_blocks).
 * tcoll.shm.express says when a call may take it and builds it; this file is what runs.
 *
 * A repeated `comm.all_reduce(x)` on a small array spends about two microseconds in Python around the
 * half microsecond of its arena step: numbering, registering the call with the agreement, describing
 * it, choosing the path, recording it. Everything that can vary between two such calls is either
 * checked here (the buffer is the same object, dtype, address and length; nothing waits in the
 * agreement's queues) or shuts the communicator's Gate when it changes (a notice, an alarm, a revoke,
 * a failed call, a closed arena: tcoll.comm.agreement and tcoll.comm.dispatch). The express call does
 * what the Python path does on success, in the same order: it takes the call's number before the step
 * (as Agreement.begin does, so that a notice about it is about a call under way or done), runs the
 * step, records, and returns the result. Whenever the kernel cannot finish (a peer that did not come
 * within the spin, a descriptor that differs), it shuts the gate, leaves the state it reached in
 * `arena.pending` and returns HANDED_OVER: the Python path goes on with the same call from there
 * (Dispatcher.resume), with its full waiting, liveness and error reporting. A hand-over that Python
 * never took (an exception in between) is failed at this rank's next call (Dispatcher._fail_abandoned).
 */

/* A communicator's gate: the kernel its express calls may step on now, or NULL (shut). */
typedef struct {
    PyObject_HEAD
    Kernel *kernel;
    PyObject *early;  /* the engine watch's messages that came before their call (a dict: must be empty) */
    PyObject *ahead;  /* the agreement's notices for calls not started yet (a dict: must be empty) */
} Gate;

static void Gate_dealloc(Gate *self) {
    Py_XDECREF(self->kernel);
    Py_XDECREF(self->early);
    Py_XDECREF(self->ahead);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Gate(early, ahead): shut at first. */
static int Gate_init(Gate *self, PyObject *args, PyObject *kwds) {
    (void)kwds;
    PyObject *early, *ahead;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &early, &PyDict_Type, &ahead)) return -1;
    Py_INCREF(early);
    Py_INCREF(ahead);
    Py_XSETREF(self->early, early);
    Py_XSETREF(self->ahead, ahead);
    Py_CLEAR(self->kernel);
    return 0;
}

/* open(kernel): let express calls step on `kernel`; whether it opened (only on a Kernel: shut otherwise). */
static PyObject *Gate_open(Gate *self, PyObject *kernel) {
    if (!PyObject_TypeCheck(kernel, &KernelType) || ((Kernel *)kernel)->retired) {
        Py_CLEAR(self->kernel);
        Py_RETURN_FALSE;
    }
    Py_INCREF(kernel);
    Py_XSETREF(self->kernel, (Kernel *)kernel);
    Py_RETURN_TRUE;
}

static PyObject *Gate_shut(Gate *self, PyObject *unused) {
    (void)unused;
    Py_CLEAR(self->kernel);
    Py_RETURN_NONE;
}

static PyObject *Gate_is_open(Gate *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->kernel != NULL && !self->kernel->retired);
}

static PyMethodDef Gate_methods[] = {
    {"open", (PyCFunction)Gate_open, METH_O, "Let express calls step on this kernel (the arena's); whether it opened."},
    {"shut", (PyCFunction)Gate_shut, METH_NOARGS, "No express call until the gate is opened again."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Gate_getset[] = {
    {"is_open", (getter)Gate_is_open, NULL, "Whether express calls may run now.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tcoll.shm._arena_kernel.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Whether a communicator's express calls may run (see express.h).",
    .tp_methods = Gate_methods,
    .tp_getset = Gate_getset,
    .tp_init = (initproc)Gate_init,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Gate_dealloc,
};

/* One repeated call, bound: what it runs on, what it checks, and where it writes what the Python path would. */
typedef struct {
    PyObject_HEAD
    Gate *gate;
    Kernel *kernel;
    PyObject *x;          /* the caller's array: the same object every time */
    PyObject *dtype;      /* its dtype then (the same object every time) */
    PyObject *result;     /* what the call returns */
    PyObject *arena;      /* tcoll.shm.arena.Arena: step, first, pending */
    PyObject *dispatcher; /* tcoll.comm.dispatch.Dispatcher: sequence, current */
    PyObject *watch;      /* tcoll.p2p.watch.BlockWatch: high */
    PyObject *prepared;   /* the Prepared call, for dispatcher.current (the hang report) */
    PyObject *seqs;       /* the agreement's ring of recent calls: sequence numbers (list of 64) */
    PyObject *calls;      /* ... and their (label, stamp) (list of 64) */
    PyObject *said;       /* this call's (label, stamp) */
    void *buf;
    Py_ssize_t len;
    int dtype_code, op, want, split, yield;
    int root;             /* a broadcast's root (its one step: step_broadcast); -1: a reduction */
    int blocks;           /* a block collective's kind (its one step: step_blocks), or -1 */
    int lending;          /* ... large enough to lend: its step ends with the lenders' (Blocks) */
    PyObject *out;        /* ... its output array, the same object every time (NULL: none) */
    PyObject *shape, *out_shape, *out_dtype;  /* ... x's shape, out's shape and dtype then (they decide the result) */
    void *out_buf;
    Py_ssize_t out_len, block;
    uint8_t header[DESCRIPTION_BYTES];  /* a scatter's description: root writes it, the others expect it */
    uint64_t stamp_low, stamp_high, spin_ns, generation;
    unsigned long long completed;  /* calls it ran whole (tests, and whoever asks why a call was fast) */
} Express;

#define RING 64  /* entries of the agreement's ring of recent calls (tcoll.comm.agreement.RING) */

/* Bumped by forget_all(): every express call made before it stops (a setting its choice of steps depends on
 * changed: tcoll.shm.vector.set_one_step_limit); the Python path makes new ones. */
static uint64_t express_generation = 1;

static PyObject *S_shape, *S_dtype, *S_step, *S_first, *S_pending, *S_sequence, *S_current, *S_high;
static PyObject *HANDED_OVER;  /* what run() returns when the Python path must go on with the call */

static int Express_traverse(Express *self, visitproc visit, void *arg) {
    Py_VISIT(self->gate);
    Py_VISIT(self->kernel);
    Py_VISIT(self->x);
    Py_VISIT(self->dtype);
    Py_VISIT(self->result);
    Py_VISIT(self->arena);
    Py_VISIT(self->dispatcher);
    Py_VISIT(self->watch);
    Py_VISIT(self->prepared);
    Py_VISIT(self->seqs);
    Py_VISIT(self->calls);
    Py_VISIT(self->said);
    Py_VISIT(self->out);
    Py_VISIT(self->shape);
    Py_VISIT(self->out_shape);
    Py_VISIT(self->out_dtype);
    return 0;
}

static int Express_clear(Express *self) {
    Py_CLEAR(self->gate);
    Py_CLEAR(self->kernel);
    Py_CLEAR(self->x);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->result);
    Py_CLEAR(self->arena);
    Py_CLEAR(self->dispatcher);
    Py_CLEAR(self->watch);
    Py_CLEAR(self->prepared);
    Py_CLEAR(self->seqs);
    Py_CLEAR(self->calls);
    Py_CLEAR(self->said);
    Py_CLEAR(self->out);
    Py_CLEAR(self->shape);
    Py_CLEAR(self->out_shape);
    Py_CLEAR(self->out_dtype);
    return 0;
}

static void Express_dealloc(Express *self) {
    PyObject_GC_UnTrack(self);
    Express_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Express(gate, kernel, x, result, arena, dispatcher, watch, prepared, seqs, calls, label, stamp,
 *         dtype_code, op, want, split, spin_ns, yield, root, blocks, out, block, lending, header): root -1 for a
 *         reduction, else a broadcast's (or a block collective's); blocks -1, or a block collective's kind
 *         (BLOCKS_*), which reads x (want 0) and writes `out`, blocks of `block` bytes (see Blocks: lending);
 *         header: a scatter's description (DESCRIPTION_BYTES: root's, or what the others expect), else None */
static int Express_init(Express *self, PyObject *args, PyObject *kwds) {
    (void)kwds;
    PyObject *gate, *kernel, *x, *result, *arena, *dispatcher, *watch, *prepared, *seqs, *calls, *label, *stamp;
    PyObject *out, *header;
    int dtype_code, op, want, split, yield, root, blocks, lending;
    unsigned long long spin_ns;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "O!O!OOOOOOO!O!UOiippKpiiOnpO", &GateType, &gate, &KernelType, &kernel, &x, &result,
                          &arena, &dispatcher, &watch, &prepared, &PyList_Type, &seqs, &PyList_Type, &calls, &label,
                          &stamp, &dtype_code, &op, &want, &split, &spin_ns, &yield, &root, &blocks, &out, &block,
                          &lending, &header))
        return -1;
    if ((blocks == BLOCKS_SCATTER) != (header != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "Express: a scatter, and only a scatter, has a header");
        return -1;
    }
    if (header != Py_None) {
        Py_buffer described;
        if (PyObject_GetBuffer(header, &described, PyBUF_SIMPLE) < 0) return -1;
        int whole = described.len == DESCRIPTION_BYTES;
        if (whole) memcpy(self->header, described.buf, DESCRIPTION_BYTES);
        PyBuffer_Release(&described);
        if (!whole) {
            PyErr_SetString(PyExc_ValueError, "Express: a scatter's header is DESCRIPTION_BYTES long");
            return -1;
        }
    }
    int gather_off_root = blocks == BLOCKS_GATHER && root != ((Kernel *)kernel)->rank;
    if (blocks >= BLOCKS_KINDS || (blocks >= 0 && (split || want || root < 0 || (out == Py_None) != gather_off_root))) {
        PyErr_SetString(PyExc_ValueError, "Express: a block collective has one step, reads x and writes out "
                                          "(but a gather's other ranks), and has a root");
        return -1;
    }
    if (root < -1 || root >= ((Kernel *)kernel)->size || (root >= 0 && split)) {
        PyErr_SetString(PyExc_ValueError, "Express: the root is not a rank (or a broadcast was given three steps)");
        return -1;
    }
    if (((Gate *)gate)->early == NULL) {
        PyErr_SetString(PyExc_ValueError, "Express: the gate was not initialised");
        return -1;
    }
    if (dtype_code < 0 || dtype_code >= NDTYPES || op < 0 || op >= NOPS || PyList_GET_SIZE(seqs) != RING ||
        PyList_GET_SIZE(calls) != RING) {
        PyErr_SetString(PyExc_ValueError, "Express: unknown dtype or op code, or a ring that is not 64 long");
        return -1;
    }
    uint64_t low, high;
    if (stamp_words(stamp, &low, &high) < 0) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(x, &view, want ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    int fits = view.len <= ((Kernel *)kernel)->slot_bytes && view.len % ITEMSIZE[dtype_code] == 0;
    self->buf = view.buf;
    self->len = view.len;
    PyBuffer_Release(&view);
    void *out_buf = NULL;
    Py_ssize_t out_len = -1;
    if (fits && blocks >= 0) {
        Blocks b = {blocks, root, block, blocks_share((Kernel *)kernel, blocks, dtype_code), NULL, lending,
                    header == Py_None ? NULL : self->header};
        if (out != Py_None) {
            if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE) < 0) return -1;
            out_buf = view.buf;
            out_len = view.len;
            PyBuffer_Release(&view);
        }
        fits = blocks_fit((Kernel *)kernel, &b, dtype_code, self->len, out_len);
    }
    if (!fits) {
        PyErr_SetString(PyExc_ValueError,
                        "Express: the buffer does not fit a slot or its dtype (or the blocks one step)");
        return -1;
    }
    PyObject *dtype = PyObject_GetAttr(x, S_dtype);
    if (dtype == NULL) return -1;
    PyObject *said = PyTuple_Pack(2, label, stamp);
    if (said == NULL) { Py_DECREF(dtype); return -1; }
    Express_clear(self);
    self->dtype = dtype;
    self->said = said;
    Py_INCREF(gate); self->gate = (Gate *)gate;
    Py_INCREF(kernel); self->kernel = (Kernel *)kernel;
    Py_INCREF(x); self->x = x;
    Py_INCREF(result); self->result = result;
    Py_INCREF(arena); self->arena = arena;
    Py_INCREF(dispatcher); self->dispatcher = dispatcher;
    Py_INCREF(watch); self->watch = watch;
    Py_INCREF(prepared); self->prepared = prepared;
    Py_INCREF(seqs); self->seqs = seqs;
    Py_INCREF(calls); self->calls = calls;
    self->dtype_code = dtype_code;
    self->op = op;
    self->want = want;
    self->split = split;
    self->root = root;
    self->blocks = blocks;
    self->lending = (blocks >= 0 || root >= 0) && lending;  /* (a reduction never lends in the kernel) */
    if (blocks >= 0) {  /* a block call's result depends on the arrays' shapes too: kept, and compared at each run */
        if ((self->shape = PyObject_GetAttr(x, S_shape)) == NULL) return -1;
        if (out != Py_None) {
            Py_INCREF(out);
            self->out = out;
            if ((self->out_shape = PyObject_GetAttr(out, S_shape)) == NULL ||
                (self->out_dtype = PyObject_GetAttr(out, S_dtype)) == NULL)
                return -1;
        }
    }
    self->out_buf = out_buf;
    self->out_len = out_len;
    self->block = block;
    self->yield = yield;
    self->spin_ns = spin_ns;
    self->stamp_low = low;
    self->stamp_high = high;
    self->generation = express_generation;
    return 0;
}

/* An attribute that holds a non-negative int, as a C integer; -1 with the error set. */
static int get_count(PyObject *obj, PyObject *name, uint64_t *value) {
    PyObject *got = PyObject_GetAttr(obj, name);
    if (got == NULL) return -1;
    *value = PyLong_AsUnsignedLongLong(got);
    Py_DECREF(got);
    return PyErr_Occurred() ? -1 : 0;
}

static int set_count(PyObject *obj, PyObject *name, uint64_t value) {
    PyObject *number = PyLong_FromUnsignedLongLong(value);
    if (number == NULL) return -1;
    int rc = PyObject_SetAttr(obj, name, number);
    Py_DECREF(number);
    return rc;
}

/* Whether obj.shape equals `shape` (no error set either way). */
static int same_shape(PyObject *obj, PyObject *shape) {
    PyObject *now = PyObject_GetAttr(obj, S_shape);
    if (now == NULL) { PyErr_Clear(); return 0; }
    int same = PyObject_RichCompareBool(now, shape, Py_EQ);
    Py_DECREF(now);
    if (same < 0) { PyErr_Clear(); return 0; }
    return same;
}

/* Whether the call may run now: the gate is open on this express call's kernel, nothing waits in the
 * agreement, and `x` is the array it was made for, as it was (dtype, address, length, and a block call's
 * shape; writable if the result goes into it). The view is acquired when it returns 1. */
static int may_run(Express *self, PyObject *x, Py_buffer *view) {
    Gate *gate = self->gate;
    if (x != self->x || gate->kernel != self->kernel || self->kernel->retired || PyDict_GET_SIZE(gate->early) ||
        PyDict_GET_SIZE(gate->ahead) || self->generation != express_generation)
        return 0;
    PyObject *dtype = PyObject_GetAttr(x, S_dtype);
    if (dtype == NULL) { PyErr_Clear(); return 0; }
    Py_DECREF(dtype);  /* (compared by identity only: self->dtype holds its own reference) */
    if (dtype != self->dtype || (self->shape != NULL && !same_shape(x, self->shape))) return 0;
    if (PyObject_GetBuffer(x, view, self->want ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {  /* read-only now */
        PyErr_Clear();
        return 0;
    }
    if (view->buf != self->buf || view->len != self->len) { PyBuffer_Release(view); return 0; }
    return 1;
}

/* A block collective's output, as it was when the call was bound (writable, same dtype, shape, address and
 * length); the view is acquired when it returns 1. */
static int out_ready(Express *self, Py_buffer *view) {
    PyObject *dtype = PyObject_GetAttr(self->out, S_dtype);
    if (dtype == NULL) { PyErr_Clear(); return 0; }
    Py_DECREF(dtype);  /* (compared by identity only) */
    if (dtype != self->out_dtype || !same_shape(self->out, self->out_shape)) return 0;
    if (PyObject_GetBuffer(self->out, view, PyBUF_WRITABLE) < 0) { PyErr_Clear(); return 0; }
    if (view->buf != self->out_buf || view->len != self->out_len) { PyBuffer_Release(view); return 0; }
    return 1;
}

/* Take the call's number, as Agreement.begin does before the call runs: on the dispatcher, and as the
 * engine's watch's highest call started (so that what arrives for it is for a call under way or done). */
static int take_number(Express *self, PyObject *number, uint64_t sequence) {
    uint64_t high;
    if (PyObject_SetAttr(self->dispatcher, S_sequence, number) < 0 || get_count(self->watch, S_high, &high) < 0)
        return -1;
    return high < sequence ? PyObject_SetAttr(self->watch, S_high, number) : 0;
}

/* What the Python path records of a call that finished well: the arena's steps, the hang report's last
 * call, the agreement's ring. */
static int record_done(Express *self, PyObject *number, uint64_t sequence, uint64_t step) {
    int rc = -1;
    int steps = self->split ? 3 : self->lending || self->blocks == BLOCKS_SCATTER ? 2 : 1;  /* (a scatter closes) */
    if (set_count(self->arena, S_step, step + steps) < 0 ||
        set_count(self->arena, S_first, step) < 0)
        return -1;
    PyObject *current = PyTuple_Pack(2, number, self->prepared);
    if (current == NULL) return -1;
    rc = PyObject_SetAttr(self->dispatcher, S_current, current);
    Py_DECREF(current);
    if (rc < 0) return -1;
    Py_ssize_t at = (Py_ssize_t)(sequence % RING);
    Py_INCREF(number);
    PyList_SetItem(self->seqs, at, number);  /* (steals the reference; cannot fail: at < RING) */
    Py_INCREF(self->said);
    PyList_SetItem(self->calls, at, self->said);
    return 0;
}

/* run(x): the call, whole; its result. None: it did not start (the Python path runs the call).
 * HANDED_OVER: it started (its number taken) and the Python path must go on with it from
 * arena.pending = sequence * 4 + how far the kernel got. */
static PyObject *Express_run(Express *self, PyObject *x) {
    RunArgs a;
    Py_buffer out;
    if (!may_run(self, x, &a.view)) Py_RETURN_NONE;
    int has_out = self->out != NULL;  /* (a block collective's; none on a gather's other ranks) */
    if (has_out && !out_ready(self, &out)) { PyBuffer_Release(&a.view); Py_RETURN_NONE; }
    uint64_t last;
    if (get_count(self->arena, S_step, &a.step) < 0 || get_count(self->dispatcher, S_sequence, &last) < 0) {
        PyBuffer_Release(&a.view);
        if (has_out) PyBuffer_Release(&out);
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *number = PyLong_FromUnsignedLongLong(last + 1);
    if (number == NULL || take_number(self, number, last + 1) < 0) {  /* (only out of memory) */
        Py_XDECREF(number);
        PyBuffer_Release(&a.view);
        if (has_out) PyBuffer_Release(&out);
        return NULL;
    }
    a.dtype = self->dtype_code;
    a.op = self->op;
    a.yield = self->yield;
    a.want = self->want;
    a.sequence = last + 1;
    a.spin_ns = self->spin_ns;
    a.stamp_low = self->stamp_low;
    a.stamp_high = self->stamp_high;
    Kernel *kernel = self->kernel;
    Py_INCREF(kernel);  /* (a thread that closes the communicator meanwhile retires it: it waits for this step) */
    kernel->busy++;
    long state;
    if (self->blocks >= 0) {
        Blocks b = {self->blocks, self->root, self->block, blocks_share(kernel, self->blocks, a.dtype),
                    has_out ? out.buf : NULL, self->lending, self->header};
        state = step_blocks(kernel, &a, &b);
    } else {
        state = self->root >= 0 ? step_broadcast(kernel, &a, self->root, self->lending)
                : self->split ? step_split(kernel, &a) : step_small(kernel, &a);
    }
    step_over(kernel);
    Py_DECREF(kernel);
    PyBuffer_Release(&a.view);
    if (has_out) PyBuffer_Release(&out);
    if (state != DONE) {  /* the Python path takes the call over where the kernel left it */
        Py_DECREF(number);
        Py_CLEAR(self->gate->kernel);  /* no express call until Python has dealt with this one */
        if (set_count(self->arena, S_pending, a.sequence * 4 + (uint64_t)state) < 0) return NULL;
        Py_INCREF(HANDED_OVER);
        return HANDED_OVER;
    }
    int rc = record_done(self, number, a.sequence, a.step);
    Py_DECREF(number);
    if (rc < 0) return NULL;
    self->completed++;
    Py_INCREF(self->result);
    return self->result;
}

/* usable(kernel): whether this express call still runs on `kernel` (the arena's now) and is of this
 * generation: if not, the Python path makes a new one. */
static PyObject *Express_usable(Express *self, PyObject *kernel) {
    return PyBool_FromLong((PyObject *)self->kernel == kernel && !self->kernel->retired &&
                           self->generation == express_generation);
}

static PyMethodDef Express_methods[] = {
    {"run", (PyCFunction)Express_run, METH_O, "The call, whole; its result, or None (see express.h)."},
    {"usable", (PyCFunction)Express_usable, METH_O, "Whether it still runs on this kernel (see the source)."},
    {NULL, NULL, 0, NULL},
};

/* forget_all(): every express call made so far stops; the Python path makes new ones. */
static PyObject *module_forget_all(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    express_generation++;
    Py_RETURN_NONE;
}

static PyMethodDef express_functions[] = {
    {"forget_all", module_forget_all, METH_NOARGS, "Every express call made so far stops (see express.h)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Express_members[] = {
    {"completed", T_ULONGLONG, offsetof(Express, completed), READONLY, "Calls it ran whole."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ExpressType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tcoll.shm._arena_kernel.Express",
    .tp_basicsize = sizeof(Express),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A repeated blocking reduction, broadcast, barrier or block collective, whole in one C call.",
    .tp_methods = Express_methods,
    .tp_members = Express_members,
    .tp_init = (initproc)Express_init,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)Express_traverse,
    .tp_clear = (inquiry)Express_clear,
    .tp_dealloc = (destructor)Express_dealloc,
};

/* Ready the two types and the attribute names; add the types to module `m`. */
static int add_express(PyObject *m) {
    S_dtype = PyUnicode_InternFromString("dtype");
    S_shape = PyUnicode_InternFromString("shape");
    S_step = PyUnicode_InternFromString("step");
    S_first = PyUnicode_InternFromString("first");
    S_pending = PyUnicode_InternFromString("pending");
    S_sequence = PyUnicode_InternFromString("sequence");
    S_current = PyUnicode_InternFromString("current");
    S_high = PyUnicode_InternFromString("high");
    if (!S_dtype || !S_shape || !S_step || !S_first || !S_pending || !S_sequence || !S_current || !S_high) return -1;
    HANDED_OVER = PyUnicode_InternFromString("handed over");  /* (a constant of the module: compared by identity) */
    if (HANDED_OVER == NULL || PyModule_AddObjectRef(m, "HANDED_OVER", HANDED_OVER) < 0) return -1;
    if (PyType_Ready(&GateType) < 0 || PyType_Ready(&ExpressType) < 0) return -1;
    Py_INCREF(&GateType);
    if (PyModule_AddObject(m, "Gate", (PyObject *)&GateType) < 0) { Py_DECREF(&GateType); return -1; }
    Py_INCREF(&ExpressType);
    if (PyModule_AddObject(m, "Express", (PyObject *)&ExpressType) < 0) { Py_DECREF(&ExpressType); return -1; }
    return PyModule_AddFunctions(m, express_functions);
}
