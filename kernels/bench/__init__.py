"""GPU benchmarks of the kernels (see ``bench_sse.py``)."""
