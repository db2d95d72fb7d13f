/* gpipe.worker.dataplane._ring: the sending end of a same-host lane's ring of shared memory (worker/dataplane/unix_lane.py's Ring), in C.

   The same bookkeeping as unix_lane._Writer, the Python it stands in for (the package works without this
   module: a host with no C compiler at install time keeps the Python): where the next message goes, its slot's
   (offset, length) pair in the ring's table, the eventfd writes. A send of a tensor (`send`) is one call: the
   header, the tensor's bytes and the slot written, `posted` told. Right after an action's GEMMs have taken the
   core's caches, each line of Python costs several times its warm cost (bench/README.md (ab)); this module
   makes the send one line.

   Nothing here reads the peer's memory: the peer only ever adds to `freed` (an eventfd, a count), taken as at
   most the messages posted. The Writer holds the ring's mapping as a buffer (it cannot be unmapped under it),
   and every offset it writes at is within it. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>

#define ALIGN 64
#define MB_BYTES 8
#define UNLOCKED_COPY (1 << 20) /* a longer copy lets the worker's other threads run */

typedef struct {
    PyObject_HEAD
    Py_buffer view;            /* the ring's mapping (an mmap's buffer: it cannot be closed while held) */
    int viewing;               /* whether `view` is held: the Writer is initialised */
    char *data;                /* the ring's messages */
    int64_t *table;            /* RING_SLOTS (offset, length) pairs */
    Py_ssize_t size, warm, max_message, header;
    Py_ssize_t slots;
    int posted, freed;
    int64_t seq;               /* messages posted */
    Py_ssize_t *starts, *ends; /* the unread messages' spans, oldest first (a circle of `slots`) */
    Py_ssize_t head, count;
} Writer;

static void writer_dealloc(Writer *self) {
    PyMem_Free(self->starts);
    PyMem_Free(self->ends);
    if (self->viewing)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Writer(mapping, size, slots, warm, max_message, header, posted, freed): `mapping` (the ring's mmap) holds the
   table of `slots` (offset, length) pairs, then `size` bytes of messages. */
static int writer_init(Writer *self, PyObject *args, PyObject *kw) {
    PyObject *keep;
    Py_ssize_t size, slots, warm, max_message, header;
    int posted, freed;
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "Writer takes no keyword arguments");
        return -1;
    }
    if (self->viewing) {
        PyErr_SetString(PyExc_RuntimeError, "a Writer is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "Onnnnnii", &keep, &size, &slots, &warm, &max_message, &header, &posted, &freed))
        return -1;
    if (size <= 0 || slots <= 0 || slots > PY_SSIZE_T_MAX / 32 || header < MB_BYTES || max_message > size ||
        header > max_message || warm < 0) {
        PyErr_SetString(PyExc_ValueError, "a ring of no room, or a header shorter than its micro-batch");
        return -1;
    }
    if (PyObject_GetBuffer(keep, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        return -1;
    if (self->view.len < slots * 16 || self->view.len - slots * 16 < size) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "a ring larger than its mapping");
        return -1;
    }
    self->starts = PyMem_New(Py_ssize_t, slots);
    self->ends = PyMem_New(Py_ssize_t, slots);
    if (self->starts == NULL || self->ends == NULL) {
        PyMem_Free(self->starts);
        PyMem_Free(self->ends);
        self->starts = self->ends = NULL;
        PyBuffer_Release(&self->view);
        PyErr_NoMemory();
        return -1;
    }
    self->viewing = 1;
    self->table = (int64_t *)self->view.buf;
    self->data = (char *)self->view.buf + slots * 16;
    self->size = size;
    self->slots = slots;
    self->warm = warm;
    self->max_message = max_message;
    self->header = header;
    self->posted = posted;
    self->freed = freed;
    self->seq = self->head = self->count = 0;
    return 0;
}

static int ready(Writer *self) {
    if (self->viewing)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "a Writer used before it was initialised");
    return 0;
}

/* What the receiver has read since, taken back: 0, or -1 with OSError (a descriptor gone). */
static int reclaim(Writer *self) {
    eventfd_t read;
    if (eventfd_read(self->freed, &read) != 0) {
        if (errno == EAGAIN)
            return 0; /* none read since */
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    Py_ssize_t k = read < (eventfd_t)self->count ? (Py_ssize_t)read : self->count;
    self->head = (self->head + k) % self->slots;
    self->count -= k;
    return 0;
}

static Py_ssize_t fit(Writer *self, Py_ssize_t n) {
    if (self->count == 0)
        return 0;
    if (self->count >= self->slots)
        return -1;
    Py_ssize_t first = self->starts[self->head];
    Py_ssize_t tail = (self->head + self->count - 1) % self->slots;
    Py_ssize_t last = self->starts[tail], end = self->ends[tail];
    if (last >= first) { /* in use: [first, end) */
        if (end + n <= self->size)
            return end;
        return n <= first ? 0 : -1;
    }
    return end + n <= first ? end : -1; /* in use: [first, size) and [0, end) */
}

/* Where a message of `n` bytes (0 <= n) goes: -1 where the ring has no room for it, -2 with OSError set. */
static Py_ssize_t place(Writer *self, Py_ssize_t n) {
    if (n > self->max_message)
        return -1;
    Py_ssize_t at = fit(self, n);
    if (at < 0 || at + n > self->warm) {
        if (reclaim(self) < 0)
            return -2;
        at = fit(self, n);
    }
    return at;
}

static int post(Writer *self, Py_ssize_t at, Py_ssize_t n) {
    Py_ssize_t i = 2 * (Py_ssize_t)(self->seq % self->slots);
    self->table[i] = at;
    self->table[i + 1] = n;
    self->seq += 1;
    Py_ssize_t k = (self->head + self->count) % self->slots;
    self->starts[k] = at;
    self->ends[k] = at + (n + ALIGN - 1) / ALIGN * ALIGN;
    self->count += 1;
    if (eventfd_write(self->posted, 1) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *writer_place(Writer *self, PyObject *arg) {
    if (!ready(self))
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "a message of a negative length");
        return NULL;
    }
    Py_ssize_t at = place(self, n);
    if (at == -2)
        return NULL;
    if (at < 0)
        Py_RETURN_NONE;
    return PyLong_FromSsize_t(at);
}

static PyObject *writer_post(Writer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready(self))
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "post(at, n)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[0]), n = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (at < 0 || n < 0 || n > self->size || at > self->size - n) {
        PyErr_SetString(PyExc_ValueError, "a message past the ring's end");
        return NULL;
    }
    if (post(self, at, n) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* send(mb, tail, address, n): the message of a tensor of `n` bytes at `address` (its memory, contiguous),
   micro-batch `mb`, the rest of its header `tail`; False when the ring has no room for it. */
static PyObject *writer_send(Writer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready(self))
        return NULL;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "send(mb, tail, address, n)");
        return NULL;
    }
    int64_t mb = PyLong_AsLongLong(args[0]);
    char *tail;
    Py_ssize_t tail_n;
    if (mb == -1 && PyErr_Occurred())
        return NULL;
    if (PyBytes_AsStringAndSize(args[1], &tail, &tail_n) < 0)
        return NULL;
    void *src = PyLong_AsVoidPtr(args[2]);
    Py_ssize_t n = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (MB_BYTES + tail_n != self->header || n < 0 || (n && src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "a header of the wrong length, or no tensor memory");
        return NULL;
    }
    if (n > self->max_message - self->header)
        Py_RETURN_FALSE;
    Py_ssize_t total = self->header + n;
    Py_ssize_t at = place(self, total);
    if (at == -2)
        return NULL;
    if (at < 0)
        Py_RETURN_FALSE;
    char *to = self->data + at;
    memcpy(to, &mb, MB_BYTES);
    memcpy(to + MB_BYTES, tail, (size_t)tail_n);
    if (n > UNLOCKED_COPY) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(to + self->header, src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else if (n) {
        memcpy(to + self->header, src, (size_t)n);
    }
    if (post(self, at, total) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *writer_unread(Writer *self, PyObject *Py_UNUSED(ignored)) {
    if (!ready(self))
        return NULL;
    if (self->count && reclaim(self) < 0)
        return NULL;
    return PyLong_FromSsize_t(self->count);
}

static PyMethodDef writer_methods[] = {
    {"place", (PyCFunction)writer_place, METH_O,
     "place(n): where a message of n bytes can go now; None when the ring has no room for it"},
    {"post", (PyCFunction)(void (*)(void))writer_post, METH_FASTCALL,
     "post(at, n): the message of n bytes written at `at` is the receiver's"},
    {"send", (PyCFunction)(void (*)(void))writer_send, METH_FASTCALL,
     "send(mb, tail, address, n): write and post a tensor's message; False when the ring has no room"},
    {"unread", (PyCFunction)writer_unread, METH_NOARGS,
     "unread(): how many of the messages posted the receiver has not read yet"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpipe.worker.dataplane._ring.Writer",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The sending end of a lane's ring (gpipe.worker.dataplane.unix_lane._Writer's methods).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)writer_init,
    .tp_dealloc = (destructor)writer_dealloc,
    .tp_methods = writer_methods,
};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT, "gpipe.worker.dataplane._ring", "The sending end of a same-host lane's ring, in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&WriterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&ring_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&WriterType);
    if (PyModule_AddObject(m, "Writer", (PyObject *)&WriterType) < 0) {
        Py_DECREF(&WriterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
