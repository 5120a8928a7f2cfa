/*
 * kbtp_initiator.c - a small KBTP initiator on libibverbs and librdmacm,
 * written from the KBTP draft and its companion notes alone.  It connects
 * with rdma_cm (RoCEv2 or iWARP), sends HELLO, parses HELLO_ACK, runs the
 * script of $KBTP_OPS and writes one line per operation to
 * $KBTP_OUT/results (README.md has the details).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* ---- protocol constants (spec: Messages, KBTP Opcodes, Flags, Features) */
enum { KBTP_VERSION = 1 };
enum { OP_HELLO = 0x01, OP_HELLO_ACK = 0x02, OP_LOAD = 0x10, OP_ALLOC_STORE = 0x12,
       OP_FREE = 0x13, OP_COMPLETION = 0x20, OP_GOODBYE = 0x30 };
enum { FL_INLINE = 0x0001, FL_SEAL = 0x0002, FL_ALLOW_UNSEALED = 0x0010,
       FL_RELEASE = 0x0001 /* GOODBYE */ };
enum { FEAT_DIRECT_LOAD = 0x0001, FEAT_DIRECT_ALLOC = 0x0002, FEAT_ADDR_LE = 0x0008 };
enum { ENT_VALID = 0x0001, ENT_SEALED = 0x0002 };
enum { HDR_LEN = 24, DESC_LEN = 16, COMPLETION_LEN = 40, HELLO_LEN = 44,
       HELLO_ACK_LEN = 56, DIRECT_DESC_LEN = 48, ENTRY_LEN = 16 };

static const char *const status_name[] = {   /* spec: KBTP Status Codes, 0 to 11 */
	"OK", "INVALID_HANDLE", "STALE_GENERATION", "NOT_VALID", "ALREADY_BOUND", "NO_SPACE",
	"SEALED", "NOT_SEALED", "TOO_LARGE", "MALFORMED", "INTERNAL", "TICKET_ABANDONED" };
#define NSTATUS (sizeof(status_name) / sizeof(status_name[0]))

/* ---- local limits */
enum { NRECV = 16,        /* receive buffers of RECV_SIZE = Completion Credits */
       RECV_SIZE = 1024, MAX_OPS = 1024, CQ_DEPTH = 256, SEND_DEPTH = 128,
       MAX_BLOCK = 64 << 20 };  /* largest Block Size we allocate a buffer for */
#define WR_CONTROL UINT64_MAX   /* wr_id of HELLO and GOODBYE */

/* ---- byte order: network order, except the address fields of an ADDR_LE
 * session, which are little-endian (spec: HELLO_ACK; NOTES 4.7). */
static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i)); }
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static uint32_t get32(const uint8_t *p) { return (uint32_t)get16(p) << 16 | get16(p + 2); }
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

static int addr_le;   /* ADDR_LE granted in HELLO_ACK Features */

/* an n-octet address field: least significant octet last (network order)
 * or first (ADDR_LE) */
static void put_addr(uint8_t *p, uint64_t v, int n)
{
	for (int i = 0; i < n; i++) p[addr_le ? i : n - 1 - i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_addr(const uint8_t *p, int n)
{
	uint64_t v = 0;
	for (int i = 0; i < n; i++) v |= (uint64_t)p[addr_le ? i : n - 1 - i] << (8 * i);
	return v;
}

/* ---- the operations of the script */
enum kind { K_ALLOC_STORE, K_LOAD, K_FREE, K_DIRECT_LOAD, K_GOODBYE, K_UNSUPPORTED, K_BAD };

struct op {
	enum kind kind;
	char name[24], narg[24], file[256];
	uint64_t n;                /* handle offset: the handle is Handle Base + n */
	int seal, no_inline, unsealed, release;
	int group;                 /* statement; the ops of a group fly together */
	int state;                 /* 0 waiting, 1 active, 2 done */
	const char *result;
	uint64_t rid, handle;
	int is_request, sent, completed, step;
	uint8_t *msg, *data; size_t msg_len, data_len; struct ibv_mr *msg_mr, *data_mr;
	uint32_t dl_len; uint64_t dl_off; uint16_t dl_gen;  /* Direct Load */
};

/* ---- the session */
static struct {
	struct rdma_event_channel *ec; struct rdma_cm_id *id;
	struct ibv_pd *pd; struct ibv_cq *scq, *rcq;
	int qp_made, connected, lost;
	uint8_t *rbuf; struct ibv_mr *rmr;     /* NRECV receive buffers */
	uint8_t *hbuf; struct ibv_mr *hmr;     /* HELLO, then GOODBYE */
	int have_ack;                          /* HELLO_ACK, as received: */
	uint16_t features, req_credits;
	uint32_t block_size, max_inline, quota, handle_count, tab_stag, tab_count, pool_stag, pool_count;
	uint64_t handle_base, tab_to, tab_base, pool_to;
	int inflight, limit;       /* requests awaiting COMPLETION; credit limit */
	uint32_t usage;            /* handles bound this session, plus in flight */
	uint64_t next_rid;
	double deadline;           /* CLOCK_MONOTONIC seconds */
	int control_done, bye_posted, ended;
} S;

static struct op ops[MAX_OPS];
static int nops;
static const char *dir_in, *dir_out, *dir_state;

/* One line on stderr; returns -1 for "return fail(...)". */
static int fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("kbtp-initiator: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	return -1;
}

/* The session is over (connection lost, refused, timed out): say why once. */
static void lose(const char *why)
{
	S.lost = S.lost || fail("%s", why);   /* fail() returns -1: true */
}

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + t.tv_nsec / 1e9;
}
static long ms_left(void) { double ms = (S.deadline - now_s()) * 1000; return ms > 0 ? (long)ms : 0; }

/* ---- files: plain names inside $KBTP_IN / $KBTP_OUT / $KBTP_STATE only */
static int file_path(char *path, size_t size, const char *dir, const char *f)
{
	if (!dir || !*dir || !f[0] || strchr(f, '/') || !strcmp(f, ".") || !strcmp(f, ".."))
		return -1;
	return snprintf(path, size, "%s/%s", dir, f) < (int)size ? 0 : -1;
}

static uint8_t *read_file(const char *dir, const char *name, size_t *len)
{
	char path[4096];
	struct stat st;
	uint8_t *buf = NULL;
	FILE *f;
	if (file_path(path, sizeof path, dir, name) || !(f = fopen(path, "rb")))
		return NULL;
	if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= 0x7fffffff &&
	    (buf = malloc((size_t)st.st_size + 1)))
		*len = fread(buf, 1, (size_t)st.st_size, f);
	fclose(f);
	return buf;
}

static int write_file(const char *dir, const char *name, const void *p, size_t len, int mode)
{
	char path[4096];
	size_t done = 0;
	ssize_t r;
	int fd;
	if (file_path(path, sizeof path, dir, name) ||
	    (fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode)) < 0)
		return -1;
	while (done < len && (r = write(fd, (const uint8_t *)p + done, len - done)) > 0)
		done += (size_t)r;
	return close(fd) == 0 && done == len ? 0 : -1;
}

/* Initiator ID (spec: Session Establishment): 16 octets from getrandom,
 * kept secret as 32 hex digits in $KBTP_STATE/id (mode 0600) and reused. */
static int initiator_id(uint8_t id[16])
{
	char hex[40] = "";
	size_t len = 0;
	uint8_t *saved = read_file(dir_state, "id", &len);
	if (saved) {
		saved[len < 32 ? len : 32] = 0;
		int ok = len >= 32 && strspn((char *)saved, "0123456789abcdefABCDEF") == 32;
		for (int i = 0; ok && i < 16; i++)
			ok = sscanf((char *)saved + 2 * i, "%2hhx", &id[i]) == 1;
		free(saved);
		return ok ? 0 : fail("%s/id is not a 32-digit hex Initiator ID", dir_state);
	}
	if (getrandom(id, 16, 0) != 16)
		return fail("getrandom: %s", strerror(errno));
	if (dir_state && *dir_state) {
		for (int i = 0; i < 16; i++)
			sprintf(hex + 2 * i, "%02x", id[i]);
		hex[32] = '\n';
		if (write_file(dir_state, "id", hex, 33, 0600) < 0)
			return fail("cannot write %s/id", dir_state);
	}
	return 0;
}

/* ---- the script (driver interface: "Operation scripts") */
static void parse_op(char *text, int group)
{
	char *w[16], *save = NULL, *end = NULL;
	int nw = 0, i = 1, need_file = 1;
	for (char *t = strtok_r(text, " \t\r", &save); t && nw < 16; t = strtok_r(NULL, " \t\r", &save))
		w[nw++] = t;
	if (nw == 0 || (nops == MAX_OPS && fail("more than %d operations", MAX_OPS)))
		return;
	struct op *o = &ops[nops++];
	memset(o, 0, sizeof *o);
	o->group = group;
	snprintf(o->name, sizeof o->name, "%s", w[0]);
	snprintf(o->narg, sizeof o->narg, "-");
	o->kind = K_BAD;
	if (!strcmp(w[0], "alloc_store")) o->kind = K_ALLOC_STORE;
	else if (!strcmp(w[0], "load")) o->kind = K_LOAD;
	else if (!strcmp(w[0], "direct_load")) o->kind = K_DIRECT_LOAD;
	else if (!strcmp(w[0], "free")) { o->kind = K_FREE; need_file = 0; }
	else if (!strcmp(w[0], "goodbye")) { o->kind = K_GOODBYE; need_file = 0; i = 0; }
	else if (!strcmp(w[0], "store") || !strcmp(w[0], "direct_alloc")) o->kind = K_UNSUPPORTED;
	if (i) {                          /* every operation but goodbye: N */
		if (nw < 2) { o->kind = K_BAD; return; }
		snprintf(o->narg, sizeof o->narg, "%s", w[1]);
		errno = 0;
		o->n = strtoull(w[1], &end, 10);
		if (errno || *end || w[1][0] < '0' || w[1][0] > '9') o->kind = K_BAD;
	}
	i = i ? 2 : 1;
	if (need_file && (i >= nw || w[i][0] != '@')) o->kind = K_BAD;
	if (o->kind == K_UNSUPPORTED || o->kind == K_BAD) return;
	if (need_file) snprintf(o->file, sizeof o->file, "%s", w[i++] + 1);
	for (; i < nw; i++) {
		int store = o->kind == K_ALLOC_STORE;
		if (!strcmp(w[i], "record")) o->kind = K_UNSUPPORTED;
		else if (store && !strcmp(w[i], "seal")) o->seal = 1;
		else if (store && !strcmp(w[i], "inline")) o->no_inline = 0;
		else if (store && !strcmp(w[i], "noinline")) o->no_inline = 1;
		else if (o->kind == K_LOAD && !strcmp(w[i], "unsealed")) o->unsealed = 1;
		else if (o->kind == K_GOODBYE && !strcmp(w[i], "release")) o->release = 1;
		else if (o->kind != K_UNSUPPORTED) o->kind = K_BAD;
	}
}

static void parse_script(const char *script)
{
	char *copy = strdup(script ? script : ""), *s1 = NULL, *s2;
	int group = 0;
	for (char *st = copy ? strtok_r(copy, ";\n", &s1) : NULL; st; st = strtok_r(NULL, ";\n", &s1), group++)
		for (char *t = strtok_r(st, "&", &s2); t; t = strtok_r(NULL, "&", &s2))
			parse_op(t, group);
	free(copy);
}

/* ---- verbs helpers */
static struct ibv_mr *reg(void *p, size_t len, int access)
{
	return ibv_reg_mr(S.pd, p, len ? len : 1, access | IBV_ACCESS_LOCAL_WRITE);
}

static int post_recv(uint64_t i)
{
	struct ibv_sge sge = { (uintptr_t)(S.rbuf + i * RECV_SIZE), RECV_SIZE, S.rmr->lkey };
	struct ibv_recv_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1 }, *bad;
	return ibv_post_recv(S.id->qp, &wr, &bad);
}

/* Send or RDMA Read; wr_id is op index * 4 + step (0 the request, 1-3 the
 * reads of a Direct Load), or WR_CONTROL. */
static int post(uint64_t wr_id, enum ibv_wr_opcode opc, void *p, size_t len,
		uint32_t lkey, uint32_t rkey, uint64_t raddr)
{
	struct ibv_sge sge = { (uintptr_t)p, (uint32_t)len, lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
				  .opcode = opc, .send_flags = IBV_SEND_SIGNALED }, *bad;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(S.id->qp, &wr, &bad);
}

static void release_op(struct op *o)
{
	if (o->msg_mr) ibv_dereg_mr(o->msg_mr);
	if (o->data_mr) ibv_dereg_mr(o->data_mr);
	free(o->msg), free(o->data);
	o->msg = o->data = NULL, o->msg_mr = o->data_mr = NULL;
}

/* Done: keep the first result, free the buffers. */
static void finish(struct op *o, const char *result)
{
	o->result = o->result ? o->result : result;
	if (o->state != 2)
		release_op(o);
	o->state = 2;
}

/* ---- Direct Load (spec: Direct Modes): the entry, the block, the entry
 * again, each read issued only after the previous one completed. */
static void dl_step(struct op *o, uint64_t idx)
{
	uint64_t eaddr = S.tab_to + ENTRY_LEN * (o->handle - S.tab_base);
	uint8_t *e1 = o->data, *e2 = o->data + ENTRY_LEN, *blk = o->data + 2 * ENTRY_LEN;
	uint64_t pool_len = (uint64_t)S.pool_count * S.block_size, rel, lkey = o->data_mr->lkey;
	int rc = 0;
	switch (o->step++) {
	case 0:
		rc = post(idx * 4 + 1, IBV_WR_RDMA_READ, e1, ENTRY_LEN, lkey, S.tab_stag, eaddr);
		break;
	case 1:
		o->dl_gen = get16(e1 + 2), o->dl_len = get32(e1 + 4), o->dl_off = get_addr(e1 + 8, 8);
		rel = o->dl_off - S.pool_to;
		if ((get16(e1) & (ENT_VALID | ENT_SEALED)) != (ENT_VALID | ENT_SEALED))
			return finish(o, get16(e1) & ENT_VALID ? "NOT_SEALED" : "NOT_VALID");
		/* read only a whole block of the pool, never past our buffer */
		if (o->dl_len > S.block_size || o->dl_off < S.pool_to || rel >= pool_len ||
		    rel % S.block_size || pool_len - rel < o->dl_len)
			return finish(o, "ERROR");
		if (o->dl_len == 0)        /* nothing to read: on to the entry */
			return dl_step(o, idx);
		rc = post(idx * 4 + 2, IBV_WR_RDMA_READ, blk, o->dl_len, lkey, S.pool_stag, o->dl_off);
		break;
	case 2:
		rc = post(idx * 4 + 3, IBV_WR_RDMA_READ, e2, ENTRY_LEN, lkey, S.tab_stag, eaddr);
		break;
	default:
		/* valid only if both reads show the same Generation, VALID, SEALED */
		if (!(get16(e2) & ENT_VALID))
			return finish(o, "NOT_VALID");
		if (get16(e2 + 2) != o->dl_gen)
			return finish(o, "STALE_GENERATION");
		if (!(get16(e2) & ENT_SEALED) || get32(e2 + 4) != o->dl_len ||
		    get_addr(e2 + 8, 8) != o->dl_off)
			return finish(o, "ERROR");
		return finish(o, write_file(dir_out, o->file, blk, o->dl_len, 0644) ? "ERROR" : "OK");
	}
	if (rc)
		lose("connection lost: cannot post an RDMA Read"), finish(o, "ERROR");
}

static void start_direct_load(struct op *o, uint64_t idx)
{
	o->state = 1, o->handle = S.handle_base + o->n;
	if (!(S.features & FEAT_DIRECT_LOAD) || S.block_size > MAX_BLOCK)
		return finish(o, "ERROR");            /* not granted: no STags */
	if (o->handle - S.tab_base >= S.tab_count)
		return finish(o, "INVALID_HANDLE");   /* not in the exposed table */
	o->data_len = 2 * ENTRY_LEN + (size_t)S.block_size;
	if (!(o->data = malloc(o->data_len)) || !(o->data_mr = reg(o->data, o->data_len, 0)))
		return finish(o, "ERROR");
	dl_step(o, idx);
}

/* ---- requests: LOAD, ALLOC_STORE, FREE.  Header (spec: Common Header):
 * Version, Opcode, Flags, Request ID, Block Handle, Generation 0 ("any"),
 * Status 0; then a Data Descriptor: STag, Tagged Offset, Length. */
static void header(uint8_t *m, uint8_t opcode, uint16_t flags, uint64_t rid, uint64_t handle)
{
	memset(m, 0, HDR_LEN);
	m[0] = KBTP_VERSION;
	m[1] = opcode;
	put16(m + 2, flags);
	put64(m + 4, rid);
	put_addr(m + 12, handle, 8);
}

static void start_request(struct op *o, uint64_t idx)
{
	uint8_t opcode = o->kind == K_LOAD ? OP_LOAD : o->kind == K_FREE ? OP_FREE : OP_ALLOC_STORE;
	uint16_t flags = 0;
	size_t flen = 0, inl = 0;
	uint32_t stag = 0, dlen = 0;
	uint64_t to = 0;
	o->state = 1, o->handle = S.handle_base + o->n;
	/* handles are chosen within our own range (spec: Block Handle) */
	if (o->kind != K_LOAD && o->n >= S.handle_count)
		return finish(o, "INVALID_HANDLE");
	if (o->kind == K_ALLOC_STORE) {
		if (!(o->data = read_file(dir_in, o->file, &flen)))
			return finish(o, "ERROR");
		if (flen > S.block_size)
			return finish(o, "TOO_LARGE");
		if (S.usage >= S.quota)   /* MUST NOT exceed the quota (Allocation Quotas) */
			return finish(o, "NO_SPACE");
		flags = o->seal ? FL_SEAL : 0;
		dlen = (uint32_t)flen;
		if (!o->no_inline && flen <= S.max_inline) {
			flags |= FL_INLINE;       /* STag and Tagged Offset stay zero */
			inl = flen;
		} else {
			o->data_len = flen;
			if (!(o->data_mr = reg(o->data, flen, IBV_ACCESS_REMOTE_READ)))
				return finish(o, "ERROR");
		}
	} else if (o->kind == K_LOAD) {
		flags = o->unsealed ? FL_ALLOW_UNSEALED : 0;
		o->data_len = dlen = S.block_size;
		if (S.block_size > MAX_BLOCK || !(o->data = malloc(o->data_len)) ||
		    !(o->data_mr = reg(o->data, o->data_len, IBV_ACCESS_REMOTE_WRITE)))
			return finish(o, "ERROR");
	}
	if (o->data_mr)                   /* the buffer the target reads or writes */
		stag = o->data_mr->rkey, to = (uintptr_t)o->data;
	o->msg_len = HDR_LEN + (opcode == OP_FREE ? 0 : DESC_LEN) + inl;
	if (!(o->msg = calloc(1, o->msg_len)) || !(o->msg_mr = reg(o->msg, o->msg_len, 0)))
		return finish(o, "ERROR");
	o->rid = S.next_rid++;
	header(o->msg, opcode, flags, o->rid, o->handle);
	if (opcode != OP_FREE) {
		put_addr(o->msg + HDR_LEN, stag, 4);
		put_addr(o->msg + HDR_LEN + 4, to, 8);
		put_addr(o->msg + HDR_LEN + 12, dlen, 4);
		memcpy(o->msg + HDR_LEN + DESC_LEN, o->data, inl);
	}
	if (post(idx * 4, IBV_WR_SEND, o->msg, o->msg_len, o->msg_mr->lkey, 0, 0))
		return lose("connection lost: cannot post a Send"), finish(o, "ERROR");
	o->is_request = 1, S.inflight++;
	if (o->kind == K_ALLOC_STORE)
		S.usage++;                /* counted while in flight, undone on failure */
}

/* ---- received messages */
/* HELLO_ACK (spec: Session Establishment; NOTES 2): every length checked
 * before use; a refusal or a malformed one ends the session. */
static void parse_hello_ack(const uint8_t *m, uint32_t len)
{
	const uint8_t *b = m + HDR_LEN, *d = m + HELLO_ACK_LEN;
	uint16_t st = get16(m + 22);
	char why[96];
	if (m[0] != KBTP_VERSION)
		return lose("malformed HELLO_ACK: Version is not 1");
	if (st) {
		snprintf(why, sizeof why, "HELLO refused by the target: status %s",
			 st < NSTATUS ? status_name[st] : "unknown");
		return lose(why);
	}
	if (len < HELLO_ACK_LEN)
		return lose("malformed HELLO_ACK: shorter than 56 octets");
	S.features = get16(b), S.req_credits = get16(b + 2);
	S.block_size = get32(b + 4), S.max_inline = get32(b + 8), S.quota = get32(b + 12);
	S.handle_base = get64(b + 16), S.handle_count = get32(b + 24);
	/* b + 28: Ticket Timeout, for DIRECT_ALLOC, which is not implemented */
	uint32_t need = HELLO_ACK_LEN + (S.features & FEAT_DIRECT_LOAD ? DIRECT_DESC_LEN : 0) +
			(S.features & FEAT_DIRECT_ALLOC ? DIRECT_DESC_LEN : 0);
	if (len < need)
		return lose("malformed HELLO_ACK: direct-mode descriptors its Features announce are missing");
	if (S.block_size == 0)
		return lose("malformed HELLO_ACK: Block Size 0");
	if (S.features & FEAT_DIRECT_LOAD) {
		/* Table descriptor, Table Base Handle, 8 reserved, Pool descriptor */
		S.tab_stag = get32(d), S.tab_to = get64(d + 4), S.tab_count = get32(d + 12);
		S.tab_base = get64(d + 16);
		S.pool_stag = get32(d + 32), S.pool_to = get64(d + 36), S.pool_count = get32(d + 44);
	}
	addr_le = !!(S.features & FEAT_ADDR_LE);
	/* never more requests in flight than Request Credits, nor than our
	 * receive buffers for their COMPLETIONs */
	S.limit = S.req_credits < NRECV ? S.req_credits : NRECV;
	S.have_ack = 1;
}

/* Only a COMPLETION whose Request ID matches a request still awaiting one
 * is used; an unknown or duplicate Request ID, or anything else, is ignored. */
static void on_recv(const uint8_t *m, uint32_t len)
{
	struct op *o = NULL;
	if (!S.have_ack) {
		if (len >= HDR_LEN && m[1] == OP_HELLO_ACK)
			parse_hello_ack(m, len);
		return;
	}
	if (len < COMPLETION_LEN || m[0] != KBTP_VERSION || m[1] != OP_COMPLETION)
		return;
	for (int i = 0; i < nops && !o; i++)
		if (ops[i].state == 1 && ops[i].is_request && !ops[i].completed &&
		    ops[i].rid == get64(m + 4))
			o = &ops[i];
	if (!o)
		return;
	uint16_t st = get16(m + 22);
	uint32_t dlen = get32(m + 24);
	o->completed = 1, S.inflight--;
	o->result = st < NSTATUS ? status_name[st] : "ERROR";
	/* the loaded data is in place once the COMPLETION arrived (spec:
	 * Completion); a Data Length past our buffer is an error, not data */
	if (o->kind == K_LOAD && st == 0 &&
	    (dlen > o->data_len || write_file(dir_out, o->file, o->data, dlen, 0644)))
		o->result = "ERROR";
	if (((o->kind == K_ALLOC_STORE && st) || (o->kind == K_FREE && !st)) && S.usage)
		S.usage--;
	if (o->sent)            /* buffers go once the Send completed too */
		finish(o, o->result);
}

static void on_send_wc(const struct ibv_wc *wc)
{
	uint64_t idx = wc->wr_id / 4;
	struct op *o = idx < (uint64_t)nops ? &ops[idx] : NULL;
	if (wc->wr_id == WR_CONTROL && (S.bye_posted || wc->status == IBV_WC_SUCCESS)) {
		S.control_done = 1;       /* GOODBYE may be flushed by the disconnect */
		return;
	}
	if (wc->status != IBV_WC_SUCCESS)
		lose(wc->wr_id == WR_CONTROL ? "connection lost: HELLO could not be sent" :
		     wc->wr_id % 4 ? "connection lost: an RDMA Read of the target failed" :
		     "connection lost: a Send failed");
	if (!o || o->state != 1)
		return;
	if (S.lost)
		finish(o, "ERROR");
	else if (o->kind == K_DIRECT_LOAD)
		dl_step(o, idx);
	else {
		o->sent = 1;
		if (o->completed)
			finish(o, o->result);
	}
}

/* ---- waiting: every wait ends by the session deadline */
static void handle_cm_events(void)
{
	struct rdma_cm_event *ev;
	while (rdma_get_cm_event(S.ec, &ev) == 0) {
		enum rdma_cm_event_type t = ev->event;
		rdma_ack_cm_event(ev);
		if (t != RDMA_CM_EVENT_DISCONNECTED && t != RDMA_CM_EVENT_DEVICE_REMOVAL &&
		    t != RDMA_CM_EVENT_TIMEWAIT_EXIT)
			continue;
		S.connected = 0;
		if (!S.bye_posted)          /* after GOODBYE it is the expected end */
			lose("connection lost: the target disconnected");
		S.control_done = S.control_done || S.bye_posted;
	}
}

/* Handle the completions that are ready, else sleep a little.  Returns -1
 * once the session is lost or out of time. */
static int progress(void)
{
	struct ibv_wc wc[16];
	int n, got = 0;
	while ((n = ibv_poll_cq(S.scq, 16, wc)) > 0 && (got = 1))
		for (int i = 0; i < n; i++)
			on_send_wc(&wc[i]);
	while ((n = ibv_poll_cq(S.rcq, 16, wc)) > 0 && (got = 1))
		for (int i = 0; i < n; i++) {
			if (wc[i].status != IBV_WC_SUCCESS || wc[i].wr_id >= NRECV) {
				if (!S.bye_posted)
					lose("connection lost: a receive failed");
				continue;
			}
			uint32_t len = wc[i].byte_len > RECV_SIZE ? RECV_SIZE : wc[i].byte_len;
			on_recv(S.rbuf + wc[i].wr_id * RECV_SIZE, len);
			if (!S.lost && post_recv(wc[i].wr_id))
				lose("connection lost: cannot repost a receive");
		}
	if (n < 0)
		lose("connection lost: ibv_poll_cq failed");
	handle_cm_events();
	if (S.lost)
		return -1;
	if (got)
		return 0;
	long left = ms_left();
	if (left == 0) {
		lose("gave up: KBTP_TIMEOUT reached while waiting for the target");
		return -1;
	}
	struct pollfd pf = { S.ec->fd, POLLIN, 0 };
	poll(&pf, 1, 1);            /* CQs are polled: sleep 1 ms or until a CM event */
	return 0;
}

static int wait_cm(enum rdma_cm_event_type want, const char *what)
{
	struct rdma_cm_event *ev;
	for (;;) {
		if (rdma_get_cm_event(S.ec, &ev) == 0) {
			enum rdma_cm_event_type t = ev->event;
			int st = ev->status;
			rdma_ack_cm_event(ev);   /* copy first: acking frees the event */
			return t == want ? 0 : fail("%s failed: %s (status %d)", what, rdma_event_str(t), st);
		}
		struct pollfd pf = { S.ec->fd, POLLIN, 0 };
		if (ms_left() == 0)
			return fail("%s: KBTP_TIMEOUT reached", what);
		poll(&pf, 1, (int)ms_left());
	}
}

/* HELLO or GOODBYE from hbuf, then wait for its Send to complete. */
static int send_control(size_t len)
{
	S.control_done = 0;
	if (post(WR_CONTROL, IBV_WR_SEND, S.hbuf, len, S.hmr->lkey, 0, 0))
		lose("connection lost: cannot post a Send");
	while (!S.control_done && progress() == 0)
		;
	return S.control_done ? 0 : -1;
}

/* GOODBYE ends the session; it needs a request credit like any request. */
static int goodbye(int release)
{
	if (S.lost || S.limit == 0 || S.inflight)
		return -1;
	header(S.hbuf, OP_GOODBYE, release ? FL_RELEASE : 0, 0, 0);
	S.bye_posted = 1;
	return send_control(HDR_LEN);
}

/* ---- running the script: group by group; within a group as many requests
 * in flight as the credits allow, GOODBYE only after the others. */
static int active(int from, int to)
{
	int n = 0;
	for (int k = from; k < to; k++)
		n += ops[k].state == 1;
	return n;
}

static void run_script(void)
{
	for (int i = 0, end; i < nops && !S.lost; i = end) {
		int next = i;
		for (end = i; end < nops && ops[end].group == ops[i].group; end++)
			;
		for (;;) {
			while (next < end && !S.lost) {
				struct op *o = &ops[next];
				if (o->kind == K_UNSUPPORTED)
					finish(o, "UNSUPPORTED");          /* and not sent */
				else if (o->kind == K_BAD || S.ended)
					finish(o, "ERROR");
				else if (o->kind == K_GOODBYE) {
					if (active(i, next))
						break;
					o->state = 1;
					finish(o, goodbye(o->release) ? "ERROR" : "OK");
					S.ended = 1;
				} else if (o->kind == K_DIRECT_LOAD)
					start_direct_load(o, (uint64_t)next);
				else if (S.limit == 0)
					finish(o, "ERROR");                /* no credit at all */
				else if (S.inflight >= S.limit)
					break;                             /* wait for a credit */
				else
					start_request(o, (uint64_t)next);
				next++;
			}
			if ((next == end && !active(i, end)) || S.lost || progress() < 0)
				break;
		}
		for (int k = i; k < end; k++)      /* lost: what was in flight failed */
			if (ops[k].state == 1)
				finish(&ops[k], "ERROR");
	}
}

/* results: "op N STATUS" per operation, in script order */
static void write_results(void)
{
	char path[4096];
	FILE *f = file_path(path, sizeof path, dir_out, "results") ? NULL : fopen(path, "w");
	for (int i = 0; f && i < nops; i++)
		if (ops[i].result)
			fprintf(f, "%s %s %s\n", ops[i].name, ops[i].narg, ops[i].result);
	if (!f || fclose(f))
		fail("cannot write $KBTP_OUT/results");
}

/* ---- connection: roce://HOST[:PORT] (4791) or iwarp://HOST:PORT (5420) */
static int parse_url(const char *url, struct sockaddr_storage *dst)
{
	char host[256], *colon;
	const char *port = "4791";
	struct addrinfo hints = { .ai_flags = AI_NUMERICSERV }, *ai;
	if (!url || (strncmp(url, "roce://", 7) && strncmp(url, "iwarp://", 8)))
		return -1;
	if (url[0] == 'i')
		port = "5420";
	snprintf(host, sizeof host, "%s", strstr(url, "//") + 2);
	if ((colon = strchr(host, ':')))            /* IPv4 address or host name */
		*colon = 0, port = colon + 1;
	if (!host[0] || getaddrinfo(host, port, &hints, &ai))
		return -1;
	memcpy(dst, ai->ai_addr, ai->ai_addrlen);
	freeaddrinfo(ai);
	return 0;
}

static int connect_target(const char *url, const char *local)
{
	struct sockaddr_storage dst, src;
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST }, *ai;
	struct ibv_device_attr da;
	int have_src = local && *local;
	if (parse_url(url, &dst))
		return fail("bad KBTP_TARGET_URL '%s'", url ? url : "");
	if (have_src && getaddrinfo(local, NULL, &hints, &ai))
		return fail("bad KBTP_LOCAL '%s'", local);
	if (have_src)
		memcpy(&src, ai->ai_addr, ai->ai_addrlen), freeaddrinfo(ai);
	if (!(S.ec = rdma_create_event_channel()) || rdma_create_id(S.ec, &S.id, NULL, RDMA_PS_TCP))
		return fail("rdma_cm: %s", strerror(errno));
	fcntl(S.ec->fd, F_SETFL, fcntl(S.ec->fd, F_GETFL) | O_NONBLOCK);
	if (rdma_resolve_addr(S.id, have_src ? (struct sockaddr *)&src : NULL,
			      (struct sockaddr *)&dst, ms_left() > 5000 ? 5000 : (int)ms_left() + 1))
		return fail("rdma_resolve_addr: %s", strerror(errno));
	if (wait_cm(RDMA_CM_EVENT_ADDR_RESOLVED, "address resolution") ||
	    rdma_resolve_route(S.id, ms_left() > 5000 ? 5000 : (int)ms_left() + 1) ||
	    wait_cm(RDMA_CM_EVENT_ROUTE_RESOLVED, "route resolution"))
		return fail("cannot reach %s", url);
	if (ibv_query_device(S.id->verbs, &da) || !(S.pd = ibv_alloc_pd(S.id->verbs)) ||
	    !(S.scq = ibv_create_cq(S.id->verbs, CQ_DEPTH, NULL, NULL, 0)) ||
	    !(S.rcq = ibv_create_cq(S.id->verbs, CQ_DEPTH, NULL, NULL, 0)))
		return fail("cannot create PD and CQs: %s", strerror(errno));
	struct ibv_qp_init_attr qa = {
		.send_cq = S.scq, .recv_cq = S.rcq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = SEND_DEPTH, .max_recv_wr = NRECV,
			 .max_send_sge = 1, .max_recv_sge = 1 } };
	if (rdma_create_qp(S.id, S.pd, &qa))
		return fail("rdma_create_qp: %s", strerror(errno));
	S.qp_made = 1;
	/* receive buffers before connecting: HELLO_ACK lands in one of them */
	if (!(S.rbuf = calloc(NRECV, RECV_SIZE)) || !(S.hbuf = calloc(1, HELLO_LEN)) ||
	    !(S.rmr = reg(S.rbuf, (size_t)NRECV * RECV_SIZE, 0)) ||
	    !(S.hmr = reg(S.hbuf, HELLO_LEN, 0)))
		return fail("cannot register buffers");
	for (uint64_t i = 0; i < NRECV; i++)
		if (post_recv(i))
			return fail("ibv_post_recv failed");
	/* the target RDMA-reads our store buffers; we read it for Direct Load */
	struct rdma_conn_param cp = {
		.responder_resources = (uint8_t)(da.max_qp_rd_atom < 16 ? da.max_qp_rd_atom : 16),
		.initiator_depth = (uint8_t)(da.max_qp_init_rd_atom < 16 ? da.max_qp_init_rd_atom : 16),
		.retry_count = 7, .rnr_retry_count = 7 };
	if (rdma_connect(S.id, &cp))
		return fail("rdma_connect: %s", strerror(errno));
	S.connected = wait_cm(RDMA_CM_EVENT_ESTABLISHED, "connection") == 0;
	return S.connected ? 0 : -1;
	return 0;
}

/* HELLO: Requested Features (what this program can use), Completion
 * Credits, Initiator ID; then wait for the HELLO_ACK (parsed in on_recv). */
static int hello(void)
{
	uint8_t id[16];
	if (initiator_id(id))
		return -1;
	header(S.hbuf, OP_HELLO, 0, 0, 0);
	put16(S.hbuf + 24, FEAT_DIRECT_LOAD | FEAT_ADDR_LE), put16(S.hbuf + 26, NRECV);
	memcpy(S.hbuf + 28, id, 16);
	if (send_control(HELLO_LEN) < 0)
		return -1;
	while (!S.have_ack && progress() == 0)
		;
	return S.have_ack ? 0 : -1;
}

/* Release everything, on every path. */
static void cleanup(void)
{
	if (S.connected) rdma_disconnect(S.id);
	if (S.qp_made) rdma_destroy_qp(S.id);
	for (int i = 0; i < nops; i++)
		release_op(&ops[i]);
	if (S.rmr) ibv_dereg_mr(S.rmr);
	if (S.hmr) ibv_dereg_mr(S.hmr);
	if (S.scq) ibv_destroy_cq(S.scq);
	if (S.rcq) ibv_destroy_cq(S.rcq);
	if (S.pd) ibv_dealloc_pd(S.pd);
	if (S.id) rdma_destroy_id(S.id);
	if (S.ec) rdma_destroy_event_channel(S.ec);
	free(S.rbuf), free(S.hbuf);
}

int main(void)
{
	const char *t = getenv("KBTP_TIMEOUT");
	double secs = t && *t ? strtod(t, NULL) : 30.0;
	secs = secs > 0 && secs < 86400 ? secs : 30.0;
	/* the deadline keeps a little time back for the cleanup */
	S.deadline = now_s() + secs - (secs > 2 ? 0.5 : secs / 4);
	dir_in = getenv("KBTP_IN"), dir_out = getenv("KBTP_OUT"), dir_state = getenv("KBTP_STATE");
	S.next_rid = 1;          /* Request IDs: 1, 2, ... */
	parse_script(getenv("KBTP_OPS"));
	int rc = 1;
	if (connect_target(getenv("KBTP_TARGET_URL"), getenv("KBTP_LOCAL")) == 0 && hello() == 0) {
		run_script();
		/* a script without goodbye ends with GOODBYE without RELEASE */
		if (!S.lost && !S.ended && goodbye(0) < 0)
			lose("cannot send GOODBYE");
		rc = S.lost ? 1 : 0;
	}
	write_results();
	cleanup();
	return rc;
}
