"""Speculative-assist planning (mechanism 3, Algorithm 3's choices; docs/policies.md).

A recovering worker (draft model loaded, full model still loading) assists one survivor: the
most loaded serving worker that has no assistant yet, provided the predicted gain is positive.
The gain comes from the driver's cost model through ``gain_fn``. The draft length is
conservative while the assistant's draft context is cold, then the configured ``k``. When the
assistant's full model is loaded, ``finish`` unpairs it and it rejoins as a normal worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lumen_core._validate import check_instance, check_int, check_number
from lumen_core.policy.events import AssistDecision, WorkerState
from lumen_core.policy.load import LoadMonitor

GainFn = Callable[[LoadMonitor, int, int], float]
"""(monitor, survivor_id, k) -> predicted net gain: tokens per verify step minus the verify
step's extra cost, both in tokens. Positive means assisting speeds the survivor up."""


def expected_tokens_per_step(acceptance_rate: float, num_draft_tokens: int) -> float:
    """Expected tokens emitted by one verify step of ``k`` drafts at acceptance rate ``a``:
    ``(1 - a^(k+1)) / (1 - a)`` (``k + 1`` when ``a = 1``)."""
    a = check_number("acceptance_rate", acceptance_rate, 0, 1)
    k = check_int("num_draft_tokens", num_draft_tokens, low=0)
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def make_acceptance_gain(acceptance_rate: float, verify_cost_per_draft_token: float) -> GainFn:
    """A survivor-independent GainFn: ``(1 - a^(k+1)) / (1 - a) - (1 + c * k)``.

    A verify step of ``k`` drafts costs ``1 + c * k`` decode steps (``c`` =
    ``verify_cost_per_draft_token``), in which plain decoding would emit as many tokens; the
    gain is what speculation emits beyond that. Drivers with a cost model pass their own.
    """
    expected_tokens_per_step(acceptance_rate, 1)
    c = check_number("verify_cost_per_draft_token", verify_cost_per_draft_token, low=0)

    def gain(monitor: LoadMonitor, survivor_id: int, k: int) -> float:
        return expected_tokens_per_step(acceptance_rate, k) - (1.0 + c * k)

    return gain


@dataclass(frozen=True)
class AssistConfig:
    """num_draft_tokens: k once the draft context is warm.
    cold_num_draft_tokens: k during the first ``cold_steps`` steps of a cold draft context
        (the paper's deployment notes: start conservatively while acceptance is unknown).
    """

    num_draft_tokens: int = 4
    cold_num_draft_tokens: int = 2
    cold_steps: int = 100

    def __post_init__(self) -> None:
        check_int("num_draft_tokens", self.num_draft_tokens, low=1)
        check_int("cold_num_draft_tokens", self.cold_num_draft_tokens, low=1)
        check_int("cold_steps", self.cold_steps, low=0)


class SpecAssistPlanner:
    """Pairs assisting (recovering) workers with survivors; one assistant per survivor.

    Holds the pairings only; load comes from the monitor passed to ``pair``.
    """

    def __init__(self, config: AssistConfig, gain_fn: GainFn) -> None:
        check_instance("config", config, AssistConfig, "an AssistConfig")
        if not callable(gain_fn):
            raise TypeError(f"`gain_fn` must be callable, got {type(gain_fn).__name__}")
        self.config = config
        self._gain_fn = gain_fn
        self._survivor_of: dict[int, int] = {}
        self._assistant_of: dict[int, int] = {}

    def pair(self, monitor: LoadMonitor, assistant_id: int) -> AssistDecision:
        """Pair a recovering worker with the most loaded serving worker without an assistant
        whose predicted gain (at the warm ``k``) is positive; ties: lowest id.

        Survivors are tried in decreasing L; those with no gain are skipped (named in the
        reason). Already paired: returns the current pairing unchanged. Mutates the pairings.
        Raises TypeError for a non-LoadMonitor monitor or a non-int id, IndexError for an
        unknown worker, ValueError if the assistant is not recovering.
        """
        check_instance("monitor", monitor, LoadMonitor)
        assistant_id = check_int("assistant_id", assistant_id)
        state = monitor.worker(assistant_id).state
        if state != WorkerState.RECOVERING:
            raise ValueError(f"`assistant_id` must be a recovering worker, got {assistant_id} ({state})")
        k = self.config.num_draft_tokens
        cold_k = self.config.cold_num_draft_tokens
        current = self._survivor_of.get(assistant_id)
        if current is not None:
            return AssistDecision(
                assistant_id,
                current,
                cold_k,
                float(self._gain_fn(monitor, current, k)),
                f"already assisting survivor {current}",
            )
        candidates = [w for w in monitor.live_worker_ids() if w not in self._assistant_of]
        candidates.sort(key=lambda w: (-monitor.load(w), w))
        skipped: list[str] = []
        for survivor_id in candidates:
            gain = float(self._gain_fn(monitor, survivor_id, k))
            if gain > 0.0:
                self._survivor_of[assistant_id] = survivor_id
                self._assistant_of[survivor_id] = assistant_id
                note = f" (no gain on {', '.join(skipped)})" if skipped else ""
                return AssistDecision(
                    assistant_id,
                    survivor_id,
                    cold_k,
                    gain,
                    f"assist the most loaded unassisted survivor {survivor_id} "
                    f"(L={monitor.load(survivor_id):.3f}) with predicted gain {gain:.3f} tokens "
                    f"per verify step at k={k}{note}",
                )
            skipped.append(f"{survivor_id}: {gain:.3f}")
        why = (
            f"no survivor with a positive predicted gain ({', '.join(skipped)})"
            if skipped
            else "no serving worker without an assistant"
        )
        return AssistDecision(assistant_id, None, 0, 0.0, f"not assisting: {why}")

    def num_draft_tokens(self, assistant_id: int, steps_done: int) -> int:
        """k for the assistant's next step: ``cold_num_draft_tokens`` for its first
        ``cold_steps`` steps, then ``num_draft_tokens``. Raises ValueError if steps_done < 0."""
        check_int("assistant_id", assistant_id)
        steps_done = check_int("steps_done", steps_done, low=0)
        if steps_done < self.config.cold_steps:
            return self.config.cold_num_draft_tokens
        return self.config.num_draft_tokens

    def finish(self, assistant_id: int) -> int | None:
        """The assistant's full model is loaded (or it died): unpair it; return the survivor
        it assisted (now free for another assistant), or None if it was not paired."""
        survivor_id = self._survivor_of.pop(check_int("assistant_id", assistant_id), None)
        if survivor_id is not None:
            del self._assistant_of[survivor_id]
        return survivor_id

    def release_survivor(self, survivor_id: int) -> int | None:
        """The survivor failed: unpair it; return its assistant (free to pair again), or None."""
        assistant_id = self._assistant_of.pop(check_int("survivor_id", survivor_id), None)
        if assistant_id is not None:
            del self._survivor_of[assistant_id]
        return assistant_id

    def survivor_of(self, assistant_id: int) -> int | None:
        return self._survivor_of.get(check_int("assistant_id", assistant_id))

    def assistant_of(self, survivor_id: int) -> int | None:
        return self._assistant_of.get(check_int("survivor_id", survivor_id))
