"""Measurements of the rollout engine, each a ``python -m`` script that prints a table: generation throughput
(:mod:`.benchmark`), against vLLM (:mod:`.bench_vllm`), the engine's log-probabilities against the trainer's
(:mod:`.bench_numerics`), weight sync to the engines (:mod:`.bench_weight_sync`) and where a decode step's time
goes (:mod:`.profile_engine`)."""
