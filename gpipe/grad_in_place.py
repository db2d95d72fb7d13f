"""A large weight's gradient added into its `.grad` where it is computed: no second copy of it per micro-batch.

Autograd computes a weight's gradient as a new tensor and then adds it into
`.grad` (AccumulateGrad). With several micro-batches a step, every micro-batch
after the first therefore holds two gradients of the weight at once: for a
language model's embedding or head (GPT-2 at n_embd 2048: 412 MB, Llama 3's
head: 2 GB in float32) that second copy is the largest transient of its stage,
and the embedding's is made dense (a zeroed table) for the few rows a
micro-batch touches.

Here a captured model's embedding, linear and addmm operations on a weight of
at least IN_PLACE_BYTES (`rewrite`, applied to every captured piece) compute the
weight's gradient into the tensor `.grad` holds:

- the backward takes `.grad` (leaving it unset), adds its micro-batch's
  gradient into it in place (`addmm_`; the embedding's `index_add_` of only
  the rows its tokens used) and hands it on as the weight's gradient;
- AccumulateGrad, finding `.grad` unset and the tensor its own, keeps it as
  `.grad` without a copy, and the weight's post-accumulate hooks fire as after
  any backward (the replicas' bucketed sums start from them).

The math is the sum a plain backward takes, in another order of addition (to
float rounding). Each gradient is computed only where autograd runs the edge it
leads to (`torch._C._will_engine_execute_node`), so a split backward
(gpipe.split_backward: B the inputs', W the weights') computes each part once.
Under autocast (the weight cast to bf16 or fp16 on the way), without grad mode,
or for a weight that takes no gradient, the operation is autograd's own. A
weight used twice in one piece (a tied embedding and head on one stage) still
sums right: the second use finds `.grad` taken and makes its gradient anew.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import reduce
from typing import Any

import torch
from torch import fx

IN_PLACE_BYTES = 16 << 20  # a weight's gradient at least this large is computed into `.grad`

_aten = torch.ops.aten
# autograd's own operations (typed: torch.ops' are not)
_LINEAR: Callable[..., torch.Tensor] = _aten.linear.default
_ADDMM: Callable[..., torch.Tensor] = _aten.addmm.default
_EMBEDDING: Callable[..., torch.Tensor] = _aten.embedding.default


def _runs(node: Any) -> bool:
    """Whether this backward computes the gradient that goes to autograd's node `node` (an input's edge; None:
    no gradient goes there). A leaf that autograd.grad captures (a stage's received input, in a split
    backward's B) is one torch cannot answer for: it wants its gradient."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # a leaf captured by autograd.grad
        return True


def _accumulates(node: Any) -> bool:
    """Whether this backward adds into the weight's .grad (runs its AccumulateGrad), so that the gradient may be
    computed into .grad: not under autograd.grad, which hands the gradient back and leaves .grad be, nor
    under create_graph (a gradient with a graph of its own)."""
    if node is None or torch.is_grad_enabled():
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # autograd.grad captures the weight: its gradient goes back to the caller
        return False


_SHARED = "_gpipe_gradient_shared"  # the attribute that marks a weight whose backward runs on several threads


def exclude(weight: torch.Tensor) -> None:
    """Keep `weight`'s gradient autograd's own: gpipe.Pipeline's stages run their backwards on threads of their
    own, and a weight two of them share (a tied embedding and head) must be added into under AccumulateGrad's
    lock, not taken from .grad by one thread while the other adds."""
    setattr(weight, _SHARED, True)


def _wants(weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the in-place gradient applies: grad mode on, a leaf weight taking a gradient and no other thread's
    nor a tensor hook (a hook sees a micro-batch's gradient, not the sum so far), no autocast, no deterministic
    mode (whose one-device reference adds in autograd's order, bit for bit), and every floating input of the
    weight's dtype."""
    if not (torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf) or weight.is_meta:
        return False  # (the meta device: a probe's shapes, no gradient kept)
    if weight._backward_hooks or getattr(weight, _SHARED, False) or torch.are_deterministic_algorithms_enabled():
        return False
    if torch.is_autocast_enabled(weight.device.type):
        return False
    return all(t is None or not t.is_floating_point() or t.dtype == weight.dtype for t in others)


def _taken(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight`'s `.grad`, taken from it: the backward adds into it and hands it on to AccumulateGrad. (A backward
    that fails in between leaves .grad unset: a failed step starts again from zero_grad.)"""
    g = weight.grad
    if g is not None:
        weight.grad = None
    return g


class _Linear(torch.autograd.Function):
    """y = x @ weight.T + bias, its weight's gradient added into `.grad` (the module's doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_edge, w_edge, *b_edge = (n for n, _ in ctx.next_functions)  # no bias: no edge
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = grad @ weight if _runs(x_edge) else None
        gw = gb = None
        if _runs(w_edge):
            rows = x.reshape(-1, x.shape[-1])
            # the parameter (a saved tensor unpacks as another tensor object)
            acc = _taken(w_edge.variable) if _accumulates(w_edge) else None
            gw = g.T @ rows if acc is None else acc.addmm_(g.T, rows)
        if b_edge and _runs(b_edge[0]):
            gb = g.sum(0)
        return gx, gw, gb


class _Addmm(torch.autograd.Function):
    """y = bias + mat1 @ mat2 (mat2 the weight, as GPT-2's Conv1D holds it: in x out), mat2's gradient added into
    `.grad`."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mat1, mat2)
        ctx.bias_shape = bias.shape
        return torch.addmm(bias, mat1, mat2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        b_edge, m1_edge, w_edge = (n for n, _ in ctx.next_functions)
        mat1, mat2 = ctx.saved_tensors
        gb = gm1 = gw = None
        if _runs(b_edge):
            gb = grad.sum_to_size(ctx.bias_shape)
        if _runs(m1_edge):
            gm1 = grad @ mat2.T
        if _runs(w_edge):
            acc = _taken(w_edge.variable) if _accumulates(w_edge) else None
            gw = mat1.T @ grad if acc is None else acc.addmm_(mat1.T, grad)
        return gb, gm1, gw


class _Embedding(torch.autograd.Function):
    """weight[indices], the gradient's rows added into the weight's `.grad` (padding_idx's row takes none)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.padding_idx = padding_idx
        return _EMBEDDING(weight, indices, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w_edge = ctx.next_functions[0][0]
        if not _runs(w_edge):
            return None, None, None
        (indices,) = ctx.saved_tensors
        rows, g = indices.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx >= 0:
            keep = rows != ctx.padding_idx
            rows, g = rows[keep], g[keep]
        weight = w_edge.variable  # the weight's AccumulateGrad holds it
        acc = _taken(weight) if _accumulates(w_edge) else None
        if acc is None:
            acc = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        return acc.index_add_(0, rows, g.to(acc.dtype)), None, None


def _apply(fn: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    out: torch.Tensor = fn.apply(*args)  # type: ignore[no-untyped-call]  # unannotated in torch
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """aten.linear, its weight's gradient computed into `.grad` where that applies."""
    if not _wants(weight, x, bias):
        return _LINEAR(x, weight, bias)
    return _apply(_Linear, x, weight, bias)


def addmm(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: float = 1, alpha: float = 1
          ) -> torch.Tensor:
    """aten.addmm (mat2 the weight), its gradient computed into `.grad` where that applies."""
    if beta != 1 or alpha != 1 or not _wants(mat2, bias, mat1):
        return _ADDMM(bias, mat1, mat2, beta=beta, alpha=alpha)
    return _apply(_Addmm, bias, mat1, mat2)


def embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> torch.Tensor:
    """aten.embedding, its weight's gradient computed into `.grad` where that applies (not for
    scale_grad_by_freq or sparse gradients: autograd's own)."""
    if scale_grad_by_freq or sparse or not _wants(weight):
        return _EMBEDDING(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    return _apply(_Embedding, weight, indices, padding_idx)


# operation: (its in-place form, the index of its weight argument)
_IN_PLACE = {_aten.linear.default: (linear, 1), _aten.addmm.default: (addmm, 2),
             _aten.embedding.default: (embedding, 0)}


def rewrite(gm: fx.GraphModule, large: set[str]) -> int:
    """Point `gm`'s embedding, linear and addmm nodes whose weight is one of the placeholders `large` at the
    forms above; returns how many. The caller recompiles."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _IN_PLACE:
            continue
        form, i = _IN_PLACE[n.target]
        w = n.args[i] if len(n.args) > i else None
        if isinstance(w, fx.Node) and w.op == "placeholder" and w.target in large:
            n.target = form
            changed += 1
    return changed


def in_place_params(module: torch.nn.Module) -> set[int]:
    """The ids of the parameters of `module`'s captured pieces whose gradients are computed into `.grad`
    (`rewrite` made their one use the forms above)."""
    forms = {form: i for form, i in _IN_PLACE.values()}
    uses: dict[int, int] = {}
    for piece in module.modules():
        graph, state = getattr(piece, "_gp_graph", None), getattr(piece, "_gp_state", None)
        if not isinstance(graph, fx.GraphModule) or state is None:
            continue
        for n in graph.graph.nodes:
            i = forms.get(n.target) if n.op == "call_function" else None
            w = n.args[i] if i is not None and len(n.args) > i else None
            if isinstance(w, fx.Node) and w.target in state:
                key = id(getattr(*state[w.target]))
                uses[key] = uses.get(key, 0) + 1
    return {key for key, n in uses.items() if n == 1}  # a weight used twice makes its second gradient anew


def is_large(t: torch.Tensor) -> bool:
    """Whether `t`'s gradient is computed into `.grad` (at least IN_PLACE_BYTES)."""
    return reduce(operator.mul, t.shape, 1) * t.element_size() >= IN_PLACE_BYTES
