"""The built-in methods' audit adapters, one module per method card (named on the card: ``MethodSpec.audit``).

Each subclasses :class:`server.audit_adapter.AuditAdapter`; what the audit engine needs to know of a method
beyond its registered strategy and client handlers lives here, nowhere else.
"""
