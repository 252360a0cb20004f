"""The Triton kernels, apart from the ops that launch them: ``combine`` (the per-call gather and
combine of :mod:`dilated.longnet.rows`), ``branch_combine`` (the whole-schedule combine of
:mod:`dilated.longnet.branch_combine`), ``online_merge`` (the streaming log-sum-exp merge both
combines use) and ``launch`` (the launch sizes they share). This package imports no Triton, so
the library loads without it; each kernel module needs it."""
