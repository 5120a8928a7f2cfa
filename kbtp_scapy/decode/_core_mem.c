/* Growable octet buffers and a chained hash map of short octet keys, for the decoder core. */
#include "_core.h"


int buf_reserve(Buf *b, size_t extra)
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

int buf_put(Buf *b, const void *d, size_t n)
{
    if (buf_reserve(b, n) < 0)
        return -1;
    if (n)
        memcpy(b->p + b->len, d, n);
    b->len += n;
    return 0;
}

void buf_drop(Buf *b, size_t n)      /* the first n octets */
{
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

void buf_free(Buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

/* ---- a chained hash map of short octet keys ---------------------------------------- */

static uint64_t hash_of(const uint8_t *k, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ k[i]) * 1099511628211ULL;
    return h;
}

Node *map_get(Map *m, const uint8_t *k, size_t n)
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
Node *map_put(Map *m, const uint8_t *k, size_t n)
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
void *map_del(Map *m, const uint8_t *k, size_t n)
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

void map_free(Map *m, void (*drop)(void *))
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
