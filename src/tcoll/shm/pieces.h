/* The pipelined steps of calls larger than a slot, in C: the pieces of a large all_reduce / reduce
 * (tcoll.shm.large.reduce_large), and of large broadcasts and gathers (tcoll.shm.vector.broadcast,
 * tcoll.shm.blocks.gather).
 *
 * Each loop is cut into phases, and each call returns how many phases are done: all of them, or fewer where a
 * wait outlasts the kernel's spin, where the first step's descriptors differ, or where a peer lent its buffer
 * (comm.empty: Python reads it in place). Python then takes the phase it stopped at, with its full waiting,
 * liveness and error reporting, and may call again for the rest. Python and C take the same phases on the same
 * steps, so ranks in either pair. In Python each piece cost a few dozen interpreter calls around its copies;
 * here a whole loop is one call.
 *
 * A reduction goes piece by piece, two arena steps and three phases each: 0, write all but this rank's own part
 * of the piece into its slot and publish (the input step); 1, once every rank has, reduce this rank's part over
 * every rank's input (its own read in place) into its slot of the next step, and into its buffer there if it
 * wants the result, and publish (the result step); 2, once every rank has, copy the other ranks' parts out.
 * A broadcast or a gather goes in slot-sized pieces, one step and two phases each, streamed (rooted_phase).
 */

/* Phase `phase` (0, 1 or 2) of the piece at `mine` (`len` bytes), whose input step is `step`: 1 once it is
 * done, 0 where it cannot go on (a wait outlasted the spin; in the call's first piece, the descriptors differ or
 * a peer lent its buffer). The first piece's input step also describes the call. Large copies and reductions
 * let other threads (thread ranks) run, as elsewhere in the kernel (COPY_UNLOCKED). */
static int piece_phase(Kernel *k, const RunArgs *a, int phase, uint64_t step, int first, uint8_t *mine,
                       Py_ssize_t len) {
    Py_ssize_t item = ITEMSIZE[a->dtype], n = len / item, lo, hi;
    part_bounds(n, k->size, k->rank, &lo, &hi);
    PyThreadState *saved = NULL;
    if (phase == 0) {
        if (step >= 1 && !wait_all(k, step, a->spin_ns, a->yield)) return 0;  /* every rank done with step - 1 */
        if (first) describe_step(k, a);
        if (len >= COPY_UNLOCKED) saved = PyEval_SaveThread();
        copy_in_but(k, step, mine, len, lo * item, hi * item);
        if (saved != NULL) PyEval_RestoreThread(saved);
        publish_counter(k, step + 1);
    } else if (phase == 1) {
        if (!wait_all(k, step + 1, a->spin_ns, a->yield)) return 0;
        if (first && (!descriptors_agree(k, step) || peer_lent(k, step))) return 0;
        if (len >= COPY_UNLOCKED) saved = PyEval_SaveThread();
        int ok = reduce_part(k, step, step + 1, a->dtype, a->op, mine, a->want, n);
        if (saved != NULL) PyEval_RestoreThread(saved);
        if (!ok) return 0;
        publish_counter(k, step + 2);
    } else if (a->want) {
        if (!wait_all(k, step + 2, a->spin_ns, a->yield)) return 0;
        if (len >= COPY_UNLOCKED) saved = PyEval_SaveThread();
        copy_parts_out(k, step + 1, item, mine, n);
        if (saved != NULL) PyEval_RestoreThread(saved);
    }
    return 1;
}

/* The phases from `done` on of a call of `a->view.len` bytes in pieces of `piece` bytes, its first step
 * `a->step`: how many phases are done when it stops (3 per piece: all of them, or where it could not go on). */
static long step_pieces(Kernel *k, const RunArgs *a, Py_ssize_t piece, long done) {
    Py_ssize_t total = a->view.len;
    long phases = 3 * (long)((total + piece - 1) / piece);
    for (; done < phases; done++) {
        long index = done / 3;
        Py_ssize_t lo = (Py_ssize_t)index * piece, len = total - lo < piece ? total - lo : piece;
        if (!piece_phase(k, a, (int)(done % 3), a->step + 2 * (uint64_t)index, index == 0,
                         (uint8_t *)a->view.buf + lo, len))
            break;
    }
    return done;
}

/* run_pieces(buf, dtype, op, step, stamp, sequence, spin_ns, yield, want, piece, done): step_pieces on `buf`
 * (a plain buffer, not lent, of more than a slot) from phase `done`, where `step` is the call's first step and
 * `piece` (a multiple of the dtype's size, at most a slot) the bytes of each piece; returns the phases done
 * (`done` itself on a host of more ranks than the kernel reduces for: Python takes every phase). */
static PyObject *Kernel_run_pieces(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    RunArgs a;
    if (parse_reduction(self, args, nargs, 2, PY_SSIZE_T_MAX, &a) < 0) return NULL;
    Py_ssize_t piece = PyLong_AsSsize_t(args[9]);
    long done = PyLong_AsLong(args[10]);
    if (!PyErr_Occurred() && (piece < 1 || piece > self->slot_bytes || piece % ITEMSIZE[a.dtype] || done < 0))
        PyErr_SetString(PyExc_ValueError, "arena kernel: a piece that is not a whole number of items of at most a "
                                          "slot, or a negative phase");
    if (PyErr_Occurred()) {
        PyBuffer_Release(&a.view);
        return NULL;
    }
    if (self->size <= MAX_KERNEL_RANKS) {
        self->busy++;
        done = step_pieces(self, &a, piece, done);
        step_over(self);
    }
    PyBuffer_Release(&a.view);
    return PyLong_FromLong(done);
}

/* A rooted call larger than a slot, in slot-sized pieces, one step each, streamed: a broadcast (root writes,
 * the others read) or a gather of equal blocks (the others write, root reads each one's into its place). */
typedef struct {
    int root, gathering;
    uint8_t *out;       /* a gather's root: where block q goes, at q * block */
    Py_ssize_t block;   /* a gather's bytes per rank */
} Rooted;

/* A broadcast's or gather's piece at byte `lo` (`len` bytes) of every block, whose step is `step`, streamed: a
 * writer copies its piece into its slot a chunk at a time, announcing each (stream_slot), and publishes it; a
 * reader publishes the step at once (done with the piece before it: the writers may reuse that slot set) and
 * copies each chunk as it is announced (read_stream), so that a piece crosses between the cores once,
 * overlapped, where in Python it was copied in whole, then out whole. Two phases per piece: 0, claim (a
 * writer; a reader only in the first piece), describe (the first piece), and write or publish; 1, read (a
 * reader), and in the first piece the check that every rank describes the same call. 1 once done, 0 where it
 * cannot go on (a wait past the spin; a writer that describes another call or lent its buffer). A reader lets
 * the GIL go while it streams: it waits there for the writer, which may be a thread of this process. */
static int rooted_phase(Kernel *k, const RunArgs *a, const Rooted *r, int phase, uint64_t step, int first,
                        Py_ssize_t lo, Py_ssize_t len) {
    RunArgs at = *a;
    at.step = step;
    int writer = r->gathering ? k->rank != r->root : k->rank == r->root, streamed = 1;
    if (phase == 0) {
        if ((first || writer) && step >= 1 && !wait_all(k, step, a->spin_ns, a->yield)) return 0;
        if (first) describe_step(k, &at);
        if (!writer) {
            publish_counter(k, step + 1);
            return 1;
        }
        PyThreadState *saved = len >= COPY_UNLOCKED ? PyEval_SaveThread() : NULL;  /* (a writer waits for nobody) */
        stream_slot(k, &at, (const uint8_t *)a->view.buf + lo, len);
        if (saved != NULL) PyEval_RestoreThread(saved);
    } else if (!writer) {
        PyThreadState *saved = PyEval_SaveThread();
        if (r->gathering) {
            for (int q = 0; q < k->size && streamed; q++)
                streamed = q == k->rank || read_stream(k, &at, q, r->out + q * r->block + lo, len, first);
        } else {
            streamed = read_stream(k, &at, r->root, (uint8_t *)a->view.buf + lo, len, first);
        }
        PyEval_RestoreThread(saved);
    }
    return streamed && !(phase == 1 && first && (!wait_all(k, step + 1, a->spin_ns, a->yield) ||
                                                 !descriptors_agree(k, step)));
}

/* The phases from `done` on of a rooted call of `a->view.len` bytes a block (a broadcast's buffer, a gather's
 * blocks), in pieces of `piece` bytes, its first step `a->step`: how many are done when it stops (2 per
 * piece: all, or where rooted_phase could not go on). */
static long step_rooted_pieces(Kernel *k, const RunArgs *a, const Rooted *r, Py_ssize_t piece, long done) {
    Py_ssize_t total = a->view.len;
    long phases = 2 * (total > piece ? (long)((total + piece - 1) / piece) : 1);  /* (as Python counts: one at least) */
    for (; done < phases; done++) {
        long index = done / 2;
        Py_ssize_t lo = (Py_ssize_t)index * piece, len = total - lo < piece ? total - lo : piece;
        if (!rooted_phase(k, a, r, (int)(done % 2), a->step + (uint64_t)index, index == 0, lo, len))
            break;
    }
    return done;
}

/* step_rooted_pieces with the kernel held, the buffers released after; the phases done, or NULL with the error
 * set (`done` negative). */
static PyObject *run_rooted_pieces(Kernel *self, RunArgs *a, const Rooted *r, Py_buffer *out, long done) {
    if (!PyErr_Occurred() && done < 0) PyErr_SetString(PyExc_ValueError, "arena kernel: a negative phase");
    if (!PyErr_Occurred()) {
        self->busy++;
        done = step_rooted_pieces(self, a, r, self->slot_bytes, done);
        step_over(self);
    }
    PyBuffer_Release(&a->view);
    if (out != NULL) PyBuffer_Release(out);
    return PyErr_Occurred() ? NULL : PyLong_FromLong(done);
}

/* run_broadcast_pieces(buf, root, step, stamp, sequence, spin_ns, yield, done): step_rooted_pieces of a broadcast
 * of `buf` (root's not lent; writable off root) from phase `done`; returns the phases done. */
static PyObject *Kernel_run_broadcast_pieces(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    RunArgs a;
    Rooted r = {0, 0, NULL, 0};
    if (parse_broadcast(self, args, nargs, 2, "run_broadcast_pieces(buf, root, step, stamp, sequence, spin_ns, "
                        "yield, done)", &a, &r.root) < 0)
        return NULL;
    return run_rooted_pieces(self, &a, &r, NULL, PyLong_AsLong(args[7]));
}

/* run_gather_pieces(send, out, root, step, stamp, sequence, spin_ns, yield, done): step_rooted_pieces of a gather
 * of equal blocks (`send`, this rank's, not lent; `out`: root's, a block a rank; None elsewhere) from phase
 * `done`; returns the phases done. */
static PyObject *Kernel_run_gather_pieces(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    RunArgs a;
    Rooted r = {0, 1, NULL, 0};
    if (parse_rooted(self, args, nargs, 9, 2, 3, "run_gather_pieces(send, out, root, step, stamp, sequence, spin_ns, "
                     "yield, done)", &a, &r.root) < 0)
        return NULL;
    if ((self->rank == r.root) == (args[1] == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: a gather's out is root's alone");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &a.view, PyBUF_SIMPLE) < 0) return NULL;
    Py_buffer out;
    if (self->rank == r.root) {
        if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&a.view);
            return NULL;
        }
        if (out.len != a.view.len * self->size) {
            PyBuffer_Release(&out);
            PyBuffer_Release(&a.view);
            PyErr_SetString(PyExc_ValueError, "arena kernel: a gather's out holds a block a rank");
            return NULL;
        }
        r.out = out.buf;
    }
    r.block = a.view.len;
    return run_rooted_pieces(self, &a, &r, self->rank == r.root ? &out : NULL, PyLong_AsLong(args[8]));
}
