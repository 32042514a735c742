"""The algorithm: context-parallel attention itself, independent of any training framework.

``config`` (:class:`CPConfig`) and ``groups`` (:class:`CPGroups`) say what to run and on which ranks; ``api``
(:func:`cp_attention` and the sharding helpers) runs it through ``attention``: the ring loop (``ring``, over a
``layouts`` plan and the ``blocks`` of the ``mask``, with ``block_calls`` into the local ``kernels`` and ``merge``),
the Ulysses all-to-alls (``ulysses``) or the all-gather backend (``allgather``). ``comm`` holds the communication
primitives, ``agreement`` the check that every rank asked for the same thing before any of them communicates,
``rules`` how a sequence and its heads split over ranks, ``documents`` packed documents, ``sinks`` attention sinks,
``profiling`` the named profiler ranges.

The adapters (:mod:`ctx_plugin.megatron`, :mod:`ctx_plugin.deepspeed`, :mod:`ctx_plugin.hf`) and the tools
(``bench``, ``plan``, ``memory``, ``slurm``, the ``ctx-plugin`` command) build on this package; it imports none of
them, and nothing here reads a framework's global state or the environment.
"""
