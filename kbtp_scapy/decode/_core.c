/*
 * The compiled core of `kbtp decode`: pcap and pcapng records, the frame walk of frames.py,
 * RoCE Sends by PSN with the ICRC check (roce.py), iWARP TCP/MPA/DDP Sends (iwarp.py with
 * sends_only), KBTP messages with each session's ADDR_LE (capture.py), and the JSON line
 * json.dumps(to_json(found)) writes or kbtp decode's text line (summary.py's summary). A
 * port of those modules, which stay the reference; the KBTP layouts come from
 * _core_tables.h, generated from the field tables. Hand-written: record, frame and
 * transport arithmetic, no layout. This unit is the module: its configuration, the run,
 * the report; the others are named in _core.h.
 *
 * A malformed KBTP message, which the core does not render itself, is rendered by the
 * `malformed` callback (the codec, and to_json or the text line), with the session state
 * the core keeps.
 */
#include "_core.h"

static int config(Core *c, PyObject *cfg)
{
#define INT(name, field) do { PyObject *v = PyDict_GetItemString(cfg, name); \
        if (v == NULL) { PyErr_Format(PyExc_KeyError, "config lacks %s", name); return -1; } \
        c->field = PyLong_AsUnsignedLong(v); if (PyErr_Occurred()) return -1; } while (0)
    INT("chunk", chunk);
    INT("max_record", max_record);
    INT("max_message", max_message);
    INT("max_closed", max_closed);
    INT("max_pending", max_pending);
    INT("max_followed", max_followed);
    INT("marker_interval", marker_interval);
    INT("marker_len", marker_len);
    INT("max_out_of_order", max_out_of_order);
    INT("max_unframed", max_unframed);
    INT("ddp_tagged_len", ddp_tagged_len);
    INT("flag_c", flag_c);
    INT("roce_port", roce_port);
    INT("ddp_untagged_len", ddp_untagged_len);
    INT("flag_m", flag_m);
    INT("flag_r", flag_r);
    INT("mpa_startup_len", mpa_startup_len);
#undef INT
    if (!c->marker_interval || !c->marker_len) {
        PyErr_SetString(PyExc_ValueError, "config: marker interval and length must not be zero");
        return -1;
    }
    for (int i = 0; i < 256; i++)
        c->send_pos[i] = -1;
    PyObject *sends = PyDict_GetItemString(cfg, "roce_sends");
    PyObject *iw = PyDict_GetItemString(cfg, "iwarp_sends");
    PyObject *req = PyDict_GetItemString(cfg, "mpa_req_key"), *rep = PyDict_GetItemString(cfg, "mpa_rep_key");
    if (sends == NULL || iw == NULL || req == NULL || rep == NULL || !PyBytes_Check(req) || !PyBytes_Check(rep)
        || PyBytes_GET_SIZE(req) != 16 || PyBytes_GET_SIZE(rep) != 16) {
        PyErr_SetString(PyExc_ValueError, "config lacks the Send tables or the MPA keys");
        return -1;
    }
    memcpy(c->req_key, PyBytes_AS_STRING(req), 16);
    memcpy(c->rep_key, PyBytes_AS_STRING(rep), 16);
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(sends, &pos, &k, &v)) {
        long op = PyLong_AsLong(k);
        int p, e;
        if ((op == -1 && PyErr_Occurred()) || op < 0 || op > 255 || !PyArg_ParseTuple(v, "ii", &p, &e))
            return -1;
        c->send_pos[op] = p;
        c->send_ext[op] = e;
    }
    PyObject *it = PyObject_GetIter(iw);
    if (it == NULL)
        return -1;
    while ((v = PyIter_Next(it)) != NULL) {
        long op = PyLong_AsLong(v);
        Py_DECREF(v);
        if (op >= 0 && op < 16)
            c->iw_sends[op] = 1;
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

static int report(Core *c, PyObject *stats)
{
    PyObject *first = c->have_first ? PyFloat_FromDouble(c->first_time) : Py_NewRef(Py_None);
    PyObject *cut_short = c->cut_short ? PyLong_FromUnsignedLongLong(c->cut_short) : Py_NewRef(Py_None);
    PyObject *damage = c->damage_first == NULL ? Py_NewRef(Py_None)
        : Py_BuildValue("(OOKKKKO)", c->damage_first, c->damage_last, c->damage_skipped, c->damage_position,
                        c->damage_places, c->damage_total, c->damage_lost ? Py_True : Py_False);
    if (damage == NULL) {
        Py_DECREF(first);
        Py_DECREF(cut_short);
        return -1;
    }
    PyObject *r = Py_BuildValue("{sKsNsKsKsKsNsNsOsKsn}", "frames", c->frames, "first_time", first, "cut", c->cut,
                                "messages", c->messages, "malformed", c->n_malformed, "cut_short", cut_short,
                                "damage", damage, "unsupported", c->unsupported,
                                "position", c->base + c->at, "conns", (Py_ssize_t)c->sessions.n);
    if (r == NULL)
        return -1;
    int rc = PyDict_Update(stats, r);
    Py_DECREF(r);
    return rc;
}

static void sessions_free(void *v) { free(v); }

static PyObject *run(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"config", "readinto", "head", "base", "pcapng", "big", "unit", "linktype",
                            "snaplen", "text", "sink", "progress", "malformed", "stats", NULL};
    PyObject *cfg, *stats;
    Py_buffer head;
    Core c;
    memset(&c, 0, sizeof c);
    unsigned long long base;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!Oy*KppdikpOOOO!", names, &PyDict_Type, &cfg, &c.readinto, &head,
                                     &base, &c.pcapng, &c.big, &c.unit, &c.pcap_linktype, &c.snaplen, &c.text, &c.sink,
                                     &c.progress, &c.malformed, &PyDict_Type, &stats))
        return NULL;
    (void)self;
    c.base = base;
    int rc = config(&c, cfg);
    c.unsupported = PyDict_New();
    if (c.unsupported == NULL)
        rc = -1;
    if (rc == 0)
        rc = buf_put(&c.in, head.buf, (size_t)head.len);
    PyBuffer_Release(&head);
    if (rc == 0)
        rc = c.pcapng ? pcapng_records(&c) : pcap_records(&c);
    if (rc == 0)
        rc = roce_flush(&c);
    if (rc == 0)
        rc = iwarp_flush(&c);
    PyObject *exc = NULL, *val = NULL, *tb = NULL;
    if (rc < 0)
        PyErr_Fetch(&exc, &val, &tb);
    int frc = flush_out(&c);
    if (rc < 0)
        PyErr_Restore(exc, val, tb);
    else
        rc = frc;
    if (c.unsupported != NULL) {
        if (rc < 0)
            PyErr_Fetch(&exc, &val, &tb);
        if (report(&c, stats) < 0 && rc == 0)
            rc = -1;
        else if (rc < 0)
            PyErr_Restore(exc, val, tb);
    }
    free_dead(&c);
    map_free(&c.flows, flow_free);
    free_dead(&c);
    map_free(&c.closed, NULL);
    map_free(&c.parts, part_free);
    map_free(&c.sessions, sessions_free);
    conns_free(&c);
    buf_free(&c.in);
    buf_free(&c.out);
    buf_free(&c.scratch);
    buf_free(&c.closed_order);
    Py_XDECREF(c.unsupported);
    Py_XDECREF(c.damage_first);
    Py_XDECREF(c.damage_last);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_VARARGS | METH_KEYWORDS,
     "Decode the records after a capture's header into lines, JSON or text; see kbtp_scapy.decode.core."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_core", "The compiled core of kbtp decode --json.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void)
{
    crc_init();
    return PyModule_Create(&module);
}
