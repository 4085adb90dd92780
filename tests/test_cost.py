import pytest

from lumen_core.cost import MODELS, CostConfig, CostModel


def test_kv_bytes_follow_eq1():
    # 2 * layers * kv_heads * head_dim * 2 bytes (MODELS.md)
    assert MODELS["Qwen3-32B"].kv_bytes_per_token == 262_144
    assert MODELS["Qwen3-14B"].kv_bytes_per_token == 163_840
    assert MODELS["Llama-3-70B"].kv_bytes_per_token == 327_680
    assert MODELS["Llama-3.2-1B"].kv_bytes_per_token == 32_768
    # Eq. (2): a 4096-token Llama-3-70B request holds 1.34 GB.
    assert MODELS["Llama-3-70B"].kv_bytes_per_token * 4096 == pytest.approx(1.342e9, rel=1e-3)


def test_decode_step_is_memory_bound_by_hand():
    cost = CostModel("Qwen3-32B", "H100", 2)
    # bytes: 65.6e9 weights + 1000 tokens * 262144 B; bandwidth 2 * 3.35e12 * 0.7 = 4.69e12 B/s
    memory_s = (65.6e9 + 262_144_000) / 4.69e12
    assert cost.decode_step_time_s(1, 1000) == pytest.approx(memory_s + 0.004, rel=1e-9)
    assert memory_s == pytest.approx(0.014043, rel=1e-4)


def test_prefill_is_compute_bound_by_hand():
    cost = CostModel("Qwen3-32B", "H100", 2)
    # 2 * 32.8e9 * 1000 linear + 4 * 64 * 64 * 128 * (1000 * 1001 / 2) attention FLOPs,
    # over 2 * 989e12 * 0.5 FLOP/s
    flops = 2 * 32.8e9 * 1000 + 4 * 64 * 64 * 128 * 500_500
    assert cost.prefill_time_s(1000) == pytest.approx(flops / 989e12 + 0.004, rel=1e-9)
    assert flops / 989e12 == pytest.approx(0.067393, rel=1e-4)


def test_capacity_links_and_loads_by_hand():
    cost = CostModel("Qwen3-32B", "H100", 2)
    assert cost.kv_capacity_tokens == int((2 * 80e9 * 0.9 - 65.6e9) // 262_144) == 299_072
    assert cost.restore_time_s(1000) == pytest.approx(262_144_000 / 100e9)
    assert cost.stream_bytes_per_s == 3.125e9  # the 25 Gb/s NIC, not 2 x 50 GB/s PCIe
    assert cost.remote_restore_time_s(1000) == pytest.approx(262_144_000 / 3.125e9)
    assert cost.model_load_time_s == pytest.approx(65.6e9 / 7e9 + 5.0)
    assert cost.draft.name == "Qwen3-0.6B"
    assert cost.draft_load_time_s == pytest.approx(1.2e9 / 7e9 + 2.0)
    fast = CostModel("Qwen3-32B", "H100", 2, config=CostConfig(nic_bytes_per_s=400e9))
    assert fast.stream_bytes_per_s == 100e9  # now PCIe bounds it


def test_verify_step_prices_k_plus_one_tokens():
    cost = CostModel("Qwen3-14B", "H100", 1)
    # Small batch: memory bound, verify costs about a decode step.
    assert cost.verify_step_time_s(4, 4000, 4) < 1.1 * cost.decode_step_time_s(4, 4000)
    # Large batch: compute bound, a verify step of 5 tokens each costs much more.
    assert cost.verify_step_time_s(256, 256 * 500, 4) > 2.5 * cost.decode_step_time_s(256, 256 * 500)
    assert cost.verify_step_time_s(8, 8000, 3) == cost.iteration_time_s(32, 32000, 8000)
    assert cost.iteration_time_s(0, 0, 0) == 0.0


def test_h200_has_more_kv_room_than_h100():
    assert (
        CostModel("Llama-3-70B", "H200", 2).kv_capacity_tokens
        > CostModel("Llama-3-70B", "H100", 4).kv_capacity_tokens / 2
    )


def test_validation():
    with pytest.raises(ValueError, match="`model` must be one of"):
        CostModel("GPT-5", "H100", 1)
    with pytest.raises(ValueError, match="`gpu` must be one of"):
        CostModel("Qwen3-14B", "B200", 1)
    with pytest.raises(TypeError, match="`tp` must be int"):
        CostModel("Qwen3-14B", "H100", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`tp` must be >= 1"):
        CostModel("Qwen3-14B", "H100", 0)
    with pytest.raises(ValueError, match="`tp` must give room for the KV cache"):
        CostModel("Llama-3-70B", "H100", 1)
    with pytest.raises(ValueError, match="`draft_model` must be one of"):
        CostModel("Qwen3-14B", "H100", 1, draft_model="tiny")
    with pytest.raises(ValueError, match="`mfu` must be in"):
        CostConfig(mfu=1.5)
    with pytest.raises(ValueError, match="`nic_bytes_per_s` must be > 0"):
        CostConfig(nic_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="`engine_start_s` must be >= 0"):
        CostConfig(engine_start_s=-1.0)
