/* iWARP Sends of the decoder core (iwarp.py with sends_only): TCP in sequence order with its
 * holes, MPA startup, FPDUs with markers, DDP segments of untagged Sends. */
#include "_core.h"

enum { ST_STARTUP, ST_FPDU, ST_RESYNC, ST_DEAD };

/* A TCP segment held after a hole, by stream offset. */
typedef struct { uint64_t at; Buf data; unsigned long long frame; double time; } Held;

/* A closed connection, in the order it was closed. */
typedef struct { unsigned long long seq; uint8_t klen; uint8_t key[KEY_MAX]; } Closed;

/* A DDP segment of an untagged Send, and a Send being put together: its QN and MSN, its
 * segments by MO (iwarp.py's Assembler). */
typedef struct { uint32_t mo; int last; Buf data; unsigned long long frame; double time; } Piece;
typedef struct { uint8_t key[8]; Piece *pieces; size_t n, cap; } Untagged;

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
    Untagged *sends;            /* Sends being put together, in the order they began (the Assembler) */
    size_t nsends, cap_sends;
    int64_t sends_size;          /* as Assembler.size counts it */
    unsigned long long order;   /* of its opening, for the end's flush */
} Flow;

typedef struct { uint64_t start, end; unsigned long long frame; double time; } Span;

#define TCP_FIN 0x01
#define TCP_SYN 0x02
#define TCP_RST 0x04
#define TCP_ACK 0x10

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

static void untagged_free(Untagged *u)
{
    for (size_t i = 0; i < u->n; i++)
        buf_free(&u->pieces[i].data);
    free(u->pieces);
}

static void drop_untagged(Flow *f)
{
    for (size_t i = 0; i < f->nsends; i++)
        untagged_free(&f->sends[i]);
    free(f->sends);
    f->sends = NULL;
    f->nsends = f->cap_sends = 0;
    f->sends_size = 0;
}

void flow_free(void *v)
{
    Flow *f = v;
    if (f) {
        buf_free(&f->buf);
        buf_free(&f->spans);
        buf_free(&f->skip);
        drop_untagged(f);
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

/* A Send put together, complete or not: its segments' octets in MO order, its latest
 * frame and that frame's time (iwarp.py's _merge). */
static int emit_untagged(Core *c, Flow *f, const Untagged *u)
{
    Buf data = {0};
    unsigned long long frame = 0;
    double time = 0;
    for (size_t i = 0; i < u->n; i++) {
        if (buf_put(&data, u->pieces[i].data.p, u->pieces[i].data.len) < 0) {
            buf_free(&data);
            return -1;
        }
        if (u->pieces[i].frame > frame) {
            frame = u->pieces[i].frame;
            time = u->pieces[i].time;
        }
    }
    Conn m = {1, f->src, f->dst, 0, f->sport, f->dport, NULL};
    int rc = message(c, &m, frame, time, data.p ? data.p : (const uint8_t *)"", data.len, NULL, 0);
    buf_free(&data);
    return rc;
}

/* Whatever is still incomplete, in the order it began (Assembler.flush). */
static int flush_untagged(Core *c, Flow *f)
{
    int rc = 0;
    for (size_t i = 0; i < f->nsends && rc == 0; i++)
        rc = emit_untagged(c, f, &f->sends[i]);
    drop_untagged(f);
    return rc;
}

static Untagged *untagged_of(Flow *f, const uint8_t *key)
{
    for (size_t i = 0; i < f->nsends; i++)
        if (!memcmp(f->sends[i].key, key, 8))
            return &f->sends[i];
    return NULL;
}

/* One DDP segment of an untagged Send: the Send when it is complete (Assembler.add),
 * everything incomplete past MAX_PENDING (iwarp.py's _fpdu). */
static int add_untagged(Core *c, Flow *f, const uint8_t *key, uint32_t mo, int last, const uint8_t *data,
                        size_t n, unsigned long long frame, double time)
{
    f->sends_size += (int64_t)n;
    Untagged *u = untagged_of(f, key);
    if (u == NULL) {
        if (f->nsends == f->cap_sends) {
            size_t cap = f->cap_sends ? 2 * f->cap_sends : 4;
            Untagged *a = realloc(f->sends, cap * sizeof *a);
            if (a == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            f->sends = a;
            f->cap_sends = cap;
        }
        u = &f->sends[f->nsends++];
        memset(u, 0, sizeof *u);
        memcpy(u->key, key, 8);
    }
    size_t k = 0;
    while (k < u->n && u->pieces[k].mo < mo)
        k++;
    if (k == u->n || u->pieces[k].mo != mo) {
        if (u->n == u->cap) {
            size_t cap = u->cap ? 2 * u->cap : 4;
            Piece *p = realloc(u->pieces, cap * sizeof *p);
            if (p == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            u->pieces = p;
            u->cap = cap;
        }
        memmove(u->pieces + k + 1, u->pieces + k, (u->n - k) * sizeof *u->pieces);
        memset(&u->pieces[k], 0, sizeof *u->pieces);
        u->n++;
    }
    Piece *p = &u->pieces[k];                   /* a segment of the same MO again replaces it */
    p->mo = mo;
    p->last = last;
    p->frame = frame;
    p->time = time;
    p->data.len = 0;
    if (buf_put(&p->data, data, n) < 0)
        return -1;
    uint64_t pos = 0, end = 0;
    int contiguous = 1, ends = 0;
    for (size_t i = 0; i < u->n; i++) {
        if (u->pieces[i].last && !ends) {
            ends = 1;
            end = u->pieces[i].mo + u->pieces[i].data.len;
        }
        if (contiguous && u->pieces[i].mo != pos)
            contiguous = 0;
        pos += u->pieces[i].data.len;
    }
    if (contiguous && ends && pos == end) {
        int rc = emit_untagged(c, f, u);
        f->sends_size -= (int64_t)pos;
        untagged_free(u);
        size_t i = (size_t)(u - f->sends);
        memmove(f->sends + i, f->sends + i + 1, (f->nsends - i - 1) * sizeof *f->sends);
        f->nsends--;
        if (rc < 0)
            return -1;
    }
    if (f->sends_size > (int64_t)c->max_pending)
        return flush_untagged(c, f);
    return 0;
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
        if (ctrl & 0x40 && untagged_of(f, pair) == NULL) {    /* the usual case: a Send in one FPDU */
            Conn m = {1, f->src, f->dst, 0, f->sport, f->dport, NULL};
            return message(c, &m, frame, time, data, dlen, NULL, 0);
        }
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
    }
    return add_untagged(c, f, pair, mo, ctrl & 0x40, data, dlen, frame, time);
}

/* Octets an FPDU of clean_len takes at stream position pos, markers included
 * (wire/iwarp.py's fpdu_wire_length). */
static uint64_t wire_length(const Core *c, uint64_t clean_len, uint64_t pos)
{
    uint64_t wire = clean_len;
    for (;;) {
        uint64_t first = (c->marker_interval - pos % c->marker_interval) % c->marker_interval;
        uint64_t count = first >= wire ? 0 : 1 + (wire - 1 - first) / c->marker_interval;
        if (clean_len + c->marker_len * count == wire)
            return wire;
        wire = clean_len + c->marker_len * count;
    }
}

/* The FPDU w[0:n] at stream position pos without its markers (wire/mpa_markers.py). */
static int strip_markers(const Core *c, Buf *out, const uint8_t *w, size_t n, uint64_t pos)
{
    out->len = 0;
    size_t i = 0;
    while (i < n) {
        size_t next = i + (size_t)((c->marker_interval - (pos + i) % c->marker_interval) % c->marker_interval);
        if (buf_put(out, w + i, (next < n ? next : n) - i) < 0)
            return -1;
        if (next >= n)
            break;
        i = next + c->marker_len;
    }
    return 0;
}

/* ULPDU Length and wire size of the FPDU at w[0:avail], stream octet at, or 0 until
 * enough octets are there (iwarp.py's _length). */
static int fpdu_length(const Core *c, Flow *f, const uint8_t *w, size_t avail, uint64_t at, size_t *ulen,
                       size_t *size)
{
    if (!f->markers) {
        if (avail < 2)
            return 0;
        *ulen = be16(w);
        *size = 2 + *ulen + ((4 - (2 + *ulen) % 4) % 4) + 4;
        return 1;
    }
    uint64_t pos = at - f->fpdu_at;
    uint64_t ahead = (c->marker_interval - pos % c->marker_interval) % c->marker_interval;
    size_t a = ahead == 0 ? 4 : 0, b = ahead <= 1 ? 5 : 1;
    if (avail <= b)
        return 0;
    *ulen = (size_t)w[a] << 8 | w[b];
    *size = (size_t)wire_length(c, 2 + *ulen + ((4 - (2 + *ulen) % 4) % 4) + 4, pos);
    return 1;
}

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
    while (fpdu_length(c, f, w + i, n - i, f->base + i, &ulen, &size) && n - i >= size) {
        const uint8_t *clean = w + i;
        if (f->markers) {
            if (strip_markers(c, &c->scratch, w + i, size, f->base + i - f->fpdu_at) < 0)
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

/* Whether an FPDU starts at the flow's first buffered octet (iwarp.py's _valid_fpdu). */
static int valid_fpdu(Core *c, Flow *f)
{
    if (f->markers < 0 && !negotiated(c, f)) {
        f->state = ST_DEAD;
        return V_NO;
    }
    size_t ulen, size;
    if (!fpdu_length(c, f, f->buf.p, f->buf.len, f->base, &ulen, &size))
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
        if (strip_markers(c, &c->scratch, wire, size, f->base - f->fpdu_at) < 0)
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
    if ((f->state == ST_FPDU || f->state == ST_RESYNC) && flush_untagged(c, f) < 0)
        return -1;
    f->state = ST_DEAD;
    f->buf.len = 0;
    f->spans.len = 0;
    drop_held(f);
    return forget(c, f);
}

int tcp_segment(Core *c, unsigned long long frame, double time, const Addr *src, const Addr *dst,
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
int iwarp_flush(Core *c)
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

void free_dead(Core *c)
{
    while (c->dead != NULL) {
        Flow *f = c->dead;
        c->dead = f->next_dead;
        flow_free(f);
    }
}
