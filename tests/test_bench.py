"""bench.py's own measuring tools: what `--e2e` reports about the host during each generate."""

import gc
import time

from bench import HostClock


def test_host_clock_counts_the_collections_and_the_cpu_time_inside_it():
    gc.collect()
    with HostClock() as clock:
        gc.collect()  # one full collection
        busy_until = time.process_time() + 0.2
        while time.process_time() < busy_until:
            pass
    gc.collect()  # after the block: not counted
    assert clock.runs[2] == 1 and clock.seconds[2] > 0
    assert clock.cpu_s >= 0.2
