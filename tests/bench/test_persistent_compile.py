"""`declab_bench.persistent_compile`'s SASS reading: which of a loop's global loads are waited on in the
iteration that issued them, on a hand-written SASS loop; and its command's refusals."""

import pytest

from declab_bench.persistent_compile import loops


def sass(lines):
    return "\n".join(f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(lines))


def test_a_load_read_in_its_iteration_is_waited_one_not_read_there_is_in_flight():
    body = ["LDG.E.128 R4, desc[UR4][R2.64]",     # R4..R7, R5 read below: waited
            "LDG.E.64 R12, desc[UR4][R8.64]",     # never read in the body: in flight
            "@P0 LDG.E R20, desc[UR4][R10.64]"] + ["FFMA R30, R5, R31, R30"] * 8 + [
            "STG.E desc[UR4][R10.64], R20",      # a store reads its value: waited
            "STL [R1], R30",                      # a spill store (of no load's register)
            "BRA 0x0000"]
    (loop,) = loops(sass(body))
    assert loop == dict(start="0x0", instructions=len(body), loads_waited=2, loads_in_flight=1, spill_ops=1)


def test_forward_branches_and_loops_without_arithmetic_are_not_loops():
    assert loops(sass(["LDG.E R4, desc[UR4][R2.64]", "BRA 0x0040", "FFMA R5, R4, R4, R5"])) == []
    assert loops(sass(["LDG.E R4, desc[UR4][R2.64]", "IADD3 R2, R2, 4, RZ", "BRA 0x0000"])) == []


@pytest.mark.parametrize("args, env, message", [
    (["--models", "no-such-preset"], {}, "no-such-preset"),
    (["--models", "maskpredict-tiny"], {}, "no persistent step"),
    (["--programs", "0"], {}, "at least 1"),
    ([], {"TRITON_INTERPRET": "1"}, "TRITON_INTERPRET"),
    (["--models", "llama-tiny", "--tiles", "qkv=4"], {}, "--tiles applies to Mamba-2 and RWKV-7 models, not transformer"),
    (["--models", "mamba2-tiny", "--tiles", "rows=4"], {}, "NAME is one of in_rows, block_p, out_rows, head_rows"),
    (["--models", "mamba2-tiny", "--tiles", "in_rows=0"], {}, "ROWS must be an integer >= 1"),
    (["--models", "mamba2-tiny", "--tiles", "in_rows=x"], {}, "ROWS must be an integer >= 1"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_compile(monkeypatch, capsys, args, env, message):
    from declab_bench import persistent_compile

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(persistent_compile, "build", lambda *a: pytest.fail("built a step for a refused input"))
    assert persistent_compile.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_malformed_ptx_version_is_one_line_and_exit_2(capsys):
    from declab_bench import persistent_compile

    with pytest.raises(SystemExit) as exit:
        persistent_compile.main(["--ptx-version", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and "MAJOR.MINOR" in err[0]


def test_tiles_replace_the_planned_fields_of_the_step_compiled():
    from declab_bench import persistent_compile

    step = persistent_compile.build("mamba2-tiny", 8, 32, {"in_rows": 4, "head_rows": 8})
    planned = persistent_compile.build("mamba2-tiny", 8, 32)
    assert (step.tiles.in_rows, step.tiles.head_rows) == (4, 8)
    assert (step.tiles.block_p, step.tiles.out_rows) == (planned.tiles.block_p, planned.tiles.out_rows)
    assert planned.tiles.in_rows != 4 or planned.tiles.head_rows != 8
