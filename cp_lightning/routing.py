"""Which attention runs over the CP group, and how a processor's attention call gets there.

Processors come in three kinds:

* **dispatch**: the processor calls diffusers' ``dispatch_attention_fn`` with
  ``parallel_config=self._parallel_config`` (Flux, Wan, QwenImage, LTX, HunyuanVideo, Z-Image, ...).
  We set a :class:`~cp_lightning.attention.ContextParallelAttention` as that config and wrap the
  dispatcher of the processor's module; a call with ``parallel_config=None`` (Wan's cross-attention to
  unsplit text) passes through.
  Processors that call the dispatcher without any ``parallel_config`` (:data:`BARE_DISPATCH`, Cosmos) are
  routed by the attention module they run in: the wrapped dispatcher takes the route's config for them.
* **sdpa**: the processor calls ``F.scaled_dot_product_attention`` itself (SD3/SD3.5's
  ``JointAttnProcessor2_0``, ``AttnProcessor2_0``, CogVideoX's processor). For the stock processors in
  :data:`SDPA_PROCESSORS`, whose only cross-token operation is that call, the ``F`` their module sees
  is replaced by a proxy whose ``scaled_dot_product_attention`` runs CP attention while such a module
  is running (and plain SDPA otherwise): the user passes the stock model and keeps its processors.
* **linear**: a stock linear-attention processor (Sana's, :data:`~cp_lightning.linear_attention.LINEAR_PROCESSORS`)
  is swapped for a :class:`~cp_lightning.linear_attention.LinearAttentionCP` that all-reduces its key sums
  over the CP group inside the split region; :func:`unroute_processors` puts the original back.
* **stand-in**: a stock processor whose own code cannot run on split tokens but whose attention is one
  masked SDPA in disguise (Mochi's per-sample unpadding) is swapped for the stand-in its family module
  registers in :data:`STAND_INS` (``factory(original, attend, runs_cp)``); the stand-in calls
  ``attend(q, k, v, key_mask)`` (CP attention) inside the split region and the original elsewhere, and
  cuts a whole per-token tensor it is handed (a mask built from the full inputs) with :func:`local_shard`.
* **anything else** is refused by :func:`check_processors` before any communication, unless the plan
  declares the module :class:`~cp_lightning.plan.Unsplit`.

Local or CP, per module: attention runs over the CP group only when it is called between a split and
a gather of the forward pass (``SplitState.sharded``). Elsewhere (a text refiner before the split,
layers after a gather) the module's own attention runs on its full, replicated tokens with no
communication, instead of exchanging cp copies of them. The choice is made in the forward pass and
remembered per module, so that activation checkpointing's recomputation (during backward, after the
forward's gathers) routes each module the same way.

Under torch.compile the routing hooks run inside activation-checkpointed regions, whose traced body
may not mutate Python state (dynamo refuses it as an unsafe side effect). So the running-module stack
and each route's decision are kept by constant functions (``assume_constant_result``), like the split
table (split_table.py): dynamo runs them while tracing and bakes their answers into the graph.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.fx.node import has_side_effect
from torch.utils.hooks import RemovableHandle

from cp_lightning import collectives
from cp_lightning.attention import ContextParallelAttention
from cp_lightning.linear_attention import LINEAR_PROCESSORS, LinearAttentionCP
from cp_lightning.masked import local_attention
from cp_lightning.masks import MaskSpec
from cp_lightning.split_table import SplitState

# stock processors that call SDPA directly, by class name -> how their keys relate to their queries:
# "joint": keys are the queries' own tokens (self or joint image+text attention): CP when split;
# "self": like "joint" without encoder_hidden_states, but cross-attention (encoder_hidden_states
# given, e.g. to unsplit text) stays local, as diffusers' own processors do
SDPA_PROCESSORS = {
    "JointAttnProcessor2_0": "joint",
    "CogVideoXAttnProcessor2_0": "joint",
    "CogView4AttnProcessor": "joint",
    "Lumina2AttnProcessor2_0": "joint",  # self-attention, its keys passed as encoder_hidden_states
    "HiDreamAttnProcessor": "joint",  # image + text, or the single stream's one sequence
    "AuraFlowAttnProcessor2_0": "joint",  # [text, image] (MMDiT blocks) or the single stream's one sequence
    "EasyAnimateAttnProcessor2_0": "joint",  # [text, video], or its one stream
    "AttnProcessor2_0": "self",
    "AllegroAttnProcessor2_0": "self",  # Allegro's self-attention, and cross-attention to the unsplit text
    "SanaAttnProcessor2_0": "self",  # Sana's cross-attention to the text
    "HunyuanAttnProcessor2_0": "self",  # HunyuanDiT: self-attention, and cross-attention to the unsplit text
    "LuminaAttnProcessor2_0": "self",  # Lumina-Next: the same, its self-attention passing keys as encoder states
}

# dispatch processors that pass their ``_parallel_config`` for cross-attention to unsplit text too; such a
# call (encoder_hidden_states given) runs locally: every rank holds the whole text, so attending over cp
# copies of it would give the same result at cp times the key work (see ``Route.cross_local``). Not
# Kandinsky 5's: its RoPE rounds queries and keys, and in backward their gradients, to bfloat16, which only
# the copies path keeps within 1e-4 (each rank's text keys get 1/cp of the full gradient, not a partial one)
CROSS_LOCAL_DISPATCH = ("SanaAttnProcessor2_0", "BriaFibo2AttnProcessor", "AnyFlowCrossAttnProcessor")

# stock processors that call ``dispatch_attention_fn`` with no ``parallel_config`` at all (and whose only
# cross-token operation is that call); their cross-attention to unsplit text stays local, as for "self"
BARE_DISPATCH = ("CosmosAttnProcessor2_0",)

# stock processor class name -> factory(original, attend, runs_cp) of its stand-in (see the module doc); the
# model's family module in cp_lightning/models/ registers it, so the engine knows no model by name
STAND_INS: dict = {}


class StandIn:
    """What every stand-in shares: the stock processor it replaces (run outside the split region and in one process),
    ``attend`` (CP attention over the running routed module) and ``runs_cp()`` (whether this call is inside the
    split region); ``stand_in`` marks it for :func:`unroute_processors`."""

    stand_in = True

    def __init__(self, original, attend, runs_cp) -> None:
        self.original, self.attend, self.runs_cp = original, attend, runs_cp


@dataclass
class Route:
    """One attention module's routing: its path, processor kind, and whether the current call is CP."""

    name: str
    kind: str  # "dispatch", "joint", "self" or "linear"
    config: ContextParallelAttention
    cp: bool = True
    # a call given encoder_hidden_states (cross-attention to the unsplit text) runs locally
    cross_local: bool = False
    bare: bool = False  # a BARE_DISPATCH processor: its dispatcher calls carry no parallel_config
    handles: list[RemovableHandle] = field(default_factory=list)

    @property
    def key(self) -> int:
        return id(self)


_ROUTES: dict[int, Route] = {}  # every installed route by key (the constant functions below take ints)
_ACTIVE: list[int] = []  # the keys of the routed attention modules running now, innermost last


@torch._dynamo.assume_constant_result
def _enter(key: int, cp: bool | None) -> bool:
    """A routed module starts; ``cp``: this forward pass's decision (None: keep the remembered one)."""
    if cp is not None:
        _ROUTES[key].cp = cp
    _ACTIVE.append(key)
    return True


@torch._dynamo.assume_constant_result
def _leave(key: int) -> bool:
    # from its first entry on: a trace that dynamo restarted (a graph break) entered the module twice
    if key in _ACTIVE:
        del _ACTIVE[_ACTIVE.index(key) :]
    return True


# Run time of a compiled graph: what the two functions above did while tracing, for eager code that runs
# between graphs (after a graph break inside an attention module, with fullgraph=False)
@torch.library.custom_op("cp_lightning::route_enter", mutates_args=())
def route_enter(key: int, cp: bool | None) -> None:
    _enter(key, cp)


@torch.library.custom_op("cp_lightning::route_leave", mutates_args=())
def route_leave(key: int) -> None:
    _leave(key)


for _op in (route_enter, route_leave):
    _op.register_fake(lambda *args: None)
    has_side_effect(_op._opoverload)


@torch._dynamo.assume_constant_result
def _innermost() -> tuple[int, bool] | None:
    """The innermost running routed module's key and whether its call runs CP, or None."""
    if not _ACTIVE:
        return None
    return _ACTIVE[-1], _ROUTES[_ACTIVE[-1]].cp


def _active() -> tuple[Route | None, bool]:
    found = _innermost()
    if found is None:
        return None, True
    return _ROUTES[found[0]], found[1]


def attention_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The diffusers attention modules (those with a ``processor``) inside ``module``."""
    return [(name, sub) for name, sub in module.named_modules() if hasattr(sub, "processor")]


def processor_kind(processor) -> str | None:
    """ "dispatch", the SDPA_PROCESSORS kind, "linear", "stand-in", or None for a processor we cannot route."""
    module_globals = sys.modules[type(processor).__module__].__dict__
    if type(processor).__name__ in LINEAR_PROCESSORS and type(processor).__module__.startswith("diffusers."):
        return "linear"
    if type(processor).__name__ in STAND_INS and type(processor).__module__.startswith("diffusers."):
        return "stand-in"
    bare = type(processor).__name__ in BARE_DISPATCH and type(processor).__module__.startswith("diffusers.")
    if (hasattr(processor, "_parallel_config") or bare) and "dispatch_attention_fn" in module_globals:
        return "dispatch"
    kind = SDPA_PROCESSORS.get(type(processor).__name__)
    if kind is not None and type(processor).__module__.startswith("diffusers.") and "F" in module_globals:
        return kind
    return None


def check_processors(
    module: nn.Module, ulysses_degree: int, unsplit: tuple[str, ...] = ()
) -> list[tuple[str, nn.Module]]:
    """Validate every attention module before any communication; returns those to route.

    ``unsplit``: module paths the plan declares :class:`~cp_lightning.plan.Unsplit`; attention
    modules inside them keep their processors untouched and are not returned.
    """
    found = attention_modules(module)
    if not found:
        raise ValueError(f"{type(module).__name__} has no diffusers attention module (none with a `processor`).")
    routed = []
    for name, sub in found:
        if any(name == path or name.startswith(path + ".") or path == "" for path in unsplit):
            continue
        processor = sub.processor
        if processor_kind(processor) is None:
            raise ValueError(
                f"attention processor {type(processor).__name__} at {name!r} cannot run over the CP group: it "
                "neither calls diffusers' dispatch_attention_fn with a `_parallel_config` nor is a stock processor "
                f"cp_lightning routes ({', '.join(sorted(SDPA_PROCESSORS))}). Give the module the model's own "
                f"processor before parallelize(), or, if it runs on full unsplit tokens, declare it in the plan: "
                f'{{"{name}": cp_lightning.Unsplit()}}.'
            )
        heads = getattr(sub, "heads", None)
        # linear attention sends its key state, never heads: any head count suits any degree
        if processor_kind(processor) != "linear" and isinstance(heads, int) and heads < ulysses_degree:
            raise ValueError(
                f"{name!r} has {heads} attention heads, fewer than the Ulysses degree {ulysses_degree} (each "
                f"Ulysses rank attends over at least one head); use cp / ring <= {heads}, e.g. a larger ring "
                f'degree (or, if it runs on full unsplit tokens, declare it: {{"{name}": cp_lightning.Unsplit()}}).'
            )
        routed.append((name, sub))
    return routed


def _routed_dispatch(original):
    # Arguments are matched to names by hand rather than with ``Signature.bind``, which
    # torch.compile cannot trace (a graph break inside every attention call).
    parameters = inspect.signature(original).parameters
    names = list(parameters)
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    mask_at = names.index("attn_mask")

    @functools.wraps(original)
    def dispatch_attention_fn(*args, **kwargs):
        config = kwargs.get("parallel_config")
        if "parallel_config" not in kwargs:  # a BARE_DISPATCH processor's call: its module's route decides
            route, _ = _active()
            config = route.config if route is not None and route.bare else None
        route, cp = _active()
        if not isinstance(config, ContextParallelAttention) or not cp:
            spec = args[mask_at] if len(args) > mask_at else kwargs.get("attn_mask")
            if isinstance(spec, MaskSpec):  # diffusers cannot take a spec: run it here, over the local tokens
                a = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
                return local_attention(a["query"], a["key"], a["value"], spec, scale=a["scale"])
            if not isinstance(config, ContextParallelAttention):
                return original(*args, **kwargs)
            return original(*args, **{**kwargs, "parallel_config": None})
        a = dict(defaults)
        a.update(zip(names, args, strict=False))  # trailing defaults may be omitted
        a.update(kwargs)
        mask = a["attn_mask"]
        if (
            isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and mask.shape == (a["query"].shape[0], a["key"].shape[1])
        ):
            # diffusers' native backend reads a (B, S_k) mask as the key mask (B, 1, 1, S_k) (NucleusMoE passes one)
            mask = mask[:, None, None, :]
        return config(
            a["query"],
            a["key"],
            a["value"],
            attn_mask=mask,
            dropout_p=a["dropout_p"],
            is_causal=a["is_causal"],
            scale=a["scale"],
            enable_gqa=a["enable_gqa"],
            where=route.name if route is not None else None,
        )

    dispatch_attention_fn.__cp_lightning_original__ = original
    return dispatch_attention_fn


class _RoutedFunctional:
    """``torch.nn.functional`` as an SDPA processor's module sees it: SDPA runs CP inside a routed module."""

    def __init__(self, real) -> None:
        self.__cp_lightning_original__ = real

    def __getattr__(self, name: str):
        return getattr(self.__cp_lightning_original__, name)

    def scaled_dot_product_attention(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        route, cp = _active()
        if isinstance(attn_mask, MaskSpec) and (route is None or route.kind == "dispatch" or not cp):
            # B, H, S, D -> B, S, H, D for the spec's rectangles over the local tokens and back
            out = local_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask)
            return out.transpose(1, 2)
        if route is None or route.kind == "dispatch" or not cp:
            real = self.__cp_lightning_original__.scaled_dot_product_attention
            return real(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa,
            )  # fmt: skip
        # B, H, S_local, D -> B, S_local, H, D for CP attention and back
        out = route.config(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            where=route.name,
        )
        return out.transpose(1, 2)


def _attend(query, key, value, attn_mask=None, scale=None):
    """A stand-in's attention: (B, S_local, H, D) tensors over the CP group of the running routed module; K/V with
    fewer heads than the queries are grouped-query attention (SDPA's ``enable_gqa``)."""
    route, _ = _active()
    return route.config(
        query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=False, scale=scale,
        enable_gqa=key.shape[2] != query.shape[2], where=route.name,
    )  # fmt: skip


def local_shard(x: torch.Tensor, dim: int) -> torch.Tensor:
    """A stand-in's share of a whole, replicated per-token tensor (Ideogram 4's segment mask, which its model builds
    from the full inputs): this rank's slice along ``dim``, cut as the split hooks cut the sequence (no collective)."""
    route, _ = _active()
    return collectives.shard(x, dim, route.config.state.group)


def shard_span(x: torch.Tensor, dim: int) -> tuple[int, int]:
    """Where a stand-in's local tokens sit in the whole sequence: (this rank's offset, the full length) of ``x``'s
    ``dim``, for attention whose keys depend on a token's global position (Wan-Animate's per-frame face attention).
    Eager code exchanges the ranks' lengths (one small all-gather), compiled code looks them up (SplitState)."""
    route, _ = _active()
    state = route.config.state
    lengths = state.lengths_of(x, dim, route.name)
    return sum(lengths[: state.rank]), sum(lengths)


def shard_lengths(x: torch.Tensor, dim: int) -> list[int]:
    """Every CP rank's length of a stand-in's local ``x`` along ``dim`` (what :func:`shard_span` sums), for a mask
    spec over tokens laid out otherwise than one contiguous run per rank (Flux.2's double blocks: [text_r, image_r])."""
    route, _ = _active()
    return route.config.state.lengths_of(x, dim, route.name)


def _has_encoder_states(module: nn.Module, args, kwargs) -> bool:
    """Whether a call attends to other tokens than its queries' own: encoder_hidden_states given, and not the
    hidden_states tensor itself (Lumina-Next's self-attention passes its own tokens as both)."""
    params = list(inspect.signature(module.forward).parameters)
    named = {**dict(zip(params, args, strict=False)), **kwargs}
    encoder = named.get("encoder_hidden_states")
    return encoder is not None and encoder is not named.get("hidden_states")


def route_processors(
    found: list[tuple[str, nn.Module]], config: ContextParallelAttention, state: SplitState | None = None
) -> list[Route]:
    """Route each attention module of ``found`` to ``config`` (see the module doc); returns the routes.

    ``state``: the model's split state; each call then runs CP only between a split and a gather.
    Without it every call of a routed module runs CP.
    """
    routes = []
    for name, sub in found:
        processor = sub.processor
        kind = processor_kind(processor)
        bare = type(processor).__name__ in BARE_DISPATCH
        module_globals = sys.modules[type(processor).__module__].__dict__
        if kind == "dispatch":
            dispatch = module_globals["dispatch_attention_fn"]
            if not hasattr(dispatch, "__cp_lightning_original__"):
                module_globals["dispatch_attention_fn"] = _routed_dispatch(dispatch)
            if not bare:
                processor._parallel_config = config
        elif kind not in ("linear", "stand-in") and not isinstance(module_globals["F"], _RoutedFunctional):
            module_globals["F"] = _RoutedFunctional(module_globals["F"])
        cross_local = kind == "self" or bare or type(processor).__name__ in CROSS_LOCAL_DISPATCH
        route = Route(name, kind, config, cross_local=cross_local, bare=bare)
        _ROUTES[route.key] = route
        if kind == "linear":
            sub.processor = LinearAttentionCP(processor, config.groups.cp, lambda: _active()[1])
        elif kind == "stand-in":
            sub.processor = STAND_INS[type(processor).__name__](processor, _attend, lambda: _active()[1])

        def enter(module, args, kwargs, route=route):
            record = None if state is None else state.record
            cp = None
            if state is not None and record is not None and not record.closed:  # the forward pass decides
                cp = state.sharded and not (route.cross_local and _has_encoder_states(module, args, kwargs))
            _enter(route.key, cp)
            if torch.compiler.is_compiling():
                route_enter(route.key, cp)

        def leave(_module, _args, _output, route=route):
            _leave(route.key)
            if torch.compiler.is_compiling():
                route_leave(route.key)

        route.handles = [
            sub.register_forward_pre_hook(enter, with_kwargs=True),
            sub.register_forward_hook(leave, always_call=True),
        ]
        routes.append(route)
    return routes


def unroute_processors(found: list[tuple[str, nn.Module]], routes: list[Route] = ()) -> None:
    """Take our config off the processors (the routes' hooks are removed with the plan's handles)."""
    for route in routes:
        _ROUTES.pop(route.key, None)
    for _, sub in found:
        if isinstance(sub.processor, LinearAttentionCP) or getattr(sub.processor, "stand_in", False):
            sub.processor = sub.processor.original
        # Drop the instance attribute so the class default (None: no CP) shows through again.
        sub.processor.__dict__.pop("_parallel_config", None)
