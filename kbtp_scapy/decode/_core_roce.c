/* RoCE Sends of the decoder core, put together by PSN with the ICRC check (roce.py, icrc.py). */
#include "_core.h"

/* A RoCE Send being put together (roce.py's _Part). */
typedef struct {
    Addr src, dst;
    uint32_t dqpn, psn;
    int keep;                   /* whether its first octets are KBTP's */
    double time;
    Buf data;
    unsigned long long last_frame;
    Buf bad;                    /* frame numbers (unsigned long long) with a wrong ICRC */
    unsigned long long order;   /* of its last update, for the end's flush */
} Part;

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

enum { P_FIRST, P_MIDDLE, P_LAST, P_ONLY };

void part_free(void *v)
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
        Conn m = {0, p->src, p->dst, p->dqpn, 0, 0, conn_of(c, &p->src, &p->dst, p->dqpn)};
        rc = m.first == NULL ? -1 : message(c, &m, p->last_frame, p->time, p->data.p ? p->data.p : (const uint8_t *)"", p->data.len,
                     (const unsigned long long *)p->bad.p, p->bad.len / sizeof(unsigned long long));
    }
    part_free(p);
    return rc;
}

int roce_packet(Core *c, unsigned long long frame, double time, const Addr *src, const Addr *dst,
                       const uint8_t *data, size_t n, size_t start, size_t end, size_t net)
{
    if (start + 12 > n)             /* the callers' checks keep the BTH in the frame */
        return 0;
    if (conns_packet(c, src, dst, data, start, end) < 0)
        return -1;
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
    size_t kl = dir_key(key, src, dst, dqpn);
    Part *part = c->parts.n ? map_del(&c->parts, key, kl) : NULL;
    if (part != NULL && (position == P_FIRST || position == P_ONLY || psn != ((part->psn + 1) & 0xFFFFFF))) {
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
            Conn m = {0, *src, *dst, dqpn, 0, 0, conn_of(c, src, dst, dqpn)};
            if (m.first == NULL)
                return -1;
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
        part->keep = looks_like_kbtp(chunk, clen);
    }
    part->psn = psn;
    part->time = time;
    if (part->keep) {
        part->last_frame = frame;
        if (!icrc_ok(data, n, net, start, end) && buf_put(&part->bad, &frame, sizeof frame) < 0) {
            part_free(part);
            return -1;
        }
        if (part->data.len + clen <= c->max_message && buf_put(&part->data, chunk, clen) < 0) {
            part_free(part);
            return -1;
        }
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

int roce_flush(Core *c)
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
        if (rc == 0)
            rc = finish(c, all[i]);
        else
            part_free(all[i]);
    }
    free(all);
    return rc;
}
