/* The pipelined steps of a large all_reduce / reduce in C: the slot-sized pieces of tcoll.shm.vector._reduce_large.
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
 * a peer lent its buffer). The first piece's input step also describes the call. */
static int piece_phase(Kernel *k, const RunArgs *a, int phase, uint64_t step, int first, uint8_t *mine,
                       Py_ssize_t len) {
    Py_ssize_t item = ITEMSIZE[a->dtype], n = len / item, lo, hi;
    part_bounds(n, k->size, k->rank, &lo, &hi);
    if (phase == 0) {
        if (step >= 1 && !wait_all(k, step, a->spin_ns, a->yield)) return 0;  /* every rank done with step - 1 */
        if (first) describe_step(k, a);
        uint8_t *slot = slot_of(k, k->rank, step);
        Py_BEGIN_ALLOW_THREADS
        tc_copy(slot, mine, (size_t)(lo * item));
        tc_copy(slot + hi * item, mine + hi * item, (size_t)(len - hi * item));
        Py_END_ALLOW_THREADS
        publish_counter(k, step + 1);
    } else if (phase == 1) {
        if (!wait_all(k, step + 1, a->spin_ns, a->yield)) return 0;
        if (first && (!descriptors_agree(k, step) || peer_lent(k, step))) return 0;
        int ok;
        Py_BEGIN_ALLOW_THREADS
        ok = reduce_part(k, step, step + 1, a->dtype, a->op, mine, a->want, n);
        Py_END_ALLOW_THREADS
        if (!ok) return 0;
        publish_counter(k, step + 2);
    } else if (a->want) {
        if (!wait_all(k, step + 2, a->spin_ns, a->yield)) return 0;
        Py_BEGIN_ALLOW_THREADS
        copy_parts_out(k, step + 1, item, mine, n);
        Py_END_ALLOW_THREADS
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
 * `piece` (a multiple of the dtype's size, at most a slot) the bytes of each piece; returns the phases done. */
static PyObject *Kernel_run_pieces(Kernel *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "run_pieces(buf, dtype, op, step, stamp, sequence, spin_ns, yield, want, piece, done)");
        return NULL;
    }
    Py_ssize_t piece = PyLong_AsSsize_t(args[9]);
    long done = PyLong_AsLong(args[10]);
    if (PyErr_Occurred()) return NULL;
    RunArgs a;
    memset(&a, 0, sizeof(a));
    a.dtype = (int)PyLong_AsLong(args[1]);
    a.op = (int)PyLong_AsLong(args[2]);
    if (PyErr_Occurred() || parse_step(args + 3, &a) < 0) return NULL;
    a.want = PyObject_IsTrue(args[8]);
    if (a.want < 0) return NULL;
    if (self->held < 0 || a.dtype < 0 || a.dtype >= NDTYPES || a.op < 0 || a.op >= NOPS ||
        self->size > MAX_KERNEL_RANKS || piece < 1 || piece > self->slot_bytes || piece % ITEMSIZE[a.dtype] ||
        done < 0) {
        PyErr_SetString(PyExc_ValueError, "arena kernel: not initialised, an unknown dtype or op code, or a bad piece");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &a.view, a.want ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    if (a.view.len % ITEMSIZE[a.dtype]) {
        PyBuffer_Release(&a.view);
        PyErr_SetString(PyExc_ValueError, "arena kernel: the buffer is not a whole number of items");
        return NULL;
    }
    self->busy++;
    done = step_pieces(self, &a, piece, done);
    step_over(self);
    PyBuffer_Release(&a.view);
    return PyLong_FromLong(done);
}
