/* A continued stream's chunk of text passed on in C: `services.gateway.relay.Relay`,
 * compiled. The Python class is the rule a reader checks; this is the same rule, step
 * for step, held equal to it by tests/gateway/test_relay.py (the same bytes written,
 * the same state left, the same chunks handed to `take`). Chosen by the gateway's
 * `--chunk-relay` (`compiled`, or `auto` where it was built).
 *
 * A relay is the sink of one segment of a continued stream (`Body.sink`): each read of
 * the replica's answer comes to it in the read's callback. A read that is one chunk of
 * text, on a stream whose chunks may be read later (`continuation_fast.Deferred`), is
 * kept for that reading and written to the client here; any other read goes to `take`,
 * the Python reading, whose answer is returned. Everything that decides which is read
 * from the Python objects at each read, as `take` would read it: nothing is cached
 * across reads but what is fixed for the segment. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>

/* The attribute names read, interned once (constants, not state). */
static PyObject *s_broken, *s_wrote, *s_strip_counts, *s_id, *s_segments, *s_by_ids,
    *s_kept, *s_kept_bytes, *s_chunks, *s_ids_wanted, *s_strip_ids, *s_closing,
    *s_transport, *s_write_paused, *s_write, *s_choices, *s_error, *s_usage,
    *s_prompt_token_ids, *s_finish_reason, *s_token_ids, *s_last_read, *s_body, *s__sink,
    *s__feed, *s__wake, *s__bad, *s_Accept;

/* One layout for every type here (`Relay`, `OnData`, `OnBody`, `OnHeader`, `Head`,
 * `OnAnswerHeader`, `RequestHead`): each uses its own fields, the others stay NULL, and
 * one traverse, clear and dealloc serve all of them. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    /* Relay's */
    PyObject *take;   /* the Python reading of a read: take(data) -> bool */
    PyObject *plan;   /* the continuation's Plan: broken, wrote */
    PyObject *st;     /* its Deferred stream */
    PyObject *conn;   /* the client's connection (front._Conn); OnData's, OnBody's:
                         the upstream._Conn */
    PyObject *decode; /* continuation_fast's typed decode of a chunk */
    PyObject *unset;  /* msgspec.UNSET */
    PyObject *failed; /* what a write raised, for the request's coroutine; None */
    Py_ssize_t max_kept;
    int chunked;
    int behind;
    /* OnData's */
    PyObject *time;     /* its loop's time */
    PyObject *feed;     /* its parser's feed_data */
    PyObject *errors;   /* what `unparsed` reads: (HttpParserError, HttpParserUpgrade) */
    PyObject *unparsed; /* its _unparsed(e, data) */
    /* OnHeader's, OnAnswerHeader's */
    PyObject *pairs;    /* the head's (name, value) pairs read so far (front._Conn._pairs);
                           OnAnswerHeader's: the dict of an answer's (upstream._Conn._said) */
    /* Head's */
    PyObject *reasons;  /* status -> reason phrase (bytes) */
    PyObject *fallback; /* the Python rule, for what the fast way does not take */
} Relay;

/* ---- the token ids nulled: `continuation._NULL_IDS.sub(_null, raw)`, by hand.
 * The pattern: ("(?:prompt_token_ids|token_ids)":\s*)\[[\d,\s]*\] on bytes: \s is
 * [ \t\n\r\f\v], \d is [0-9]. No part of it can match in two ways (each run ends at a
 * byte it cannot take), so the first match from the left, taken whole, and the scan
 * going on after it, is what `re.sub` does. */

static int
is_space(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* The match's length at s[i] (0: none); *keep: its group's (the key and what follows). */
static Py_ssize_t
match_at(const char *s, Py_ssize_t n, Py_ssize_t i, Py_ssize_t *keep)
{
    static const char P[] = "prompt_token_ids\":";
    static const char T[] = "token_ids\":";
    Py_ssize_t j = i + 1; /* s[i] is the quote */
    if (n - j >= (Py_ssize_t)(sizeof P - 1) && memcmp(s + j, P, sizeof P - 1) == 0)
        j += sizeof P - 1;
    else if (n - j >= (Py_ssize_t)(sizeof T - 1) && memcmp(s + j, T, sizeof T - 1) == 0)
        j += sizeof T - 1;
    else
        return 0;
    while (j < n && is_space((unsigned char)s[j]))
        j++;
    *keep = j - i;
    if (j >= n || s[j] != '[')
        return 0;
    j++;
    while (j < n && ((s[j] >= '0' && s[j] <= '9') || s[j] == ',' || is_space((unsigned char)s[j])))
        j++;
    if (j >= n || s[j] != ']')
        return 0;
    return j + 1 - i;
}

/* The nulled bytes of s written to out (when not NULL); their length. */
static Py_ssize_t
nulled(const char *s, Py_ssize_t n, char *out)
{
    Py_ssize_t i = 0, from = 0, size = 0;
    while (i < n) {
        const char *q = memchr(s + i, '"', (size_t)(n - i));
        if (q == NULL)
            break;
        i = q - s;
        Py_ssize_t keep = 0, m = match_at(s, n, i, &keep);
        if (m == 0) {
            i++;
            continue;
        }
        Py_ssize_t part = i + keep - from;
        if (out != NULL) {
            memcpy(out + size, s + from, (size_t)part);
            memcpy(out + size + part, "null", 4);
        }
        size += part + 4;
        i += m;
        from = i;
    }
    if (out != NULL)
        memcpy(out + size, s + from, (size_t)(n - from));
    return size + (n - from);
}

/* The bytes written for a chunk: nulled or not, framed as an HTTP chunk or not. */
static PyObject *
framed(const char *s, Py_ssize_t n, int null_ids, int chunked)
{
    Py_ssize_t size = null_ids ? nulled(s, n, NULL) : n;
    char head[24];
    int h = chunked ? snprintf(head, sizeof head, "%zx\r\n", size) : 0;
    PyObject *b = PyBytes_FromStringAndSize(NULL, h + size + (chunked ? 2 : 0));
    if (b == NULL)
        return NULL;
    char *out = PyBytes_AS_STRING(b);
    memcpy(out, head, (size_t)h);
    if (null_ids)
        nulled(s, n, out + h);
    else
        memcpy(out + h, s, (size_t)n);
    if (chunked)
        memcpy(out + h + size, "\r\n", 2);
    return b;
}

static PyObject *
null_ids(PyObject *module, PyObject *arg)
{
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "null_ids takes bytes");
        return NULL;
    }
    return framed(PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg), 1, 0);
}

/* ---- the relay */

/* 1, 0, or -1 with an error set: the truth of o.name. */
static int
attr_true(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* 1 when o.name is None, 0 when not, -1 with an error set. */
static int
attr_none(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int t = v == Py_None;
    Py_DECREF(v);
    return t;
}

/* o.name += by, for an int attribute; -1 with an error set. */
static int
attr_add(PyObject *o, PyObject *name, Py_ssize_t by)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    PyObject *w = PyLong_FromSsize_t(x + by);
    if (w == NULL)
        return -1;
    int r = PyObject_SetAttr(o, name, w);
    Py_DECREF(w);
    return r;
}

/* Whether the read `data` is a chunk kept and passed on here (1), one for `take` (0),
 * or neither: an error (-1). What it reads, in `relay.Relay.__call__`'s order. */
static int
plain(Relay *self, PyObject *data, PyObject **seg_out, int *null_out, Py_ssize_t *kept_out)
{
    const char *s = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    int t;

    /* The plan: nothing of an event left from the read before; its first byte written. */
    PyObject *broken = PyObject_GetAttr(self->plan, s_broken);
    if (broken == NULL)
        return -1;
    if (!PyTuple_Check(broken) || PyTuple_GET_SIZE(broken) != 3) {
        Py_DECREF(broken);
        return 0;
    }
    t = PyObject_IsTrue(PyTuple_GET_ITEM(broken, 2));
    Py_DECREF(broken);
    if (t != 0)
        return t < 0 ? -1 : 0;
    if ((t = attr_true(self->plan, s_wrote)) != 1)
        return t < 0 ? -1 : 0;
    /* The stream: no running usage to take out, its id read. */
    if ((t = attr_true(self->st, s_strip_counts)) != 0)
        return t < 0 ? -1 : 0;
    if ((t = attr_none(self->st, s_id)) != 0)
        return t < 0 ? -1 : 0;
    /* The read: one whole event, of the chunks' common form. */
    if (n < 9 || memcmp(s, "data: {", 7) != 0 || s[n - 2] != '\n' || s[n - 1] != '\n')
        return 0;
    if (memchr(s, '\r', (size_t)n) != NULL)
        return 0;
    for (Py_ssize_t i = 0; i < n - 2; i++)
        if (s[i] == '\n' && s[i + 1] == '\n')
            return 0;
    /* The client's connection: open. */
    if ((t = attr_true(self->conn, s_closing)) != 0)
        return t < 0 ? -1 : 0;
    if ((t = attr_none(self->conn, s_transport)) != 0)
        return t < 0 ? -1 : 0;
    /* One segment, not a continuation by ids; room to keep it. */
    PyObject *segments = PyObject_GetAttr(self->st, s_segments);
    if (segments == NULL)
        return -1;
    if (!PyList_Check(segments) || PyList_GET_SIZE(segments) != 1) {
        Py_DECREF(segments);
        return 0;
    }
    PyObject *seg = PyList_GET_ITEM(segments, 0);
    Py_INCREF(seg);
    Py_DECREF(segments);
    if ((t = attr_true(seg, s_by_ids)) != 0)
        goto not_plain;
    PyObject *kb = PyObject_GetAttr(self->st, s_kept_bytes);
    if (kb == NULL)
        goto fail;
    Py_ssize_t kept = PyLong_AsSsize_t(kb);
    Py_DECREF(kb);
    if (kept == -1 && PyErr_Occurred())
        goto fail;
    if (kept + n > self->max_kept) {
        t = 0;
        goto not_plain;
    }
    /* The chunk: decoded to the fields that decide (`Deferred.event`'s). */
    PyObject *body = PyBytes_FromStringAndSize(s + 5, n - 5);
    if (body == NULL)
        goto fail;
    PyObject *chunk = PyObject_CallOneArg(self->decode, body);
    Py_DECREF(body);
    if (chunk == NULL) {
        PyErr_Clear(); /* not of the form read here: `take`'s to say */
        t = 0;
        goto not_plain;
    }
    PyObject *choices = PyObject_GetAttr(chunk, s_choices);
    PyObject *error = PyObject_GetAttr(chunk, s_error);
    PyObject *usage = PyObject_GetAttr(chunk, s_usage);
    PyObject *pids = PyObject_GetAttr(chunk, s_prompt_token_ids);
    Py_DECREF(chunk);
    t = -1;
    if (choices == NULL || error == NULL || usage == NULL || pids == NULL)
        goto chunk_done;
    t = 0;
    if (!PyList_CheckExact(choices) || PyList_GET_SIZE(choices) == 0 || error != self->unset
        || PyDict_Check(usage) || pids != Py_None)
        goto chunk_done;
    PyObject *first = PyList_GET_ITEM(choices, 0);
    PyObject *finish = PyObject_GetAttr(first, s_finish_reason);
    PyObject *fpids = PyObject_GetAttr(first, s_prompt_token_ids);
    PyObject *ids = PyObject_GetAttr(first, s_token_ids);
    if (finish == NULL || fpids == NULL || ids == NULL)
        t = -1;
    else if ((PyUnicode_Check(finish) && PyUnicode_CompareWithASCIIString(finish, "abort") == 0)
             || fpids != Py_None)
        t = 0;
    else {
        t = 1;
        *null_out = ids != Py_None;
    }
    Py_XDECREF(finish);
    Py_XDECREF(fpids);
    Py_XDECREF(ids);
chunk_done:
    Py_XDECREF(choices);
    Py_XDECREF(error);
    Py_XDECREF(usage);
    Py_XDECREF(pids);
    if (t == 1 && *null_out) {
        /* The ids taken out only where the gateway asked for them, not the client. */
        int w = attr_true(self->st, s_ids_wanted);
        int x = w == 1 ? attr_true(self->st, s_strip_ids) : w;
        if (x < 0)
            goto fail;
        *null_out = x;
    }
    if (t != 1)
        goto not_plain;
    *seg_out = seg;
    *kept_out = kept;
    return 1;
not_plain:
    Py_DECREF(seg);
    return t < 0 ? -1 : 0;
fail:
    Py_DECREF(seg);
    return -1;
}

static PyObject *
relay_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Relay *self = (Relay *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "a relay takes one read (bytes)");
        return NULL;
    }
    PyObject *data = args[0];
    PyObject *seg = NULL;
    int null_ids = 0;
    Py_ssize_t kept = 0;
    int p = plain(self, data, &seg, &null_ids, &kept);
    if (p != 1) {
        /* Not one kept here (or what decides could not be read: `take` reads it again,
         * and says what went wrong as it would have). */
        if (p < 0)
            PyErr_Clear();
        return PyObject_CallOneArg(self->take, data);
    }
    /* Kept for the reading at a break, counted, and written. */
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    PyObject *list = PyObject_GetAttr(self->st, s_kept);
    PyObject *nb = PyLong_FromSsize_t(kept + n);
    int r = -1;
    if (list != NULL && nb != NULL && PyList_Check(list) && PyList_Append(list, data) == 0
        && PyObject_SetAttr(self->st, s_kept_bytes, nb) == 0 && attr_add(seg, s_chunks, 1) == 0)
        r = 0;
    Py_XDECREF(list);
    Py_XDECREF(nb);
    Py_DECREF(seg);
    if (r < 0)
        return NULL; /* the Python objects are not what this reads: said, not hidden */
    PyObject *out = framed(PyBytes_AS_STRING(data), n, null_ids, self->chunked);
    if (out == NULL)
        return NULL;
    PyObject *transport = PyObject_GetAttr(self->conn, s_transport);
    PyObject *done = NULL;
    if (transport != NULL) {
        done = PyObject_CallMethodOneArg(transport, s_write, out);
        Py_DECREF(transport);
    }
    Py_DECREF(out);
    if (done == NULL) {
        /* Raised in the request's coroutine, not the read's (as `take` does). */
        PyObject *type, *value, *tb;
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL)
            PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        Py_XSETREF(self->failed, value);
        Py_RETURN_FALSE;
    }
    Py_DECREF(done);
    int behind = attr_true(self->conn, s_write_paused);
    if (behind < 0)
        return NULL;
    if (behind) {
        self->behind = 1;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static int
relay_init(Relay *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"take", "plan", "st", "conn", "chunked", "decode", "unset", "max_kept", NULL};
    PyObject *take, *plan, *st, *conn, *decode, *unset;
    int chunked;
    Py_ssize_t max_kept;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOpOOn:Relay", kw, &take, &plan, &st, &conn,
                                     &chunked, &decode, &unset, &max_kept))
        return -1;
    Py_XSETREF(self->take, Py_NewRef(take));
    Py_XSETREF(self->plan, Py_NewRef(plan));
    Py_XSETREF(self->st, Py_NewRef(st));
    Py_XSETREF(self->conn, Py_NewRef(conn));
    Py_XSETREF(self->decode, Py_NewRef(decode));
    Py_XSETREF(self->unset, Py_NewRef(unset));
    Py_XSETREF(self->failed, Py_NewRef(Py_None));
    self->chunked = chunked;
    self->max_kept = max_kept;
    self->behind = 0;
    self->vectorcall = relay_call;
    return 0;
}

static int
relay_traverse(Relay *self, visitproc visit, void *arg)
{
    Py_VISIT(self->take);
    Py_VISIT(self->plan);
    Py_VISIT(self->st);
    Py_VISIT(self->conn);
    Py_VISIT(self->decode);
    Py_VISIT(self->unset);
    Py_VISIT(self->failed);
    Py_VISIT(self->time);
    Py_VISIT(self->feed);
    Py_VISIT(self->errors);
    Py_VISIT(self->unparsed);
    Py_VISIT(self->pairs);
    Py_VISIT(self->reasons);
    Py_VISIT(self->fallback);
    return 0;
}

static int
relay_clear(Relay *self)
{
    Py_CLEAR(self->take);
    Py_CLEAR(self->plan);
    Py_CLEAR(self->st);
    Py_CLEAR(self->conn);
    Py_CLEAR(self->decode);
    Py_CLEAR(self->unset);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->time);
    Py_CLEAR(self->feed);
    Py_CLEAR(self->errors);
    Py_CLEAR(self->unparsed);
    Py_CLEAR(self->pairs);
    Py_CLEAR(self->reasons);
    Py_CLEAR(self->fallback);
    return 0;
}

static void
relay_dealloc(Relay *self)
{
    PyObject_GC_UnTrack(self);
    relay_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
get_behind(Relay *self, void *closure)
{
    return PyBool_FromLong(self->behind);
}

static int
set_behind(Relay *self, PyObject *v, void *closure)
{
    int t = v == NULL ? 0 : PyObject_IsTrue(v);
    if (t < 0)
        return -1;
    self->behind = t;
    return 0;
}

static PyObject *
get_failed(Relay *self, void *closure)
{
    return Py_NewRef(self->failed != NULL ? self->failed : Py_None);
}

static int
set_failed(Relay *self, PyObject *v, void *closure)
{
    Py_XSETREF(self->failed, Py_NewRef(v == NULL ? Py_None : v));
    return 0;
}

static PyGetSetDef relay_getset[] = {
    {"behind", (getter)get_behind, (setter)set_behind,
     "The client was behind after a write here: the request's coroutine drains.", NULL},
    {"failed", (getter)get_failed, (setter)set_failed,
     "What a write here raised (None): raised in the request's coroutine.", NULL},
    {NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "services.gateway._relay.Relay",
    .tp_doc = "relay.Relay, compiled: a continued stream's chunks of text passed on in C.",
    .tp_basicsize = sizeof(Relay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)relay_init,
    .tp_dealloc = (destructor)relay_dealloc,
    .tp_traverse = (traverseproc)relay_traverse,
    .tp_clear = (inquiry)relay_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Relay, vectorcall),
    .tp_getset = relay_getset,
};


/* ---- the upstream connection's read callbacks (`upstream._Conn.data_received` and
 * `on_body`), compiled: set on a connection of the lean client as its own attributes
 * (`_Conn.__init__`), so that uvloop and httptools call them with no Python frame. Each
 * is its method's body, step for step. */


/* OnData(conn, time, feed, errors, unparsed)(data): `_Conn.data_received`. */
static PyObject *
on_data(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Relay *self = (Relay *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "data_received takes one read");
        return NULL;
    }
    PyObject *now = PyObject_CallNoArgs(self->time);
    if (now == NULL)
        return NULL;
    int r = PyObject_SetAttr(self->conn, s_last_read, now);
    Py_DECREF(now);
    if (r < 0)
        return NULL;
    PyObject *done = PyObject_CallOneArg(self->feed, args[0]);
    if (done != NULL) {
        Py_DECREF(done);
        Py_RETURN_NONE;
    }
    if (!PyErr_ExceptionMatches(self->errors))
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyObject *said = PyObject_CallFunctionObjArgs(self->unparsed, value, args[0], NULL);
    Py_DECREF(value);
    if (said == NULL)
        return NULL;
    Py_DECREF(said);
    Py_RETURN_NONE;
}

/* OnBody(conn)(data): `_Conn.on_body`. */
static PyObject *
on_body(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Relay *self = (Relay *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "on_body takes one part of a body");
        return NULL;
    }
    PyObject *body = PyObject_GetAttr(self->conn, s_body);
    if (body == NULL)
        return NULL;
    PyObject *sink = PyObject_GetAttr(body, s__sink);
    PyObject *res = NULL;
    if (sink == NULL)
        goto done;
    if (sink == Py_None) {
        res = PyObject_CallMethodOneArg(body, s__feed, args[0]);
        goto done;
    }
    PyObject *went_on = PyObject_CallOneArg(sink, args[0]);
    if (went_on == NULL)
        goto done;
    int t = PyObject_IsTrue(went_on);
    Py_DECREF(went_on);
    if (t < 0)
        goto done;
    if (t == 0) {
        /* Taken where it was read, no reader woken for it: unless the sink stops. */
        if (PyObject_SetAttr(body, s__sink, Py_None) < 0)
            goto done;
        res = PyObject_CallMethodNoArgs(body, s__wake);
        goto done;
    }
    res = Py_NewRef(Py_None);
done:
    Py_XDECREF(sink);
    Py_DECREF(body);
    if (res == NULL)
        return NULL;
    Py_DECREF(res);
    Py_RETURN_NONE;
}

static int
hook_init(Relay *self, PyObject *args, PyObject *kwds, int data)
{
    static char *kw_data[] = {"conn", "time", "feed", "errors", "unparsed", NULL};
    static char *kw_body[] = {"conn", NULL};
    PyObject *conn, *time = Py_None, *feed = Py_None, *errors = Py_None, *unparsed = Py_None;
    if (data ? !PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO:OnData", kw_data, &conn, &time,
                                            &feed, &errors, &unparsed)
             : !PyArg_ParseTupleAndKeywords(args, kwds, "O:OnBody", kw_body, &conn))
        return -1;
    Py_XSETREF(self->conn, Py_NewRef(conn));
    Py_XSETREF(self->time, Py_NewRef(time));
    Py_XSETREF(self->feed, Py_NewRef(feed));
    Py_XSETREF(self->errors, Py_NewRef(errors));
    Py_XSETREF(self->unparsed, Py_NewRef(unparsed));
    self->vectorcall = data ? on_data : on_body;
    return 0;
}

static int
on_data_init(Relay *self, PyObject *args, PyObject *kwds)
{
    return hook_init(self, args, kwds, 1);
}

static int
on_body_init(Relay *self, PyObject *args, PyObject *kwds)
{
    return hook_init(self, args, kwds, 0);
}


/* ---- the lean server's head, read and written (`front._Conn.on_header` and
 * `front.answer_head`), compiled: the same rule step for step, held equal to it by
 * tests/gateway/test_heads.py. */

/* A header callback's two arguments (a name and a value, bytes) decoded as latin-1 into
 * new references: 0, or -1 with an error set and nothing held. */
static int
header_args(PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject **k,
            PyObject **v)
{
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL || !PyBytes_Check(args[0])
        || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "on_header takes a name and a value, bytes");
        return -1;
    }
    *k = PyUnicode_DecodeLatin1(PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]), NULL);
    if (*k == NULL)
        return -1;
    *v = PyUnicode_DecodeLatin1(PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]), NULL);
    if (*v == NULL) {
        Py_CLEAR(*k);
        return -1;
    }
    return 0;
}

/* OnHeader(conn, pairs, most)(name, value): `front._Conn.on_header`, each header of a
 * request's head added to `pairs` (its name and value, latin-1), at most `most` of them:
 * past it, the connection's `_bad` says so and ValueError stops the parse. */
static PyObject *
on_header(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Relay *self = (Relay *)callable;
    if (PyList_GET_SIZE(self->pairs) >= self->max_kept) {
        PyObject *bad = PyUnicode_FromFormat("over %zd headers", self->max_kept);
        if (bad == NULL)
            return NULL;
        if (PyObject_SetAttr(self->conn, s__bad, bad) == 0)
            PyErr_SetObject(PyExc_ValueError, bad);
        Py_DECREF(bad);
        return NULL;
    }
    PyObject *k, *v;
    if (header_args(args, nargsf, kwnames, &k, &v) < 0)
        return NULL;
    PyObject *pair = PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(k);
        Py_DECREF(v);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, k);
    PyTuple_SET_ITEM(pair, 1, v);
    int r = PyList_Append(self->pairs, pair);
    Py_DECREF(pair);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A growing buffer of bytes. */
typedef struct {
    char *at;
    Py_ssize_t len, cap;
} Buf;

static int
put(Buf *b, const char *s, Py_ssize_t n)
{
    if (b->len + n > b->cap) {
        Py_ssize_t cap = b->cap * 2 > b->len + n ? b->cap * 2 : b->len + n + 256;
        char *at = PyMem_Realloc(b->at, (size_t)cap);
        if (at == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->at = at;
        b->cap = cap;
    }
    memcpy(b->at + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT(b, lit) put(b, lit, (Py_ssize_t)(sizeof lit - 1))

/* Whether every name and value of `headers` (a dict) is a str: where one is not, the
 * head is the rule's to make, before any line is written (both rules format or encode
 * each before they look at a line). */
static int
all_str(PyObject *headers)
{
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(headers, &pos, &k, &v))
        if (!PyUnicode_CheckExact(k) || !PyUnicode_CheckExact(v))
            return 0;
    return 1;
}

/* The head's header lines, into `b`: 1 done, 0 for the rule's own way (a name or a value
 * that is not a str, or not UTF-8), -1 with ValueError for a line broken inside. */
static int
header_lines(Buf *b, PyObject *headers)
{
    if (!all_str(headers))
        return 0;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(headers, &pos, &k, &v)) {
        Py_ssize_t kn, vn;
        const char *ks = PyUnicode_AsUTF8AndSize(k, &kn);
        const char *vs = ks == NULL ? NULL : PyUnicode_AsUTF8AndSize(v, &vn);
        if (vs == NULL) {
            PyErr_Clear();
            return 0;
        }
        /* A line of each header, each with one CR and one LF: the rule's counts equal
         * the headers' exactly where no name or value holds either. */
        if (memchr(ks, '\n', (size_t)kn) || memchr(ks, '\r', (size_t)kn)
            || memchr(vs, '\n', (size_t)vn) || memchr(vs, '\r', (size_t)vn)) {
            PyErr_SetString(PyExc_ValueError, "a header with a newline");
            return -1;
        }
        if (put(b, ks, kn) < 0 || PUT(b, ": ") < 0 || put(b, vs, vn) < 0 || PUT(b, "\r\n") < 0)
            return -1;
    }
    return 1;
}

/* Head(reasons, fallback)(version, keep_alive, status, headers, length, date_line):
 * `front.answer_head`. What it does not take the fast way (headers not a dict, a name or
 * a value not a str, a status or a length not an int) goes to `fallback`, the rule. */
static PyObject *
head_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Relay *self = (Relay *)callable;
    if (PyVectorcall_NARGS(nargsf) != 6 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "answer_head takes six arguments");
        return NULL;
    }
    PyObject *version = args[0], *status = args[2], *headers = args[3], *length = args[4],
             *date_line = args[5];
    if (!PyUnicode_CheckExact(version) || !PyLong_CheckExact(status)
        || !PyDict_CheckExact(headers) || !(length == Py_None || PyLong_CheckExact(length))
        || !PyBytes_CheckExact(date_line))
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    int keep_alive = PyObject_IsTrue(args[1]);
    if (keep_alive < 0)
        return NULL;
    long code = PyLong_AsLong(status);
    long long len = length == Py_None ? 0 : PyLong_AsLongLong(length);
    if ((code == -1 || len == -1) && PyErr_Occurred()) {
        PyErr_Clear();
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    }
    int v11 = PyUnicode_CompareWithASCIIString(version, "1.1") == 0;
    Buf b = {NULL, 0, 0};
    PyObject *out = NULL;
    char num[48];
    int n = snprintf(num, sizeof num, "HTTP/%s %ld ", v11 ? "1.1" : "1.0", code);
    if (put(&b, num, n) < 0)
        goto done;
    PyObject *reason = PyDict_GetItemWithError(self->reasons, status); /* borrowed */
    if (reason == NULL && PyErr_Occurred())
        goto done;
    if (reason != NULL) {
        if (!PyBytes_Check(reason)) {
            PyErr_SetString(PyExc_TypeError, "a reason phrase is bytes");
            goto done;
        }
        if (put(&b, PyBytes_AS_STRING(reason), PyBytes_GET_SIZE(reason)) < 0)
            goto done;
    }
    if (PUT(&b, "\r\n") < 0)
        goto done;
    int lines = header_lines(&b, headers);
    if (lines < 0)
        goto done;
    if (lines == 0) {
        out = PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
        goto done;
    }
    if (length == Py_None) {
        if (PUT(&b, "Transfer-Encoding: chunked\r\n") < 0)
            goto done;
    }
    else if (len >= 0) {
        n = snprintf(num, sizeof num, "Content-Length: %lld\r\n", len);
        if (put(&b, num, n) < 0)
            goto done;
    }
    /* Said where it is not the version's default (aiohttp's rule). */
    if (v11 && !keep_alive) {
        if (PUT(&b, "Connection: close\r\n") < 0)
            goto done;
    }
    else if (!v11 && keep_alive) {
        if (PUT(&b, "Connection: keep-alive\r\n") < 0)
            goto done;
    }
    if (put(&b, PyBytes_AS_STRING(date_line), PyBytes_GET_SIZE(date_line)) < 0)
        goto done;
    out = PyBytes_FromStringAndSize(b.at, b.len);
done:
    PyMem_Free(b.at);
    return out;
}

static int
on_header_init(Relay *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"conn", "pairs", "most", NULL};
    PyObject *conn, *pairs;
    Py_ssize_t most;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!n:OnHeader", kw, &conn, &PyList_Type,
                                     &pairs, &most))
        return -1;
    Py_XSETREF(self->conn, Py_NewRef(conn));
    Py_XSETREF(self->pairs, Py_NewRef(pairs));
    self->max_kept = most;
    self->vectorcall = on_header;
    return 0;
}

static int
head_init(Relay *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"reasons", "fallback", NULL};
    PyObject *reasons, *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O:Head", kw, &PyDict_Type, &reasons,
                                     &fallback))
        return -1;
    Py_XSETREF(self->reasons, Py_NewRef(reasons));
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    self->vectorcall = head_call;
    return 0;
}


/* ---- the lean client's side: an answer's header callback and a request's head
 * (`upstream._Conn.on_header` as the Python client sets it, and `upstream.request_head`),
 * compiled; held equal by tests/gateway/test_heads.py. */

/* OnAnswerHeader(said)(name, value): `said.setdefault(name, value)`, the name and the
 * value decoded (latin-1) as they come, not after the head (`_Conn.on_headers_complete`):
 * latin-1 is one character a byte both ways, so the names kept and the values kept are
 * the same. */
static PyObject *
on_answer_header(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Relay *self = (Relay *)callable;
    PyObject *k, *v;
    if (header_args(args, nargsf, kwnames, &k, &v) < 0)
        return NULL;
    PyObject *got = PyDict_SetDefault(self->pairs, k, v); /* borrowed */
    Py_DECREF(k);
    Py_DECREF(v);
    if (got == NULL)
        return NULL;
    Py_RETURN_NONE;
}

/* RequestHead(fallback)(start, headers, length): `upstream.request_head`. What it does
 * not take the fast way (headers not a dict, a name or a value not a str, a name not
 * UTF-8, a length not an int of 0 or more) goes to `fallback`, the rule. */
static PyObject *
request_head_call(PyObject *callable, PyObject *const *args, size_t nargsf,
                  PyObject *kwnames)
{
    Relay *self = (Relay *)callable;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "request_head takes three arguments");
        return NULL;
    }
    PyObject *start = args[0], *headers = args[1], *length = args[2];
    if (!PyBytes_CheckExact(start) || !PyDict_CheckExact(headers) || !PyLong_CheckExact(length))
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    long long len = PyLong_AsLongLong(length);
    if (len < 0) {
        PyErr_Clear();
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    }
    if (!all_str(headers))
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    Buf b = {NULL, 0, 0};
    PyObject *out = NULL;
    if (put(&b, PyBytes_AS_STRING(start), PyBytes_GET_SIZE(start)) < 0)
        goto done;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(headers, &pos, &k, &v)) {
        Py_ssize_t kn, vn;
        const char *ks = PyUnicode_AsUTF8AndSize(k, &kn);
        if (ks == NULL) {
            PyErr_Clear();
            out = PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
            goto done;
        }
        if (PUT(&b, "\r\n") < 0 || put(&b, ks, kn) < 0 || PUT(&b, ": ") < 0)
            goto done;
        const char *vs = PyUnicode_AsUTF8AndSize(v, &vn);
        if (vs != NULL) {
            if (put(&b, vs, vn) < 0)
                goto done;
            continue;
        }
        /* Not UTF-8 as it is (a lone surrogate): as the rule encodes it. */
        PyErr_Clear();
        PyObject *e = PyUnicode_AsEncodedString(v, "utf-8", "surrogateescape");
        if (e == NULL)
            goto done;
        int r = put(&b, PyBytes_AS_STRING(e), PyBytes_GET_SIZE(e));
        Py_DECREF(e);
        if (r < 0)
            goto done;
    }
    int accept = PyDict_Contains(headers, s_Accept);
    if (accept < 0 || (!accept && PUT(&b, "\r\nAccept: */*") < 0))
        goto done;
    char num[48];
    int n = snprintf(num, sizeof num, "\r\nContent-Length: %lld\r\n\r\n", len);
    if (put(&b, num, n) < 0)
        goto done;
    out = PyBytes_FromStringAndSize(b.at, b.len);
done:
    PyMem_Free(b.at);
    return out;
}

static int
on_answer_header_init(Relay *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"said", NULL};
    PyObject *said;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!:OnAnswerHeader", kw, &PyDict_Type, &said))
        return -1;
    Py_XSETREF(self->pairs, Py_NewRef(said));
    self->vectorcall = on_answer_header;
    return 0;
}

static int
request_head_init(Relay *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"fallback", NULL};
    PyObject *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:RequestHead", kw, &fallback))
        return -1;
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    self->vectorcall = request_head_call;
    return 0;
}

#define HOOK_TYPE(var, pyname, doc, init)                                                   \
    static PyTypeObject var = {                                                             \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "services.gateway._relay." pyname,        \
        .tp_doc = doc,                                                                      \
        .tp_basicsize = sizeof(Relay),                                                       \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,   \
        .tp_new = PyType_GenericNew,                                                        \
        .tp_init = (initproc)init,                                                          \
        .tp_dealloc = (destructor)relay_dealloc,                                             \
        .tp_traverse = (traverseproc)relay_traverse,                                         \
        .tp_clear = (inquiry)relay_clear,                                                    \
        .tp_call = PyVectorcall_Call,                                                       \
        .tp_vectorcall_offset = offsetof(Relay, vectorcall),                                 \
    };

HOOK_TYPE(OnDataType, "OnData", "upstream._Conn.data_received, compiled.", on_data_init)
HOOK_TYPE(OnBodyType, "OnBody", "upstream._Conn.on_body, compiled.", on_body_init)
HOOK_TYPE(OnHeaderType, "OnHeader", "front._Conn.on_header, compiled.", on_header_init)
HOOK_TYPE(HeadType, "Head", "front.answer_head, compiled.", head_init)
HOOK_TYPE(OnAnswerHeaderType, "OnAnswerHeader", "upstream._Conn.on_header, compiled.",
          on_answer_header_init)
HOOK_TYPE(RequestHeadType, "RequestHead", "upstream.request_head, compiled.", request_head_init)

static PyMethodDef methods[] = {
    {"null_ids", null_ids, METH_O,
     "continuation._NULL_IDS.sub(_null, raw), in C: the token ids' lists written null."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "services.gateway._relay",
    "The compiled chunk relay (services.gateway.relay).", -1, methods,
};

#define INTERN(var, text)                                                                   \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                   \
        return NULL;

PyMODINIT_FUNC
PyInit__relay(void)
{
    INTERN(s_broken, "broken");
    INTERN(s_wrote, "wrote");
    INTERN(s_strip_counts, "strip_counts");
    INTERN(s_id, "id");
    INTERN(s_segments, "segments");
    INTERN(s_by_ids, "by_ids");
    INTERN(s_kept, "kept");
    INTERN(s_kept_bytes, "kept_bytes");
    INTERN(s_chunks, "chunks");
    INTERN(s_ids_wanted, "ids_wanted");
    INTERN(s_strip_ids, "strip_ids");
    INTERN(s_closing, "closing");
    INTERN(s_transport, "transport");
    INTERN(s_write_paused, "write_paused");
    INTERN(s_write, "write");
    INTERN(s_choices, "choices");
    INTERN(s_error, "error");
    INTERN(s_usage, "usage");
    INTERN(s_prompt_token_ids, "prompt_token_ids");
    INTERN(s_finish_reason, "finish_reason");
    INTERN(s_token_ids, "token_ids");
    INTERN(s_last_read, "last_read");
    INTERN(s_body, "body");
    INTERN(s__sink, "_sink");
    INTERN(s__feed, "_feed");
    INTERN(s__wake, "_wake");
    INTERN(s__bad, "_bad");
    INTERN(s_Accept, "Accept");
    if (PyType_Ready(&RelayType) < 0 || PyType_Ready(&OnDataType) < 0
        || PyType_Ready(&OnBodyType) < 0 || PyType_Ready(&OnHeaderType) < 0
        || PyType_Ready(&HeadType) < 0 || PyType_Ready(&OnAnswerHeaderType) < 0
        || PyType_Ready(&RequestHeadType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Relay", (PyObject *)&RelayType) < 0
        || PyModule_AddObjectRef(m, "OnData", (PyObject *)&OnDataType) < 0
        || PyModule_AddObjectRef(m, "OnBody", (PyObject *)&OnBodyType) < 0
        || PyModule_AddObjectRef(m, "OnHeader", (PyObject *)&OnHeaderType) < 0
        || PyModule_AddObjectRef(m, "Head", (PyObject *)&HeadType) < 0
        || PyModule_AddObjectRef(m, "OnAnswerHeader", (PyObject *)&OnAnswerHeaderType) < 0
        || PyModule_AddObjectRef(m, "RequestHead", (PyObject *)&RequestHeadType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
