"""The benchmark programs: each one measures a question end to end and writes its JSON.

``transfer`` (bandwidth and latency against perftest), ``layer`` (four ways to send a KV
layer), ``overhead`` (planning and per-work-request cost), ``plan`` (the vectorized
planner against a per-segment one), ``hosts`` (two VMs on one virtual wire) and ``suite``
(runs the first three and writes the report). The ``benchmarks/bench_*.py`` and
``run_all.py`` files are their command-line entry points.
"""
