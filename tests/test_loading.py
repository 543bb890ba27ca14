"""Loading a diffusers folder without any rank holding the whole model (cp_lightning.loading), CPU, gloo.

Every sharded load is compared with ``from_pretrained`` of the same folder (exactly: fp32, and bf16 cast
from fp32 files), with and without LoRA, at world 2 and 4, FSDP over dp x cp and HSDP; trainings that start
from a meta-built model (Lightning FSDP and DDP, Fabric, Accelerate) are compared with the same training
from ``from_pretrained`` and with one process (SGD). One spawned group per world size runs every case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import spawn

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def save_tiny(folder: Path, family: str = "flux") -> Path:
    """The tiny model with every weight non-zero (zero-initialised gates and outputs too), saved sharded."""
    from cp_lightning.tiny import tiny_model

    model = tiny_model(family)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(folder, max_shard_size="40KB")
    return folder


def with_lora(model):
    from peft import LoraConfig

    from cp_lightning import loading

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    loading.init_lora(model, seed=3)
    return model


def numpy_state(model) -> dict:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


# -- worker side ----------------------------------------------------------------------------------
def with_fp8(model):
    from cp_lightning import to_fp8_base

    model.requires_grad_(False)
    return to_fp8_base(model)


def gathered_state(model) -> dict:
    """The consolidated state of a sharded model with float8 tensors (gathered as bytes: gloo has no float8)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor) and t.dtype == torch.float8_e4m3fn:
            local = t.to_local().view(torch.uint8)
            as_bytes = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
            out[name] = as_bytes.full_tensor().view(t.dtype)
        else:
            out[name] = t.full_tensor() if isinstance(t, DTensor) else t
    return {k: v.detach().cpu() for k, v in out.items()}


def sharded_load(folder: str, family: str, *, cp: int, hsdp: bool, lora: bool, dtype=None, fp8: bool = False) -> dict:
    """empty_model -> (LoRA) -> parallelize -> fully_shard -> materialize; rank 0 gets the consolidated state
    and every rank reports the bytes it holds."""
    import diffusers

    from cp_lightning import build_mesh, data_parallel, loading, sharding

    cls = diffusers.WanTransformer3DModel if family == "wan" else diffusers.FluxTransformer2DModel
    model = loading.empty_model(cls, folder, dtype=dtype)
    if fp8:  # the frozen linears become float8 on the meta device; the loader quantizes each rank's rows
        with_fp8(model)
    if lora:
        with_lora(model)
    mesh = build_mesh(cp)
    data_parallel.parallelize_targets(
        model, mesh=mesh, plan=None, ring=1, kernel=None, loss_parallel=False, check_steps=0
    )
    sharding.apply_fsdp(model, mesh=mesh, plan=None, options=sharding.FSDPOptions(hsdp=hsdp), loss_parallel=False)
    held_meta = any(p.is_meta for p in model.parameters())
    loading.materialize(model)
    local = sum(p.to_local().numel() for p in model.parameters())
    state = gathered_state(model) if fp8 else sharding.full_state_dict(model)
    return {
        "meta_before": held_meta,
        "local_numel": local,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "state": {k: v.float().numpy() for k, v in state.items()} if dist.get_rank() == 0 else None,
        "fp8": sum(p.dtype == torch.float8_e4m3fn for p in model.parameters()),
        "pending_after": bool(loading.pending(model)),
    }


def trajectories(folder: str, tmp: Path) -> dict:
    """Lightning fits (SGD) from a meta-built model (FSDP and DDP) and from from_pretrained."""
    from tests.test_fsdp import fit

    out = {}
    for name, module, strategy in (
        ("fsdp_meta", {"pretrained": folder, "meta": True}, {}),
        ("fsdp_eager", {"pretrained": folder}, {}),
        ("fsdp_lora_meta", {"pretrained": folder, "meta": True, "lora": True, "lr": 0.5}, {}),
        ("fsdp_lora_eager", {"pretrained": folder, "lora": True, "lr": 0.5}, {}),
        ("hsdp_meta", {"pretrained": folder, "meta": True}, {"hsdp": True}),
        ("ddp_meta", {"pretrained": folder, "meta": True, "lora": True, "lr": 0.5}, {"fsdp": False}),
    ):
        out[name] = fit(module, strategy)["params"]
    out["fabric"] = fabric_case(folder)
    out["accelerate"] = accelerate_case(folder)
    return out


def fabric_case(folder: str) -> dict | None:
    """Fabric with fsdp=True sets up a meta-built model: each rank loads its shards."""
    import lightning as L
    from diffusers import FluxTransformer2DModel

    from cp_lightning import FabricContextParallelStrategy, loading
    from cp_lightning.sharding import full_state_dict

    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=FabricContextParallelStrategy(cp=2, fsdp=True))
    fabric.launch()
    model = fabric.setup_module(loading.empty_model(FluxTransformer2DModel, folder))
    state = full_state_dict(model.module)
    return {k: v.numpy() for k, v in state.items()} if dist.get_rank() == 0 else None


def accelerate_case(folder: str) -> dict | None:
    """cp_lightning.accelerate with fsdp=True prepares a meta-built LoRA model and its optimizer."""
    from accelerate import Accelerator
    from diffusers import FluxTransformer2DModel

    from cp_lightning import loading
    from cp_lightning.accelerate import ContextParallel
    from cp_lightning.sharding import full_state_dict

    accelerator = Accelerator(cpu=True)
    model = with_lora(loading.empty_model(FluxTransformer2DModel, folder))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, optimizer = ContextParallel(accelerator, cp=2, fsdp=True).prepare(model, optimizer)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    state = full_state_dict(model)
    return {
        "optimizer_follows": in_optimizer == trainable,
        "state": {k: v.numpy() for k, v in state.items()} if dist.get_rank() == 0 else None,
    }


def sync_cases(rank: int) -> dict:
    """data_parallel.sync_module_states: equal weights move nothing; a tensor one rank holds differently is
    broadcast from rank 0 (bitwise); models of another structure are a ValueError on every rank."""
    from cp_lightning.data_parallel import sync_module_states
    from cp_lightning.tiny import tiny_model

    model = tiny_model("flux")
    equal = sync_module_states(model)
    weight = model.proj_out.weight
    if rank == 1:
        with torch.no_grad():
            weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(2.0))  # one ulp apart
    moved = sync_module_states(model)
    gathered = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weight.detach())
    try:
        sync_module_states(tiny_model("flux") if rank else tiny_model("wan"))
        structure = None
    except ValueError as err:
        structure = str(err)
    return {
        "equal": equal,
        "moved": moved,
        "same": all(torch.equal(g, gathered[0]) for g in gathered),
        "structure": structure,
    }


def world_cases(rank: int, world: int, tmp: str) -> dict:
    tmp = Path(tmp)
    flux, wan = str(tmp / "flux"), str(tmp / "wan")
    out = {
        "sync": sync_cases(rank),
        "fsdp": sharded_load(flux, "flux", cp=2, hsdp=False, lora=False),
        "fsdp_lora": sharded_load(flux, "flux", cp=2, hsdp=False, lora=True),
        "fsdp_cp_world": sharded_load(flux, "flux", cp=world, hsdp=False, lora=True),
        "wan_bf16": sharded_load(wan, "wan", cp=2, hsdp=False, lora=False, dtype=torch.bfloat16),
        "fsdp_fp8_lora": sharded_load(flux, "flux", cp=2, hsdp=False, lora=True, fp8=True),
    }
    if world == 4:
        out["hsdp_lora"] = sharded_load(flux, "flux", cp=2, hsdp=True, lora=True)
        out["trajectories"] = trajectories(flux, tmp)
    return out


# -- test side ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loading")
    save_tiny(tmp / "flux", "flux")
    save_tiny(tmp / "wan", "wan")
    return tmp


@pytest.fixture(scope="module", params=[2, 4])
def results(request, folders):
    env = {"PL_GLOBAL_SEED": "0", "LOCAL_WORLD_SIZE": str(request.param)}
    return request.param, spawn(world_cases, request.param, str(folders), timeout_s=900, env=env)


def reference(folder: Path, family: str, *, lora: bool, dtype=None, fp8: bool = False) -> dict:
    import diffusers

    cls = diffusers.WanTransformer3DModel if family == "wan" else diffusers.FluxTransformer2DModel
    model = cls.from_pretrained(folder, torch_dtype=dtype)
    if fp8:
        with_fp8(model)
    return numpy_state(with_lora(model) if lora else model), sorted({str(p.dtype) for p in model.parameters()})


def assert_same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].shape == value.shape, key
        assert (got[key] == value).all(), f"{key}: max diff {abs(got[key] - value).max()}"


@pytest.mark.parametrize(
    "case, family, lora, dtype",
    [
        ("fsdp", "flux", False, None),
        ("fsdp_lora", "flux", True, None),
        ("fsdp_cp_world", "flux", True, None),
        ("wan_bf16", "wan", False, torch.bfloat16),
        ("hsdp_lora", "flux", True, None),
        ("fsdp_fp8_lora", "flux", True, None),
    ],
)
def test_sharded_load_equals_from_pretrained(results, folders, case, family, lora, dtype):
    """fsdp_fp8_lora: float8 weights and row scales quantized from each rank's rows equal converting the whole
    loaded model (cp_lightning.to_fp8_base)."""
    world, ranks = results
    if case not in ranks[0]:
        pytest.skip(f"{case} runs at world 4")
    want, dtypes = reference(folders / family, family, lora=lora, dtype=dtype, fp8="fp8" in case)
    assert all(r[case]["meta_before"] and not r[case]["pending_after"] for r in ranks)
    assert all(r[case]["dtypes"] == dtypes for r in ranks)  # bf16, with Wan's fp32-kept modules in fp32
    assert_same_state(ranks[0][case]["state"], want)


def test_no_rank_holds_more_than_its_shard(results, folders):
    """Each rank's parameters are 1/world of the model (FSDP) or 1/cp (HSDP) plus FSDP's row padding."""
    world, ranks = results
    want, _ = reference(folders / "flux", "flux", lora=False)
    total = sum(v.size for v in want.values())
    for r in ranks:
        assert r["fsdp"]["local_numel"] <= total / world * 1.1
    if world == 4:
        hsdp_total = sum(v.size for v in ranks[0]["hsdp_lora"]["state"].values())
        for r in ranks:
            assert r["hsdp_lora"]["local_numel"] <= hsdp_total / 2 * 1.1


def test_trainings_from_a_meta_built_model_equal_from_pretrained(results, folders):
    world, ranks = results
    if world != 4:
        pytest.skip("the trainings run at world 4")
    got = ranks[0]["trajectories"]
    pairs = (("fsdp_meta", "fsdp_eager"), ("fsdp_lora_meta", "fsdp_lora_eager"), ("hsdp_meta", "fsdp_eager"))
    for meta, eager in pairs:
        for key, value in got[eager].items():
            err = abs(got[meta][key] - value).max() / max(abs(value).max(), 1e-12)
            assert err <= 1e-5, (meta, key, err)
    # DDP from a meta-built LoRA model: the same as one process trained from from_pretrained
    from tests.lightning_tasks import FlowMatching, Samples, param_rel_err, reference_params
    from tests.test_fsdp import GLOBAL_BATCH, STEPS, tensors_of

    torch.manual_seed(0)
    module = FlowMatching(pretrained=str(folders / "flux"), lora=True, lr=0.5)
    ref = reference_params(module, Samples(), GLOBAL_BATCH, STEPS, clip=None)
    assert param_rel_err(tensors_of(got["ddp_meta"]), ref) <= 1e-5
    assert param_rel_err(tensors_of(got["fsdp_lora_meta"]), ref) <= 1e-5


def test_fabric_and_accelerate_load_a_meta_built_model(results, folders):
    world, ranks = results
    if world != 4:
        pytest.skip("runs at world 4")
    got = ranks[0]["trajectories"]
    assert_same_state(got["fabric"], reference(folders / "flux", "flux", lora=False)[0])
    assert all(r["trajectories"]["accelerate"]["optimizer_follows"] for r in ranks)
    assert_same_state(got["accelerate"]["state"], reference(folders / "flux", "flux", lora=True)[0])


def test_ddp_start_up_sync_broadcasts_only_what_differs(results):
    _, ranks = results
    for r in ranks:
        assert r["sync"]["equal"] == 0 and r["sync"]["moved"] == 1 and r["sync"]["same"]
        assert "differ in structure" in r["sync"]["structure"]


# -- bad input: clear errors from the headers, before any collective -----------------------------
def test_an_index_naming_a_missing_shard_names_the_file(tmp_path):
    from diffusers import FluxTransformer2DModel

    from cp_lightning import loading

    folder = save_tiny(tmp_path / "flux")
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (folder / gone).unlink()
    with pytest.raises(ValueError, match=f"shard files that .* does not have: \\['{gone}'\\]"):
        loading.check_pretrained(loading.empty_model(FluxTransformer2DModel, folder))


def test_weights_that_do_not_match_the_config_name_the_key_and_file(tmp_path):
    from diffusers import FluxTransformer2DModel

    from cp_lightning import loading

    folder = save_tiny(tmp_path / "flux")
    wider = loading.empty_model(FluxTransformer2DModel, folder, joint_attention_dim=48)
    with pytest.raises(
        ValueError,
        match=r"'context_embedder.weight' in diffusion_pytorch_model-\d+-of-\d+.safetensors "
        r"has shape \(64, 32\), the model \(64, 48\)",
    ):
        loading.check_pretrained(wider)
    deeper = loading.empty_model(FluxTransformer2DModel, folder, num_layers=2)
    with pytest.raises(ValueError, match=r"'transformer_blocks.1.[a-z_.0-9]+' is missing"):
        loading.check_pretrained(deeper)


def test_a_folder_without_weights_or_config_is_a_clear_error(tmp_path):
    from diffusers import FluxTransformer2DModel

    from cp_lightning import loading

    with pytest.raises(ValueError, match="has no config.json"):
        loading.empty_model(FluxTransformer2DModel, tmp_path)
    folder = save_tiny(tmp_path / "flux")
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(ValueError, match="0 safetensors files and no"):
        loading.check_pretrained(loading.empty_model(FluxTransformer2DModel, folder))


def test_init_lora_does_not_depend_on_the_order_or_the_device(tmp_path):
    """Two models initialised with the same seed agree; another seed differs; B starts at zero."""
    from cp_lightning.tiny import tiny_model

    a, b, c = (with_lora(tiny_model("flux")) for _ in range(3))
    from cp_lightning import loading

    torch.manual_seed(123)  # the global RNG plays no part
    loading.init_lora(b, seed=3)
    loading.init_lora(c, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        if "lora_A" in name:
            assert torch.equal(pa, pb) and not torch.equal(pa, pc)
            assert abs(pa.std().item() - 1 / 4) < 0.1
        elif "lora_B" in name:
            assert not pa.any()


def test_weights_are_cast_and_quantized_on_the_device_they_load_to(tmp_path):
    """Each tensor travels in its file's dtype and is cast (or fp8-quantized) where it lands: casting on the host
    first is one slow CPU pass over every weight of a 12B model. The meta device stands in for CUDA (no CPU
    kernel may touch a weight's values on the way; reading the file's header bytes is not checked)."""
    from safetensors.torch import save_file
    from torch.utils._python_dispatch import TorchDispatchMode

    from cp_lightning import loading
    from cp_lightning.fp8 import FP8Linear

    g = torch.Generator().manual_seed(0)
    shapes = {"0.weight": (4, 8), "0.bias": (4,), "1.weight": (4, 4), "1.bias": (4,)}
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, tmp_path / "model.safetensors")
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 4, dtype=torch.bfloat16, device="meta"), FP8Linear(4, 4, device="meta")
    )
    passive = {"detach", "view", "alias", "lift_fresh", "_local_scalar_dense", "select", "set_"}

    class HostWork(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            on_host = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
            name = func.overloadpacket.__name__
            moves = name == "_to_copy" and kwargs.get("dtype", on_host[0].dtype if on_host else None) in (
                None,
                *(t.dtype for t in on_host),
            )
            if any(t.is_floating_point() for t in on_host) and name not in passive and not moves:
                self.ops.append((name, [t.dtype for t in on_host], kwargs.get("dtype")))
            return func(*args, **kwargs)

    watch = HostWork()
    with watch:
        loading.load_weights(model, loading.SafetensorsFolder(tmp_path), torch.device("meta"))
    assert watch.ops == [], watch.ops
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float8_e4m3fn
