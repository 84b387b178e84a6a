"""declab_bench.quant_gemv: its refusal to run without a GPU (its timing itself runs on one)."""

import pytest
import torch

from declab_bench import quant_gemv


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_bench_needs_a_gpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        quant_gemv.main(["--out", "unused.jsonl"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.count("\n") == 1
