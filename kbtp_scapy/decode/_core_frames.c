/* Where a frame's RoCE packet or TCP segment is, by octet arithmetic (frames.py's locate). */
#include "_core.h"

enum { LT_NULL = 0, LT_ETHERNET = 1, LT_RAW_BSD = 12, LT_RAW_OPENBSD = 14, LT_RAW = 101, LT_LOOP = 108,
       LT_SLL = 113, LT_IPV4 = 228, LT_IPV6 = 229, LT_SLL2 = 276 };

int supported(int lt)
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

int frame_in(Core *c, unsigned long long number, double time, int lt, const uint8_t *d, size_t n)
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
