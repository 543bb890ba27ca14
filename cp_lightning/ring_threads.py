"""The ring's P2P between threads: P virtual ranks in one process, on one device, no process group.

On one GPU the shipped ring loop cannot run across processes: NCCL refuses two ranks on one device
(NVIDIA/nccl#418) and gloo's send/recv take host memory only (DESIGN.md section 9.4). A :class:`ThreadRing`
runs ring attention's own code (``ring._ring_forward`` / ``_ring_backward``, the custom ops, key chunking,
masks, uneven block lengths) with each virtual rank a thread and the P2P a shared mailbox, so the loop that
trains is the loop that is checked, on a GPU and in CPU CI alike.

Semantics of :meth:`ThreadComm.start` match ``RingComm``'s: the sender posts its tensors under (sender,
tag, sequence number); the receiver's :meth:`ThreadComm.finish` waits for them and copies each into a fresh
buffer of the shape it expects (a shape mismatch is an error, so uneven block lengths are checked as NCCL
would). All threads share the device's current stream, so a copy is ordered after the kernel that wrote its
source, and the caching allocator does not reuse a sent tensor's memory before the copy ran.

Autograd: on the CPU each thread's ``backward()`` runs on that thread. On CUDA, autograd runs every graph's
CUDA work on one device thread, so P ranks that wait on each other there would deadlock: call the backward
op (``ring.ring_attention_backward``) directly on CUDA, as :func:`run_ring` does unless told otherwise.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import torch

from cp_lightning import ring
from cp_lightning.collectives import record_sent

_NAMES = itertools.count()


class ThreadComm:
    """One virtual rank's view of a :class:`ThreadRing`: RingComm's interface over the shared mailbox."""

    def __init__(self, ring_: ThreadRing, rank: int) -> None:
        self.ring, self.world, self.rank = ring_, ring_.world, rank
        self.next, self.prev = (rank + 1) % ring_.world, (rank - 1) % ring_.world
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}

    def start(self, tensors, tags, shapes=None):
        """Post ``tensors`` to the next rank; returns what :meth:`finish` needs to receive the previous one's."""
        shapes = shapes or [t.shape for t in tensors]
        expected = []
        for tensor, tag, shape in zip(tensors, tags, shapes, strict=True):
            record_sent(f"p2p:{tag}", tensor.numel() * tensor.element_size())
            number = self._sent.get(tag, 0)
            self._sent[tag] = number + 1
            self.ring._post((self.rank, self.next, tag, number), tensor)
            received = self._received.get(tag, 0)
            self._received[tag] = received + 1
            expected.append(((self.prev, self.rank, tag, received), torch.Size(shape), tensor))
        return expected

    def finish(self, pending) -> list[torch.Tensor]:
        buffers = []
        for key, shape, like in pending:
            sent = self.ring._take(key)
            if sent.shape != shape or sent.dtype != like.dtype:
                raise RuntimeError(
                    f"ring P2P {key}: rank {self.rank} expected {tuple(shape)} {like.dtype} from rank {self.prev}, "
                    f"got {tuple(sent.shape)} {sent.dtype}"
                )
            buffer = like.new_empty(shape)
            buffer.copy_(sent)
            buffers.append(buffer)
        return buffers

    def incoming_length(self, lengths: list[int] | None, step: int) -> int | None:
        return None if lengths is None else lengths[(self.rank - step - 1) % self.world]


class ThreadRing:
    """``world`` virtual ranks as threads sharing a mailbox; registered for the ring ops under ``group_name``.

    Use as a context manager (it unregisters on exit) and pass it as ``group=`` to ``ring.ring_attention``, or
    its ``group_name`` to the ring ops; each thread must first :meth:`bind` its rank (:meth:`run` does).
    """

    def __init__(self, world: int, *, timeout: float = 120.0) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"ThreadRing needs an int world >= 1, got {world!r}.")
        self.world, self.timeout = world, timeout
        self.group_name = f"cp_lightning.thread_ring.{next(_NAMES)}"
        self._mail: dict[tuple, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._local = threading.local()
        self._failed: BaseException | None = None
        ring.register_comm(self.group_name, self._comm)

    def __enter__(self) -> ThreadRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        ring.register_comm(self.group_name, None)

    def bind(self, rank: int) -> None:
        """The calling thread is virtual rank ``rank`` from now on."""
        self._local.comm = ThreadComm(self, rank)

    def _comm(self) -> ThreadComm:
        # one communicator per thread for all its ring ops: message numbers go on from op to op, so a rank
        # that starts its backward before its successor has taken the forward's last block cannot overwrite it
        comm = getattr(self._local, "comm", None)
        if comm is None:
            raise RuntimeError(f"{self.group_name}: this thread has no rank; call bind(rank) first.")
        return comm

    def _post(self, key: tuple, tensor: torch.Tensor) -> None:
        with self._cond:
            self._mail[key] = tensor
            self._cond.notify_all()

    def _take(self, key: tuple) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._mail or self._failed is not None, self.timeout):
                raise TimeoutError(f"{self.group_name}: no message {key} within {self.timeout:.0f} s")
            if key not in self._mail:
                raise RuntimeError(f"{self.group_name}: a peer failed, waiting for {key}") from self._failed
            return self._mail.pop(key)

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            self._failed = self._failed or err
            self._cond.notify_all()

    def run(self, fn: Callable[[int], object]) -> list:
        """``fn(rank)`` on ``world`` threads, each bound to its rank; the results by rank, or the first error."""
        results: list = [None] * self.world

        def body(rank: int) -> None:
            self.bind(rank)
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                self._fail(err)

        threads = [threading.Thread(target=body, args=(r,), name=f"ring-rank-{r}") for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self._failed is not None:  # the first error; the peers it left waiting raised after it
            raise self._failed
        if self._mail:
            raise RuntimeError(f"{self.group_name}: messages never received: {sorted(self._mail)}")
        return results


def run_ring(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    dout: Sequence[torch.Tensor],
    *,
    kernel: str,
    bias: Sequence[torch.Tensor] | None = None,
    scale: float | None = None,
    autograd: bool | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Ring attention forward and backward over ``len(q)`` virtual ranks: per rank (out, dq, dk, dv).

    Rank r holds ``q[r], k[r], v[r]`` ((B, H, S_r, D); lengths may differ), the key mask ``bias[r]``
    ((B, H|1, 1, S_r) additive) and the output gradient ``dout[r]``. K/V with fewer heads H_kv than the queries'
    H (dividing it) are grouped-query attention as SDPA's ``enable_gqa``: query head j reads K/V head j // (H / H_kv),
    the blocks travel with their H_kv heads and dk, dv come back with H_kv heads. ``autograd``: through
    ``ring.ring_attention`` and ``backward()`` (default: on the CPU only, see the module docstring), else the
    two custom ops called directly.
    """
    world = len(q)
    heads, kv = q[0].shape[1], k[0].shape[1]
    if kv != heads and (kv < 1 or heads % kv or v[0].shape[1] != kv):
        raise ValueError(
            f"grouped-query attention needs K and V with the same head count dividing the {heads} query heads, got "
            f"K {k[0].shape[1]} and V {v[0].shape[1]} heads."
        )
    kv_heads = None if kv == heads else [j // (heads // kv) for j in range(heads)]
    lengths = [t.shape[2] for t in k]
    block_lengths = None if len(set(lengths)) == 1 else lengths
    autograd = q[0].device.type == "cpu" if autograd is None else autograd
    masks = [None] * world if bias is None else list(bias)

    with ThreadRing(world) as ring_:

        def rank_fn(r: int):
            if autograd:
                leaves = [t.detach().requires_grad_() for t in (q[r], k[r], v[r])]
                out = ring.ring_attention(
                    *leaves, group=ring_, kernel=ring.get_kernel(kernel), bias=masks[r], scale=scale,
                    block_lengths=block_lengths, kv_heads=kv_heads,
                )  # fmt: skip
                out.backward(dout[r])
                return (out.detach(), *(t.grad for t in leaves))
            args = (q[r], k[r], v[r], masks[r], ring_.group_name, kernel, scale, block_lengths, None, kv_heads)
            out, lse = ring.ring_attention_forward(*args)
            grads = ring.ring_attention_backward(dout[r], q[r], k[r], v[r], out, lse, *args[3:])
            return (out, *grads)

        return ring_.run(rank_fn)
