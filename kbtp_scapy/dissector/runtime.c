/* Interprets the generated layouts (kbtp_header, kbtp_messages, kbtp_flagsets, kbtp_fmt):
 * recognition, field tree, Info column, expert info, sessions and request/response
 * tracking, RoCEv2 Send reassembly. Holds no layout of its own, and does what
 * runtime.lua does, step for step, so that both forms show the same fields, tree and Info
 * column. Wireshark 4.0.
 */

static int proto_kbtp = -1;
static int kbtp_tap = -1;

static expert_field ei_kbtp_status = EI_INIT;
static expert_field ei_kbtp_malformed = EI_INIT;
static expert_field ei_kbtp_undefined_flags = EI_INIT;
static expert_field ei_kbtp_no_request = EI_INIT;
static expert_field ei_kbtp_credits = EI_INIT;
static expert_field ei_kbtp_icrc = EI_INIT;

/* kbtp.addr_le: byte order of address fields for sessions whose HELLO_ACK is not seen. */
enum { KBTP_ADDR_LE_AUTO = 1, KBTP_ADDR_LE_ON = 2, KBTP_ADDR_LE_OFF = 3 };
static gint kbtp_pref_addr_le = KBTP_ADDR_LE_AUTO;
static gboolean kbtp_pref_check_icrc = TRUE;

/* ---- state: filled only when not visited; file scope ------------------------------------- */
typedef struct kbtp_frame {
    gboolean more;              /* a further Send of an iWARP segment (rdma.c) */
    const char *info;           /* its Info text */
    gboolean kbtp, roce, le, pad_unknown, fragment, broken, unanswered, has_len, has_delta;
    guint len;                  /* octets of the message in this packet (has_len) */
    const char *key;            /* its connection */
    tvbuff_t *message_tvb;      /* a reassembled Send: made on each pass from message */
    guint8 *message;
    guint message_len;
    guint32 request_in, response_in, fragment_in, over_credits;
    double delta;               /* response time, seconds */
    int req_opcode;             /* an answer: its request's opcode, time and this status */
    nstime_t req_ts;
    guint32 status;
    wmem_array_t *data_in;      /* a request: frames of the RDMA transfers of its data (rdma.c) */
    int icrc;                   /* RoCE: ICRC_UNKNOWN, ICRC_OK or ICRC_BAD (first pass) */
    proto_item *root;           /* its kbtp item, while this packet is dissected */
    guint32 icrc_got, icrc_want;
} kbtp_frame_t;

enum { ICRC_UNKNOWN, ICRC_OK, ICRC_BAD };

typedef struct {
    guint32 frame;
    kbtp_frame_t *st;
    double ts;
    nstime_t abs_ts;
    int opcode, answer;
} kbtp_req_t;

struct kbtp_rdma;

typedef struct {
    gboolean kbtp, roce, le_known, le, has_credits;
    struct kbtp_rdma *rdma;     /* what its KBTP messages announced (rdma.c) */
    guint32 credits;
    gint outstanding;
    wmem_map_t *pending;        /* Request ID -> kbtp_req_t */
} kbtp_conn_t;

typedef struct {
    wmem_array_t *data;
    guint mtu, remaining;
    wmem_array_t *frames;       /* kbtp_frame_t * of the fragments so far */
} kbtp_reasm_t;

static wmem_map_t *kbtp_conns;  /* connection key -> kbtp_conn_t */
static wmem_map_t *kbtp_reasm;  /* direction and QP -> kbtp_reasm_t */

static kbtp_conn_t *conn_of(const char *key, gboolean roce)
{
    kbtp_conn_t *c = (kbtp_conn_t *)wmem_map_lookup(kbtp_conns, key);
    if (!c) {
        c = wmem_new0(wmem_file_scope(), kbtp_conn_t);
        c->pending = wmem_map_new(wmem_file_scope(), g_int64_hash, g_int64_equal);
        c->roce = roce;
        wmem_map_insert(kbtp_conns, wmem_strdup(wmem_file_scope(), key), c);
    }
    return c;
}

/* Both directions of a connection share one key. On RoCEv2 without the CM exchange the
 * two directions name different QPs, so the address pair stands for the session. */
static const char *pair_key(packet_info *pinfo, const char *kind, const char *a, const char *b)
{
    if (strcmp(a, b) > 0) {
        const char *t = a;
        a = b;
        b = t;
    }
    return wmem_strdup_printf(pinfo->pool, "%s %s %s", kind, a, b);
}

static const char *endpoint(packet_info *pinfo, const address *addr, guint32 port)
{
    const char *a = address_to_str(pinfo->pool, addr);
    if (port == 0xffffffff)
        return a;
    return wmem_strdup_printf(pinfo->pool, "%s:%u", a, port);
}

static const char *iwarp_key(packet_info *pinfo)
{
    return pair_key(pinfo, "iwarp", endpoint(pinfo, &pinfo->src, pinfo->srcport),
                    endpoint(pinfo, &pinfo->dst, pinfo->destport));
}

typedef struct kbtp_ctx kbtp_ctx_t;
static void rdma_on_message(packet_info *pinfo, kbtp_conn_t *conn, kbtp_frame_t *st, const kbtp_ctx_t *ctx,
                            const kbtp_msg_t *msg);
static void rdma_register(void);
static void rdma_handoff(void);

/* ---- reading a message ------------------------------------------------------------------- */
struct kbtp_ctx {
    tvbuff_t *tvb;
    guint len;
    gboolean le, truncated;
    const kbtp_msg_t *msg;
    const kbtp_item_t *tail;
    guint off;
    guint64 v[V_COUNT];
    guint8 has[V_COUNT];
    guint size[V_COUNT];        /* octets of each value read */
    proto_item *at[V_COUNT];    /* items an expert info may go under */
};

static const kbtp_msg_t *message_of(int opcode)
{
    for (guint i = 0; i < G_N_ELEMENTS(kbtp_messages); i++) {
        if (kbtp_messages[i].opcode == opcode)
            return &kbtp_messages[i];
    }
    return NULL;
}

static gboolean opcode_known(int op)
{
    return message_of(op) != NULL || (op >= KBTP_PRIVATE_LO && op <= KBTP_PRIVATE_HI);
}

static guint64 value_at(tvbuff_t *tvb, guint off, guint size, gboolean le)
{
    const guint enc = le ? ENC_LITTLE_ENDIAN : ENC_BIG_ENDIAN;
    switch (size) {
    case 1: return tvb_get_guint8(tvb, off);
    case 2: return tvb_get_guint16(tvb, off, enc);
    case 4: return tvb_get_guint32(tvb, off, enc);
    case 8: return tvb_get_guint64(tvb, off, enc);
    default: return off;        /* octet strings: where they start */
    }
}

/* The Private Use row of an enumeration ``value`` falls in, or NULL: the value string
 * names only the defined codes, so those values get a label of their own. */
static const range_string *private_range(int vid, guint64 value)
{
    const kbtp_fmt_t *fmt = &kbtp_fmt[vid];
    if (fmt->kind != KBTP_FMT_ENUM)
        return NULL;
    for (const range_string *r = fmt->names; r->strptr; r++) {
        if (r->value_min != r->value_max && value >= r->value_min && value <= r->value_max)
            return r;
    }
    return NULL;
}

static proto_item *add_private(proto_tree *tree, const kbtp_item_t *item, const kbtp_ctx_t *ctx,
                               const range_string *r)
{
    guint32 v = (guint32)ctx->v[item->vid];
    const char *title = proto_registrar_get_name(*item->hf);
    if (kbtp_fmt[item->vid].hex)
        return proto_tree_add_uint_format(tree, *item->hf, ctx->tvb, ctx->off, item->size, v, "%s: %s (0x%0*x)",
                                          title, r->strptr, (int)(2 * item->size), v);
    return proto_tree_add_uint_format(tree, *item->hf, ctx->tvb, ctx->off, item->size, v, "%s: %s (%u)",
                                      title, r->strptr, v);
}

/* Walk ``items`` from ctx->off over the first ctx->len octets; add to ``tree`` when
 * ``build``. Sets ctx->truncated when the message ends before a fixed field does. */
static void walk(const kbtp_item_t *items, guint n, proto_tree *tree, gboolean build, kbtp_ctx_t *ctx)
{
    for (guint i = 0; i < n; i++) {
        const kbtp_item_t *item = &items[i];
        if (item->when_vid >= 0 && !(ctx->has[item->when_vid] && (ctx->v[item->when_vid] & item->when_mask)))
            continue;
        if (item->items) {
            if (ctx->off >= ctx->len) {
                ctx->truncated = TRUE;
                return;
            }
            proto_tree *sub = NULL;
            if (build) {
                proto_item *ti = proto_tree_add_item(tree, *item->hf, ctx->tvb, ctx->off,
                                                     MIN(item->size, ctx->len - ctx->off), ENC_NA);
                sub = proto_item_add_subtree(ti, *item->ett);
            }
            walk(item->items, item->n_items, sub, build, ctx);
            if (ctx->truncated)
                return;
        } else if (item->size == 0) {
            guint rest = ctx->len - ctx->off;
            ctx->v[item->vid] = rest;
            ctx->has[item->vid] = TRUE;
            ctx->tail = item;
            if (build && rest > 0)
                proto_tree_add_item(tree, *item->hf, ctx->tvb, ctx->off, rest, ENC_NA);
            ctx->off = ctx->len;
        } else {
            if (ctx->off + item->size > ctx->len) {
                ctx->truncated = TRUE;
                return;
            }
            gboolean le = ctx->le && item->order == 'A';
            ctx->v[item->vid] = value_at(ctx->tvb, ctx->off, item->size, le);
            ctx->has[item->vid] = TRUE;
            ctx->size[item->vid] = item->size;
            if (build) {
                guint enc = item->size > 8 ? ENC_NA : le ? ENC_LITTLE_ENDIAN : ENC_BIG_ENDIAN;
                const range_string *private = private_range(item->vid, ctx->v[item->vid]);
                proto_item *ti = private
                    ? add_private(tree, item, ctx, private)
                    : proto_tree_add_item(tree, *item->hf, ctx->tvb, ctx->off, item->size, enc);
                if (item->keep)
                    ctx->at[item->vid] = ti;
                int fs = item->flagset == -2 ? (ctx->msg ? ctx->msg->flagset : -1) : item->flagset;
                int * const *bits = fs >= 0 ? kbtp_bit_hfs(item->vid, fs) : NULL;
                if (bits) {
                    proto_tree *bt = proto_item_add_subtree(ti, *kbtp_flag_ett(item->vid));
                    for (; *bits; bits++)
                        proto_tree_add_item(bt, **bits, ctx->tvb, ctx->off, item->size, enc);
                }
            }
            ctx->off += item->size;
        }
    }
}

static void read_message(kbtp_ctx_t *ctx, tvbuff_t *tvb, guint len, const kbtp_msg_t *msg, gboolean le,
                         proto_tree *tree, gboolean build)
{
    memset(ctx, 0, sizeof *ctx);
    ctx->tvb = tvb;
    ctx->len = len;
    ctx->msg = msg;
    ctx->le = le && (msg == NULL || msg->addr_le);
    walk(kbtp_header, G_N_ELEMENTS(kbtp_header), tree, build, ctx);
    if (msg && !ctx->truncated)
        walk(msg->items, msg->n_items, tree, build, ctx);
}

/* What is wrong with the layout a read found, or NULL. */
static const char *problem_of(packet_info *pinfo, const kbtp_ctx_t *ctx)
{
    if (ctx->truncated)
        return wmem_strdup_printf(pinfo->pool, "truncated: %u octets, %s with these flags needs more",
                                  ctx->len, ctx->msg->name);
    if (ctx->tail) {
        int from = ctx->tail->length_from;
        guint64 have = ctx->v[ctx->tail->vid];
        if (!ctx->has[from])
            return wmem_strdup_printf(pinfo->pool, "inline data is %" PRIu64 " octets, the descriptor says nil", have);
        if (ctx->v[from] != have)
            return wmem_strdup_printf(pinfo->pool, "inline data is %" PRIu64 " octets, the descriptor says %" PRIu64,
                                      have, ctx->v[from]);
    } else if (ctx->off < ctx->len) {
        return wmem_strdup_printf(pinfo->pool, "%u octets after the end of %s", ctx->len - ctx->off, ctx->msg->name);
    }
    return NULL;
}

/* Length of the whole message a read found; FALSE when the fixed part is not all there. */
static gboolean declared_of(const kbtp_ctx_t *ctx, guint64 *out)
{
    if (ctx->truncated)
        return FALSE;
    if (ctx->tail) {
        if (!ctx->has[ctx->tail->length_from])
            return FALSE;
        *out = ctx->off - ctx->v[ctx->tail->vid] + ctx->v[ctx->tail->length_from];
        return TRUE;
    }
    *out = ctx->off;
    return TRUE;
}

/* Version 1 and a known or Private Use opcode: the cheap test before any other. */
static int header_ok(tvbuff_t *tvb, guint len)
{
    if (len < KBTP_HEADER_SIZE || tvb_get_guint8(tvb, KBTP_AT_VERSION) != KBTP_VERSION)
        return -1;
    int op = tvb_get_guint8(tvb, KBTP_AT_OPCODE);
    return opcode_known(op) ? op : -1;
}

/* Strict recognition: Version 1, a known or Private Use opcode, and a layout that fits.
 * Inside a conversation already known to carry KBTP, a wrong layout is still claimed. */
static gboolean recognise(packet_info *pinfo, tvbuff_t *tvb, guint len, const kbtp_conn_t *conn)
{
    int op = header_ok(tvb, len);
    if (op < 0)
        return FALSE;
    if (conn && conn->kbtp)
        return TRUE;
    const kbtp_msg_t *msg = message_of(op);
    if (!msg)
        return FALSE;
    kbtp_ctx_t *ctx = wmem_new(pinfo->pool, kbtp_ctx_t);
    read_message(ctx, tvb, len, msg, FALSE, NULL, FALSE);
    return problem_of(pinfo, ctx) == NULL;
}

static gboolean continues(const kbtp_ctx_t *ctx)
{
    return !ctx->truncated && ctx->tail && ctx->has[ctx->tail->length_from]
        && ctx->v[ctx->tail->vid] < ctx->v[ctx->tail->length_from];
}

/* ---- the Info column ----------------------------------------------------------------------- */
static void show(wmem_strbuf_t *out, const kbtp_ctx_t *ctx, int vid)
{
    const kbtp_fmt_t *fmt = &kbtp_fmt[vid];
    guint64 v = ctx->v[vid];
    switch (fmt->kind) {
    case KBTP_FMT_HEX:
        wmem_strbuf_append_printf(out, "0x%" PRIx64, v);
        break;
    case KBTP_FMT_ENUM:
        for (const range_string *r = fmt->names; r->strptr; r++) {
            if (v >= r->value_min && v <= r->value_max) {
                if (r->value_min == r->value_max)
                    wmem_strbuf_append(out, r->strptr);
                else
                    wmem_strbuf_append_printf(out, "%s (0x%" PRIx64 ")", r->strptr, v);
                return;
            }
        }
        wmem_strbuf_append_printf(out, "Unknown (0x%" PRIx64 ")", v);
        break;
    case KBTP_FMT_FLAGS: {
        gboolean any = FALSE;
        for (const kbtp_bit_t *b = kbtp_flagsets[fmt->flagset].bits; b->name; b++) {
            if (v & b->mask) {
                if (any)
                    wmem_strbuf_append_c(out, '+');
                wmem_strbuf_append(out, b->name);
                any = TRUE;
            }
        }
        if (!any)
            wmem_strbuf_append_c(out, '0');
        break;
    }
    case KBTP_FMT_BYTES:        /* a fixed-size octet string: v is where it starts */
        for (guint i = 0; i < ctx->size[vid]; i++)
            wmem_strbuf_append_printf(out, "%02X", tvb_get_guint8(ctx->tvb, (guint)v + i));
        break;
    default:
        wmem_strbuf_append_printf(out, "%" PRIu64, v);
    }
}

static const char *summary(packet_info *pinfo, const kbtp_ctx_t *ctx, const kbtp_msg_t *msg)
{
    wmem_strbuf_t *out = wmem_strbuf_new(pinfo->pool, "");
    if (!msg) {
        show(out, ctx, V_OPCODE);
        wmem_strbuf_append(out, " rid=");
        show(out, ctx, V_REQUEST_ID);
        return wmem_strbuf_get_str(out);
    }
    wmem_strbuf_append(out, msg->name);
    for (const kbtp_pair_t *p = msg->summary; p->label; p++) {
        if (!ctx->has[p->vid])
            continue;
        wmem_strbuf_append_c(out, ' ');
        if (p->label[0]) {
            wmem_strbuf_append(out, p->label);
            wmem_strbuf_append_c(out, '=');
        }
        show(out, ctx, p->vid);
    }
    if (msg->flagset >= 0 && ctx->has[V_FLAGS]) {
        for (const kbtp_bit_t *b = kbtp_flagsets[msg->flagset].bits; b->name; b++) {
            if (ctx->v[V_FLAGS] & b->mask) {
                wmem_strbuf_append_c(out, ' ');
                wmem_strbuf_append(out, b->name);
            }
        }
    }
    return wmem_strbuf_get_str(out);
}

/* ---- tracking (first pass only) ---------------------------------------------------------- */
/* Times as runtime.lua has them: seconds in a double (Lua's pinfo.abs_ts), so that both
 * forms show the same response time to the nanosecond. */
static double abs_seconds(const packet_info *pinfo)
{
    return (double)pinfo->abs_ts.secs + (double)pinfo->abs_ts.nsecs / 1000000000.0;
}

static void track(packet_info *pinfo, kbtp_conn_t *conn, kbtp_frame_t *st, const kbtp_msg_t *msg,
                  const kbtp_ctx_t *ctx)
{
    int op = (int)ctx->v[V_OPCODE];
    if (op == KBTP_OP_HELLO_ACK && ctx->has[V_STATUS] && ctx->v[V_STATUS] == KBTP_STATUS_OK) {
        guint64 feats = ctx->has[V_HELLO_ACK_FEATURES] ? ctx->v[V_HELLO_ACK_FEATURES] : 0;
        conn->le_known = TRUE;
        conn->le = (feats & KBTP_FEATURE_ADDR_LE) != 0;
        conn->has_credits = ctx->has[V_HELLO_ACK_REQUEST_CREDITS];
        conn->credits = (guint32)ctx->v[V_HELLO_ACK_REQUEST_CREDITS];
    }
    if (!msg)
        return;
    guint64 rid = ctx->v[V_REQUEST_ID];
    if (msg->answer >= 0) {
        kbtp_req_t *req = wmem_new(wmem_file_scope(), kbtp_req_t);
        req->frame = pinfo->num;
        req->st = st;
        req->ts = abs_seconds(pinfo);
        req->abs_ts = pinfo->abs_ts;
        req->opcode = op;
        req->answer = msg->answer;
        guint64 *k = wmem_new(wmem_file_scope(), guint64);
        *k = rid;
        wmem_map_insert(conn->pending, k, req);
        if (msg->answer == KBTP_OP_COMPLETION) {
            conn->outstanding++;
            if (conn->has_credits && conn->outstanding > (gint)conn->credits)
                st->over_credits = conn->outstanding;
        }
    } else if (op == KBTP_OP_COMPLETION || op == KBTP_OP_HELLO_ACK) {
        kbtp_req_t *req = (kbtp_req_t *)wmem_map_lookup(conn->pending, &rid);
        if (req && req->answer == op) {
            wmem_map_remove(conn->pending, &rid);
            st->request_in = req->frame;
            st->has_delta = TRUE;
            st->delta = abs_seconds(pinfo) - req->ts;
            st->req_opcode = req->opcode;
            st->req_ts = req->abs_ts;
            st->status = (guint32)ctx->v[V_STATUS];
            req->st->response_in = pinfo->num;
            if (op == KBTP_OP_COMPLETION)
                conn->outstanding--;
        } else {
            st->unanswered = TRUE;
        }
    }
    rdma_on_message(pinfo, conn, st, ctx, msg);
}

static proto_item *at_or(const kbtp_ctx_t *ctx, int vid, proto_item *root)
{
    return ctx->at[vid] ? ctx->at[vid] : root;
}

/* Decode one whole KBTP message, the first ``len`` octets of ``tvb``; returns the Info. */
static const char *dissect_message(tvbuff_t *tvb, guint len, packet_info *pinfo, proto_tree *tree,
                                   kbtp_frame_t *st)
{
    kbtp_conn_t *conn = conn_of(st->key, st->roce);
    int op = tvb_get_guint8(tvb, KBTP_AT_OPCODE);
    const kbtp_msg_t *msg = message_of(op);
    gboolean visited = PINFO_FD_VISITED(pinfo);
    if (!visited) {
        conn->kbtp = TRUE;
        st->le = kbtp_pref_addr_le == KBTP_ADDR_LE_ON
            || (kbtp_pref_addr_le == KBTP_ADDR_LE_AUTO && conn->le_known && conn->le);
    }
    proto_item *root = proto_tree_add_item(tree, proto_kbtp, tvb, 0, len, ENC_NA);
    proto_tree *rt = proto_item_add_subtree(root, ett_kbtp);
    kbtp_ctx_t *ctx = wmem_new(pinfo->pool, kbtp_ctx_t);
    read_message(ctx, tvb, len, msg, st->le, rt, TRUE);
    const char *problem = msg ? problem_of(pinfo, ctx) : NULL;
    if (!visited)
        track(pinfo, conn, st, msg, ctx);

    if (st->le)
        proto_item_set_generated(proto_tree_add_boolean(rt, hf_kbtp_session_addr_le, tvb, 0, 0, TRUE));
    if (st->request_in) {
        proto_item_set_generated(proto_tree_add_uint(rt, hf_kbtp_request_in, tvb, 0, 0, st->request_in));
        nstime_t ns;
        double whole = floor(st->delta);
        ns.secs = (time_t)whole;
        ns.nsecs = (int)floor((st->delta - whole) * 1e9 + 0.5);
        proto_item_set_generated(proto_tree_add_time(rt, hf_kbtp_time, tvb, 0, 0, &ns));
    }
    if (st->response_in)
        proto_item_set_generated(proto_tree_add_uint(rt, hf_kbtp_response_in, tvb, 0, 0, st->response_in));
    for (guint i = 0; st->data_in && i < wmem_array_get_count(st->data_in); i++)
        proto_item_set_generated(proto_tree_add_uint(rt, hf_kbtp_data_in, tvb, 0, 0,
                                                     *(guint32 *)wmem_array_index(st->data_in, i)));
    if (st->request_in)
        tap_queue_packet(kbtp_tap, pinfo, st);     /* -z kbtp,srt and Statistics menu */
    if (problem)
        expert_add_info_format(pinfo, root, &ei_kbtp_malformed, "%s", problem);
    if (msg && msg->flagset >= 0 && ctx->has[V_FLAGS]) {
        guint64 extra = ctx->v[V_FLAGS] & ~(guint64)kbtp_flagsets[msg->flagset].defined;
        if (extra)
            expert_add_info_format(pinfo, at_or(ctx, V_FLAGS, root), &ei_kbtp_undefined_flags,
                                   "undefined flag bits 0x%04" PRIx64, extra);
    }
    if ((op == KBTP_OP_COMPLETION || op == KBTP_OP_HELLO_ACK) && ctx->has[V_STATUS]
            && ctx->v[V_STATUS] != KBTP_STATUS_OK) {
        wmem_strbuf_t *s = wmem_strbuf_new(pinfo->pool, "");
        show(s, ctx, V_STATUS);
        expert_add_info_format(pinfo, at_or(ctx, V_STATUS, root), &ei_kbtp_status, "%s", wmem_strbuf_get_str(s));
    }
    if (st->unanswered)
        expert_add_info(pinfo, at_or(ctx, V_REQUEST_ID, root), &ei_kbtp_no_request);
    if (st->over_credits)
        expert_add_info_format(pinfo, at_or(ctx, V_REQUEST_ID, root), &ei_kbtp_credits,
                               "%u requests outstanding, %u credits", st->over_credits, conn->credits);
    const char *info = summary(pinfo, ctx, msg);
    if (problem)
        info = wmem_strconcat(pinfo->pool, info, " [Malformed]", NULL);
    proto_item_append_text(root, ", %s", info);
    st->root = root;
    if (!st->info)
        st->info = wmem_strdup(wmem_file_scope(), info);
    return info;
}

static void set_columns(packet_info *pinfo, const char *info)
{
    col_set_str(pinfo->cinfo, COL_PROTOCOL, "KBTP");
    col_add_str(pinfo->cinfo, COL_INFO, info);
}

/* ---- RoCEv2 / InfiniBand ----------------------------------------------------------------- */
enum { SEND_NONE, SEND_FIRST, SEND_MIDDLE, SEND_LAST, SEND_ONLY, SEND_UNKNOWN };

static int send_kind(int opcode)
{
    switch (opcode) {
    case 0x04: case 0x05: case 0x17: case 0x64: case 0x65: return SEND_ONLY;
    case 0x02: case 0x03: case 0x16: return SEND_LAST;
    default: break;
    }
    if (opcode < 0x40 && (opcode & 0x1f) == 0x00) return SEND_FIRST;
    if (opcode < 0x40 && (opcode & 0x1f) == 0x01) return SEND_MIDDLE;
    return SEND_NONE;
}

static gboolean path_mtu(guint n)
{
    return n == 256 || n == 512 || n == 1024 || n == 2048 || n == 4096;
}

static kbtp_frame_t *frame_state(packet_info *pinfo)
{
    kbtp_frame_t *st = (kbtp_frame_t *)p_get_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 0);
    if (!st) {
        st = wmem_new0(wmem_file_scope(), kbtp_frame_t);
        p_add_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 0, st);
    }
    return st;
}

static kbtp_frame_t *message_state(packet_info *pinfo, const char *key, gboolean roce, gboolean has_len,
                                   guint len, gboolean pad_unknown)
{
    kbtp_frame_t *st = frame_state(pinfo);
    st->kbtp = TRUE;
    st->key = wmem_strdup(wmem_file_scope(), key);
    st->roce = roce;
    st->has_len = has_len;
    st->len = len;
    st->pad_unknown = pad_unknown;
    return st;
}

static void reasm_append(kbtp_reasm_t *r, tvbuff_t *tvb, guint n)
{
    if (n)
        wmem_array_append(r->data, tvb_get_ptr(tvb, 0, n), n);
}

static void fragment(kbtp_reasm_t *r, kbtp_frame_t *st)
{
    wmem_array_append_one(r->frames, st);
}

/* First sight of a RoCEv2 / InfiniBand payload: is it (part of) a KBTP Send? As
 * runtime.lua's classify_roce: FIRST and MIDDLE packets carry exactly one path MTU and no
 * pad; LAST the rest plus the pad to 4 octets; ONLY the whole message plus its pad. */
static kbtp_frame_t *classify_roce(tvbuff_t *tvb, guint n, packet_info *pinfo, const char *key,
                                   const char *src, const char *dst, int kind, int padcnt)
{
    if (kind == SEND_NONE)
        return NULL;
    const char *dir = wmem_strdup_printf(pinfo->pool, "%s>%s/%u", src, dst, pinfo->destport);
    kbtp_reasm_t *r = wmem_map_size(kbtp_reasm) ? (kbtp_reasm_t *)wmem_map_lookup(kbtp_reasm, dir) : NULL;
    if (r) {
        if (kind != SEND_LAST && kind != SEND_ONLY && kind != SEND_FIRST && n == r->mtu && r->remaining > r->mtu) {
            reasm_append(r, tvb, n);
            r->remaining -= n;
            kbtp_frame_t *st = frame_state(pinfo);
            st->fragment = TRUE;
            fragment(r, st);
            return st;
        } else if ((kind == SEND_UNKNOWN || kind == SEND_LAST) && n == r->remaining + ((4 - r->remaining % 4) % 4)) {
            reasm_append(r, tvb, r->remaining);
            wmem_map_remove(kbtp_reasm, dir);
            kbtp_frame_t *st = frame_state(pinfo);
            st->message_len = wmem_array_get_count(r->data);
            st->message = (guint8 *)wmem_memdup(wmem_file_scope(), wmem_array_get_raw(r->data), st->message_len);
            for (guint i = 0; i < wmem_array_get_count(r->frames); i++)
                (*(kbtp_frame_t **)wmem_array_index(r->frames, i))->fragment_in = pinfo->num;
            return st;
        }
        wmem_map_remove(kbtp_reasm, dir);
        /* A Send we claimed the start of goes on, but not as its header said: claim what
         * continues it, until a packet shorter than the path MTU ends it. */
        if (kind == SEND_MIDDLE || kind == SEND_LAST || (kind == SEND_UNKNOWN && header_ok(tvb, n) < 0)) {
            if (n >= r->mtu && kind != SEND_LAST)
                wmem_map_insert(kbtp_reasm, wmem_strdup(wmem_file_scope(), dir), r);
            kbtp_frame_t *st = frame_state(pinfo);
            st->fragment = TRUE;
            st->broken = TRUE;
            return st;
        }
    }
    int op = (kind != SEND_MIDDLE && kind != SEND_LAST) ? header_ok(tvb, n) : -1;
    if (op < 0)
        return NULL;
    kbtp_conn_t *conn = (kbtp_conn_t *)wmem_map_lookup(kbtp_conns, key);
    const kbtp_msg_t *msg = message_of(op);
    gboolean pad_known = kind == SEND_ONLY && padcnt >= 0;
    guint pad = pad_known ? (guint)padcnt : 0;
    if (!pad_known && msg) {
        kbtp_ctx_t *ctx = wmem_new(pinfo->pool, kbtp_ctx_t);
        read_message(ctx, tvb, n, msg, (conn && conn->le_known && conn->le) || kbtp_pref_addr_le == KBTP_ADDR_LE_ON,
                     NULL, FALSE);
        guint64 declared = 0;
        gboolean has = declared_of(ctx, &declared);
        gboolean exact = has && n >= declared && n - declared == (4 - declared % 4) % 4;
        if ((kind == SEND_FIRST || (kind == SEND_UNKNOWN && path_mtu(n)))
                && (continues(ctx) || (conn && conn->kbtp && !exact))) {
            r = wmem_new0(wmem_file_scope(), kbtp_reasm_t);
            r->data = wmem_array_new(wmem_file_scope(), 1);
            r->frames = wmem_array_new(wmem_file_scope(), sizeof(kbtp_frame_t *));
            r->mtu = n;
            r->remaining = has && declared > n ? (guint)(declared - n) : 0;
            reasm_append(r, tvb, n);
            wmem_map_insert(kbtp_reasm, wmem_strdup(wmem_file_scope(), dir), r);
            kbtp_frame_t *st = frame_state(pinfo);
            st->fragment = TRUE;
            fragment(r, st);
            return st;
        }
        if (exact) {
            pad = n - (guint)declared;
            pad_known = TRUE;
        }
    }
    if (kind == SEND_FIRST || pad > n || !recognise(pinfo, tvb, n - pad, conn))
        return NULL;
    return message_state(pinfo, key, TRUE, TRUE, n - pad, !pad_known);
}

/* ---- the ICRC (tshark 4.0 shows infiniband.invariant.crc but never checks it) ----------
 * A packet whose ICRC is wrong is one the receiving NIC dropped. CRC-32 over 8 octets of
 * ones (the absent LRH), the network header with its variant fields set to ones, the UDP
 * header with its checksum set to ones (RoCEv2), the BTH with its reserved octet set to
 * ones, and the rest up to the ICRC (IBA vol. 1, 7.8.1; annexes A16.8.1 and A17.4.5).
 * Read from the frame's own octets: Ethernet (802.1Q, 802.1ad), then IPv4 or IPv6 and
 * UDP KBTP_PORT_ROCEV2, or the RoCEv1 GRH; unknown when the frame is cut short or not that. */
static void check_icrc(packet_info *pinfo, kbtp_frame_t *st)
{
    if (!kbtp_pref_check_icrc)
        return;
    tvbuff_t *frame = get_data_source_tvb((const struct data_source *)pinfo->data_src->data);
    guint len = tvb_captured_length(frame), off = 12, net, bth, end;
    if (len < 14 || tvb_reported_length(frame) != len)
        return;
    guint et = tvb_get_ntohs(frame, off);
    while ((et == 0x8100 || et == 0x88a8) && off + 6 <= len) {
        off += 4;
        et = tvb_get_ntohs(frame, off);
    }
    net = off + 2;
    if (et == 0x0800 && net + 20 <= len) {
        guint ihl = 4 * (tvb_get_guint8(frame, net) & 0x0f);
        if ((tvb_get_guint8(frame, net) >> 4) != 4 || tvb_get_guint8(frame, net + 9) != 17 || ihl < 20)
            return;
        bth = net + ihl + 8;
        end = net + tvb_get_ntohs(frame, net + 2);
    } else if (et == 0x86dd && net + 40 <= len) {
        if (tvb_get_guint8(frame, net + 6) != 17)
            return;
        bth = net + 48;
        end = net + 40 + tvb_get_ntohs(frame, net + 4);
    } else if (et == 0x8915 && net + 40 <= len) {
        bth = net + 40;
        end = net + 40 + tvb_get_ntohs(frame, net + 4);
    } else {
        return;
    }
    if (end > len || end < bth + 16 || (et != 0x8915 && tvb_get_ntohs(frame, bth - 6) != KBTP_PORT_ROCEV2))
        return;
    guint n = end - 4 - net;
    guint8 *buf = (guint8 *)wmem_alloc(pinfo->pool, 8 + n);
    memset(buf, 0xff, 8);
    tvb_memcpy(frame, buf + 8, net, n);
    guint8 *h = buf + 8;
    if (et == 0x0800) {
        h[1] = 0xff;                        /* Type of Service */
        h[8] = 0xff;                        /* Time to Live */
        h[10] = h[11] = 0xff;               /* header checksum */
    } else {                                /* IPv6 or GRH: Traffic Class, Flow Label, Hop Limit */
        h[0] |= 0x0f;
        h[1] = h[2] = h[3] = 0xff;
        h[7] = 0xff;
    }
    if (et != 0x8915)
        h[bth - net - 2] = h[bth - net - 1] = 0xff;     /* UDP checksum */
    h[bth - net + 4] = 0xff;                /* BTH reserved octet */
    st->icrc_want = crc32_ccitt(buf, 8 + n);
    st->icrc_got = tvb_get_letohl(frame, end - 4);
    st->icrc = st->icrc_want == st->icrc_got ? ICRC_OK : ICRC_BAD;
}

static void show_icrc(packet_info *pinfo, proto_item *item, const kbtp_frame_t *st)
{
    if (st->icrc == ICRC_BAD)
        expert_add_info_format(pinfo, item, &ei_kbtp_icrc,
                               "ICRC 0x%08x is wrong (0x%08x is right): the receiving NIC drops this packet",
                               st->icrc_got, st->icrc_want);
}

static gboolean dissect_kbtp_infiniband(tvbuff_t *tvb, packet_info *pinfo, proto_tree *tree, void *data)
{
    const struct infinibandinfo *info = (const struct infinibandinfo *)data;
    guint n = tvb_captured_length(tvb);
    if (n == 0)
        return FALSE;
    kbtp_frame_t *st = (kbtp_frame_t *)p_get_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 0);
    if (PINFO_FD_VISITED(pinfo)) {
        if (!st || !st->kbtp)
            return FALSE;
    } else {
        if (wmem_map_size(kbtp_reasm) == 0 && header_ok(tvb, n) < 0)
            return FALSE;
        const char *src = address_to_str(pinfo->pool, &pinfo->src);
        const char *dst = address_to_str(pinfo->pool, &pinfo->dst);
        const char *key = pair_key(pinfo, "roce", src, dst);
        st = classify_roce(tvb, n, pinfo, key, src, dst, info ? send_kind(info->opCode) : SEND_UNKNOWN,
                           info ? info->pad_count : -1);
        if (!st)
            return FALSE;
        st->kbtp = TRUE;
        st->roce = TRUE;
        if (!st->key)
            st->key = wmem_strdup(wmem_file_scope(), key);
        check_icrc(pinfo, st);
    }
    if (st->has_len) {
        if (st->pad_unknown && info && info->pad_count > 0 && info->pad_count < st->len) {
            st->len -= info->pad_count;
            st->pad_unknown = FALSE;
        }
        set_columns(pinfo, dissect_message(tvb, st->len, pinfo, tree, st));
        show_icrc(pinfo, st->root, st);
    } else if (st->message) {
        tvbuff_t *msg_tvb = tvb_new_child_real_data(tvb, st->message, st->message_len, st->message_len);
        add_new_data_source(pinfo, msg_tvb, "Reassembled KBTP message");
        set_columns(pinfo, dissect_message(msg_tvb, st->message_len, pinfo, tree, st));
        show_icrc(pinfo, st->root, st);
    } else {
        proto_item *item = proto_tree_add_protocol_format(tree, proto_kbtp, tvb, 0, n, "KBTP fragment");
        proto_tree *ft = proto_item_add_subtree(item, ett_kbtp);
        if (st->fragment_in)
            proto_item_set_generated(proto_tree_add_uint(ft, hf_kbtp_fragment_in, tvb, 0, 0, st->fragment_in));
        if (st->broken)
            expert_add_info_format(pinfo, item, &ei_kbtp_malformed,
                                   "Send fragment that does not continue the message as its header said");
        show_icrc(pinfo, item, st);
        char *text = wmem_strdup(pinfo->pool, "KBTP fragment");
        if (st->fragment_in)
            text = wmem_strdup_printf(pinfo->pool, "%s (message in %u)", text, st->fragment_in);
        if (st->broken)
            text = wmem_strconcat(pinfo->pool, text, " [reassembly failed]", NULL);
        set_columns(pinfo, text);
    }
    return TRUE;
}

/* ---- iWARP: Wireshark reassembles Sends; tagged Writes and Read Responses are data ------- */
static gboolean dissect_kbtp_iwarp(tvbuff_t *tvb, packet_info *pinfo, proto_tree *tree, void *data)
{
    const rdmap_info_t *info = (const rdmap_info_t *)data;
    guint n = tvb_captured_length(tvb);
    kbtp_frame_t *st = (kbtp_frame_t *)p_get_proto_data(wmem_file_scope(), pinfo, proto_kbtp, 0);
    if (PINFO_FD_VISITED(pinfo)) {
        if (!st || !st->kbtp)
            return FALSE;
    } else {
        if (header_ok(tvb, n) < 0 || (info && info->is_tagged))
            return FALSE;
        const char *key = iwarp_key(pinfo);
        if (!recognise(pinfo, tvb, n, (kbtp_conn_t *)wmem_map_lookup(kbtp_conns, key)))
            return FALSE;
        st = message_state(pinfo, key, FALSE, FALSE, 0, FALSE);
    }
    set_columns(pinfo, dissect_message(tvb, n, pinfo, tree, st));
    return TRUE;
}

/* ---- Service Response Time: -z kbtp,srt, Statistics > Service Response Time > KBTP ---- */
/* Table 0: per request opcode (filter kbtp.opcode). Then one table per answered opcode, per
 * status of the answer (filter kbtp.status; the defined statuses at their values, then one
 * row for the others, each made when first answered): a row's name is one word, which fits tshark's 22-column field, and
 * the table's column header names the opcode ("ALLOC_STORE status"). */
#define KBTP_N_STATUS G_N_ELEMENTS(vs_kbtp_status)   /* the defined ones and one more */

static int answered_index(int opcode)
{
    int i = 0;
    for (guint m = 0; m < G_N_ELEMENTS(kbtp_messages); m++) {
        if (kbtp_messages[m].answer < 0)
            continue;
        if (kbtp_messages[m].opcode == opcode)
            return i;
        i++;
    }
    return -1;
}

static int status_index(guint32 status)
{
    for (guint i = 0; vs_kbtp_status[i].strptr; i++) {
        if (vs_kbtp_status[i].value == status)
            return (int)i;
    }
    return KBTP_N_STATUS - 1;
}

static void kbtp_srt_init(struct register_srt *srt, GArray *srt_array)
{
    (void)srt;
    wmem_allocator_t *scope = wmem_epan_scope();
    srt_stat_table *ops = init_srt_table("KBTP requests", NULL, srt_array, 256, "Opcode", "kbtp.opcode", NULL);
    for (guint m = 0; m < G_N_ELEMENTS(kbtp_messages); m++) {
        const kbtp_msg_t *msg = &kbtp_messages[m];
        if (msg->answer < 0)
            continue;
        init_srt_table_row(ops, msg->opcode, msg->name);
        /* no rows yet: a status gets its row when first answered, so a table of an opcode
         * the capture never answered stays empty, and tshark prints nothing of it */
        init_srt_table(wmem_strdup_printf(scope, "KBTP %s by status of the answer", msg->name), NULL, srt_array,
                       0, wmem_strdup_printf(scope, "%s status", msg->name), "kbtp.status", NULL);
    }
}

static tap_packet_status kbtp_srt_packet(void *pss, packet_info *pinfo, epan_dissect_t *edt, const void *prv,
                                         tap_flags_t flags)
{
    (void)edt;
    (void)flags;
    srt_data_t *data = (srt_data_t *)pss;
    const kbtp_frame_t *st = (const kbtp_frame_t *)prv;
    int i = answered_index(st->req_opcode);
    if (i < 0)
        return TAP_PACKET_DONT_REDRAW;
    add_srt_table_data(g_array_index(data->srt_array, srt_stat_table *, 0), st->req_opcode, &st->req_ts, pinfo);
    srt_stat_table *sts = g_array_index(data->srt_array, srt_stat_table *, 1 + i);
    int s = status_index(st->status);
    if (s >= sts->num_procs || sts->procedures[s].procedure == NULL)
        init_srt_table_row(sts, s, vs_kbtp_status[s].strptr ? vs_kbtp_status[s].strptr : "other");
    add_srt_table_data(sts, s, &st->req_ts, pinfo);
    return TAP_PACKET_REDRAW;
}

/* ---- registration --------------------------------------------------------------------------- */
void proto_register_kbtp(void)
{
    static ei_register_info ei[] = {
        { &ei_kbtp_status, { "kbtp.expert.status", PI_RESPONSE_CODE, PI_WARN, "KBTP non-OK status", EXPFILL } },
        { &ei_kbtp_malformed, { "kbtp.expert.malformed", PI_MALFORMED, PI_ERROR, "Malformed KBTP message", EXPFILL } },
        { &ei_kbtp_undefined_flags, { "kbtp.expert.undefined_flags", PI_PROTOCOL, PI_NOTE,
                                      "Undefined flag bits set", EXPFILL } },
        { &ei_kbtp_no_request, { "kbtp.expert.no_request", PI_SEQUENCE, PI_NOTE, "Answer to a request not seen", EXPFILL } },
        { &ei_kbtp_credits, { "kbtp.expert.credits", PI_SEQUENCE, PI_WARN,
                              "More requests outstanding than Request Credits", EXPFILL } },
        { &ei_kbtp_icrc, { "kbtp.expert.icrc", PI_CHECKSUM, PI_ERROR,
                           "Wrong RoCE ICRC: the receiving NIC drops this packet", EXPFILL } },
    };
    static const enum_val_t addr_le_values[] = {
        { "auto", "auto", KBTP_ADDR_LE_AUTO },
        { "on", "on", KBTP_ADDR_LE_ON },
        { "off", "off", KBTP_ADDR_LE_OFF },
        { NULL, NULL, 0 }
    };

    /* One form registers: if kbtp is known already (another copy of this plugin), this
     * copy registers nothing. The Lua form loads after C plugins and steps aside. */
    if (proto_get_id_by_filter_name("kbtp") != -1) {
        ws_message("kbtp: a KBTP dissector is registered already; this copy of the C plugin steps aside");
        return;
    }
    proto_kbtp = proto_register_protocol("KV Cache Block Transfer Protocol", "KBTP", "kbtp");
    kbtp_tap = register_tap("kbtp");
    register_srt_table(proto_kbtp, NULL, 1 + (int)G_N_ELEMENTS(kbtp_messages), kbtp_srt_packet, kbtp_srt_init, NULL);
    kbtp_register_fields(proto_kbtp);
    expert_module_t *em = expert_register_protocol(proto_kbtp);
    expert_register_field_array(em, ei, array_length(ei));
    module_t *m = prefs_register_protocol(proto_kbtp, NULL);
    prefs_register_enum_preference(m, "addr_le",
        "Address byte order (auto: follow HELLO_ACK; on: ADDR_LE; off: network)",
        "Byte order of address fields for sessions whose HELLO_ACK is not in the capture",
        &kbtp_pref_addr_le, addr_le_values, FALSE);
    prefs_register_bool_preference(m, "check_icrc", "Check the RoCE ICRC",
        "Mark KBTP frames whose RoCEv2 or RoCEv1 ICRC is wrong (kbtp.expert.icrc); off saves its cost",
        &kbtp_pref_check_icrc);
    kbtp_conns = wmem_map_new_autoreset(wmem_epan_scope(), wmem_file_scope(), g_str_hash, g_str_equal);
    kbtp_reasm = wmem_map_new_autoreset(wmem_epan_scope(), wmem_file_scope(), g_str_hash, g_str_equal);
    rdma_register();
}

void proto_reg_handoff_kbtp(void)
{
    if (proto_kbtp == -1)
        return;
    heur_dissector_add("infiniband.payload", dissect_kbtp_infiniband, "KBTP over InfiniBand and RoCE",
                       "kbtp_infiniband", proto_kbtp, HEURISTIC_ENABLE);
    heur_dissector_add("iwarp_ddp_rdmap", dissect_kbtp_iwarp, "KBTP over iWARP", "kbtp_iwarp", proto_kbtp,
                       HEURISTIC_ENABLE);
    rdma_handoff();
}
