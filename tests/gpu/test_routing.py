"""GpuRouter: size crossover, backpressure, CPU fallback on GPU errors and unsupported texts."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from toktier_backend.gpu.routing import GpuRouter, measure_crossover


class Fake:
    def __init__(self, name, *, fail=False, delay=0.0, accept=True):
        self.name, self.fail, self.delay, self.accept = name, fail, delay, accept
        self.calls = 0

    def accepts(self, text):
        return self.accept

    def encode(self, text):
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")
        return np.arange(len(text), dtype=np.int32)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


def test_small_requests_stay_on_cpu():
    r = GpuRouter(Fake("cpu"), Fake("gpu"), crossover_chars=100)
    assert r.encode("x" * 99)[1] == "cpu_small"
    ids, route = r.encode("x" * 100)
    assert route == "gpu" and ids.tolist() == list(range(100))
    assert r.counts == {"cpu_small": 1, "gpu": 1}


def test_no_gpu_and_not_accepted_go_to_cpu():
    assert GpuRouter(Fake("cpu"), None, crossover_chars=0).encode("abc")[1] == "cpu_no_gpu"
    assert GpuRouter(Fake("cpu"), Fake("gpu", accept=False), crossover_chars=0).encode("abc")[1] == "cpu_not_accepted"


def test_gpu_error_falls_back_and_is_counted():
    cpu = Fake("cpu")
    r = GpuRouter(cpu, Fake("gpu", fail=True), crossover_chars=0)
    ids, route = r.encode("abcd")
    assert route == "cpu_gpu_error" and ids.tolist() == [0, 1, 2, 3] and cpu.calls == 1
    assert "LAUNCH_FAILED" in r.last_error and r.counts["cpu_gpu_error"] == 1


def test_full_queue_goes_to_cpu():
    r = GpuRouter(Fake("cpu"), Fake("gpu", delay=0.3), crossover_chars=0, max_queue=1)
    routes = []
    threads = [threading.Thread(target=lambda: routes.append(r.encode("abc")[1])) for _ in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert routes.count("gpu") == 2 and routes.count("cpu_queue_full") == 3


def test_measure_crossover_and_refusal():
    cpu, gpu = Fake("cpu"), Fake("gpu")
    n = measure_crossover(cpu, gpu, {10: "x" * 10, 1000: "x" * 1000}, repeats=1)
    assert n in (10, 1000, 1001)

    class Wrong(Fake):
        def encode(self, text):
            return np.zeros(1, dtype=np.int32)

    with pytest.raises(AssertionError):
        measure_crossover(cpu, Wrong("gpu"), {10: "x" * 10}, repeats=1)
