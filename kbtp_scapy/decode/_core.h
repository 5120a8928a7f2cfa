/*
 * What the units of the compiled decoder core share (kbtp_scapy/decode/_core*.c): octet
 * buffers and hash maps, the CRCs, the decoder's state, and each unit's entry points.
 * Every symbol but PyInit__core is hidden (-fvisibility=hidden in pyproject.toml).
 */
#ifndef KBTP_CORE_H
#define KBTP_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* _core_mem.c: growable octet buffers, and a chained hash map of short octet keys */
typedef struct { uint8_t *p; size_t len, cap; } Buf;
int buf_reserve(Buf *b, size_t extra);
int buf_put(Buf *b, const void *d, size_t n);
void buf_drop(Buf *b, size_t n);
void buf_free(Buf *b);

#define KEY_MAX 40
typedef struct Node { struct Node *next; uint64_t hash; uint8_t klen; uint8_t key[KEY_MAX]; void *val; } Node;
typedef struct { Node **b; size_t nb, n; } Map;
Node *map_get(Map *m, const uint8_t *k, size_t n);
Node *map_put(Map *m, const uint8_t *k, size_t n);
void *map_del(Map *m, const uint8_t *k, size_t n);
void map_free(Map *m, void (*drop)(void *));

/* _core_crc.c: zlib's CRC-32 (the RoCE ICRC) and CRC32c (the MPA CRC) */
void crc_init(void);
uint32_t crc32_update(uint32_t crc, const uint8_t *p, size_t n);
uint32_t crc32c(const uint8_t *p, size_t n);

/* the decoder's state */
static inline uint32_t be16(const uint8_t *p) { return (uint32_t)p[0] << 8 | p[1]; }
static inline uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

typedef struct { uint8_t len; uint8_t raw[16]; } Addr;

typedef struct {
    /* configuration from decode/core.py */
    unsigned long chunk, max_record, max_message, max_closed, max_pending, marker_interval, marker_len;
    unsigned long max_out_of_order, max_unframed;
    int roce_port, ddp_untagged_len, ddp_tagged_len, flag_m, flag_c, flag_r, mpa_startup_len;
    int send_pos[256], send_ext[256];   /* RoCE Send opcodes: position, extension headers; -1: not one */
    int iw_sends[16];
    uint8_t req_key[16], rep_key[16];
    PyObject *readinto, *sink, *progress, *malformed;
    int text;                   /* kbtp decode's text lines, not JSON */
    /* the record reader */
    Buf in;
    size_t at;
    unsigned long long base, count;
    int eof, pcapng, big, pcap_linktype;
    double unit;
    unsigned long snaplen;      /* a classic pcap's, 0 for pcapng */
    /* damage read past (pcapfile.py's Reader.report_damage): the first and the last met,
     * each (kind, numbers...), the octets skipped at the last and where reading went on,
     * the places read past and the octets skipped there, whether no record followed */
    PyObject *damage_first, *damage_last;
    unsigned long long damage_skipped, damage_position, damage_places, damage_total;
    int damage_lost;
    /* stats */
    unsigned long long frames, cut, messages, n_malformed, cut_short;
    int have_first;
    double first_time;
    PyObject *unsupported;
    /* state */
    Map sessions, parts, flows, closed;
    Map peers, sent, cm_reqs, conns, lone;   /* RoCEv2 connections (_core_conns.c) */
    unsigned long followed, max_followed;
    Buf closed_order;           /* Closed entries from closed_head on, some stale */
    size_t closed_head;
    unsigned long long order, closed_seq;
    struct Flow *dead;          /* directions forgotten during this record, freed after it */
    Buf out, scratch;           /* lines to write; an FPDU without its markers */
} Core;

/* A RoCE direction: source and destination address, destination QP. */
typedef struct { Addr src, dst; uint32_t qp; } Dir;

/* Where a message was: the RoCE addresses and destination QP with the first direction of
 * its connection, or the iWARP endpoints. */
typedef struct { int iwarp; Addr src, dst; uint32_t qp; uint16_t sport, dport; const Dir *first; } Conn;

/* _core_kbtp.c: KBTP messages and their lines, JSON or text */
int looks_like_kbtp(const uint8_t *p, size_t n);
size_t endpoint_key(uint8_t *k, const Addr *a, int port, int with_port);
int message(Core *c, const Conn *m, unsigned long long frame, double time, const uint8_t *p, size_t n,
            const unsigned long long *bad, size_t nbad);
int flush_out(Core *c);

/* _core_roce.c: RoCE Sends */
int roce_packet(Core *c, unsigned long long frame, double time, const Addr *src, const Addr *dst,
                const uint8_t *data, size_t n, size_t start, size_t end, size_t net);
int roce_flush(Core *c);
void part_free(void *v);

/* _core_conns.c: RoCEv2 connections, the QPs of their two directions tied */
size_t dir_key(uint8_t *k, const Addr *src, const Addr *dst, uint32_t qp);
int conns_packet(Core *c, const Addr *src, const Addr *dst, const uint8_t *data, size_t start, size_t end);
const Dir *conn_of(Core *c, const Addr *src, const Addr *dst, uint32_t qp);
void conns_free(Core *c);

/* _core_iwarp.c: iWARP Sends */
int tcp_segment(Core *c, unsigned long long frame, double time, const Addr *src, const Addr *dst, int sport,
                int dport, uint32_t seq, uint32_t ack, int flags, const uint8_t *payload, size_t plen);
int iwarp_flush(Core *c);
void flow_free(void *v);
void free_dead(Core *c);

/* _core_frames.c: where a frame's RoCE packet or TCP segment is, of the link types read */
int supported(int lt);
int frame_in(Core *c, unsigned long long number, double time, int lt, const uint8_t *d, size_t n);

/* _core_records.c: pcap and pcapng records */
int pcap_records(Core *c);
int pcapng_records(Core *c);

#endif
