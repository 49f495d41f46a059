"""The paged decode-attention kernel (``kernels/paged_attention.py``) against gathering the blocks and running SDPA
(the engine's path without it); on CPU through Triton's interpreter."""

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention import paged_decode_attention


def gathered(q, pool_k, pool_v, tables, lengths, scale):
    """Each sequence's blocks in order as one tensor, then masked SDPA in float32."""
    B, H, D = q.shape
    H_kv = pool_k.shape[1]
    k = pool_k[tables].permute(0, 2, 1, 3, 4).reshape(B, H_kv, -1, D).float()
    v = pool_v[tables].permute(0, 2, 1, 3, 4).reshape(B, H_kv, -1, D).float()
    mask = (torch.arange(k.shape[2])[None] < lengths[:, None])[:, None, None]
    return F.scaled_dot_product_attention(q[:, :, None].float(), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=H != H_kv)[:, :, 0]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(2, 2, 16), (6, 2, 32)])
def test_paged_decode_equals_gather_then_sdpa(dtype, atol, heads, kv_heads, dim):
    torch.manual_seed(0)
    block_size, num_blocks, B = 16, 12, 4
    lengths = torch.tensor([1, 17, 40, 5])  # one token, a block and one, partial last blocks
    pool_k = torch.randn(num_blocks + 1, kv_heads, block_size, dim).to(dtype)  # unused entries hold garbage
    pool_v = torch.randn(num_blocks + 1, kv_heads, block_size, dim).to(dtype)
    order = torch.randperm(num_blocks)  # each sequence's blocks scattered over the pool
    tables = torch.full((B, 3), num_blocks, dtype=torch.long)  # unused entries: the scratch block
    taken = 0
    for b, n in enumerate(lengths.tolist()):
        need = -(-n // block_size)
        tables[b, :need] = order[taken:taken + need]
        taken += need
    q = torch.randn(B, heads, dim).to(dtype)
    scale = dim ** -0.5
    want = gathered(q, pool_k, pool_v, tables, lengths, scale)
    for splits in (1, 3, 8):  # whole sequences; split in ranges, some empty for the short ones, merged after
        got = paged_decode_attention(q, pool_k, pool_v, tables, lengths, tokens_per_step=16, splits=splits)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


def test_shapes_it_cannot_take_are_refused():
    pool = torch.zeros(2, 2, 16, 24)
    with pytest.raises(ValueError, match="3 query heads over 2 KV heads of size 24"):
        paged_decode_attention(torch.zeros(1, 3, 24), pool, pool, torch.zeros(1, 1, dtype=torch.long),
                               torch.ones(1, dtype=torch.long))
