"""vLLM beside the rollout engine (``scripts/vllm_site.py`` brings vLLM to a GPU machine without a package index):
:mod:`.plugin` and :mod:`.model` serve ``SSEForCausalLM`` checkpoints in vLLM (the ``vllm.general_plugins`` entry point), and
:mod:`.engine` puts vLLM behind the engine's interface for ``engine.backend: vllm``. Nothing here imports vLLM at
import time."""
