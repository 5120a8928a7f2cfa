"""Conformance of KBTP initiators: a checking target, the program under test, the cases.

``kbtp conform --role initiator --listen URL -- CMD ...`` runs CMD once per case against
a checking target built on the reference target (``target.py``), which records what the
initiator does on the wire and in target memory and misbehaves on purpose where a case
asks it to. Verdicts, exit codes, JSON, JUnit and pcaps are target conformance's.
"""
