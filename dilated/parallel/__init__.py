"""Context parallelism: a sequence sharded over ranks (``sharding``: layouts, all-to-alls, what a
rank communicated), checks every rank agrees on (``agreement``), K/V moved round a ring
(``ring_exchange``, ``peer_copy``), one algorithm per module (``ring_attention``,
``ulysses_attention``, ``hybrid_attention``, ``distributed_dilated_attention`` with
``crossing_segments``), and packed documents balanced over the ranks (``document_layout``,
``document_attention``, ``document_calls``), and decoding against a KV cache sharded over
the ranks (``decode_attention``). Public names are exported by :mod:`dilated`."""
