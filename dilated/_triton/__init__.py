"""The Triton kernels, apart from the ops that launch them: ``combine`` (the per-call gather and
combine of :mod:`dilated.longnet.rows`), ``branch_combine`` (the whole-schedule combine of
:mod:`dilated.longnet.branch_combine`), ``indexed_rows`` (merge into or add to
indexed rows, :mod:`dilated.indexed_rows`), ``online_merge`` (the streaming log-sum-exp merge the
combines and the row merge use) and ``launch`` (the launch sizes they share). This package imports no Triton, so
the library loads without it; each kernel module needs it."""
