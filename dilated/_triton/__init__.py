"""What the Triton kernels of :mod:`dilated.longnet.rows`, :mod:`dilated.longnet.branch_combine` and
:mod:`dilated.merge` share (imports no Triton, so the package loads without it)."""
