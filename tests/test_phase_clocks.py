"""benchmarks/phase_clocks.py, the table of a JSMLA_PHASE_CLOCKS build's phase records: the last launch
of a kernel kept, medians and maxima per mark over the blocks, unreached marks left out, and a clear
failure when a run printed no records; benchmarks/phase_clocks.sh refuses a tree built without the knob."""

import io
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import phase_clocks  # noqa: E402


def _line(role, block, start, end, marks):
    marks = list(marks) + [-1] * (19 - len(marks))
    return (f"PHASE h16 {role} block={block} split={block} head_tile=0 token=0 start_ns={start} end_ns={end} "
            f"c={','.join(str(m) for m in marks)}\n")


def test_last_launch_medians_and_maxima():
    first_launch = [_line("producer", 0, 10, 20, [999999]), _line("producer", 1, 10, 20, [999999])]
    second_launch = [
        _line("producer", 0, 1000, 9000, [100, 2000, 3000]),
        _line("consumer", 0, 1000, 12000, [900, 3100] + [-1] * 11 + [7000, 8000, 9000]),
        _line("producer", 1, 1500, 9500, [300, 2200, 3400]),
        _line("producer", 2, 1200, 9100, [200, 2100, 3200]),
    ]
    launches = phase_clocks.parse(io.StringIO("noise\n" + "".join(first_launch + second_launch)))
    assert len(launches["h16"]["producer"]) == 3  # the first launch's records are dropped
    text = phase_clocks.table(launches, ghz=2.0)
    assert "## h16: 3 blocks; block starts 0..500 ns after the first, ends 8000..11000 ns" in text
    assert "| 0: tile 0 issued | 200 | 300 | 0.10 | 0.15 |" in text
    assert "| 2: tile 0 converted | 3200 | 3400 | 1.60 | 1.70 |" in text
    assert "| 15: stores issued | 9000 | 9000 | 4.50 | 4.50 |" in text
    assert "tile 1 full" not in text  # marks no block reached are left out


def test_start_marks_follow_the_numbered_ones():
    marks = [100, 2000] + [-1] * 14 + [700, 300, 650]
    launches = phase_clocks.parse(io.StringIO(_line("producer", 0, 0, 9000, marks)))
    text = phase_clocks.table(launches, ghz=2.0)
    assert "| 16: count and lengths arrived | 700 | 700 | 0.35 | 0.35 |" in text
    assert "| 17: coordinates computed | 300 | 300 | 0.15 | 0.15 |" in text
    assert "| 18: first index arrived | 650 | 650 | 0.33 | 0.33 |" in text


def test_roles_of_a_block_share_one_time_line():
    producer = _line("producer", 0, 1000, 9000, [100, 2000]).replace(" c=", " start_cycles=5000 c=")
    consumer = _line("consumer", 0, 1000, 9000, [400, -1, 900]).replace(" c=", " start_cycles=5300 c=")
    launches = phase_clocks.parse(io.StringIO(producer + consumer))
    assert launches["h16"]["producer"][0]["marks"][:2] == [100, 2000]  # the earlier role is the origin
    assert launches["h16"]["consumer"][0]["marks"][:3] == [700, -1, 1200]  # shifted by 300; unreached stays -1


def test_no_records_is_an_error(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("dsv3_2 T=1 H=128 PASS\n")
    assert phase_clocks.main([str(log)]) == 1
    assert "no PHASE lines" in capsys.readouterr().out


def test_the_device_script_refuses_a_tree_without_the_knob(tmp_path):
    header = tmp_path / "kernels" / "cuda" / "launch_params.h"
    header.parent.mkdir(parents=True)
    header.write_text("#ifndef JSMLA_PHASE_CLOCKS\n#define JSMLA_PHASE_CLOCKS 0\n#endif\n")
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "phase_clocks.sh"), str(tmp_path)],
                         capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path / "out")))
    assert run.returncode == 2
    assert "not built with JSMLA_PHASE_CLOCKS=1" in run.stdout
