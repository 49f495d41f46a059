"""The vLLM peer benchmark's table (``pipeline/rollout/bench/bench_vllm.py``); the runs themselves need vLLM and a GPU."""

from pipeline.rollout.bench.bench_vllm import table


def test_each_row_is_compared_with_vllm_at_its_length():
    gib = 2**30
    rows = [dict(new_tokens=1024, system="vllm", model="transformer-2b", tokens=20000, seconds=2.0, peak=70 * gib,
                 prompts=32, samples=8),
            dict(new_tokens=1024, system="engine", model="sse-h-2b", tokens=30000, seconds=2.0, peak=20 * gib),
            dict(new_tokens=8192, system="engine", model="sse-h-2b", tokens=9000, seconds=1.0, peak=21 * gib),
            dict(new_tokens=8192, system="vllm", model="transformer-2b", tokens=3000, seconds=1.0, peak=70 * gib)]
    lines = table(rows).splitlines()
    assert lines[2] == "| 1024 | 32 x 8 | vllm | transformer-2b | 10,000 | 1.00x | 70.0 |"
    assert lines[3] == "| 1024 | ? x ? | engine | sse-h-2b | 15,000 | 1.50x | 20.0 |"
    assert lines[4] == "| 8192 | ? x ? | engine | sse-h-2b | 9,000 | 3.00x | 21.0 |"
    assert table(rows[1:2]).splitlines()[2].endswith("| - | 20.0 |")  # no vLLM row at that length


def test_vllm_serving_sse_h_is_not_the_reference():
    """vLLM + our plugin on SSE-H is a row like the others; every row compares with vLLM on the Transformer."""
    rows = [dict(new_tokens=8192, system="vllm", model="transformer-2b", tokens=3000, seconds=1.0, peak=0),
            dict(new_tokens=8192, system="vllm", model="sse-h-2b", tokens=6000, seconds=1.0, peak=0)]
    assert table(rows).splitlines()[3] == "| 8192 | ? x ? | vllm | sse-h-2b | 6,000 | 2.00x | 0.0 |"
