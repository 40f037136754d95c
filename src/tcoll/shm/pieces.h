/* The pipelined steps of calls larger than a slot, in C: the pieces of a large all_reduce / reduce
 * (tcoll.shm.large.reduce_large) and of a large broadcast (tcoll.shm.vector.broadcast).
 *
 * A call larger than a slot goes piece by piece, two arena steps each: write all but this rank's own part of
 * the piece into its slot and publish (the input step); once every rank has, reduce this rank's part over
 * every rank's input (its own read in place) into its slot of the next step, and into its buffer there if it
 * wants the result, and publish (the result step); once every rank has, copy the other ranks' parts out. In
 * Python each piece costs a few dozen interpreter calls around its copies; here the whole loop is one call.
 *
 * The loop is cut into phases, three per piece (0: write and publish the input; 1: reduce and publish the
 * result; 2: copy the other parts out), and this call returns how many phases are done: all of them, or
 * fewer where a wait outlasts the kernel's spin, where the first step's descriptors differ, or where a peer
 * lent its buffer (comm.empty: Python reads it in place). Python then takes the phase it stopped at, with its
 * full waiting, liveness and error reporting, and may call again for the rest. Python and C take the same
 * phases on the same steps, so ranks in either pair (the phases of one piece are the same in both).
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

/* A broadcast larger than a slot, in slot-sized pieces, one step each, streamed: root copies each piece into
 * its slot a chunk at a time, announcing each (stream_slot), and publishes it; the others publish the step
 * at once (done with the piece before it: root may reuse that slot set) and copy each chunk as it is
 * announced (read_stream), so that a piece crosses between the cores once, overlapped, where in Python it
 * was copied in whole, then out whole. Two phases per piece: 0, claim (root; the others only in the first
 * piece), describe (the first piece), and write (root) or publish (the others); 1, read (the others), and in
 * the first piece the check that every rank describes the same call. */
static int broadcast_phase(Kernel *k, const RunArgs *a, int root, int phase, uint64_t step, int first,
                           uint8_t *mine, Py_ssize_t len) {
    RunArgs at = *a;
    at.step = step;
    int streamed = 1;
    if (phase == 0) {
        if ((first || k->rank == root) && step >= 1 && !wait_all(k, step, a->spin_ns, a->yield)) return 0;
        if (first) describe_step(k, &at);
        if (k->rank != root) {
            publish_counter(k, step + 1);
            return 1;
        }
        PyThreadState *saved = PyEval_SaveThread();
        stream_slot(k, &at, mine, len);
        PyEval_RestoreThread(saved);
    } else if (k->rank != root) {
        PyThreadState *saved = PyEval_SaveThread();
        streamed = read_stream(k, &at, root, mine, len, first);  /* (first: root's descriptor names this call) */
        PyEval_RestoreThread(saved);
    }
    return streamed && !(phase == 1 && first && (!wait_all(k, step + 1, a->spin_ns, a->yield) ||
                                                 !descriptors_agree(k, step)));
}

/* The phases from `done` on of a broadcast of `a->view.len` bytes from `root`, in pieces of `piece` bytes, its
 * first step `a->step`: how many are done when it stops (2 per piece: all, or where it could not go on: a
 * wait past the spin, a descriptor that differs, a root that lent its buffer). */
static long step_broadcast_pieces(Kernel *k, const RunArgs *a, int root, Py_ssize_t piece, long done) {
    Py_ssize_t total = a->view.len;
    long phases = 2 * (long)((total + piece - 1) / piece);
    for (; done < phases; done++) {
        long index = done / 2;
        Py_ssize_t lo = (Py_ssize_t)index * piece, len = total - lo < piece ? total - lo : piece;
        if (!broadcast_phase(k, a, root, (int)(done % 2), a->step + (uint64_t)index, index == 0,
                             (uint8_t *)a->view.buf + lo, len))
            break;
    }
    return done;
}

/* run_broadcast_pieces(buf, root, step, stamp, sequence, spin_ns, yield, done): step_broadcast_pieces on `buf`
 * (root's not lent; writable off root) from phase `done`, in slot-sized pieces; returns the phases done. */
static PyObject *Kernel_run_broadcast_pieces(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    RunArgs a;
    int root;
    if (parse_broadcast(self, args, nargs, 2, "run_broadcast_pieces(buf, root, step, stamp, sequence, spin_ns, "
                        "yield, done)", &a, &root) < 0)
        return NULL;
    long done = PyLong_AsLong(args[7]);
    if (!PyErr_Occurred() && done < 0) PyErr_SetString(PyExc_ValueError, "arena kernel: a negative phase");
    if (PyErr_Occurred()) {
        PyBuffer_Release(&a.view);
        return NULL;
    }
    self->busy++;
    done = step_broadcast_pieces(self, &a, root, self->slot_bytes, done);
    step_over(self);
    PyBuffer_Release(&a.view);
    return PyLong_FromLong(done);
}
