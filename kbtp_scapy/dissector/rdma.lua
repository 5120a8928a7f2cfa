-- RDMA transfers tied to KBTP requests (kbtp.data_for) and the ring Head counter
-- (kbtp.ring.ticket, kbtp.ring.slot_offset, expert kbtp.expert.ring), on both bindings.
--
-- The RDMA operations that carry KBTP block data and the FetchAdds on the ring counter do
-- not reach the KBTP heuristics, or reach them without their headers (docs/WIRESHARK.md), so a
-- postdissector labels them. It learns what to expect from KBTP messages, through HOOKS
-- (first pass only):
--   LOAD: the target RDMA-Writes the block into the buffer of the Data Descriptor;
--   STORE / ALLOC_STORE without INLINE: the target RDMA-Reads it from that buffer;
--   HELLO_ACK with DIRECT_ALLOC: the initiator may FetchAdd on the Head descriptor;
--   the COMPLETION of a request ends what its transfers may still carry.
-- A transfer matches by STag and Tagged Offset inside the Data Descriptor's range, in the
-- direction the request implies. Packets without an address follow the one that had it:
-- RoCEv2 WRITE MIDDLE/LAST by PSN on their QP, READ RESPONSE by the PSNs of the READ
-- REQUEST, ATOMIC ACKNOWLEDGE by the FETCH ADD's PSN; on iWARP the Read Response is tagged
-- with the Read Request's sink STag and TO, and the Atomic Response names its request by
-- Request Identifier. Frames that match nothing get nothing.
--
-- Headers are read from the packet bytes at the place a field extractor points to (the BTH
-- of RoCEv2; the RDMAP control octet of each FPDU of iWARP), not from tshark's values:
--   * tshark 4.0 decodes RFC 7306 atomics only in part: a FetchAdd whose 28 reserved bits
--     are not zero, and every Swap, get their Add (Swap) Data and Mask labelled Compare
--     Data and Compare Mask, and the Original Remote Data Value of an Atomic Response is
--     labelled "Original Request Identifier";
--   * one string read costs less than one extractor per value;
--   * the same reader serves frames without a protocol tree. In the first pass of
--     `tshark -2` without a filter, tshark builds no tree, so extractors return nothing
--     (a Lua postdissector cannot ask for fields as C ones do with
--     set_postdissector_wanted_hfids). The headers are then found by walking Ethernet
--     (802.1Q/802.1ad) / IPv4 or IPv6 / UDP 4791 or TCP, and on TCP the MPA FPDUs of a
--     segment that starts with one (no markers, CRC or not).
-- Results are kept per frame (marks) and shown again on later passes.
--
-- 64-bit Tagged Offsets, Add Data and the like are kept as two 32-bit numbers (high, low):
-- UInt64 objects cost an allocation each, and data packets are most of a KBTP capture.
-- KBTP messages hand their 64-bit values over as 8-octet strings (runtime.lua's hl64).
--
-- A Send that shares an iWARP TCP segment with another one is decoded here too, with
-- runtime.lua's dissect_more: see more_sends().

-- One block: its locals do not count towards the 200 the chunk (all parts) may have.
do

local Xr = {
    iw_opcode = Field.new("iwarp_rdma.opcode"),
}

local TWO32, U24 = 2 ^ 32, 0x1000000
local INLINE = FLAGSETS.request_flags.bits[1][1]
assert(FLAGSETS.request_flags.bits[1][2] == "INLINE")

-- ---- state: filled only when not pinfo.visited, cleared with the runtime's ----------------
local marks   -- frame number -> label(s) (see show())
local flows   -- "src|dst" endpoints -> { r = per-connection RDMA state, to_ini = direction }
local armed   -- some connection expects RDMA traffic tied to KBTP
local armed_roce, armed_iwarp  -- ... on that binding: only its extractor is asked
local sends   -- frame -> { [Send key] = count } of the KBTP messages the heuristics decoded
local extras  -- frame -> { { off, len, st } } KBTP messages decoded here (see more_sends())
local claimed -- the last RoCEv2 frame that carried a KBTP message: no RDMA operation of
              -- interest can share its packet, so the postdissector, which runs right after
              -- the heuristic on the same frame, skips it at once

local function rdma_init()
    marks, flows, armed, armed_roce, armed_iwarp = {}, {}, false, false, false
    sends, extras, claimed = {}, {}, nil
end
rdma_init()

-- ---- 64-bit values as (high, low) ----------------------------------------------------------
local function add64(h, l, n)
    l = l + n
    if l >= TWO32 then return (h + math.floor(l / TWO32)) % TWO32, l % TWO32 end
    return h, l
end

local function le64(ah, al, bh, bl)
    return ah < bh or (ah == bh and al <= bl)
end

local function hex64(h, l)
    return string.format("0x%08x%08x", h, l)
end

local function u32(s, i)  -- big-endian, ``i`` 1-based
    local a, b, c, d = s:byte(i, i + 3)
    return ((a * 256 + b) * 256 + c) * 256 + d
end

-- ---- expectations --------------------------------------------------------------------------
local MAX_EXPECT = 256  -- per connection: requests answered by completion records never end

local function push(list, e)
    list[#list + 1] = e
    if #list > MAX_EXPECT then table.remove(list, 1) end
end

local function drop_request(list, req)
    for i = #list, 1, -1 do
        if list[i].req == req then table.remove(list, i) end
    end
end

-- e.lo <= TO < e.hi on the same STag.
local function in_range(e, stag, th, tl)
    return e.stag == stag and le64(e.loh, e.lol, th, tl) and not le64(e.hih, e.hil, th, tl)
end

-- Newest first: a later request may reuse a buffer.
local function find(list, stag, th, tl, kind)
    for i = #list, 1, -1 do
        local e = list[i]
        if (kind == nil or e.kind == kind) and in_range(e, stag, th, tl) then return e end
    end
end

-- ``st``: the request's per-message state, which lists the frames of its data (data_in).
local function expectation(req, name, stag, h, l, len, st)
    local hh, hl = add64(h, l, len)
    if not le64(h, l, hh, hl) then hh, hl = TWO32 - 1, TWO32 - 1 end  -- wrapped: to the top
    return { req = req, name = name, stag = stag, loh = h, lol = l, hih = hh, hil = hl, st = st }
end

-- ---- the ring counter rule (kbtp-draft "Free-Block Ring"; RFC 7306 masked FetchAdd) --------
local function log2(count)
    local n = 0
    while 2 ^ n < count do n = n + 1 end
    return n
end

local function ring_mask(n)
    local h, l = 0, 0
    for _, b in ipairs({ n + RING.mask_n_offset, table.unpack(RING.mask_bits) }) do
        if b >= 32 then h = bit32.bor(h, bit32.lshift(1, b - 32)) else l = bit32.bor(l, bit32.lshift(1, b)) end
    end
    return h, l
end

local MASKED_H, MASKED_L = RING.masked_add:higher(), RING.masked_add:lower()
local UNMASKED_H, UNMASKED_L = RING.unmasked_add:higher(), RING.unmasked_add:lower()

-- ---- what KBTP messages announce (first pass, from runtime's track()) -----------------------
local function endpoints(pinfo, roce)
    local s, d = tostring(pinfo.src), tostring(pinfo.dst)
    if roce then return s, d end
    return s .. ":" .. pinfo.src_port, d .. ":" .. pinfo.dst_port
end

local function rdma_state(conn, pinfo, from_initiator)
    local r = conn.rdma
    if not r then
        r = { xfers = {}, sinks = {}, reads = {}, cur = {}, atomics = {} }
        conn.rdma = r
        r.roce = conn.roce == true
        local s, d = endpoints(pinfo, r.roce)
        if not from_initiator then s, d = d, s end
        flows[s .. "|" .. d] = { r = r, to_ini = false }
        flows[d .. "|" .. s] = { r = r, to_ini = true }
    end
    return r
end

local function arm(r)
    armed = true
    if r.roce then armed_roce = true else armed_iwarp = true end
    return r
end

-- A KBTP message names itself by opcode and Request ID (its 8 octets), whatever path
-- decoded it.
local function send_key(opcode, request_id)
    return opcode .. ":" .. request_id
end

-- iWARP: which messages the heuristics decoded in this frame, so that the postdissector can
-- tell the Sends they were never given.
local function note_send(conn, st, values, pinfo, n)
    if st.more then return end
    local op = values.opcode
    local from_initiator = op ~= OPCODE.COMPLETION and op ~= OPCODE.HELLO_ACK
    local r = conn.rdma or rdma_state(conn, pinfo, from_initiator)
    if r.roce then return end
    arm(r)
    local set = sends[n] or {}
    sends[n] = set
    local k = send_key(op, values.request_id or "")
    set[k] = (set[k] or 0) + 1
end

HOOKS[#HOOKS + 1] = {
    init = rdma_init,
    message = function(conn, st, values, msg, pinfo, number)
        local op = values.opcode
        if conn.roce then
            claimed = number
        else
            note_send(conn, st, values, pinfo, number)
        end
        if op == OPCODE.LOAD or op == OPCODE.STORE or op == OPCODE.ALLOC_STORE then
            if bit32.band(values.flags or 0, INLINE) ~= 0 then return end
            local stag, off, len = values["dd.stag"], values["dd.offset"], values["dd.length"]
            if not (stag and off and len) or len == 0 then return end
            local r = arm(rdma_state(conn, pinfo, true))
            local h, l = hl64(off)
            local e = expectation(number, msg.name, stag, h, l, len, st)
            e.kind = op == OPCODE.LOAD and "write" or "read"
            push(r.xfers, e)
        elseif op == OPCODE.HELLO_ACK and values.status == STATUS_OK then
            local feats = values["hello_ack.features"] or 0
            if bit32.band(feats, FEATURE.DIRECT_ALLOC) == 0 or not values["hello_ack.head.stag"] then return end
            local r = arm(rdma_state(conn, pinfo, false))
            local count = values["hello_ack.ring.count"] or 0
            local h, l = hl64(values["hello_ack.head.offset"])
            r.ring = { stag = values["hello_ack.head.stag"], h = h, l = l, count = count,
                       n = log2(count), frame = number }
        elseif op == OPCODE.COMPLETION and st.request_in and conn.rdma then
            -- The request is over, and its transfers with it (RFC 5040 s5.5, rule 5).
            local r, req = conn.rdma, st.request_in
            drop_request(r.xfers, req)
            drop_request(r.sinks, req)
            for k, e in pairs(r.reads) do if e.req == req then r.reads[k] = nil end end
            for k, e in pairs(r.cur) do if e.req == req then r.cur[k] = nil end end
        end
    end,
}

-- ---- reading RDMA headers ----------------------------------------------------------------------
-- An operation: { t = "roce" | "iwarp", kind, ... } with the header values matching needs.

-- RoCEv2 / InfiniBand BTH (12 octets) and extension headers (IBTA vol. 1, 9.2, 9.3).
local RC_WRITE = { [0x06] = "first", [0x07] = "middle", [0x08] = "last", [0x09] = "last",
                   [0x0a] = "only", [0x0b] = "only" }
local RC_READ_RESPONSE = { [0x0d] = "first", [0x0e] = "middle", [0x0f] = "last", [0x10] = "only" }
local RC_INTERESTING = { [0x0c] = true, [0x12] = true, [0x14] = true }
local SERVICE_EXT = { [0x00] = 0, [0xa0] = 4 }  -- RC; XRC puts an XRCETH after the BTH
local SERVICE_UC = 0x20                         -- UC carries RDMA Writes too

local ROCE_INTERESTING = {}  -- BTH opcode -> true for the operations matched here
for opcode = 0, 255 do
    local service, op = bit32.band(opcode, 0xe0), bit32.band(opcode, 0x1f)
    if service == SERVICE_UC then
        ROCE_INTERESTING[opcode] = RC_WRITE[op] ~= nil
    else
        ROCE_INTERESTING[opcode] = SERVICE_EXT[service] ~= nil
            and (RC_WRITE[op] ~= nil or RC_READ_RESPONSE[op] ~= nil or RC_INTERESTING[op] ~= nil)
    end
end

-- ``s``: the octets from the BTH on (at least 12).
local function read_bth(s)
    if #s < 12 then return end
    local opcode = s:byte(1)
    local service, op = bit32.band(opcode, 0xe0), bit32.band(opcode, 0x1f)
    local h = 13 + (SERVICE_EXT[service] or 0)
    local o = { t = "roce", psn = u32(s, 9) % U24, qp = u32(s, 5) % U24 }
    local pos = RC_WRITE[op]
    if pos then
        o.kind, o.pos = "write", pos
        if pos == "first" or pos == "only" then  -- RETH: VA, R_Key, DMA Length
            if #s < h + 15 then return end
            o.th, o.tl, o.stag = u32(s, h), u32(s, h + 4), u32(s, h + 8)
        end
        return o
    end
    pos = RC_READ_RESPONSE[op]
    if pos then
        o.kind, o.pos = "read_resp", pos
    elseif op == 0x0c then     -- RDMA READ Request: RETH
        if #s < h + 15 then return end
        o.kind, o.th, o.tl, o.stag = "read_req", u32(s, h), u32(s, h + 4), u32(s, h + 8)
    elseif op == 0x14 then     -- FETCH ADD: AtomicETH = VA, R_Key, Swap (Add) Data, Compare Data
        if #s < h + 27 then return end
        o.kind, o.th, o.tl, o.stag = "fetch_add", u32(s, h), u32(s, h + 4), u32(s, h + 8)
        o.ah, o.al = u32(s, h + 12), u32(s, h + 16)
    elseif op == 0x12 then     -- ATOMIC ACKNOWLEDGE: AETH, AtomicAckETH = Original Remote Data
        if #s < h + 11 then return end
        o.kind, o.oh, o.ol = "atomic_resp", u32(s, h + 4), u32(s, h + 8)
    else
        return
    end
    return o
end

-- iWARP: DDP (RFC 5041 s4) and RDMAP (RFC 5040 s4, RFC 7306 s5); ``s`` from the DDP header.
local IW_TAGGED = { [0x0] = "write", [0x2] = "read_resp" }
local IW_UNTAGGED = { [0x1] = 28, [0xa] = 52, [0xb] = 12 }  -- body octets after 18 of headers
local IW_INTERESTING = { [0x0] = true, [0x1] = true, [0x2] = true, [0xa] = true, [0xb] = true }
local IW_READ = 18 + 52  -- octets the longest of these needs
local IW_SEND = { [0x3] = true, [0x4] = true, [0x5] = true, [0x6] = true }  -- with SE, Invalidate

local function read_ddp(s)
    if #s < 14 then return end
    local ctrl, rctrl = s:byte(1, 2)
    -- DDP version 1, RDMAP version 1, reserved bits zero.
    if bit32.band(ctrl, 0x3f) ~= 0x01 or bit32.band(rctrl, 0xf0) ~= 0x40 then return end
    local op = bit32.band(rctrl, 0x0f)
    local o = { t = "iwarp", last = bit32.band(ctrl, 0x40) ~= 0 }
    if bit32.band(ctrl, 0x80) ~= 0 then  -- tagged: STag, TO
        o.kind = IW_TAGGED[op]
        if not o.kind then return end
        o.stag, o.th, o.tl = u32(s, 3), u32(s, 7), u32(s, 11)
        return o
    end
    local body = IW_UNTAGGED[op]
    if not body or #s < 18 + body then return end
    local p = 19
    if op == 0x1 then      -- Read Request: sink STag, sink TO, size, source STag, source TO
        o.kind = "read_req"
        o.sink_stag, o.sh, o.sl, o.size = u32(s, p), u32(s, p + 4), u32(s, p + 8), u32(s, p + 12)
        o.stag, o.th, o.tl = u32(s, p + 16), u32(s, p + 20), u32(s, p + 24)
    elseif op == 0xa then  -- Atomic Request: reserved and AOpCode, id, STag, TO, Add Data, Add Mask
        if bit32.band(s:byte(p + 3), 0x0f) ~= 0 then return end  -- FetchAdd only
        o.kind, o.id, o.stag = "fetch_add", u32(s, p + 4), u32(s, p + 8)
        o.th, o.tl, o.ah, o.al = u32(s, p + 12), u32(s, p + 16), u32(s, p + 20), u32(s, p + 24)
        o.mh, o.ml = u32(s, p + 28), u32(s, p + 32)
    else                   -- Atomic Response: original request id, original remote data
        o.kind, o.id, o.oh, o.ol = "atomic_resp", u32(s, p), u32(s, p + 4), u32(s, p + 8)
    end
    return o
end

-- A whole KBTP message in one Send FPDU of the frame ``tvb``: its DDP header at ``d``, after
-- the MPA ULPDU Length (RFC 5044 s4). Only a Send in one DDP segment (Last, MO 0).
local function send_of(tvb, d)
    if d < 2 or d + 18 + HEADER_SIZE > tvb:len() then return end
    local s = tvb:raw(d - 2, 20 + 12)
    local ulen = s:byte(1) * 256 + s:byte(2)
    local ctrl, rctrl = s:byte(3, 4)
    if bit32.band(ctrl, 0xff) ~= 0x41 or bit32.band(rctrl, 0xf0) ~= 0x40 or u32(s, 17) ~= 0 then return end
    if ulen < 18 + HEADER_SIZE or d + ulen > tvb:len() then return end
    local m = 21                               -- where the message starts in ``s``, 1-based
    local key = send_key(s:byte(m + AT.opcode), s:sub(m + AT.request_id, m + AT.request_id + 7))
    return { t = "iwarp", kind = "send", off = d + 18, len = ulen - 18, key = key }
end

-- ---- finding the headers ---------------------------------------------------------------------
local function last_of(...)
    local n = select("#", ...)
    if n > 0 then return (select(n, ...)) end
end

local function raw(tvb, off, want)
    local n = math.min(want, Tvb_len(tvb) - off)
    return n > 0 and Tvb_raw(tvb, off, n) or ""
end

-- With a protocol tree. Returns the operations and whether they are RoCEv2; false when the
-- frame has RDMA headers but none of interest, nil when no extractor answered.
local function ops_from_fields(tvb)
    local fi = armed_roce and last_of(X.bth_opcode())
    if fi then
        if not ROCE_INTERESTING[fi.value] then return false end
        -- The BTH lies in the frame itself: RoCEv2 reassembles nothing below it.
        return read_bth(raw(tvb, fi.offset, 44)) or false, true
    end
    if not armed_iwarp then return end
    local f1, f2 = Xr.iw_opcode()
    if not f1 then return end
    if not f2 then  -- one FPDU, the usual case
        if not IW_INTERESTING[f1.value] then return false end
        -- An FPDU may lie in a reassembled segment: read from the field's own source.
        return read_ddp(raw(f1.source, f1.offset - 1, IW_READ)) or false, false
    end
    local out, seen = {}, {}
    for _, f in ipairs({ Xr.iw_opcode() }) do
        local v = f.value
        if IW_INTERESTING[v] or IW_SEND[v] then
            local src, off = f.source, f.offset - 1
            local id = off .. "/" .. src:len()   -- fields added twice name one FPDU
            if not seen[id] then
                seen[id] = true
                if IW_INTERESTING[v] then
                    out[#out + 1] = read_ddp(raw(src, off, IW_READ))
                elseif src:len() == tvb:len() then  -- in the frame itself, not reassembled
                    out[#out + 1] = send_of(tvb, off)
                end
            end
        end
    end
    return out, false
end

-- Without a tree: Ethernet (802.1Q, 802.1ad) / IPv4 (unfragmented) or IPv6 / UDP or TCP.
local function transport_of(tvb)
    local len = tvb:len()
    if len < 14 then return end
    local off, et = 12, tvb:range(12, 2):uint()
    while (et == 0x8100 or et == 0x88a8) and off + 6 <= len do
        off = off + 4
        et = tvb:range(off, 2):uint()
    end
    off = off + 2
    -- The fourth value: the frame is cut short of the length its IP header gives.
    if et == 0x0800 and off + 20 <= len then
        local vihl = tvb:range(off, 1):uint()
        if bit32.rshift(vihl, 4) ~= 4 or bit32.band(tvb:range(off + 6, 2):uint(), 0x3fff) ~= 0 then return end
        local stop = off + tvb:range(off + 2, 2):uint()
        return tvb:range(off + 9, 1):uint(), off + 4 * bit32.band(vihl, 0xf), math.min(len, stop), stop > len
    elseif et == 0x86dd and off + 40 <= len then
        local stop = off + 40 + tvb:range(off + 4, 2):uint()
        return tvb:range(off + 6, 1):uint(), off + 40, math.min(len, stop), stop > len
    end
end

-- Start offsets of the ULPDUs of the FPDUs filling ``s`` exactly (RFC 5044 s4: ULPDU Length,
-- ULPDU, pad to 4, CRC when negotiated), or nil.
local function fpdus(s, crc)
    local starts, p, stop = {}, 0, #s
    while p + 2 <= stop do
        local a, b = s:byte(p + 1, p + 2)
        starts[#starts + 1] = p + 2
        p = p + 2 + a * 256 + b
        p = p + (4 - p % 4) % 4 + (crc and 4 or 0)
    end
    return p == stop and starts or nil
end

local function ops_from_bytes(tvb, pinfo)
    local proto, l4, stop, cut = transport_of(tvb)
    if proto == 17 and armed_roce and l4 + 8 <= stop and tvb:range(l4 + 2, 2):uint() == PORT_ROCEV2 then
        local s = raw(tvb, l4 + 8, 44)
        if #s < 12 or not ROCE_INTERESTING[s:byte(1)] then return end
        return read_bth(s), true
    elseif proto == 6 and armed_iwarp and l4 + 20 <= stop and not cut then
        -- A segment cut short by the snap length: tshark's MPA does not decode its FPDUs
        -- either (so with a tree, no field would be there).
        local p = l4 + 4 * bit32.rshift(tvb:range(l4 + 12, 1):uint(), 4)
        if p >= stop then return end
        local s, d = endpoints(pinfo, false)
        local flow = flows[s .. "|" .. d]
        if not flow then return end
        s = tvb:raw(p, stop - p)
        local r = flow.r
        local guess = r.mpa_crc ~= false
        local starts = fpdus(s, guess)
        if not starts then
            starts = fpdus(s, not guess)
            if starts then r.mpa_crc = not guess end
        end
        local out = {}
        starts = starts or {}
        for _, d in ipairs(starts) do
            local o = read_ddp(s:sub(d + 1, d + IW_READ))
            if not o and #starts > 1 then o = send_of(tvb, p + d) end
            out[#out + 1] = o
        end
        return out, false
    end
end

-- ---- matching (first pass) ---------------------------------------------------------------------
-- A label is what a frame shows; data labels are made once per transfer and shared.
local WHAT = { write = "RDMA Write", read_req = "RDMA Read Request", read_resp = "RDMA Read Response" }

local function data_label(e, kind)
    local memo = e.labels
    if not memo then
        memo = {}
        e.labels = memo
    end
    local m = memo[kind]
    if not m then
        m = { req = e.req, text = ", " .. WHAT[kind] .. " for " .. e.name .. " in frame " .. e.req,
              info = "KBTP data for " .. e.req, st = e.st }
        memo[kind] = m
    end
    return m
end

local STREAM_TO_INI, STREAM_READ = U24, 2 * U24

local function match_roce(r, o, to_ini)
    local kind, pos = o.kind, o.pos
    if kind == "write" or kind == "read_resp" then
        -- Within a connection the destination QP and the direction name the stream.
        local ck = o.qp + (to_ini and STREAM_TO_INI or 0) + (kind == "write" and 0 or STREAM_READ)
        if pos == "first" or pos == "only" then
            local e
            if kind == "write" then
                e = to_ini and find(r.xfers, o.stag, o.th, o.tl, "write")
            else
                e = not to_ini and r.reads[o.psn]  -- responses leave the initiator
                if e then r.reads[o.psn] = nil end
            end
            if not e then
                r.cur[ck] = nil
                return
            end
            local m = data_label(e, kind)
            r.cur[ck] = pos == "first" and { req = e.req, label = m, next = (o.psn + 1) % U24 } or nil
            return m
        end
        local c = r.cur[ck]
        if not c then return end
        if c.next ~= o.psn or pos == "last" then r.cur[ck] = nil end
        if c.next ~= o.psn then return end
        c.next = (o.psn + 1) % U24
        return c.label
    elseif kind == "read_req" then
        local e = to_ini and find(r.xfers, o.stag, o.th, o.tl, "read")
        if not e then return end
        -- The responses come back from the initiator, numbered from the request's PSN.
        r.reads[o.psn] = e
        return data_label(e, kind)
    end
end

local function match_iwarp(r, o, to_ini)
    local kind = o.kind
    if kind == "write" then
        local e = to_ini and find(r.xfers, o.stag, o.th, o.tl, "write")
        return e and data_label(e, kind)
    elseif kind == "read_req" then
        local e = to_ini and find(r.xfers, o.stag, o.th, o.tl, "read")
        if not e then return end
        -- The Read Response is tagged with the request's sink STag and TO.
        push(r.sinks, expectation(e.req, e.name, o.sink_stag, o.sh, o.sl, o.size, e.st))
        return data_label(e, kind)
    elseif kind == "read_resp" and not to_ini then
        local e = find(r.sinks, o.stag, o.th, o.tl)
        if not e then return end
        if o.last then drop_request(r.sinks, e.req) end
        return data_label(e, kind)
    end
end

local function match_ring(r, o, to_ini, number)
    local ring = r.ring
    if not ring then return end
    local masked = o.t == "iwarp"
    if o.kind == "fetch_add" then
        if to_ini or o.stag ~= ring.stag or o.th ~= ring.h or o.tl ~= ring.l then return end
        r.atomics[masked and o.id or o.psn] = { req = number }
        local want_h, want_l = MASKED_H, MASKED_L
        local mh, ml = 0, 0
        if masked then mh, ml = ring_mask(ring.n) else want_h, want_l = UNMASKED_H, UNMASKED_L end
        local m = { ring = "request", text = ", FetchAdd on the ring Head of the HELLO_ACK in frame " .. ring.frame,
                    info = "KBTP ring Head FetchAdd" }
        if o.ah ~= want_h or o.al ~= want_l or (masked and (o.mh ~= mh or o.ml ~= ml)) then
            m.problem = "Add Data " .. hex64(o.ah, o.al)
                .. (masked and (", Add Mask " .. hex64(o.mh, o.ml)) or "")
                .. "; a ring counter takes Add Data " .. hex64(want_h, want_l)
                .. (masked and (", Add Mask " .. hex64(mh, ml)) or "")
                .. string.format(" (N = %d)", ring.count)
            m.info = "KBTP ring Head FetchAdd: wrong Add Data or Add Mask"
        end
        return m
    elseif o.kind == "atomic_resp" then
        local k = masked and o.id or o.psn
        local a = r.atomics[k]
        if not a or not to_ini then return end
        r.atomics[k] = nil
        -- Ticket in bits 63-32 (RING.ticket_shift); the Slot Offset in the low n+4 bits when
        -- masked, else computed as 16 * (ticket mod N) (kbtp-draft, InfiniBand and RoCEv2).
        assert(RING.ticket_shift == 32)
        local ticket, slot = o.oh, nil
        if masked then
            slot = math.floor(o.ol % 2 ^ (ring.n + 4))
        else
            slot = math.floor(RING.slot_size * (ticket % 2 ^ ring.n))
        end
        return { ring = "response", req = a.req, ticket = ticket, slot = slot,
                 text = ", ring Head FetchAdd of frame " .. a.req .. ": Ticket " .. ticket
                        .. ", Slot Offset " .. slot,
                 info = "KBTP ticket=" .. ticket .. " slot=" .. slot }
    end
end

local function label(flow, o, number)
    if o.kind == "fetch_add" or o.kind == "atomic_resp" then
        return match_ring(flow.r, o, flow.to_ini, number)
    end
    return (o.t == "roce" and match_roce or match_iwarp)(flow.r, o, flow.to_ini)
end

-- ---- the postdissector ---------------------------------------------------------------------------
local rdma_context = Proto("kbtp_rdma", "KBTP RDMA context (block data and ring counters)")

local TITLE = kbtp.description
local Tree_set_hidden, Tree_add_expert = TreeItem.set_hidden, TreeItem.add_proto_expert_info

-- The item's whole text in one call, made once per label (labels are shared).
local function show_one(m, tree)
    local title = m.title
    if not title then
        title = TITLE .. m.text
        m.title = title
    end
    local item = Tree_add(tree, kbtp, title)
    if m.ring == "response" then
        Tree_set_generated(Tree_add(item, F["ring.ticket"], m.ticket))
        Tree_set_generated(Tree_add(item, F["ring.slot_offset"], m.slot))
    elseif m.ring == nil then
        Tree_set_generated(Tree_add(item, F.data_for, m.req))
    elseif m.problem then
        Tree_add_expert(item, E.ring, m.problem)
    end
    return m.info
end

-- ``mark``: one label, or { many = { labels } } for a segment holding several FPDUs.
-- A hidden kbtp_rdma item tells these frames from those carrying KBTP messages
-- (`kbtp && !kbtp_rdma`), and finds them all (`kbtp_rdma`).
local function show(mark, pinfo, tree)
    Tree_set_hidden(Tree_add(tree, rdma_context))
    local info
    if mark.many then
        local notes = {}
        for i, m in ipairs(mark.many) do notes[i] = show_one(m, tree) end
        info = table.concat(notes, "; ")
    else
        info = show_one(mark, tree)
    end
    pinfo.cols.info:append(" [" .. info .. "]")
end

-- ---- the second Send of a segment (iWARP) -------------------------------------------------------
-- tshark 4.0 reassembles iWARP Sends per segment and hands a heuristic only the first Send
-- that a TCP segment completes; the others of that segment are dissected as DDP/RDMAP and
-- never offered. They are decoded here with runtime.lua's dissect_more: every Send FPDU of
-- a segment that holds several, less those the heuristics decoded (by opcode and Request ID).
local function show_more(list, tvb, pinfo, tree)
    local infos = { frame_info(pinfo.number) }
    for _, e in ipairs(list) do
        infos[#infos + 1] = dissect_more(tvb:range(e.off, e.len):tvb(), pinfo, tree, e.st)
    end
    pinfo.cols.protocol = "KBTP"
    pinfo.cols.info = table.concat(infos, "; ")
end

local function more_sends(candidates, seen, tvb, pinfo, tree)
    local n = pinfo.number
    local found
    for _, o in ipairs(candidates) do
        local c = seen and seen[o.key]
        if c and c > 0 then
            seen[o.key] = c - 1
        else
            found = found or {}
            found[#found + 1] = { off = o.off, len = o.len, st = { more = true } }
        end
    end
    if not found then return end
    -- Decode (and track) in capture order; keep only what was KBTP.
    local infos, kept = { frame_info(n) }, {}
    for _, e in ipairs(found) do
        local info = dissect_more(tvb:range(e.off, e.len):tvb(), pinfo, tree, e.st)
        if info then
            infos[#infos + 1] = info
            kept[#kept + 1] = e
        end
    end
    if #kept == 0 then return end
    extras[n] = kept
    pinfo.cols.protocol = "KBTP"
    pinfo.cols.info = table.concat(infos, "; ")
end

-- ---- payloads the heuristics deferred (runtime.lua's defer()) ---------------------------------
local ROCEV1 = 0x8915

-- The BTH opcode and PadCnt of a RoCEv2 or RoCEv1 frame, or nil.
local function bth_of(tvb)
    local proto, l4, stop = transport_of(tvb)
    local b
    if proto == 17 and l4 + 12 <= stop and tvb:range(l4 + 2, 2):uint() == PORT_ROCEV2 then
        b = l4 + 8
    elseif proto == nil and Tvb_len(tvb) >= 14 + 40 + 12 and tvb:range(12, 2):uint() == ROCEV1 then
        b = 14 + 40                              -- Ethernet, GRH, BTH
    else
        return nil
    end
    local opcode, flags = Tvb_raw(tvb, b, 2):byte(1, 2)
    return opcode, bit32.band(bit32.rshift(flags, 4), 3)
end

-- iWARP: whether an untagged Send's headers (DDP 6, RDMAP 12 octets) end at ``off``.
local function after_send_header(tvb, off)
    if off < 18 then return false end
    local ctrl, rctrl = Tvb_raw(tvb, off - 18, 2):byte(1, 2)
    return bit32.band(ctrl, 0xbf) == 0x01 and bit32.band(rctrl, 0xf0) == 0x40
        and IW_SEND[bit32.band(rctrl, 0x0f)] == true
end

-- ---- the ICRC (tshark 4.0 shows infiniband.invariant.crc but never checks it) -------------
-- As runtime.c's check_icrc: CRC-32 over 8 octets of ones, the network header with its
-- variant fields set to ones, the UDP header with its checksum set to ones (RoCEv2), the
-- BTH with its reserved octet set to ones, and the rest up to the ICRC. First pass only.
-- Slicing by 4 (four tables): per 4 octets one string.byte and two bit32.bxor calls, the
-- octets split with arithmetic, which costs next to nothing beside a call into C.
local CRC0, CRC1, CRC2, CRC3 = {}, {}, {}, {}
for i = 0, 255 do
    local c = i
    for _ = 1, 8 do
        if c % 2 == 1 then c = bit32.bxor((c - 1) / 2, 0xEDB88320) else c = c / 2 end
    end
    CRC0[i] = c
end
for i = 0, 255 do
    local c1 = bit32.bxor(CRC0[CRC0[i] % 256], (CRC0[i] - CRC0[i] % 256) / 256)
    local c2 = bit32.bxor(CRC0[c1 % 256], (c1 - c1 % 256) / 256)
    CRC1[i], CRC2[i] = c1, c2
    CRC3[i] = bit32.bxor(CRC0[c2 % 256], (c2 - c2 % 256) / 256)
end

local function crc32(s, crc)
    local bxor, byte = bit32.bxor, string.byte
    crc = bit32.bnot(crc or 0)
    local n = #s
    local i = 1
    while i + 3 <= n do
        local a, b, c, d = byte(s, i, i + 3)
        local x = bxor(crc, a + b * 256 + c * 65536 + d * 16777216)
        local x0 = x % 256
        x = (x - x0) / 256
        local x1 = x % 256
        x = (x - x1) / 256
        local x2 = x % 256
        crc = bxor(CRC3[x0], CRC2[x1], CRC1[x2], CRC0[(x - x2) / 256])
        i = i + 4
    end
    for j = i, n do
        local x = bxor(crc, byte(s, j)) % 256
        crc = bxor(CRC0[x], (crc - crc % 256) / 256)
    end
    return bit32.bnot(crc)
end
local LRH_CRC = crc32(string.rep("\255", 8))

local function set(s, i, octets)  -- ``s`` with the octets at 0-based ``i`` replaced
    return s:sub(1, i) .. octets .. s:sub(i + #octets + 1)
end

-- { got, want } of a RoCE frame's ICRC, or nil when the frame is cut short or not RoCE.
-- One read of the frame's octets; the rest is string arithmetic.
local function icrc_of(tvb)
    local len = Tvb_len(tvb)
    if len < 14 or tvb:reported_len() ~= len then return nil end
    local s = Tvb_raw(tvb, 0, len)
    local function u16(i) local a, b = s:byte(i + 1, i + 2) return a * 256 + b end
    local off, et = 12, u16(12)
    while (et == 0x8100 or et == 0x88a8) and off + 6 <= len do
        off = off + 4
        et = u16(off)
    end
    local net, bth, stop = off + 2
    if et == 0x0800 and net + 20 <= len then
        local vihl = s:byte(net + 1)
        local ihl = 4 * (vihl % 16)
        if vihl - vihl % 16 ~= 0x40 or s:byte(net + 10) ~= 17 or ihl < 20 then return nil end
        bth, stop = net + ihl + 8, net + u16(net + 2)
    elseif et == 0x86dd and net + 40 <= len then
        if s:byte(net + 7) ~= 17 then return nil end
        bth, stop = net + 48, net + 40 + u16(net + 4)
    elseif et == ROCEV1 and net + 40 <= len then
        bth, stop = net + 40, net + 40 + u16(net + 4)
    else
        return nil
    end
    if stop > len or stop < bth + 16 or (et ~= ROCEV1 and u16(bth - 6) ~= PORT_ROCEV2) then return nil end
    local h = s:sub(net + 1, bth + 12)
    if et == 0x0800 then
        h = set(set(set(h, 1, "\255"), 8, "\255"), 10, "\255\255")
    else
        h = set(set(h, 0, string.char(bit32.bor(h:byte(1), 0x0f)) .. "\255\255\255"), 7, "\255")
    end
    if et ~= ROCEV1 then h = set(h, bth - net - 2, "\255\255") end
    h = set(h, bth - net + 4, "\255")
    local want = crc32(s:sub(bth + 13, stop - 4), crc32(h, LRH_CRC))
    local a, b, c, d = s:byte(stop - 3, stop)
    return { got = ((d * 256 + c) * 256 + b) * 256 + a, want = want }
end

local function show_icrc(st)
    local v = st.icrc
    if v and v.got ~= v.want and st.root then
        Tree_add_expert(st.root, E.icrc, string.format(
            "ICRC 0x%08x is wrong (0x%08x is right): the receiving NIC drops this packet", v.got, v.want))
    end
end

local function resolve_deferred(list, tvb, pinfo, tree)
    for _, d in ipairs(list) do
        local off, n = d.off, d.n
        -- In the frame itself (not a reassembled Send): the headers before it say what it is.
        local framed = off + n <= Tvb_len(tvb) and Tvb_raw(tvb, off, #d.head) == d.head
        if d.roce then
            resolve(tvb:range(off, n):tvb(), pinfo, tree, true, bth_of(tvb))
        elseif not framed then
            -- Reassembled: by iWARP (Sends only; the message starts its tvb) or by TCP for
            -- MPA (the FPDU starts its tvb: 2 octets of ULPDU Length, then 18 octets of
            -- untagged or 14 of tagged headers). A tagged payload starts at 16.
            if off ~= 2 + 14 then resolve(d.data:tvb("Reassembled KBTP message"), pinfo, tree, false) end
        elseif after_send_header(tvb, off) then
            resolve(tvb:range(off, n):tvb(), pinfo, tree, false)
        end
    end
end

function rdma_context.dissector(tvb, pinfo, tree)
    local later = deferred_of(pinfo.number)
    if later then resolve_deferred(later, tvb, pinfo, tree) end
    local st = frames[pinfo.number]
    if st and st.roce and st.kbtp then
        if not pinfo.visited then st.icrc = pref_check_icrc and icrc_of(tvb) or false end
        show_icrc(st)
    end
    if not armed then return end  -- no KBTP session expecting RDMA: nothing marked either
    local n = pinfo.number
    if claimed == n then return end  -- a RoCEv2 frame that carried a KBTP message
    if pinfo.visited then
        local more = extras[n]
        if more then show_more(more, tvb, pinfo, tree) end
        local mark = marks[n]
        if mark then show(mark, pinfo, tree) end
        return
    end
    local ops, roce = ops_from_fields(tvb)
    if ops == nil and tree.text == nil then  -- no protocol tree, so no field values
        ops, roce = ops_from_bytes(tvb, pinfo)
    end
    local seen = sends[n]
    if seen then sends[n] = nil end
    if not ops then return end
    local s, d = endpoints(pinfo, roce)
    local flow = flows[s .. "|" .. d]
    if not flow then return end
    if ops.kind then ops = { ops } end  -- one operation, or the list of a segment's FPDUs
    local mark, candidates
    for _, o in ipairs(ops) do
        local m
        if o.kind == "send" then
            candidates = candidates or {}
            candidates[#candidates + 1] = o
        else
            m = label(flow, o, n)
        end
        if m then
            local req = m.st   -- the request lists its data frames, once each
            if req then
                local list = req.data_in or {}
                req.data_in = list
                if list[#list] ~= n then list[#list + 1] = n end
            end
            if not mark then
                mark = m
            elseif mark.many then
                mark.many[#mark.many + 1] = m
            else
                mark = { many = { mark, m } }
            end
        end
    end
    if candidates then more_sends(candidates, seen, tvb, pinfo, tree) end
    if mark then
        marks[n] = mark
        if tree.text ~= nil then show(mark, pinfo, tree) end  -- without a tree, nothing to show
    end
end

register_postdissector(rdma_context)

end
