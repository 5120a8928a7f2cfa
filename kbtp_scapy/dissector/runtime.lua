-- Interprets the generated layouts (HEADER, MESSAGES, FLAGSETS, FMT): recognition,
-- field tree, Info column, expert info, sessions and request/response tracking.
-- Holds no layout of its own. Wireshark 4.0 / Lua 5.2.
--
-- Speed: every call into Wireshark (a TvbRange, a tree item, a pinfo attribute, a field
-- extractor) costs about a microsecond, Lua arithmetic a hundredth of that. So values are
-- read from one tvb:raw() string with byte arithmetic, pinfo attributes are read once per
-- call, per-frame results (connection key included) are kept for revisits, and the only
-- TvbRanges made are those the tree items need. Hot paths call the class methods
-- directly (Tree_add(tree, ...)): ``tree:add`` first looks ``add`` up through the
-- metatable's __index function, which costs a quarter of the call.

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
    icrc = ProtoExpert.new("kbtp.expert.icrc", "Wrong RoCE ICRC: the receiving NIC drops this packet",
                           expert.group.CHECKSUM, expert.severity.ERROR),
}
kbtp.experts = { E.status, E.malformed, E.undefined_flags, E.unanswered, E.credits, E.ring, E.icrc }

local fieldlist = {}
for _, f in pairs(F) do fieldlist[#fieldlist + 1] = f end
kbtp.fields = fieldlist

kbtp.prefs.addr_le = Pref.enum("Address byte order (auto: follow HELLO_ACK; on: ADDR_LE; off: network)",
    1, "Byte order of address fields for sessions whose HELLO_ACK is not in the capture",
    { { 1, "auto", 1 }, { 2, "on", 2 }, { 3, "off", 3 } }, false)
kbtp.prefs.check_icrc = Pref.bool("Check the RoCE ICRC", true,
    "Mark KBTP frames whose RoCEv2 or RoCEv1 ICRC is wrong (kbtp.expert.icrc); off saves its cost")

-- RDMA context, read with field extractors (the C structs do not reach Lua).
local X = {
    bth_opcode = Field.new("infiniband.bth.opcode"),
    bth_padcnt = Field.new("infiniband.bth.padcnt"),
    ddp_tagged = Field.new("iwarp_ddp.tagged_flag"),
}

local byte, sub, format = string.byte, string.sub, string.format
local band = bit32.band
local TWO32 = 2 ^ 32
local Tree_add, Tree_add_le, Tree_append_text = TreeItem.add, TreeItem.add_le, TreeItem.append_text
local Tree_set_generated, Tvb_range, Tvb_raw, Tvb_len = TreeItem.set_generated, Tvb.range, Tvb.raw, Tvb.len

local function last_value(...)
    local n = select("#", ...)
    if n == 0 then return nil end
    return (select(n, ...)).value
end

-- The last value an extractor has for this frame (some fields are added twice).
local function last(extractor)
    return last_value(extractor())
end

-- ---- 64-bit values ----------------------------------------------------------------------
-- Kept as 8-character strings, most significant octet first whatever the wire order: exact
-- (Lua numbers are doubles), usable as table keys, and no UInt64 object per field.
local function hl64(v)
    local a, b, c, d, e, f, g, h = byte(v, 1, 8)
    return ((a * 256 + b) * 256 + c) * 256 + d, ((e * 256 + f) * 256 + g) * 256 + h
end

-- Integers print with "%d": cheaper than tostring()'s "%.14g", and exact below 2^53.
local function dec64(v)
    local h, l = hl64(v)
    if h < 0x200000 then return format("%d", h * TWO32 + l) end
    return tostring(UInt64.new(l, h))
end

local function hex64(v)
    local h, l = hl64(v)
    if h == 0 then return format("0x%x", l) end
    return format("0x%x%08x", h, l)
end

-- ---- state: filled only when not pinfo.visited, cleared in init ----------------------
local conns   -- conversation key -> { le, credits, outstanding, pending = {[rid] = req} }
local frames  -- frame number -> per-frame result (kept for revisits: -2, GUI)
local reasm   -- RoCEv2 Send reassembly, per direction and QP
local HOOKS = {}  -- { init, message(conn, st, values, msg, pinfo) on first pass after a message, prefs }
local pref_addr_le  -- kbtp.prefs.addr_le, read once per dissection pass
local pref_check_icrc  -- kbtp.prefs.check_icrc, likewise
local deferred  -- frame number -> payloads claimed without a tree, for rdma.lua (see defer())

local function reset()
    conns, frames, reasm, deferred = {}, {}, {}, {}
    pref_addr_le, pref_check_icrc = kbtp.prefs.addr_le, kbtp.prefs.check_icrc
    for _, hook in ipairs(HOOKS) do
        if hook.init then hook.init() end
    end
end
kbtp.init = reset
kbtp.prefs_changed = function()
    pref_addr_le, pref_check_icrc = kbtp.prefs.addr_le, kbtp.prefs.check_icrc
    for _, hook in ipairs(HOOKS) do
        if hook.prefs then hook.prefs() end
    end
end
reset()

local function endpoint(addr, port)
    return tostring(addr) .. ((port and port ~= 0xffffffff) and (":" .. port) or "")
end

-- Both directions of a connection share one key. On RoCEv2 without the CM exchange the
-- two directions name different QPs, so the address pair stands for the session.
local function roce_key(a, b)
    if a > b then a, b = b, a end
    return "roce " .. a .. " " .. b
end

local function iwarp_key(pinfo)
    local a, b = endpoint(pinfo.src, pinfo.src_port), endpoint(pinfo.dst, pinfo.dst_port)
    if a > b then a, b = b, a end
    return "iwarp " .. a .. " " .. b
end

local function conn_of(key, roce)
    local c = conns[key]
    if not c then
        c = { pending = {}, outstanding = 0, roce = roce }
        conns[key] = c
    end
    return c
end

-- ---- layout walking --------------------------------------------------------------------
-- Per item, found once: its ProtoField, and per flag set the fields of its bits.
-- Items whose tree item an expert info is put under (each expert on its own item, so that
-- JSON shows every one: siblings with one name would collide).
local EXPERT_AT = { flags = true, status = true, request_id = true }

local function prepare(items)
    for _, item in ipairs(items) do
        if item.member then
            item.field = F[item.member]
            prepare(item.items)
        else
            item.field = F[item.key]
            item.keep = EXPERT_AT[item.key]
            item.private = PRIVATE[item.key]
        end
    end
end
prepare(HEADER)
for _, msg in pairs(MESSAGES) do prepare(msg.items) end

local function bit_fields(item, set)
    local cache = item.bits
    if not cache then
        cache = {}
        item.bits = cache
    end
    local list = cache[set]
    if not list then
        list = {}
        for i, bit in ipairs(FLAGSETS[set].bits) do list[i] = F[item.key .. "." .. bit[3]] end
        cache[set] = list
    end
    return list
end

-- Octets of a message that values are read from: its fixed part at most (inline data
-- is only shown, never read).
local function fixed_size(items)
    local n = 0
    for _, item in ipairs(items) do n = n + item.size end
    return n
end
local FIXED_MAX = HEADER_SIZE
for _, msg in pairs(MESSAGES) do FIXED_MAX = math.max(FIXED_MAX, HEADER_SIZE + fixed_size(msg.items)) end

local function octets(tvb, len)
    return Tvb_raw(tvb, 0, math.min(len, FIXED_MAX))
end

-- The value of ``size`` octets at 1-based ``i`` of ``s``: a number up to 4 octets, else a
-- string (8 octets: see hl64); ``le`` for little-endian.
local function value_at(s, i, size, le)
    if size == 1 then return byte(s, i) end
    if size == 2 then
        local a, b = byte(s, i, i + 1)
        if le then return b * 256 + a end
        return a * 256 + b
    end
    if size == 4 then
        local a, b, c, d = byte(s, i, i + 3)
        if le then a, b, c, d = d, c, b, a end
        return ((a * 256 + b) * 256 + c) * 256 + d
    end
    local v = sub(s, i, i + size - 1)
    if le and size == 8 then v = v:reverse() end
    return v
end

-- Walk ``items`` from ``off`` over the first ``ctx.len`` octets (``s`` holds their fixed
-- part); add to ``tree`` (ranges of ``tvb``) when given. Returns the offset reached and
-- whether the message ended before a fixed field did.
local function walk(items, tvb, s, off, tree, ctx)
    local len, values = ctx.len, ctx.values
    for i = 1, #items do
        local item = items[i]
        local when = item.when
        local word = when and values[when[1]]
        if not when or (word ~= nil and band(word, when[2]) ~= 0) then
            local size = item.size
            if item.member then
                if off >= len then return off, true end
                local sub_tree = tree and Tree_add(tree, item.field, Tvb_range(tvb, off, math.min(size, len - off)))
                local truncated
                off, truncated = walk(item.items, tvb, s, off, sub_tree, ctx)
                if truncated then return off, true end
            elseif size == 0 then
                local n = len - off
                values[item.key] = n
                ctx.tail = item
                if tree and n > 0 then Tree_add(tree, item.field, Tvb_range(tvb, off, n)) end
                off = len
            else
                if off + size > len then return off, true end
                local le = ctx.le and item.order == "A"
                values[item.key] = value_at(s, off + 1, size, le)
                if tree then
                    local range = Tvb_range(tvb, off, size)
                    local ti
                    local private, v = item.private, values[item.key]
                    if private and v >= private[1] and v <= private[2] then
                        ti = Tree_add(tree, item.field, range, v, format(private[3], v))
                    else
                        ti = (le and Tree_add_le or Tree_add)(tree, item.field, range)
                    end
                    if item.keep then ctx.items[item.key] = ti end
                    local set = item.flagset
                    if set == true then set = ctx.msg and ctx.msg.flagset end
                    if set then
                        local bits = bit_fields(item, set)
                        for j = 1, #bits do Tree_add(ti, bits[j], range) end
                    end
                end
                off = off + size
            end
        end
    end
    return off, false
end

-- ---- recognition and decoding ------------------------------------------------------------
local function opcode_known(op)
    return MESSAGES[op] ~= nil or (op >= PRIVATE_OPCODES[1] and op <= PRIVATE_OPCODES[2])
end

-- One context for every read, cleared each time: a read is used up before the next one
-- starts, and new tables (growing key by key) would cost a malloc per growth step.
local CTX, VALUES, ITEMS = {}, {}, {}

-- Read one message from the first ``len`` octets (``s``: see octets()), into ``tree`` when
-- given: the context holds the values, the offset reached, truncation and the inline tail.
-- Valid until the next read.
local function read_message(tvb, s, len, msg, le, tree)
    local ctx, values = CTX, VALUES
    for k in next, values do values[k] = nil end
    if tree then
        for k in next, ITEMS do ITEMS[k] = nil end
    end
    ctx.values, ctx.le, ctx.msg, ctx.len, ctx.tail = values, le and (msg == nil or msg.addr_le), msg, len, nil
    ctx.items = ITEMS
    local off, truncated = walk(HEADER, tvb, s, 0, tree, ctx)
    if msg and not truncated then off, truncated = walk(msg.items, tvb, s, off, tree, ctx) end
    ctx.off, ctx.truncated = off, truncated
    return ctx
end

-- What is wrong with the layout a read found, or nil.
local function problem_of(ctx)
    local msg = ctx.msg
    if ctx.truncated then
        return format("truncated: %d octets, %s with these flags needs more", ctx.len, msg.name)
    end
    if ctx.tail then
        local declared = ctx.values[ctx.tail.length_from]
        if declared ~= ctx.values[ctx.tail.key] then
            return format("inline data is %d octets, the descriptor says %s",
                          ctx.values[ctx.tail.key], tostring(declared))
        end
    elseif ctx.off < ctx.len then
        return format("%d octets after the end of %s", ctx.len - ctx.off, msg.name)
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
local function header_ok(s, len)
    if len < HEADER_SIZE then return nil end
    local version, op = byte(s, 1, 2)
    if version ~= VERSION or not opcode_known(op) then return nil end
    return op
end

-- Strict recognition: Version 1, a known or Private Use opcode, and a layout that fits the
-- opcode, flags and descriptors. Inside a conversation already known to carry KBTP, a
-- message with a wrong layout is still claimed (and marked malformed).
local function recognise(s, len, conn)
    local op = header_ok(s, len)
    if not op then return false end
    if conn and conn.kbtp then return true end
    local msg = MESSAGES[op]
    return msg ~= nil and problem_of(read_message(nil, s, len, msg, false)) == nil
end

-- The first packet of a multi-packet Send: a header whose inline data continues past it.
local function continues(ctx)
    return not ctx.truncated and ctx.tail ~= nil and ctx.values[ctx.tail.key] < ctx.values[ctx.tail.length_from]
end

-- Info column text of a value, per field (from FMT, once).
local SHOW = {}
for key, fmt in pairs(FMT) do
    if fmt == "hex" then
        SHOW[key] = function(v)
            if type(v) == "number" then return format("0x%x", v) end
            return hex64(v)
        end
    elseif fmt:sub(1, 5) == "enum:" then
        local rows = ENUMS[fmt:sub(6)]
        SHOW[key] = function(v)
            for _, row in ipairs(rows) do
                if v >= row[1] and v <= row[2] then
                    return row[1] == row[2] and row[3] or format("%s (0x%x)", row[3], v)
                end
            end
            return format("Unknown (0x%x)", v)
        end
    elseif fmt:sub(1, 6) == "flags:" then
        local bits = FLAGSETS[fmt:sub(7)].bits
        SHOW[key] = function(v)
            local names = {}
            for _, bit in ipairs(bits) do
                if band(v, bit[1]) ~= 0 then names[#names + 1] = bit[2] end
            end
            return #names > 0 and table.concat(names, "+") or "0"
        end
    elseif fmt == "bytes" then
        SHOW[key] = function(v)
            return (v:gsub(".", function(c) return format("%02X", byte(c)) end))
        end
    else
        SHOW[key] = function(v)
            if type(v) == "string" then return dec64(v) end
            return format("%d", v)
        end
    end
end

local function show(key, value)
    return SHOW[key](value)
end

local function summary(msg, op, values)
    if not msg then
        return format("%s rid=%s", show("opcode", op), show("request_id", values.request_id))
    end
    local parts = { msg.name }
    local pairs_ = msg.summary
    for i = 1, #pairs_ do
        local pair = pairs_[i]
        local key = pair[2]
        local v = values[key]
        if v ~= nil then
            parts[#parts + 1] = pair[1] ~= "" and (pair[1] .. "=" .. SHOW[key](v)) or SHOW[key](v)
        end
    end
    if msg.flagset and values.flags then
        for _, bit in ipairs(FLAGSETS[msg.flagset].bits) do
            if band(values.flags, bit[1]) ~= 0 then parts[#parts + 1] = bit[2] end
        end
    end
    return table.concat(parts, " ")
end

local function nstime(seconds)
    local s = math.floor(seconds)
    return NSTime.new(s, math.floor((seconds - s) * 1e9 + 0.5))
end

-- First pass only: session state and request/response tracking for one message.
local function track(pinfo, number, conn, st, msg, values)
    local op = values.opcode
    if op == OPCODE.HELLO_ACK and values.status == STATUS_OK then
        local feats = values["hello_ack.features"] or 0
        conn.le = band(feats, FEATURE.ADDR_LE) ~= 0
        conn.credits = values["hello_ack.request_credits"]
    end
    if not msg then return end
    local rid = values.request_id
    if msg.answer then
        conn.pending[rid] = { frame = number, st = st, ts = pinfo.abs_ts, answer = msg.answer, op = op }
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
            st.req_op, st.status = req.op, values.status    -- for srt.lua
            req.st.response_in = number      -- the request's own state: two may share a frame
            if op == OPCODE.COMPLETION then conn.outstanding = conn.outstanding - 1 end
        else
            st.unanswered = true
        end
    end
    for _, hook in ipairs(HOOKS) do
        if hook.message then hook.message(conn, st, values, msg, pinfo, number) end
    end
end

-- Decode one whole KBTP message, the first ``len`` octets of ``tvb`` (``s``: see octets()),
-- into ``tree``; ``st`` is its per-frame state, ``visited`` and ``number`` pinfo's.
local function dissect_message(tvb, s, len, pinfo, visited, number, tree, key, st)
    local conn = conn_of(key, st.roce)
    local op = byte(s, 2)
    local msg = MESSAGES[op]
    if not visited then
        conn.kbtp = true
        st.le = (pref_addr_le == 2) or (pref_addr_le == 1 and conn.le == true)
    end
    local root = Tree_add(tree, kbtp, Tvb_range(tvb, 0, len))
    local ctx = read_message(tvb, s, len, msg, st.le, root)
    local values = ctx.values
    local problem = msg and problem_of(ctx)
    if not visited then track(pinfo, number, conn, st, msg, values) end

    if st.le then root:add(F["session.addr_le"], true):set_generated() end
    if st.request_in then
        Tree_set_generated(Tree_add(root, F.request_in, st.request_in))
        Tree_set_generated(Tree_add(root, F.time, nstime(st.delta)))
    end
    if st.response_in then Tree_set_generated(Tree_add(root, F.response_in, st.response_in)) end
    local data_in = st.data_in   -- filled by rdma.lua as the transfers are seen
    if data_in then
        for i = 1, #data_in do Tree_set_generated(Tree_add(root, F.data_in, data_in[i])) end
    end
    -- Each expert under the item it is about (the message itself for a malformed layout).
    local items = ctx.items
    if problem then root:add_proto_expert_info(E.malformed, problem) end
    if msg and msg.flagset and values.flags then
        local extra = band(values.flags, bit32.bnot(FLAGSETS[msg.flagset].defined))
        if extra ~= 0 then
            (items.flags or root):add_proto_expert_info(E.undefined_flags, format("undefined flag bits 0x%04x", extra))
        end
    end
    if (op == OPCODE.COMPLETION or op == OPCODE.HELLO_ACK) and values.status and values.status ~= STATUS_OK then
        (items.status or root):add_proto_expert_info(E.status, show("status", values.status))
    end
    if st.unanswered then (items.request_id or root):add_proto_expert_info(E.unanswered) end
    if st.over_credits then
        (items.request_id or root):add_proto_expert_info(E.credits, format("%d requests outstanding, %d credits",
                                                     st.over_credits, conn.credits or 0))
    end
    local info = summary(msg, op, values)
    if problem then info = info .. " [Malformed]" end
    Tree_append_text(root, ", " .. info)
    st.info = info
    st.root = root   -- for rdma.lua's ICRC check, while this packet is dissected
    return info
end

local function set_columns(pinfo, info)
    local cols = pinfo.cols
    cols.protocol = "KBTP"
    cols.info = info
end

-- ---- entry points -------------------------------------------------------------------------
local SEND_FIRST, SEND_MIDDLE = 0x00, 0x01
local SEND_LAST = { [0x02] = true, [0x03] = true, [0x16] = true }
local SEND_ONLY = { [0x04] = true, [0x05] = true, [0x17] = true, [0x64] = true, [0x65] = true }
local PATH_MTUS = { [256] = true, [512] = true, [1024] = true, [2048] = true, [4096] = true }

local function frame_state(number)
    local st = frames[number]
    if not st then
        st = {}
        frames[number] = st
    end
    return st
end

-- The state of a frame carrying one KBTP message, made with the keys it will hold (one
-- allocation instead of one per growth step).
local function message_state(number, key, roce, len, pad_unknown)
    local st = frames[number]
    if st then
        st.kbtp, st.key, st.roce, st.len, st.pad_unknown = true, key, roce, len, pad_unknown
    else
        st = { kbtp = true, key = key, roce = roce, len = len, pad_unknown = pad_unknown, le = false }
        frames[number] = st
    end
    return st
end

-- "first", "middle", "last" or "only" for a Send's BTH opcode; false for other opcodes.
local function send_kind(opcode)
    if SEND_ONLY[opcode] then return "only" end
    if SEND_LAST[opcode] then return "last" end
    if opcode < 0x40 and band(opcode, 0x1f) == SEND_FIRST then return "first" end
    if opcode < 0x40 and band(opcode, 0x1f) == SEND_MIDDLE then return "middle" end
    return false
end

-- First sight of a RoCEv2 / InfiniBand payload: is it (part of) a KBTP Send? Works from
-- lengths, because a first pass without a tree (tshark -2) gets no BTH fields: FIRST and
-- MIDDLE packets carry exactly one path MTU and no pad; LAST carries the rest plus the pad
-- to 4 octets; ONLY the whole message plus its pad. BTH fields, when there, must agree.
local function classify_roce(tvb, s, n, pinfo, number, key, src, dst, opcode, padcnt)
    local kind = opcode and send_kind(opcode)
    if kind == false then return nil end
    local dir = next(reasm) ~= nil and (src .. ">" .. dst .. "/" .. pinfo.dst_port)
    local r = dir and reasm[dir]
    if r then
        if kind ~= "last" and kind ~= "only" and kind ~= "first" and n == r.mtu and r.remaining > r.mtu then
            r.data:append(tvb:range(0, n):bytes())
            r.remaining = r.remaining - n
            r.frames[#r.frames + 1] = number
            local st = frame_state(number)
            st.fragment = true
            return st
        elseif (kind == nil or kind == "last") and n == r.remaining + (-r.remaining) % 4 then
            r.data:append(tvb:range(0, r.remaining):bytes())
            reasm[dir] = nil
            local st = frame_state(number)
            st.message = r.data
            for _, other in ipairs(r.frames) do frames[other].fragment_in = number end
            return st
        end
        reasm[dir] = nil
        -- A Send we claimed the start of goes on, but not as its header said (a length lie,
        -- a lost, repeated or reordered packet): claim what continues it, so that no other
        -- heuristic gets a Send LAST without its FIRST (RPC-over-RDMA then fails an assertion
        -- on a second pass), until a packet shorter than the path MTU ends it.
        if kind == "middle" or kind == "last" or (kind == nil and not header_ok(s, n)) then
            if n >= r.mtu and kind ~= "last" then reasm[dir] = r end
            local st = frame_state(number)
            st.fragment, st.broken = true, true
            return st
        end
    end
    local op = kind ~= "middle" and kind ~= "last" and header_ok(s, n)
    if not op then return nil end
    local conn = conns[key]
    local msg = MESSAGES[op]
    local pad = kind == "only" and padcnt or nil
    if pad == nil and msg then     -- a first packet, or no BTH fields: the header decides
        local ctx = read_message(nil, s, n, msg, (conn and conn.le) or pref_addr_le == 2)
        local declared = declared_of(ctx)
        -- the whole message plus the pad to 4 octets: a Send ONLY, whatever its length
        local exact = declared and n >= declared and n - declared == (-declared) % 4
        if (kind == "first" or (kind == nil and PATH_MTUS[n])) and
                (continues(ctx) or (conn and conn.kbtp and not exact)) then
            reasm[dir or (src .. ">" .. dst .. "/" .. pinfo.dst_port)] = {
                data = tvb:range(0, n):bytes(), mtu = n, frames = { number },
                remaining = declared and declared > n and declared - n or 0 }
            local st = frame_state(number)
            st.fragment = true
            return st
        end
        if exact then pad = n - declared end
    end
    if kind == "first" or not recognise(s, n - (pad or 0), conn) then return nil end
    return message_state(number, key, true, n - (pad or 0), pad == nil)
end

-- ---- the first pass without a protocol tree -------------------------------------------------
-- Only Sends carry KBTP messages, never the data of an RDMA Write or Read Response, however
-- it begins. With a tree the BTH opcode and the DDP Tagged flag say which; without one (the
-- first pass of tshark -2, or tshark -r without a filter or -V) no field extractor answers,
-- and the headers that say it lie before the tvb a heuristic is given. So the heuristic
-- claims the payload for now and notes where it lies in the frame; rdma.lua's
-- postdissector, which runs next on the same frame and sees all of it, reads the RDMA
-- header there and decodes the payload with first_sight() or lets it go (resolve()).
local function defer(tvb, pinfo, n, roce)
    local number = pinfo.number
    local list = deferred[number]
    if not list then
        list = {}
        deferred[number] = list
    end
    list[#list + 1] = { roce = roce, off = tvb:offset(), n = n, head = octets(tvb, n), data = tvb:bytes() }
end

-- First pass: decide on ``tvb`` (``n`` octets, ``s`` its fixed part) as the RDMA header
-- said (``opcode``: the BTH opcode, or nil on iWARP), and decode it when it is KBTP.
local function first_sight(tvb, s, n, pinfo, tree, roce, opcode, padcnt)
    local number = pinfo.number
    local st
    if roce then
        local src, dst = tostring(pinfo.src), tostring(pinfo.dst)
        local key = roce_key(src, dst)
        st = classify_roce(tvb, s, n, pinfo, number, key, src, dst, opcode, padcnt)
        if not st then return false end
        st.kbtp, st.key, st.roce = true, key, true  -- fragments too
    else
        local key = iwarp_key(pinfo)
        if not recognise(s, n, conns[key]) then return false end
        st = message_state(number, key, false)
    end
    return st
end

-- Show a frame's KBTP message or fragment (both passes).
local function show_roce(tvb, s, n, pinfo, visited, number, tree, st)
    if st.len then               -- one packet: dissect it in place
        local pad = st.pad_unknown and last(X.bth_padcnt)
        if pad and pad > 0 and pad < st.len then   -- first seen without BTH fields
            st.len, st.pad_unknown = st.len - pad, false
        end
        set_columns(pinfo, dissect_message(tvb, s or octets(tvb, st.len), st.len, pinfo, visited, number,
                                           tree, st.key, st))
    elseif st.message then       -- reassembled: a new data source
        local msg_tvb = st.message:tvb("Reassembled KBTP message")
        local len = msg_tvb:len()
        set_columns(pinfo, dissect_message(msg_tvb, octets(msg_tvb, len), len, pinfo, visited, number,
                                           tree, st.key, st))
    else
        local item = tree:add(kbtp, tvb:range(0, n), "KBTP fragment")
        st.root = item
        if st.fragment_in then item:add(F.fragment_in, st.fragment_in):set_generated() end
        if st.broken then
            item:add_proto_expert_info(E.malformed, "Send fragment that does not continue the message as its header said")
        end
        set_columns(pinfo, "KBTP fragment" .. (st.fragment_in and (" (message in " .. st.fragment_in .. ")") or "")
                           .. (st.broken and " [reassembly failed]" or ""))
    end
end

-- rdma.lua, first pass: the payload a heuristic deferred (``tvb``, from the frame), now that
-- the RDMA header says it is a Send (``opcode``, ``padcnt``: the BTH's on RoCE).
local function resolve(tvb, pinfo, tree, roce, opcode, padcnt)
    local n = Tvb_len(tvb)
    local s = octets(tvb, n)
    local st = first_sight(tvb, s, n, pinfo, tree, roce, opcode, padcnt)
    if not st then return end
    if roce then
        show_roce(tvb, s, n, pinfo, false, pinfo.number, tree, st)
    else
        set_columns(pinfo, dissect_message(tvb, s, n, pinfo, false, pinfo.number, tree, st.key, st))
    end
end

-- RoCEv2 / InfiniBand: Sends reach us packet by packet with their pad; reassemble
-- FIRST/MIDDLE/LAST per direction and QP, and claim every fragment, so no other
-- heuristic misreads the continuation packets.
local function heur_infiniband(tvb, pinfo, tree)
    local n = Tvb_len(tvb)
    if n == 0 then return false end
    local number, visited = pinfo.number, pinfo.visited
    local st = frames[number]
    local s
    if visited then
        if not (st and st.kbtp) then return false end
    else
        s = octets(tvb, n)
        -- Not a KBTP header and no Send being reassembled: not ours (RDMA Writes, other
        -- protocols), before any further call into Wireshark.
        if next(reasm) == nil and not header_ok(s, n) then return false end
        local opcode = last(X.bth_opcode)
        if opcode == nil then
            defer(tvb, pinfo, n, true)
            return true
        end
        st = first_sight(tvb, s, n, pinfo, tree, true, opcode, last(X.bth_padcnt))
        if not st then return false end
    end
    show_roce(tvb, s, n, pinfo, visited, number, tree, st)
    return true
end

-- iWARP: Wireshark reassembles Sends; the heuristic sees whole messages, and the data of
-- tagged RDMA Writes and Read Responses, which are never KBTP messages.
local function heur_iwarp(tvb, pinfo, tree)
    local number, visited = pinfo.number, pinfo.visited
    local st = frames[number]
    local n = Tvb_len(tvb)
    local s = octets(tvb, n)
    if visited then
        if not st or not st.kbtp then return false end
    else
        if not header_ok(s, n) then return false end
        local tagged = last(X.ddp_tagged)
        if tagged then return false end
        if tagged == nil then    -- no tree: see defer()
            if not recognise(s, n, conns[iwarp_key(pinfo)]) then return false end
            defer(tvb, pinfo, n, false)
            return true
        end
        st = first_sight(tvb, s, n, pinfo, tree, false)
        if not st then return false end
    end
    set_columns(pinfo, dissect_message(tvb, s, n, pinfo, visited, number, tree, st.key, st))
    return true
end

-- For rdma.lua: a further KBTP message in a frame whose heuristic call decoded another
-- (two Sends in one iWARP TCP segment: tshark 4.0 offers only the first to heuristics).
-- Returns the Info text, or nil when ``tvb`` is not KBTP.
local function dissect_more(tvb, pinfo, tree, st)
    local n = tvb:len()
    local s = octets(tvb, n)
    local visited = pinfo.visited
    if not visited then
        local key = iwarp_key(pinfo)
        if not recognise(s, n, conns[key]) then return nil end
        st.kbtp, st.key = true, key
    elseif not st.kbtp then
        return nil
    end
    return dissect_message(tvb, s, n, pinfo, visited, pinfo.number, tree, st.key, st)
end

local function frame_info(number)
    local st = frames[number]
    return st and st.info
end

local function deferred_of(number)
    local list = deferred[number]
    if list then deferred[number] = nil end
    return list
end
