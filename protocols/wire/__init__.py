"""The wire vocabulary that the server and the clients share, Flower-free.

One module per protocol, one frozen dataclass per message part.  Each part has ONE encoder
(``to_config()``, a plain ``dict`` of config values that the sender wraps in Flower's ``ConfigRecord``)
and ONE decoder (``from_config(rec)``, any ``Mapping``: a ``ConfigRecord`` or a ``dict``; it validates and
raises ``ValueError`` naming the offending key), so a key string lives in exactly one module.  A message
made of several parts merges them (:func:`protocols.wire.common.merge_configs`); each decoder ignores the
keys that are not its own.

:mod:`.arrays` encodes named arrays into the fields of Flower's ``Array`` (the ``.npy`` bytes) and decodes
them zero-copy; :mod:`.intermediate` is DDP-SA's gRPC protocol to the intermediate servers.
"""
