"""Experiment runners and tools: the paper-2b dry run (:mod:`.paper_dry_run`), sweeps of settings (:mod:`.sweep`),
vLLM packed for a GPU machine without a package index (:mod:`.vllm_site`), the graders' cases (:mod:`.build_grader_cases`).
Not part of the installed package; run from the repository root (``python -m scripts.<name>``)."""
