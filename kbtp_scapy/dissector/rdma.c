/* RDMA transfers tied to KBTP requests (kbtp.data_for) and the ring Head counter
 * (kbtp.ring.ticket, kbtp.ring.slot_offset, expert kbtp.expert.ring), on both bindings;
 * and the second Send of an iWARP TCP segment, which tshark 4.0 never offers to a
 * heuristic. As rdma.lua, whose comments explain the rules; here a postdissector asks
 * Wireshark for the RDMA header fields it needs (set_postdissector_wanted_hfids), so it
 * always has them and reads the headers at the place they point to.
 */

static int proto_kbtp_rdma = -1;
static expert_field ei_kbtp_ring = EI_INIT;
static dissector_handle_t kbtp_rdma_handle;
static int hf_bth_opcode = -1, hf_iwarp_rdma_opcode = -1;

#define KBTP_MAX_EXPECT 256
#define U24 0x1000000u

enum { K_NONE, K_WRITE, K_READ_REQ, K_READ_RESP, K_FETCH_ADD, K_ATOMIC_RESP, K_SEND };
enum { P_NONE, P_FIRST, P_MIDDLE, P_LAST, P_ONLY };
enum { R_DATA, R_REQUEST, R_RESPONSE };

typedef struct {
    int ring;                   /* R_DATA: data_for req; R_REQUEST / R_RESPONSE: the ring Head */
    guint32 req, ticket, slot;
    const char *text, *info, *problem;
    kbtp_frame_t *st;           /* R_DATA: the request, which lists its data frames */
} kbtp_label_t;

typedef struct {
    guint32 req;
    const char *name;
    int kind;                   /* K_WRITE or K_READ_REQ: what the target does with the buffer */
    guint32 stag;
    guint64 lo, hi;             /* lo <= TO < hi */
    kbtp_frame_t *st;           /* the request's state */
    kbtp_label_t *labels[K_READ_RESP + 1];
} kbtp_expect_t;

typedef struct {
    guint32 req, next;
    kbtp_label_t *label;
} kbtp_cur_t;

typedef struct kbtp_rdma {
    gboolean roce;
    wmem_list_t *xfers, *sinks;
    wmem_map_t *reads;          /* READ REQUEST PSN -> kbtp_expect_t */
    wmem_map_t *cur;            /* stream -> kbtp_cur_t */
    wmem_map_t *atomics;        /* PSN or request id -> frame of the FetchAdd */
    gboolean ring;
    guint32 ring_stag, ring_count, ring_n, ring_frame;
    guint64 ring_offset;
} kbtp_rdma_t;

typedef struct {
    kbtp_rdma_t *r;
    gboolean to_ini;
} kbtp_flow_t;

typedef struct {
    int t_roce;
    int kind, pos;
    gboolean last;
    guint32 psn, qp, stag, sink_stag, size, id;
    guint64 to, sink_to, add, mask, orig;
    guint off, len;             /* K_SEND: the KBTP message in the frame */
    int send_op;
    guint64 send_rid;
} kbtp_op_t;

typedef struct {
    guint off, len;
    kbtp_frame_t *st;
} kbtp_extra_t;

static wmem_map_t *kbtp_flows;  /* "src|dst" -> kbtp_flow_t */
static gboolean armed, armed_roce, armed_iwarp;
static guint32 claimed;         /* the last RoCEv2 frame that carried a KBTP message */
/* iWARP, this frame: the KBTP messages the heuristics decoded (opcode, Request ID). */
static guint32 sends_frame;
static guint sends_count;
static struct { int op; guint64 rid; gboolean used; } sends[16];

static void rdma_init(void)
{
    armed = armed_roce = armed_iwarp = FALSE;
    claimed = 0;
    sends_frame = 0;
    sends_count = 0;
}

static void push(wmem_list_t *list, kbtp_expect_t *e)
{
    wmem_list_append(list, e);
    if (wmem_list_count(list) > KBTP_MAX_EXPECT)
        wmem_list_remove_frame(list, wmem_list_head(list));
}

static void drop_request(wmem_list_t *list, guint32 req)
{
    wmem_list_frame_t *f = wmem_list_head(list);
    while (f) {
        wmem_list_frame_t *next = wmem_list_frame_next(f);
        if (((kbtp_expect_t *)wmem_list_frame_data(f))->req == req)
            wmem_list_remove_frame(list, f);
        f = next;
    }
}

/* Newest first: a later request may reuse a buffer. kind K_NONE: any. */
static kbtp_expect_t *find(wmem_list_t *list, guint32 stag, guint64 to, int kind)
{
    for (wmem_list_frame_t *f = wmem_list_tail(list); f; f = wmem_list_frame_prev(f)) {
        kbtp_expect_t *e = (kbtp_expect_t *)wmem_list_frame_data(f);
        if ((kind == K_NONE || e->kind == kind) && e->stag == stag && e->lo <= to && to < e->hi)
            return e;
    }
    return NULL;
}

static kbtp_expect_t *expectation(guint32 req, const char *name, guint32 stag, guint64 lo, guint64 len,
                                  kbtp_frame_t *st)
{
    kbtp_expect_t *e = wmem_new0(wmem_file_scope(), kbtp_expect_t);
    e->req = req;
    e->st = st;
    e->name = name;
    e->stag = stag;
    e->lo = lo;
    e->hi = lo + len;
    if (e->hi < lo)
        e->hi = G_MAXUINT64;    /* wrapped: to the top */
    return e;
}

static guint32 log2_ceil(guint32 count)
{
    guint32 n = 0;
    while (((guint64)1 << n) < count)
        n++;
    return n;
}

static guint64 ring_mask(guint32 n)
{
    return ((guint64)1 << (n + KBTP_RING_MASK_N_OFFSET)) | KBTP_RING_MASK_BITS;
}

/* ---- what KBTP messages announce (first pass, from track()) ----------------------------- */
static const char *flow_key(packet_info *pinfo, gboolean roce, gboolean reverse)
{
    const char *s = roce ? address_to_str(pinfo->pool, &pinfo->src) : endpoint(pinfo, &pinfo->src, pinfo->srcport);
    const char *d = roce ? address_to_str(pinfo->pool, &pinfo->dst) : endpoint(pinfo, &pinfo->dst, pinfo->destport);
    return reverse ? wmem_strdup_printf(pinfo->pool, "%s|%s", d, s) : wmem_strdup_printf(pinfo->pool, "%s|%s", s, d);
}

static kbtp_rdma_t *rdma_state(kbtp_conn_t *conn, packet_info *pinfo, gboolean from_initiator)
{
    if (!conn->rdma) {
        kbtp_rdma_t *r = wmem_new0(wmem_file_scope(), kbtp_rdma_t);
        r->roce = conn->roce;
        r->xfers = wmem_list_new(wmem_file_scope());
        r->sinks = wmem_list_new(wmem_file_scope());
        r->reads = wmem_map_new(wmem_file_scope(), g_direct_hash, g_direct_equal);
        r->cur = wmem_map_new(wmem_file_scope(), g_direct_hash, g_direct_equal);
        r->atomics = wmem_map_new(wmem_file_scope(), g_direct_hash, g_direct_equal);
        conn->rdma = r;
        kbtp_flow_t *out = wmem_new(wmem_file_scope(), kbtp_flow_t);
        kbtp_flow_t *back = wmem_new(wmem_file_scope(), kbtp_flow_t);
        out->r = back->r = r;
        out->to_ini = FALSE;
        back->to_ini = TRUE;
        /* initiator -> target is "out" */
        wmem_map_insert(kbtp_flows, wmem_strdup(wmem_file_scope(), flow_key(pinfo, r->roce, !from_initiator)), out);
        wmem_map_insert(kbtp_flows, wmem_strdup(wmem_file_scope(), flow_key(pinfo, r->roce, from_initiator)), back);
    }
    return conn->rdma;
}

static kbtp_rdma_t *arm(kbtp_rdma_t *r)
{
    armed = TRUE;
    if (r->roce)
        armed_roce = TRUE;
    else
        armed_iwarp = TRUE;
    return r;
}

static void note_send(packet_info *pinfo, kbtp_conn_t *conn, const kbtp_frame_t *st, const kbtp_ctx_t *ctx)
{
    if (st->more)
        return;
    int op = (int)ctx->v[V_OPCODE];
    gboolean from_initiator = op != KBTP_OP_COMPLETION && op != KBTP_OP_HELLO_ACK;
    kbtp_rdma_t *r = conn->rdma ? conn->rdma : rdma_state(conn, pinfo, from_initiator);
    if (r->roce)
        return;
    arm(r);
    if (sends_frame != pinfo->num) {
        sends_frame = pinfo->num;
        sends_count = 0;
    }
    if (sends_count < G_N_ELEMENTS(sends)) {
        sends[sends_count].op = op;
        sends[sends_count].rid = ctx->v[V_REQUEST_ID];
        sends[sends_count].used = FALSE;
        sends_count++;
    }
}

/* Remove from ``map`` every entry whose value ``of_req`` says belongs to request ``req``. */
static void drop_entries(wmem_map_t *map, guint32 req, guint32 (*of_req)(gconstpointer))
{
    wmem_list_t *keys = wmem_map_get_keys(NULL, map);
    for (wmem_list_frame_t *f = wmem_list_head(keys); f; f = wmem_list_frame_next(f)) {
        gpointer k = wmem_list_frame_data(f);
        if (of_req(wmem_map_lookup(map, k)) == req)
            wmem_map_remove(map, k);
    }
    wmem_destroy_list(keys);
}

static guint32 expect_req(gconstpointer e)
{
    return ((const kbtp_expect_t *)e)->req;
}

static guint32 cur_req(gconstpointer c)
{
    return ((const kbtp_cur_t *)c)->req;
}

static void rdma_on_message(packet_info *pinfo, kbtp_conn_t *conn, kbtp_frame_t *st, const kbtp_ctx_t *ctx,
                            const kbtp_msg_t *msg)
{
    int op = (int)ctx->v[V_OPCODE];
    if (conn->roce)
        claimed = pinfo->num;
    else
        note_send(pinfo, conn, st, ctx);
    if (op == KBTP_OP_LOAD || op == KBTP_OP_STORE || op == KBTP_OP_ALLOC_STORE) {
        if (ctx->v[V_FLAGS] & KBTP_FLAG_REQUEST_FLAGS_INLINE)
            return;
        if (!ctx->has[V_DD_STAG] || !ctx->has[V_DD_OFFSET] || !ctx->has[V_DD_LENGTH] || ctx->v[V_DD_LENGTH] == 0)
            return;
        kbtp_rdma_t *r = arm(rdma_state(conn, pinfo, TRUE));
        kbtp_expect_t *e = expectation(pinfo->num, msg->name, (guint32)ctx->v[V_DD_STAG], ctx->v[V_DD_OFFSET],
                                       ctx->v[V_DD_LENGTH], st);
        e->kind = op == KBTP_OP_LOAD ? K_WRITE : K_READ_REQ;
        push(r->xfers, e);
    } else if (op == KBTP_OP_HELLO_ACK && ctx->v[V_STATUS] == KBTP_STATUS_OK) {
        guint64 feats = ctx->has[V_HELLO_ACK_FEATURES] ? ctx->v[V_HELLO_ACK_FEATURES] : 0;
        if (!(feats & KBTP_FEATURE_DIRECT_ALLOC) || !ctx->has[V_HELLO_ACK_HEAD_STAG])
            return;
        kbtp_rdma_t *r = arm(rdma_state(conn, pinfo, FALSE));
        r->ring = TRUE;
        r->ring_stag = (guint32)ctx->v[V_HELLO_ACK_HEAD_STAG];
        r->ring_offset = ctx->v[V_HELLO_ACK_HEAD_OFFSET];
        r->ring_count = ctx->has[V_HELLO_ACK_RING_COUNT] ? (guint32)ctx->v[V_HELLO_ACK_RING_COUNT] : 0;
        r->ring_n = log2_ceil(r->ring_count);
        r->ring_frame = pinfo->num;
    } else if (op == KBTP_OP_COMPLETION && st->request_in && conn->rdma) {
        /* The request is over, and its transfers with it (RFC 5040 s5.5, rule 5). */
        kbtp_rdma_t *r = conn->rdma;
        guint32 req = st->request_in;
        drop_request(r->xfers, req);
        drop_request(r->sinks, req);
        drop_entries(r->reads, req, expect_req);
        drop_entries(r->cur, req, cur_req);
    }
}

/* ---- reading RDMA headers ------------------------------------------------------------------ */
static const int RC_WRITE[32] = { [0x06] = P_FIRST, [0x07] = P_MIDDLE, [0x08] = P_LAST, [0x09] = P_LAST,
                                  [0x0a] = P_ONLY, [0x0b] = P_ONLY };
static const int RC_READ_RESPONSE[32] = { [0x0d] = P_FIRST, [0x0e] = P_MIDDLE, [0x0f] = P_LAST, [0x10] = P_ONLY };

/* Extension header octets after the BTH, per service: RC 0, XRC 4 (XRCETH); -1 others. */
static int service_ext(int service)
{
    return service == 0x00 ? 0 : service == 0xa0 ? 4 : -1;
}

static gboolean roce_interesting(int opcode)
{
    int service = opcode & 0xe0, op = opcode & 0x1f;
    if (service == 0x20)        /* UC carries RDMA Writes too */
        return RC_WRITE[op] != P_NONE;
    return service_ext(service) >= 0
        && (RC_WRITE[op] != P_NONE || RC_READ_RESPONSE[op] != P_NONE || op == 0x0c || op == 0x12 || op == 0x14);
}

/* The BTH at ``b`` of ``tvb`` and what follows it. */
static gboolean read_bth(tvbuff_t *tvb, guint b, kbtp_op_t *o)
{
    gint remaining = tvb_captured_length_remaining(tvb, b);   /* -1 past the end */
    if (remaining < 12)
        return FALSE;
    guint have = (guint)remaining;
    int opcode = tvb_get_guint8(tvb, b);
    int service = opcode & 0xe0, op = opcode & 0x1f;
    int ext = service_ext(service);
    guint h = b + 12 + (guint)(ext > 0 ? ext : 0);
    memset(o, 0, sizeof *o);
    o->t_roce = TRUE;
    o->psn = tvb_get_ntohl(tvb, b + 8) % U24;
    o->qp = tvb_get_ntohl(tvb, b + 4) % U24;
    have += b;                  /* end */
    if (RC_WRITE[op]) {
        o->kind = K_WRITE;
        o->pos = RC_WRITE[op];
        if (o->pos == P_FIRST || o->pos == P_ONLY) {   /* RETH: VA, R_Key, DMA Length */
            if (have < h + 16)
                return FALSE;
            o->to = tvb_get_ntoh64(tvb, h);
            o->stag = tvb_get_ntohl(tvb, h + 8);
        }
        return TRUE;
    }
    if (RC_READ_RESPONSE[op]) {
        o->kind = K_READ_RESP;
        o->pos = RC_READ_RESPONSE[op];
    } else if (op == 0x0c) {    /* RDMA READ Request: RETH */
        if (have < h + 16)
            return FALSE;
        o->kind = K_READ_REQ;
        o->to = tvb_get_ntoh64(tvb, h);
        o->stag = tvb_get_ntohl(tvb, h + 8);
    } else if (op == 0x14) {    /* FETCH ADD: AtomicETH = VA, R_Key, Add Data, Compare Data */
        if (have < h + 28)
            return FALSE;
        o->kind = K_FETCH_ADD;
        o->to = tvb_get_ntoh64(tvb, h);
        o->stag = tvb_get_ntohl(tvb, h + 8);
        o->add = tvb_get_ntoh64(tvb, h + 12);
    } else if (op == 0x12) {    /* ATOMIC ACKNOWLEDGE: AETH, Original Remote Data */
        if (have < h + 12)
            return FALSE;
        o->kind = K_ATOMIC_RESP;
        o->orig = tvb_get_ntoh64(tvb, h + 4);
    } else {
        return FALSE;
    }
    return TRUE;
}

static gboolean iw_interesting(int op)
{
    return op == 0x0 || op == 0x1 || op == 0x2 || op == 0xa || op == 0xb;
}

static gboolean iw_send(int op)
{
    return op >= 0x3 && op <= 0x6;
}

/* iWARP: DDP (RFC 5041 s4) and RDMAP (RFC 5040 s4, RFC 7306 s5), the DDP header at ``d``. */
static gboolean read_ddp(tvbuff_t *tvb, guint d, kbtp_op_t *o)
{
    gint remaining = tvb_captured_length_remaining(tvb, d);   /* -1 past the end */
    if (remaining < 14)
        return FALSE;
    guint have = (guint)remaining;
    int ctrl = tvb_get_guint8(tvb, d), rctrl = tvb_get_guint8(tvb, d + 1);
    if ((ctrl & 0x3f) != 0x01 || (rctrl & 0xf0) != 0x40)
        return FALSE;
    int op = rctrl & 0x0f;
    memset(o, 0, sizeof *o);
    o->last = (ctrl & 0x40) != 0;
    if (ctrl & 0x80) {          /* tagged: STag, TO */
        if (op == 0x0)
            o->kind = K_WRITE;
        else if (op == 0x2)
            o->kind = K_READ_RESP;
        else
            return FALSE;
        o->stag = tvb_get_ntohl(tvb, d + 2);
        o->to = tvb_get_ntoh64(tvb, d + 6);
        return TRUE;
    }
    guint body = op == 0x1 ? 28 : op == 0xa ? 52 : op == 0xb ? 12 : 0;
    if (!body || have < 18 + body)
        return FALSE;
    guint p = d + 18;
    if (op == 0x1) {            /* Read Request: sink STag, sink TO, size, source STag, source TO */
        o->kind = K_READ_REQ;
        o->sink_stag = tvb_get_ntohl(tvb, p);
        o->sink_to = tvb_get_ntoh64(tvb, p + 4);
        o->size = tvb_get_ntohl(tvb, p + 12);
        o->stag = tvb_get_ntohl(tvb, p + 16);
        o->to = tvb_get_ntoh64(tvb, p + 20);
    } else if (op == 0xa) {     /* Atomic Request: FetchAdd only */
        if (tvb_get_guint8(tvb, p + 3) & 0x0f)
            return FALSE;
        o->kind = K_FETCH_ADD;
        o->id = tvb_get_ntohl(tvb, p + 4);
        o->stag = tvb_get_ntohl(tvb, p + 8);
        o->to = tvb_get_ntoh64(tvb, p + 12);
        o->add = tvb_get_ntoh64(tvb, p + 20);
        o->mask = tvb_get_ntoh64(tvb, p + 28);
    } else {                    /* Atomic Response: original request id, original remote data */
        o->kind = K_ATOMIC_RESP;
        o->id = tvb_get_ntohl(tvb, p);
        o->orig = tvb_get_ntoh64(tvb, p + 4);
    }
    return TRUE;
}

/* A whole KBTP message in one Send FPDU of the frame: its DDP header at ``d``, after the
 * MPA ULPDU Length. Only a Send in one DDP segment (Last, MO 0). */
static gboolean send_of(tvbuff_t *tvb, guint d, kbtp_op_t *o)
{
    guint len = tvb_captured_length(tvb);
    if (d < 2 || d + 18 + KBTP_HEADER_SIZE > len)
        return FALSE;
    guint ulen = tvb_get_ntohs(tvb, d - 2);
    int ctrl = tvb_get_guint8(tvb, d), rctrl = tvb_get_guint8(tvb, d + 1);
    if (ctrl != 0x41 || (rctrl & 0xf0) != 0x40 || tvb_get_ntohl(tvb, d + 14) != 0)
        return FALSE;
    if (ulen < 18 + KBTP_HEADER_SIZE || d + ulen > len)
        return FALSE;
    memset(o, 0, sizeof *o);
    o->kind = K_SEND;
    o->off = d + 18;
    o->len = ulen - 18;
    o->send_op = tvb_get_guint8(tvb, o->off + KBTP_AT_OPCODE);
    o->send_rid = tvb_get_ntoh64(tvb, o->off + KBTP_AT_REQUEST_ID);
    return TRUE;
}

/* The operations of this frame, from the RDMA header fields: their number; *roce says the
 * binding. -1 when no field answered. */
static int ops_of(packet_info *pinfo, tvbuff_t *tvb, proto_tree *tree, kbtp_op_t *ops, int max, gboolean *roce)
{
    (void)pinfo;
    GPtrArray *fis = armed_roce ? proto_get_finfo_ptr_array(tree, hf_bth_opcode) : NULL;
    if (fis && fis->len) {
        field_info *fi = (field_info *)g_ptr_array_index(fis, fis->len - 1);
        *roce = TRUE;
        if (!roce_interesting((int)fvalue_get_uinteger(&fi->value)))
            return 0;
        return read_bth(fi->ds_tvb, (guint)fi->start, &ops[0]) ? 1 : 0;
    }
    if (!armed_iwarp)
        return -1;
    fis = proto_get_finfo_ptr_array(tree, hf_iwarp_rdma_opcode);
    if (!fis || !fis->len)
        return -1;
    *roce = FALSE;
    if (fis->len == 1) {        /* one FPDU, the usual case */
        field_info *fi = (field_info *)g_ptr_array_index(fis, 0);
        if (!iw_interesting((int)fvalue_get_uinteger(&fi->value)))
            return 0;
        return fi->start > 0 && read_ddp(fi->ds_tvb, (guint)fi->start - 1, &ops[0]) ? 1 : 0;
    }
    int n = 0;
    guint seen_off[64];
    tvbuff_t *seen_tvb[64];
    int n_seen = 0;
    for (guint i = 0; i < fis->len && n < max; i++) {
        field_info *fi = (field_info *)g_ptr_array_index(fis, i);
        int v = (int)fvalue_get_uinteger(&fi->value);
        if (!iw_interesting(v) && !iw_send(v))
            continue;
        if (fi->start < 1)
            continue;
        guint off = (guint)fi->start - 1;
        gboolean dup = FALSE;   /* fields added twice name one FPDU */
        for (int j = 0; j < n_seen; j++)
            dup = dup || (seen_off[j] == off && seen_tvb[j] == fi->ds_tvb);
        if (dup)
            continue;
        if (n_seen < 64) {
            seen_off[n_seen] = off;
            seen_tvb[n_seen++] = fi->ds_tvb;
        }
        if (iw_interesting(v)) {
            if (read_ddp(fi->ds_tvb, off, &ops[n]))
                n++;
        } else if (tvb_captured_length(fi->ds_tvb) == tvb_captured_length(tvb)) {
            if (send_of(tvb, off, &ops[n]))  /* in the frame itself, not reassembled */
                n++;
        }
    }
    return n;
}

/* ---- matching (first pass) ------------------------------------------------------------------ */
static const char *what(int kind)
{
    return kind == K_WRITE ? "RDMA Write" : kind == K_READ_REQ ? "RDMA Read Request" : "RDMA Read Response";
}

static kbtp_label_t *data_label(kbtp_expect_t *e, int kind)
{
    if (!e->labels[kind]) {
        kbtp_label_t *m = wmem_new0(wmem_file_scope(), kbtp_label_t);
        m->ring = R_DATA;
        m->req = e->req;
        m->st = e->st;
        m->text = wmem_strdup_printf(wmem_file_scope(), ", %s for %s in frame %u", what(kind), e->name, e->req);
        m->info = wmem_strdup_printf(wmem_file_scope(), "KBTP data for %u", e->req);
        e->labels[kind] = m;
    }
    return e->labels[kind];
}

static kbtp_label_t *match_roce(kbtp_rdma_t *r, const kbtp_op_t *o, gboolean to_ini)
{
    if (o->kind == K_WRITE || o->kind == K_READ_RESP) {
        /* Within a connection the destination QP and the direction name the stream. */
        guint32 ck = o->qp + (to_ini ? U24 : 0) + (o->kind == K_WRITE ? 0 : 2 * U24);
        gpointer key = GUINT_TO_POINTER(ck);
        if (o->pos == P_FIRST || o->pos == P_ONLY) {
            kbtp_expect_t *e = NULL;
            if (o->kind == K_WRITE) {
                e = to_ini ? find(r->xfers, o->stag, o->to, K_WRITE) : NULL;
            } else if (!to_ini) {       /* responses leave the initiator */
                e = (kbtp_expect_t *)wmem_map_remove(r->reads, GUINT_TO_POINTER(o->psn + 1));
            }
            if (!e) {
                wmem_map_remove(r->cur, key);
                return NULL;
            }
            kbtp_label_t *m = data_label(e, o->kind);
            if (o->pos == P_FIRST) {
                kbtp_cur_t *c = wmem_new(wmem_file_scope(), kbtp_cur_t);
                c->req = e->req;
                c->label = m;
                c->next = (o->psn + 1) % U24;
                wmem_map_insert(r->cur, key, c);
            } else {
                wmem_map_remove(r->cur, key);
            }
            return m;
        }
        kbtp_cur_t *c = (kbtp_cur_t *)wmem_map_lookup(r->cur, key);
        if (!c)
            return NULL;
        if (c->next != o->psn || o->pos == P_LAST)
            wmem_map_remove(r->cur, key);
        if (c->next != o->psn)
            return NULL;
        c->next = (o->psn + 1) % U24;
        return c->label;
    } else if (o->kind == K_READ_REQ) {
        kbtp_expect_t *e = to_ini ? find(r->xfers, o->stag, o->to, K_READ_REQ) : NULL;
        if (!e)
            return NULL;
        /* The responses come back from the initiator, numbered from the request's PSN
         * (kept + 1: PSN 0 is a key too). */
        wmem_map_insert(r->reads, GUINT_TO_POINTER(o->psn + 1), e);
        return data_label(e, K_READ_REQ);
    }
    return NULL;
}

static kbtp_label_t *match_iwarp(kbtp_rdma_t *r, const kbtp_op_t *o, gboolean to_ini)
{
    if (o->kind == K_WRITE) {
        kbtp_expect_t *e = to_ini ? find(r->xfers, o->stag, o->to, K_WRITE) : NULL;
        return e ? data_label(e, K_WRITE) : NULL;
    } else if (o->kind == K_READ_REQ) {
        kbtp_expect_t *e = to_ini ? find(r->xfers, o->stag, o->to, K_READ_REQ) : NULL;
        if (!e)
            return NULL;
        /* The Read Response is tagged with the request's sink STag and TO. */
        push(r->sinks, expectation(e->req, e->name, o->sink_stag, o->sink_to, o->size, e->st));
        return data_label(e, K_READ_REQ);
    } else if (o->kind == K_READ_RESP && !to_ini) {
        kbtp_expect_t *e = find(r->sinks, o->stag, o->to, K_NONE);
        if (!e)
            return NULL;
        kbtp_label_t *m = data_label(e, K_READ_RESP);
        if (o->last)
            drop_request(r->sinks, e->req);
        return m;
    }
    return NULL;
}

static kbtp_label_t *match_ring(kbtp_rdma_t *r, const kbtp_op_t *o, gboolean to_ini, guint32 number)
{
    if (!r->ring)
        return NULL;
    gboolean masked = !o->t_roce;
    if (o->kind == K_FETCH_ADD) {
        if (to_ini || o->stag != r->ring_stag || o->to != r->ring_offset)
            return NULL;
        wmem_map_insert(r->atomics, GUINT_TO_POINTER((masked ? o->id : o->psn) + 1), GUINT_TO_POINTER(number));
        guint64 want = masked ? KBTP_RING_MASKED_ADD : KBTP_RING_UNMASKED_ADD;
        guint64 mask = masked ? ring_mask(r->ring_n) : 0;
        kbtp_label_t *m = wmem_new0(wmem_file_scope(), kbtp_label_t);
        m->ring = R_REQUEST;
        m->text = wmem_strdup_printf(wmem_file_scope(), ", FetchAdd on the ring Head of the HELLO_ACK in frame %u",
                                     r->ring_frame);
        m->info = "KBTP ring Head FetchAdd";
        if (o->add != want || (masked && o->mask != mask)) {
            if (masked)
                m->problem = wmem_strdup_printf(wmem_file_scope(),
                    "Add Data 0x%016" PRIx64 ", Add Mask 0x%016" PRIx64 "; a ring counter takes Add Data 0x%016" PRIx64
                    ", Add Mask 0x%016" PRIx64 " (N = %u)", o->add, o->mask, want, mask, r->ring_count);
            else
                m->problem = wmem_strdup_printf(wmem_file_scope(),
                    "Add Data 0x%016" PRIx64 "; a ring counter takes Add Data 0x%016" PRIx64 " (N = %u)",
                    o->add, want, r->ring_count);
            m->info = "KBTP ring Head FetchAdd: wrong Add Data or Add Mask";
        }
        return m;
    } else if (o->kind == K_ATOMIC_RESP) {
        gpointer k = GUINT_TO_POINTER((masked ? o->id : o->psn) + 1);
        guint32 req = GPOINTER_TO_UINT(wmem_map_lookup(r->atomics, k));
        if (!req || !to_ini)
            return NULL;
        wmem_map_remove(r->atomics, k);
        /* Ticket in bits 63-32; the Slot Offset in the low n+4 bits when masked, else
         * 16 * (ticket mod N) (kbtp-draft, InfiniBand and RoCEv2). */
        guint32 ticket = (guint32)(o->orig >> KBTP_RING_TICKET_SHIFT);
        guint32 slot = masked ? (guint32)(o->orig & (((guint64)1 << (r->ring_n + 4)) - 1))
                              : (guint32)(KBTP_RING_SLOT_SIZE * (ticket % ((guint64)1 << r->ring_n)));
        kbtp_label_t *m = wmem_new0(wmem_file_scope(), kbtp_label_t);
        m->ring = R_RESPONSE;
        m->req = req;
        m->ticket = ticket;
        m->slot = slot;
        m->text = wmem_strdup_printf(wmem_file_scope(), ", ring Head FetchAdd of frame %u: Ticket %u, Slot Offset %u",
                                     req, ticket, slot);
        m->info = wmem_strdup_printf(wmem_file_scope(), "KBTP ticket=%u slot=%u", ticket, slot);
        return m;
    }
    return NULL;
}

static kbtp_label_t *label(kbtp_flow_t *flow, const kbtp_op_t *o, guint32 number)
{
    if (o->kind == K_FETCH_ADD || o->kind == K_ATOMIC_RESP)
        return match_ring(flow->r, o, flow->to_ini, number);
    return o->t_roce ? match_roce(flow->r, o, flow->to_ini) : match_iwarp(flow->r, o, flow->to_ini);
}

/* ---- showing ------------------------------------------------------------------------------ */
static const char *show_one(const kbtp_label_t *m, tvbuff_t *tvb, packet_info *pinfo, proto_tree *tree)
{
    proto_item *item = proto_tree_add_protocol_format(tree, proto_kbtp, tvb, 0, 0,
                                                      "KV Cache Block Transfer Protocol%s", m->text);
    proto_tree *t = proto_item_add_subtree(item, ett_kbtp);
    if (m->ring == R_RESPONSE) {
        proto_item_set_generated(proto_tree_add_uint(t, hf_kbtp_ring_ticket, tvb, 0, 0, m->ticket));
        proto_item_set_generated(proto_tree_add_uint(t, hf_kbtp_ring_slot_offset, tvb, 0, 0, m->slot));
    } else if (m->ring == R_DATA) {
        proto_item_set_generated(proto_tree_add_uint(t, hf_kbtp_data_for, tvb, 0, 0, m->req));
    } else if (m->problem) {
        expert_add_info_format(pinfo, item, &ei_kbtp_ring, "%s", m->problem);
    }
    return m->info;
}

/* A hidden kbtp_rdma item tells these frames from those carrying KBTP messages. */
static void show_marks(wmem_array_t *marks, tvbuff_t *tvb, packet_info *pinfo, proto_tree *tree)
{
    proto_item_set_hidden(proto_tree_add_item(tree, proto_kbtp_rdma, tvb, 0, 0, ENC_NA));
    wmem_strbuf_t *info = wmem_strbuf_new(pinfo->pool, "");
    for (guint i = 0; i < wmem_array_get_count(marks); i++) {
        if (i)
            wmem_strbuf_append(info, "; ");
        wmem_strbuf_append(info, show_one(*(kbtp_label_t **)wmem_array_index(marks, i), tvb, pinfo, tree));
    }
    col_append_fstr(pinfo->cinfo, COL_INFO, " [%s]", wmem_strbuf_get_str(info));
}

/* The second Send of a segment (iWARP): decoded here with dissect_more. */
static const char *dissect_more(tvbuff_t *tvb, packet_info *pinfo, proto_tree *tree, kbtp_frame_t *st)
{
    guint n = tvb_captured_length(tvb);
    if (!PINFO_FD_VISITED(pinfo)) {
        const char *key = iwarp_key(pinfo);
        if (!recognise(pinfo, tvb, n, (kbtp_conn_t *)wmem_map_lookup(kbtp_conns, key)))
            return NULL;
        st->kbtp = TRUE;
        st->key = wmem_strdup(wmem_file_scope(), key);
    } else if (!st->kbtp) {
        return NULL;
    }
    return dissect_message(tvb, n, pinfo, tree, st);
}

static void show_more(wmem_array_t *extras, tvbuff_t *tvb, packet_info *pinfo, proto_tree *tree)
{
    kbtp_frame_t *st = (kbtp_frame_t *)p_get_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 0);
    wmem_strbuf_t *info = wmem_strbuf_new(pinfo->pool, st && st->info ? st->info : "");
    guint kept = 0;
    for (guint i = 0; i < wmem_array_get_count(extras); i++) {
        kbtp_extra_t *e = (kbtp_extra_t *)wmem_array_index(extras, i);
        const char *more = dissect_more(tvb_new_subset_length(tvb, e->off, e->len), pinfo, tree, e->st);
        if (more) {
            wmem_strbuf_append_printf(info, "%s%s", wmem_strbuf_get_len(info) ? "; " : "", more);
            kept++;
        }
    }
    if (kept)
        set_columns(pinfo, wmem_strbuf_get_str(info));
}

static int dissect_kbtp_rdma(tvbuff_t *tvb, packet_info *pinfo, proto_tree *tree, void *data)
{
    (void)data;
    if (!armed)
        return 0;               /* no KBTP session expecting RDMA: nothing marked either */
    guint32 n = pinfo->num;
    if (claimed == n)
        return 0;               /* a RoCEv2 frame that carried a KBTP message */
    if (PINFO_FD_VISITED(pinfo)) {
        wmem_array_t *extras = (wmem_array_t *)p_get_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 2);
        if (extras)
            show_more(extras, tvb, pinfo, tree);
        wmem_array_t *marks = (wmem_array_t *)p_get_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 1);
        if (marks)
            show_marks(marks, tvb, pinfo, tree);
        return 0;
    }
    kbtp_op_t ops[16];
    gboolean roce = FALSE;
    int count = ops_of(pinfo, tvb, tree, ops, G_N_ELEMENTS(ops), &roce);
    gboolean have_sends = sends_frame == n;
    sends_frame = 0;
    if (count <= 0)
        return 0;
    kbtp_flow_t *flow = (kbtp_flow_t *)wmem_map_lookup(kbtp_flows, flow_key(pinfo, roce, FALSE));
    if (!flow)
        return 0;
    wmem_array_t *marks = NULL, *extras = NULL;
    for (int i = 0; i < count; i++) {
        kbtp_op_t *o = &ops[i];
        o->t_roce = roce;
        if (o->kind == K_SEND) {
            gboolean seen = FALSE;  /* decoded by a heuristic already */
            for (guint j = 0; have_sends && j < sends_count && !seen; j++) {
                if (!sends[j].used && sends[j].op == o->send_op && sends[j].rid == o->send_rid) {
                    sends[j].used = TRUE;
                    seen = TRUE;
                }
            }
            if (!seen) {
                if (!extras)
                    extras = wmem_array_new(wmem_file_scope(), sizeof(kbtp_extra_t));
                kbtp_extra_t e = { o->off, o->len, wmem_new0(wmem_file_scope(), kbtp_frame_t) };
                e.st->more = TRUE;
                wmem_array_append_one(extras, e);
            }
            continue;
        }
        kbtp_label_t *m = label(flow, o, n);
        if (m && m->st) {       /* the request lists its data frames, once each */
            wmem_array_t *list = m->st->data_in;
            if (!list)
                list = m->st->data_in = wmem_array_new(wmem_file_scope(), sizeof(guint32));
            guint listed = wmem_array_get_count(list);
            if (!listed || *(guint32 *)wmem_array_index(list, listed - 1) != n)
                wmem_array_append_one(list, n);
        }
        if (m) {
            if (!marks)
                marks = wmem_array_new(wmem_file_scope(), sizeof(kbtp_label_t *));
            wmem_array_append_one(marks, m);
        }
    }
    if (extras) {
        /* Decode (and track) in capture order; keep only what was KBTP. */
        kbtp_frame_t *st = (kbtp_frame_t *)p_get_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 0);
        wmem_strbuf_t *info = wmem_strbuf_new(pinfo->pool, st && st->info ? st->info : "");
        wmem_array_t *kept = wmem_array_new(wmem_file_scope(), sizeof(kbtp_extra_t));
        for (guint i = 0; i < wmem_array_get_count(extras); i++) {
            kbtp_extra_t *e = (kbtp_extra_t *)wmem_array_index(extras, i);
            const char *more = dissect_more(tvb_new_subset_length(tvb, e->off, e->len), pinfo, tree, e->st);
            if (more) {
                wmem_strbuf_append_printf(info, "%s%s", wmem_strbuf_get_len(info) ? "; " : "", more);
                wmem_array_append_one(kept, *e);
            }
        }
        if (wmem_array_get_count(kept)) {
            p_add_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 2, kept);
            set_columns(pinfo, wmem_strbuf_get_str(info));
        }
    }
    if (marks) {
        p_add_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 1, marks);
        show_marks(marks, tvb, pinfo, tree);
    }
    return 0;
}

static void rdma_register(void)
{
    static ei_register_info ei[] = {
        { &ei_kbtp_ring, { "kbtp.expert.ring", PI_PROTOCOL, PI_WARN,
                           "FetchAdd on a ring counter with the wrong Add Data or Add Mask", EXPFILL } },
    };
    expert_module_t *em = expert_register_protocol(proto_kbtp);
    expert_register_field_array(em, ei, array_length(ei));
    proto_kbtp_rdma = proto_register_protocol("KBTP RDMA context (block data and ring counters)", "KBTP_RDMA",
                                              "kbtp_rdma");
    kbtp_flows = wmem_map_new_autoreset(wmem_epan_scope(), wmem_file_scope(), g_str_hash, g_str_equal);
    register_init_routine(rdma_init);
}

static void rdma_handoff(void)
{
    kbtp_rdma_handle = create_dissector_handle(dissect_kbtp_rdma, proto_kbtp_rdma);
    register_postdissector(kbtp_rdma_handle);
    hf_bth_opcode = proto_registrar_get_id_byname("infiniband.bth.opcode");
    hf_iwarp_rdma_opcode = proto_registrar_get_id_byname("iwarp_rdma.opcode");
    GArray *wanted = g_array_new(FALSE, FALSE, (guint)sizeof(int));
    g_array_append_val(wanted, hf_bth_opcode);
    g_array_append_val(wanted, hf_iwarp_rdma_opcode);
    set_postdissector_wanted_hfids(kbtp_rdma_handle, wanted);
}
