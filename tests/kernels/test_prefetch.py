"""kernels.prefetch: the byte ranges a kernel is asked to prefetch, and where prefetching is on. That a
prefetch changes no result is checked on a GPU beside each hosting kernel (paged decode, SSD step)."""

import pytest
import torch

from kernels import prefetch


def test_ranges_take_the_first_bytes_in_order():
    a, b = torch.zeros(10, 4), torch.zeros(100, dtype=torch.bfloat16)
    assert [(t is a, n) for t, n in prefetch.ranges((a, b), 1 << 30)[:1]] == [(True, 160)]
    assert [n for _, n in prefetch.ranges((a, b), 1 << 30)] == [160, 200]
    assert [n for _, n in prefetch.ranges((a, b), 170)] == [160, 10]
    assert [n for _, n in prefetch.ranges((a, b), 100)] == [100, 0]
    assert [n for _, n in prefetch.ranges((a, b), -5)] == [0, 0]
    (t0, n0), (t1, n1) = prefetch.ranges((a,), 1 << 30)
    assert t0 is a and n0 == 160 and t1 is None and n1 == 0
    assert prefetch.ranges((), 1 << 30) == [(None, 0), (None, 0)]
    assert [n for _, n in prefetch.ranges((b,), 1 << 30, 1)] == [200]


def test_ranges_refuse_strided_tensors_and_too_many():
    with pytest.raises(ValueError, match="contiguous"):
        prefetch.ranges((torch.zeros(4, 6).t(),), 1 << 30)
    with pytest.raises(ValueError, match="at most 1"):
        prefetch.ranges((torch.zeros(2), torch.zeros(2)), 1 << 30, 1)


def test_enabled_only_on_a_gpu_outside_the_interpreter(monkeypatch):
    assert not prefetch.enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not prefetch.enabled(torch.device("cuda"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert prefetch.enabled(torch.device("cuda"))
