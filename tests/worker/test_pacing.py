import pytest

from lumen_core.cost import CostModel
from lumen_core.engine.connector import SavedTokens
from lumen_core.engine.engine import StepOutput
from lumen_core.pacing import Pacer, StepChunk, modelled_step_s, parse_pace, step_chunks, step_time_s

COST = CostModel("Qwen3-32B", "H100", 2)


class FakeClock:
    """A clock that compute advances by hand and the pacer's sleeps advance."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.now += seconds


def pacer(time_scale: float = 1.0) -> tuple[Pacer, FakeClock]:
    clock = FakeClock()
    return Pacer(COST, time_scale, clock=clock, sleep=clock.sleep), clock


def test_a_step_lasts_its_modelled_time_times_the_scale():
    p, clock = pacer(time_scale=4.0)
    p.begin()
    clock.now += 0.010  # real compute
    p.end(0.020)
    assert clock.now == pytest.approx(100.080)
    assert clock.slept == [pytest.approx(0.070)]
    assert (p.num_steps, p.num_overruns, p.overrun_fraction) == (1, 0, 0.0)
    assert p.modelled_s == pytest.approx(0.020)


def test_compute_longer_than_the_paced_time_is_an_overrun_and_does_not_sleep():
    p, clock = pacer(time_scale=2.0)
    for compute_s in (0.050, 0.010, 0.030, 0.001):
        p.begin()
        clock.now += compute_s
        p.end(0.010)  # paced: 0.020 s
    assert (p.num_steps, p.num_overruns) == (4, 2)
    assert p.overrun_fraction == 0.5
    assert clock.slept == [pytest.approx(0.010), pytest.approx(0.019)]


def test_an_empty_step_is_not_counted_and_end_needs_begin():
    p, clock = pacer()
    assert p.overrun_fraction == 0.0
    p.begin()
    p.end(0.0)
    assert p.num_steps == 0 and clock.slept == []
    with pytest.raises(RuntimeError, match="without begin"):
        p.end(0.01)
    p.begin()
    with pytest.raises(ValueError, match="`modelled_s` must be >= 0, got -1"):
        p.end(-1.0)


def test_time_scale_must_be_positive():
    with pytest.raises(ValueError, match="`time_scale` must be > 0, got 0"):
        Pacer(COST, 0.0)


def test_step_time_matches_the_cost_model_the_simulator_uses():
    # A decode batch of 3 requests at contexts 10, 20, 30 and a 5-token prefill chunk after a
    # 7-token cached prefix: the simulator's (tokens, attended context, KV read).
    chunks = [StepChunk(9, 1), StepChunk(19, 1), StepChunk(29, 1), StepChunk(7, 5)]
    attn = 10 + 20 + 30 + (8 + 9 + 10 + 11 + 12)
    assert step_time_s(COST, chunks) == pytest.approx(COST.iteration_time_s(8, attn, 9 + 19 + 29 + 7))
    assert step_time_s(COST, [StepChunk(0, 17)]) == pytest.approx(COST.prefill_time_s(17))
    assert step_time_s(COST, []) == 0.0


def test_a_long_prefill_is_compute_bound_and_costs_more_than_a_decode_step():
    decode = step_time_s(COST, [StepChunk(100, 1)] * 16)
    prefill = step_time_s(COST, [StepChunk(0, 4096)])
    assert prefill > 5 * decode


def test_step_chunks_read_prefill_decode_and_verify_from_a_step_output():
    out = StepOutput(
        saves=[
            SavedTokens("a", 0, tuple(range(12)), tuple(range(12))),  # prefill chunk of 12
            SavedTokens("b", 40, (1,), (5,)),  # plain decode at position 40
            SavedTokens("c", 30, (1, 2, 3), (5, 6, 7)),  # fed 1, 2 of 4 drafts accepted
        ],
        num_draft_tokens={"c": 4},
        num_accepted={"c": 2},
    )
    assert step_chunks(out) == [StepChunk(0, 12), StepChunk(40, 1), StepChunk(30, 5, 4)]


def test_restores_add_pcie_or_nic_time_to_the_step():
    out = StepOutput(saves=[SavedTokens("a", 100, (1,), (5,))])
    plain = modelled_step_s(COST, out)
    local = modelled_step_s(COST, out, [(100, False)])
    remote = modelled_step_s(COST, out, [(100, True)])
    assert local - plain == pytest.approx(COST.restore_time_s(100))
    assert remote - plain == pytest.approx(COST.remote_restore_time_s(100))
    assert remote > local  # 25 Gb/s NIC vs 2 x 50 GB/s PCIe


def test_chunk_validation():
    with pytest.raises(ValueError, match="`start` must be >= 0, got -1"):
        StepChunk(-1, 1)
    with pytest.raises(ValueError, match="`num_tokens` must be >= 1, got 0"):
        StepChunk(0, 0)
    with pytest.raises(ValueError, match=r"`num_draft_tokens` must be in \[0, num_tokens=3\), got 3"):
        StepChunk(0, 3, 3)


@pytest.mark.parametrize(
    ("spec", "model", "gpu", "tp"),
    [
        ("qwen3-32b/h100x2", "Qwen3-32B", "H100", 2),
        ("Llama-3-70B/A100-80GBx4", "Llama-3-70B", "A100-80GB", 4),
        ("llama-3-8b/h200", "Llama-3-8B", "H200", 1),
    ],
)
def test_parse_pace_names_a_preset(spec, model, gpu, tp):
    cost = parse_pace(spec)
    assert (cost.model.name, cost.gpu.name, cost.tp) == (model, gpu, tp)


@pytest.mark.parametrize("spec", ["qwen3-32b", "qwen3-33b/h100x2", "qwen3-32b/b200x2", "/h100"])
def test_parse_pace_refuses_unknown_setups(spec):
    with pytest.raises(ValueError, match="`pace` must be MODEL/GPUxTP"):
        parse_pace(spec)
    with pytest.raises(TypeError, match="`pace` must be str, got int"):
        parse_pace(3)  # type: ignore[arg-type]


def test_back_to_back_steps_keep_one_timeline_so_work_between_them_is_absorbed():
    p, clock = pacer()
    p.begin()
    clock.now += 0.002
    p.end(0.010)  # ends at 100.010
    clock.now += 0.003  # token reports between the steps
    p.begin(after_previous=True)
    clock.now += 0.002
    p.end(0.010)
    assert clock.now == pytest.approx(100.020)  # not 100.023
    clock.now += 0.5  # idle: the next step starts when it starts
    p.begin(after_previous=False)
    p.end(0.010)
    assert clock.now == pytest.approx(100.530)
    assert p.num_overruns == 0


def test_an_overrun_step_is_followed_from_when_it_really_ended():
    p, clock = pacer()
    p.begin()
    clock.now += 0.030
    p.end(0.010)  # overran: ends at 100.030
    p.begin(after_previous=True)
    p.end(0.010)
    assert clock.now == pytest.approx(100.040)
    assert p.num_overruns == 1
