"""The message vocabulary: one module per protocol, one frozen dataclass per message part.

Each part has ONE encoder (``to_config() -> ConfigRecord``) and ONE decoder
(``from_config(rec)``, which validates and raises ``ValueError`` naming the
offending key).  The strategy (server) and the client handlers both use these
classes, so a key string lives in exactly one module.  A message made of
several parts merges their records (:func:`client.messages.common.merge_configs`);
each decoder ignores the keys that are not its own.
"""
