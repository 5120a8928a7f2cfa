-- Service Response Time in tshark: `tshark -q -o kbtp.srt:TRUE -r FILE` prints, when the
-- capture ends, what the C form gives with `-z kbtp,srt`: per request opcode, and per
-- opcode and status of the answer, the calls and the min, max, average and sum of the
-- response times. Wireshark 4.0's Lua API cannot register a -z statistic nor an SRT table
-- (nor the Statistics > Service Response Time menu entry), so a tap listener, made when
-- the preference is set, prints the same table; the response times are runtime.lua's
-- (doubles, see kbtp.time).
do

kbtp.prefs.srt = Pref.bool("Print Service Response Time statistics when tshark ends", false,
    "As -z kbtp,srt of the C plugin: per opcode, and per opcode and status (use with -q)")

local OPS, STATUSES = {}, {}   -- the answered requests, in opcode order; the defined statuses
for op = 0, 255 do
    local msg = MESSAGES[op]
    if msg and msg.answer then OPS[#OPS + 1] = { op = op, name = msg.name } end
end
for _, row in ipairs(RS_STATUS) do
    if row[1] == row[2] then STATUSES[#STATUSES + 1] = row end
end

local listener

local function row(t, index, name, dt)
    local r = t[index]
    if not r then
        r = { name = name, calls = 0, min = dt, max = dt, sum = 0 }
        t[index] = r
    end
    r.calls, r.sum = r.calls + 1, r.sum + dt
    if dt < r.min then r.min = dt end
    if dt > r.max then r.max = dt end
end

-- As tshark prints an SRT table: its filter, then a row per index, names in 22 columns.
local function print_table(filter, column, t)
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    table.sort(keys)
    print("Filter: " .. filter)
    print(string.format("Index  %-22s Calls    Min SRT    Max SRT    Avg SRT    Sum SRT", column))
    for _, k in ipairs(keys) do
        local r = t[k]
        print(string.format("%5d  %-22s %6d %10.6f %10.6f %10.6f %10.6f", k, r.name, r.calls, r.min, r.max,
                            r.sum / r.calls, r.sum))
    end
end

local function start()
    if listener or not kbtp.prefs.srt then return end
    listener = Listener.new("frame", "kbtp.request_in")
    local by_op, by_status = {}, {}   -- by_status: request opcode -> status index -> row
    function listener.reset() by_op, by_status = {}, {} end
    function listener.packet(pinfo)
        local st = frames[pinfo.number]
        if not (st and st.req_op and st.delta) then return end
        local name = MESSAGES[st.req_op].name
        row(by_op, st.req_op, name, st.delta)
        local s = #STATUSES
        for n, r in ipairs(STATUSES) do if r[1] == st.status then s = n - 1 end end
        local status = STATUSES[s + 1] and STATUSES[s + 1][3] or "other"
        by_status[st.req_op] = by_status[st.req_op] or {}
        row(by_status[st.req_op], s, status, st.delta)
    end
    function listener.draw()
        print("")
        print("===================================================================")
        print("KBTP SRT Statistics (kbtp.lua):")
        print_table("kbtp.opcode", "Opcode", by_op)
        for _, o in ipairs(OPS) do
            if by_status[o.op] then
                print("")
                print_table("kbtp.status", o.name .. " status", by_status[o.op])
            end
        end
        print("==================================================================")
    end
end

HOOKS[#HOOKS + 1] = { prefs = start }

end
