"""What the sharded optimizer (gpipe.memory.zero) holds, counted, not measured: the bytes of its state per replica,
by storage (a storage viewed twice counted once), against the unsharded optimizer's; what its step allocates at
once; and what a checkpoint of it allocates at once (never the whole state in one process). And what clipping
allocates at once (docs/memory.md: a peak that climbs over the steps)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpipe import optim
from gpipe.memory import meter, zero
from gpipe.stage import Stage
from gpipe.worker.stage_server import StageServer
from tests.support.local import close_stages, drive, plan_of  # noqa: F401  # close_stages: autouse
from tests.support.spec import job


def tensors_in(obj: Any, depth: int = 6) -> Iterator[torch.Tensor]:
    """Every tensor `obj` holds, through its attributes, lists, tuples and dicts, to `depth` levels."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth and isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_in(k, depth - 1)
            yield from tensors_in(v, depth - 1)
    elif depth and isinstance(obj, list | tuple):
        for v in obj:
            yield from tensors_in(v, depth - 1)
    elif depth and hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from tensors_in(vars(obj), depth - 1)


def storage_bytes(ts: Iterator[torch.Tensor]) -> dict[int, int]:
    """Storage address -> its bytes, each storage once however many tensors view it."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts if t.numel()}


def state_of(opt: Any) -> list[torch.Tensor]:
    """The tensors in the (inner) torch optimizer's state."""
    inner = opt.inner if isinstance(opt, zero.ShardedOptimizer) else opt
    return [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


WIDTH = 48


def spec(shard: bool, optimizer: str = "adamw") -> dict:
    extra = {"momentum": 0.9} if optimizer == "sgd" else {}
    return job(model={"factory": "mlp", "args": {"width": WIDTH, "depth": 3}}, stages=2, replicas=2, chunks=2,
               steps=2, data={"factory": "random_regression", "batch_size": 8,
                              "args": {"n": 32, "in_features": WIDTH, "out_features": WIDTH}},
               optimizer={"name": optimizer, "lr": 0.01, "shard": shard, **extra})


def stages_after_steps(tmp_path, shard: bool, optimizer: str) -> dict[tuple[int, int], Stage]:
    """(stage, replica) -> its Stage after 2 steps over local stages, in this process."""
    drive(plan_of(spec(shard, optimizer)), tmp_path / ("shard" if shard else "plain"))
    out = {(s.stage.cfg.model_chunk, s.stage.cfg.replica): s.stage for s in StageServer.live if s.stage is not None}
    assert len(out) == 4
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_each_replica_holds_half_the_optimizer_state_counted_by_storage(tmp_path, optimizer):
    """2 replicas x 2 stages: each sharded copy's optimizer state, counted by storage after 2 steps, is half the
    unsharded state (the cut's rounding apart: a bucket's halves differ by an element at most), and the sharded
    optimizer holds no tensor besides its state but views of the stage's own parameters (no moment made whole
    before it was cut, no full-size gather buffer, no flat copy of the weights)."""
    plain = stages_after_steps(tmp_path, False, optimizer)
    whole = {k: storage_bytes(iter(state_of(st.optimizer))) for k, st in plain.items()}
    scalars = {k: sum(t.untyped_storage().nbytes() for t in state_of(st.optimizer) if t.dim() == 0)
               for k, st in plain.items()}
    StageServer.close_all()
    sharded = stages_after_steps(tmp_path, True, optimizer)
    for (stage, replica), st in sorted(sharded.items()):
        opt = st.optimizer
        assert isinstance(opt, zero.ShardedOptimizer)
        held = storage_bytes(iter(state_of(opt)))
        own_scalars = sum(t.untyped_storage().nbytes() for t in state_of(opt) if t.dim() == 0)
        plain_bytes = sum(whole[stage, replica].values()) - scalars[stage, replica]
        slots = 2 if optimizer == "adamw" else 1
        mine = sum(pc.hi - pc.lo for pc in opt.mine) * 4 * slots  # float32
        got = sum(held.values()) - own_scalars
        print(f"stage {stage} replica {replica}: {got} bytes of state, unsharded {plain_bytes}")
        assert got == mine  # exactly its pieces' elements, once each
        assert abs(got - plain_bytes / 2) <= 4 * slots * len(opt.cut.buckets)
        # nothing else: every other tensor it holds views a parameter of the stage
        params = {p.untyped_storage().data_ptr() for p in st.params}
        others = storage_bytes(t for t in tensors_in(opt) if t.untyped_storage().data_ptr() not in held)
        assert set(others) <= params, f"the sharded optimizer holds {sum(others.values())} bytes of its own"


class Created(TorchDispatchMode):
    """The largest storage any op makes while it is on (this thread's ops): a tensor made new, not a view of an
    input nor an input changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_a_sharded_step_makes_nothing_larger_than_a_slice_or_a_gather_round(monkeypatch):
    """The step of a copy's pieces, a parameter of 4096 elements cut in two: stepped whole, adam makes
    temporaries of a piece (half the parameter: on a CPU, below glibc's mmap threshold, they stayed in the
    heap); in slices of SLICE_BYTES, of a slice. Before and after each step the heaps are handed back
    (malloc_trim)."""
    from tests.engine.test_zero import on_copies

    monkeypatch.setattr(zero, "GATHER_BYTES", 1024)  # rounds of 128 elements a copy
    trims: list[int] = []
    monkeypatch.setattr(meter, "give_back", lambda: trims.append(1))

    def largest(slice_bytes: int) -> list[int]:
        monkeypatch.setattr(zero, "SLICE_BYTES", slice_bytes)

        def copy(r: int, gather: Any) -> int:
            p = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
            opt = zero.ShardedOptimizer(torch.optim.AdamW, {"lr": 0.01}, [p], ["w"], 2, r, gather)
            p.grad = torch.ones_like(p)
            opt.step()  # the first step: what torch's optimizer makes once
            with Created() as c:
                opt.step()
            return c.largest

        return on_copies(2, copy)

    assert all(n >= 2048 * 4 for n in largest(1 << 20))  # a piece: half of 4096 float32 elements
    assert all(n <= 1024 for n in largest(1024))  # a slice (256 elements) or a gather round (2 x 128)
    # and the heaps handed back before and after every step (2 steps, 2 copies, twice)
    assert len(trims) == 2 * 2 * 2 * 2


def test_an_unsharded_step_on_a_cpu_hands_the_heaps_back_before_and_after(monkeypatch):
    """gpipe.optim.build: what the backwards freed is not under the step's temporaries, what the step freed not
    under the next step (docs/memory.md, a peak that climbs); the step itself is torch's."""
    trims: list[int] = []
    monkeypatch.setattr(meter, "give_back", lambda: trims.append(1))
    p = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    twin = p.detach().clone().requires_grad_()
    opt, plain = optim.build("adamw", [p], {"lr": 0.01}), torch.optim.AdamW([twin], lr=0.01)
    for _ in range(3):
        p.grad, twin.grad = torch.ones_like(p), torch.ones_like(twin)
        opt.step()
        plain.step()
    assert len(trims) == 2 * 3 and torch.equal(p, twin)


def test_a_sharded_checkpoint_never_holds_a_whole_optimizer_tensor_and_equals_the_unsharded_one(tmp_path,
                                                                                              monkeypatch):
    """A checkpoint of a sharded stage (gpipe.worker.state_stream.Outgoing on replica 0): the optimizer's tensors
    come from the copies in rounds, each written where it goes in the file, so the largest tensor made meanwhile
    is a round's, not the whole state's nor one tensor's; and the checkpoint holds the very tensors an
    unsharded job's does."""
    from gpipe.coordinator.outputs import checkpoint
    from gpipe.worker import state_stream

    monkeypatch.setattr(zero, "GATHER_BYTES", 256)  # rounds of 32 elements a copy
    made: list[tuple[int, int]] = []  # per copy-out: (the largest tensor made, the state's bytes)
    init = state_stream.Outgoing.__init__

    def counted(self: Any, step: int, st: Any) -> None:
        with Created() as c:
            init(self, step, st)
        made.append((c.largest, self.data_bytes))

    monkeypatch.setattr(state_stream.Outgoing, "__init__", counted)
    for shard in (True, False):
        drive(plan_of({**spec(shard), "checkpoint_every": 2}), tmp_path / str(shard))
        StageServer.close_all()
    sharded, plain = made[:2], made[2:]
    assert len(sharded) == len(plain) == 2  # stage 0's and stage 1's, on replica 0
    weight = WIDTH * WIDTH * 4  # one weight, or one moment of it
    assert all(largest <= 2 * 256 for largest, _ in sharded), sharded
    assert all(largest >= weight for largest, _ in plain)  # unsharded, held in memory: each tensor copied whole

    def optim(shard: bool) -> dict[str, torch.Tensor]:
        ck = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path / str(shard)), 2))
        return {k: v for st in ck.stages for k, v in st.tensors.items() if k.startswith("optim/")}

    got, want = optim(True), optim(False)
    assert set(got) == set(want) and len(want) == 3 * 8  # 8 parameters: exp_avg, exp_avg_sq, step
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-7)


def test_clipping_squares_a_slice_of_each_gradient_at_a_time_on_a_cpu(monkeypatch):
    """Stage._clip's float64 squares: of a whole gradient they were twice its size, twice over (a GPT-2 worker's
    25 MiB embedding: 100 MiB out of the heap, kept from its second step on); now of CLIP_SLICE elements at a
    time, and the norm and the clipped gradients as before."""
    from types import SimpleNamespace

    from gpipe import stage as stage_module

    g = torch.Generator().manual_seed(0)
    params = [torch.zeros(64, 64, requires_grad=True), torch.zeros(10, requires_grad=True)]
    grads = [torch.randn(64, 64, generator=g), torch.randn(10, generator=g)]

    def clip(slice_elements: int) -> tuple[float, list[torch.Tensor], int]:
        monkeypatch.setattr(stage_module, "CLIP_SLICE", slice_elements)
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr.clone()
        fake = SimpleNamespace(grad_params=params, tied=[], device=torch.device("cpu"), _on_cpu=True,
                               transport=SimpleNamespace(all_reduce=lambda t, group: None))
        with Created() as c:
            norm = Stage._clip(fake, 1.0)  # type: ignore[arg-type]
        return norm, [p.grad.clone() for p in params], c.largest

    whole, clipped, largest = clip(1 << 20)
    assert largest >= 64 * 64 * 8  # the whole weight's squares in float64
    sliced, clipped_too, largest = clip(100)
    assert largest <= 100 * 8
    assert abs(sliced - whole) <= 1e-12 * whole
    want = torch.cat([gr.reshape(-1) for gr in grads]).double().norm().item()
    assert abs(whole - want) <= 1e-9 * want
    for a, b in zip(clipped, clipped_too, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
