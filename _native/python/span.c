/* The base of Region, RegionSlice, RemoteRegion and RemoteSlice: a span of a
 * region, (region, offset, nbytes), and its slicing. A user writes
 * peer.put(kv[a:b], cache[c:d]) on every op; made in Python, each slice cost
 * a third of a same-host put (docs/benchmarks.md, "slices per op"). Here
 * [a:b] of ints in range is one C call; anything else (negative bounds, a
 * step, a bad type, out of range) goes to the Python fallback, which builds
 * the same span or raises the library's error naming the region.
 *
 * Built for the limited API, as the cffi module is: one wheel per platform. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* Every field an object, read through T_OBJECT_EX members: the only kind
 * CPython 3.11's attribute specialization takes, and the put path reads
 * region/offset/nbytes of two spans per op. */
typedef struct {
    PyObject_HEAD PyObject *region; /* what a slice is of; None for a region itself */
    PyObject *offset;               /* int >= 0 */
    PyObject *nbytes;               /* int >= 0 */
    PyObject *sliced_as;            /* a region's slice type; None: a slice's own type */
} Span;

static PyObject *fallback; /* fallback(span, key): the Python rule, errors included */

static PyObject *span_new_slice(Span *self, Py_ssize_t offset, Py_ssize_t start, Py_ssize_t stop)
{
    PyTypeObject *tp = self->sliced_as != Py_None ? (PyTypeObject *)self->sliced_as : Py_TYPE(self);
    allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
    Span *out = (Span *)alloc(tp, 0);
    if (!out)
        return NULL;
    PyObject *region = self->region != Py_None ? self->region : (PyObject *)self;
    Py_INCREF(region);
    out->region = region;
    Py_INCREF(Py_None);
    out->sliced_as = Py_None;
    out->offset = PyLong_FromSsize_t(offset + start);
    out->nbytes = PyLong_FromSsize_t(stop - start);
    if (!out->offset || !out->nbytes) {
        Py_DECREF(out);
        return NULL;
    }
    return (PyObject *)out;
}

static PyObject *span_subscript(Span *self, PyObject *key)
{
    Py_ssize_t start, stop, step;
    if (!self->nbytes) { /* made by __new__ alone */
        PyErr_SetString(PyExc_TypeError, "an uninitialised span cannot be sliced");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(self->offset), nbytes = PyLong_AsSsize_t(self->nbytes);
    if ((offset == -1 || nbytes == -1) && PyErr_Occurred())
        return NULL;
    /* PySlice_Unpack gives None as 0 / PY_SSIZE_T_MAX and clips huge bounds to those. */
    if (PySlice_Check(key) && PySlice_Unpack(key, &start, &stop, &step) == 0) {
        if (stop == PY_SSIZE_T_MAX) { /* [a:], or a stop far out of range */
            PyObject *given = PyObject_GetAttrString(key, "stop");
            if (given == Py_None)
                stop = nbytes;
            Py_XDECREF(given);
            PyErr_Clear();
        }
        if (step == 1 && 0 <= start && start <= stop && stop <= nbytes)
            return span_new_slice(self, offset, start, stop);
    } else if (PyErr_Occurred()) {
        PyErr_Clear(); /* a bound that is no index: the fallback names it */
    }
    if (!fallback) {
        PyErr_SetString(PyExc_RuntimeError, "aiohixl._span: no fallback set");
        return NULL;
    }
    return PyObject_CallFunctionObjArgs(fallback, (PyObject *)self, key, NULL);
}

static Py_ssize_t span_length(Span *self)
{
    if (!self->nbytes) {
        PyErr_SetString(PyExc_TypeError, "an uninitialised span has no length");
        return -1;
    }
    return PyLong_AsSsize_t(self->nbytes);
}

static int span_init(Span *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"region", "offset", "nbytes", "sliced_as", NULL};
    PyObject *region, *offset, *nbytes, *sliced_as = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O", names, &region, &offset, &nbytes, &sliced_as))
        return -1;
    if (sliced_as != Py_None && !PyType_Check(sliced_as)) {
        PyErr_SetString(PyExc_TypeError, "sliced_as is a type");
        return -1;
    }
    offset = PyNumber_Index(offset);
    nbytes = offset ? PyNumber_Index(nbytes) : NULL;
    if (!nbytes) {
        Py_XDECREF(offset);
        return -1;
    }
    Py_ssize_t o = PyLong_AsSsize_t(offset), n = PyLong_AsSsize_t(nbytes);
    if (o < 0 || n < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a span's offset and nbytes are >= 0");
        Py_DECREF(offset);
        Py_DECREF(nbytes);
        return -1;
    }
    PyObject *old[4] = {self->region, self->offset, self->nbytes, self->sliced_as};
    Py_INCREF(region);
    Py_INCREF(sliced_as);
    self->region = region;
    self->offset = offset;
    self->nbytes = nbytes;
    self->sliced_as = sliced_as;
    for (int i = 0; i < 4; i++)
        Py_XDECREF(old[i]);
    return 0;
}

/* Spans hold no cycles of their own; a subclass with a __dict__ (Region) is
 * collected by the GC, which reaches these references through here. */
static int span_traverse(Span *self, visitproc visit, void *arg)
{
    Py_VISIT(self->region);
    Py_VISIT(self->offset);
    Py_VISIT(self->nbytes);
    Py_VISIT(self->sliced_as);
    return 0;
}

static int span_clear(Span *self)
{
    Py_CLEAR(self->region);
    Py_CLEAR(self->offset);
    Py_CLEAR(self->nbytes);
    Py_CLEAR(self->sliced_as);
    return 0;
}

static void span_dealloc(Span *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    span_clear(self);
    freefunc free_ = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    free_(self);
    Py_DECREF(tp);
}

static PyMemberDef span_members[] = {
    {"region", T_OBJECT_EX, offsetof(Span, region), READONLY, "the region a slice is of (None for a region)"},
    {"offset", T_OBJECT_EX, offsetof(Span, offset), READONLY, "the first byte, from the region's start"},
    {"nbytes", T_OBJECT_EX, offsetof(Span, nbytes), READONLY, "how many bytes"},
    {"_sliced_as", T_OBJECT_EX, offsetof(Span, sliced_as), READONLY,
     "a region's slice type (None for a slice)"},
    {NULL},
};

/* No Py_tp_new: object's is inherited, which also sets up a subclass's
 * managed __dict__, so that attribute reads of a Region are specialized by
 * the interpreter as on any class (PyType_GenericNew left them ~2x slower). */
static PyType_Slot span_slots[] = {
    {Py_tp_doc, "A span of a region: (region, offset, nbytes); slicing it makes another."},
    {Py_tp_init, span_init},
    {Py_tp_dealloc, span_dealloc},
    {Py_tp_traverse, span_traverse},
    {Py_tp_clear, span_clear},
    {Py_tp_members, span_members},
    {Py_mp_subscript, span_subscript},
    {Py_mp_length, span_length},
    {Py_sq_length, span_length},
    {0, NULL},
};

static PyType_Spec span_spec = {
    "aiohixl._span.Span", sizeof(Span), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, span_slots,
};

static PyObject *set_fallback(PyObject *module, PyObject *fn)
{
    (void)module;
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_fallback takes a callable");
        return NULL;
    }
    PyObject *old = fallback;
    Py_INCREF(fn);
    fallback = fn;
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_fallback", set_fallback, METH_O,
     "set_fallback(fn): fn(span, key) slices what the C path does not."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "aiohixl._span",
    .m_doc = "Spans of registered memory and their slicing.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__span(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    PyObject *tp = PyType_FromSpec(&span_spec);
    if (!tp || PyModule_AddObject(m, "Span", tp) < 0) {
        Py_XDECREF(tp);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
