"""Benchmarks of the rewards: the verifier pool's throughput (:mod:`.reward_pool`) and the graders against
hand-labelled cases (:mod:`.graders`)."""
