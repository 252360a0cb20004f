"""What the Triton kernels of :mod:`dilated.rows`, :mod:`dilated.branch_combine` and
:mod:`dilated.merge` share (imports no Triton, so the package loads without it)."""
