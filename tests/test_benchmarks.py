"""Each benchmark script runs in a tiny configuration, so the scripts cannot rot.

The figures themselves are measured by running the scripts (see docs/benchmarks.md), not here.
"""

from __future__ import annotations


def test_ring_memory_benchmark_runs_every_mode(capsys):
    from benchmarks import ring_memory

    rows = ring_memory.main(["--cp", "2", "--tokens", "256", "--text-tokens", "16", "--layers", "1"])
    assert set(rows) == {"ulysses", "ring", "allgather"}
    for mode, per_rank in rows.items():
        assert len(per_rank) == 2
        for figures in per_rank:
            assert figures["peak"] >= 0 and figures["time"] > 0 and figures["sent"] > 0, (mode, figures)
    table = capsys.readouterr().out
    assert "| ulysses |" in table and "| ring |" in table and "| allgather |" in table
