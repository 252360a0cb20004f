"""LongNet dilated attention on one device: the readable form (``dilated_attention``), the fast one
(``improved_dilated_attention``: a plan of kernel calls per shape, ``plan``; strided views and
gathers, ``rows``; one Triton combine, ``branch_combine``; calls on two streams,
``call_streams``; their custom ops, ``ops``), the residue-major layout (``residue_major``) and the
multihead layer (``multihead``). Public names are exported by :mod:`dilated`."""
