"""Triton kernels for SSE models: the ``triton`` backend of :mod:`sse_model.ops.dispatch`.

:func:`sse_model.ops.dispatch.active_backend` calls :func:`register` the first time it sees a CUDA tensor.
What runs where:

- routing (router softmax + top-k): :mod:`kernels.routing`;
- decode (one token for a batch of sequences in a state pool; SSE, GLA and gated delta rule):
  :mod:`kernels.decode`;
- the rollout engine's decode attention over its paged KV, with its RoPE-and-store prologue
  (:mod:`kernels.paged_attention`), and its sampler without top-p / top-k (:mod:`kernels.sampling`), called by
  the engine's cache and sampler directly;
- generation's matrix products of few rows, the residual added in their epilogue: :mod:`kernels.skinny`;
- chunked training / prefill of SSE over GLA, and of GLA: :mod:`kernels.sse_chunk` (ours, no fla); the gated
  delta rule runs on fla's chunked kernels when fla is installed, else on the PyTorch chunked ops.

This module imports nothing heavy: transformers probes for a package named ``kernels`` (the Hugging Face
hub-kernels library) while it initialises, and must find nothing here that imports transformers back.
"""


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``): its bf16 ``tl.dot`` products are wrong,
    so kernels that multiply bf16 tiles multiply float32 there."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def register() -> None:
    from .backend import register as _register

    _register()
