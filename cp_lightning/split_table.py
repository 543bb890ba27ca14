"""The split table: every CP rank's shard lengths in the current forward pass, known without communicating.

The plan's hooks (plan/hooks.py) report each forward pass's events here, one call each: the pass starts
(``start_pass``), a tensor is split (``split``: every rank's length recorded), a tensor is gathered
(``gather``: the ranks' lengths looked up), the pass ends (``end_pass``). Gathers and attention look the
lengths up instead of exchanging them.

The table (and the routing state in routing.py) is host-side bookkeeping that also runs while torch.compile
traces, inside activation-checkpointed regions too: it is written and read through
``torch._dynamo.assume_constant_result`` functions keyed by plain integers, and side-effect custom ops repeat
the writes at run time for frames compiled separately (see :class:`SplitState`).
"""

from __future__ import annotations

import operator
import weakref

import torch
import torch.distributed as dist
from torch._guards import TracingContext
from torch.fx.node import has_side_effect

from cp_lightning import collectives
from cp_lightning.gradients import ForwardRecord, finish_forward

# SplitStates by a plain integer key, for the table functions below (see SplitState)
_STATES: weakref.WeakValueDictionary[int, SplitState] = weakref.WeakValueDictionary()


class SplitState:
    """Every CP rank's shard lengths in the current forward pass, known without communicating.

    A split hook knows the full size S of what it splits, hence every rank's length
    (``collectives.chunk_sizes(S, P)``), and records that list here under the split's name. Gathers and
    attention then *look up* the ranks' lengths of a local sequence, one split or a concatenation of
    several (joint text + image attention), instead of all-gathering them: no host synchronisation.
    The table is refilled at every forward pass of the parallelized module (``start_forward``, a
    pre-hook). While the consistency check is active, each lookup is cross-checked against lengths
    exchanged between the ranks.

    Under ``torch.compile`` the table is host-side bookkeeping, not part of any graph: its functions are
    marked ``assume_constant_result``, so dynamo runs them while tracing and bakes their answers into
    the graph as constants. That holds inside activation-checkpointed blocks (whose traced body may not
    mutate outer Python state) and needs static sequence lengths (``dynamic=False`` when lengths vary).
    When the whole model is compiled, the splits run inside the graph, whose guards on the input shapes
    already cover the table. When only blocks are compiled, the splits run eagerly before them and a
    block's local shapes do not determine the other ranks' lengths (15 and 16 tokens both put 8 on
    rank 0 at cp 2), so a graph is also guarded on the entries recorded outside its own trace, and
    splits traced into a graph record again at run time (custom ops), keeping those entries fresh.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, check=None) -> None:
        group = dist.group.WORLD if group is None else group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.check = group, check
        self.shards: dict[str, list[int]] = {}  # every rank's length of each split, by name
        self.lengths: dict[str, int] = {}  # full length of each split argument, by name (for JointInput)
        self._traced_lengths: dict[str, tuple[int, int]] = {}  # (length, trace) recorded while tracing
        self.joint = False  # the plan has a JointInput (apply_plan): only then is ``lengths`` kept
        self.exchange = False  # set by ``even = False``: no table lookups, exchange the lengths
        self.layout = None  # this pass's head_tail Layout of the sequence as long as it (parallelize.set_layout)
        self.record: ForwardRecord | None = None  # the current forward pass (gradients.py)
        self._sharded = False  # see ``sharded``: as set outside traces
        self._sharded_traced = False  # as set by the dynamo trace ``_sharded_origin`` (None: none)
        self._sharded_origin: int | None = None
        self._found: dict[int, list[int] | None] = {}  # lookups of this pass
        self.origin: dict[str, int | None] = {}  # which dynamo trace recorded each entry (None: eager)
        self.key = id(self)
        _STATES[self.key] = self

    def set_group(self, group: dist.ProcessGroup) -> None:
        """Run the next forward passes over ``group`` (dynamic CP rebinds it between steps); no collective."""
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group

    def start_forward(self) -> None:
        if self.joint:
            # a fresh dict, not a cleared one: a compiled graph then never guards on the previous pass's
            self.lengths = {}
        _start_forward(self.key)
        if torch.compiler.is_compiling():
            split_table_start(self.key)  # at run time too, for frames compiled separately

    def record_length(self, arg: str, size: int) -> None:
        """The full length of split argument ``arg`` (JointInput plans), kept like the ``sharded`` flag."""
        size = operator.index(size)
        _record_length(self.key, arg, size)
        if torch.compiler.is_compiling():
            split_table_length(self.key, arg, size)

    def full_length(self, arg: str) -> int | None:
        if torch.compiler.is_compiling():
            here = _length_here(self.key, arg)
            if here is not None:
                return here
        return self.lengths.get(arg)  # recorded outside this trace: read as a plain dict, guarded

    def record_split(self, where: str, size: int) -> None:
        # operator.index specializes a length torch.compile made symbolic (automatic dynamic shapes
        # after a length changed; int() does not): CP needs every rank's length while tracing, so each
        # length gets its own graph
        size = operator.index(size)
        _record(self.key, where, size)
        if torch.compiler.is_compiling():
            split_table_record(self.key, where, size)  # at run time too, for frames compiled separately

    def record_sizes(self, where: str, sizes: list[int]) -> None:
        """Record a split whose ranks' lengths are ``sizes`` (a JointInput: the sum of its segments')."""
        sizes = [operator.index(size) for size in sizes]
        _record_sizes(self.key, where, sizes)
        if torch.compiler.is_compiling():
            split_table_record_sizes(self.key, where, sizes)

    def record_whole(self, where: str, size: int) -> None:
        """A sequence of ``size`` tokens that reached a split hook unsplit (identical on every rank).

        Recorded only before the pass's first split, when every tensor is still the replicated input:
        such a stream (LTX-2's audio) may reach CP attention whole, and a lookup must then tell it from
        the concatenations of the splits on every rank alike (see ``lookup``).
        """
        size = operator.index(size)
        _record_whole(self.key, where, size)
        if torch.compiler.is_compiling():
            split_table_record_whole(self.key, where, size)

    def _guard_table(self) -> None:
        """Under torch.compile: guard the graph on the table entries recorded outside this trace.

        Entries recorded in this trace follow from its input shapes, which dynamo guards already;
        entries recorded elsewhere (eager split hooks, another compiled block) are read here from the
        live table, so that dynamo guards on their values.
        """
        if torch.compiler.is_compiling():
            for where, sizes in _outside_this_trace(self.key):
                live = self.shards[where]
                # element by element: dynamo guards on each int it compares (a list == list compares
                # without guarding the elements)
                if len(live) != len(sizes) or any(a != b for a, b in zip(live, sizes, strict=True)):
                    raise AssertionError(f"the split table entry {where!r} changed while tracing")

    @property
    def even(self) -> bool:
        """Every split of this pass divided evenly over the CP ranks (so every concatenation of them does)."""
        self._guard_table()
        return _even(self.key)

    @even.setter
    def even(self, value: bool) -> None:
        """``even = False`` makes attention exchange its ranks' lengths, for calls no split hook fed."""
        self.exchange = not value

    def lookup(self, local: int) -> list[int] | None:
        """Every rank's length of a local sequence of ``local`` tokens, or None when the table cannot tell.

        The candidates are the concatenations of this pass's splits and the whole (replicated) streams
        (``record_whole``). The answer is used only when it is unambiguous on *every* rank: exactly one
        candidate has ``local`` at this rank, and no other one shares any rank's length with it. For a
        tensor that is one of the candidates that condition does not depend on which rank evaluates it,
        so the ranks all answer, or all raise the same error, never some entering a collective alone. (A
        whole stream of 5 tokens beside a split of 9 tokens, 5 + 4 at cp 2: rank 0 could not tell them
        apart, rank 1 could; both refuse.)
        """
        self._guard_table()
        return _lookup(self.key, operator.index(local))  # specialized, as in record()

    def lengths_of(self, x: torch.Tensor, dim: int, where: str) -> list[int]:
        """Every CP rank's length of ``x`` along ``dim``: exchanged in eager code, looked up while compiling.

        Eager code always exchanges (one small all-gather, only on passes with uneven splits): the table
        answers for every rank alike only when ``x`` is a concatenation of this pass's splits. A tensor
        that is not (LTX-2's whole audio stream reaching CP attention) can match on some ranks and not on
        others, and the ranks that fell back to exchanging would wait forever for the rest.
        """
        if not torch.compiler.is_compiling():
            return [row[0] for row in collectives.exchange_lengths([x.shape[dim]], self.group, x.device)]
        lengths = self.lookup(x.shape[dim])
        if lengths is None:
            raise ValueError(
                f"{where}: cannot tell the CP ranks' lengths of a {x.shape[dim]}-token local sequence from "
                "this forward pass's splits, the same way on every rank: it matches several of them on some rank "
                "(text and image shards of equal lengths, or a whole input stream as long as a shard) or none (a "
                "tensor that is neither a concatenation of the splits nor a whole input stream), and exchanging "
                "them would break the compiled graph. Use lengths the CP degree divides, or do not compile this "
                "module."
            )
        if self.check is not None:
            self.check.lengths(where, x, dim, lengths)
        return lengths

    def _concatenations(self) -> list[tuple[int, ...]]:
        """Every rank's length of each concatenation of this pass's distinct splits, and of each whole tensor.

        A split recorded under several names (text tokens, their mask and their RoPE table) counts once;
        so does a length shared by text and image, whose concatenation the table then cannot tell (it
        is an error under torch.compile). Tensors that reached a split hook whole, before the pass's first
        split (LTX-2's audio stream), are candidates of their own, the same length on every rank.
        """
        distinct: list[tuple[int, ...]] = []
        for where, sizes in self.shards.items():
            if not where.startswith(_WHOLE) and tuple(sizes) not in distinct:
                distinct.append(tuple(sizes))
        sums: list[tuple[int, ...]] = [(0,) * self.world]
        for sizes in distinct:
            sums = sums + [tuple(a + b for a, b in zip(s, sizes, strict=True)) for s in sums]
        whole = [tuple(sizes) for where, sizes in self.shards.items() if where.startswith(_WHOLE)]
        return list(dict.fromkeys(sums[1:] + whole))

    def _lookup(self, local: int) -> list[int] | None:
        candidates = self._concatenations()
        matches = [c for c in candidates if c[self.rank] == local]
        if len(matches) != 1:
            return None
        found = matches[0]
        for other in candidates:
            if other != found and any(a == b for a, b in zip(other, found, strict=True)):
                return None
        return list(found)

    @property
    def sharded(self) -> bool:
        """Between a split and a gather in the current forward pass (set by the hooks, read by routing).

        Like the table, a flag set by hooks that torch.compile traces, inside activation-checkpointed
        regions too (a split hook on the first block), where the traced body may not mutate Python
        state: it is set and read through constant functions. A value set outside this trace (eager
        hooks before a compiled block) is read as a plain attribute, so that the graph guards on it.
        """
        if torch.compiler.is_compiling():
            here = _sharded_here(self.key)
            if here is not None:
                return here
        return self._sharded

    def set_sharded(self, value: bool) -> None:
        _set_sharded(self.key, bool(value))
        if torch.compiler.is_compiling():
            split_state_sharded(self.key, bool(value))  # at run time too, for frames compiled separately

    # ---- the events of a forward pass, as the plan's hooks report them (plan/hooks.py): one call each

    def start_pass(self, loss_parallel: bool) -> None:
        """The parallelized module's forward begins: an empty table, a new gradient record, no split yet."""
        self.start_forward()
        self.record = ForwardRecord(loss_parallel)
        self.set_sharded(False)

    def split(
        self, where: str, size: int | list[int], *, arg: str | None = None, opens: bool = True, whole: bool = False
    ) -> None:
        """``where`` is about to split ``size`` tokens over the CP ranks (a list: the full sizes of a joint
        tensor's segments, each split apart); record every rank's length.

        ``arg``: the forward argument split (its full length is kept for JointInputs that name it).
        ``opens``: the split starts the split region, where attention runs over the CP group; not for
        position tables (RoPE) that a parameter-free module returns. ``whole``: a (B, S, ...) tensor the
        split point passes on unsplit (see ``record_whole``). A split after a gather that loss-parallel
        left sharded is refused here, before the tensor is split.
        """
        if whole:
            self.record_whole(where, size)
            return
        record = self.record
        if record is not None and not record.closed:
            if record.skipped is not None:
                raise ValueError(
                    f"{where} is split after the gather at {record.skipped!r}, which loss-parallel mode left "
                    "sharded (it looked like the last gather from the model's module order). Train this plan "
                    "without loss_parallel, or gather once, after the last split."
                )
            if opens:
                self.set_sharded(True)
        if isinstance(size, list):  # each rank holds its share of every segment
            per_segment = [collectives.chunk_sizes(part, self.world) for part in size]
            self.record_sizes(where, [sum(column) for column in zip(*per_segment, strict=True)])
            return
        if arg is not None and self.joint:  # only JointInput plans read the full lengths
            self.record_length(arg, size)
        if self.layout is not None and self.layout.length == size:  # cut by the layout's runs, not chunk_sizes
            self.record_sizes(where, self.layout.lengths)
            return
        self.record_split(where, size)

    def gather(self, where: str, x: torch.Tensor, dim: int, *, closes: bool = True) -> list[int] | None:
        """``where`` is about to gather ``x`` along ``dim``: every rank's length of it (None when every split
        of the pass was even). ``closes``: the gather ends the split region (not when loss-parallel leaves
        it sharded)."""
        lengths = None if self.even else self.lengths_of(x, dim, where)
        if closes:
            self.set_sharded(False)
        return lengths

    def end_pass(self, outputs):
        """The parallelized module's forward returns ``outputs``: its gradient rule is fixed (gradients.py)."""
        return finish_forward(outputs, self.record, self.world)


@torch._dynamo.assume_constant_result
def _start_forward(key: int) -> bool:
    state = _STATES[key]
    state.shards, state._found, state.origin, state._traced_lengths = {}, {}, {}, {}
    return True


@torch._dynamo.assume_constant_result
def _record(key: int, where: str, size: int) -> bool:
    state = _STATES[key]
    state.shards[where] = collectives.chunk_sizes(size, state.world)
    state._found = {}
    state.origin[where] = _trace_id()
    return True


def _trace_id() -> int | None:
    """Which dynamo trace is running (None: none; dynamo runs the functions above while tracing)."""
    context = TracingContext.try_get()
    return None if context is None else id(context)


@torch._dynamo.assume_constant_result
def _outside_this_trace(key: int) -> tuple:
    state, here = _STATES[key], _trace_id()
    return tuple((where, sizes) for where, sizes in state.shards.items() if state.origin.get(where) != here)


@torch.library.custom_op("cp_lightning::split_table_start", mutates_args=())
def split_table_start(key: int) -> None:
    """Run time of a compiled graph: what ``SplitState.start_forward`` did while tracing."""
    _start_forward(key)


@torch.library.custom_op("cp_lightning::split_table_record", mutates_args=())
def split_table_record(key: int, where: str, size: int) -> None:
    """Run time of a compiled graph: what ``SplitState.record`` did while tracing."""
    _record(key, where, size)


@torch.library.custom_op("cp_lightning::split_table_record_sizes", mutates_args=())
def split_table_record_sizes(key: int, where: str, sizes: list[int]) -> None:
    """Run time of a compiled graph: what ``SplitState.record_sizes`` did while tracing."""
    _record_sizes(key, where, sizes)


@torch._dynamo.assume_constant_result
def _record_length(key: int, arg: str, size: int) -> bool:
    state, origin = _STATES[key], _trace_id()
    if origin is None:  # as for the sharded flag below: a trace's records stay apart
        state.lengths[arg] = size
    state._traced_lengths[arg] = (size, origin)
    return True


@torch._dynamo.assume_constant_result
def _length_here(key: int, arg: str) -> int | None:
    entry, here = _STATES[key]._traced_lengths.get(arg), _trace_id()
    return entry[0] if entry is not None and here is not None and entry[1] == here else None


@torch.library.custom_op("cp_lightning::split_table_length", mutates_args=())
def split_table_length(key: int, arg: str, size: int) -> None:
    """Run time of a compiled graph: what ``SplitState.record_length`` did while tracing."""
    _record_length(key, arg, size)


@torch._dynamo.assume_constant_result
def _set_sharded(key: int, value: bool) -> bool:
    state, origin = _STATES[key], _trace_id()
    if origin is None:  # eager, or a compiled graph at run time: what the next frame finds on entry
        state._sharded = value
    # a trace's value stays apart: dynamo may abandon a trace and restart it, and the restarted trace must
    # read (and guard on) the value its frame starts with, not the abandoned one's last
    state._sharded_traced, state._sharded_origin = value, origin
    return True


@torch._dynamo.assume_constant_result
def _sharded_here(key: int) -> bool | None:
    """The flag when this dynamo trace set it, else None (read it as an attribute, guarded)."""
    state, here = _STATES[key], _trace_id()
    return state._sharded_traced if here is not None and state._sharded_origin == here else None


@torch.library.custom_op("cp_lightning::split_state_sharded", mutates_args=())
def split_state_sharded(key: int, value: bool) -> None:
    """Run time of a compiled graph: what ``SplitState.set_sharded`` did while tracing."""
    _set_sharded(key, value)


@torch._dynamo.assume_constant_result
def _record_sizes(key: int, where: str, sizes: list[int]) -> bool:
    state = _STATES[key]
    state.shards[where] = list(sizes)
    state._found = {}
    state.origin[where] = _trace_id()
    return True


_WHOLE = "="  # table names of whole streams (``record_whole``) start with it


@torch._dynamo.assume_constant_result
def _record_whole(key: int, where: str, size: int) -> bool:
    state = _STATES[key]
    if any(not name.startswith(_WHOLE) for name in state.shards):
        return False  # after a split, an unsplit argument may be a shard already (a block's hidden states)
    return _record_sizes(key, _WHOLE + where, [size] * state.world)


@torch.library.custom_op("cp_lightning::split_table_record_whole", mutates_args=())
def split_table_record_whole(key: int, where: str, size: int) -> None:
    """Run time of a compiled graph: what ``SplitState.record_whole`` did while tracing."""
    _record_whole(key, where, size)


for _op in (
    split_table_start,
    split_table_record,
    split_table_record_sizes,
    split_table_record_whole,
    split_table_length,
    split_state_sharded,
):
    _op.register_fake(lambda *args: None)
    has_side_effect(_op._opoverload)


@torch._dynamo.assume_constant_result
def _even(key: int) -> bool:
    if _STATES[key].exchange:
        return False
    return all(min(sizes) == max(sizes) for sizes in _STATES[key].shards.values())


@torch._dynamo.assume_constant_result
def _lookup(key: int, local: int) -> list[int] | None:
    state = _STATES[key]
    if state.exchange:
        return None
    if _even(key):
        return [local] * state.world
    if local not in state._found:
        state._found[local] = state._lookup(local)
    return state._found[local]
