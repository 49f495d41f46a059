"""Packed softmax attention: sequence by sequence, equal to the dense-mask reference, never a [T, T] mask."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from sse_model import SSEConfig, SSEForCausalLM
from sse_model.ops.attention import packed_causal_attention, segments_of


def dense_reference(q, k, v, cu_seqlens, window):
    """Every query against every key of the row, masked to its own sequence's causal (window) past."""
    T = q.shape[2]
    i = torch.arange(T)
    seq = torch.searchsorted(cu_seqlens[1:], i, right=True)
    allowed = (i[None, :] <= i[:, None]) & (seq[None, :] == seq[:, None])
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_matches_the_dense_mask_with_gradients(window, kv_heads):
    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 7, 8, 21, 30])  # an empty and a one-token sequence included
    q = torch.randn(1, 4, 30, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, 30, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, 30, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(1, 4, 30, 8, dtype=torch.float64)
    out = packed_causal_attention(q, k, v, segments_of(cu), window)
    ref = dense_reference(q, k, v, cu, window)
    assert_close(out, ref, torch.float64, "output")
    grads = torch.autograd.grad(out, (q, k, v), grad)
    refs = torch.autograd.grad(ref, (q, k, v), grad)
    for name, g, r in zip("qkv", grads, refs):
        assert_close(g, r, torch.float64, f"d{name}")


def test_packed_attention_refuses_segments_that_miss_tokens():
    q = torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match="cover 6 of the row's 10"):
        packed_causal_attention(q, q, q, [(0, 6)])


def test_a_packed_model_forward_builds_no_row_sized_mask(monkeypatch):
    """The attention layers of a packed 2 x 12-token row attend per sequence: no mask spans the row, which is
    what turned flash attention off and cost T^2 memory at 32k tokens."""
    torch.manual_seed(0)
    config = SSEConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                       mixer_types=["sse", "attn"])
    model = SSEForCausalLM(config).double()
    masks = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        masks.append(None if attn_mask is None else tuple(attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    ids = torch.randint(1, 64, (1, 24))
    position_ids = torch.cat([torch.arange(12), torch.arange(12)])[None]
    packed = model(ids, position_ids=position_ids).logits
    assert masks == [None, None], masks
    for s in (slice(0, 12), slice(12, 24)):
        assert_close(packed[:, s], model(ids[:, s]).logits, torch.float64, f"sequence {s}")


def test_a_packed_forward_hands_every_flash_launch_the_same_bounds(monkeypatch):
    """Where the flash varlen kernel serves (stood in for here by the dense reference, on CPU), the attention layers
    of one forward share one copy of the row's bounds: building them per layer copied host to device, and waited
    for the GPU, once per layer. The varlen layout (tokens x heads) gives the per-sequence path's logits."""
    from sse_model.ops import attention

    torch.manual_seed(0)
    config = SSEConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_heads=2, head_dim=8,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                       mixer_types=["attn", "sse", "attn"])
    model = SSEForCausalLM(config).double()
    ids = torch.randint(1, 64, (1, 24))
    position_ids = torch.cat([torch.arange(7), torch.arange(17)])[None]
    plain = model(ids, position_ids=position_ids).logits
    seen = []

    def launch(q, k, v, cu, max_len, window):  # [T, H, D] in and out, as the kernel
        seen.append(cu)
        out = dense_reference(*(x.transpose(0, 1)[None] for x in (q, k, v)), cu.long(), window)
        assert max_len == int((cu[1:] - cu[:-1]).max())
        return out[0].transpose(0, 1)

    monkeypatch.setattr(attention, "flash_varlen_serves", lambda q: True)
    monkeypatch.setattr(attention._FlashVarlen, "apply", launch)
    varlen = model(ids, position_ids=position_ids).logits
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0].tolist() == [0, 7, 24]
    assert_close(varlen, plain, torch.float64, "varlen layout")
