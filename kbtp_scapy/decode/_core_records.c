/* pcap and pcapng records after the capture's header (pcapfile.py's Reader). */
#include "_core.h"
#include <math.h>

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

/* Damage met at the reading position, described by ``what`` (a new reference, taken; NULL
 * on an error), from ``start``; ``found`` what the resync found (1: a record to go on at, 0:
 * none, -1: an error). Returns ``found``, with the damage noted (pcapfile.py's
 * Reader._damaged and report_damage). */
static int damaged(Core *c, PyObject *what, unsigned long long start, int found)
{
    if (what == NULL || found < 0) {
        Py_XDECREF(what);
        return -1;
    }
    if (c->damage_first == NULL)
        c->damage_first = Py_NewRef(what);
    Py_XSETREF(c->damage_last, what);
    unsigned long long position = c->base + c->at;
    if (found) {
        c->damage_places++;
        c->damage_total += position - start;
    }
    c->damage_skipped = position - start;
    c->damage_position = position;
    c->damage_lost = !found;
    return found;
}

#define RESYNC_SPAN (30ULL * 86400)   /* seconds from the last record read, at most */

/* The captured length of a plausible pcap record header at h, or -1 (Reader._pcap_header_ok). */
static long long pcap_header_ok(Core *c, const uint8_t *h, int have_last, uint32_t last)
{
    uint32_t sec = u32(c, h), frac = u32(c, h + 4), caplen = u32(c, h + 8), wirelen = u32(c, h + 12);
    unsigned long long gap = sec > last ? (unsigned long long)sec - last : (unsigned long long)last - sec;
    if (caplen > c->max_record || caplen > wirelen || !caplen || frac >= (uint32_t)llround(1.0 / c->unit)
            || (c->snaplen && caplen > c->snaplen) || (have_last && gap > RESYNC_SPAN))
        return -1;
    return caplen;
}

/* Move to the next record header that another one (or the end) follows: 1 found, 0 not,
 * -1 on an error (Reader._resync_pcap). */
static int pcap_resync(Core *c, int have_last, uint32_t last)
{
    for (;;) {
        c->at++;
        int got = need(c, 16);
        if (got <= 0)
            return got;
        long long caplen = pcap_header_ok(c, c->in.p + c->at, have_last, last);
        if (caplen < 0)
            continue;
        got = need(c, 16 + (size_t)caplen + 16);
        if (got < 0)
            return -1;
        if (!got) {                 /* the last record: it ends the file exactly */
            got = need(c, 16 + (size_t)caplen);
            if (got < 0)
                return -1;
            if (got && c->in.len - c->at == 16 + (size_t)caplen)
                return 1;
            continue;
        }
        const uint8_t *h = c->in.p + c->at;
        if (pcap_header_ok(c, h + 16 + caplen, 1, u32(c, h)) >= 0)
            return 1;
    }
}

int pcap_records(Core *c)
{
    int have_last = 0;
    uint32_t last = 0;              /* the seconds of the last record read */
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
            unsigned long long start = c->base + c->at;
            PyObject *what = Py_BuildValue("(sKk)", "record", c->count + 1, (unsigned long)caplen);
            int on = damaged(c, what, start, what == NULL ? -1 : pcap_resync(c, have_last, last));
            if (on <= 0)
                return on;
            continue;
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
        have_last = 1;
        last = sec;
        double time = (double)sec + (double)frac * c->unit;
        if (record(c, time, c->pcap_linktype, c->in.p + at + 16, caplen) < 0)
            return -1;
        free_dead(c);
    }
}

/* Move to the next block of a known type whose trailing length repeats its leading one
 * (a Section Header also with its byte-order magic): 1 found, 0 not, -1 on an error
 * (Reader._resync_pcapng). */
static int pcapng_resync(Core *c)
{
    for (;;) {
        c->at++;
        int got = need(c, 12);
        if (got <= 0)
            return got;
        const uint8_t *b = c->in.p + c->at;
        uint32_t kind = u32(c, b), length = u32(c, b + 4);
        int known = kind == 1 || kind == 2 || kind == 3 || kind == 4 || kind == 5 || kind == 6 || kind == 9
                    || kind == 10 || kind == 0x0A0D0D0A;
        if (!known || length < 12 || length % 4 || length > c->max_record)
            continue;
        got = need(c, length);
        if (got < 0)
            return -1;
        if (!got)
            continue;
        b = c->in.p + c->at;
        if (u32(c, b + length - 4) != length)
            continue;
        if (kind != 0x0A0D0D0A || !memcmp(b + 8, "\x4d\x3c\x2b\x1a", 4) || !memcmp(b + 8, "\x1a\x2b\x3c\x4d", 4))
            return 1;
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

int pcapng_records(Core *c)
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
        unsigned long long start = c->base + at;
        int bad = 0;                /* damage here: a section without its magic, a block's length */
        PyObject *what = NULL;
        if (!memcmp(b + at, "\x0a\x0d\x0d\x0a", 4)) {
            const uint8_t *m = b + at + 8;
            int little = !memcmp(m, "\x4d\x3c\x2b\x1a", 4);
            if (!little && memcmp(m, "\x1a\x2b\x3c\x4d", 4)) {
                /* the previous section's byte order (Reader._pcapng) */
                bad = 1;
                what = Py_BuildValue("(sK)", "section", start);
            } else {
                c->big = !little;
                ifaces.len = 0;
            }
        }
        uint32_t kind = u32(c, b + at), length = u32(c, b + at + 4);
        if (!bad && (length < 12 || length % 4 || length > c->max_record)) {
            bad = 1;
            what = Py_BuildValue("(sKk)", "block", start, (unsigned long)length);
        }
        if (bad) {
            int on = damaged(c, what, start, what == NULL ? -1 : pcapng_resync(c));
            rc = on < 0 ? -1 : 0;
            if (on <= 0)
                break;
            continue;
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
