"""GPU benchmarks of the Triton kernels (see ``bench_sse.py``)."""
