/*
 * The compiled core of `kbtp decode --json`: pcap and pcapng records, the frame walk of
 * frames.py, RoCE Sends by PSN with the ICRC check (roce.py), iWARP TCP/MPA/DDP Sends
 * (iwarp.py with sends_only), KBTP messages with each session's ADDR_LE (capture.py),
 * and the JSON line json.dumps(to_json(found)) writes. A port of those modules, which
 * stay the reference; the KBTP layouts come from _core_tables.h, generated from the
 * field tables. Hand-written here: record, frame and transport arithmetic, no layout.
 *
 * What the core does not reproduce itself goes back to Python (decode/core.py says so):
 * a malformed KBTP message is rendered by the `malformed` callback (codec and to_json),
 * and an iWARP Send whose DDP segments are out of order, interleaved with another's or
 * outgrow MAX_PENDING raises Unsupported, after which the caller decodes the capture
 * again in Python and skips the lines already written. TCP holes, reordering and
 * retransmissions, resynchronisation after a hole, MPA markers and CRC are ported.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "_core_tables.h"

static PyObject *Unsupported;
static uint64_t c_marker_interval = 512, c_marker_len = 4;     /* from decode/core.py's config */

/* ---- growable octet buffers ------------------------------------------------------- */

typedef struct { uint8_t *p; size_t len, cap; } Buf;

static int buf_reserve(Buf *b, size_t extra)
{
    if (b->len + extra <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra)
        cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const void *d, size_t n)
{
    if (buf_reserve(b, n) < 0)
        return -1;
    if (n)
        memcpy(b->p + b->len, d, n);
    b->len += n;
    return 0;
}

static void buf_drop(Buf *b, size_t n)      /* the first n octets */
{
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

static void buf_free(Buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

/* ---- a chained hash map of short octet keys ---------------------------------------- */

#define KEY_MAX 40
typedef struct Node { struct Node *next; uint64_t hash; uint8_t klen; uint8_t key[KEY_MAX]; void *val; } Node;
typedef struct { Node **b; size_t nb, n; } Map;

static uint64_t hash_of(const uint8_t *k, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ k[i]) * 1099511628211ULL;
    return h;
}

static Node *map_get(Map *m, const uint8_t *k, size_t n)
{
    if (!m->nb)
        return NULL;
    uint64_t h = hash_of(k, n);
    for (Node *x = m->b[h & (m->nb - 1)]; x; x = x->next)
        if (x->hash == h && x->klen == n && !memcmp(x->key, k, n))
            return x;
    return NULL;
}

static int map_grow(Map *m)
{
    size_t nb = m->nb ? m->nb * 2 : 64;
    Node **b = calloc(nb, sizeof *b);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < m->nb; i++)
        for (Node *x = m->b[i], *next; x; x = next) {
            next = x->next;
            x->next = b[x->hash & (nb - 1)];
            b[x->hash & (nb - 1)] = x;
        }
    free(m->b);
    m->b = b;
    m->nb = nb;
    return 0;
}

/* The node of key k, made (val NULL) when absent; NULL only when memory runs out. */
static Node *map_put(Map *m, const uint8_t *k, size_t n)
{
    Node *x = map_get(m, k, n);
    if (x)
        return x;
    if (m->n + 1 > m->nb && map_grow(m) < 0)
        return NULL;
    x = calloc(1, sizeof *x);
    if (x == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    x->hash = hash_of(k, n);
    x->klen = (uint8_t)n;
    memcpy(x->key, k, n);
    x->next = m->b[x->hash & (m->nb - 1)];
    m->b[x->hash & (m->nb - 1)] = x;
    m->n++;
    return x;
}

/* Remove key k; returns its value (NULL when absent). */
static void *map_del(Map *m, const uint8_t *k, size_t n)
{
    if (!m->nb)
        return NULL;
    uint64_t h = hash_of(k, n);
    for (Node **at = &m->b[h & (m->nb - 1)]; *at; at = &(*at)->next) {
        Node *x = *at;
        if (x->hash == h && x->klen == n && !memcmp(x->key, k, n)) {
            void *val = x->val;
            *at = x->next;
            free(x);
            m->n--;
            return val;
        }
    }
    return NULL;
}

static void map_free(Map *m, void (*drop)(void *))
{
    for (size_t i = 0; i < m->nb; i++)
        for (Node *x = m->b[i], *next; x; x = next) {
            next = x->next;
            if (drop)
                drop(x->val);
            free(x);
        }
    free(m->b);
    m->b = NULL;
    m->nb = m->n = 0;
}

/* ---- CRC-32 (zlib's) for the RoCE ICRC -------------------------------------------- */

static uint32_t crc_table[8][256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, size_t n)
{
    crc = ~crc;
    while (n >= 8) {
        uint32_t a = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        crc = crc_table[7][a & 0xFF] ^ crc_table[6][a >> 8 & 0xFF] ^ crc_table[5][a >> 16 & 0xFF]
              ^ crc_table[4][a >> 24] ^ crc_table[3][p[4]] ^ crc_table[2][p[5]] ^ crc_table[1][p[6]]
              ^ crc_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* icrc.py's icrc_ok: the network header with its variant fields set to ones. */
static int icrc_ok(const uint8_t *data, size_t n, size_t net, size_t bth, size_t end)
{
    if (end < bth + 16 || end > n)
        return 0;
    uint8_t small[128], *head = small;
    size_t hl = bth + 12 - net;
    if (hl > sizeof small && (head = malloc(hl)) == NULL)
        return 0;
    memcpy(head, data + net, hl);
    int version = head[0] >> 4;
    if (version == 4) {
        head[1] = 0xFF;
        head[8] = 0xFF;
        head[10] = head[11] = 0xFF;
    } else {
        head[0] |= 0x0F;
        head[1] = head[2] = head[3] = 0xFF;
        head[7] = 0xFF;
    }
    if (version == 4 || bth - net > 40)
        head[bth - net - 2] = head[bth - net - 1] = 0xFF;
    head[bth - net + 4] = 0xFF;
    static const uint8_t ones[8] = {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF};
    uint32_t crc = crc32_update(0, ones, 8);
    crc = crc32_update(crc, head, hl);
    if (head != small)
        free(head);
    crc = crc32_update(crc, data + bth + 12, end - 4 - (bth + 12));
    const uint8_t *s = data + end - 4;
    return crc == ((uint32_t)s[0] | (uint32_t)s[1] << 8 | (uint32_t)s[2] << 16 | (uint32_t)s[3] << 24);
}

/* ---- the decoder's state ------------------------------------------------------------ */

static inline uint32_t be16(const uint8_t *p) { return (uint32_t)p[0] << 8 | p[1]; }
static inline uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

typedef struct { uint8_t len; uint8_t raw[16]; } Addr;

/* One session (capture.session_key): its number, ADDR_LE and its addresses as text. */
typedef struct { long number; int le; uint8_t a_len, b_len; uint8_t a_raw[16], b_raw[16]; char a[48], b[48]; } Session;

/* A RoCE Send being put together (roce.py's _Part). */
typedef struct {
    Addr src, dst;
    uint32_t dqpn, first_psn, psn;
    int complete, keep, inv;
    double time;
    Buf data;
    unsigned long long last_frame;
    Buf bad;                    /* frame numbers (unsigned long long) with a wrong ICRC */
    unsigned long long order;   /* of its last update, for the end's flush */
} Part;

enum { ST_STARTUP, ST_FPDU, ST_RESYNC, ST_DEAD };

/* A TCP segment held after a hole, by stream offset. */
typedef struct { uint64_t at; Buf data; unsigned long long frame; double time; } Held;

/* A closed connection, in the order it was closed. */
typedef struct { unsigned long long seq; uint8_t klen; uint8_t key[KEY_MAX]; } Closed;

/* One direction of a TCP connection (iwarp.py's _Flow), sends_only. */
typedef struct Flow {
    uint8_t key[KEY_MAX];
    uint8_t klen;
    Addr src, dst;
    uint16_t sport, dport;
    uint32_t seq;
    uint64_t off, base, fpdu_at;  /* fpdu_at: offset of the first FPDU, where markers count from */
    Buf buf, spans;             /* unframed octets from base; the segments that carried them */
    Held *held;                 /* segments after a hole, by offset */
    size_t nheld, cap_held;
    uint64_t held_size;
    int state, has_startup, st_request, st_flags, markers, crc, fin, forgotten;
    struct Flow *peer, *next_dead;
    Buf skip;                   /* (QN, MSN) pairs of Sends that are not KBTP, 8 octets each */
    /* the one Send of several DDP segments being put together, in order (the Assembler) */
    int pending;
    uint8_t pend_key[8];        /* its QN and MSN */
    Buf pend;
    unsigned long long pend_frame, order;
    double pend_time;
} Flow;

typedef struct {
    /* configuration from decode/core.py */
    unsigned long chunk, max_record, max_message, max_closed, max_pending, marker_interval, marker_len;
    unsigned long max_out_of_order, max_unframed;
    int roce_port, ddp_untagged_len, ddp_tagged_len, flag_m, flag_c, flag_r, mpa_startup_len;
    int send_pos[256], send_ext[256], send_inv[256];   /* RoCE Send opcodes; pos -1: not one */
    int iw_sends[16];
    uint8_t req_key[16], rep_key[16];
    PyObject *readinto, *sink, *progress, *malformed;
    /* the record reader */
    Buf in;
    size_t at;
    unsigned long long base, count;
    int eof, pcapng, big, pcap_linktype;
    double unit;
    /* stats */
    unsigned long long frames, cut, messages, n_malformed, cut_short;
    int have_first;
    double first_time;
    PyObject *unsupported, *problem;
    /* state */
    Map sessions, parts, flows, closed;
    Buf closed_order;           /* Closed entries from closed_head on, some stale */
    size_t closed_head;
    unsigned long long order, closed_seq;
    Flow *dead;
    Buf out, scratch;           /* JSON lines to write; an FPDU without its markers */
} Core;

/* ---- output --------------------------------------------------------------------------- */

static int flush_out(Core *c)
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

/* ---- KBTP messages (codec.decode, capture.kbtp_messages, capture.to_json) ---------- */

static int looks_like_kbtp(const uint8_t *p, size_t n)
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

typedef struct { int iwarp; Addr src, dst; uint32_t qp; uint16_t sport, dport; } Conn;

static size_t endpoint_key(uint8_t *k, const Addr *a, int port, int with_port)
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
    uint8_t one[20], two[20], key[KEY_MAX];
    size_t n1 = endpoint_key(one, &m->src, m->sport, m->iwarp), n2 = endpoint_key(two, &m->dst, m->dport, m->iwarp);
    int swap = n1 > n2 || (n1 == n2 && memcmp(one, two, n1) > 0);
    size_t n = 0;
    key[n++] = (uint8_t)m->iwarp;
    memcpy(key + n, swap ? two : one, swap ? n2 : n1);
    n += swap ? n2 : n1;
    if (n1 != n2 || memcmp(one, two, n1)) {          /* frozenset: one element when equal */
        memcpy(key + n, swap ? one : two, swap ? n1 : n2);
        n += swap ? n1 : n2;
    }
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

static int message(Core *c, const Conn *m, unsigned long long frame, double time, const uint8_t *p,
                   size_t n, const unsigned long long *bad, size_t nbad)
{
    if (!looks_like_kbtp(p, n))
        return 0;
    Session *s = session_of(c, m);
    if (s == NULL)
        return -1;
    const char *src = text_of(s, &m->src), *dst = text_of(s, &m->dst);
    int le = s->le;
    c->messages++;
    const kbtp_opcode *op = kbtp_opcodes[p[KBTP_OPCODE_AT]];
    const kbtp_layout *lay = layout_of(p, n, le);
    Buf *o = &c->out;
    if (lay == NULL) {
        c->n_malformed++;
        PyObject *conn = conn_tuple(m, src, dst);
        PyObject *frames = PyTuple_New((Py_ssize_t)nbad);
        if (conn == NULL || frames == NULL) {
            Py_XDECREF(conn);
            Py_XDECREF(frames);
            return -1;
        }
        for (size_t i = 0; i < nbad; i++)
            PyTuple_SET_ITEM(frames, (Py_ssize_t)i, PyLong_FromUnsignedLongLong(bad[i]));
        PyObject *line = PyObject_CallFunction(c->malformed, "y#iKdsNlN", (const char *)p, (Py_ssize_t)n, le, frame,
                                               time, m->iwarp ? "iwarp" : "roce", conn, s->number, frames);
        if (line == NULL)
            return -1;
        Py_ssize_t size;
        const char *text = PyUnicode_AsUTF8AndSize(line, &size);
        int rc = text == NULL ? -1 : buf_put(o, text, (size_t)size);
        Py_DECREF(line);
        if (rc < 0 || buf_put(o, "\n", 1) < 0)
            return -1;
    } else {
        int fle = le && op->addr_le_applies;
        if (put_str(o, "{\"frame\": ") < 0 || put_uint(o, frame) < 0 || put_str(o, ", \"time\": ") < 0
            || put_time(o, time) < 0)
            return -1;
        if (m->iwarp) {
            if (put_str(o, ", \"transport\": \"iwarp\", \"conn\": ") < 0 || put_uint(o, (unsigned long long)s->number) < 0
                || put_str(o, ", \"src\": \"") < 0 || put_str(o, src) < 0 || put_str(o, "\", \"src_port\": ") < 0
                || put_uint(o, m->sport) < 0 || put_str(o, ", \"dst\": \"") < 0 || put_str(o, dst) < 0
                || put_str(o, "\", \"dst_port\": ") < 0 || put_uint(o, m->dport) < 0)
                return -1;
        } else if (put_str(o, ", \"transport\": \"roce\", \"conn\": ") < 0 || put_uint(o, (unsigned long long)s->number) < 0
                   || put_str(o, ", \"src\": \"") < 0 || put_str(o, src) < 0 || put_str(o, "\", \"dst\": \"") < 0
                   || put_str(o, dst) < 0 || put_str(o, "\", \"dst_qp\": ") < 0 || put_uint(o, m->qp) < 0)
            return -1;
        for (int i = 0; i < lay->nfields; i++) {
            const kbtp_field *f = &lay->fields[i];
            if (put_str(o, ", ") < 0 || put_str(o, f->key) < 0)
                return -1;
            if (f->kind == KF_BYTES) {
                if (put_hex(o, p + f->at, f->size) < 0)
                    return -1;
                continue;
            }
            uint64_t v = field_value(f, p, fle);
            if (put_uint(o, v) < 0)
                return -1;
            for (int k = 0; k < f->nbits; k++)
                if (put_str(o, ", ") < 0 || put_str(o, f->bits[k].key) < 0
                    || put_str(o, v & f->bits[k].mask ? "1" : "0") < 0)
                    return -1;
        }
        if (lay->tail_key != NULL
            && (put_str(o, ", ") < 0 || put_str(o, lay->tail_key) < 0 || put_hex(o, p + lay->size, n - lay->size) < 0))
            return -1;
        if (nbad) {
            if (put_str(o, ", \"icrc_bad\": [") < 0)
                return -1;
            for (size_t i = 0; i < nbad; i++)
                if ((i && put_str(o, ", ") < 0) || put_uint(o, bad[i]) < 0)
                    return -1;
            if (put_str(o, "]") < 0)
                return -1;
        }
        if (put_str(o, "}\n") < 0)
            return -1;
    }
    hello_ack(s, p, n);
    if (o->len >= (1 << 18))
        return flush_out(c);
    return 0;
}

/* ---- RoCE Sends (roce.py) --------------------------------------------------------------- */

enum { P_FIRST, P_MIDDLE, P_LAST, P_ONLY };

static size_t part_key(uint8_t *k, const Addr *src, const Addr *dst, uint32_t dqpn)
{
    size_t n = endpoint_key(k, src, 0, 0);
    n += endpoint_key(k + n, dst, 0, 0);
    k[n++] = (uint8_t)(dqpn >> 16);
    k[n++] = (uint8_t)(dqpn >> 8);
    k[n++] = (uint8_t)dqpn;
    return n;
}

static void part_free(void *v)
{
    Part *p = v;
    if (p) {
        buf_free(&p->data);
        buf_free(&p->bad);
        free(p);
    }
}

static int finish(Core *c, Part *p)
{
    int rc = 0;
    if (p->keep) {
        Conn m = {0, p->src, p->dst, p->dqpn, 0, 0};
        rc = message(c, &m, p->last_frame, p->time, p->data.p ? p->data.p : (const uint8_t *)"", p->data.len,
                     (const unsigned long long *)p->bad.p, p->bad.len / sizeof(unsigned long long));
    }
    part_free(p);
    return rc;
}

static int roce_packet(Core *c, unsigned long long frame, double time, const Addr *src, const Addr *dst,
                       const uint8_t *data, size_t n, size_t start, size_t end, size_t net)
{
    if (start + 12 > n)             /* the callers' checks keep the BTH in the frame */
        return 0;
    int opcode = data[start], position = c->send_pos[opcode];
    if (position < 0)
        return 0;
    size_t low = start + 12 + (size_t)c->send_ext[opcode];
    size_t pad = data[start + 1] >> 4 & 3;
    if (end < 4 + pad || end - 4 - pad < low)
        return 0;
    size_t high = end - 4 - pad;
    const uint8_t *head = data + start + 4;
    uint32_t dqpn = (uint32_t)head[1] << 16 | (uint32_t)head[2] << 8 | head[3];
    uint32_t psn = (uint32_t)head[5] << 16 | (uint32_t)head[6] << 8 | head[7];
    uint8_t key[KEY_MAX];
    size_t kl = part_key(key, src, dst, dqpn);
    Part *part = c->parts.n ? map_del(&c->parts, key, kl) : NULL;
    if (part != NULL && (position == P_FIRST || position == P_ONLY || psn != ((part->psn + 1) & 0xFFFFFF))) {
        part->complete = 0;
        if (finish(c, part) < 0)
            return -1;
        part = NULL;
    }
    const uint8_t *chunk = data + low;
    size_t clen = high - low;
    if (part == NULL) {
        if (position == P_ONLY) {
            if (!looks_like_kbtp(chunk, clen))
                return 0;
            Conn m = {0, *src, *dst, dqpn, 0, 0};
            unsigned long long bad = frame;
            int ok = icrc_ok(data, n, net, start, end);
            return message(c, &m, frame, time, chunk, clen, &bad, ok ? 0 : 1);
        }
        part = calloc(1, sizeof *part);
        if (part == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        part->src = *src;
        part->dst = *dst;
        part->dqpn = dqpn;
        part->first_psn = psn;
        part->complete = position == P_FIRST;
        part->keep = looks_like_kbtp(chunk, clen);
    }
    part->psn = psn;
    part->inv = c->send_inv[opcode];
    part->time = time;
    if (part->keep) {
        part->last_frame = frame;
        if (!icrc_ok(data, n, net, start, end) && buf_put(&part->bad, &frame, sizeof frame) < 0) {
            part_free(part);
            return -1;
        }
        if (part->data.len + clen <= c->max_message) {
            if (buf_put(&part->data, chunk, clen) < 0) {
                part_free(part);
                return -1;
            }
        } else
            part->complete = 0;
    }
    if (position == P_LAST)
        return finish(c, part);
    part->order = ++c->order;
    Node *x = map_put(&c->parts, key, kl);
    if (x == NULL) {
        part_free(part);
        return -1;
    }
    x->val = part;
    return 0;
}

static int order_cmp(const void *a, const void *b)
{
    const Part *x = *(Part *const *)a, *y = *(Part *const *)b;
    return x->order < y->order ? -1 : x->order > y->order;
}

static int roce_flush(Core *c)
{
    size_t n = c->parts.n, k = 0;
    if (!n)
        return 0;
    Part **all = malloc(n * sizeof *all);
    if (all == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < c->parts.nb; i++)
        for (Node *x = c->parts.b[i]; x; x = x->next) {
            all[k++] = x->val;
            x->val = NULL;
        }
    map_free(&c->parts, NULL);
    qsort(all, n, sizeof *all, order_cmp);
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        all[i]->complete = 0;
        if (rc == 0)
            rc = finish(c, all[i]);
        else
            part_free(all[i]);
    }
    free(all);
    return rc;
}

/* ---- iWARP Sends (iwarp.py, sends_only) ------------------------------------------------ */

#define TCP_FIN 0x01
#define TCP_SYN 0x02
#define TCP_RST 0x04
#define TCP_ACK 0x10

static int unsupported(const char *why)
{
    PyErr_SetString(Unsupported, why);
    return -1;
}

static size_t flow_key(uint8_t *k, const Addr *src, int sport, const Addr *dst, int dport)
{
    size_t n = endpoint_key(k, src, sport, 1);
    return n + endpoint_key(k + n, dst, dport, 1);
}

static void drop_held(Flow *f)
{
    for (size_t i = 0; i < f->nheld; i++)
        buf_free(&f->held[i].data);
    free(f->held);
    f->held = NULL;
    f->nheld = f->cap_held = 0;
    f->held_size = 0;
}

static void flow_free(void *v)
{
    Flow *f = v;
    if (f) {
        buf_free(&f->buf);
        buf_free(&f->spans);
        buf_free(&f->skip);
        buf_free(&f->pend);
        drop_held(f);
        free(f);
    }
}

/* ``_closed``: connections that are not iWARP or are over, the oldest forgotten first
 * past MAX_CLOSED (a dict's insertion order: a key set again keeps its place). */
static int closed_add(Core *c, const uint8_t *key, size_t kl)
{
    Node *x = map_put(&c->closed, key, kl);
    if (x == NULL)
        return -1;
    if (x->val != NULL)
        return 0;
    x->val = (void *)(uintptr_t)++c->closed_seq;
    Closed entry = {c->closed_seq, (uint8_t)kl, {0}};
    memcpy(entry.key, key, kl);
    if (buf_put(&c->closed_order, &entry, sizeof entry) < 0)
        return -1;
    Closed *q = (Closed *)c->closed_order.p;
    size_t n = c->closed_order.len / sizeof entry;
    while (c->closed.n > c->max_closed) {
        Closed *old = &q[c->closed_head++];
        Node *y = map_get(&c->closed, old->key, old->klen);
        if (y != NULL && (uintptr_t)y->val == old->seq)
            map_del(&c->closed, old->key, old->klen);
    }
    if (n - c->closed_head > 2 * c->closed.n + 4096) {  /* keep the entries still closed */
        size_t kept = 0;
        for (size_t i = c->closed_head; i < n; i++) {
            Node *y = map_get(&c->closed, q[i].key, q[i].klen);
            if (y != NULL && (uintptr_t)y->val == q[i].seq)
                q[kept++] = q[i];
        }
        c->closed_order.len = kept * sizeof entry;
        c->closed_head = 0;
    } else if (c->closed_head > n / 2 + 1024) {      /* forget what was evicted */
        memmove(q, q + c->closed_head, (n - c->closed_head) * sizeof entry);
        c->closed_order.len = (n - c->closed_head) * sizeof entry;
        c->closed_head = 0;
    }
    return 0;
}

static int forget(Core *c, Flow *f)
{
    Node *x = map_get(&c->flows, f->key, f->klen);
    if (x != NULL && x->val == f) {
        map_del(&c->flows, f->key, f->klen);
        if (closed_add(c, f->key, f->klen) < 0)
            return -1;
    }
    if (f->peer != NULL && f->peer->peer == f)
        f->peer->peer = NULL;
    if (!f->forgotten) {
        f->forgotten = 1;
        f->next_dead = c->dead;
        c->dead = f;
    }
    return 0;
}

static int emit_pending(Core *c, Flow *f)
{
    Conn m = {1, f->src, f->dst, 0, f->sport, f->dport};
    f->pending = 0;
    int rc = message(c, &m, f->pend_frame, f->pend_time, f->pend.p, f->pend.len, NULL, 0);
    f->pend.len = 0;
    return rc;
}

static Flow *open_flow(Core *c, const uint8_t *key, size_t kl, const Addr *src, int sport, const Addr *dst,
                       int dport, uint32_t seq)
{
    Flow *f = calloc(1, sizeof *f);
    if (f == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(f->key, key, kl);
    f->klen = (uint8_t)kl;
    f->src = *src;
    f->dst = *dst;
    f->sport = (uint16_t)sport;
    f->dport = (uint16_t)dport;
    f->seq = seq;
    f->markers = -1;
    f->order = ++c->order;
    Node *x = map_put(&c->flows, key, kl);
    if (x == NULL) {
        free(f);
        return NULL;
    }
    x->val = f;
    uint8_t rev[KEY_MAX];
    size_t rl = flow_key(rev, dst, dport, src, sport);
    Node *p = map_get(&c->flows, rev, rl);
    if (p != NULL) {
        f->peer = p->val;
        f->peer->peer = f;
    }
    return f;
}

/* Markers and CRC of this direction from both startup frames (iwarp.py's _negotiated). */
static int negotiated(Core *c, Flow *f)
{
    int peer = f->peer != NULL && f->peer->has_startup && f->peer->st_request != f->st_request;
    int req = -1, rep = -1;                   /* flags of the Request and the Reply, -1 absent */
    if (f->st_request) {
        req = f->st_flags;
        rep = peer ? f->peer->st_flags : -1;
    } else {
        rep = f->st_flags;
        req = peer ? f->peer->st_flags : -1;
    }
    int req_flags = req < 0 ? 0 : req, rep_flags = rep < 0 ? 0 : rep;
    if (rep_flags & c->flag_r)
        return 0;
    f->crc = ((req_flags | rep_flags) & c->flag_c) != 0;
    f->markers = ((f->st_request ? rep_flags : req_flags) & c->flag_m) != 0;
    return 1;
}

static int send_fpdu(Core *c, Flow *f, const uint8_t *w, size_t ulen, unsigned long long frame, double time)
{
    if (ulen < 2)
        return 0;
    int ctrl = w[2];
    if (ctrl & 0x80 || !c->iw_sends[w[3] & 0x0F] || ulen < (size_t)c->ddp_untagged_len)
        return 0;
    uint32_t mo = be32(w + 16);
    const uint8_t *data = w + 2 + c->ddp_untagged_len;
    size_t dlen = ulen - (size_t)c->ddp_untagged_len;
    uint8_t pair[8];
    memcpy(pair, w + 8, 8);
    if (mo == 0) {
        if (!looks_like_kbtp(data, dlen)) {
            if (!(ctrl & 0x40)) {
                size_t have = f->skip.len / 8, i;
                for (i = 0; i < have && memcmp(f->skip.p + 8 * i, pair, 8); i++)
                    ;
                if (i == have && buf_put(&f->skip, pair, 8) < 0)
                    return -1;
                if (f->skip.len / 8 > 1024)
                    f->skip.len = 0;
            }
            return 0;
        }
        if (f->pending && !memcmp(f->pend_key, pair, 8))
            return unsupported("an iWARP Send begun again while being put together");
        if (ctrl & 0x40) {
            Conn m = {1, f->src, f->dst, 0, f->sport, f->dport};
            return message(c, &m, frame, time, data, dlen, NULL, 0);
        }
        if (f->pending)
            return unsupported("two iWARP Sends put together at once");
        f->pending = 1;
        memcpy(f->pend_key, pair, 8);
        f->pend.len = 0;
        f->pend_frame = 0;
    } else {
        size_t have = f->skip.len / 8;
        for (size_t i = 0; i < have; i++)
            if (!memcmp(f->skip.p + 8 * i, pair, 8)) {
                if (ctrl & 0x40) {
                    memmove(f->skip.p + 8 * i, f->skip.p + 8 * i + 8, f->skip.len - 8 * i - 8);
                    f->skip.len -= 8;
                }
                return 0;
            }
        if (!f->pending || memcmp(f->pend_key, pair, 8) || mo != f->pend.len)
            return unsupported("an iWARP Send whose DDP segments are not in order");
    }
    if (buf_put(&f->pend, data, dlen) < 0)
        return -1;
    if (frame > f->pend_frame) {                  /* the message's latest frame, and its time */
        f->pend_frame = frame;
        f->pend_time = time;
    }
    if (ctrl & 0x40 && mo != 0)
        return emit_pending(c, f);
    if (f->pend.len > c->max_pending)
        return unsupported("an iWARP Send larger than MAX_PENDING");
    return 0;
}

/* Octets an FPDU of clean_len takes at stream position pos, markers included
 * (wire/iwarp.py's fpdu_wire_length). */
static uint64_t wire_length(uint64_t clean_len, uint64_t pos)
{
    uint64_t wire = clean_len;
    for (;;) {
        uint64_t first = (c_marker_interval - pos % c_marker_interval) % c_marker_interval;
        uint64_t count = first >= wire ? 0 : 1 + (wire - 1 - first) / c_marker_interval;
        if (clean_len + c_marker_len * count == wire)
            return wire;
        wire = clean_len + c_marker_len * count;
    }
}

/* The FPDU w[0:n] at stream position pos without its markers (wire/mpa_markers.py). */
static int strip_markers(Buf *out, const uint8_t *w, size_t n, uint64_t pos)
{
    out->len = 0;
    size_t i = 0;
    while (i < n) {
        size_t next = i + (size_t)((c_marker_interval - (pos + i) % c_marker_interval) % c_marker_interval);
        if (buf_put(out, w + i, (next < n ? next : n) - i) < 0)
            return -1;
        if (next >= n)
            break;
        i = next + c_marker_len;
    }
    return 0;
}

/* ULPDU Length and wire size of the FPDU at w[0:avail], stream octet at, or 0 until
 * enough octets are there (iwarp.py's _length). */
static int fpdu_length(Flow *f, const uint8_t *w, size_t avail, uint64_t at, size_t *ulen, size_t *size)
{
    if (!f->markers) {
        if (avail < 2)
            return 0;
        *ulen = be16(w);
        *size = 2 + *ulen + ((4 - (2 + *ulen) % 4) % 4) + 4;
        return 1;
    }
    uint64_t pos = at - f->fpdu_at;
    uint64_t ahead = (c_marker_interval - pos % c_marker_interval) % c_marker_interval;
    size_t a = ahead == 0 ? 4 : 0, b = ahead <= 1 ? 5 : 1;
    if (avail <= b)
        return 0;
    *ulen = (size_t)w[a] << 8 | w[b];
    *size = (size_t)wire_length(2 + *ulen + ((4 - (2 + *ulen) % 4) % 4) + 4, pos);
    return 1;
}

typedef struct { uint64_t start, end; unsigned long long frame; double time; } Span;

/* The latest frame that carried stream octets [a, b) of the flow's buffer, and its time. */
static void frames_of(Flow *f, uint64_t a, uint64_t b, unsigned long long *frame, double *time)
{
    const Span *s = (const Span *)f->spans.p;
    size_t n = f->spans.len / sizeof *s;
    unsigned long long latest = 0;
    for (size_t k = 0; k < n && s[k].start < b; k++)
        if (s[k].end > a && s[k].frame > latest) {
            latest = s[k].frame;
            *time = s[k].time;
        }
    *frame = latest;
}

/* FPDUs of w[0:n], whose first octet is the flow's base; frame and time are those of
 * w when the flow holds no octets before it, else they come from its spans. Returns the
 * octets framed, or -1 (iwarp.py's _frame). */
static long frame_fpdus(Core *c, Flow *f, const uint8_t *w, size_t n, int spans, unsigned long long frame,
                        double time)
{
    size_t i = 0, ulen, size;
    while (fpdu_length(f, w + i, n - i, f->base + i, &ulen, &size) && n - i >= size) {
        const uint8_t *clean = w + i;
        if (f->markers) {
            if (strip_markers(&c->scratch, w + i, size, f->base + i - f->fpdu_at) < 0)
                return -1;
            clean = c->scratch.p;
        }
        if (spans)
            frames_of(f, f->base + i, f->base + i + size, &frame, &time);
        if (send_fpdu(c, f, clean, ulen, frame, time) < 0)
            return -1;
        i += size;
    }
    return (long)i;
}

static void consume(Flow *f, size_t n)
{
    buf_drop(&f->buf, n);
    f->base += n;
    Span *s = (Span *)f->spans.p;
    size_t ns = f->spans.len / sizeof *s, k = 0;
    while (k < ns && s[k].end <= f->base)
        k++;
    if (k) {
        memmove(s, s + k, (ns - k) * sizeof *s);
        f->spans.len -= k * sizeof *s;
    }
}

enum { V_NO, V_YES, V_NOT_YET };

static uint32_t crc32c_table[256];

static void crc32c_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0x82F63B78u ^ (c >> 1) : c >> 1;
        crc32c_table[i] = c;
    }
}

static uint32_t crc32c(const uint8_t *p, size_t n)
{
    uint32_t crc = 0xFFFFFFFFu;
    while (n--)
        crc = crc32c_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* Whether an FPDU starts at the flow's first buffered octet (iwarp.py's _valid_fpdu). */
static int valid_fpdu(Core *c, Flow *f)
{
    if (f->markers < 0 && !negotiated(c, f)) {
        f->state = ST_DEAD;
        return V_NO;
    }
    size_t ulen, size;
    if (!fpdu_length(f, f->buf.p, f->buf.len, f->base, &ulen, &size))
        return V_NOT_YET;
    if (f->buf.len < size)
        return size <= c->max_unframed ? V_NOT_YET : V_NO;
    const uint8_t *wire = f->buf.p, *clean = wire;
    if (f->crc) {
        const uint8_t *s = wire + size - 4;
        return crc32c(wire, size - 4) == ((uint32_t)s[0] | (uint32_t)s[1] << 8 | (uint32_t)s[2] << 16
                                          | (uint32_t)s[3] << 24);
    }
    if (f->markers) {
        if (strip_markers(&c->scratch, wire, size, f->base - f->fpdu_at) < 0)
            return -1;
        clean = c->scratch.p;
    }
    int ctrl = clean[2], rctrl = clean[3];
    if ((ctrl & 0x3F) != 0x01 || (rctrl & 0xF0) != 0x40)
        return V_NO;
    if (ulen < (size_t)(ctrl & 0x80 ? c->ddp_tagged_len : c->ddp_untagged_len))
        return V_NO;
    const Span *s = (const Span *)f->spans.p;
    for (size_t k = 0; k < f->spans.len / sizeof *s; k++)
        if (s[k].end == f->base + size)
            return V_YES;
    return V_NO;
}

/* After a hole: drop octets until a segment starts with a valid FPDU (iwarp.py's _resync). */
static int resync(Core *c, Flow *f)
{
    while (f->spans.len) {
        const Span *s = (const Span *)f->spans.p;
        if (s->start > f->base)
            consume(f, (size_t)(s->start - f->base));
        int v = valid_fpdu(c, f);
        if (v < 0)
            return -1;
        s = (const Span *)f->spans.p;
        if (v == V_NOT_YET) {
            if (f->buf.len > c->max_unframed) {
                consume(f, (size_t)(s->end - f->base));
                continue;
            }
            return 0;
        }
        if (v == V_YES) {
            f->state = ST_FPDU;
            return 0;
        }
        consume(f, (size_t)(s->end - f->base));
    }
    return 0;
}

static int append(Core *c, Flow *f, const uint8_t *data, size_t n, unsigned long long frame, double time)
{
    uint64_t start = f->off;
    f->off += n;
    f->seq += (uint32_t)n;
    if (f->state == ST_DEAD)
        return 0;
    if (f->state == ST_FPDU && f->markers >= 0 && f->buf.len == 0) {     /* the usual case: no copy */
        long used = frame_fpdus(c, f, data, n, 0, frame, time);
        if (used < 0)
            return -1;
        f->base += (uint64_t)used;
        if ((size_t)used == n)
            return 0;
        Span span = {start, f->off, frame, time};
        return buf_put(&f->buf, data + used, n - (size_t)used) < 0 ? -1 : buf_put(&f->spans, &span, sizeof span);
    }
    Span span = {start, f->off, frame, time};
    if (buf_put(&f->buf, data, n) < 0 || buf_put(&f->spans, &span, sizeof span) < 0)
        return -1;
    if (f->state == ST_STARTUP) {
        size_t have = f->buf.len < 16 ? f->buf.len : 16;
        if (memcmp(f->buf.p, c->req_key, have) && memcmp(f->buf.p, c->rep_key, have)) {
            f->state = ST_DEAD;
            return 0;
        }
        if (f->buf.len < (size_t)c->mpa_startup_len)
            return 0;
        size_t need = (size_t)c->mpa_startup_len + be16(f->buf.p + 18);
        if (f->buf.len < need)
            return 0;
        f->has_startup = 1;
        f->st_request = !memcmp(f->buf.p, c->req_key, 16);
        f->st_flags = f->buf.p[16];
        consume(f, need);
        f->fpdu_at = f->base;
        f->state = ST_FPDU;
    }
    if (f->state == ST_RESYNC && resync(c, f) < 0)
        return -1;
    if (f->state == ST_FPDU) {
        if (!f->buf.len)
            return 0;
        if (f->markers < 0 && !negotiated(c, f)) {
            f->state = ST_DEAD;
            return 0;
        }
        long used = frame_fpdus(c, f, f->buf.p, f->buf.len, 1, frame, time);
        if (used < 0)
            return -1;
        consume(f, (size_t)used);
    }
    return 0;
}

/* Segments held after a hole that the stream has now reached (iwarp.py's _drain). */
static int drain(Core *c, Flow *f)
{
    while (f->nheld && f->held[0].at <= f->off) {
        Held h = f->held[0];
        memmove(f->held, f->held + 1, (f->nheld - 1) * sizeof h);
        f->nheld--;
        f->held_size -= h.data.len;
        int rc = 0;
        if (h.at + h.data.len > f->off) {
            size_t skip = (size_t)(f->off - h.at);
            rc = append(c, f, h.data.p + skip, h.data.len - skip, h.frame, h.time);
        }
        buf_free(&h.data);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* Octets up to stream offset ``to`` are lost: resume there (iwarp.py's _gap). */
static int gap(Core *c, Flow *f, uint64_t to)
{
    f->seq += (uint32_t)(to - f->off);
    f->off = f->base = to;
    f->buf.len = 0;
    f->spans.len = 0;
    if (f->state == ST_STARTUP)
        f->state = ST_DEAD;
    else if (f->state == ST_FPDU)
        f->state = ST_RESYNC;
    return drain(c, f);
}

/* A segment after a hole waits, the longest copy of each offset kept (iwarp.py's _data). */
static int hold(Core *c, Flow *f, uint64_t at, const uint8_t *data, size_t n, unsigned long long frame, double time)
{
    size_t k = 0;
    while (k < f->nheld && f->held[k].at < at)
        k++;
    size_t old = k < f->nheld && f->held[k].at == at ? f->held[k].data.len : 0;
    if (n > old) {
        f->held_size += n - old;
        if (k < f->nheld && f->held[k].at == at)
            f->held[k].data.len = 0;
        else {
            if (f->nheld == f->cap_held) {
                size_t cap = f->cap_held ? 2 * f->cap_held : 8;
                Held *h = realloc(f->held, cap * sizeof *h);
                if (h == NULL) {
                    PyErr_NoMemory();
                    return -1;
                }
                f->held = h;
                f->cap_held = cap;
            }
            memmove(f->held + k + 1, f->held + k, (f->nheld - k) * sizeof *f->held);
            memset(&f->held[k], 0, sizeof *f->held);
            f->held[k].at = at;
            f->nheld++;
        }
        if (buf_put(&f->held[k].data, data, n) < 0)
            return -1;
        f->held[k].frame = frame;
        f->held[k].time = time;
    }
    if (f->held_size > c->max_out_of_order)
        return gap(c, f, f->held[0].at);
    return 0;
}

static int tcp_data(Core *c, Flow *f, uint32_t seq, const uint8_t *data, size_t n, unsigned long long frame,
                    double time)
{
    int64_t d = (int32_t)(seq - f->seq);
    if (d > 0)
        return hold(c, f, f->off + (uint64_t)d, data, n, frame, time);
    if ((uint64_t)-d >= n)
        return 0;                                  /* a retransmission: nothing new */
    if (append(c, f, data + (size_t)-d, n - (size_t)-d, frame, time) < 0)
        return -1;
    return f->nheld ? drain(c, f) : 0;
}

/* The receiver acknowledged octets of the reverse direction the capture never showed
 * while later ones wait: the capture lost them (iwarp.py's _acked). */
static int acked(Core *c, const Addr *src, int sport, const Addr *dst, int dport, uint32_t ack)
{
    uint8_t rev[KEY_MAX];
    size_t rl = flow_key(rev, dst, dport, src, sport);
    Node *x = map_get(&c->flows, rev, rl);
    Flow *r = x ? x->val : NULL;
    if (r == NULL || !r->nheld)
        return 0;
    int64_t d = (int32_t)(ack - r->seq);
    if (d > 0 && r->held[0].at <= r->off + (uint64_t)d)
        return gap(c, r, r->held[0].at);
    return 0;
}

/* The direction ends: octets after a hole are framed as far as they go, and a Send still
 * being put together comes out incomplete (iwarp.py's _close). */
static int close_flow(Core *c, Flow *f)
{
    if (f->nheld && (f->state == ST_FPDU || f->state == ST_RESYNC) && gap(c, f, f->held[0].at) < 0)
        return -1;
    if ((f->state == ST_FPDU || f->state == ST_RESYNC) && f->pending && emit_pending(c, f) < 0)
        return -1;
    f->state = ST_DEAD;
    f->buf.len = 0;
    f->spans.len = 0;
    drop_held(f);
    return forget(c, f);
}

static int tcp_segment(Core *c, unsigned long long frame, double time, const Addr *src, const Addr *dst,
                       int sport, int dport, uint32_t seq, uint32_t ack, int flags, const uint8_t *payload,
                       size_t plen)
{
    uint8_t key[KEY_MAX];
    size_t kl = flow_key(key, src, sport, dst, dport);
    Node *x = map_get(&c->flows, key, kl);
    Flow *f = x ? x->val : NULL;
    if (flags & TCP_SYN) {
        if (f != NULL && f->seq == seq + 1)
            return 0;                               /* a retransmitted SYN */
        if (f != NULL && close_flow(c, f) < 0)
            return -1;
        map_del(&c->closed, key, kl);
        f = open_flow(c, key, kl, src, sport, dst, dport, seq + 1);
        if (f == NULL)
            return -1;
    } else if (f == NULL) {
        if (!plen || map_get(&c->closed, key, kl) != NULL || flags & TCP_RST)
            return flags & TCP_ACK ? acked(c, src, sport, dst, dport, ack) : 0;
        f = open_flow(c, key, kl, src, sport, dst, dport, seq);   /* a capture that starts mid-connection */
        if (f == NULL)
            return -1;
    }
    if (plen && f->state != ST_DEAD && tcp_data(c, f, seq, payload, plen, frame, time) < 0)
        return -1;
    if (flags & TCP_ACK && acked(c, src, sport, dst, dport, ack) < 0)
        return -1;
    if (flags & TCP_RST) {
        if (close_flow(c, f) < 0 || (f->peer != NULL && close_flow(c, f->peer) < 0))
            return -1;
    } else if (flags & TCP_FIN) {
        f->fin = 1;
        if (f->peer == NULL || f->peer->fin) {
            if (close_flow(c, f) < 0 || (f->peer != NULL && close_flow(c, f->peer) < 0))
                return -1;
        }
    } else if (f->state == ST_DEAD && forget(c, f) < 0)
        return -1;
    return 0;
}

static int flow_order(const void *a, const void *b)
{
    const Flow *x = *(Flow *const *)a, *y = *(Flow *const *)b;
    return x->order < y->order ? -1 : x->order > y->order;
}

/* The capture ends: every direction closes, in the order the directions opened. */
static int iwarp_flush(Core *c)
{
    size_t n = c->flows.n, k = 0;
    if (!n)
        return 0;
    Flow **open = malloc(n * sizeof *open);
    if (open == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < c->flows.nb; i++)
        for (Node *x = c->flows.b[i]; x; x = x->next)
            open[k++] = x->val;
    qsort(open, n, sizeof *open, flow_order);
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++)
        rc = close_flow(c, open[i]);
    free(open);
    return rc;
}

static void free_dead(Core *c)
{
    while (c->dead != NULL) {
        Flow *f = c->dead;
        c->dead = f->next_dead;
        flow_free(f);
    }
}

/* ---- frames (frames.py's locate) ------------------------------------------------------- */

enum { LT_NULL = 0, LT_ETHERNET = 1, LT_RAW_BSD = 12, LT_RAW_OPENBSD = 14, LT_RAW = 101, LT_LOOP = 108,
       LT_SLL = 113, LT_IPV4 = 228, LT_IPV6 = 229, LT_SLL2 = 276 };

static int supported(int lt)
{
    switch (lt) {
    case LT_NULL: case LT_ETHERNET: case LT_RAW_BSD: case LT_RAW_OPENBSD: case LT_RAW: case LT_LOOP:
    case LT_SLL: case LT_IPV4: case LT_IPV6: case LT_SLL2:
        return 1;
    }
    return 0;
}

static void network(int lt, const uint8_t *d, size_t n, uint32_t *et, size_t *off)
{
    *et = 0;
    *off = 0;
    if (lt == LT_ETHERNET) {
        if (n < 14)
            return;
        uint32_t e = be16(d + 12);
        size_t o = 14;
        while ((e == 0x8100 || e == 0x88A8 || e == 0x9100) && n >= o + 4) {
            e = be16(d + o + 2);
            o += 4;
        }
        *et = e;
        *off = o;
    } else if (lt == LT_RAW || lt == LT_RAW_BSD || lt == LT_RAW_OPENBSD || lt == LT_IPV4 || lt == LT_IPV6) {
        int version = n ? d[0] >> 4 : 0;
        *et = version == 4 ? 0x0800 : version == 6 ? 0x86DD : 0;
    } else if (lt == LT_SLL) {
        if (n >= 16) {
            *et = be16(d + 14);
            *off = 16;
        }
    } else if (lt == LT_SLL2) {
        if (n >= 20) {
            *et = be16(d);
            *off = 20;
        }
    } else if ((lt == LT_NULL || lt == LT_LOOP) && n >= 4) {
        uint32_t fam = lt == LT_LOOP || d[0] == 0 ? be32(d)
                       : (uint32_t)d[0] | (uint32_t)d[1] << 8 | (uint32_t)d[2] << 16 | (uint32_t)d[3] << 24;
        *et = fam == 2 ? 0x0800 : (fam == 10 || fam == 24 || fam == 28 || fam == 30) ? 0x86DD : 0;
        *off = 4;
    }
}

static int frame_in(Core *c, unsigned long long number, double time, int lt, const uint8_t *d, size_t n)
{
    uint32_t et;
    size_t off, start, end, net;
    int proto;
    Addr src, dst;
    if (lt == LT_ETHERNET && n >= 34 && d[12] == 8 && d[13] == 0) {
        et = 0x0800;
        off = 14;
    } else
        network(lt, d, n, &et, &off);
    net = off;
    if (et == 0x0800) {
        if (n < off + 20 || d[off] >> 4 != 4 || (d[off + 6] & 0x3F) | d[off + 7])
            return 0;
        start = off + (size_t)(d[off] & 0x0F) * 4;
        end = off + be16(d + off + 2);
        proto = d[off + 9];
        src.len = dst.len = 4;
        memcpy(src.raw, d + off + 12, 4);
        memcpy(dst.raw, d + off + 16, 4);
    } else if (et == 0x86DD) {
        if (n < off + 40)
            return 0;
        start = off + 40;
        end = start + be16(d + off + 4);
        proto = d[off + 6];
        src.len = dst.len = 16;
        memcpy(src.raw, d + off + 8, 16);
        memcpy(dst.raw, d + off + 24, 16);
        while (proto == 0 || proto == 43 || proto == 60 || proto == 51) {
            if (n < start + 8)
                return 0;
            size_t size = proto == 51 ? ((size_t)d[start + 1] + 2) * 4 : ((size_t)d[start + 1] + 1) * 8;
            proto = d[start];
            start += size;
        }
    } else if (et == 0x8915) {
        if (n < off + 52 || d[off + 6] != 0x1B)
            return 0;
        end = off + 40 + be16(d + off + 4);
        if (end > n) {
            c->cut++;
            return 0;
        }
        src.len = dst.len = 16;
        memcpy(src.raw, d + off + 8, 16);
        memcpy(dst.raw, d + off + 24, 16);
        return roce_packet(c, number, time, &src, &dst, d, n, off + 40, end, net);
    } else
        return 0;
    if (end > n) {
        c->cut++;
        return 0;
    }
    if (proto == 17) {
        if (end < start + 8 + 16 || (int)be16(d + start + 2) != c->roce_port)
            return 0;
        return roce_packet(c, number, time, &src, &dst, d, n, start + 8, end, net);
    }
    if (proto == 6 && end >= start + 20) {
        const uint8_t *h = d + start;
        size_t from = start + (size_t)(h[12] >> 4) * 4;
        return tcp_segment(c, number, time, &src, &dst, (int)be16(h), (int)be16(h + 2), be32(h + 4), be32(h + 8),
                           h[13], d + from, from < end ? end - from : 0);
    }
    return 0;
}

/* ---- records (pcapfile.py's Reader, after its header) ----------------------------------- */

/* Make n octets available at c->at; 0 at the end of the stream, -1 on an error. */
static int need(Core *c, size_t n)
{
    while (c->in.len - c->at < n) {
        if (c->eof)
            return 0;
        if (flush_out(c) < 0)
            return -1;
        if (c->progress != Py_None) {
            PyObject *r = PyObject_CallFunction(c->progress, "KK", c->base + c->at, c->messages);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
        }
        buf_drop(&c->in, c->at);
        c->base += c->at;
        c->at = 0;
        size_t want = n > c->chunk ? n : c->chunk;
        if (buf_reserve(&c->in, want) < 0)
            return -1;
        PyObject *view = PyMemoryView_FromMemory((char *)c->in.p + c->in.len, (Py_ssize_t)want, PyBUF_WRITE);
        if (view == NULL)
            return -1;
        PyObject *got = PyObject_CallOneArg(c->readinto, view);
        Py_DECREF(view);
        if (got == NULL)
            return -1;
        Py_ssize_t k = got == Py_None ? 0 : PyLong_AsSsize_t(got);
        Py_DECREF(got);
        if (k < 0 || (size_t)k > want) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "readinto gave a bad count");
            return -1;
        }
        if (k == 0)
            c->eof = 1;
        c->in.len += (size_t)k;
    }
    return 1;
}

static void cut(Core *c)
{
    if (c->in.len > c->at)
        c->cut_short = c->count + 1;
}

static uint32_t u32(Core *c, const uint8_t *p) { return c->big ? be32(p) : (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint32_t u16(Core *c, const uint8_t *p) { return c->big ? be16(p) : (uint32_t)p[0] | (uint32_t)p[1] << 8; }

static int record(Core *c, double time, int lt, const uint8_t *d, size_t n)
{
    unsigned long long number = ++c->count;
    c->frames = number;
    if (number == 1) {
        c->have_first = 1;
        c->first_time = time;
    }
    if ((number & 0xFFFF) == 0 && PyErr_CheckSignals() < 0)
        return -1;
    if (!supported(lt)) {
        PyObject *key = PyLong_FromLong(lt);
        if (key == NULL)
            return -1;
        PyObject *old = PyDict_GetItemWithError(c->unsupported, key);
        long was = old ? PyLong_AsLong(old) : 0;
        PyObject *now = PyErr_Occurred() ? NULL : PyLong_FromLong(was + 1);
        int rc = now == NULL ? -1 : PyDict_SetItem(c->unsupported, key, now);
        Py_XDECREF(now);
        Py_DECREF(key);
        return rc;
    }
#ifdef KBTP_CORE_CHECKED
    /* The sanitizer build (tests/test_decode_core.py): each frame in an allocation of its
     * own size, so that AddressSanitizer sees a read past its end, not the next record. */
    uint8_t *copy = malloc(n ? n : 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, d, n);
    int rc = frame_in(c, number, time, lt, copy, n);
    free(copy);
    return rc;
#else
    return frame_in(c, number, time, lt, d, n);
#endif
}

static int pcap_records(Core *c)
{
    for (;;) {
        int got = need(c, 16);
        if (got < 0)
            return -1;
        if (!got) {
            cut(c);
            return 0;
        }
        const uint8_t *h = c->in.p + c->at;
        uint32_t sec = u32(c, h), frac = u32(c, h + 4), caplen = u32(c, h + 8);
        if (caplen > c->max_record) {
            c->problem = Py_BuildValue("(sKk)", "record", c->count + 1, (unsigned long)caplen);
            return c->problem ? 0 : -1;
        }
        got = need(c, 16 + (size_t)caplen);
        if (got < 0)
            return -1;
        if (!got) {
            cut(c);
            return 0;
        }
        size_t at = c->at;
        c->at = at + 16 + caplen;
        double time = (double)sec + (double)frac * c->unit;
        if (record(c, time, c->pcap_linktype, c->in.p + at + 16, caplen) < 0)
            return -1;
        free_dead(c);
    }
}

typedef struct { int lt; double unit, offset; } Iface;

static Iface interface(Core *c, const uint8_t *b, size_t at, size_t end, size_t limit)
{
    Iface f = {(int)u16(c, b + at), 1e-6, 0.0};
    at += 8;
    while (at + 4 <= end) {
        uint32_t code = u16(c, b + at), size = u16(c, b + at + 2);
        if (code == 0)
            break;
        const uint8_t *v = b + at + 4;
        if (code == 9 && size >= 1)
            f.unit = v[0] & 0x80 ? pow(2.0, -(double)(v[0] & 0x7F)) : pow(10.0, -(double)v[0]);
        else if (code == 14 && size >= 8 && at + 12 <= limit) {
            uint64_t raw = c->big ? (uint64_t)be32(v) << 32 | be32(v + 4)
                                  : (uint64_t)u32(c, v + 4) << 32 | u32(c, v);
            f.offset = (double)(int64_t)raw;
        }
        at += 4 + size + ((4 - size % 4) % 4);
    }
    return f;
}

static int pcapng_records(Core *c)
{
    Buf ifaces = {0};
    int rc = 0;
    c->big = 0;
    for (;;) {
        int got = need(c, 12);
        if (got < 0) {
            rc = -1;
            break;
        }
        if (!got) {
            cut(c);
            break;
        }
        const uint8_t *b = c->in.p;
        size_t at = c->at;
        if (!memcmp(b + at, "\x0a\x0d\x0d\x0a", 4)) {
            const uint8_t *m = b + at + 8;
            c->big = !(m[0] == 0x4d && m[1] == 0x3c && m[2] == 0x2b && m[3] == 0x1a);
            if (u32(c, m) != 0x1A2B3C4D) {
                c->problem = Py_BuildValue("(sK)", "section", c->base + at);
                rc = c->problem ? 0 : -1;
                break;
            }
            ifaces.len = 0;
        }
        uint32_t kind = u32(c, b + at), length = u32(c, b + at + 4);
        if (length < 12 || length % 4 || length > c->max_record) {
            c->problem = Py_BuildValue("(sKk)", "block", c->base + at, (unsigned long)length);
            rc = c->problem ? 0 : -1;
            break;
        }
        got = need(c, length);
        if (got < 0) {
            rc = -1;
            break;
        }
        if (!got) {
            cut(c);
            break;
        }
        b = c->in.p;
        at = c->at;
        c->at = at + length;
        size_t body = at + 8;
        size_t nif = ifaces.len / sizeof(Iface);
        if (kind == 6 || kind == 2) {
            uint32_t iface, high, low, caplen;
            if (length < 28)            /* Python's struct.unpack_from would fail: never a frame */
                continue;
            if (kind == 6) {
                iface = u32(c, b + body);
                high = u32(c, b + body + 4);
                low = u32(c, b + body + 8);
                caplen = u32(c, b + body + 12);
            } else {
                iface = u16(c, b + body);
                high = u32(c, b + body + 4);
                low = u32(c, b + body + 8);
                caplen = u32(c, b + body + 12);
            }
            if (iface >= nif || 28 + (uint64_t)caplen > length)
                continue;
            Iface f = ((Iface *)ifaces.p)[iface];
            double time = (double)((uint64_t)high << 32 | low) * f.unit + f.offset;
            if (record(c, time, f.lt, b + body + 20, caplen) < 0) {
                rc = -1;
                break;
            }
            free_dead(c);
        } else if (kind == 3) {
            if (nif) {
                uint32_t wirelen = u32(c, b + body);
                size_t room = length < 16 ? 0 : length - 16, caplen = wirelen < room ? wirelen : room;
                if (record(c, 0.0, ((Iface *)ifaces.p)[0].lt, b + body + 4, caplen) < 0) {
                    rc = -1;
                    break;
                }
                free_dead(c);
            }
        } else if (kind == 1) {
            Iface f = interface(c, b, body, at + length - 4, c->in.len);
            if (buf_put(&ifaces, &f, sizeof f) < 0) {
                rc = -1;
                break;
            }
        }
    }
    buf_free(&ifaces);
    return rc;
}

/* ---- the module ---------------------------------------------------------------------- */

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
    c_marker_interval = c->marker_interval;
    c_marker_len = c->marker_len;
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
        int p, e, inv;
        if ((op == -1 && PyErr_Occurred()) || op < 0 || op > 255 || !PyArg_ParseTuple(v, "iip", &p, &e, &inv))
            return -1;
        c->send_pos[op] = p;
        c->send_ext[op] = e;
        c->send_inv[op] = inv;
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
    PyObject *r = Py_BuildValue("{sKsNsKsKsKsNsOsOsKsn}", "frames", c->frames, "first_time", first, "cut", c->cut,
                                "messages", c->messages, "malformed", c->n_malformed, "cut_short", cut_short,
                                "problem", c->problem ? c->problem : Py_None, "unsupported", c->unsupported,
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
                            "sink", "progress", "malformed", "stats", NULL};
    PyObject *cfg, *stats;
    Py_buffer head;
    Core c;
    memset(&c, 0, sizeof c);
    unsigned long long base;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!Oy*KppdiOOOO!", names, &PyDict_Type, &cfg, &c.readinto, &head,
                                     &base, &c.pcapng, &c.big, &c.unit, &c.pcap_linktype, &c.sink, &c.progress,
                                     &c.malformed, &PyDict_Type, &stats))
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
    buf_free(&c.in);
    buf_free(&c.out);
    buf_free(&c.scratch);
    buf_free(&c.closed_order);
    Py_XDECREF(c.unsupported);
    Py_XDECREF(c.problem);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_VARARGS | METH_KEYWORDS,
     "Decode the records after a capture's header into JSON lines; see kbtp_scapy.decode.core."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_core", "The compiled core of kbtp decode --json.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void)
{
    crc_init();
    crc32c_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Unsupported = PyErr_NewException("kbtp_scapy.decode._core.Unsupported", NULL, NULL);
    if (Unsupported == NULL || PyModule_AddObjectRef(m, "Unsupported", Unsupported) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
