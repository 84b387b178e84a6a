"""MBU against the datasheet peak: the bandwidth table's lookup and the records that carry it."""

import pytest

from decoders import harness


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H200", 4.8e12),
    ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA A100-SXM4-80GB", 2.039e12),
    ("NVIDIA A100-SXM4-40GB", 1.555e12),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_nominal_bandwidth_by_device_name(name, expected):
    assert harness.nominal_bandwidth(name) == expected


def test_a_point_carries_mbu_against_the_nominal_peak():
    import decoders

    dec = decoders.load("llama-tiny", device="cpu", impl="ref")
    ceiling = {"copy_bytes_per_s": 1e11, "matmul_flops": 1e12, "nominal_bytes_per_s": 2e11}
    record = harness.measure(dec, batch=1, ctx=32, new_tokens=4, ceiling=ceiling, seed=0, repeats=1)
    # The same bytes over twice the bandwidth: half the copy-bandwidth MBU.
    assert record["mbu_nominal"] == pytest.approx(record["mbu"] / 2)
    record = harness.measure(dec, batch=1, ctx=32, new_tokens=4, ceiling={**ceiling, "nominal_bytes_per_s": None}, seed=0, repeats=1)
    assert record["mbu_nominal"] is None and record["mbu"] > 0
