"""The Wireshark Lua dissector, generated from the field tables (``generate``)."""
