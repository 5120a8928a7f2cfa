/* KBTP messages of the decoder core: fields from the generated tables (codec.decode), each
 * session's number and ADDR_LE (capture.kbtp_messages), and the JSON line to_json gives or
 * the text line of kbtp decode (cli/decode.py's _line, summary.describe). */
#include "_core.h"
#include <arpa/inet.h>
#include <sys/socket.h>

#include "_core_tables.h"

/* One session (capture.session_key): its number, ADDR_LE and its addresses as text. */
typedef struct { long number; int le; uint8_t a_len, b_len; uint8_t a_raw[16], b_raw[16]; char a[48], b[48]; } Session;

int flush_out(Core *c)
{
    if (!c->out.len)
        return 0;
    PyObject *r = PyObject_CallFunction(c->sink, "y#", (const char *)c->out.p, (Py_ssize_t)c->out.len);
    c->out.len = 0;
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int put_str(Buf *b, const char *s) { return buf_put(b, s, strlen(s)); }

static int put_uint(Buf *b, unsigned long long v)
{
    char tmp[24];
    int i = 24;
    do {
        tmp[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return buf_put(b, tmp + i, (size_t)(24 - i));
}

/* round(t, 6) as json.dumps writes the float: Python's repr. */
static int put_time(Buf *b, double t)
{
    char *fixed = PyOS_double_to_string(t, 'f', 6, 0, NULL);
    if (fixed == NULL)
        return -1;
    double r = PyOS_string_to_double(fixed, NULL, NULL);
    PyMem_Free(fixed);
    if (r == -1.0 && PyErr_Occurred())
        return -1;
    char *text = PyOS_double_to_string(r, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (text == NULL)
        return -1;
    int rc = put_str(b, text);
    PyMem_Free(text);
    return rc;
}

static int put_hex(Buf *b, const uint8_t *p, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    if (buf_reserve(b, 2 * n + 2) < 0)
        return -1;
    uint8_t *o = b->p + b->len;
    *o++ = '"';
    for (size_t i = 0; i < n; i++) {
        *o++ = (uint8_t)digits[p[i] >> 4];
        *o++ = (uint8_t)digits[p[i] & 15];
    }
    *o++ = '"';
    b->len += 2 * n + 2;
    return 0;
}

static void addr_text(const Addr *a, char *out)
{
    if (inet_ntop(a->len == 4 ? AF_INET : AF_INET6, a->raw, out, 48) == NULL)
        out[0] = 0;
}

int looks_like_kbtp(const uint8_t *p, size_t n)
{
    if (n < KBTP_HEADER_SIZE || p[KBTP_VERSION_AT] != KBTP_VERSION)
        return 0;
    int op = p[KBTP_OPCODE_AT];
    return kbtp_opcodes[op] != NULL || (op >= KBTP_PRIVATE_FIRST && op <= KBTP_PRIVATE_LAST);
}

static uint64_t field_value(const kbtp_field *f, const uint8_t *p, int le)
{
    uint64_t v = 0;
    const uint8_t *q = p + f->at;
    if (f->kind == KF_ADDRESS && le)
        for (int i = f->size - 1; i >= 0; i--)
            v = v << 8 | q[i];
    else
        for (int i = 0; i < f->size; i++)
            v = v << 8 | q[i];
    return v;
}

/* The layout a well-formed message has, or NULL when codec.decode raises Malformed. */
static const kbtp_layout *layout_of(const uint8_t *p, size_t n, int le)
{
    const kbtp_opcode *op = kbtp_opcodes[p[KBTP_OPCODE_AT]];
    if (op == NULL)
        return NULL;
    uint32_t flags = be16(p + KBTP_FLAGS_AT), features = 0;
    if (op->features_size && n >= (size_t)op->features_at + op->features_size)
        for (int i = 0; i < op->features_size; i++)
            features = features << 8 | p[op->features_at + i];
    int present = 0;
    for (int i = 0; i < op->nconds; i++)
        if ((op->conds[i].features ? features : flags) & op->conds[i].mask)
            present |= 1 << i;
    const kbtp_layout *lay = &op->layouts[present];
    if (n < lay->size)
        return NULL;
    if (lay->tail_key != NULL) {
        if (field_value(&lay->fields[(int)lay->tail_length], p, le && op->addr_le_applies) != n - lay->size)
            return NULL;
    } else if (n > lay->size)
        return NULL;
    return lay;
}

/* HELLO_ACK with status 0 sets the session's byte order (what kbtp_messages reads from
 * the fields codec.decode gives, Malformed or not: Features when the layout fits). */
static void hello_ack(Session *s, const uint8_t *p, size_t n)
{
    if (p[KBTP_OPCODE_AT] != KBTP_HELLO_ACK || be16(p + KBTP_STATUS_AT))
        return;
    const kbtp_opcode *op = kbtp_opcodes[KBTP_HELLO_ACK];
    uint32_t features = 0;
    if (n >= (size_t)op->features_at + op->features_size)
        for (int i = 0; i < op->features_size; i++)
            features = features << 8 | p[op->features_at + i];
    int present = 0;
    for (int i = 0; i < op->nconds; i++)
        if ((op->conds[i].features ? features : be16(p + KBTP_FLAGS_AT)) & op->conds[i].mask)
            present |= 1 << i;
    s->le = n >= op->layouts[present].size && (features & KBTP_ADDR_LE);
}

size_t endpoint_key(uint8_t *k, const Addr *a, int port, int with_port)
{
    size_t n = 0;
    k[n++] = a->len;
    memcpy(k + n, a->raw, a->len);
    n += a->len;
    if (with_port) {
        k[n++] = (uint8_t)(port >> 8);
        k[n++] = (uint8_t)port;
    }
    return n;
}

static Session *session_of(Core *c, const Conn *m)
{
    uint8_t key[KEY_MAX];
    size_t n = 0;
    key[n++] = (uint8_t)m->iwarp;
    if (m->iwarp) {                              /* frozenset of the endpoints: one when equal */
        uint8_t one[20], two[20];
        size_t n1 = endpoint_key(one, &m->src, m->sport, 1), n2 = endpoint_key(two, &m->dst, m->dport, 1);
        int swap = n1 > n2 || (n1 == n2 && memcmp(one, two, n1) > 0);
        memcpy(key + n, swap ? two : one, swap ? n2 : n1);
        n += swap ? n2 : n1;
        if (n1 != n2 || memcmp(one, two, n1)) {
            memcpy(key + n, swap ? one : two, swap ? n1 : n2);
            n += swap ? n1 : n2;
        }
    } else                                       /* the connection's first direction */
        n += dir_key(key + n, &m->first->src, &m->first->dst, m->first->qp);
    Node *x = map_put(&c->sessions, key, n);
    if (x == NULL)
        return NULL;
    if (x->val == NULL) {
        Session *s = calloc(1, sizeof *s);
        if (s == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        s->number = (long)c->sessions.n - 1;
        s->a_len = m->src.len;
        memcpy(s->a_raw, m->src.raw, m->src.len);
        addr_text(&m->src, s->a);
        s->b_len = m->dst.len;
        memcpy(s->b_raw, m->dst.raw, m->dst.len);
        addr_text(&m->dst, s->b);
        x->val = s;
    }
    return x->val;
}

static const char *text_of(const Session *s, const Addr *a)
{
    if (a->len == s->a_len && !memcmp(a->raw, s->a_raw, a->len))
        return s->a;
    return s->b;
}

/* The conn tuple of an RdmaMessage, for the malformed callback. */
static PyObject *conn_tuple(const Conn *m, const char *src, const char *dst)
{
    if (m->iwarp)
        return Py_BuildValue("((si)(si))", src, m->sport, dst, m->dport);
    return Py_BuildValue("(ssk)", src, dst, (unsigned long)m->qp);
}

/* The JSON line json.dumps(to_json(found)) writes for a well-formed message. Each put
 * returns 0, or -1 when memory runs out: || keeps them in order and stops at the first. */
static int json_line(Buf *o, const Conn *m, const Session *s, const char *src, const char *dst,
                     unsigned long long frame, double time, const uint8_t *p, size_t n, const kbtp_layout *lay,
                     int le, const unsigned long long *bad, size_t nbad)
{
    if (put_str(o, "{\"frame\": ") || put_uint(o, frame) || put_str(o, ", \"time\": ") || put_time(o, time)
        || put_str(o, m->iwarp ? ", \"transport\": \"iwarp\", \"conn\": " : ", \"transport\": \"roce\", \"conn\": ")
        || put_uint(o, (unsigned long long)s->number) || put_str(o, ", \"src\": \"") || put_str(o, src))
        return -1;
    if (m->iwarp) {
        if (put_str(o, "\", \"src_port\": ") || put_uint(o, m->sport) || put_str(o, ", \"dst\": \"") || put_str(o, dst)
            || put_str(o, "\", \"dst_port\": ") || put_uint(o, m->dport))
            return -1;
    } else if (put_str(o, "\", \"dst\": \"") || put_str(o, dst) || put_str(o, "\", \"dst_qp\": ") || put_uint(o, m->qp))
        return -1;
    for (int i = 0; i < lay->nfields; i++) {
        const kbtp_field *f = &lay->fields[i];
        if (put_str(o, ", ") || put_str(o, f->key))
            return -1;
        if (f->kind == KF_BYTES) {
            if (put_hex(o, p + f->at, f->size))
                return -1;
            continue;
        }
        uint64_t v = field_value(f, p, le);
        if (put_uint(o, v))
            return -1;
        for (int k = 0; k < f->nbits; k++)
            if (put_str(o, ", ") || put_str(o, f->bits[k].key) || put_str(o, v & f->bits[k].mask ? "1" : "0"))
                return -1;
    }
    if (lay->tail_key != NULL && (put_str(o, ", ") || put_str(o, lay->tail_key) || put_hex(o, p + lay->size, n - lay->size)))
        return -1;
    if (nbad) {
        if (put_str(o, ", \"icrc_bad\": ["))
            return -1;
        for (size_t i = 0; i < nbad; i++)
            if (put_str(o, i ? ", " : "") || put_uint(o, bad[i]))
                return -1;
        if (put_str(o, "]"))
            return -1;
    }
    return put_str(o, "}\n");
}

/* Enumeration.describe: the name of a value, else Private Use or Unknown. */
static int put_enum(Buf *o, const kbtp_enum *e, uint64_t v)
{
    for (int i = 0; i < e->n; i++)
        if (e->names[i].value == v)
            return put_str(o, e->names[i].name);
    char tmp[48];
    snprintf(tmp, sizeof tmp, v >= e->private_first && v <= e->private_last ? "Private Use (0x%llx)"
                                                                             : "Unknown (0x%llx)", (unsigned long long)v);
    return put_str(o, tmp);
}

/* FlagSet.names, each after sep: the set bits' names, then Private Use and undefined bits. */
static int put_flags(Buf *o, const kbtp_flagset *f, uint64_t v, const char *sep, int *any)
{
    char tmp[48];
    for (int i = 0; i < f->n; i++)
        if (v & f->bits[i].value && (put_str(o, (*any)++ ? sep : "") || put_str(o, f->bits[i].name)))
            return -1;
    uint64_t rest = v & ~(uint64_t)f->defined;
    if (rest & f->private_mask) {
        snprintf(tmp, sizeof tmp, "PRIVATE(0x%llx)", (unsigned long long)(rest & f->private_mask));
        if (put_str(o, (*any)++ ? sep : "") || put_str(o, tmp))
            return -1;
    }
    if (rest & ~(uint64_t)f->private_mask) {
        snprintf(tmp, sizeof tmp, "UNDEFINED(0x%llx)", (unsigned long long)(rest & ~(uint64_t)f->private_mask));
        if (put_str(o, (*any)++ ? sep : "") || put_str(o, tmp))
            return -1;
    }
    return 0;
}

/* kbtp decode's text line (cli/decode.py's _line, summary.describe) of a well-formed message. */
static int text_line(Core *c, Buf *o, const Conn *m, const Session *s, const char *src, const char *dst,
                     unsigned long long frame, double time, const uint8_t *p, const kbtp_opcode *op,
                     const kbtp_layout *lay, int le, const unsigned long long *bad, size_t nbad)
{
    char tmp[160];
    double origin = c->have_first ? c->first_time : 0.0;
    char *elapsed = PyOS_double_to_string((time != 0.0 ? time : origin) - origin, 'f', 6, 0, NULL);
    if (elapsed == NULL)
        return -1;
    snprintf(tmp, sizeof tmp, "%7llu %*s", frame, (int)(strlen(elapsed) < 11 ? 11 - strlen(elapsed) : 0), "");
    int rc = put_str(o, tmp) || put_str(o, elapsed);
    PyMem_Free(elapsed);
    snprintf(tmp, sizeof tmp, " %-5s #%-3ld ", m->iwarp ? "iwarp" : "roce", s->number);
    if (rc || put_str(o, tmp))
        return -1;
    if (m->iwarp)
        snprintf(tmp, sizeof tmp, strchr(src, ':') ? "[%s]:%u -> [%s]:%u" : "%s:%u -> %s:%u", src, m->sport, dst,
                 m->dport);
    else
        snprintf(tmp, sizeof tmp, "%s -> %s QP 0x%06x", src, dst, m->qp);
    if (put_str(o, tmp) || put_str(o, "  ") || put_str(o, op->name))
        return -1;
    for (int i = 0; i < lay->nsummary; i++) {
        const kbtp_item *item = &lay->summary[i];
        if (item->field < 0)
            continue;
        uint64_t v = field_value(&lay->fields[(int)item->field], p, le);
        int any = 0;
        if (put_str(o, " ") || put_str(o, item->label))
            return -1;
        if (item->show == KS_ENUM) {
            if (put_enum(o, item->en, v))
                return -1;
        } else if (item->show == KS_FLAGS) {
            if (put_flags(o, item->flags, v, "+", &any) || (!any && put_str(o, "0")))
                return -1;
        } else {
            snprintf(tmp, sizeof tmp, item->show == KS_HEX ? "0x%llx" : "%llu", (unsigned long long)v);
            if (put_str(o, tmp))
                return -1;
        }
    }
    int any = 1;                                 /* each flag name after a space */
    if (op->flags != NULL && put_flags(o, op->flags, be16(p + KBTP_FLAGS_AT), " ", &any))
        return -1;
    if (nbad) {
        if (put_str(o, " [bad ICRC in frame "))
            return -1;
        for (size_t i = 0; i < nbad; i++)
            if (put_str(o, i ? ", " : "") || put_uint(o, bad[i]))
                return -1;
        if (put_str(o, ": the receiving NIC dropped it]"))
            return -1;
    }
    return put_str(o, "\n");
}

/* The line of a malformed message, from the ``malformed`` callback (the codec's reason). */
static int malformed_line(Core *c, Buf *o, const Conn *m, const Session *s, const char *src, const char *dst,
                          unsigned long long frame, double time, const uint8_t *p, size_t n, int le,
                          const unsigned long long *bad, size_t nbad)
{
    PyObject *conn = conn_tuple(m, src, dst);
    PyObject *frames = PyTuple_New((Py_ssize_t)nbad);
    if (conn == NULL || frames == NULL) {
        Py_XDECREF(conn);
        Py_XDECREF(frames);
        return -1;
    }
    for (size_t i = 0; i < nbad; i++)
        PyTuple_SET_ITEM(frames, (Py_ssize_t)i, PyLong_FromUnsignedLongLong(bad[i]));
    double origin = c->have_first ? c->first_time : 0.0;
    PyObject *line = PyObject_CallFunction(c->malformed, "y#iKdsNlNd", (const char *)p, (Py_ssize_t)n, le, frame,
                                           time, m->iwarp ? "iwarp" : "roce", conn, s->number, frames, origin);
    if (line == NULL)
        return -1;
    Py_ssize_t size;
    const char *text = PyUnicode_AsUTF8AndSize(line, &size);
    int rc = text == NULL ? -1 : buf_put(o, text, (size_t)size);
    Py_DECREF(line);
    return rc < 0 ? -1 : put_str(o, "\n");
}

int message(Core *c, const Conn *m, unsigned long long frame, double time, const uint8_t *p, size_t n,
            const unsigned long long *bad, size_t nbad)
{
    if (!looks_like_kbtp(p, n))
        return 0;
    Session *s = session_of(c, m);
    if (s == NULL)
        return -1;
    const char *src = text_of(s, &m->src), *dst = text_of(s, &m->dst);
    c->messages++;
    const kbtp_opcode *op = kbtp_opcodes[p[KBTP_OPCODE_AT]];
    const kbtp_layout *lay = layout_of(p, n, s->le);
    int rc;
    if (lay == NULL) {
        c->n_malformed++;
        rc = malformed_line(c, &c->out, m, s, src, dst, frame, time, p, n, s->le, bad, nbad);
    } else if (c->text)
        rc = text_line(c, &c->out, m, s, src, dst, frame, time, p, op, lay, s->le && op->addr_le_applies, bad, nbad);
    else
        rc = json_line(&c->out, m, s, src, dst, frame, time, p, n, lay, s->le && op->addr_le_applies, bad, nbad);
    if (rc < 0)
        return -1;
    hello_ack(s, p, n);
    return c->out.len >= (1 << 18) ? flush_out(c) : 0;
}
