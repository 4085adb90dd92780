"""Simulator speed on the whole Splitwise-Conv trace at 64 workers (issue 8's target: each
of `table1 --workers 64` and `scale --workers 64 --policy LUMEN` in <= 15 s wall).

Baseline measured in the same run: the failure-free S&R run of the same workload (no
checkpoints, restores or assist). Reports wall seconds, simulated requests per wall second
and the ratio to the baseline. Correctness is checked once before timing (every request
finishes exactly once).

    PYTHONPATH=src python bench/sim_speed.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

from lumen_core.policy.presets import preset
from lumen_core.sim.cluster import ClusterSim, Failure
from lumen_core.sim.experiments import RATE_PER_WORKER, Options, failed_workers, run_experiment, table1_config
from lumen_core.sim.workload import load_trace

NUM_WORKERS = 64


def timed(fn) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workload = load_trace().scaled_to_rate(RATE_PER_WORKER * NUM_WORKERS)
    config = table1_config(NUM_WORKERS)
    failures = (Failure(0.4 * float(workload.arrival_s[-1]), failed_workers(NUM_WORKERS, 0.25, 0)),)
    check = ClusterSim(config, workload, preset("LUMEN"), failures).run()
    assert (check.finish_counts == 1).all() and check.num_interrupted > 0

    rows = []
    base_s, base = timed(lambda: ClusterSim(config, workload, preset("S&R")).run())
    rows.append(("failure-free S&R run (baseline)", base_s, len(workload), 1.0))
    for name in ("S&R", "FC", "LUMEN"):
        wall_s, _ = timed(lambda name=name: ClusterSim(config, workload, preset(name), failures).run())
        rows.append((f"{name} run, 25% fail", wall_s, len(workload), wall_s / base_s))
    for label, argv in (
        ("table1 --workers 64", Options(workers=NUM_WORKERS)),
        ("scale --workers 64 --policy LUMEN", Options(workers=NUM_WORKERS, policy="LUMEN")),
    ):
        experiment = label.split()[0]
        wall_s, _ = timed(lambda e=experiment, o=argv: run_experiment(e, o))
        rows.append((f"experiment {label} (2 runs)", wall_s, 2 * len(workload), wall_s / base_s))
    print(f"{'what':52s} {'wall_s':>7s} {'sim req/s':>10s} {'x baseline':>10s}")
    for what, wall_s, num, ratio in rows:
        print(f"{what:52s} {wall_s:7.2f} {num / wall_s:10,.0f} {ratio:10.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                [{"what": w, "wall_s": s, "sim_requests_per_s": n / s, "ratio": r} for w, s, n, r in rows],
                handle,
                indent=1,
            )


# ---- pytest-benchmark (make bench): the first 2000 requests at 8 workers, checked first -----


def test_sim_lumen_8_workers(benchmark) -> None:  # type: ignore[no-untyped-def]
    workers = 8
    workload = load_trace().head(2000).scaled_to_rate(RATE_PER_WORKER * workers)
    config = table1_config(workers)
    failures = (Failure(0.4 * float(workload.arrival_s[-1]), failed_workers(workers, 0.25, 0)),)
    result = benchmark.pedantic(
        lambda: ClusterSim(config, workload, preset("LUMEN"), failures).run(), rounds=3, iterations=1
    )
    assert (result.finish_counts == 1).all() and result.num_interrupted > 0


if __name__ == "__main__":
    main()
