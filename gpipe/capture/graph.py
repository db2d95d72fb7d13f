"""Any nn.Module as a pipeline: captured with torch.export and cut into pieces, an nn.Sequential of them.

The rest of gpipe cuts an nn.Sequential between its layers. A model that is not
one (a Hugging Face causal LM, a hand-written module with a `forward`) is
captured whole with torch.export, its batch and sequence dimensions dynamic,
and its graph is cut with torch.fx's split_module into *pieces*:

- before each of its repeated blocks but the first (the longest ModuleList,
  Sequential or ModuleDict of same-type children, in its order: `transformer.h`,
  `model.layers`, torchtitan's `layers` dict), so that what comes before the
  first block rides with it and what comes after the last rides with the last;
- and before each of `split_points`, the submodules named (torch.distributed.
  pipelining's SplitPoint.BEGINNING).

Piece i takes a tuple of the values that later pieces still need (piece 0: the
micro-batch itself, a tensor or a dict of the forward's keyword inputs) and
gives the same kind of tuple on: residuals, masks and sizes cross the cuts as
any pytree does. The last piece gives the output the loss takes (`logits` when
the output has them, see `select_output`). Every piece holds the model's own
parameter tensors under the model's own names, so the stages, checkpoints and
`model.safetensors` speak the model's names.

A parameter that two pieces use (GPT-2's embedding and head: tied weights) is
one tensor in each; `tied_groups` lists them so that stages holding copies of it
sum its gradient and keep the copies equal.
"""

from __future__ import annotations

import copy
import difflib
import operator
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from gpipe import grad_in_place, rng

MAX_SPLIT_POINTS = 255

# torch.export keeps its tracing state process-wide (the fx patcher, the proxy-mode stack): two captures at
# once in one process (a worker building two model chunks on two RPC threads) corrupt each other's trace.
_capturing = threading.RLock()

# What export writes into a graph about the sample it traced: the dtype and device of the tensors that `.to()`
# was called on. A stage runs its piece under autocast (the activations bf16 or fp16) and on its own device,
# so these checks would fail on values that are right; they compute nothing.
_METADATA_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


class CaptureError(ValueError):
    """The model cannot be captured or cut as asked: the message says which module or operation, and what to do."""


@dataclass
class Captured:
    """A model as pieces, and what the plan and the stages need to know of them."""

    pieces: nn.Sequential  # piece i: a Piece, holding the model's own parameters under the model's names
    cuts: list[int]  # piece indices where a split point begins (the stages' boundaries, when given)
    blocks: str | None  # the repeated blocks' container, when found (its path: `transformer.h`, `layers`)
    modules: list[list[str]]  # per piece: the model's submodules wholly in it (largest first found)
    crossing: list[list[str]]  # per boundary i (between piece i and i+1): the values that cross it
    tied: list[list[str]] = field(default_factory=list)  # parameter keys ("i.name") that are one tensor
    # per boundary: each crossing value as the sample gave it ("[B, T, 64] float32 from transformer.h.1.mlp";
    # B and T: the batch and sequence dimensions, any other dynamic one the sample's size), in the order of `crossing`
    shapes: list[list[str]] = field(default_factory=list)
    block_count: int = 0  # the repeated blocks found in `blocks`
    block_type: str = ""  # and their class
    split_points: int = 0  # the split points given (model.split_points)

    def what(self) -> str:
        """What the model was cut at and into, each count named: "4 blocks in layers (TransformerBlock), 4
        pieces"; "no repeated blocks, 1 split point, 2 pieces"."""
        points = f"{self.split_points} split point{'s' if self.split_points != 1 else ''}"
        if self.blocks is None:
            found = f"no repeated blocks, {points}"
        else:
            found = f"{self.block_count} blocks in {self.blocks} ({self.block_type})"
            found += f" and {points}" if self.split_points else ""
        return f"{found}, {len(self.pieces)} pieces"


@rng.vouch  # its forward only runs its graph, a submodule proven on its own (gpipe.rng.quiet)
class Piece(nn.Module):
    """One piece of a captured model: carry in, carry out (see the module's doc). It holds its parameters and
    buffers under the model's own names (`transformer.h.2.attn.c_attn.weight`), and its graph beside them."""

    def __init__(self, gm: fx.GraphModule, ins: list[str], args: list[str], outs: list[str], emits: list[Any],
                 state: dict[str, tuple[str, torch.Tensor, str]], in_spec: pytree.TreeSpec | None,
                 out_spec: pytree.TreeSpec | None, output: str | None, device: torch.device):
        super().__init__()
        # A large weight's gradient is computed into its .grad (gpipe.grad_in_place): one copy of it, not two.
        if grad_in_place.rewrite(gm, {a for a, (_, t, kind) in state.items()
                                      if kind == "parameter" and grad_in_place.is_large(t)}):
            gm.recompile()
        self._gp_graph = gm  # a submodule, so that .to() moves its constants; it holds no parameters
        self._gp_eval = _eval_graph(gm)  # the same graph with dropout and batch norm in eval mode (or None)
        self._gp_ins, self._gp_args, self._gp_outs, self._gp_emits = ins, args, outs, emits
        self._gp_in_spec, self._gp_out_spec, self._gp_output = in_spec, out_spec, output
        self._gp_device = device  # the device the capture traced on, which the graph names (see to_device)
        self._gp_state: dict[str, tuple[nn.Module, str]] = {}
        for arg, (name, t, kind) in state.items():
            self._gp_state[arg] = _put(self, name, t, kind)
        self._gp_keys: list[str] | None = None
        if in_spec is not None:  # the first piece: which keyword inputs, in the captured order
            kwargs_spec = in_spec.children()[1] if in_spec.num_children == 2 else None
            if kwargs_spec is not None and kwargs_spec.num_children:
                self._gp_keys = list(kwargs_spec.context)

    def __deepcopy__(self, memo: dict[int, Any]) -> Piece:
        """A copy (a replica's, the probe's) that shares the input and output tree specs: they never change,
        and copying one re-creates its leaves through torch's deprecated LeafSpec constructor, which warns
        (FutureWarning) at every validate and run."""
        for spec in (self._gp_in_spec, self._gp_out_spec):
            if spec is not None:
                memo[id(spec)] = spec
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    def forward(self, x: Any) -> Any:
        if self._gp_in_spec is not None:
            values = self._flat_inputs(x)
        else:
            values = list(x) if isinstance(x, tuple | list) else [x]
        env = dict(zip(self._gp_ins, values, strict=True))
        state = self._gp_state
        graph = self._gp_graph if self.training or self._gp_eval is None else self._gp_eval
        out = graph(*[getattr(*state[a]) if a in state else env[a] for a in self._gp_args])
        if len(self._gp_outs) == 1 and not isinstance(out, tuple | list):
            out = (out,)
        env.update(zip(self._gp_outs, out, strict=True))
        emitted = [env[n] if isinstance(n, str) else n for n in self._gp_emits]
        if self._gp_out_spec is not None:
            return select_output(pytree.tree_unflatten(emitted, self._gp_out_spec), self._gp_output)
        return tuple(emitted)

    def _flat_inputs(self, x: Any) -> list[Any]:
        keys = self._gp_keys
        if keys is not None:
            if not isinstance(x, dict):
                raise TypeError(f"the model was captured with keyword inputs {keys}, got a {type(x).__name__}")
            if set(x) != set(keys):
                raise TypeError(f"the model was captured with keyword inputs {keys}, got {sorted(x)}")
            x = ((), {k: x[k] for k in keys})
        else:
            x = ((x,), {})
        flat, _ = pytree.tree_flatten(x)
        return flat


# The operations captured in training mode that run otherwise in eval mode: the index of their `train` argument.
TRAINING_ARG = {
    torch.ops.aten.dropout.default: 2,
    torch.ops.aten.feature_dropout.default: 2,
    torch.ops.aten.alpha_dropout.default: 2,
    torch.ops.aten.feature_alpha_dropout.default: 2,
    torch.ops.aten.batch_norm.default: 5,
}


def _eval_graph(gm: fx.GraphModule) -> fx.GraphModule | None:
    """`gm` with its dropout and batch norm switched to eval mode (export captures the training forward);
    None when it has none, and the one graph serves both modes."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    changed = False
    for n in gm.graph.nodes:
        new = graph.node_copy(n, lambda a: env[a])
        i = TRAINING_ARG.get(n.target)
        if i is not None and len(new.args) > i and new.args[i] is True:
            new.args = (*new.args[:i], False, *new.args[i + 1:])
            changed = True
        elif n.target is torch.ops.aten.scaled_dot_product_attention.default:  # attention's dropout
            if len(new.args) > 4 and new.args[4]:
                new.args = (*new.args[:4], 0.0, *new.args[5:])
                changed = True
            elif new.kwargs.get("dropout_p"):
                new.kwargs = {**new.kwargs, "dropout_p": 0.0}
                changed = True
        env[n] = new
    if not changed:
        return None
    return fx.GraphModule(gm, graph)


def _put(root: nn.Module, name: str, t: torch.Tensor, kind: str) -> tuple[nn.Module, str]:
    """Register `t` on `root` under the dotted `name` (containers made as needed); (owner, leaf)."""
    owner = root
    *path, leaf = name.split(".")
    for a in path:
        if a not in owner._modules:
            owner.add_module(a, nn.Module())
        nxt = owner._modules[a]
        assert nxt is not None
        owner = nxt
    if kind == "parameter":
        assert isinstance(t, nn.Parameter)
        owner.register_parameter(leaf, t)
    else:
        owner.register_buffer(leaf, t, persistent=kind == "buffer")
    return owner, leaf


def select_output(out: Any, name: str | None) -> Any:
    """What the loss takes of a model's output: `name` (a key or attribute) when given; else `logits` when the
    output has them (a ModelOutput or a dict); else the output itself if a tensor; else its first tensor."""
    if name is not None:
        if isinstance(out, dict) and name in out:
            return out[name]
        if hasattr(out, name) and not isinstance(out, tuple | list):
            return getattr(out, name)
        if name == "loss" and isinstance(out, tuple | list):  # (logits, loss), as nanoGPT returns: its one scalar
            scalars = [t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
            if len(scalars) == 1:
                return scalars[0]
            raise KeyError(f"model.output: the output is a {type(out).__name__} of {len(out)} with "
                           f"{len(scalars)} float scalars: which is the loss? (return a dict with 'loss')")
        have = list(out) if isinstance(out, dict) else [k for k in vars(out) if not k.startswith("_")]
        raise KeyError(f"model.output: the output has no {name!r} (it has {have})")
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    if not isinstance(out, dict | tuple | list) and hasattr(out, "logits"):
        return out.logits
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise KeyError("model.output: the output holds no tensor")
    return leaves[0]


BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)  # where libraries keep their repeated blocks


def repeated_blocks(model: nn.Module) -> str | None:
    """The name of the longest ModuleList, Sequential or ModuleDict (torchtitan's `layers`, keys "0", "1", ...)
    whose children are all of one type (at least 2); its blocks are its children, in its order."""
    best: tuple[int, str] | None = None
    for name, m in model.named_modules():
        if not isinstance(m, BLOCK_CONTAINERS) or m is model:
            continue
        kids = list(m.children())
        if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and (best is None or len(kids) > best[0]):
            best = (len(kids), name)
    return best[1] if best is not None else None


def _dynamic_shapes(sample: Any) -> Any:
    """Dim 0 (batch) and dim 1 (sequence) of every input tensor dynamic; the rest as sampled."""
    def dims(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return None
        return {d: torch.export.Dim.AUTO for d in range(min(t.dim(), 2))}
    if isinstance(sample, dict):
        return {k: pytree.tree_map(dims, v) for k, v in sample.items()}
    return (pytree.tree_map(dims, sample),)


def export(model: nn.Module, sample: Any) -> torch.export.ExportedProgram:
    """torch.export of `model` in training mode on one micro-batch `sample` (a tensor, or a dict of keyword
    inputs), its batch and sequence dimensions dynamic, with torch's own output held back. A refusal is one
    line naming the operation, the user's file and line, and what to do where the forward is to blame
    (gpipe.capture.refusal)."""
    from gpipe.capture import refusal

    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # training keeps no key/value cache (and export cannot return one)
    args, kwargs = ((), dict(sample)) if isinstance(sample, dict) else ((sample,), {})
    with _capturing, refusal.quiet():
        try:
            return torch.export.export(model, args, kwargs, dynamic_shapes=_dynamic_shapes(sample))
        except (MemoryError, OSError, TimeoutError):  # the machine's, not the model's: restarts may help
            raise
        except Exception as e:
            if type(e).__name__ == "OutOfMemoryError":
                raise
            raise CaptureError(refusal.line(model, e)) from None


def _device_of(sample: Any) -> torch.device:
    leaves = [t for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor)]
    return leaves[0].device if leaves else torch.device("cpu")


def _drop_metadata_checks(gm: fx.GraphModule) -> None:
    """Remove the dtype and device checks export wrote about the traced sample (_METADATA_CHECKS), so that a
    piece runs in any precision and on any device (`to_device` replaces the devices it names)."""
    for sub in gm.modules():  # the graph, and those nested in it (a no-grad region's, a higher-order op's)
        if isinstance(sub, fx.GraphModule):
            for n in list(sub.graph.nodes):
                if n.op == "call_function" and n.target in _METADATA_CHECKS and not n.users:
                    sub.graph.erase_node(n)
            sub.recompile()


def _stack(node: fx.Node) -> list[str]:
    return [v[0] for v in node.meta.get("nn_module_stack", {}).values()]


def _check_points(model: nn.Module, points: Sequence[str]) -> None:
    names = [n for n, _ in model.named_modules() if n]
    known = set(names)
    if len(points) > MAX_SPLIT_POINTS:
        raise CaptureError(f"model.split_points: {len(points)} given, at most {MAX_SPLIT_POINTS}")
    for p in points:
        if p not in known:
            near = difflib.get_close_matches(p, names, n=3, cutoff=0.5)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            raise CaptureError(f"model.split_points: {p!r} names no submodule of {type(model).__name__}{hint}")
    if len(set(points)) != len(points):
        raise CaptureError("model.split_points: a name is given twice")


def capture(model: nn.Module, sample: Any, split_points: Sequence[str] = (), output: str | None = None) -> Captured:
    """`model` as pieces: cut before each repeated block but the first, and before each split point. One
    capture at a time in a process (torch.export's tracing state is process-wide)."""
    with _capturing:
        return _capture(model, sample, split_points, output)


def _capture(model: nn.Module, sample: Any, split_points: Sequence[str], output: str | None) -> Captured:
    _check_points(model, split_points)
    blocks = repeated_blocks(model)
    if blocks is None and not split_points:
        raise CaptureError(f"model: {type(model).__name__} has no repeated blocks (a ModuleList, Sequential or "
                           "ModuleDict of same-type modules) to cut at; give model.split_points")
    kids = list(model.get_submodule(blocks).named_children()) if blocks else []
    block_names = [f"{blocks}.{n}" for n, _ in kids]
    ep = export(model, sample)
    gm = ep.module(check_guards=False)  # the batch and sequence sizes differ from the sample's
    _drop_metadata_checks(gm)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]

    def first_node(name: str) -> int:
        prefix = name + "."
        hits = [i for i, n in enumerate(nodes) if any(s == name or s.startswith(prefix) for s in _stack(n))]
        if not hits:
            raise CaptureError(f"model.split_points: {name!r} runs no operation in the captured forward "
                               "(it is not called); cut before a module that is")
        if hits[-1] - hits[0] + 1 != len(hits):  # called twice, or its work interleaved with other modules'
            raise CaptureError(f"model.split_points: {name!r} cannot be cut before: its operations are not "
                               "contiguous in the forward (it is called more than once, or interleaved with "
                               "others); name the module that contains it or one after it")
        return hits[0]

    point_starts = {first_node(p) for p in split_points}
    starts = [s for s in sorted({first_node(b) for b in block_names[1:]} | point_starts) if s > 0]
    where: dict[fx.Node, int] = {}
    piece = 0
    for i, n in enumerate(nodes):
        while piece < len(starts) and i >= starts[piece]:
            piece += 1
        where[n] = piece
    cuts = sorted({starts.index(s) + 1 for s in point_starts if s in starts})
    if split_points and len(cuts) != len(split_points):
        raise CaptureError("model.split_points: the first one must not be the model's first operation")

    def part(n: fx.Node) -> int:
        if n in where:
            return where[n]
        # placeholders and get_attr: in the first piece that uses them (split_module copies get_attr
        # into every piece that reads them, and passes placeholders on)
        return min((where.get(u, 0) for u in n.users), default=0)

    split = _split(gm, part)
    captured = _pieces(model, split, len(starts) + 1, ep, output, _device_of(sample))
    captured.cuts, captured.blocks = cuts, blocks
    captured.block_count, captured.split_points = len(kids), len(split_points)
    captured.block_type = type(kids[0][1]).__name__ if kids else ""
    captured.modules = _modules_of(nodes, where, len(starts) + 1)
    captured.tied = tied_groups(captured.pieces)
    return captured


def _split(gm: fx.GraphModule, part: Any) -> fx.GraphModule:
    from torch.fx.passes.split_module import split_module

    return split_module(gm, gm, part, keep_original_order=True)


def _pieces(model: nn.Module, split: fx.GraphModule, count: int, ep: torch.export.ExportedProgram, output: str | None,
            device: torch.device) -> Captured:
    """The Piece modules of `split` (submod_0, ...), from the dataflow of its top graph."""
    calls: dict[int, fx.Node] = {}
    for n in split.graph.nodes:
        if n.op == "call_module" and n.target.startswith("submod_"):
            calls[int(n.target.split("_")[1])] = n
    if sorted(calls) != list(range(count)):
        raise CaptureError(f"model: the cut gave {len(calls)} pieces, expected {count}; a piece holds no "
                           "operation: move a split point")
    defined: dict[str, int] = {}  # value (top-graph node name) -> piece that makes it; -1: the model's input
    outs: dict[int, list[str]] = {}
    for n in split.graph.nodes:
        if n.op == "placeholder":
            defined[n.name] = -1
        elif n.op == "call_module":
            k = int(n.target.split("_")[1])
            getitems = [u for u in n.users if u.op == "call_function" and u.target is operator.getitem]
            if getitems and len(getitems) == len(n.users):
                ordered = sorted(getitems, key=lambda u: u.args[1])
                outs[k] = [u.name for u in ordered]
                for u in ordered:
                    defined[u.name] = k
            else:
                outs[k] = [n.name]
                defined[n.name] = k
    args = {k: [a.name for a in calls[k].args if isinstance(a, fx.Node)] for k in calls}
    attrs = {n.name: str(n.target) for n in split.graph.nodes if n.op == "get_attr"}
    canonical = {id(t): name for name, t in [*model.named_buffers(), *model.named_parameters()]}
    out_node = next(n for n in split.graph.nodes if n.op == "output")
    finals = [a.name if isinstance(a, fx.Node) else a for a in pytree.tree_leaves(out_node.args[0])]
    placeholders = [n.name for n in split.graph.nodes if n.op == "placeholder"]
    pieces: list[Piece] = []
    crossing: list[list[str]] = []
    carry = placeholders  # what piece 0 receives (flattened from the micro-batch)
    for k in range(count):
        later = [a for j in range(k + 1, count) for a in args[j]] + (finals if k < count - 1 else [])
        live = list(dict.fromkeys(v for v in later if v in defined and defined[v] <= k))
        last = k == count - 1
        emits = finals if last else live
        state = {a: _state_of(model, split, attrs[a], canonical) for a in args[k] if a in attrs}
        pieces.append(Piece(getattr(split, f"submod_{k}"), carry, args[k], outs[k], emits, state,
                            ep.call_spec.in_spec if k == 0 else None, ep.call_spec.out_spec if last else None,
                            output, device))
        if not last:
            crossing.append(live)
        carry = live
    seq = nn.Sequential(*pieces)
    seen = _values(split, calls, outs)
    names = _dim_names(seen, placeholders)
    return Captured(seq, [], None, [], crossing, shapes=[[_describe(seen.get(v), names) for v in live]
                                                         for live in crossing])


def _values(split: fx.GraphModule, calls: dict[int, fx.Node], outs: dict[int, list[str]]) -> dict[str, fx.Node]:
    """Each top-graph value of `split` (a piece's output, the model's input) as the node that made it, with the
    sample's value in its meta."""
    out = {n.name: n for n in split.graph.nodes if n.op == "placeholder"}
    for k in calls:
        ret = next(n for n in getattr(split, f"submod_{k}").graph.nodes if n.op == "output").args[0]
        made = list(ret) if isinstance(ret, tuple | list) else [ret]
        for name, node in zip(outs[k], made, strict=False):
            if isinstance(node, fx.Node):
                out[name] = node
    return out


def _dim_names(seen: dict[str, fx.Node], placeholders: list[str]) -> dict[str, str]:
    """The symbols torch.export gave the inputs' dimensions, named: B for dimension 0 of every input tensor (a
    micro-batch cuts each of them there, so they are one size), T for dimension 1 of the first."""
    names: dict[str, str] = {}
    inputs = [v for p in placeholders if p in seen and isinstance(v := seen[p].meta.get("val"), torch.Tensor)]
    for i, v in enumerate(inputs):
        for d, name in zip(v.shape, "BT" if i == 0 else "B", strict=False):
            if isinstance(d, torch.SymInt) and re.fullmatch(SYMBOL, str(d)):
                names.setdefault(str(d), name)
    return names


SYMBOL = r"\b[su]\d+\b"  # a size torch.export made symbolic: s0 backed by the sample's size, u0 unbacked


def _size(d: object, names: dict[str, str]) -> str:
    """A dimension as a user reads it: a number, B or T (or an expression of them: B*T), else the sample's size
    (the number the symbol stood for when the sample was captured)."""
    text = re.sub(SYMBOL, lambda m: names.get(m.group(0), m.group(0)), str(d))
    if isinstance(d, torch.SymInt) and re.search(SYMBOL, text):
        hint = getattr(d.node, "hint", None)
        if isinstance(hint, int):
            return str(hint)
    return text


def _describe(node: fx.Node | None, names: dict[str, str]) -> str:
    """A value that crosses a cut: its shape (B and T for the input's dimensions, the sample's sizes for the
    rest) and dtype, and the module that made it."""
    if node is None:
        return "?"
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        what = f"[{', '.join(_size(d, names) for d in v.shape)}] {str(v.dtype).removeprefix('torch.')}"
    elif isinstance(v, torch.SymInt | int):
        what = f"size {_size(v, names)}"
    else:
        what = type(v).__name__ if v is not None else "None"
    stack = [m for m in _stack(node) if m and not m.startswith("_")]
    return f"{what} from {stack[-1]}" if stack else what


def _state_of(model: nn.Module, split: fx.GraphModule, target: str,
              canonical: dict[int, str]) -> tuple[str, torch.Tensor, str]:
    """(name, tensor, kind) of what a get_attr reads: a parameter or buffer of the model under its canonical
    name (the first the model's named_parameters() gives it: tied weights have one), kind parameter, buffer or
    transient (not saved); or a constant of the capture's (transient)."""
    owner_name, _, leaf = target.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        owner = None
    if owner is not None and leaf in owner._parameters:
        p = owner._parameters[leaf]
        assert p is not None
        return canonical.get(id(p), target), p, "parameter"
    if owner is not None and leaf in owner._buffers:
        b = owner._buffers[leaf]
        assert b is not None
        kind = "transient" if leaf in owner._non_persistent_buffers_set else "buffer"
        return canonical.get(id(b), target), b, kind
    t = getattr(split.get_submodule(owner_name), leaf)
    assert isinstance(t, torch.Tensor), target
    return f"_gp_constants.{target.replace('.', '_')}", t, "transient"


def _modules_of(nodes: list[fx.Node], where: dict[fx.Node, int], count: int) -> list[list[str]]:
    """Per piece: the submodules whose operations all fall in it, the outermost of them."""
    homes: dict[str, set[int]] = {}
    for n in nodes:
        for s in _stack(n):
            if s and not s.startswith("_"):
                homes.setdefault(s, set()).add(where[n])
    out: list[list[str]] = [[] for _ in range(count)]
    for name, ks in homes.items():
        if len(ks) != 1:
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if parent and homes.get(parent) == ks:
            continue
        out[next(iter(ks))].append(name)
    return out


def tied_groups(layers: nn.Module) -> list[list[str]]:
    """Keys of the parameters that are one tensor under several names ("i.name", in order): each group's first
    key is the canonical one (the name the model's own named_parameters() gives it)."""
    by_id: dict[int, list[str]] = {}
    for name, p in layers.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def to_device(layers: nn.Module, device: torch.device | str) -> None:
    """The pieces in `layers`, made to run on `device`: the device the capture traced on (the meta device on a
    worker, the CPU in a process that captured its own model) is written into operations (arange, to, a
    factory's device=), and becomes `device` in each piece's graphs, nested ones (a no-grad region's) too.
    Call it after moving the parameters (`layers.to(device)`); pieces already there are left alone."""
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    for piece in layers.modules():
        if not isinstance(piece, Piece) or piece._gp_device == target:
            continue
        source = piece._gp_device

        def swap(a: Any, source: torch.device = source) -> Any:
            return target if isinstance(a, torch.device) and a == source else a

        for gm in piece.modules():
            if isinstance(gm, fx.GraphModule):
                for n in gm.graph.nodes:
                    n.args = pytree.tree_map(swap, n.args)
                    n.kwargs = pytree.tree_map(swap, n.kwargs)
                gm.recompile()
        piece._gp_device = target


def retie(layers: nn.Module, groups: Iterable[Sequence[str]]) -> None:
    """Make each group's parameters one tensor again (the first's), for those of `layers` that hold them:
    a module moved with to_empty() or copied has a tensor per name."""
    own = dict(layers.named_parameters(remove_duplicate=False))
    for group in groups:
        held = [k for k in group if k in own]
        if len(held) < 2:
            continue
        first = own[held[0]]
        for k in held[1:]:
            owner, _, leaf = k.rpartition(".")
            setattr(layers.get_submodule(owner), leaf, first)


def sample_signature(sample: Any) -> dict[str, Any]:
    """A micro-batch's structure, shapes and dtypes (JSON-able): what a stage captures the model with, on the
    meta device, without the data. The batch dimension is at least 2 (a dynamic dimension of 1 would be
    specialised)."""
    from gpipe import structure

    skeleton, tensors = structure.flatten(sample)
    shapes = [[max(2, d) if i == 0 else d for i, d in enumerate(t.shape)] for t in tensors]
    return {"skeleton": skeleton, "shapes": shapes, "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors]}


def sample_from(signature: dict[str, Any], device: torch.device | str = "meta") -> Any:
    """A micro-batch of zeros of `signature`'s structure, shapes and dtypes."""
    from gpipe import structure

    tensors = [torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
               for shape, dtype in zip(signature["shapes"], signature["dtypes"], strict=True)]
    return structure.unflatten(signature["skeleton"], tensors)


def balance_of_cuts(cuts: Sequence[int], pieces: int) -> list[int]:
    """Pieces per stage when the stages begin at `cuts` (piece indices, after piece 0)."""
    bounds = [0, *cuts, pieces]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def model_name(key: str) -> str:
    """A piece parameter's key ("3.transformer.h.2.attn.c_attn.weight") under the model's own name."""
    return key.split(".", 1)[1]
