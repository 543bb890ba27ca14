"""The plan library: tiny-model parity for every model it covers, its refusals, and the checker CLI.

One spawned group of 4 processes runs every case (starting groups costs seconds): cp=4 as dp1 x cp4
(Ulysses, ring, USP 2 ring x 2 ulysses) and cp=2 as dp2 x cp2, where the two CP groups run different
modes of the same case at once (dp rank 0 Ulysses, dp rank 1 ring). Every case runs at a length no CP
degree divides, in fp32, with and without gradient checkpointing (against a one-process reference with
the same setting); each is asserted by its own test.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cp_lightning.check import GRAD_TOL, OUT_TOL
from cp_lightning.models import CASES
from tests.conftest import module_selected, selected
from tests.distributed import spawn

NAMES = sorted(CASES) if not os.environ.get("CP_LIBRARY_CASES") else os.environ["CP_LIBRARY_CASES"].split(",")
TOKENS = 21  # neither 2 nor 4 divides it
LAYOUTS = [(2, 1), (2, 2), (4, 1), (4, 4), (4, 2)]  # (cp, ring): Ulysses, ring, Ulysses, ring, USP 2x2
PARITY = [(name, cp, ring, ckpt) for name in NAMES for cp, ring in LAYOUTS for ckpt in (False, True)]
QUICK = {"flux", "wan2.1", "ltx2"}  # the edit-test loop's cases (-m "not slow"); the full suite runs every one


def _skyreels_block_causal(mesh):
    """SkyReels-V2 DF with blocks of 2 frames: what its self-attention is handed in one process, inside parallelize
    and after remove (and whether a forward that raises restores the config); the dense mask under a plan passed
    by hand (the library entry's hooks are not installed then)."""
    import torch

    from cp_lightning import parallelize, remove
    from cp_lightning.check import build, make_inputs
    from cp_lightning.models import lookup

    case = CASES["skyreels-v2-df-block2"]
    model = build(case)[0]
    inputs = make_inputs(case, [model], case.tokens)[0]
    seen = []  # the attention_mask each self-attention is called with: a tensor's shape, or the spec
    for block in model.blocks:
        block.attn1.register_forward_pre_hook(lambda _m, a: seen.append(getattr(a[2], "shape", a[2])))
    config = model.config
    out = {}
    with torch.no_grad():
        for when in ("stock", "inside", "raised", "after", "by hand"):
            if when == "inside":
                parallelize(model, mesh=mesh)
            if when == "by hand":
                parallelize(model, mesh=mesh, plan=lookup(model).resolve(model))
            seen.clear()
            kwargs = inputs if when != "raised" else {**inputs, "encoder_hidden_states": inputs["timestep"]}
            try:
                model(**kwargs, return_dict=False)
                error = None
            except (ValueError, RuntimeError) as err:  # on every rank alike, before any collective
                error = f"{type(err).__name__}: {err}"
            out[when] = {"masks": list(seen), "config kept": model.config is config, "error": error}
            if when in ("raised", "by hand"):
                remove(model)
    return out


def _all_cases(rank, world, names, skyreels=False):
    from cp_lightning import build_mesh
    from cp_lightning.check import Reference, run_cp
    from cp_lightning.mesh import cp_groups

    meshes = {2: build_mesh(2), 4: build_mesh(4)}
    for cp, ring in LAYOUTS:
        cp_groups(meshes[cp], ring)  # created collectively up front; the dp groups then diverge
    cp2_ring = 1 if rank < 2 else 2
    results = {}
    for name in names:
        for ckpt in (False, True):
            ref = Reference(CASES[name], CASES[name].tokens or TOKENS, ckpt=ckpt)  # a case may need its own count
            for cp, ring in [(2, cp2_ring), (4, 1), (4, 4), (4, 2)]:
                try:
                    results[(name, cp, ring, ckpt)] = run_cp(ref, meshes[cp], ring)
                except ValueError as err:  # refused before any collective, on every rank alike
                    results[(name, cp, ring, ckpt)] = {"error": str(err)}
    if "mochi" in names:  # its stock processor is swapped for the stand-in while parallelized
        from cp_lightning import parallelize, remove
        from cp_lightning.check import build

        model = build(CASES["mochi"])[0]
        parallelize(model, mesh=meshes[4])
        inside = sorted({type(sub.processor).__name__ for sub in model.modules() if hasattr(sub, "processor")})
        remove(model)
        after = sorted({type(sub.processor).__name__ for sub in model.modules() if hasattr(sub, "processor")})
        results["mochi processors"] = {"inside": inside, "after": after}
    if skyreels:
        results["skyreels block-causal"] = _skyreels_block_causal(meshes[4])
    return results


@pytest.fixture(scope="module")
def results(request):
    names = sorted({case[0] for case in selected(request, "case")})  # the selected rows' cases only
    if module_selected(request, "test_mochi_processor_is_stood_in_for_inside_parallelize_and_restored_after"):
        names = sorted({*names, "mochi"})
    if module_selected(request, "test_the_docs_table_is_generated_from_the_library_and_its_parity_rows"):
        names = list(NAMES)  # the table reads every case's rows
    skyreels = any(module_selected(request, test) for test in SKYREELS_TESTS)
    per_rank = spawn(_all_cases, 4, names, skyreels, timeout_s=900)
    merged = {}
    for r in per_rank:
        for case, row in r.items():
            if isinstance(case, str):  # a non-parity record, the same on every rank
                merged[case] = row
                continue
            if case not in merged or "error" in row:
                merged[case] = dict(row)
            elif "error" not in merged[case]:
                for key in ("out_err", "grad_err"):
                    merged[case][key] = max(merged[case][key], row[key])
    return merged


def _id(case):
    name, cp, ring, ckpt = case
    mode = "ulysses" if ring == 1 else ("ring" if ring == cp else f"usp{ring}x{cp // ring}")
    return f"{name}-cp{cp}-{mode}" + ("-ckpt" if ckpt else "")


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=_id(c), marks=[] if c[0] in QUICK else [pytest.mark.slow]) for c in PARITY]
)
def test_parity(results, case):
    r = results[case]
    assert "error" not in r, r
    assert r["out_err"] <= OUT_TOL, r
    assert r["grad_err"] <= GRAD_TOL, r  # relative to max(the tensor's gradient, 1e-4 x the model's largest)
    assert not r["silent"], f"no gradient reaches {r['silent']}"


@pytest.mark.slow
@pytest.mark.skipif(NAMES != sorted(CASES), reason="CP_LIBRARY_CASES leaves cases out: the table needs every case")
def test_the_docs_table_is_generated_from_the_library_and_its_parity_rows(results):
    """docs/models.md's supported-models table is cp_lightning.check_all.docs_table of the parity rows above (no
    error figures in it, so any machine renders the same text)."""
    from pathlib import Path

    from cp_lightning.check_all import docs_region, docs_table

    rows = {}
    for key, row in results.items():
        if not isinstance(key, str):  # a parity row (name, cp, ring, ckpt)
            rows.setdefault(key[0], []).append(row)
    assert sorted(rows) == sorted(CASES) and all(len(r) == 2 * len(LAYOUTS) for r in rows.values())
    assert docs_region(Path("docs/models.md").read_text()) == docs_table(rows), (
        "docs/models.md's generated table differs from the library: rewrite it with "
        "`python -m cp_lightning.check --all --cp 4 --tokens 21 --checkpointing --write-docs docs/models.md`"
    )


# ---------------------------------------------------------------- library lookups (no process group)


def test_every_tiny_case_resolves_its_default_plan():
    from cp_lightning.check import build
    from cp_lightning.models import plan_for
    from cp_lightning.plan import resolve_plan

    for name, case in CASES.items():
        model = build(case)[0]
        assert resolve_plan(model, plan_for(model)), name


def test_library_plan_wins_over_diffusers():
    from diffusers import ChronoEditTransformer3DModel

    from cp_lightning.check import build
    from cp_lightning.models import plan_for

    model = build(CASES["chronoedit"])[0]
    assert "timestep" in plan_for(model)[""]
    assert "" not in ChronoEditTransformer3DModel._cp_plan  # diffusers' plan misses the per-token timestep


def test_class_without_plan_names_the_checker():
    from torch import nn

    from cp_lightning.models import plan_for

    class Custom(nn.Module):
        pass

    with pytest.raises(ValueError, match=r"python -m cp_lightning\.check.*|ContextParallelInput") as info:
        plan_for(Custom())
    assert "python -m cp_lightning.check" in str(info.value) and "ContextParallelInput" in str(info.value)


def test_block_causal_skyreels_is_accepted_with_its_mask_hooks():
    """SkyReels-V2 diffusion forcing with num_frame_per_block > 1 has a plan (its parity rows above are exact) and
    installs the hooks that hand its blocks a mask spec; even a tail block shorter than the rest is accepted."""
    from diffusers import SkyReelsV2Transformer3DModel

    from cp_lightning.models import lookup, plan_for

    for per_block in (2, 3, 5):
        model = SkyReelsV2Transformer3DModel(**dict(CASES["skyreels-v2-t2v"].config, num_frame_per_block=per_block))
        assert plan_for(model) and lookup(model).install is not None


SKYREELS_TESTS = (
    "test_block_causal_skyreels_gets_a_spec_inside_parallelize_and_its_stock_mask_after_remove",
    "test_a_dense_block_causal_skyreels_mask_stays_refused",
)


def test_block_causal_skyreels_gets_a_spec_inside_parallelize_and_its_stock_mask_after_remove(results):
    """Inside parallelize the blocks' self-attention is handed a MaskSpec, never the dense (1, 1, S, S) mask, and
    the model's own config object is back after every forward, one that raises included; after remove the stock
    forward builds its dense mask again."""
    from cp_lightning.masks import block_causal

    r = results["skyreels block-causal"]
    dense, spec = (1, 1, 30, 30), block_causal(10, 3, 2)  # 10 frames x 3 tokens, blocks of 2 frames
    assert r["stock"] == {"masks": [dense, dense], "config kept": True, "error": None}, r["stock"]
    assert r["inside"] == {"masks": [spec, spec], "config kept": True, "error": None}, r["inside"]
    assert r["raised"]["error"] and r["raised"]["config kept"], r["raised"]
    assert r["after"] == r["stock"], r["after"]


def test_a_dense_block_causal_skyreels_mask_stays_refused(results):
    """With a plan passed by hand the entry's hooks are not installed: diffusers' dense block-causal mask reaches
    the CP attention, which cannot prove it equal to a spec and refuses it before communicating."""
    r = results["skyreels block-causal"]["by hand"]
    assert r["error"].startswith("ValueError") and "one row per query" in r["error"], r
    assert r["masks"][:1] == [(1, 1, 30, 30)] and r["config kept"], r


def test_omnigen_is_refused_before_any_collective():
    import torch
    from diffusers import OmniGenTransformer2DModel

    from cp_lightning.models import plan_for

    factors = {"short_factor": [1.0] * 4, "long_factor": [1.0] * 4}
    with torch.device("meta"):
        model = OmniGenTransformer2DModel(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_layers=1,
            vocab_size=16, pad_token_id=0, rope_scaling=factors, pos_embed_max_size=8, time_step_dim=16,
        )  # fmt: skip
    with pytest.raises(ValueError, match="causal over the condition tokens"):
        plan_for(model)


@pytest.mark.parametrize(
    "cls, why",
    [
        ("AnyFlowFARTransformer3DModel", "frame-causal FlexAttention BlockMask"),
        ("WanAnimate2Transformer3DModel", "FlexAttention block mask"),
        ("Kandinsky6SRTransformer3DModel", "NABLA sparse attention"),
        ("SanaWMTransformer3DModel", "Gated DeltaNet"),
    ],
)
def test_video_classes_that_cannot_be_exact_are_refused_with_the_reason(cls, why):
    """Whole classes the library refuses (their attention has no exact CP form yet): plan_for raises the reason."""
    import diffusers

    from cp_lightning.models import plan_for

    klass = getattr(diffusers, cls)
    with pytest.raises(ValueError, match=why) as info:
        plan_for(klass.__new__(klass))  # the refusal reads no config: no instance needs building
    assert f"{cls} cannot be made exactly context parallel" in str(info.value)


# ---------------------------------------------------------------- the checker CLI

# diffusers' ChronoEdit plan: per-token timesteps stay whole while the tokens are split (a crash)
CHRONOEDIT_DIFFUSERS_PLAN = __import__("diffusers").ChronoEditTransformer3DModel._cp_plan


def _check(*args):
    """`python -m cp_lightning.check ARGS` in a subprocess, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cp_lightning.check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _check_here(monkeypatch, capsys, *args):
    """The checker's ``main(ARGS)`` in this process, its ranks workers of the shared pool (the table, exit code
    and every row as from the command line, which the first test below runs)."""
    from types import SimpleNamespace

    from cp_lightning import check

    monkeypatch.setattr(check, "run_workers", lambda fn, world, *a, **_: spawn(fn, world, *a, timeout_s=600))
    code = check.main(list(args))
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def test_checker_passes_a_library_model_and_prints_its_table():
    run = _check("wan2.1", "--cp", "2", "--tokens", "9")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| ulysses |" in run.stdout and "| ring |" in run.stdout and "FAIL" not in run.stdout


def test_checker_fails_a_wrong_plan_with_a_non_zero_exit(monkeypatch, capsys):
    run = _check_here(
        monkeypatch,
        capsys,
        "chronoedit",
        "--cp",
        "2",
        "--tokens",
        "9",
        "--plan",
        "tests.test_library:CHRONOEDIT_DIFFUSERS_PLAN",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAIL" in run.stdout


CUSTOM = ["tests.custom_dit:TinyDiT", "--config", "tests/custom_dit.json", "--inputs", "tests.custom_dit:inputs"]


def test_checker_passes_a_correct_plan_for_a_model_outside_the_library(monkeypatch, capsys):
    run = _check_here(monkeypatch, capsys, *CUSTOM, "--plan", "tests.custom_dit:PLAN", "--cp", "2", "--tokens", "9")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| ulysses |" in run.stdout and "| ring |" in run.stdout and "FAIL" not in run.stdout


@pytest.mark.parametrize("plan, why", [("WRONG_DIM", "shapes"), ("WRONG_GATHER", "crashed")])
def test_checker_fails_a_wrong_plan_for_a_model_outside_the_library(monkeypatch, capsys, plan, why):
    run = _check_here(monkeypatch, capsys, *CUSTOM, "--plan", f"tests.custom_dit:{plan}", "--cp", "2", "--tokens", "9")
    assert run.returncode == 1, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ulysses") or line.startswith("| ring")]
    assert len(rows) == 2 and all("FAIL" in row and why in row for row in rows), run.stdout


def test_the_custom_model_example_in_the_docs_is_the_tested_one():
    from pathlib import Path

    import tests.custom_dit as example

    code = Path(example.__file__).read_text().split('"""\n', 2)[2].strip()  # below the module docstring
    assert code in Path("docs/models.md").read_text()


def test_custom_model_usage_errors_exit_2(capsys):
    from cp_lightning.check import main

    assert main(["tests.custom_dit:TinyDiT", "--config", "tests/custom_dit.json"]) == 2  # no --inputs
    assert "--inputs module:function" in capsys.readouterr().err
    assert main([*CUSTOM[:3], "--inputs", "tests.custom_dit:nothing"]) == 2
    assert main(["tests.custom_dit:inputs", *CUSTOM[1:]]) == 2  # not an nn.Module class
    assert main(["wan2.1", "--config", "tests/custom_dit.json"]) == 2


def test_checker_usage_errors_exit_2(capsys):
    from cp_lightning.check import main

    assert main(["NoSuchTransformer"]) == 2
    assert "add a TinyCase" in capsys.readouterr().err
    assert main(["wan2.1", "--cp", "4", "--ring", "3"]) == 2
    assert main(["wan2.1", "--plan", "no_colon"]) == 2


REFUSED_WHOLE = {
    "OmniGenTransformer2DModel": "causal over the condition tokens",
    "AnyFlowFARTransformer3DModel": "frame-causal FlexAttention BlockMask",
    "WanAnimate2Transformer3DModel": "FlexAttention block mask",
    "Kandinsky6SRTransformer3DModel": "NABLA sparse attention",
    "SanaWMTransformer3DModel": "Gated DeltaNet",
}


def test_checker_prints_the_refusal_of_a_class_refused_whole(capsys):
    """A refused class has no tiny case to build: the checker answers with the entry's reason and exit 0."""
    from cp_lightning.check import main

    for cls, why in REFUSED_WHOLE.items():
        assert main([cls]) == 0, cls
        out = capsys.readouterr().out
        assert out.startswith(f"{cls}: refused") and why in out, out


def test_checker_all_prints_one_row_per_class_and_fails_a_failing_class(monkeypatch, capsys):
    """``--all``'s table and exit status, on rows made up here (the parity rows above run the real cases)."""
    from cp_lightning import check_all
    from cp_lightning.check import main

    ok = {"out_err": 1e-7, "grad_err": 2e-6, "worst": "0.proj_out.weight", "silent": []}
    rows = {name: [{"mode": "ulysses", **ok}, {"mode": "ring", **ok}] for name in CASES}
    monkeypatch.setattr(check_all, "run_all", lambda *_: rows)
    assert main(["--all", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    table_rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| diffusers")]
    assert len(table_rows) == len(check_all.classes()), out
    assert "| FluxTransformer2DModel | flux | exact | 1.00e-07 | 2.00e-06 | flux ring: 0.proj_out.weight |" in out
    assert all(f"| {cls} |  | refused: " in out and why in out for cls, why in REFUSED_WHOLE.items()), out
    assert f"{len(REFUSED_WHOLE)} refused" in out
    rows["flux"][1] = {"mode": "ring", **ok, "grad_err": 0.5}
    assert main(["--all", "--cp", "2"]) == 1
    assert "| FluxTransformer2DModel | flux | failing: `flux` ring: gradient error 5.00e-01" in capsys.readouterr().out


def test_checker_all_usage_errors_exit_2(capsys):
    from cp_lightning.check import main

    assert main(["--all", "wan2.1"]) == 2 and "takes no CLASS_OR_CONFIG" in capsys.readouterr().err
    assert main(["--all", "--cp", "4", "--ring", "3"]) == 2
    assert main([]) == 2 and "or pass --all" in capsys.readouterr().err
    assert main(["wan2.1", "--write-docs", "docs/models.md"]) == 2
    assert main(["--all", "--write-docs", "README.md"]) == 2 and "no generated region" in capsys.readouterr().err


@pytest.mark.skipif("mochi" not in NAMES, reason="CP_LIBRARY_CASES leaves Mochi out")
def test_mochi_processor_is_stood_in_for_inside_parallelize_and_restored_after(results):
    """Mochi's stock processor unpads each sample's text (it cannot run on split tokens): parallelize swaps in the
    key-masked stand-in, remove() puts the stock one back; its parity rows above prove the stand-in exact."""
    from cp_lightning import routing
    from cp_lightning.check import build

    model = build(CASES["mochi"])[0]
    assert {routing.processor_kind(sub.processor) for _, sub in routing.attention_modules(model)} == {"stand-in"}
    assert results["mochi processors"] == {"inside": ["MochiJointAttention"], "after": ["MochiAttnProcessor2_0"]}


def test_checker_scales_down_a_diffusers_config(tmp_path):
    import json

    from cp_lightning.check import build, resolve_case

    config = {"_class_name": "WanTransformer3DModel", "num_layers": 30, "num_attention_heads": 24}
    config.update(attention_head_dim=128, qk_norm="rms_norm", cross_attn_norm=False, in_channels=48)
    (tmp_path / "config.json").write_text(json.dumps(config))
    case = resolve_case(str(tmp_path))
    model = build(case)[0]
    # architecture switches come from the user's config, sizes stay tiny
    assert model.config.qk_norm == "rms_norm" and model.config.cross_attn_norm is False
    assert model.config.num_layers == 1 and model.config.num_attention_heads == 4


def test_loss_parallel_is_refused_for_plans_whose_last_gather_returns_into_a_block():
    """Helios's plan gathers inside each block, whose own code then adds the output to whole tokens: loss-parallel
    (which leaves that gather sharded) is a clear error before any process group is needed, while every other
    library plan (its last gather feeds per-token modules only) is accepted."""
    import diffusers
    import torch

    from cp_lightning.models import plan_for
    from cp_lightning.parallelize import _check_entry_loss_parallel
    from cp_lightning.plan import check_loss_parallel, resolve_plan

    refused = {}
    for name, case in CASES.items():
        with torch.device("meta"):
            model = getattr(diffusers, case.cls)(**case.config)
        try:
            check_loss_parallel(model, resolve_plan(model, plan_for(model)))
            _check_entry_loss_parallel(model, None)  # a reason the entry gives, where no rule sees it
        except ValueError as err:
            refused[name] = str(err)
    # Sana's feed-forward convolves the token grid, so its plan gathers around each attention like Helios's;
    # HiDream's forward cuts the last block's gathered output by full lengths
    # image DiTs whose forward cuts the image tokens out of the gathered joint sequence (issue 46)
    cut = ["bria-fibo2", "ernie-image", "krea2"]
    # video DiTs (issue 46) whose forward regroups the gathered tokens by full lengths or the whole grid
    video = ["anyflow", "consisid", "hunyuanvideo-framepack", "kandinsky6", "latte"]
    # Cosmos3 reads its predictions at global indexes of the concatenated [text, generated] streams (issue 46)
    packed = ["cosmos3-omni"]
    assert sorted(refused) == sorted(["helios", "hidream-i1", "sana", "sana-video", *cut, *video, *packed]), refused
    assert all("Train it without loss_parallel" in refused[name] for name in video + packed), refused
    assert all("cuts the image tokens out of" in refused[name] for name in cut), refused
    assert "'blocks.0.ffn'" in refused["helios"] and "without loss_parallel" in refused["helios"]
    assert "cuts the last block's output" in refused["hidream-i1"] and "without loss_parallel" in refused["hidream-i1"]
