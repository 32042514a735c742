"""Benchmarks: simulated ranks on one device (``harness``, ``simulated``), real processes (``distributed``), and
the ``ctx-plugin bench`` report (``report``)."""
