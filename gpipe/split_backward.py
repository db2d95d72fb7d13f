"""Split backward: a micro-batch's backward as B (its inputs' gradients) now and W (its weights') later.

Zero-bubble schedules (gpipe.schedule: zb-h1) send a stage's input gradients
upstream as soon as they exist, since the stage before waits on them, and
compute the weight gradients later, where the stage would otherwise be idle.

Nothing is computed twice (the approach of torch.distributed.pipelining's
`stage_backward_input` / `stage_backward_weight`):

- B runs autograd from the outputs to the inputs only, keeping the graph.
  Autograd then runs only the nodes on a path to an input, and each computes
  only the gradients that lead there: a Linear's matmul for its input, not
  the one for its weight.
- The nodes where a weight's path leaves the inputs' path (the Linear's addmm:
  a "split" node) get a pre-hook that keeps the gradient arriving at them.
- W runs autograd from the split nodes, with those gradients, to the weights
  only: each split node now computes just its weight-side gradients, and the
  weights' AccumulateGrad nodes add them into `.grad` (their hooks fire, so
  the replicas' sums start as they do after a plain backward).

A weight reached from two split nodes, one below the other on the input path
(a weight used twice), would get the lower node's gradient again through the
upper one: there the lower node's kept gradient replaces whatever arrives, so
the sum is still one backward's (the input path between them then runs again:
the one case that computes twice). An output that does not depend on any input
(the first stage's, whose inputs want no gradient) goes backward whole in W.

What W needs of the graph is the split nodes and what lies below them toward
the weights; but a split node keeps every node below it alive, on the input
path too (attention's saved queries and keys, a ReLU's mask, the loss's
log-probabilities), with what they saved. So B unpacks the tensors saved by the
input path's other nodes under `releasing`, which drops what is unpacked (the
stage's gpipe.memory.meter.ActivationMeter, which packed them): between B and W a
micro-batch then holds only its weights' inputs, as the zero-bubble paper counts
it. (Not in the weight-used-twice case, whose W runs part of the input path.)
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from gpipe import grad_in_place


def _node(t: torch.Tensor) -> Node | None:
    """The node autograd runs for `t`: its grad_fn, or for a leaf its AccumulateGrad (made on first use)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view = t.view_as(t).grad_fn
    assert view is not None  # a view of a tensor that requires grad has one
    node: Node | None = view.next_functions[0][0]
    return node


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node below `roots`, the nodes that pass it a gradient."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _above(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """The nodes reached going up from `starts` (toward the outputs) without entering `stop`; and the nodes of
    `stop` met on the way."""
    reached, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), []):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


@dataclass
class _Group:
    """Weights whose gradients come from the same split nodes, with the gradients B kept at those nodes."""

    params: list[torch.Tensor]
    splits: list[Node]
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


def _keeper(group: _Group, node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    """A pre-hook that keeps the gradients arriving at split node `node` for `group`'s W."""
    def keep(grads: tuple[torch.Tensor | None, ...]) -> None:
        group.kept[node] = tuple(grads)
    return keep


def _replacer(kept: tuple[torch.Tensor | None, ...]) -> Callable[[tuple[torch.Tensor | None, ...]],
                                                                  tuple[torch.Tensor | None, ...]]:
    """A pre-hook that replaces the gradients arriving at a split node with `kept`."""
    return lambda _grads: kept


class WeightGradients:
    """W of one micro-batch: what B kept for its weights' gradients. `run` once; it drops the graph."""

    def __init__(self, groups: list[_Group], whole: list[tuple[torch.Tensor, torch.Tensor | None]],
                 params: list[torch.Tensor]):
        self.groups, self.whole, self.params = groups, whole, params

    def run(self) -> None:
        """Add the weights' gradients into their `.grad`, as one plain backward would have: each weight's
        post-accumulate hooks fire once, after all its parts are in (the replicas' sums start there)."""
        plan = [(g, [node for node in g.splits if grad_in_place.is_deferred(node)]) for g in self.groups]
        # First the deferred parts: a linear's or addmm's weight-gradient GEMMs, with no autograd pass.
        deferred: dict[int, torch.Tensor] = {}
        for _, nodes in plan:
            for node in nodes:
                for p in grad_in_place.run_deferred(node):
                    deferred[id(p)] = p
        passes = [g for g, nodes in plan if len(nodes) < len(g.splits)]
        # Then autograd's passes (where a weight has other uses too, its AccumulateGrad fires its hooks, once
        # the deferred parts are in; the deferred nodes among them add nothing more: grad_in_place._kept).
        fired: set[int] = set()
        marks = [p.register_post_accumulate_grad_hook(lambda p: fired.add(id(p)))  # type: ignore[no-untyped-call]
                 for p in deferred.values()] if passes or self.whole else []
        try:
            for g in passes:
                self._autograd_pass(g)
            if self.whole and self.params:  # outputs that no input reaches: their whole backward, now
                torch.autograd.backward([t for t, _ in self.whole], [g for _, g in self.whole], inputs=self.params)
        finally:
            for m in marks:
                m.remove()
        for key, p in deferred.items():
            if key not in fired:
                grad_in_place.fire_hooks(p)
        self.groups, self.whole = [], []

    @staticmethod
    def _autograd_pass(g: _Group) -> None:
        """`g`'s weights' gradients by autograd, from the gradients B kept at its split nodes."""
        edges, grads = [], []
        for node in g.splits:
            for i, grad in enumerate(g.kept.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not edges:
            return
        handles = []
        if len(g.splits) > 1:  # one split node below another: it takes what B kept there, not a second copy
            handles = [node.register_prehook(_replacer(kept)) for node, kept in g.kept.items()]
        try:
            torch.autograd.backward(edges, grads, inputs=g.params, retain_graph=True)
        finally:
            for h in handles:
                h.remove()


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                   releasing: Callable[[], AbstractContextManager[None]] | None = None) -> WeightGradients:
    """B: the gradients of `inputs` (tensors that require grad) from `roots` with `grads` (None: ones, for a
    scalar loss), put in each input's `.grad`; returns W, the weights' part, to run later.

    `params` are the weights (leaves) whose gradients W adds to their `.grad`. `releasing`, when given, is a
    context under which unpacking a saved tensor drops it: B then drops what the nodes W does not run saved
    (see the module's docstring).
    """
    pairs = [(t, g) for t, g in zip(roots, grads, strict=True) if t.requires_grad]
    inputs = [t for t in inputs if t.requires_grad]
    params = [p for p in params if p.requires_grad]
    if not pairs:
        return WeightGradients([], [], params)
    if not inputs:
        return WeightGradients([], pairs, params)
    root_nodes = [n for t, _ in pairs if (n := _node(t)) is not None]
    parents = _parents(root_nodes)
    on_input_path, _ = _above([n for t in inputs if (n := _node(t)) is not None], parents, set())
    by_split: dict[Node, _Group] = {}
    for p in params:
        node = _node(p)
        if node is None or node not in parents:
            continue  # not used on the way to these outputs
        _, splits = _above([node], parents, on_input_path)
        group = _Group([p], sorted(splits, key=id))
        for s in splits:  # weights that share a split node share one W pass
            other = by_split.get(s)
            if other is not None and other is not group:
                group.params = other.params + [q for q in group.params if all(q is not o for o in other.params)]
                group.splits = other.splits + [q for q in group.splits if q not in other.splits]
                for n in other.splits:
                    by_split[n] = group
            by_split[s] = group
    groups = list({id(g): g for g in by_split.values()}.values())
    # A split node that is grad_in_place's linear or addmm keeps its own gradient for W, and W computes its
    # weights' gradients without autograd; the others' gradients are kept by a pre-hook, for an autograd pass.
    handles = [s.register_prehook(_keeper(g, s)) for g in groups for s in g.splits if not grad_in_place.defer(s)]
    try:
        got = torch.autograd.grad([t for t, _ in pairs], inputs, [d for _, d in pairs],
                                  retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for t, d in zip(inputs, got, strict=True):
        if d is not None:
            t.grad = d if t.grad is None else t.grad + d
    whole = [(t, d) for t, d in pairs if _node(t) not in on_input_path]
    if releasing is not None and not whole and all(len(g.splits) == 1 for g in groups):
        splits = {s for g in groups for s in g.splits}
        with releasing():
            for node in on_input_path - splits:
                _unpack_saved(node)
    return WeightGradients(groups, whole, params)


_SAVED: dict[type, list[str]] = {}  # per kind of autograd node: the attributes its saved values are read by


def _unpack_saved(node: Node) -> None:
    """Unpack every tensor autograd's node `node` saved for its backward (its `_saved_*` attributes)."""
    names = _SAVED.get(type(node))
    if names is None:
        names = _SAVED[type(node)] = [n for n in dir(node) if n.startswith("_saved_")
                                      and not n.endswith(("_sym_sizes", "_sym_strides"))]
    for name in names:
        try:
            getattr(node, name)
        except RuntimeError:  # not unpackable (freed already)
            continue
