-- Interprets the generated layouts (HEADER, MESSAGES, FLAGSETS, FMT): recognition,
-- field tree, Info column, expert info, sessions and request/response tracking.
-- Holds no layout of its own. Wireshark 4.0 / Lua 5.2.

local E = {
    status = ProtoExpert.new("kbtp.expert.status", "KBTP non-OK status",
                             expert.group.RESPONSE_CODE, expert.severity.WARN),
    malformed = ProtoExpert.new("kbtp.expert.malformed", "Malformed KBTP message",
                                expert.group.MALFORMED, expert.severity.ERROR),
    undefined_flags = ProtoExpert.new("kbtp.expert.undefined_flags", "Undefined flag bits set",
                                      expert.group.PROTOCOL, expert.severity.NOTE),
    unanswered = ProtoExpert.new("kbtp.expert.no_request", "Answer to a request not seen",
                                 expert.group.SEQUENCE, expert.severity.NOTE),
    credits = ProtoExpert.new("kbtp.expert.credits", "More requests outstanding than Request Credits",
                              expert.group.SEQUENCE, expert.severity.WARN),
    ring = ProtoExpert.new("kbtp.expert.ring", "FetchAdd on a ring counter with the wrong Add Data or Add Mask",
                           expert.group.PROTOCOL, expert.severity.WARN),
}
kbtp.experts = { E.status, E.malformed, E.undefined_flags, E.unanswered, E.credits, E.ring }

local fieldlist = {}
for _, f in pairs(F) do fieldlist[#fieldlist + 1] = f end
kbtp.fields = fieldlist

kbtp.prefs.addr_le = Pref.enum("Address byte order (auto: follow HELLO_ACK; on: ADDR_LE; off: network)",
    1, "Byte order of address fields for sessions whose HELLO_ACK is not in the capture",
    { { 1, "auto", 1 }, { 2, "on", 2 }, { 3, "off", 3 } }, false)

-- RDMA context, read with field extractors (the C structs do not reach Lua).
local X = {
    bth_opcode = Field.new("infiniband.bth.opcode"),
    bth_padcnt = Field.new("infiniband.bth.padcnt"),
}

local function last_value(...)
    local n = select("#", ...)
    if n == 0 then return nil end
    return (select(n, ...)).value
end

-- The last value an extractor has for this frame (some fields are added twice).
local function last(extractor)
    return last_value(extractor())
end

-- ---- state: filled only when not pinfo.visited, cleared in init ----------------------
local conns   -- conversation key -> { le, credits, outstanding, pending = {[rid] = req} }
local frames  -- frame number -> per-frame result (kept for revisits: -2, GUI)
local reasm   -- RoCEv2 Send reassembly, per direction and QP
local HOOKS = {}  -- functions(conn, st, values, msg, pinfo) run on first pass after a message

local function reset()
    conns, frames, reasm = {}, {}, {}
    for _, hook in ipairs(HOOKS) do
        if hook.init then hook.init() end
    end
end
kbtp.init = reset
reset()

local function endpoint(addr, port)
    return tostring(addr) .. ((port and port ~= 0xffffffff) and (":" .. port) or "")
end

-- Both directions of a connection share one key. On RoCEv2 without the CM exchange the
-- two directions name different QPs, so the address pair stands for the session.
local function conn_key(pinfo, roce, src, dst)
    local a, b
    if roce then
        a, b = src or tostring(pinfo.src), dst or tostring(pinfo.dst)
    else
        a, b = endpoint(pinfo.src, pinfo.src_port), endpoint(pinfo.dst, pinfo.dst_port)
    end
    if a > b then a, b = b, a end
    return (roce and "roce " or "iwarp ") .. a .. " " .. b
end

local function conn_of(key)
    local c = conns[key]
    if not c then
        c = { pending = {}, outstanding = 0 }
        conns[key] = c
    end
    return c
end

-- ---- layout walking --------------------------------------------------------------------
local function present(item, values)
    if not item.when then return true end
    local word = values[item.when[1]]
    return word ~= nil and bit32.band(word, item.when[2]) ~= 0
end

local function value_of(range, size, le)
    if size > 8 then return range:bytes() end
    if size == 8 then return le and range:le_uint64() or range:uint64() end
    return le and range:le_uint() or range:uint()
end

-- Walk ``items`` from ``off`` over the first ``ctx.len`` octets of ``tvb``; add to ``tree``
-- when given. Returns the offset reached and whether the message ended before a fixed
-- field did.
local function walk(items, tvb, off, tree, ctx)
    local len = ctx.len
    for _, item in ipairs(items) do
        if present(item, ctx.values) then
            if item.member then
                if off >= len then return off, true end
                local sub = tree and tree:add(tvb:range(off, math.min(item.size, len - off)), item.title)
                local truncated
                off, truncated = walk(item.items, tvb, off, sub, ctx)
                if truncated then return off, true end
            elseif item.size == 0 then
                local n = len - off
                ctx.values[item.key] = n
                ctx.tail = item
                if tree and n > 0 then tree:add(F[item.key], tvb:range(off, n)) end
                off = len
            else
                if off + item.size > len then return off, true end
                local range = tvb:range(off, item.size)
                local le = ctx.le and item.order == "A"
                local value = value_of(range, item.size, le)
                ctx.values[item.key] = value
                if tree then
                    local ti = le and tree:add_le(F[item.key], range) or tree:add(F[item.key], range)
                    local set = item.flagset
                    if set == true then set = ctx.msg and ctx.msg.flagset end
                    if set then
                        for _, bit in ipairs(FLAGSETS[set].bits) do
                            ti:add(F[item.key .. "." .. bit[3]], range)
                        end
                    end
                end
                off = off + item.size
            end
        end
    end
    return off, false
end

-- ---- recognition and decoding ------------------------------------------------------------
local function opcode_known(op)
    return MESSAGES[op] ~= nil or (op >= PRIVATE_OPCODES[1] and op <= PRIVATE_OPCODES[2])
end

-- Read one message from the first ``len`` octets of ``tvb`` (into ``tree`` when given):
-- the context holds the values, the offset reached, truncation and the inline tail.
local function read_message(tvb, len, msg, le, tree)
    local ctx = { values = {}, le = le and (msg == nil or msg.addr_le), msg = msg, len = len }
    local off, truncated = walk(HEADER, tvb, 0, tree, ctx)
    if msg and not truncated then off, truncated = walk(msg.items, tvb, off, tree, ctx) end
    ctx.off, ctx.truncated = off, truncated
    return ctx
end

-- What is wrong with the layout a read found, or nil.
local function problem_of(ctx)
    local msg = ctx.msg
    if ctx.truncated then
        return string.format("truncated: %d octets, %s with these flags needs more", ctx.len, msg.name)
    end
    if ctx.tail then
        local declared = ctx.values[ctx.tail.length_from]
        if declared ~= ctx.values[ctx.tail.key] then
            return string.format("inline data is %d octets, the descriptor says %s",
                                 ctx.values[ctx.tail.key], tostring(declared))
        end
    elseif ctx.off < ctx.len then
        return string.format("%d octets after the end of %s", ctx.len - ctx.off, msg.name)
    end
end

-- Length of the whole message a read found: the fixed part plus the inline data it
-- declares; nil when the fixed part is not all there.
local function declared_of(ctx)
    if ctx.truncated then return nil end
    if ctx.tail then return ctx.off - ctx.values[ctx.tail.key] + ctx.values[ctx.tail.length_from] end
    return ctx.off
end

-- Version 1 and a known or Private Use opcode: the cheap test before any other. Returns
-- the opcode, or nil.
local function header_ok(tvb, len)
    if len < HEADER_SIZE then return nil end
    local word = tvb:range(0, 2):uint()
    local op = word % 256
    if (word - op) / 256 ~= VERSION or not opcode_known(op) then return nil end
    return op
end

-- Strict recognition: Version 1, a known or Private Use opcode, and a layout that fits the
-- opcode, flags and descriptors. Inside a conversation already known to carry KBTP, a
-- message with a wrong layout is still claimed (and marked malformed).
local function recognise(tvb, len, conn)
    local op = header_ok(tvb, len)
    if not op then return false end
    if conn and conn.kbtp then return true end
    local msg = MESSAGES[op]
    return msg ~= nil and problem_of(read_message(tvb, len, msg, false)) == nil
end

-- The first packet of a multi-packet Send: a header whose inline data continues past it.
local function continues(ctx)
    return not ctx.truncated and ctx.tail ~= nil and ctx.values[ctx.tail.key] < ctx.values[ctx.tail.length_from]
end

local function show(key, value)
    local fmt = FMT[key] or "dec"
    if fmt == "hex" then
        if type(value) == "number" then return string.format("0x%x", value) end
        local hex = value:tohex():gsub("^0+", "")
        return "0x" .. (hex == "" and "0" or hex)
    elseif fmt:sub(1, 5) == "enum:" then
        for _, row in ipairs(ENUMS[fmt:sub(6)]) do
            if value >= row[1] and value <= row[2] then
                return row[1] == row[2] and row[3] or string.format("%s (0x%x)", row[3], value)
            end
        end
        return string.format("Unknown (0x%x)", value)
    elseif fmt:sub(1, 6) == "flags:" then
        local names = {}
        for _, bit in ipairs(FLAGSETS[fmt:sub(7)].bits) do
            if bit32.band(value, bit[1]) ~= 0 then names[#names + 1] = bit[2] end
        end
        return #names > 0 and table.concat(names, "+") or "0"
    end
    return tostring(value)
end

local function summary(msg, op, values)
    if not msg then
        return string.format("%s rid=%s", show("opcode", op), tostring(values.request_id))
    end
    local parts = { msg.name }
    for _, pair in ipairs(msg.summary) do
        local v = values[pair[2]]
        if v ~= nil then
            parts[#parts + 1] = pair[1] ~= "" and (pair[1] .. "=" .. show(pair[2], v)) or show(pair[2], v)
        end
    end
    if msg.flagset and values.flags then
        for _, bit in ipairs(FLAGSETS[msg.flagset].bits) do
            if bit32.band(values.flags, bit[1]) ~= 0 then parts[#parts + 1] = bit[2] end
        end
    end
    return table.concat(parts, " ")
end

local function nstime(seconds)
    local s = math.floor(seconds)
    return NSTime.new(s, math.floor((seconds - s) * 1e9 + 0.5))
end

-- First pass only: session state and request/response tracking for one message.
local function track(pinfo, conn, st, msg, values)
    local op = values.opcode
    if op == OPCODE.HELLO_ACK and values.status == STATUS_OK then
        local feats = values["hello_ack.features"] or 0
        conn.le = bit32.band(feats, FEATURE.ADDR_LE) ~= 0
        conn.credits = values["hello_ack.request_credits"]
    end
    if not msg then return end
    local rid = tostring(values.request_id)
    if msg.answer then
        conn.pending[rid] = { frame = pinfo.number, st = st, ts = pinfo.abs_ts, answer = msg.answer }
        if msg.answer == OPCODE.COMPLETION then
            conn.outstanding = conn.outstanding + 1
            if conn.credits and conn.outstanding > conn.credits then
                st.over_credits = conn.outstanding
            end
        end
    elseif op == OPCODE.COMPLETION or op == OPCODE.HELLO_ACK then
        local req = conn.pending[rid]
        if req and req.answer == op then
            conn.pending[rid] = nil
            st.request_in, st.delta = req.frame, pinfo.abs_ts - req.ts
            req.st.response_in = pinfo.number      -- the request's own state: two may share a frame
            if op == OPCODE.COMPLETION then conn.outstanding = conn.outstanding - 1 end
        else
            st.unanswered = true
        end
    end
    for _, hook in ipairs(HOOKS) do
        if hook.message then hook.message(conn, st, values, msg, pinfo) end
    end
end

-- Decode one whole KBTP message, the first ``len`` octets of ``tvb``, into ``tree``;
-- ``st`` is its per-frame state.
local function dissect_message(tvb, len, pinfo, tree, key, st)
    local conn = conn_of(key)
    local op = tvb:range(1, 1):uint()
    local msg = MESSAGES[op]
    if not pinfo.visited then
        conn.kbtp = true
        local pref = kbtp.prefs.addr_le
        st.le = (pref == 2) or (pref == 1 and conn.le == true)
    end
    local root = tree:add(kbtp, tvb:range(0, len))
    local ctx = read_message(tvb, len, msg, st.le, root)
    local values = ctx.values
    local problem = msg and problem_of(ctx)
    if not pinfo.visited then track(pinfo, conn, st, msg, values) end

    if st.le then root:add(F["session.addr_le"], true):set_generated() end
    if st.request_in then
        root:add(F.request_in, st.request_in):set_generated()
        root:add(F.time, nstime(st.delta)):set_generated()
    end
    if st.response_in then root:add(F.response_in, st.response_in):set_generated() end
    if problem then root:add_proto_expert_info(E.malformed, problem) end
    if msg and msg.flagset and values.flags then
        local extra = bit32.band(values.flags, bit32.bnot(FLAGSETS[msg.flagset].defined))
        if extra ~= 0 then
            root:add_proto_expert_info(E.undefined_flags, string.format("undefined flag bits 0x%04x", extra))
        end
    end
    if (op == OPCODE.COMPLETION or op == OPCODE.HELLO_ACK) and values.status and values.status ~= STATUS_OK then
        root:add_proto_expert_info(E.status, show("status", values.status))
    end
    if st.unanswered then root:add_proto_expert_info(E.unanswered) end
    if st.over_credits then
        root:add_proto_expert_info(E.credits, string.format("%d requests outstanding, %d credits",
                                                            st.over_credits, conn.credits or 0))
    end
    local info = summary(msg, op, values)
    if problem then info = info .. " [Malformed]" end
    root:append_text(", " .. info)
    st.info = info
    return info
end

local function set_columns(pinfo, info)
    pinfo.cols.protocol = "KBTP"
    pinfo.cols.info = info
end

-- ---- entry points -------------------------------------------------------------------------
local SEND_FIRST, SEND_MIDDLE = 0x00, 0x01
local SEND_LAST = { [0x02] = true, [0x03] = true, [0x16] = true }
local SEND_ONLY = { [0x04] = true, [0x05] = true, [0x17] = true, [0x64] = true, [0x65] = true }
local PATH_MTUS = { [256] = true, [512] = true, [1024] = true, [2048] = true, [4096] = true }

local function frame_state(pinfo)
    local st = frames[pinfo.number]
    if not st then
        st = {}
        frames[pinfo.number] = st
    end
    return st
end

-- "first", "middle", "last" or "only" for a Send's BTH opcode; false for other opcodes.
local function send_kind(opcode)
    if SEND_ONLY[opcode] then return "only" end
    if SEND_LAST[opcode] then return "last" end
    if opcode < 0x40 and bit32.band(opcode, 0x1f) == SEND_FIRST then return "first" end
    if opcode < 0x40 and bit32.band(opcode, 0x1f) == SEND_MIDDLE then return "middle" end
    return false
end

-- First sight of a RoCEv2 / InfiniBand payload: is it (part of) a KBTP Send? Works from
-- lengths, because a first pass without a tree (tshark -2) gets no BTH fields: FIRST and
-- MIDDLE packets carry exactly one path MTU and no pad; LAST carries the rest plus the pad
-- to 4 octets; ONLY the whole message plus its pad. BTH fields, when there, must agree.
local function classify_roce(tvb, pinfo, key, src, dst)
    local n = tvb:len()
    local opcode = last(X.bth_opcode)
    local kind = opcode and send_kind(opcode)
    if kind == false then return nil end
    local dir = src .. ">" .. dst .. "/" .. pinfo.dst_port
    local r = reasm[dir]
    if r then
        if kind ~= "last" and kind ~= "only" and kind ~= "first" and n == r.mtu and r.remaining > r.mtu then
            r.data:append(tvb:range(0, n):bytes())
            r.remaining = r.remaining - n
            r.frames[#r.frames + 1] = pinfo.number
            local st = frame_state(pinfo)
            st.fragment = true
            return st
        elseif (kind == nil or kind == "last") and n == r.remaining + (-r.remaining) % 4 then
            r.data:append(tvb:range(0, r.remaining):bytes())
            reasm[dir] = nil
            local st = frame_state(pinfo)
            st.message = r.data
            for _, number in ipairs(r.frames) do frames[number].fragment_in = pinfo.number end
            return st
        end
        reasm[dir] = nil
        -- A Send we claimed the start of goes on, but not as its header said (a length lie,
        -- a lost, repeated or reordered packet): claim what continues it, so that no other
        -- heuristic gets a Send LAST without its FIRST (RPC-over-RDMA then fails an assertion
        -- on a second pass), until a packet shorter than the path MTU ends it.
        if kind == "middle" or kind == "last" or (kind == nil and not header_ok(tvb, n)) then
            if n >= r.mtu and kind ~= "last" then reasm[dir] = r end
            local st = frame_state(pinfo)
            st.fragment, st.broken = true, true
            return st
        end
    end
    local op = kind ~= "middle" and kind ~= "last" and header_ok(tvb, n)
    if not op then return nil end
    local conn = conns[key]
    local msg = MESSAGES[op]
    local pad = kind == "only" and last(X.bth_padcnt) or nil
    if pad == nil and msg then     -- a first packet, or no BTH fields: the header decides
        local ctx = read_message(tvb, n, msg, (conn and conn.le) or kbtp.prefs.addr_le == 2)
        local declared = declared_of(ctx)
        -- the whole message plus the pad to 4 octets: a Send ONLY, whatever its length
        local exact = declared and n >= declared and n - declared == (-declared) % 4
        if (kind == "first" or (kind == nil and PATH_MTUS[n])) and
                (continues(ctx) or (conn and conn.kbtp and not exact)) then
            reasm[dir] = { data = tvb:range(0, n):bytes(), mtu = n, frames = { pinfo.number },
                           remaining = declared and declared > n and declared - n or 0 }
            local st = frame_state(pinfo)
            st.fragment = true
            return st
        end
        if exact then pad = n - declared end
    end
    if kind == "first" or not recognise(tvb, n - (pad or 0), conn) then return nil end
    local st = frame_state(pinfo)
    st.len, st.pad_unknown = n - (pad or 0), pad == nil
    return st
end

-- RoCEv2 / InfiniBand: Sends reach us packet by packet with their pad; reassemble
-- FIRST/MIDDLE/LAST per direction and QP, and claim every fragment, so no other
-- heuristic misreads the continuation packets.
local function heur_infiniband(tvb, pinfo, tree)
    if tvb:len() == 0 then return false end
    local st = frames[pinfo.number]
    if pinfo.visited and not (st and st.kbtp) then return false end
    local src, dst = tostring(pinfo.src), tostring(pinfo.dst)
    local key = conn_key(pinfo, true, src, dst)
    if not pinfo.visited then
        st = classify_roce(tvb, pinfo, key, src, dst)
        if not st then return false end
        st.kbtp = true
    end
    if st.len then               -- one packet: dissect it in place
        local pad = st.pad_unknown and last(X.bth_padcnt)
        if pad and pad > 0 and pad < st.len then   -- first seen without BTH fields
            st.len, st.pad_unknown = st.len - pad, false
        end
        set_columns(pinfo, dissect_message(tvb, st.len, pinfo, tree, key, st))
    elseif st.message then       -- reassembled: a new data source
        local msg_tvb = st.message:tvb("Reassembled KBTP message")
        set_columns(pinfo, dissect_message(msg_tvb, msg_tvb:len(), pinfo, tree, key, st))
    else
        local item = tree:add(kbtp, tvb:range(0, tvb:len()), "KBTP fragment")
        if st.fragment_in then item:add(F.fragment_in, st.fragment_in):set_generated() end
        if st.broken then
            item:add_proto_expert_info(E.malformed, "Send fragment that does not continue the message as its header said")
        end
        set_columns(pinfo, "KBTP fragment" .. (st.fragment_in and (" (message in " .. st.fragment_in .. ")") or "")
                           .. (st.broken and " [reassembly failed]" or ""))
    end
    return true
end

-- iWARP: Wireshark reassembles Sends; the heuristic sees whole messages.
local function heur_iwarp(tvb, pinfo, tree)
    local key = conn_key(pinfo, false)
    local st = frames[pinfo.number]
    if pinfo.visited then
        if not st or not st.kbtp then return false end
    else
        if not recognise(tvb, tvb:len(), conns[key]) then return false end
        st = frame_state(pinfo)
        st.kbtp = true
    end
    set_columns(pinfo, dissect_message(tvb, tvb:len(), pinfo, tree, key, st))
    return true
end

-- For rdma.lua: a further KBTP message in a frame whose heuristic call decoded another
-- (two Sends in one iWARP TCP segment: tshark 4.0 offers only the first to heuristics).
-- Returns the Info text, or nil when ``tvb`` is not KBTP.
local function dissect_more(tvb, pinfo, tree, st, roce)
    local key = conn_key(pinfo, roce)
    if not pinfo.visited then
        if not recognise(tvb, tvb:len(), conns[key]) then return nil end
        st.kbtp = true
    elseif not st.kbtp then
        return nil
    end
    return dissect_message(tvb, tvb:len(), pinfo, tree, key, st)
end

local function frame_info(number)
    local st = frames[number]
    return st and st.info
end
