"""A large weight's gradient added into its `.grad` where it is computed: no second copy, no second pass.

Autograd computes a weight's gradient as a new tensor and then adds it into
`.grad` (AccumulateGrad). With several micro-batches a step, every micro-batch
after the first therefore holds two gradients of the weight at once: for a
language model's embedding or head (GPT-2 at n_embd 2048: 412 MB, Llama 3's
head: 2 GB in float32) that second copy is the largest transient of its stage,
and the embedding's is made dense (a zeroed table) for the few rows a
micro-batch touches. The add is also a pass over the weight's bytes of its
own: a Linear(1024)'s backward on 32 rows spends 0.3 of its 1.3 ms on it.

Here the embedding, linear and addmm operations on a weight of at least
IN_PLACE_BYTES compute the weight's gradient into the tensor `.grad` holds
(Megatron's gradient-accumulation fusion): a captured model's (`rewrite`,
applied to every captured piece) and a plain model's nn.Linear layers (`fuse`,
applied to every stage's layers):

- the backward takes `.grad` (leaving it unset), adds its micro-batch's
  gradient into it in place (`addmm_`; the embedding's `index_add_` of only
  the rows its tokens used) and hands it on as the weight's gradient;
- AccumulateGrad, finding `.grad` unset and the tensor its own, keeps it as
  `.grad` without a copy, and the weight's post-accumulate hooks fire as after
  any backward (the replicas' bucketed sums start from them).

A split backward (gpipe.split_backward: B the inputs' gradients, W the
weights') marks the linear and addmm nodes where its weights' paths leave the
inputs' (`defer`): B keeps the gradient arriving there on the node, and W runs
the weight-gradient GEMMs from it directly (`run_deferred`, as AccumulateGrad
would add them, hooks included), with no autograd pass of its own: the
zero-bubble paper's and Megatron's deferred weight-gradient computation. An
autograd pass per weight, as torch.distributed.pipelining's W takes, walks the
graph below each weight again (bench/README.md (s)).

The math is the sum a plain backward takes, in another order of addition (to
float rounding; on the CPU here the same bits for micro-batches of up to 256
rows). Each gradient is computed only where autograd runs the edge it
leads to (`torch._C._will_engine_execute_node`), so a split backward
computes each part once.
Under autocast (the weight cast to bf16 or fp16 on the way), without grad mode,
or for a weight that takes no gradient, the operation is autograd's own. A
weight used twice in one piece (a tied embedding and head on one stage) still
sums right: the second use finds `.grad` taken and makes its gradient anew.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from functools import reduce
from typing import Any, cast

import torch
from torch import fx

from gpipe import rng

# A weight's gradient at least this large is computed into `.grad`. Below it the Function's Python (some 50 us a
# forward and a backward, here) costs more than the add it saves: at 1 MiB (Linear(512), 32 rows a micro-batch) the
# two come out even on one core; at 4 MiB (Linear(1024)) the backward takes 0.8x, a split backward's W 0.3x
# (bench/README.md (x)).
IN_PLACE_BYTES = 1 << 20

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


_DEFER = "_gp_defer"  # set on a node by a split backward's B (gpipe.split_backward): keep the weights' part for W
_KEPT = "_gp_kept"  # the gradient B kept on such a node for W (`run_deferred`); _RAN once W has run it
_RAN = object()


def defer(node: Any) -> bool:
    """Have the weights' gradients of autograd's node `node`, if one of this module's linear or addmm, wait for
    `run_deferred`: the backward that computes its input's gradient alone (a split backward's B) keeps the
    gradient arriving there on the node. Returns whether it is such a node."""
    if not isinstance(node, (_Linear._backward_cls, _Addmm._backward_cls)):
        return False
    setattr(node, _DEFER, True)
    return True


def is_deferred(node: Any) -> bool:
    """Whether `node`'s weights' gradients wait for `run_deferred` (its B has run, its W not yet)."""
    return isinstance(getattr(node, _KEPT, None), torch.Tensor)


def _kept(ctx: Any, grad: torch.Tensor, x_edge: Any, w_edges: list[Any]) -> bool:
    """In a backward's pass at `ctx`: whether its weights' gradients are W's (kept on the node, or kept already)
    rather than this pass's."""
    if getattr(ctx, _KEPT, None) is not None:
        return True  # B kept them: W computes them (run_deferred), not a later pass through this node (an
        # autograd pass of W for another weight, where the weight is used twice, one use below the other)
    if getattr(ctx, _DEFER, False) and _runs(x_edge) and not any(_runs(e) for e in w_edges):
        setattr(ctx, _KEPT, grad)
        return True
    return False


def _add_to_grad(p: torch.Tensor, make: Callable[[], torch.Tensor], add: Callable[[torch.Tensor], Any]) -> None:
    """What AccumulateGrad does, for W: the gradient into `p.grad` (made anew by `make` where it has none, added
    in place by `add` where it has). Its hooks are the caller's to fire, once (`fire_hooks`)."""
    if p.grad is None:
        p.grad = make()
    else:
        add(p.grad)


def fire_hooks(p: torch.Tensor) -> None:
    """`p`'s post-accumulate hooks, as AccumulateGrad fires them once it has added a backward's gradient (the
    replicas' bucketed sums take the gradient as final there: once per backward, after every use's part)."""
    hooks = p._post_accumulate_grad_hooks
    if hooks:
        for hook in list(hooks.values()):
            hook(p)


def run_deferred(node: Any) -> list[torch.Tensor]:
    """W for a node `defer` took whose B has run: its weights' gradients from the gradient kept there, added into
    their `.grad` as autograd's AccumulateGrad would (Megatron's deferred weight-gradient GEMMs, with no
    autograd pass of their own); returns the weights, whose hooks the caller fires once all of W has added
    into them (a weight used twice is added into twice). Once: the node keeps nothing after."""
    grad = getattr(node, _KEPT)
    setattr(node, _KEPT, _RAN)
    done: list[torch.Tensor] = []

    def add(p: torch.Tensor, make: Callable[[], torch.Tensor], into: Callable[[torch.Tensor], Any]) -> None:
        _add_to_grad(p, make, into)
        done.append(p)

    with torch.no_grad():
        linear = isinstance(node, _Linear._backward_cls)  # (a flag: isinstance would narrow `node` to object)
        if linear:
            x, _ = node.saved_tensors
            _x_edge, w_edge, *b_edge = (n for n, _ in node.next_functions)  # no bias: no edge
            g, rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            if w_edge is not None:
                add(w_edge.variable, lambda: g.T @ rows, lambda acc: acc.addmm_(g.T, rows))
            if b_edge and b_edge[0] is not None:
                add(b_edge[0].variable, lambda: g.sum(0), lambda acc: acc.add_(g.sum(0)))
        else:
            mat1, _ = node.saved_tensors
            b_edge, _m1, w_edge = (n for n, _ in node.next_functions)
            if w_edge is not None:
                add(w_edge.variable, lambda: mat1.T @ grad, lambda acc: acc.addmm_(mat1.T, grad))
            if b_edge is not None:
                shape = node.bias_shape
                add(b_edge.variable, lambda: grad.sum_to_size(shape).clone(),
                    lambda acc: acc.add_(grad.sum_to_size(shape)))
    return done


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
        if _kept(ctx, grad, x_edge, [w_edge, *b_edge]):
            return gx, None, None
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
        if _runs(m1_edge):
            gm1 = grad @ mat2.T
        if _kept(ctx, grad, m1_edge, [b_edge, w_edge]):
            return None, gm1, None
        if _runs(b_edge):
            gb = grad.sum_to_size(ctx.bias_shape)
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


def _traced(form: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Where torch.fx traces a graph that calls `form` symbolically, the node that calls it (else None). A
    GraphModule that `rewrite` changed is traced so when it is unpickled (torch.fx re-traces its code: a
    captured piece sent to another process, as the plan's measuring processes are): its arguments are then
    Proxies, which `_wants` cannot ask, and the graph must call `form` again, not run it."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, fx.Proxy):
            return cast(torch.Tensor, a.tracer.create_proxy("call_function", form, args, kwargs))
    return None


def _apply(fn: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    out: torch.Tensor = fn.apply(*args)  # type: ignore[no-untyped-call]  # unannotated in torch
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """aten.linear, its weight's gradient computed into `.grad` where that applies."""
    if (node := _traced(linear, x, weight, bias)) is not None:
        return node
    if not _wants(weight, x, bias):
        return _LINEAR(x, weight, bias)
    return _apply(_Linear, x, weight, bias)


def addmm(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: float = 1, alpha: float = 1
          ) -> torch.Tensor:
    """aten.addmm (mat2 the weight), its gradient computed into `.grad` where that applies."""
    if (node := _traced(addmm, bias, mat1, mat2, beta=beta, alpha=alpha)) is not None:
        return node
    if beta != 1 or alpha != 1 or not _wants(mat2, bias, mat1):
        return _ADDMM(bias, mat1, mat2, beta=beta, alpha=alpha)
    return _apply(_Addmm, bias, mat1, mat2)


def embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> torch.Tensor:
    """aten.embedding, its weight's gradient computed into `.grad` where that applies (not for
    scale_grad_by_freq or sparse gradients: autograd's own)."""
    if (node := _traced(embedding, weight, indices, padding_idx, scale_grad_by_freq, sparse)) is not None:
        return node
    if scale_grad_by_freq or sparse or not _wants(weight):
        return _EMBEDDING(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    return _apply(_Embedding, weight, indices, padding_idx)


# operation: (its in-place form, the index of its weight argument)
_IN_PLACE = {_aten.linear.default: (linear, 1), _aten.addmm.default: (addmm, 2),
             _aten.embedding.default: (embedding, 0)}
for _form, _ in _IN_PLACE.values():
    rng.vouch(_form)  # they draw no random numbers: a captured graph that calls them may go unseeded


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


_FUSED = "_gp_fused"  # set on an nn.Linear whose forward `fuse` made this module's linear


@rng.vouch  # a fused linear's forward draws nothing (gpipe.rng.quiet)
def _fused_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(self, torch.nn.Linear)  # (fuse takes only these)
    return linear(x, self.weight, self.bias)


def _fusible(m: torch.nn.Module) -> bool:
    return (isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward
            and "forward" not in m.__dict__ and is_large(m.weight))


def fuse(module: torch.nn.Module) -> int:
    """Have every plain `nn.Linear` in `module` (not a subclass with a forward of its own) whose weight is at least
    IN_PLACE_BYTES run this module's linear: its weight's gradient computed into `.grad` (Megatron's
    gradient-accumulation fusion), and under a split backward its weight-gradient GEMMs deferred to W. The
    captured models' graphs get the same from `rewrite`. Returns how many."""
    changed = 0
    for m in module.modules():
        if _fusible(m):
            # An instance's own forward; a partial of a module-level function, so that a pickled model (torch.save
            # of the whole module) loads back, as a bound method would not.
            m.forward = functools.partial(_fused_forward, m)
            setattr(m, _FUSED, True)
            changed += 1
    return changed


def in_place_params(module: torch.nn.Module) -> set[int]:
    """The ids of the parameters of `module` whose gradients are computed into `.grad`: the weights of its
    captured pieces' operations that `rewrite` pointed at the forms above, and of the linears `fuse` takes, each
    used once."""
    forms = {form: i for form, i in _IN_PLACE.values()}
    uses: dict[int, int] = {}
    held: dict[int, int] = {}  # parameter -> how many modules hold it (a tied weight: more than one)
    for piece in module.modules():
        for p in piece.parameters(recurse=False):
            held[id(p)] = held.get(id(p), 0) + 1
        if getattr(piece, _FUSED, False) or _fusible(piece):  # (the coordinator's copy: the linears fuse will take)
            uses[id(piece.weight)] = uses.get(id(piece.weight), 0) + 1
        graph, state = getattr(piece, "_gp_graph", None), getattr(piece, "_gp_state", None)
        if not isinstance(graph, fx.GraphModule) or state is None:
            continue
        for n in graph.graph.nodes:
            i = forms.get(n.target) if n.op == "call_function" else None
            w = n.args[i] if i is not None and len(n.args) > i else None
            if isinstance(w, fx.Node) and w.target in state:
                key = id(getattr(*state[w.target]))
                uses[key] = uses.get(key, 0) + 1
    # a weight used twice makes its second gradient anew
    return {key for key, n in uses.items() if n == 1 and held.get(key, 0) <= 1}


def is_large(t: torch.Tensor) -> bool:
    """Whether `t`'s gradient is computed into `.grad` (at least IN_PLACE_BYTES)."""
    return reduce(operator.mul, t.shape, 1) * t.element_size() >= IN_PLACE_BYTES
