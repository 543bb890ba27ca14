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


TINY = ["--tokens", "256", "--text-tokens", "16", "--layers", "1", "--repeats", "1"]


def test_scaling_benchmark_rows_bytes_and_plot(capsys, tmp_path):
    from benchmarks import scaling

    out = scaling.main(["--cps", "1", "2", "--modes", "ring", "--plot", str(tmp_path / "scaling.png"), *TINY])
    rows = out["rows"]
    assert [(r["cp"], r["mode"], r["ring"]) for r in rows] == [(1, "none", 1), (2, "ring", 2)]
    for row in rows:
        assert row["peak"] > 0 and row["time"] > 0 and row["cpu"] > 0, row
    assert rows[0]["sent"] == 0
    assert abs(rows[1]["sent"] - rows[1]["formula"]) <= 0.05 * rows[1]["formula"], rows[1]
    assert (tmp_path / "scaling.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "| 1 | none | 1 | 1 x 2 |" in table and "| 2 | ring | 2 | 2 x 1 |" in table


def test_scaling_formulas_match_the_byte_test():
    from benchmarks.common import formula_bytes

    # one layer of attention, no output gather: the per-layer figures tests/test_comm_bytes.py checks
    m = 2 * (64 // 4) * 4 * 8 * 4
    kw = dict(cp=4, tokens=128, text_tokens=0, heads=4, head_dim=8, attention_layers=1, out_channels=0)
    assert formula_bytes("ulysses", ring=1, **kw) == 2 * 4 * m * 3 / 4  # 4 all-to-alls each way
    assert formula_bytes("ring", ring=4, **kw) == 2 * m * 3 + 2 * m * 3 + 2 * m * 4
    assert formula_bytes("usp", ring=2, **kw) == 2 * 4 * m / 2 + 2 * m + 2 * m + 2 * m * 2


def test_diffusers_head_to_head_runs_both_implementations(capsys):
    from benchmarks import diffusers_cp

    out = diffusers_cp.main(["--cps", "2", "--one-group", *TINY])
    rows = {(r["impl"], r["mode"]): r for r in out["rows"]}
    assert set(rows) == {(i, m) for i in ("cp_lightning", "diffusers") for m in ("ulysses", "ring")}
    for key, row in rows.items():
        assert row["cp"] == 2 and row["peak"] > 0 and row["time"] > 0 and row["sent"] > 0, (key, row)
    # same Ulysses algorithm, same tensors: the same bytes
    ours, theirs = rows["cp_lightning", "ulysses"]["sent"], rows["diffusers", "ulysses"]["sent"]
    assert abs(ours - theirs) <= 0.05 * theirs, (ours, theirs)
    table = capsys.readouterr().out
    assert "| 2 | ring | diffusers |" in table and "| 2 | ulysses | cp_lightning |" in table


def test_max_sequence_brackets_the_budget(capsys):
    from benchmarks import max_sequence

    budget_mib = 6
    out = max_sequence.main(
        ["--cps", "2", "--budget-mib", str(budget_mib), "--first-probe", "128", "--granularity", "64"]
        + ["--text-tokens", "16", "--layers", "1"]
    )
    (row,) = out["rows"]
    assert row["cp"] == 2 and row["tokens"] > 0 and 0 < row["peak"] <= budget_mib * 2**20, row
    # the search saw a larger count that did not fit, within one granularity step
    over = [tokens for tokens, peak, _ in row["probes"] if peak > budget_mib * 2**20]
    assert over and 0 < min(over) - row["tokens"] <= 64, row["probes"]
    assert "| 2 | ulysses |" in capsys.readouterr().out


def test_uneven_overhead_benchmark_runs_every_mode(capsys):
    from benchmarks import uneven_overhead

    rows = uneven_overhead.main(
        ["--cp", "2", "--tokens", "64", "--text-tokens", "8", "--layers", "1", "--repeats", "1"]
    )
    assert [r["mode"] for r in rows] == ["ulysses", "ring"]  # USP needs cp >= 4
    for r in rows:
        # the divisible run never leaves the even path; the uneven one does
        assert r["divisible"]["even"] and not r["uneven"]["even"], r
        assert (r["uneven"]["tokens"], r["uneven"]["text_tokens"]) == (63, 7)
        assert r["divisible"]["time"] > 0 and r["uneven"]["time"] > 0, r
    assert "| ring | 64 + 8 | 63 + 7 |" in capsys.readouterr().out


def test_gpu_check_cpu_runs_every_cpu_step_and_writes_its_json(tmp_path):
    """The script as CI runs it, in a fresh interpreter (its steps are forks of it)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root, out = Path(__file__).resolve().parents[1], tmp_path / "gpu_check"
    cmd = [sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL CHECKS PASSED" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    statuses = {step["name"]: step["status"] for step in summary["steps"]}
    assert summary["ok"] and summary["mode"] == "cpu", summary["failed"]
    assert statuses == {
        **dict.fromkeys(["facts", "kernels", "ring", "compile", "speed", "fp8", "e2e", "loading", "multi_gpu"], "ok"),
        "memory": "skipped",
    }, statuses
    steps = {step["name"]: step.get("result", {}) for step in summary["steps"]}
    for name in statuses:
        assert (out / f"{name}.json").exists() or statuses[name] == "skipped", name
    assert steps["kernels"]["checked"] > 100 and steps["kernels"]["failed"] == 0
    # the shipped ring loop at P = 2, 4, 8, uneven, with and without masks, fp64 to 1e-12
    ring = steps["ring"]["rows"]
    assert {(r["P"], r["mask"]) for r in ring} == {(p, m) for p in (2, 4, 8) for m in (None, "key", "block")}
    assert all(r["ok"] and len(set(r["lengths"])) > 1 for r in ring)
    assert max(r["out_err"] for r in ring if r["dtype"] == "float64") <= 1e-12
    assert steps["compile"]["compiled_vs_eager_max_diff"] == [0.0] * 4
    # the multi-GPU part's ring rows run the ring (they ran Ulysses whatever they asked for, before issue 44)
    parity = steps["multi_gpu"]["parity"]["rows"]
    assert {(r["mode"], r["ulysses"], r["ring"]) for r in parity} == {("ulysses", 2, 1), ("ring", 1, 2)}
    assert all(r["ok"] for r in parity) and all(r["finite"] for r in steps["e2e"]["rows"])
    assert {r["variant"] for r in steps["loading"]["rows"]} == {"bf16", "fp8"}


def test_gpu_check_timeout_kills_the_step_and_its_detached_children(tmp_path):
    """torchrun starts its workers in sessions of their own: killing the step's process group left them
    running. The whole tree goes, and the caller gets "timeout" back, not an exception."""
    import sys
    from pathlib import Path

    from benchmarks.gpu_check import run_isolated

    sleeper = "import time; time.sleep(120)"
    script = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {sleeper!r}], start_new_session=True)\n"
        "open(sys.argv[1], 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    pid_file = tmp_path / "pid"
    # 8 s: time for the child to start its grandchild and write its pid on a loaded 2-core machine
    how, code = run_isolated([sys.executable, "-c", script, str(pid_file)], None, timeout=8, log=tmp_path / "log")
    assert (how, code) == ("timeout", None)
    import time

    stat = Path(f"/proc/{pid_file.read_text()}/stat")

    def dead() -> bool:  # gone, or dead and unreaped
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    deadline = time.monotonic() + 5  # SIGKILL is delivered when the kernel next schedules the process
    while not dead() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dead(), stat.read_text()


def test_gpu_check_reports_a_step_that_times_out_and_goes_on(tmp_path, monkeypatch):
    import json
    import time

    from benchmarks import gpu_check

    def stuck(ctx):
        time.sleep(60)

    def done(ctx):  # no torch in the forked children: this test process may have thread pools running
        return {"ok": True}

    steps = [gpu_check.Step("before", done, 30), gpu_check.Step("stuck", stuck, 30), gpu_check.Step("after", done, 30)]
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    monkeypatch.setattr(gpu_check, "CPU_TIMEOUT_S", 2)
    summary = gpu_check.run_all(gpu_check.parse(["--cpu", "--out", str(tmp_path)]))
    got = [(s["name"], s["status"]) for s in summary["steps"]]
    assert got == [("before", "ok"), ("stuck", "timeout"), ("after", "ok")], got
    assert not summary["ok"] and summary["failed"] == ["stuck"]
    assert json.loads((tmp_path / "summary.json").read_text())["failed"] == ["stuck"]


def test_fsdp_memory_benchmark_shards_the_training_state(capsys):
    from benchmarks import fsdp_memory

    argv = ["--cps", "2", "--one-group", "--tokens", "64", "--text-tokens", "16", "--layers", "1"]
    rows = {r["mode"]: r for r in fsdp_memory.main([*argv, "--repeats", "1", "--warmup", "0"])["rows"]}
    assert set(rows) == {"ddp", "fsdp", "hsdp"}
    for mode, row in rows.items():
        assert row["state"] > 0 and row["peak"] > 0 and row["time"] > 0, (mode, row)
    assert rows["fsdp"]["state"] <= 0.27 * rows["ddp"]["state"]  # sharded over world 4
    assert rows["hsdp"]["state"] <= 0.52 * rows["ddp"]["state"]  # sharded over cp = 2, replicated over dp
    assert "| 2 x 2 | fsdp |" in capsys.readouterr().out


def test_gather_rule_benchmark_times_every_rule(capsys):
    from benchmarks import gather_rule

    out = gather_rule.main(["--cps", "2", "--modes", "ulysses", "--rules", "proved", "after", *TINY])
    rows = {r["rule"]: r for r in out["rows"]}
    assert set(rows) == {"proved", "after"}
    assert all(r["time"] > 0 for r in rows.values()), rows
    # the proved free slice sends no reduce-scatter; a gather before norm_out/proj_out needs one
    assert rows["proved"]["reduce_scatter"] == 0 and rows["after"]["reduce_scatter"] > 0, rows
    assert "| 2 | ulysses | after |" in capsys.readouterr().out


def test_compile_speed_benchmark_times_both_in_one_run(capsys):
    from benchmarks import compile_speed

    rows = compile_speed.main(
        ["--modes", "ring", "--backend", "aot_eager", "--tokens", "64", "--text-tokens", "8", "--layers", "1"]
        + ["--warmup", "0", "--repeats", "1"]
    )
    assert [(r["mode"], r["cp"], r["ring"]) for r in rows] == [("ring", 2, 2)]
    assert rows[0]["eager_time"] > 0 and rows[0]["compiled_time"] > 0 and rows[0]["compile"] > 0
    assert "| ring | 2 | 2 |" in capsys.readouterr().out


ALLOCATE = """
import os, subprocess, sys, time
mib = [int(a) for a in sys.argv[1:]]
child = None
if len(mib) > 1:  # rank 0 starts rank 1 as its child, as Lightning's script launcher does
    env = {**os.environ, "LOCAL_RANK": "1"}
    child = subprocess.Popen([sys.executable, "-c", os.environ["ALLOCATE"], str(mib[1])], env=env)
block = b"x" * (mib[0] * 2**20)  # written, so every page is resident
time.sleep(0.6)
del block
if child is not None:
    child.wait()
"""


def _allocate_peaks(tmp_path, *mib: int) -> dict:
    import os
    import sys

    from benchmarks.rss import run_polled

    env = {**os.environ, "ALLOCATE": ALLOCATE}
    cmd = [sys.executable, "-c", ALLOCATE, *map(str, mib)]
    result = run_polled(cmd, env=env, cwd=tmp_path, log=tmp_path / "log.txt", timeout=60)
    assert result["code"] == 0, (tmp_path / "log.txt").read_text()
    return result["peaks"]


def test_rss_poller_reads_each_ranks_anonymous_memory(tmp_path):
    base, peaks = _allocate_peaks(tmp_path, 0, 0), _allocate_peaks(tmp_path, 96, 48)
    assert set(base) == set(peaks) == {0, 1}, (base, peaks)
    for rank, mib in ((0, 96), (1, 48)):
        above = (peaks[rank] - base[rank]) / 2**20
        assert abs(above - mib) <= 0.1 * mib, (rank, above, base, peaks)


def test_scale_memory_benchmark_measures_a_tiny_run(capsys, tmp_path):
    from benchmarks import scale_memory

    argv = ["--worlds", "2", "--modes", "ddp", "--params", "4", "--hidden", "128", "--out", str(tmp_path)]
    out = scale_memory.main(argv)
    (row,) = out["rows"]
    assert row["status"] == "ok" and row["world"] == 2 and len(row["above"]) == 2, row
    # the fp32 files load memory-mapped (shared file pages, not the rank's own memory) and DDP's start-up sync
    # copies nothing: at training start a DDP rank holds well under the model's 16 MiB above the tiny run
    # (a copy per rank, as from_pretrained + DDP's bucketed broadcast made, would be >= 1.0x)
    assert all(r is not None and r < 0.5 for r in row["loaded_ratio"]), row
    assert all(r < 4.0 for r in row["ratio"]), row
    # every rank holds the whole frozen base in fp32 under DDP: twice its bf16 bytes
    assert all(abs(v - 2.0) < 1e-3 for v in row["frozen_vs_bf16"]), row
    assert not (tmp_path / "model_fp32").exists()  # removed without --keep
    table = capsys.readouterr().out
    line = next(x for x in table.splitlines() if x.startswith("| ddp |"))
    assert line.startswith("| ddp | DDP LoRA, fp32 | fp32 |") and line.count("|") == 11, line


def test_scale_memory_marks_options_this_checkout_lacks():
    from benchmarks import scale_memory

    fp8 = scale_memory.MODES["ddp-fp8"]
    assert scale_memory.available(fp8, {"weights_dtype", "base_dtype"})
    assert not scale_memory.available(fp8, {"weights_dtype"})
    assert scale_memory.available(scale_memory.MODES["ddp"], set())
    children = scale_memory.MODES["fsdp-children"]
    assert not scale_memory.available(children, {"weights_dtype", "base_dtype"})
    assert scale_memory.available(children, scale_memory.model_options())  # this checkout has fsdp_units


def test_scale_memory_caps_onednn_plan_caches_unless_told_not_to(monkeypatch):
    from benchmarks import scale_memory

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "999")
    capped = scale_memory.rank_env()
    assert capped["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == capped["LRU_CACHE_CAPACITY"] == scale_memory.ONEDNN_CACHE
    assert capped["MALLOC_MMAP_THRESHOLD_"] == "65536" and capped["OMP_NUM_THREADS"] == "1"
    default = scale_memory.rank_env("default")
    assert "LRU_CACHE_CAPACITY" not in default and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in default
    assert scale_memory.parse(["--onednn-caches", "default"]).onednn_caches == "default"
    assert scale_memory.parse([]).onednn_caches == "capped"


def test_dynamic_cp_benchmark_trains_the_same_samples_in_every_configuration(capsys):
    from benchmarks import dynamic_cp

    argv = ["--image-tokens", "16", "--video-tokens", "256", "--videos", "1", "--images-per-video", "16"]
    argv += ["--rounds", "1", "--ab-repeats", "1", "--layers", "1", "--max-batch", "4", "--text-tokens", "8"]
    rows = dynamic_cp.main(argv)
    ab = rows.pop()
    assert ab["config"] == "video A/B" and ab["fixed cp"] > 0 and ab["dynamic CP"] > 0
    assert [r["config"] for r in rows] == list(dynamic_cp.CONFIGS)
    assert {r["samples"] for r in rows} == {17} and [r["image_batch"] for r in rows] == [1, 4, 1, 4]
    assert all(r["samples_per_s"] > 0 and r["video_step"] > 0 for r in rows)
    assert "| dynamic CP | 1 |" in capsys.readouterr().out
