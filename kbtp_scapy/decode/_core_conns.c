/* RoCEv2 connections of the decoder core: which destination QP of one direction answers
 * which of the other, from the CM's REQ and REP, else the PSN an ACK, Read Response or
 * Atomic Acknowledge answers, else the oldest lone connection between the same hosts
 * (connections.py, the reference; its docstring says why). */
#include "_core.h"

/* A direction that an unpaired request went on: its QP and the span of its PSNs. */
typedef struct { uint32_t qp, first, last; } Span;

static size_t pair_key(uint8_t *k, const Addr *a, const Addr *b)
{
    size_t n = endpoint_key(k, a, 0, 0);
    return n + endpoint_key(k + n, b, 0, 0);
}

size_t dir_key(uint8_t *k, const Addr *src, const Addr *dst, uint32_t qp)
{
    size_t n = pair_key(k, src, dst);
    k[n++] = (uint8_t)(qp >> 16);
    k[n++] = (uint8_t)(qp >> 8);
    k[n++] = (uint8_t)qp;
    return n;
}

static uint32_t u24(const uint8_t *p) { return (uint32_t)p[0] << 16 | (uint32_t)p[1] << 8 | p[2]; }

/* The QP at src of direction (src, dst, qp) when known (its value is that QP + 1). */
static Node *peer_of(Core *c, const Addr *src, const Addr *dst, uint32_t qp)
{
    uint8_t k[KEY_MAX];
    return c->peers.n ? map_get(&c->peers, k, dir_key(k, src, dst, qp)) : NULL;
}

static void buf_free_all(void *v)
{
    if (v) {
        buf_free(v);
        free(v);
    }
}

void conns_free(Core *c)
{
    map_free(&c->peers, NULL);
    map_free(&c->sent, buf_free_all);
    map_free(&c->cm_reqs, NULL);
    map_free(&c->conns, free);
    map_free(&c->lone, buf_free_all);
}

/* The Buf value of key k in m, made when absent. */
static Buf *buf_at(Map *m, const uint8_t *k, size_t n)
{
    Node *x = map_put(m, k, n);
    if (x == NULL)
        return NULL;
    if (x->val == NULL && (x->val = calloc(1, sizeof(Buf))) == NULL)
        PyErr_NoMemory();
    return x->val;
}

static int put_peer(Core *c, const Addr *src, const Addr *dst, uint32_t qp, uint32_t peer)
{
    uint8_t k[KEY_MAX];
    Node *x = map_put(&c->peers, k, dir_key(k, src, dst, qp));
    if (x == NULL)
        return -1;
    x->val = (void *)(uintptr_t)(peer + 1);
    return 0;
}

/* A's QP qa and B's QP qb are one connection; their directions are no longer followed. */
static int learn(Core *c, const Addr *a, const Addr *b, uint32_t qa, uint32_t qb)
{
    if (put_peer(c, a, b, qb, qa) < 0 || put_peer(c, b, a, qa, qb) < 0)
        return -1;
    for (int i = 0; i < 2; i++) {
        uint8_t k[KEY_MAX];
        Node *x = map_get(&c->sent, k, i ? pair_key(k, b, a) : pair_key(k, a, b));
        if (x == NULL)
            continue;
        Buf *spans = x->val;
        Span *s = (Span *)spans->p;
        size_t n = spans->len / sizeof *s;
        uint32_t qp = i ? qa : qb;
        for (size_t j = 0; j < n; j++)
            if (s[j].qp == qp) {
                memmove(s + j, s + j + 1, (n - j - 1) * sizeof *s);
                spans->len -= sizeof *s;
                c->followed--;
                break;
            }
    }
    return 0;
}

static int follow(Core *c, const Addr *src, const Addr *dst, uint32_t qp, uint32_t psn)
{
    uint8_t k[KEY_MAX];
    size_t kl = pair_key(k, src, dst);
    Node *x = c->sent.n ? map_get(&c->sent, k, kl) : NULL;
    if (x != NULL) {
        Span *s = (Span *)((Buf *)x->val)->p;
        size_t n = ((Buf *)x->val)->len / sizeof *s;
        for (size_t j = 0; j < n; j++)
            if (s[j].qp == qp) {
                uint32_t d = (psn - s[j].last) & 0xFFFFFF;
                if (d && d < 0x800000)
                    s[j].last = psn;
                return 0;
            }
    }
    if (c->followed >= c->max_followed)
        return 0;
    Buf *spans = buf_at(&c->sent, k, kl);
    Span add = {qp, psn, psn};
    if (spans == NULL || buf_put(spans, &add, sizeof add) < 0)
        return -1;
    c->followed++;
    return 0;
}

/* A response from src to QP qp of dst answers the one request from dst to src whose PSNs hold psn. */
static int answer(Core *c, const Addr *src, const Addr *dst, uint32_t qp, uint32_t psn)
{
    uint8_t k[KEY_MAX];
    Node *x = c->sent.n ? map_get(&c->sent, k, pair_key(k, dst, src)) : NULL;
    if (x == NULL)
        return 0;
    const Buf *spans = x->val;
    const Span *s = (const Span *)spans->p;
    size_t n = spans->len / sizeof *s, found = 0;
    uint32_t other = 0;
    for (size_t j = 0; j < n; j++)
        if (((psn - s[j].first) & 0xFFFFFF) <= ((s[j].last - s[j].first) & 0xFFFFFF)) {
            found++;
            other = s[j].qp;
        }
    if (found != 1 || peer_of(c, dst, src, other) != NULL)
        return 0;
    return learn(c, dst, src, qp, other);
}

static int cm(Core *c, const Addr *src, const Addr *dst, const uint8_t *mad)
{
    if (mad[1] != 0x07 || mad[3] != 0x03)
        return 0;
    uint32_t attr = be16(mad + 16);
    uint8_t k[KEY_MAX];
    if (attr == 0x0010 && c->cm_reqs.n < c->max_followed) {
        size_t n = pair_key(k, src, dst);
        memcpy(k + n, mad + 24, 4);
        Node *x = map_put(&c->cm_reqs, k, n + 4);
        if (x == NULL)
            return -1;
        x->val = (void *)(uintptr_t)(u24(mad + 56) + 1);
    } else if (attr == 0x0013) {
        size_t n = pair_key(k, dst, src);
        memcpy(k + n, mad + 28, 4);
        uintptr_t qa = (uintptr_t)map_del(&c->cm_reqs, k, n + 4);
        if (qa)
            return learn(c, dst, src, (uint32_t)(qa - 1), u24(mad + 36));
    }
    return 0;
}

int conns_packet(Core *c, const Addr *src, const Addr *dst, const uint8_t *data, size_t start, size_t end)
{
    if (end < start + 12)
        return 0;
    int opcode = data[start];
    uint32_t qp = u24(data + start + 5), psn = u24(data + start + 9);
    if (opcode <= 0x0C || opcode == 0x13 || opcode == 0x14 || opcode == 0x16 || opcode == 0x17)
        return peer_of(c, src, dst, qp) ? 0 : follow(c, src, dst, qp, psn);
    if (opcode >= 0x0D && opcode <= 0x12)
        return peer_of(c, src, dst, qp) ? 0 : answer(c, src, dst, qp, psn);
    if (opcode == 0x64 && qp == 1 && end >= start + 20 + 4 + 60)
        return cm(c, src, dst, data + start + 20);
    return 0;
}

/* Remove qp from the lone connections from src to dst (kept in the order they came). */
static void unlone(Core *c, const Addr *src, const Addr *dst, uint32_t qp)
{
    uint8_t k[KEY_MAX];
    Node *x = c->lone.n ? map_get(&c->lone, k, pair_key(k, src, dst)) : NULL;
    if (x == NULL)
        return;
    Buf *b = x->val;
    uint32_t *q = (uint32_t *)b->p;
    size_t n = b->len / sizeof *q;
    for (size_t j = 0; j < n; j++)
        if (q[j] == qp) {
            memmove(q + j, q + j + 1, (n - j - 1) * sizeof *q);
            b->len -= sizeof *q;
            return;
        }
}

const Dir *conn_of(Core *c, const Addr *src, const Addr *dst, uint32_t qp)
{
    uint8_t k[KEY_MAX], pk[KEY_MAX];
    size_t kl = dir_key(k, src, dst, qp);
    Node *x = c->conns.n ? map_get(&c->conns, k, kl) : NULL;
    if (x != NULL)
        return x->val;
    Dir found = {*src, *dst, qp};
    int joined = 0;
    Node *peer = peer_of(c, src, dst, qp);
    if (peer != NULL) {
        Node *y = c->conns.n ? map_get(&c->conns, pk, dir_key(pk, dst, src, (uint32_t)((uintptr_t)peer->val - 1))) : NULL;
        if (y != NULL) {
            found = *(const Dir *)y->val;
            joined = 1;
        }
    } else {
        Node *y = c->lone.n ? map_get(&c->lone, pk, pair_key(pk, dst, src)) : NULL;
        const Buf *b = y ? y->val : NULL;
        for (size_t j = 0; b && j < b->len / sizeof(uint32_t) && !joined; j++) {
            uint32_t q = ((const uint32_t *)b->p)[j];
            if (peer_of(c, dst, src, q) == NULL) {
                found = (Dir){*dst, *src, q};
                joined = 1;
            }
        }
    }
    if (joined)
        unlone(c, &found.src, &found.dst, found.qp);
    else {
        Buf *lone = buf_at(&c->lone, pk, pair_key(pk, src, dst));
        if (lone == NULL || buf_put(lone, &qp, sizeof qp) < 0)
            return NULL;
    }
    Dir *d = malloc(sizeof *d);
    if (d == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *d = found;
    x = map_put(&c->conns, k, kl);
    if (x == NULL) {
        free(d);
        return NULL;
    }
    x->val = d;
    return d;
}
