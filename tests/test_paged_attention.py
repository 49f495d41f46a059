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
@pytest.mark.parametrize("heads, kv_heads, dim, launch", [
    (2, 2, 16, {"tokens_per_step": 16}), (2, 2, 16, {}),  # a tile of a block; the engine's: tiles of several blocks
    (6, 2, 32, {"tokens_per_step": 16}), (6, 2, 32, {"tokens_per_step": 64, "stages": 3}),  # GQA
    (3, 3, 64, {"tokens_per_step": 16, "stages": 5}), (5, 5, 256, {"tokens_per_step": 32})])  # real head sizes, odd counts
def test_paged_decode_equals_gather_then_sdpa(dtype, atol, heads, kv_heads, dim, launch):
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
        got = paged_decode_attention(q, pool_k, pool_v, tables, lengths, splits=splits, **launch)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)
    # the engine's form: rows picked by slots, lengths counted before the step's (stored) token
    order = torch.tensor([2, 0, 3, 1])
    slots = torch.argsort(order)
    got = paged_decode_attention(q, pool_k, pool_v, tables[order], (lengths - 1)[order], slots=slots, **launch)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


def test_shapes_it_cannot_take_are_refused():
    pool = torch.zeros(2, 2, 16, 32)
    with pytest.raises(ValueError, match="stages 0: at least one tile in flight"):
        paged_decode_attention(torch.zeros(1, 2, 32), pool, pool, torch.zeros(1, 1, dtype=torch.long),
                               torch.ones(1, dtype=torch.long), stages=0)
    pool = torch.zeros(2, 2, 16, 24)
    with pytest.raises(ValueError, match="3 query heads over 2 KV heads of size 24"):
        paged_decode_attention(torch.zeros(1, 3, 24), pool, pool, torch.zeros(1, 1, dtype=torch.long),
                               torch.ones(1, dtype=torch.long))


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rotary_store_equals_rope_then_store(dtype, atol):
    """The decode prologue kernel against RotaryEmbedding + storing into the blocks: q/k/v as column slices of one
    product, GQA, positions far into a long sequence (large angles), a RoPE factor, rows that are not slots 0..B-1."""
    from kernels.paged_attention import rotary_store_decode
    from sse_model.modules import RotaryEmbedding

    torch.manual_seed(0)
    B, H, H_kv, D, block_size, num_blocks = 3, 4, 2, 32, 8, 10
    rotary = RotaryEmbedding(D, base=1e6)
    rotary.attention_factor = 1.25
    qkv = torch.randn(B, (H + 2 * H_kv) * D).to(dtype)
    q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split([H * D, H_kv * D, H_kv * D], dim=-1))
    slots = torch.tensor([4, 0, 2])
    lengths = torch.tensor([9, 0, 3, 0, 30, 0])  # per slot: tokens before this step
    positions = lengths[slots] + torch.tensor([0, 5000, 31000])  # RoPE positions need not be the cache index
    tables = torch.full((6, 4), num_blocks, dtype=torch.long)
    tables[4, :4], tables[0, :1], tables[2, :1] = torch.tensor([7, 1, 8, 3]), 5, 9
    pool_k, pool_v = torch.zeros(num_blocks + 1, H_kv, block_size, D, dtype=dtype), \
        torch.zeros(num_blocks + 1, H_kv, block_size, D, dtype=dtype)
    got_q = rotary_store_decode(q, k, v, positions, rotary.inv_freq, rotary.attention_factor, pool_k, pool_v,
                                tables, lengths, slots)
    want_q, want_k = rotary(q[:, None].double(), k[:, None].double(), positions[:, None])
    torch.testing.assert_close(got_q.double(), want_q[:, 0], atol=atol, rtol=atol)
    for b, slot in enumerate(slots.tolist()):
        index = int(lengths[slot])
        block = int(tables[slot, index // block_size])
        torch.testing.assert_close(pool_k[block, :, index % block_size].double(), want_k[b, 0], atol=atol, rtol=atol)
        assert torch.equal(pool_v[block, :, index % block_size], v[b])
    assert int((pool_k != 0).any(-1).sum()) == B * H_kv  # nothing else written


def test_cache_declines_head_sizes_the_kernel_cannot_take_and_says_so_once(caplog):
    """Phi-style heads of 80 (not a power of two): the engine's cache gathers the blocks for SDPA instead of the
    paged kernel and logs that once; heads of 64 are read in place."""
    from sse_model import SSEConfig
    from pipeline.rollout.cache import SlotCache
    from sse_model.ops import dispatch

    def cache(D):
        cfg = SSEConfig(hidden_size=4 * D, num_heads=4, head_dim=D, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=1, mixer_types=["attn"], vocab_size=64)
        return SlotCache(cfg, max_slots=2, max_len=64, device="cpu", dtype=torch.float32, paged_decode=True)

    dispatch._DECLINED.clear()
    with caplog.at_level("WARNING", logger="sse_model.ops.dispatch"):
        assert cache(64).decode_in_place
        phi = cache(80)
        assert not phi.decode_in_place and not phi.decode_in_place
    notes = [r.getMessage() for r in caplog.records if "declined" in r.getMessage()]
    assert len(notes) == 1 and "head size 80" in notes[0]


def test_the_engines_launches_fit_two_programs_an_sm_and_spill_nothing():
    """Read from the kernel compiled for sm_90 on the CPU at the engine's launch (``TOKENS_PER_STEP``, ``STAGES``)
    over bf16 and float8 pools: a decode step reads the cache at full speed only with several programs an SM staging
    tiles, and a launch that spills registers or holds one program an SM (float8 tiles of 128 in three stages: 218
    registers) ran slower (``docs/benchmarks.md``)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    script = ("import json; from benchmarks.kernels.paged_ptx import compiled, registers; "
              "from kernels.paged_attention import STAGES, TOKENS_PER_STEP; "
              "ks = {kv: compiled(kv, TOKENS_PER_STEP, 90, STAGES) for kv in ('bf16', 'fp8')}; "
              "print(json.dumps({kv: [*registers(k), k.metadata.shared] for kv, k in ks.items()}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    found = json.loads(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1])
    if found["bf16"][0] is None:
        pytest.skip("no cuobjdump beside Triton's NVIDIA backend")
    from benchmarks.kernels.paged_ptx import programs_per_sm

    for kv, (regs, stack, shared) in found.items():
        assert stack == 0 and programs_per_sm(regs, shared) >= 2, (kv, found)
