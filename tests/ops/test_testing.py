"""lumen_core.testing: the helpers engine developers use must catch what they claim to."""

import pytest
import torch

from lumen_core import testing


def test_checkpoint_restore_across_block_sizes_is_bit_exact():
    source = testing.make_paged_cache("vllm_flash", num_layers=2, num_blocks=8, block_size=16)
    slots = testing.slots_for_blocks([3, 5], block_size=16, num_tokens=20)
    records = testing.checkpoint_slots(source, slots)
    target = testing.make_paged_cache("vllm_flashinfer", num_layers=2, num_blocks=64, block_size=4, seed=1)
    new_slots = testing.slots_for_blocks([9, 2, 40, 7, 1], block_size=4, num_tokens=20)
    testing.restore_slots(target, new_slots, records)
    testing.assert_kv_equal(source, slots, target, new_slots)


def test_assert_kv_equal_names_the_first_difference():
    a = testing.make_paged_cache("mla", num_layers=2, num_blocks=4, block_size=16)
    b = testing.make_paged_cache("mla", num_layers=2, num_blocks=4, block_size=16)
    slots = torch.tensor([1, 2, 3])
    testing.assert_kv_equal(a, slots, b, slots)
    b.views[1][0, 2, 0].view(torch.uint8)[10] ^= 1
    with pytest.raises(
        AssertionError, match="token 1 \\(slot 2 vs 2\\), plane layer1.kv: rows differ first at byte 10"
    ):
        testing.assert_kv_equal(a, slots, b, slots)


def test_assert_kv_equal_refuses_other_formats_and_lengths():
    a = testing.make_paged_cache("vllm_flash", num_layers=2, num_blocks=4, block_size=16)
    b = testing.make_paged_cache("vllm_flash", num_layers=3, num_blocks=4, block_size=16)
    with pytest.raises(AssertionError, match="layouts differ in record format"):
        testing.assert_kv_equal(a, torch.tensor([0]), b, torch.tensor([0]))
    with pytest.raises(AssertionError, match="token counts differ: 1 vs 2"):
        testing.assert_kv_equal(a, torch.tensor([0]), a, torch.tensor([0, 1]))


def test_slots_for_blocks_is_vllm_slot_mapping():
    assert testing.slots_for_blocks([7, 2], block_size=4, num_tokens=6).tolist() == [28, 29, 30, 31, 8, 9]
    with pytest.raises(ValueError, match="`num_tokens` must be <= 8 for 2 blocks, got 9"):
        testing.slots_for_blocks([7, 2], block_size=4, num_tokens=9)


def test_make_paged_cache_kind():
    with pytest.raises(ValueError, match="`kind` must be one of"):
        testing.make_paged_cache("paged", num_layers=1, num_blocks=1, block_size=1)


def test_random_tensor_is_random_bytes_of_the_dtype():
    t = testing.random_tensor((4, 8), torch.bfloat16, generator=torch.Generator().manual_seed(0))
    assert t.shape == (4, 8) and t.dtype == torch.bfloat16
    assert t.view(torch.uint8).unique().numel() > 30
